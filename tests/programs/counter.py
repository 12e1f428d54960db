"""A minimal program for the fault tests: numpy state, one allgather per step, a slow step.

argv: [STEPS] [DELAY] [DELAY_AFTER_RESTART]: STEPS steps (default 100), each sleeping DELAY seconds (default
0.01), or DELAY_AFTER_RESTART seconds in a restarted process (default DELAY): a test that needs a long run only
until it has checkpointed and killed it finishes the restart quickly.  The result does not depend on either.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt


class Counter(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 100
        self.delay = float(rt.argv[1]) if len(rt.argv) > 1 else 0.01
        self.delay_after_restart = float(rt.argv[2]) if len(rt.argv) > 2 else self.delay
        self.state = np.arange(1000, dtype=np.int64) * (rt.rank + 1)
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        total = sum(rt.allgather(int(self.state.sum() % 1_000_003)))
        self.state = (self.state * 31 + total + self.i) % 1_000_003
        time.sleep(self.delay_after_restart if rt.restarted else self.delay)
        self.i += 1
        return self.i < self.steps

    def result(self) -> int:
        return int(self.state.sum())
