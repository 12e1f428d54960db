"""Estimate pi by Monte Carlo on N ranks: local samples each step, an allgather of the counts.

Uses nothing but runtime collectives, so it can run under ``--on-failure recover``
with the verbs plugin disabled: kill -9 any rank and the launcher respawns it from
its own latest image while the others keep running; the answer is the same.

    ckpt launch -n 4 --on-failure recover --disable-plugin ib examples/montecarlo.py 400

argv: [STEPS] [SAMPLES]: STEPS steps (default 400) of SAMPLES points per rank (default 100000).
Each step's points come from a generator seeded by (rank, step), so the result does not
depend on where a rank was restarted from.
"""

from __future__ import annotations

import numpy as np

import ckpt


class MonteCarlo(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 400
        self.samples = int(rt.argv[1]) if len(rt.argv) > 1 else 100_000
        self.inside = 0  # points in the quarter circle, over every rank and step so far
        self.total = 0
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        rng = np.random.default_rng([rt.rank, self.i])
        x, y = rng.random(self.samples), rng.random(self.samples)
        counts = rt.allgather(int(np.count_nonzero(x * x + y * y <= 1.0)))
        self.inside += sum(counts)
        self.total += self.samples * rt.size
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"pi ~ {4 * self.inside / self.total:.6f} from {self.total} points"
