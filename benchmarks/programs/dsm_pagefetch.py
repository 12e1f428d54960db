"""The page-fetch microbenchmark of the NEWGENDSM paper (after TreadMarks'): time to fetch one page from its home.

    ckpt launch -n 4 [--dsm-protocol async|onesided] benchmarks/programs/dsm_pagefetch.py [PAGES=1024] [REPEAT=1]

Rank 0 (the master) writes every page of a PAGES-page array first, so it is
their home; after a barrier the other ranks, all at once, read one word from
each page: every read is a page fault served by the master.  Each reader times
its loop; its result is `us_per_page=<mean µs per page fetch>,fetches=<n>` (the
master reports `master`).  With REPEAT > 1 the master rewrites the pages and
the readers fetch them again, REPEAT times, one step each.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt
import dsm

WORDS = 512  # float64 words per 4 KiB page


class PageFetch(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        given = [int(a) for a in rt.argv]
        self.pages, self.repeat = (given + [1024, 1][len(given) :])[:2]
        self.mem = dsm.attach(rt)
        self.data = self.mem.array(self.pages * WORDS, np.float64)
        self.round = 0
        self.seconds = 0.0
        self.fetched = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        if rt.rank == 0:
            with self.data.write() as v:
                v[::WORDS] = self.round + 1  # one word per page: every page written, the master its home
        self.mem.barrier()
        if rt.rank != 0:
            started = time.perf_counter()
            total = 0.0
            for page in range(self.pages):
                total += float(self.data[page * WORDS])
            self.seconds += time.perf_counter() - started
            self.fetched += self.pages
            assert total == self.pages * (self.round + 1), total
        self.mem.barrier()
        self.round += 1
        return self.round < self.repeat

    def result(self) -> str:
        if self.fetched == 0:
            return "master"
        return f"us_per_page={self.seconds / self.fetched * 1e6:.3f},fetches={self.fetched}"
