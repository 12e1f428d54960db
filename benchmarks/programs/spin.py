"""A compute-bound step for overhead measurements: busy-wait WORK_MS, an allgather every EVERY steps.

    ckpt launch [--native] -n 2 benchmarks/programs/spin.py [STEPS] [WORK_MS] [EVERY]

Defaults: 2000 steps of 1.0 ms, an allgather in every step.  The program times
its own step loop with `time.perf_counter()` (from the start of its first step
to the end of its last), so process start-up, joining and setup are excluded,
and `result()` is the mean wall time of one step in seconds.  Setup ends with
an `rt.barrier()`, so that the ranks enter their first step together and the
first allgather does not absorb the ranks' start-up skew (tens of ms, which
would add tens of µs to every step of a short run).  The timing is only
meaningful for an uninterrupted run (a restart resets the clock).
"""

from __future__ import annotations

import time

import ckpt


class Spin(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 2000
        self.work = (float(rt.argv[1]) if len(rt.argv) > 1 else 1.0) / 1000
        self.every = int(rt.argv[2]) if len(rt.argv) > 2 else 1
        self.i = 0
        self.first = 0.0
        self.last = 0.0
        rt.barrier()

    def step(self, rt: ckpt.Runtime) -> bool:
        now = time.perf_counter()
        if self.i == 0:
            self.first = now
        deadline = now + self.work
        while time.perf_counter() < deadline:
            pass
        if self.i % self.every == 0:
            values = rt.allgather(self.i)
            if values != [self.i] * rt.size:
                raise RuntimeError(f"allgather in step {self.i} returned {values}")
        self.i += 1
        if self.i < self.steps:
            return True
        self.last = time.perf_counter()
        return False

    def result(self) -> str:
        return f"{(self.last - self.first) / self.steps:.9f}"
