"""dsm._intervals: a release leaves with its interval's diffs, a grantee that homes a page they change waits for
them, and pages the lock's home homes ride with the grant."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("protocol", dsm.HLRC)]
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
        diffs = dsm._handler.Handler._diffs

        def slow_diff(self: Any, src: int, *args: Any) -> None:
            if src == 2:
                land.wait(10)
            diffs(self, src, *args)

        monkeypatch.setattr(dsm._handler.Handler, "_diffs", slow_diff)
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
    assert results[0] == (42, 1), results[0]  # one grant waited (its polls are not counted)


def two_pages_homed_at_rank_0(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
    """An int64 array of two pages that rank 0 touches first (so homes), and a lock homed there too (lock 0)."""
    a = mem.array(2 * DOUBLES, np.int64)
    lock = mem.lock()
    if rt.rank == 0:
        a[0] = a[DOUBLES] = 1
    mem.barrier()
    return a, lock


def written_under_the_lock_then_read(mem: dsm.Memory, rt: ThreadRuntime, written: threading.Event) -> Any:
    """Rank 0 writes both pages under the lock; rank 1 then reads them under it: (values, its statistics)."""
    a, lock = two_pages_homed_at_rank_0(mem, rt)
    seen = None
    if rt.rank == 0:
        with lock:
            a[1], a[DOUBLES + 1] = 7, 8
        written.set()
    else:
        assert written.wait(10)
        with lock:
            seen = (int(a[1]), int(a[DOUBLES + 1]))
    stats = mem.statistics()
    mem.barrier()
    return seen, stats


def test_pages_the_lock_home_homes_ride_with_the_grant_and_are_not_fetched(protocol: str) -> None:
    written = threading.Event()
    _, (seen, stats) = run_ranks(2, lambda mem, rt: written_under_the_lock_then_read(mem, rt, written), protocol)
    assert seen == (7, 8)
    assert stats.grant_pages == 2 and stats.page_fetches == 0, stats


def test_a_page_that_rides_without_what_the_grantee_needs_is_fetched(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock's home sends copies that claim to hold nothing (applied all zero): the grantee must not take
    them for the version its notices ask for, and fetches both pages."""
    import dsm._handler

    riders = dsm._handler.Handler._riders

    def stale(self: Any, src: int, notices: Any) -> list[list[Any]]:
        return [[gid, [0] * self.mem.size, bytes(len(data))] for gid, _, data in riders(self, src, notices)]

    monkeypatch.setattr(dsm._handler.Handler, "_riders", stale)
    written = threading.Event()
    _, (seen, stats) = run_ranks(2, lambda mem, rt: written_under_the_lock_then_read(mem, rt, written), protocol)
    assert seen == (7, 8)
    assert stats.grant_pages == 0 and stats.page_fetches == 2, stats


def test_pages_ride_when_releases_wait_for_their_diffs_too(protocol: str) -> None:
    """Under remote logging (``release_after_diffs``) too: a copy holds what the grantee needs, or is not taken."""
    written = threading.Event()

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        mem.release_after_diffs = True
        return written_under_the_lock_then_read(mem, rt, written)

    _, (seen, stats) = run_ranks(2, body, protocol)
    assert seen == (7, 8)
    assert stats.grant_pages == 2 and stats.page_fetches == 0, stats


def test_a_page_a_draw_is_writing_does_not_ride(protocol: str) -> None:
    """A copy whose applied column shows a diff in progress (negative, as DRAW leaves it) is left out."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a, _ = two_pages_homed_at_rank_0(mem, rt)
        found = None
        if rt.rank == 0:
            region, gid = a._region, dsm._region.gid_of(a._region.aid, 1)
            notices = [[1, 5, [gid, 0]]]
            with mem.handler.mutex:
                region.meta[1, 1] = -5
                drawing = mem.handler._riders(1, notices)
                region.meta[1, 1] = 5
                done = mem.handler._riders(1, notices)
                region.meta[1, 1] = 0
            found = (drawing, [(g, applied[1]) for g, applied, _ in done])
        mem.barrier()
        return found

    drawing, done = run_ranks(2, body, protocol)[0]
    assert drawing == [] and done == [(dsm._region.gid_of(0, 1), 5)]


def test_a_release_whose_draw_fails_is_not_kept_pending(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under onesided the release leaves before the DRAW: if the DRAW raises, the release is given up like any
    request nobody waits for (never sent again after a reconnection).  Under async nothing is drawn."""
    import dsm._onesided
    from dsm._messages import ReleaseRequest

    def broken(mem: dsm.Memory, *args: Any) -> None:
        raise dsm.DsmError("the link broke mid-DRAW")

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a, lock = two_pages_homed_at_rank_0(mem, rt)
        failed = None
        if rt.rank == 1:
            lock.acquire()
            a[1] = 7
            with monkeypatch.context() as patch:
                patch.setattr(dsm._onesided, "draw", broken)
                try:
                    lock.release()
                except dsm.DsmError as exc:
                    failed = str(exc)
            kept = [req for _, req, _ in mem.pending.values() if isinstance(req, ReleaseRequest)]
            return failed, kept
        return None

    failed, kept = run_ranks(2, body, protocol)[1]
    if protocol == "onesided":
        assert failed == "the link broke mid-DRAW" and kept == []
    else:
        assert failed is None and kept == []
