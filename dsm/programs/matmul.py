"""Dense matrix product C = A @ B on shared matrices, one k-panel per step (remote panels of B are page faults).

    ckpt launch -n 4 dsm/programs/matmul.py [N=128] [PANEL=16]

A, B and C are N x N; each rank owns (is the home of) a band of rows of all
three.  Step s adds A[band, K] @ B[K, :] to the rank's band of C, where K is
the s-th panel of PANEL columns of A (rows of B): B's panel is mostly other
ranks' rows, fetched from their homes.  The last step ends with a barrier,
after which every rank sees all of C.  A and B hold small integers (as
float64), so every partial sum is exact whatever the order of accumulation:
the product compares bit for bit with plain numpy's A @ B.
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, band, verdict

SEED = 7


def inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A and B: integers in [-4, 4] as float64 (|any partial sum| <= 16 n, exactly representable)."""
    rng = np.random.default_rng(SEED)
    return rng.integers(-4, 5, (n, n)).astype(np.float64), rng.integers(-4, 5, (n, n)).astype(np.float64)


class MatMul(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.n, self.panel = args(rt, [128, 16])
        if self.panel < 1:
            raise ValueError(f"PANEL must be at least 1, not {self.panel}")
        self.mem = dsm.attach(rt)
        self.a = self.mem.array((self.n, self.n))
        self.b = self.mem.array((self.n, self.n))
        self.c = self.mem.array((self.n, self.n))
        lo, hi = band(self.n, rt.rank, rt.size)
        a, b = inputs(self.n)
        rows = (slice(lo, hi), slice(None))
        for shared, value in ((self.a, a[lo:hi]), (self.b, b[lo:hi]), (self.c, 0.0)):
            with shared.write(rows) as v:  # each rank first-touches its band of A, B and C: its home
                v[:] = value
        self.mem.barrier()
        self.k = 0
        self.answer: str | None = None

    def step(self, rt: ckpt.Runtime) -> bool:
        lo, hi = band(self.n, rt.rank, rt.size)
        k0, k1 = self.k, min(self.k + self.panel, self.n)
        if lo < hi and k0 < k1:
            a_panel = self.a[lo:hi, k0:k1]
            b_panel = self.b[k0:k1, :]
            with self.c.write((slice(lo, hi), slice(None))) as v:
                v += a_panel @ b_panel
        self.k = k1
        if self.k < self.n:
            return True
        self.mem.barrier()  # the last step only: every rank's band of C is complete
        a, b = inputs(self.n)
        self.answer = verdict("matmul", self.c[...], a @ b, exact=True)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
