"""dsm._intervals: a release leaves with its interval's diffs, and a grantee that homes a page they change waits."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("protocol", dsm.PROTOCOLS)]
DOUBLES = 512  # int64 per 4 KiB page


def test_a_release_leaves_with_its_diffs_and_a_home_granted_before_they_land_waits_for_them(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2 writes a page rank 0 homes, under a lock rank 1 homes; its diff is held back (at the home's handler
    under async, at the writer's DRAW under onesided) until rank 0, acquiring next, finds it missing.  The release
    must not wait for the diff (else rank 0's grant never comes while the diff is held), and rank 0 must wait for
    it before it reads its own page (else it reads 0: the diff is held 0.2 s more).  The hold gives up after 10 s,
    so neither fault hangs."""
    import dsm._handler
    import dsm._onesided

    land = threading.Event()  # the held diff may go on
    holding = threading.Event()  # rank 2 holds the lock: rank 0 queues behind it
    behind: list[bool] = []  # rank 0's _await_diffs: was its copy behind the notice?

    if protocol == "async":
        diff = dsm._handler.Handler._diff

        def slow_diff(self: Any, src: int, *args: Any) -> None:
            if src == 2:
                land.wait(10)
            diff(self, src, *args)

        monkeypatch.setattr(dsm._handler.Handler, "_diff", slow_diff)
    else:
        draw = dsm._onesided.draw

        def slow_draw(mem: dsm.Memory, *args: Any) -> None:
            if mem.rank == 2:
                land.wait(10)
            draw(mem, *args)

        monkeypatch.setattr(dsm._onesided, "draw", slow_draw)
    await_diffs = dsm.Memory._await_diffs

    def watched(self: dsm.Memory, pages: Any, source: str) -> None:
        behind.append(any(int(region.meta[page, q]) < i for region, page, q, i in pages))
        later = threading.Timer(0.2, land.set)  # still held when rank 0 would read, were it not to wait
        later.start()
        await_diffs(self, pages, source)
        later.join()

    monkeypatch.setattr(dsm.Memory, "_await_diffs", watched)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.int64)
        _, lock = mem.lock(), mem.lock()  # the second is homed at rank 1
        if rt.rank == 0:
            a[0] = 1  # first touch: rank 0 homes the page
        mem.barrier()
        seen = None
        if rt.rank == 2:
            with lock:
                holding.set()
                a[5] = 42
        elif rt.rank == 0:
            assert holding.wait(10)
            with lock:
                seen = int(a[5])
        mem.barrier()
        return seen, mem.statistics().diff_waits

    results = run_ranks(3, body, protocol)
    assert behind == [True], "rank 0's grant did not come before rank 2's diff: the release waited for it"
    assert results[0] == (42, results[0][1]) and results[0][1] >= 1, results[0]
