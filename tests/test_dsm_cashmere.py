"""Unit tests of the Cashmere protocol (dsm._cashmere, dsm._mcs) on thread-ranks: what is its own.

The memory model's tests run under it too (test_dsm_memory, EVERY), and so do the
programs (test_dsm_programs) and a checkpoint -> kill -> restart (test_e2e_dsm).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime, wait_for
from dsm import DsmError
from dsm import _cashmere as cashmere
from dsm._mcs import NEXT, NODE_WORDS, NODES, NOTICE_TAIL
from dsm._net import Endpoint
from dsm._region import INVALID

pytestmark = pytest.mark.timeout(60)
DOUBLES = 512  # float64 per 4 KiB page


def test_the_home_does_no_work_for_a_remote_fault_lock_or_write_through() -> None:
    """Rank 0 is the home of a page and of lock 0, then does nothing while ranks 1-3 copy the page, take the lock
    in turn and write through to it: rank 0's counters stay still, it has no thread, and its copy has their writes."""
    done = threading.Barrier(4)

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        lock = mem.lock()  # lock 0: its tail is at rank 0
        if rt.rank == 0:
            a[0] = 0.0  # first touch: rank 0 is the page's home
        mem.barrier()
        before = mem.statistics().as_dict(), mem.control.atomics, mem.server.notifications, len(mem.server.inbox)
        if rt.rank:
            for _ in range(5):
                with lock, a.write(slice(rt.rank, rt.rank + 1)) as v:
                    v += 1
        threads = [t.name for t in threading.enumerate() if t.name.startswith("dsm")]
        done.wait(30)  # ranks 1-3 are through: their write-throughs landed before their last release
        after = mem.statistics().as_dict(), mem.control.atomics, mem.server.notifications, len(mem.server.inbox)
        mine = None
        if rt.rank == 0:
            with a.read(...) as view:
                mine = view.copy()
        mem.barrier()
        return before, after, threads, mine

    results = run_ranks(4, body, "cashmere")
    (before, after, threads, mine), others = results[0], results[1:]
    moving = {"total_seconds", "compute_seconds"}
    assert {k: v for k, v in after[0].items() if k not in moving} == {
        k: v for k, v in before[0].items() if k not in moving
    }
    assert after[1:] == before[1:]  # no atomics of its own, no notification, no message
    assert threads == []  # no handler thread, on any rank
    assert mine is not None and mine[1:4].tolist() == [5.0, 5.0, 5.0]  # their writes are in its copy
    for stats in (o[1][0] for o in others):
        assert stats["page_fetches"] >= 1 and stats["write_throughs"] == 5 and stats["pages_served"] == 0


