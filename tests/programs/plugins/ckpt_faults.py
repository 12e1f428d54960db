"""Test plugin: kill -9 its own rank at a chosen point of a chosen checkpoint.

CKPT_TEST_FAULT=<point>:<rank>:<checkpoint number>, point one of
presuspend, drain, image (inside the image write: pickling a bomb),
resume (in ckpt_resume, after the checkpoint was committed),
resumegate (rank R waits in ckpt_resume until the file $CKPT_TEST_GATE exists),
gate (rank 0 waits in precheckpoint until the file $CKPT_TEST_GATE exists),
raise (raise in precheckpoint instead of dying: a failing plugin),
barrier (the other ranks wait in a plugin barrier at drain; this one raises).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import ckpt

CKPT_PLUGIN_API = 2
__version__ = "1.0"


def _armed(rt: ckpt.Runtime, point: str) -> bool:
    spec = os.environ.get("CKPT_TEST_FAULT", "")
    if not spec:
        return False
    want, rank, number = spec.split(":")
    n = rt.options.get("_number", 0)
    return want == point and int(rank) == rt.rank and int(number) == n


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Bomb:
    def __reduce__(self) -> Any:
        _die()
        return (_Bomb, ())


@ckpt.hookimpl
def ckpt_presuspend(rt: ckpt.Runtime) -> None:
    rt.options["_number"] = rt.options.get("_number", 0) + 1
    if _armed(rt, "presuspend"):
        _die()


@ckpt.hookimpl
def ckpt_drain(rt: ckpt.Runtime) -> None:
    if _armed(rt, "drain"):
        _die()
    spec = os.environ.get("CKPT_TEST_FAULT", "")
    if spec.startswith("barrier:") and int(spec.split(":")[2]) == rt.options.get("_number", 0):
        if _armed(rt, "barrier"):
            raise RuntimeError("injected failure before a plugin barrier")
        rt.coordinator_barrier(f"faults:drain{rt.options['_number']}")


@ckpt.hookimpl
def ckpt_precheckpoint(rt: ckpt.Runtime, image: Any) -> None:
    if _armed(rt, "image"):
        image.add("bomb", _Bomb())
    if _armed(rt, "raise"):
        raise RuntimeError("injected failure in precheckpoint")
    if rt.rank == 0 and _armed_any(rt):
        _wait_for_gate()


def _wait_for_gate() -> None:
    gate = os.environ.get("CKPT_TEST_GATE")
    deadline = time.monotonic() + 60
    while gate and not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # polling the test's gate file


@ckpt.hookimpl
def ckpt_resume(rt: ckpt.Runtime, restarted: bool, aborted: bool) -> None:
    if not restarted and not aborted and _armed(rt, "resume"):
        _die()
    if not restarted and not aborted and _armed(rt, "resumegate"):
        _wait_for_gate()


def _armed_any(rt: ckpt.Runtime) -> bool:
    spec = os.environ.get("CKPT_TEST_FAULT", "")
    return bool(spec) and spec.startswith("gate:") and int(spec.split(":")[2]) == rt.options.get("_number", 0)
