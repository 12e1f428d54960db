"""A program whose collectives are NOT step-aligned (rank 1 runs one allgather ahead of rank 0).

It completes fine on its own; a checkpoint request must be aborted with a clear
message (never a hang), after which the program still finishes normally.
"""

from __future__ import annotations

import time

import ckpt


class Misaligned(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 200
        self.delay = float(rt.argv[1]) if len(rt.argv) > 1 else 0.01
        self.total = 0
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        if rt.rank == 0:
            calls = 1
        else:
            calls = 2 if self.i == 0 else 0 if self.i == self.steps - 1 else 1
        for _ in range(calls):
            self.total += sum(rt.allgather(self.i))
        time.sleep(self.delay)
        self.i += 1
        return self.i < self.steps

    def result(self) -> int:
        return self.total
