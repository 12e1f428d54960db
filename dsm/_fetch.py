"""Page faults: bringing invalid pages from their homes -- one, or every invalid page of one access at once."""

# HLRC (docs/dsm.md): a fault on an invalid page fetches the home's copy, which
# holds at least the intervals this rank's write notices said it must (`need`).
# Under `async` that is a PageRequest to the home's handler; under `onesided` an
# ARDMAR of the home's metadata, page and metadata again (`_onesided`).  The
# pages of one `read()`/`write()` are independent, so their fetches all leave
# before the first reply is waited for (`fetch_many`): one round trip for a
# neighbour's rows, not one per page.  A replaying rank fetches page by page: it
# needs each page as it saw it the first time (minimal versions, `dsm._replay`).

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from . import _onesided
from ._errors import DsmError
from ._messages import OldPageRequest, PageReply, PageRequest, Request
from ._region import VALID, Region, gid_of

if TYPE_CHECKING:
    from ._memory import Memory


def fetch_many(mem: Memory, region: Region, pages: list[int]) -> None:
    """Fetch the invalid `pages` of one access in one round."""
    if len(pages) == 1 or mem.replay is not None:
        for page in pages:
            fetch(mem, region, page)
        return
    mem._check()
    started = time.perf_counter()
    homes = [_home_of_invalid(mem, region, page) for page in pages]
    if mem.protocol == "async":
        requests: list[tuple[int, Request, str]] = []
        for page, home in zip(pages, homes, strict=True):
            gid = gid_of(region.aid, page)
            requests.append(
                (home, PageRequest(mem._next_rid(), gid, region.need[page].tolist()), f"page {gid:#x} from rank {home}")
            )
        for page, reply in zip(pages, mem._request_many(requests, PageReply), strict=True):
            region.program_page(page)[:] = np.frombuffer(reply.data, dtype=np.uint8)
    else:
        for page in _onesided.ardmar_many(mem, region, pages, homes):  # those a diff was landing on: one by one
            _onesided.ardmar(mem, region, page, int(region.home[page]), region.need[page])
    region.state[pages] = VALID
    mem.counters.fetch_rounds += 1
    mem.counters.page_fetches += len(pages)
    mem.counters.page_fetch_seconds += time.perf_counter() - started


def fetch(mem: Memory, region: Region, page: int) -> None:
    """Fetch one invalid page (as the replay needs it, while the rank replays)."""
    mem._check()
    started = time.perf_counter()
    home, gid, need = _home_of_invalid(mem, region, page), gid_of(region.aid, page), region.need[page]
    if mem.replay is not None:  # the page as this rank saw it the first time: the intervals its vt covers
        old = OldPageRequest(mem._next_rid(), gid, list(mem.vt))
        reply = mem._request(home, old, PageReply, f"page {gid:#x} as of {mem.vt} from rank {home}")
        region.program_page(page)[:] = np.frombuffer(reply.data, dtype=np.uint8)
        mem.counters.regenerated_pages += 1
    elif mem.protocol == "async":
        reply = mem._request(
            home, PageRequest(mem._next_rid(), gid, need.tolist()), PageReply, f"page {gid:#x} from rank {home}"
        )
        region.program_page(page)[:] = np.frombuffer(reply.data, dtype=np.uint8)
    else:
        _onesided.ardmar(mem, region, page, home, need)
    region.state[page] = VALID
    mem.counters.fetch_rounds += 1
    mem.counters.page_fetches += 1
    mem.counters.page_fetch_seconds += time.perf_counter() - started


def _home_of_invalid(mem: Memory, region: Region, page: int) -> int:
    home = int(region.home[page])
    if home < 0 or home == mem.rank:
        raise DsmError(f"page {gid_of(region.aid, page):#x} is invalid but its home is {home} (rank {mem.rank})")
    return home
