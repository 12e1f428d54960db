"""A DSM program of dsm/programs, chosen by $CKPT_TEST_DSM_PROGRAM, that a test can pause mid-run and hold at its end.

    CKPT_TEST_DSM_PROGRAM=sor ckpt launch -n 4 tests/programs/dsm_held.py [ARGS of sor.py]

* $CKPT_TEST_PAUSE_AT="10,20" with $CKPT_TEST_PAUSE=PREFIX: before its 10th
  (then 20th) real step each rank idles until the file PREFIX.10 exists; rank 0
  first creates PREFIX.10.reached.  A test checkpoints there, so the
  checkpoint is mid-run however fast the program is.
* $CKPT_TEST_HOLD (`ib_common.held`): once done, ranks idle until that file exists.

Idle steps do no collective and change no state, so the result is the
program's.  A restart needs the same $CKPT_TEST_DSM_PROGRAM (the image names
this file's class).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ib_common import held

import ckpt
from dsm.programs import program_class

PROGRAM_ENV, PAUSE_ENV, PAUSE_AT_ENV = "CKPT_TEST_DSM_PROGRAM", "CKPT_TEST_PAUSE", "CKPT_TEST_PAUSE_AT"

_base = program_class(os.environ[PROGRAM_ENV])


def _paused(real_steps: int, rank: int) -> bool:
    prefix, at = os.environ.get(PAUSE_ENV), os.environ.get(PAUSE_AT_ENV, "")
    if not prefix or str(real_steps) not in at.split(","):
        return False
    gate = Path(f"{prefix}.{real_steps}")
    if gate.exists():
        return False
    if rank == 0:
        Path(f"{gate}.reached").touch()
    time.sleep(0.005)  # idle: nothing to do until the test opens the gate
    return True


def _pausable(self: object, rt: ckpt.Runtime) -> bool:
    real = int(getattr(self, "_real_steps", 0))
    if _paused(real, rt.rank):
        return True
    self._real_steps = real + 1  # type: ignore[attr-defined]
    more: bool = _base.step(self, rt)
    return more


class Held(_base):  # type: ignore[valid-type,misc]
    step = held(_pausable)
