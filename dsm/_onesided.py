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
from ._net import atomic, rdma
from ._region import META, Region, gid_of
from ._requests import FETCH_TIMEOUT

if TYPE_CHECKING:
    from ._memory import Memory


def ardmar(mem: Memory, region: Region, page: int, home: int, need: np.ndarray) -> None:
    """RDMA READ meta, page, meta until both metadata reads agree, show no diff in progress and suffice."""
    n = META + mem.size
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
        if before[0] == before[1] and np.array_equal(before, after) and np.all(before[META:] >= need):
            return
        mem.counters.fetch_retries += 1
        # back off (10 µs doubling to 1 ms): a writer's DRAW chain is in progress on that page
        time.sleep(min(1e-3, 1e-5 * 2 ** min(mem.counters.fetch_retries, 7)))
        if time.monotonic() > deadline:
            raise DsmError(
                f"page {gid_of(region.aid, page):#x}: no consistent copy at rank {home} after {FETCH_TIMEOUT:.0f} s"
            )


def draw(mem: Memory, outgoing: dict[int, list[tuple[Region, int, Diff]]], interval: int) -> None:
    """DRAW: per page, FETCH_ADD started, RDMA WRITE each run, WRITE applied[me], FETCH_ADD finished."""
    lkey = mem.scratch_mr.lkey
    land = (mem.scratch_mr.buf + (len(mem.scratch) - 2) * 8, lkey)
    stamp = (mem.scratch_mr.buf + (len(mem.scratch) - 1) * 8, 8, lkey)
    mem.scratch[-1] = interval
    add = verbs.IBV_WR_ATOMIC_FETCH_AND_ADD
    for home, items in outgoing.items():
        wrs = []
        for region, page, diff in items:
            wrs.append(atomic(add, land, *region.remote_meta(home, page, 0), 1))
            rkey, addr = region.remote_page(home, page)
            for offset, data in diff:
                wrs.append(
                    rdma(verbs.IBV_WR_RDMA_WRITE, region.local_page(page, offset, len(data)), rkey, addr + offset)
                )
                mem.counters.count("rdma_write", len(data))
            wrs.append(rdma(verbs.IBV_WR_RDMA_WRITE, stamp, *region.remote_meta(home, page, META + mem.rank)))
            wrs.append(atomic(add, land, *region.remote_meta(home, page, 1), 1))
            mem.counters.count("fetch_add", 16)
        mem.client.run(home, wrs, mem.seq)
