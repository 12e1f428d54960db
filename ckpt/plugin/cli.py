"""Helpers for plugins that add `ckpt` commands (ckpt_cli_commands): the ckpt dir's default, serving, pids."""

# Imported only by a plugin's command module (it needs click), never by ckpt.plugin itself, so
# ranks and the fast commands do not pay for it.  The same helpers the core's commands use, so a
# plugin's command behaves as theirs do (`ckpt fabric start --foreground` as `ckpt coordinator`).

from ckpt._cli_common import DEFAULT_CKPT_DIR, default_ckpt_dir, serve_until_signal
from ckpt._jobdir import process_exists

__all__ = ["DEFAULT_CKPT_DIR", "default_ckpt_dir", "process_exists", "serve_until_signal"]
