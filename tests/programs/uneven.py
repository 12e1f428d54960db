"""Ranks of very different lengths: rank r runs 60 * (r + 1) steps (of 10 ms, 20 for rank 2), so early ranks
finish first and must still take part in checkpoints (and restarts) until the last rank is done."""

from __future__ import annotations

import time

import numpy as np

import ckpt


class Uneven(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        seeds = rt.allgather(rt.rank * 7 + 1)
        self.x = np.random.default_rng(sum(seeds) + rt.rank).random(256)
        self.steps = 60 * (rt.rank + 1)
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        self.x = np.sin(self.x * 1.7 + self.i)
        time.sleep(0.02 if rt.rank == 2 else 0.01)  # rank 0 ends ~3 s before rank 2: time for a checkpoint
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"{self.i}:{float(self.x.sum()):.10f}"
