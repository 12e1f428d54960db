"""Red-black successive over-relaxation on a shared grid (barriers; neighbours' boundary rows are page faults).

    ckpt launch -n 4 dsm/programs/sor.py [N=256] [ITERATIONS=40]

Each rank owns a band of rows and relaxes its red points, then (after a
barrier) its black points; points of one colour depend only on the other
colour, so the parallel sweep computes exactly what one sequential sweep does:
the result compares bit for bit with plain numpy.  One step is one iteration.
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, band, interior, verdict

OMEGA = 1.25


def initial(n: int) -> np.ndarray:
    grid = np.zeros((n, n))
    grid[0, :] = np.linspace(0.0, 1.0, n)
    grid[:, 0] = 1.0
    grid[-1, :] = np.linspace(1.0, 0.0, n)
    return grid


def relax(rows: np.ndarray, first: int, color: int) -> np.ndarray:
    """New values of the interior rows of `rows` (rows[0] and rows[-1] are halos); `first` is rows[1]'s index."""
    inner = rows[1:-1]
    out = inner.copy()
    i = np.arange(first, first + inner.shape[0])[:, None]
    j = np.arange(inner.shape[1])[None, :]
    mask = ((i + j) % 2 == color) & (j > 0) & (j < inner.shape[1] - 1)
    around = np.zeros_like(inner)
    around[:, 1:-1] = rows[:-2, 1:-1] + rows[2:, 1:-1] + inner[:, :-2] + inner[:, 2:]
    out[mask] = (1 - OMEGA) * inner[mask] + OMEGA / 4 * around[mask]
    return out


def sweep(grid: np.ndarray, color: int) -> None:
    grid[1:-1] = relax(grid, 1, color)


class SOR(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.n, self.iterations = args(rt, [256, 40])
        self.mem = dsm.attach(rt)
        self.grid = self.mem.array((self.n, self.n))
        lo, hi = band(self.n, rt.rank, rt.size)
        with self.grid.write((slice(lo, hi), slice(None))) as v:  # each rank first-touches its band: its home
            v[:] = initial(self.n)[lo:hi]
        self.mem.barrier()
        self.it = 0
        self.answer: str | None = None

    def step(self, rt: ckpt.Runtime) -> bool:
        lo, hi = interior(self.n, rt.rank, rt.size)  # the grid's first and last rows are fixed
        for color in (0, 1):
            if lo < hi:
                with self.grid.read((slice(lo - 1, hi + 1), slice(None))) as rows:
                    new = relax(rows, lo, color)
                with self.grid.write((slice(lo, hi), slice(None))) as v:
                    v[:] = new
            self.mem.barrier()
        self.it += 1
        if self.it < self.iterations:
            return True
        want = initial(self.n)
        for _ in range(self.iterations):
            sweep(want, 0)
            sweep(want, 1)
        self.answer = verdict("sor", self.grid[...], want)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
