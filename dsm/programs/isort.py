"""Integer sort (the TreadMarks/SPLASH IS kernel): private histograms merged into shared bucket counts under a lock.

    ckpt launch -n 4 dsm/programs/isort.py [KEYS=4096] [MAXKEY=256] [ITERATIONS=4]

KEYS integers in [0, MAXKEY) are sorted ITERATIONS times, one iteration per
step.  Each rank owns (is the home of) a band of the key array and of the
sorted output.  An iteration: each rank counts the keys of its band into a
private histogram and, under the one lock, reads the shared bucket counts (how
many keys of each value the ranks before it in lock order hold) and adds its
histogram in; barrier; every rank reads the totals, whose exclusive prefix sum
is where each value's run starts in the output, and writes its keys into its
part of each run (scattered writes into pages of every rank: multiple writers,
diffs); barrier.  Keys of one value are equal, so the output does not depend
on the lock order.  The next iteration's keys are a hash of the sorted output
and the position (each rank rewrites its own band), so every iteration's sort
feeds the last one, which compares bit for bit with the same chain of
np.sort calls in plain numpy.
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, band, verdict

SEED = 5


def initial(keys: int, maxkey: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, maxkey, keys, dtype=np.int64)


def next_keys(sorted_keys: np.ndarray, first: int, iteration: int, maxkey: int) -> np.ndarray:
    """The next iteration's keys at positions first, first + 1, ... from the sorted keys there (any band split)."""
    i = np.arange(first, first + sorted_keys.shape[0], dtype=np.int64)
    x = sorted_keys * 2654435761 + i * 40503 + iteration * 97  # < 2**63 for keys and MAXKEY < 2**30
    x ^= x >> 13
    keys: np.ndarray = x % maxkey
    return keys


def reference(keys: int, maxkey: int, iterations: int) -> np.ndarray:
    """Plain numpy: the last iteration's sorted keys."""
    k = initial(keys, maxkey)
    s = np.sort(k)
    for it in range(1, iterations):
        s = np.sort(next_keys(s, 0, it, maxkey))
    return s


def positions(mine: np.ndarray, start: np.ndarray, before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where this rank's keys go: run start of the value + keys of that value before this rank + index in own run."""
    k = np.sort(mine)
    within = np.arange(k.shape[0], dtype=np.int64) - np.searchsorted(k, k, side="left")
    return start[k] + before[k] + within, k


class ISort(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.nkeys, self.maxkey, self.iterations = args(rt, [4096, 256, 4])
        if not 1 <= self.maxkey < 2**30 or self.nkeys < 1 or self.iterations < 1:
            raise ValueError("isort needs KEYS >= 1, 1 <= MAXKEY < 2**30 and ITERATIONS >= 1")
        self.mem = dsm.attach(rt)
        self.keys = self.mem.array(self.nkeys, np.int64)
        self.out = self.mem.array(self.nkeys, np.int64)
        self.buckets = self.mem.array((2, self.maxkey), np.int64)  # iteration parity: one in use, one being zeroed
        self.lock = self.mem.lock()
        lo, hi = band(self.nkeys, rt.rank, rt.size)
        if lo < hi:  # each rank first-touches its band of keys and output: its home
            with self.keys.write(slice(lo, hi)) as v:
                v[:] = initial(self.nkeys, self.maxkey)[lo:hi]
            with self.out.write(slice(lo, hi)) as v:
                v[:] = 0
        if rt.rank == 0:
            with self.buckets.write(...) as v:
                v[:] = 0
        self.mem.barrier()
        self.it = 0
        self.answer: str | None = None

    def step(self, rt: ckpt.Runtime) -> bool:
        lo, hi = band(self.nkeys, rt.rank, rt.size)
        parity = self.it % 2
        mine = self.keys[lo:hi]
        hist = np.bincount(mine, minlength=self.maxkey).astype(np.int64)
        with self.lock:
            with self.buckets.write(parity) as v:
                before = v.copy()  # keys of each value that ranks earlier in lock order hold
                v += hist
        self.mem.barrier()  # every histogram is in
        totals = self.buckets[parity]
        start = np.concatenate(([0], np.cumsum(totals)[:-1])).astype(np.int64)
        where, values = positions(mine, start, before)
        if where.size:
            self.out[where] = values
        if rt.rank == 0:  # nobody reads or adds to the other parity's counts until the next barrier
            with self.buckets.write(1 - parity) as v:
                v[:] = 0
        self.mem.barrier()  # the output is complete
        self.it += 1
        if self.it < self.iterations:
            if lo < hi:
                new = next_keys(self.out[lo:hi], lo, self.it, self.maxkey)
                with self.keys.write(slice(lo, hi)) as v:  # read only by this rank, at the next step
                    v[:] = new
            return True
        want = reference(self.nkeys, self.maxkey, self.iterations)
        self.answer = verdict("isort", self.out[...], want, exact=True)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
