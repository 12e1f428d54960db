"""Jacobi relaxation of Laplace's equation on two shared grids (old and new swap every step).

    ckpt launch -n 4 dsm/programs/jacobi.py [N=128] [ITERATIONS=30]

The N x N grid's edges are fixed; every interior point becomes the mean of
its four neighbours in the old grid.  Each rank owns a band of rows of both
grids (it touched them first: it is their home), reads its band of the old
grid plus one halo row either side (the neighbours' boundary rows are page
faults), writes its band of the new grid, and meets the others at a barrier;
then the grids swap.  Every point is computed by the same numpy expression on
the same inputs whatever the split, so the result compares bit for bit with
plain numpy.  One step is one iteration.
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, band, interior, verdict

SEED = 2024


def initial(n: int) -> np.ndarray:
    """Fixed edges (a warm top, a cold bottom, linear sides) around a deterministic random interior."""
    grid = np.random.default_rng(SEED).random((n, n))
    grid[0, :] = 1.0
    grid[-1, :] = 0.0
    grid[:, 0] = np.linspace(1.0, 0.0, n)
    grid[:, -1] = np.linspace(1.0, 0.0, n) ** 2
    return grid


def relax(rows: np.ndarray) -> np.ndarray:
    """New interior values of rows[1:-1] (rows[0] and rows[-1] are halos); the first and last columns are kept."""
    out = rows[1:-1].copy()
    out[:, 1:-1] = 0.25 * (rows[:-2, 1:-1] + rows[2:, 1:-1] + rows[1:-1, :-2] + rows[1:-1, 2:])
    return out


class Jacobi(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.n, self.iterations = args(rt, [128, 30])
        self.mem = dsm.attach(rt)
        self.old = self.mem.array((self.n, self.n))
        self.new = self.mem.array((self.n, self.n))
        lo, hi = band(self.n, rt.rank, rt.size)
        start = initial(self.n)[lo:hi]
        for grid in (self.old, self.new):  # each rank first-touches its band of both grids: its home
            with grid.write((slice(lo, hi), slice(None))) as v:
                v[:] = start  # the new grid's edges are fixed too
        self.mem.barrier()
        self.it = 0
        self.answer: str | None = None

    def step(self, rt: ckpt.Runtime) -> bool:
        lo, hi = interior(self.n, rt.rank, rt.size)  # the grid's first and last rows are fixed
        if lo < hi:
            with self.old.read((slice(lo - 1, hi + 1), slice(None))) as rows:
                fresh = relax(rows)
            with self.new.write((slice(lo, hi), slice(None))) as v:
                v[:] = fresh
        self.mem.barrier()
        self.old, self.new = self.new, self.old
        self.it += 1
        if self.it < self.iterations:
            return True
        want = initial(self.n)
        for _ in range(self.iterations):
            want[1:-1] = relax(want)
        self.answer = verdict("jacobi", self.old[...], want, exact=True)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
