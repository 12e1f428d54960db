"""Asks for its own checkpoints: one during setup (taken at boundary 0), one from inside step 50."""

from __future__ import annotations

import numpy as np

import ckpt


class SelfCheckpoint(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 200
        self.x = np.full(100, rt.rank, dtype=np.float64)
        self.i = 0
        self.numbers = [rt.checkpoint()] if rt.rank == 0 else []

    def step(self, rt: ckpt.Runtime) -> bool:
        neighbours = rt.allgather(float(self.x.mean()))
        self.x = 0.5 * self.x + 0.5 * sum(neighbours) / rt.size + self.i
        if self.i == 50 and rt.rank == rt.size - 1 and not rt.restarted:
            self.numbers.append(rt.checkpoint())
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"{float(self.x.sum()):.6f}"
