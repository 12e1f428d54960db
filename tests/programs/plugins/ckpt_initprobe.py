"""Test plugin: records what `ckpt_init` sees (rt.restarted, rt.step) in the file $CKPT_TEST_INIT_LOG."""

from __future__ import annotations

import os

import ckpt

CKPT_PLUGIN_API = 1
__version__ = "1.0"


@ckpt.hookimpl
def ckpt_init(rt: ckpt.Runtime) -> None:
    log = os.environ.get("CKPT_TEST_INIT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"rank={rt.rank} restarted={rt.restarted} step={rt.step}\n")
