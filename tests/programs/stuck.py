"""Rank 1 spends a long time inside one step without any collective (a slow, not a broken, step)."""

from __future__ import annotations

import time

import ckpt


class Stuck(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.long = float(rt.argv[0]) if rt.argv else 6.0
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        rt.barrier()
        if rt.rank == 1 and self.i == 10:
            time.sleep(self.long)
        time.sleep(0.01)
        self.i += 1
        return self.i < 40

    def result(self) -> int:
        return self.i