def test_a_write_through_forwards_only_the_elements_a_block_changed_inside_the_pages_seqlock() -> None:
    """Rank 1's block covers eight elements and changes two: the home's other six keep the home's own values, and
    the page's seqlock counts one write-through done and none in progress."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        if rt.rank == 0:
            a[0] = 0.0  # home
        mem.barrier()
        if rt.rank == 1:
            with a.write(slice(0, 8)) as v:  # its copy: zeros
                v[2], v[5] = 2.0, 5.0
        mem.barrier()
        if rt.rank == 0:
            region = a._region
            seqlock = region.directory[0, cashmere.BUSY : cashmere.ROW]
            return region.data[:64].view(np.float64).tolist(), seqlock.tolist()
        return mem.statistics().write_through_bytes

    results = run_ranks(2, body, "cashmere")
    assert results[0][0] == [0.0, 0.0, 2.0, 0.0, 0.0, 5.0, 0.0, 0.0]
    assert results[0][1] == [0, 1]  # BUSY back to 0, DONE counted once
    assert results[1] == 16


def test_a_copy_that_overlaps_a_write_through_is_taken_again_until_none_is_in_progress() -> None:
    """The home shows a write-through in progress (BUSY) on a half-written page: rank 1's copy waits, and takes
    the page once the write-through is done -- never the torn page."""
    shared: dict[str, Any] = {}

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        region = a._region
        if rt.rank == 0:
            a[0] = 0.0
            region.directory[0, cashmere.BUSY] = 1
            region.data[: 8 * DOUBLES // 2].view(np.float64)[:] = 1.0  # half of it
        mem.barrier()
        if rt.rank == 1:
            shared["mem"] = mem
            page = a[...]
            return page.min(), page.max(), mem.statistics().fetch_retries
        wait_for(lambda: "mem" in shared and shared["mem"].counters.fetch_retries > 0, 10, "a copy taken again")
        region.data.view(np.float64)[:DOUBLES] = 1.0  # the rest of it,
        region.directory[0, cashmere.DONE] += 1  # done,
        region.directory[0, cashmere.BUSY] = 0  # and no longer in progress
        return None

    low, high, retries = run_ranks(2, body, "cashmere")[1]
    assert (low, high) == (1.0, 1.0)
    assert retries >= 1


def test_a_release_notices_the_readers_and_their_next_acquire_drops_the_copy() -> None:
    """Rank 2 holds a copy; rank 1 writes the page under a lock: its release posts a notice to rank 2, whose next
    acquire drops the copy and reads rank 1's value."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        lock = mem.lock()
        if rt.rank == 0:
            assert a[0] == 0.0  # first touch by a read: rank 0 is the home, and writes nothing (the page is Shared)
        mem.barrier()
        if rt.rank == 2:
            assert a[3] == 0.0  # a copy: rank 2 joins the page's readers
        mem.barrier()
        if rt.rank == 1:
            with lock:
                a[3] = 7.0
        mem.barrier()  # an acquire too: rank 2 drops its copy at its exit, or at the lock's acquire below
        if rt.rank == 2:
            with lock:
                return a[3], mem.statistics()
        return mem.statistics()

    results = run_ranks(3, body, "cashmere")
    seen, reader = results[2]
    assert seen == 7.0
    assert results[1].notices_sent >= 1
    assert reader.notices_processed >= 1 and reader.self_invalidations >= 1
    assert results[0].notices_sent == 0  # the home wrote nothing after the first touch


