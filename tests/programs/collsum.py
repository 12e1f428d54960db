"""Runtime collectives only, for single-rank recovery: each step local numpy work, an allgather of a partial
sum and, every few steps, a barrier.  Deterministic: the results depend on every rank's every step.

argv: [STEPS] [DELAY] [SETUP]: STEPS steps (default 150), each sleeping DELAY seconds (default 0.01) of
"work"; setup takes SETUP seconds more (default 0), so a test can kill a rank before the first checkpoint.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt


class CollSum(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 150
        self.delay = float(rt.argv[1]) if len(rt.argv) > 1 else 0.01
        time.sleep(float(rt.argv[2]) if len(rt.argv) > 2 else 0.0)
        seeds = rt.allgather(rt.rank * 7919 + 17)
        self.x = np.random.default_rng(sum(seeds) + rt.rank).integers(0, 1_000_003, 512, dtype=np.int64)
        self.total = 0
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        self.x = (self.x * 48271 + self.i + rt.rank) % 1_000_003  # the local work
        time.sleep(self.delay)
        partials = rt.allgather(int(self.x[self.i % self.x.size]))
        self.total = (self.total * 31 + sum(p * (r + 1) for r, p in enumerate(partials))) % 1_000_000_007
        self.x[(self.i * 7) % self.x.size] ^= self.total % 65536
        if self.i % 5 == 4:
            rt.barrier()
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"{self.i}:{self.total}:{int(self.x.sum())}"
