"""Test plugin: records what `ckpt_init` sees (rt.restarted, rt.step, its option) in $CKPT_TEST_INIT_LOG.

Its option `--initprobe-tag` (default "untagged") must reach `rt.options` on every launch and restart,
also when the plugin is loaded for the first time at a restart.  With $CKPT_TEST_SLOW_EXIT set, its
`ckpt_exit` takes that many seconds (a plugin with slow clean-up: the launcher reaps its ranks late).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ckpt

CKPT_PLUGIN_API = 2
__version__ = "1.0"


@ckpt.hookimpl
def ckpt_add_options() -> list[dict[str, Any]]:
    return [{"name": "initprobe-tag", "help": "A word ckpt_init writes to the log.", "default": "untagged"}]


@ckpt.hookimpl
def ckpt_init(rt: ckpt.Runtime) -> None:
    log = os.environ.get("CKPT_TEST_INIT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"rank={rt.rank} restarted={rt.restarted} step={rt.step} tag={rt.options['initprobe_tag']}\n")


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    slow = float(os.environ.get("CKPT_TEST_SLOW_EXIT", "0"))
    if slow:
        time.sleep(slow)  # simulated clean-up work, not event ordering
