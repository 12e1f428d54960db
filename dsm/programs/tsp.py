"""Branch-and-bound travelling salesman (the TreadMarks TSP): a shared task queue and a global bound under locks.

    ckpt launch -n 4 dsm/programs/tsp.py [CITIES=9] [DEPTH=3] [POPS=8]

The cities (random integer points, rounded Euclidean distances) are the same
on every rank.  Tasks are partial tours from city 0, kept in a shared queue (a
table of rows with head and tail counters, and a count of tasks in progress)
under the queue lock; the best tour so far and its length, the bound, are
shared under the bound lock.  A step pops up to POPS tasks, one at a time:
a partial tour shorter than DEPTH cities is expanded into the children whose
lower bound beats the best so far, pushed back under the lock; a longer one is
solved by depth-first search, pruned by the bound, which is published under
the bound lock whenever the search improves it.  Every step ends at a barrier;
after it the ranks read the queue, and when it is empty with no task in
progress all of them stop at that step (a second barrier keeps anyone from
popping before everybody has looked).  Which rank solves what depends on
timing, the optimal length does not: it compares exactly with a Held-Karp
dynamic program in plain numpy (the tours may differ when there are ties).
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, verdict

SEED = 3
INFINITY = 2**62
HEAD, TAIL, ACTIVE = 0, 1, 2  # the queue's counters; a queue row is [cities in the tour, its length, cities...]


def distances(cities: int) -> np.ndarray:
    xy = np.random.default_rng(SEED).integers(0, 1000, (cities, 2))
    delta = xy[:, None, :] - xy[None, :, :]
    d: np.ndarray = np.rint(np.hypot(delta[..., 0], delta[..., 1])).astype(np.int64)
    return d


def capacity(cities: int, depth: int) -> int:
    """Rows the queue needs: every partial tour of 1..depth cities from city 0 is pushed at most once."""
    total, count = 0, 1
    for d in range(1, depth + 1):
        total += count
        count *= cities - d
    return total


def held_karp(d: np.ndarray) -> int:
    """Plain numpy: the optimal tour length (dp[mask, j]: the shortest path from 0 through `mask`, ending at j)."""
    n = d.shape[0]
    if n == 1:
        return 0
    m = n - 1
    dp = np.full((1 << m, m), INFINITY, dtype=np.int64)
    dp[1 << np.arange(m), np.arange(m)] = d[0, 1:]
    inner = d[1:, 1:]
    for mask in range(1, 1 << m):
        ends = [j for j in range(m) if mask >> j & 1]
        if len(ends) < 2:
            continue
        for j in ends:
            prev = dp[mask ^ (1 << j)]
            dp[mask, j] = np.min(prev + inner[:, j])
    return int(np.min(dp[-1] + d[1:, 0]))


class TSP(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.cities, self.depth, self.pops = args(rt, [9, 3, 8])
        if self.cities < 2 or not 1 <= self.depth <= self.cities or self.pops < 1:
            raise ValueError("tsp needs CITIES >= 2, 1 <= DEPTH <= CITIES and POPS >= 1")
        self.d = distances(self.cities)
        self.cheapest = np.array([min(int(v) for k, v in enumerate(row) if k != i) for i, row in enumerate(self.d)])
        self.mem = dsm.attach(rt)
        self.queue = self.mem.array((capacity(self.cities, self.depth), self.cities + 2), np.int64)
        self.counters = self.mem.array(3, np.int64)
        self.best = self.mem.array(self.cities + 1, np.int64)  # [length, tour...]
        self.queue_lock = self.mem.lock()
        self.best_lock = self.mem.lock()
        if rt.rank == 0:
            self.queue[0] = [1, 0] + [0] * self.cities  # the tour that is just city 0
            self.counters[...] = [0, 1, 0]
            self.best[...] = [INFINITY] + [0] * self.cities
        self.mem.barrier()
        self.steps = 0
        self.bound = INFINITY
        self.answer: str | None = None

    # ------------------------------------------------------------------ bounds
    def lower_bound(self, length: int, last: int, left: list[int]) -> int:
        """Every city still to leave (the last one and the unvisited ones) leaves by at least its cheapest edge."""
        return length + int(self.cheapest[last]) + sum(int(self.cheapest[c]) for c in left)

    def refresh(self) -> None:
        """This rank's copy of the bound (stale is safe: it only prunes less) takes the shared one."""
        with self.best_lock:
            self.bound = int(self.best[0])

    def offer(self, length: int, tour: list[int]) -> None:
        """Publish a tour if it beats the shared best; the bound becomes the best after that."""
        with self.best_lock:
            self.bound = int(self.best[0])
            if length < self.bound:
                self.best[...] = [length, *tour]
                self.bound = length

    # ------------------------------------------------------------------ tasks
    def pop(self) -> np.ndarray | None:
        with self.queue_lock:
            head, tail, active = (int(x) for x in self.counters[...])
            if head == tail:
                return None
            row: np.ndarray = self.queue[head]
            self.counters[...] = [head + 1, tail, active + 1]
        return row

    def finish(self, children: list[list[int]]) -> None:
        with self.queue_lock:
            head, tail, active = (int(x) for x in self.counters[...])
            if children:
                self.queue[tail : tail + len(children)] = np.array(children, dtype=np.int64)
            self.counters[...] = [head, tail + len(children), active - 1]

    def expand(self, tour: list[int], length: int) -> list[list[int]]:
        children = []
        last = tour[-1]
        left = [c for c in range(self.cities) if c not in tour]
        for c in left:
            rest = [x for x in left if x != c]
            child = length + int(self.d[last, c])
            if self.lower_bound(child, c, rest) < self.bound:
                children.append([len(tour) + 1, child, *tour, c] + [0] * (self.cities - len(tour) - 1))
        return children

    def search(self, tour: list[int], length: int, left: list[int]) -> None:
        """Depth first through the completions of `tour`, pruned by the bound."""
        last = tour[-1]
        if not left:
            total = length + int(self.d[last, 0])
            if total < self.bound:
                self.offer(total, tour)
            return
        if self.lower_bound(length, last, left) >= self.bound:
            return
        for c in left:
            tour.append(c)
            self.search(tour, length + int(self.d[last, c]), [x for x in left if x != c])
            tour.pop()

    # ------------------------------------------------------------------ steps
    def step(self, rt: ckpt.Runtime) -> bool:
        self.refresh()
        for _ in range(self.pops):
            row = self.pop()
            if row is None:
                break
            size, length = int(row[0]), int(row[1])
            tour = [int(c) for c in row[2 : 2 + size]]
            if size < self.depth:
                self.finish(self.expand(tour, length))
            else:
                self.search(tour, length, [c for c in range(self.cities) if c not in tour])
                self.finish([])
        self.mem.barrier()  # every pop and push of this step is visible
        head, tail, active = (int(x) for x in self.counters[...])
        self.mem.barrier()  # everybody has looked before anybody pops again
        self.steps += 1
        if head < tail or active > 0:
            return True
        length, tour = int(self.best[0]), [int(c) for c in self.best[1:]]
        if sorted(tour) != list(range(self.cities)) or tour[0] != 0:
            length = -1
        elif sum(int(self.d[a, b]) for a, b in zip(tour, tour[1:] + tour[:1], strict=True)) != length:
            length = -2
        want = held_karp(self.d)
        self.answer = verdict("tsp", np.array([length]), np.array([want]), exact=True)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