def test_a_page_joined_while_another_rank_writes_it_is_dropped_at_the_next_acquire() -> None:
    """Rank 1 writes the page and releases (its notices are out: processed); rank 2 copies it afterwards, so it
    joins a Weak page; rank 1 writes again -- no notice, the page is processed -- and rank 2's next acquire still
    drops its copy and sees the new value."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        lock = mem.lock()
        if rt.rank == 0:
            a[0] = 0.0
        mem.barrier()
        if rt.rank == 1:
            with lock:
                a[1] = 1.0
        mem.barrier()
        if rt.rank == 2:
            first = a[1]  # joins while rank 1 is a writer
        mem.barrier()
        if rt.rank == 1:
            sent = mem.statistics().notices_sent
            with lock:
                a[1] = 2.0
            return mem.statistics().notices_sent - sent
        mem.barrier()
        if rt.rank == 2:
            with lock:
                return first, a[1]
        return None

    def body_with_barriers(mem: Any, rt: ThreadRuntime) -> Any:
        out = body(mem, rt)
        if rt.rank == 1:
            mem.barrier()
        return out

    results = run_ranks(3, body_with_barriers, "cashmere")
    assert results[1] == 0  # the second release sent no notice
    assert results[2] == (1.0, 2.0)


def test_an_overrun_notice_list_drops_every_copy_at_the_next_acquire() -> None:
    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(4 * DOUBLES, np.float64)
        lock = mem.lock()
        if rt.rank == 0:
            with a.write(...) as v:
                v[:] = 1.0
        mem.barrier()
        if rt.rank == 1:
            total = float(np.sum(a[...]))  # copies of the four pages
            mem.control.words[NOTICE_TAIL] = mem.notice_head + cashmere.NOTICE_SLOTS + 1  # as if overwritten
            with lock:
                pass
            return total, mem.statistics().self_invalidations, int(np.sum(a._region.state != 0))
        return None

    total, dropped, valid = run_ranks(2, body, "cashmere")[1]
    assert total == 4 * DOUBLES and dropped == 4 and valid == 0


def test_refusals_are_one_clear_error_each() -> None:
    def body(mem: Any, rt: ThreadRuntime) -> Any:
        mem.nlocks = cashmere.MAX_LOCKS
        with pytest.raises(DsmError, match="room for 1024 locks"):
            mem.lock()
        return True

    assert run_ranks(1, body, "cashmere") == [True]
    rt = type("Rt", (), {"rank": 0, "size": 2, "options": {"logging": "remote"}, "device": "simib0"})()
    with pytest.raises(DsmError, match="--logging remote needs an HLRC protocol"):
        dsm.attach(rt, "cashmere")
    with pytest.raises(DsmError, match="fill policy"):
        cashmere.Cashmere(rt, 4096, fill="ecc")


def test_a_line_fill_brings_the_lines_an_access_touches_and_keeps_them_until_the_page_is_dropped() -> None:
    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        lock = mem.lock()
        if rt.rank == 0:
            with a.write(...) as v:
                v[:] = np.arange(DOUBLES)  # home, and Shared: rank 1 joins no Weak page below
        mem.barrier()
        counts = []

        def lines_for(index: Any) -> int:
            before = mem.statistics().line_fills
            a[index]
            return mem.statistics().line_fills - before

        if rt.rank == 1:
            counts += [lines_for(slice(0, 8)), lines_for(slice(0, 8)), lines_for(slice(4, 24)), lines_for(100)]
            region = a._region
            local = region.data.view(np.float64)
            counts.append(local[:24].tolist() == list(range(24)) and not local[200])  # line 25 never came
        mem.barrier()
        if rt.rank == 0:
            with lock:
                a[1] = -1.0
        mem.barrier()  # rank 1 drops the page at its exit (a notice)
        if rt.rank == 1:
            counts += [lines_for(slice(0, 8)), a[1]]
        return counts

    counts = run_ranks(2, body, "cashmere", fill="line")[1]
    # one line; none again; the two after it; one more; the page's other lines stayed at home
    assert counts[:5] == [1, 0, 2, 1, True]
    assert counts[5:] == [1, -1.0]  # dropped at the barrier: the line came again, with the new value


def test_the_line_fill_is_cashmeres_only() -> None:
    rt = type("Rt", (), {"rank": 0, "size": 1, "options": {}, "device": "simib0"})()
    with pytest.raises(DsmError, match="the 'line' fill is the cashmere protocol's: onesided copies whole pages"):
        dsm.attach(rt, "onesided", fill="line")


class _Lapping:
    """A rank's control words, with a full lap of other ranks' notices landing right after the tail is read (the
    list overruns while it is being read)."""

    def __init__(self, words: np.ndarray, fake_gid: int) -> None:
        self.words, self.fake_gid, self.fired = words, fake_gid, False

    def __getitem__(self, key: Any) -> Any:
        value = self.words[key]
        if key == NOTICE_TAIL and not self.fired:
            self.fired = True
            tail = int(value)
            for index in range(tail, tail + cashmere.NOTICE_SLOTS):
                at = cashmere.NOTICES + 2 * (index % cashmere.NOTICE_SLOTS)
                self.words[at], self.words[at + 1] = self.fake_gid, index + 1
            self.words[NOTICE_TAIL] = tail + cashmere.NOTICE_SLOTS
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self.words[key] = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.words, name)


def test_a_notice_overwritten_while_the_list_is_read_still_drops_the_copy() -> None:
    """Rank 0's release leaves a notice in rank 1's list; while rank 1's acquire reads the list, a lap of other
    notices overwrites it: the tail read again shows the overrun, and rank 1 drops every copy -- it reads 7."""
    released, left = threading.Event(), threading.Event()

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(2 * DOUBLES, np.float64)  # page 0: the data; page 1: what the lapping notices name
        lock = mem.lock()
        if rt.rank == 0:
            assert a[0] == 0.0 and a[DOUBLES] == 0.0  # home of both, by reads: they stay Shared
        mem.barrier()
        if rt.rank == 1:
            assert a[0] == 0.0  # a copy of page 0
        mem.barrier()
        if rt.rank == 1:
            left.set()  # out of the barrier (whose exit would take the notice)
        if rt.rank == 0:
            assert left.wait(30)
            with lock:
                a[0] = 7.0  # a notice to rank 1
            released.set()
            return None
        assert released.wait(30)
        real = mem.control.words
        mem.control.words = _Lapping(real, 1)  # (array 0, page 1)
        try:
            with lock:
                return a[0]
        finally:
            mem.control.words = real

    assert run_ranks(2, body, "cashmere")[1] == 7.0


def test_a_holder_that_never_waits_still_gives_its_receives_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """One receive per peer for notifications: rank 0 takes the lock free and hands it to rank 1 without waiting,
    round after round, holding it longer than rank 1's one-sided operations may wait.  Rank 1's links (WRITE WITH
    IMM) find a receive every time only because rank 0 reaps at its every acquire and release."""
    monkeypatch.setattr(cashmere, "NOTIFY_RECVS", 1)
    monkeypatch.setattr(Endpoint.wait, "__defaults__", (1.0, None, True, None))  # 120 s -> 1 s
    rounds, hold = 3, 1.5
    turn = [threading.Event() for _ in range(rounds)]
    back = [threading.Event() for _ in range(rounds)]

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        lock = mem.lock()
        mem.barrier()
        node = NODES + 0 * NODE_WORDS  # lock 0's queue node
        for i in range(rounds):
            if rt.rank == 0:
                lock.acquire()  # free: no wait
                turn[i].set()
                wait_for(lambda: bool(mem.control.words[node + NEXT]), 10, "rank 1 in line")
                holding = threading.Event()
                holding.wait(hold)  # a long critical section
                lock.release()  # rank 1 is next: handed over without a wait
                assert back[i].wait(30)
            else:
                assert turn[i].wait(30)
                try:
                    lock.acquire()
                except DsmError as exc:
                    return f"round {i}: {exc}"
                lock.release()
                back[i].set()
        return "ok"

    assert run_ranks(2, body, "cashmere") == ["ok", "ok"]


def test_a_writer_that_dropped_its_copy_before_its_release_notices_its_next_write_too() -> None:
    """Rank 1 writes page 0, then drops its copy at an acquire before its release (it joined a Weak page: rank 2
    writes it).  The release still processes the page -- processed = True -- while rank 1 holds no copy, and only
    a drop clears that bit.  Rank 2 drops, the row empties (writers &= readers | home), rank 2 copies the page
    afresh, rank 1 copies it again and writes it: its release must add it to the writers and notice rank 2,
    or rank 2's acquire keeps a copy without rank 1's write."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        lock = mem.lock()
        if rt.rank == 0:
            assert a[0] == 0.0  # home, by a read
        mem.barrier()  # 1
        if rt.rank == 2:
            a[5] = 5.0  # rank 2: a reader and, from its release on, a writer
        mem.barrier()  # 2
        if rt.rank == 1:
            a[0] = 1.0  # joins a Weak page: stale
            with lock:  # the acquire drops the copy; the release processes the page (notice to rank 2)
                pass
            assert a._region.state[0] == INVALID and a._region.processed[0]  # no copy, yet processed
        mem.barrier()  # 3: rank 2 drops its copy (the notice); the row is empty again
        if rt.rank == 2:
            assert a[0] == 1.0  # a fresh copy: Shared, not stale
        mem.barrier()  # 4
        if rt.rank == 1:
            a[1] = 2.0  # a copy again, and a write: the release below must notice rank 2
        mem.barrier()  # 5
        return float(a[1]) if rt.rank == 2 else None

    assert run_ranks(3, body, "cashmere")[2] == 2.0


