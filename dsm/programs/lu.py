"""LU factorisation without pivoting (Doolittle, packed in place) of a diagonally dominant shared matrix.

    ckpt launch -n 4 dsm/programs/lu.py [N=96] [BLOCK=8]

The rows are dealt in blocks of BLOCK rows, block b to rank b mod size, which
touches them first (its home; a page that straddles two blocks has two
writers, whose changes go home as diffs).  Step s applies the s-th block
column, columns [k0, k1) with k0 = s * BLOCK: every rank copies the pivot
panel A[k0:k1, k0:] (final since the previous step's barrier) and applies its
columns one by one to its rows below k1: A[i, j] becomes the multiplier
l = A[i, j] / A[j, j] and A[i, j+1:] loses l * A[j, j+1:].  The owner of block
s + 1 then eliminates that block within its own columns (the look-ahead that
makes the next pivot panel final; block 0's is done in setup), and a barrier
ends the step.  Each element sees exactly the divisions and
multiply-subtracts of the sequential elimination, so the packed factors (L
below the diagonal, unit diagonal implied, U on and above it) compare bit for
bit with plain numpy's.  There are ceil(N / BLOCK) steps.
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, verdict

SEED = 11


def matrix(n: int) -> np.ndarray:
    """A random matrix made strictly diagonally dominant (so elimination needs no pivoting)."""
    m = np.random.default_rng(SEED).uniform(-1.0, 1.0, (n, n))
    m[np.diag_indices(n)] = n + np.abs(m.diagonal())
    return m


def eliminate(rows: np.ndarray, pivot: np.ndarray) -> None:
    """Column 0 of `rows` becomes the multipliers; the rest loses multiplier x pivot (pivot[0] is the pivot)."""
    rows[:, 0] /= pivot[0]
    rows[:, 1:] -= rows[:, :1] * pivot[1:]


def factor(rows: np.ndarray) -> None:
    """Eliminate `rows` (r x c, r <= c) in place, one column at a time: their own packed LU factors."""
    for k in range(rows.shape[0] - 1):
        eliminate(rows[k + 1 :, k:], rows[k, k:].copy())


def doolittle(m: np.ndarray) -> np.ndarray:
    """Plain numpy: the packed LU factors of `m` (a copy)."""
    lu = m.copy()
    factor(lu)
    return lu


class LU(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.n, self.block = args(rt, [96, 8])
        if self.block < 1:
            raise ValueError(f"BLOCK must be at least 1, not {self.block}")
        self.mem = dsm.attach(rt)
        self.a = self.mem.array((self.n, self.n))
        m = matrix(self.n)
        for lo, hi in self.blocks(rt, 0):  # each rank first-touches its row blocks: their home
            with self.a.write((slice(lo, hi), slice(None))) as v:
                v[:] = m[lo:hi]
                if lo == 0:
                    factor(v)  # the first pivot panel
        self.mem.barrier()
        self.s = 0
        self.answer: str | None = None

    def blocks(self, rt: ckpt.Runtime, first: int) -> list[tuple[int, int]]:
        """This rank's row blocks [lo, hi) from block `first` on."""
        count = -(-self.n // self.block)
        start = first + (rt.rank - first) % rt.size
        return [(b * self.block, min((b + 1) * self.block, self.n)) for b in range(start, count, rt.size)]

    def step(self, rt: ckpt.Runtime) -> bool:
        k0 = self.s * self.block
        k1 = min(k0 + self.block, self.n)
        panel = self.a[k0:k1, k0:]
        for lo, hi in self.blocks(rt, self.s + 1):
            with self.a.write((slice(lo, hi), slice(k0, None))) as v:
                for j in range(k1 - k0):
                    eliminate(v[:, j:], panel[j, j:])
                if lo == k1:
                    factor(v[:, k1 - k0 :])  # look-ahead: the next pivot panel
        self.mem.barrier()  # block column s is applied everywhere and the next pivot panel is final
        self.s += 1
        if self.s * self.block < self.n:
            return True
        self.answer = verdict("lu", self.a[...], doolittle(matrix(self.n)), exact=True)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
