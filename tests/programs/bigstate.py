"""128 MB of numpy state, replaced by a new array every step (as `self.u = self.u + ...` does)."""

from __future__ import annotations

import time

import numpy as np

import ckpt


class BigState(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        megabytes = int(rt.argv[0]) if rt.argv else 128
        self.steps = int(rt.argv[1]) if len(rt.argv) > 1 else 1_000_000
        self.state = np.arange(megabytes << 17, dtype=np.int64)  # touched: all of it is resident
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        self.state = self.state + 1  # a new array: the previous one is garbage unless something pins it
        time.sleep(0.1)  # pacing: a step allocates 128 MB, and the machine has other work
        self.i += 1
        return self.i < self.steps

    def result(self) -> int:
        return int(self.state[-1])