def made_unsafe(mem: Any, rt: ThreadRuntime, home: int, readers: tuple[int, int]) -> tuple[Any, Any]:
    """Under --dsm-unsafe 2, over three barriers: `home` homes the array's first page, `readers` copy it, and rank 1
    writes it under the lock, so its release notices both readers and marks the page unsafe.  (The array, the lock.)"""
    a = mem.array(DOUBLES, np.float64)
    lock = mem.lock()
    if rt.rank == home:
        assert a[0] == 0.0  # home, by a read
    mem.barrier()
    if rt.rank in readers:
        assert a[1] == 0.0
    mem.barrier()
    if rt.rank == 1:
        with lock:
            a[1] = 1.0
    mem.barrier()
    return a, lock


def test_a_writer_that_drops_an_unsafe_page_stays_a_writer_for_the_holders_that_check_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race CI found: rank 1 holds an unsafe page and rank 2 has written it.  At the barrier's exit rank 2
    drops its copy (rank 1 writes the page too) *before* rank 1 checks the page's row.  Rank 2 must still be in
    the writers then (the page stays Weak while it is shared), or rank 1 keeps its copy without rank 2's write."""
    dropped = threading.Event()
    real = cashmere.Cashmere._self_invalidate

    def ordered(self: Any) -> None:
        if self.rank == 1 and self.epoch == 4:
            assert dropped.wait(30)  # rank 2 has dropped its copy: now rank 1 checks
        real(self)
        if self.rank == 2 and self.epoch == 4:
            dropped.set()

    monkeypatch.setattr(cashmere.Cashmere, "_self_invalidate", ordered)

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a, lock = made_unsafe(mem, rt, 0, (2, 3))
        if rt.rank == 2:
            with lock:
                a[2] = 2.0  # no notice: the page is unsafe
        mem.barrier()  # epoch 4
        return float(a[2]) if rt.rank == 1 else None

    assert run_ranks(4, body, "cashmere", unsafe=2)[1] == 2.0


