"""Test plugin: hold one rank inside an independent checkpoint, and write down the flags every hook saw.

CKPT_TEST_HOLD_RANK=<rank>: that rank's ckpt_drain of an independent checkpoint waits until the file
$CKPT_TEST_GATE exists (so a test can watch the other ranks step meanwhile).
CKPT_TEST_HOOKLOG=<dir>: each rank appends "<hook> <independent>" lines to <dir>/hooks.<rank>.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ckpt

CKPT_PLUGIN_API = 2
__version__ = "1.0"


def _note(rt: ckpt.Runtime, hook: str, independent: bool) -> None:
    directory = os.environ.get("CKPT_TEST_HOOKLOG")
    if directory:
        with open(Path(directory) / f"hooks.{rt.rank}", "a") as log:
            log.write(f"{hook} {independent}\n")


@ckpt.hookimpl
def ckpt_presuspend(rt: ckpt.Runtime, independent: bool) -> None:
    _note(rt, "presuspend", independent)


@ckpt.hookimpl
def ckpt_drain(rt: ckpt.Runtime, independent: bool) -> None:
    _note(rt, "drain", independent)
    if independent and os.environ.get("CKPT_TEST_HOLD_RANK") == str(rt.rank):
        gate = Path(os.environ["CKPT_TEST_GATE"])
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the test's gate file


@ckpt.hookimpl
def ckpt_precheckpoint(rt: ckpt.Runtime, image: Any, independent: bool) -> None:
    _note(rt, "precheckpoint", independent)


@ckpt.hookimpl
def ckpt_checkpointed(rt: ckpt.Runtime, info: dict[str, Any]) -> None:
    _note(rt, "checkpointed", bool(info["independent"]))


@ckpt.hookimpl
def ckpt_resume(rt: ckpt.Runtime, restarted: bool, aborted: bool, independent: bool) -> None:
    _note(rt, "resume", independent)
