"""examples/ring.py with its step wrapped by `ib_common.held`, and its WORK_US slept instead of computed.

    ckpt launch -n 4 tests/programs/ib_ring.py [STEPS] [WORK_US]

Without $CKPT_TEST_HOLD and $CKPT_TEST_PAUSE_AT it runs the example's steps
(`ib_common.held`, `ib_common.pausable`).  WORK_US paces every step as the
example's does, but by sleeping: the tests use it so that their checkpoints
fall mid-run, and the example's numpy work would take the CPU every other test
of the suite runs on (the suite is CPU-bound).  Neither changes the result.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from ib_common import held, pausable
from ring import Ring

import ckpt


def _paced(step: Callable[[Ring, ckpt.Runtime], bool]) -> Callable[[Ring, ckpt.Runtime], bool]:
    def run(self: Ring, rt: ckpt.Runtime) -> bool:
        if self.pace:
            time.sleep(self.pace)
        return step(self, rt)

    return run


class HeldRing(Ring):
    def setup(self, rt: ckpt.Runtime) -> None:
        super().setup(rt)
        self.pace, self.work = self.work, 0.0  # WORK_US: a sleep, not the example's numpy work

    step = held(pausable(_paced(Ring.step)))