def test_rank_0_dropping_an_unsafe_page_leaves_it_unsafe() -> None:
    """Leaving a row's sets is per set: rank 0's bit (1) is also the value of the row's unsafe mark, which a drop
    by rank 0 must not clear."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        made_unsafe(mem, rt, 3, (0, 2))  # ranks 0 and 2 drop their copies at its last barrier
        mem.barrier()
        return [int(x) for x in mem.regions[0].directory[0, cashmere.FIRST : cashmere.BUSY]] if rt.rank == 3 else None

    readers, writers, noticed, unsafe = run_ranks(4, body, "cashmere", unsafe=2)[3]
    assert unsafe == 1 and readers & 0b101 == 0 and writers == 0b10 and noticed & 0b101 == 0


def test_an_unsafe_page_sends_notices_once_and_its_holders_check_its_row_at_acquires() -> None:
    """With --dsm-unsafe 2: rank 1's release to two readers (ranks 2, 3) makes the page unsafe, and they still get
    notices.  Rank 2's later write sends none, yet rank 1, which kept its copy all along, drops it at its next
    acquire: it read the page's row there and found another writer."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        a, lock = made_unsafe(mem, rt, 0, (2, 3))
        if rt.rank == 2:
            with lock:
                a[2] = 2.0  # no notice: the page is unsafe
        mem.barrier()
        seen = None
        if rt.rank == 1:
            with lock:
                seen = a[2]
        stats = mem.statistics()
        return seen, stats.notices_sent, stats.unsafe_pages, stats.unsafe_checks

    results = run_ranks(4, body, "cashmere", unsafe=2)
    assert results[1][1:3] == (2, 1)  # rank 1: two notices, and the page made unsafe
    assert results[2][1] == 0  # rank 2's release of an unsafe page: none
    assert results[1][0] == 2.0 and results[1][3] >= 1  # rank 1 read the row, dropped its copy, saw rank 2's write
