"""A 1-D heat equation split across ranks: numpy state, an allgather of halo values every step.

    ckpt launch -n 4 examples/heat.py [STEPS] [CELLS_PER_RANK] [WORK_MS] [spin|sleep]

Every rank owns a slice of the rod; each step it trades its edge cells with
its neighbours through `rt.allgather`, relaxes its slice, and (optionally)
spins for WORK_MS milliseconds of extra compute -- or, with `sleep`, waits
that long and leaves the CPU to others (a slow step that costs nothing: the
test suite's jobs share two cores).  The result is a checksum of the rank's
slice, identical for an uninterrupted run and for any sequence of checkpoint /
kill / restart, and whatever WORK_MS and its mode.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt


class Heat(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 200
        cells = int(rt.argv[1]) if len(rt.argv) > 1 else 1000
        self.work = float(rt.argv[2]) / 1000 if len(rt.argv) > 2 else 0.0
        self.sleep = len(rt.argv) > 3 and rt.argv[3] == "sleep"
        if len(rt.argv) > 3 and rt.argv[3] not in ("spin", "sleep"):
            raise ValueError(f"heat.py: the 4th argument is spin or sleep, not {rt.argv[3]!r}")
        rng = np.random.default_rng(rt.rank)
        self.u = rng.random(cells)
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        edges = rt.allgather((float(self.u[0]), float(self.u[-1])))
        left = edges[rt.rank - 1][1] if rt.rank > 0 else self.u[0]
        right = edges[rt.rank + 1][0] if rt.rank + 1 < rt.size else self.u[-1]
        padded = np.concatenate(([left], self.u, [right]))
        self.u = self.u + 0.25 * (padded[:-2] - 2 * self.u + padded[2:])
        if self.work and self.sleep:
            time.sleep(self.work)  # the step's stand-in for compute that leaves the CPU free (see the docstring)
        elif self.work:
            deadline = time.perf_counter() + self.work
            while time.perf_counter() < deadline:
                pass
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"{float(self.u.sum()):.12f}"
