"""The one-sided protocol's two operations (NEWGENDSM): ARDMAR page fetches and DRAW diff writes.

They take the rank's `Memory` and are kept apart so the HLRC
state machine in `_memory` reads on its own; the protocol is described there.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ckpt import verbs

from ._diff import Diff
from ._errors import DsmError
from ._net import rdma
from ._region import Region, gid_of
from ._requests import FETCH_TIMEOUT

if TYPE_CHECKING:
    from ._memory import Memory

#: Pages of one access fetched in one round (`ardmar_many`): their metadata pairs land side by side in `scratch`.
FETCH_BATCH = 8


def ardmar(mem: Memory, region: Region, page: int, home: int, need: np.ndarray) -> None:
    """RDMA READ meta, page, meta until both metadata reads agree, show no diff in progress and suffice.

    A diff in progress shows as a negative column (`draw`), which is below every `need` (>= 0).
    """
    n = mem.size
    base, lkey = mem.scratch_mr.buf, mem.scratch_mr.lkey
    deadline = time.monotonic() + FETCH_TIMEOUT

    def reads() -> list[verbs.SendWR]:  # the home's addresses as of this issue (they change if it is recovered)
        meta = region.remote_meta(home, page)
        return [
            rdma(verbs.IBV_WR_RDMA_READ, (base, n * 8, lkey), *meta),
            rdma(verbs.IBV_WR_RDMA_READ, region.local_page(page), *region.remote_page(home, page)),
            rdma(verbs.IBV_WR_RDMA_READ, (base + n * 8, n * 8, lkey), *meta),
        ]

    while True:
        mem.client.run(home, reads, mem.seq)
        mem.counters.count("rdma_read", 2 * n * 8 + mem.page_size)
        before, after = mem.scratch[:n], mem.scratch[n : 2 * n]
        if np.array_equal(before, after) and np.all(before >= need):
            return
        mem.counters.fetch_retries += 1
        # back off (10 µs doubling to 1 ms): a writer's DRAW chain is in progress on that page
        time.sleep(min(1e-3, 1e-5 * 2 ** min(mem.counters.fetch_retries, 7)))
        if time.monotonic() > deadline:
            busy = ", ".join(f"rank {w}'s diff of interval {-i}" for w, i in enumerate(after.tolist()) if i < 0)
            raise DsmError(
                f"page {gid_of(region.aid, page):#x}: no consistent copy at rank {home} after {FETCH_TIMEOUT:.0f} s"
                + (f" ({busy} still in progress)" if busy else f" (it holds {after.tolist()}, {need.tolist()} needed)")
            )


def ardmar_many(mem: Memory, region: Region, pages: list[int], homes: list[int]) -> list[int]:
    """ARDMAR of several pages of one region at once: per home, the three READs of each page in one chain (RC
    executes one QP's READs in order, so each page's metadata-page-metadata order holds), one wait per chain.

    Returns the pages whose two metadata reads disagree, show a diff in progress or do not suffice: the caller
    fetches those one by one (`ardmar`, with its back-off).  An image taken before the scratch area held
    FETCH_BATCH pairs batches what fits.
    """
    n = mem.size
    slots = max(1, (len(mem.scratch) - 3) // (2 * n))
    base, lkey = mem.scratch_mr.buf, mem.scratch_mr.lkey
    by_home: dict[int, list[int]] = {}
    for page, home in zip(pages, homes, strict=True):
        by_home.setdefault(home, []).append(page)
    again: list[int] = []
    for home, mine in by_home.items():
        for start in range(0, len(mine), slots):
            chunk = mine[start : start + slots]

            def reads(chunk: list[int] = chunk, home: int = home) -> list[verbs.SendWR]:
                wrs = []
                for i, page in enumerate(chunk):
                    meta = region.remote_meta(home, page)
                    at = base + 2 * n * i * 8
                    wrs.append(rdma(verbs.IBV_WR_RDMA_READ, (at, n * 8, lkey), *meta))
                    wrs.append(rdma(verbs.IBV_WR_RDMA_READ, region.local_page(page), *region.remote_page(home, page)))
                    wrs.append(rdma(verbs.IBV_WR_RDMA_READ, (at + n * 8, n * 8, lkey), *meta))
                return wrs

            mem.client.run(home, reads, mem.seq)
            mem.counters.count("rdma_read", len(chunk) * (2 * n * 8 + mem.page_size))
            for i, page in enumerate(chunk):
                before, after = mem.scratch[2 * n * i : 2 * n * i + n], mem.scratch[2 * n * i + n : 2 * n * (i + 1)]
                if not (np.array_equal(before, after) and np.all(before >= region.need[page])):
                    again.append(page)
    return again


def draw(mem: Memory, outgoing: dict[int, list[tuple[Region, int, Diff]]], interval: int) -> None:
    """DRAW: per page, RDMA WRITE -interval into this writer's column, each run, then interval.

    The column is the writer's own seqlock: only it writes it, so a plain WRITE does what the
    paper's FETCH_AND_ADDs on shared counters do, and a writer that dies half-way leaves its mark
    on its own column -- its next incarnation re-executes the interval and DRAWs it again, which
    clears the mark (shared counters would stay unequal for good, every reader retrying forever).
    RC executes one QP's WRITEs in order, so a reader that sees no negative column and the same
    columns before and after its page read saw no partial diff.
    """
    lkey = mem.scratch_mr.lkey
    mem.scratch[-3], mem.scratch[-1] = -interval, interval
    opening = (mem.scratch_mr.buf + (len(mem.scratch) - 3) * 8, 8, lkey)
    closing = (mem.scratch_mr.buf + (len(mem.scratch) - 1) * 8, 8, lkey)
    for home, items in outgoing.items():
        wrs = []
        for region, page, diff in items:
            column = region.remote_meta(home, page, mem.rank)
            wrs.append(rdma(verbs.IBV_WR_RDMA_WRITE, opening, *column))
            rkey, addr = region.remote_page(home, page)
            for offset, length in zip(diff.offsets.tolist(), diff.lengths.tolist(), strict=True):
                wrs.append(rdma(verbs.IBV_WR_RDMA_WRITE, region.local_page(page, offset, length), rkey, addr + offset))
                mem.counters.count("rdma_write", length)
            wrs.append(rdma(verbs.IBV_WR_RDMA_WRITE, closing, *column))
            mem.counters.count("stamp", 16)  # the two column WRITEs
        mem.client.run(home, wrs, mem.seq)
