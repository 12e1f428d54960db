"""Ranks that never wait for each other: no collective after setup, so one rank parked in an independent
checkpoint cannot hold the others back (they keep stepping: what the tests observe)."""

from __future__ import annotations

import time

import numpy as np

import ckpt


class Solo(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 300
        self.delay = float(rt.argv[1]) if len(rt.argv) > 1 else 0.01
        self.x = np.arange(512, dtype=np.int64) * (rt.rank + 3)
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        self.x = (self.x * 31 + self.i) % 1_000_003
        time.sleep(self.delay)  # the step's work
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"{self.i}:{int(self.x.sum())}"
