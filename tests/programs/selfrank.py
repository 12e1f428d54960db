"""Asks for independent checkpoints from inside a rank (rt.checkpoint_rank): rank 0 asks for rank 2's at step 20,
and for a rank that does not exist, which is refused with one line it keeps as its result."""

from __future__ import annotations

import time

import numpy as np

import ckpt


class SelfRank(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.x = np.arange(64, dtype=np.int64) + rt.rank
        self.i = 0
        self.asked: list[str] = []
        rt.barrier()  # every rank has joined: the request below starts at once (its number, not 0 = queued)

    def step(self, rt: ckpt.Runtime) -> bool:
        self.x = (self.x * 7 + self.i) % 10_007
        if rt.rank == 0 and self.i == 20:
            self.asked.append(str(rt.checkpoint_rank(2)))
            try:
                rt.checkpoint_rank(rt.size)
            except ckpt.CoordinatorError as exc:
                self.asked.append(str(exc))
        time.sleep(0.01)  # the step's work
        self.i += 1
        return self.i < 80

    def result(self) -> str:
        return f"{int(self.x.sum())} {self.asked}"
