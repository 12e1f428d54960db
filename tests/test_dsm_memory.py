"""Unit tests of the HLRC protocol (dsm.Memory) on thread-ranks, under both protocols.

Bodies run on the rank threads and return what they saw; the assertions are
made in the test thread, so a failing check never leaves a peer waiting in a
DSM barrier.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest
from dsm_util import MODELS, run_ranks

import dsm
from ckpt.plugin import STATS_NS
from ckpt.testing import ThreadRuntime, wait_for
from dsm import DsmError
from dsm._messages import Ack, ReleaseRequest

pytestmark = pytest.mark.timeout(60)
#: The memory model's tests run under every protocol; the rest test HLRC's own machinery (twins, diffs, its
#: handler, its messages), which Cashmere has none of (its own: test_dsm_cashmere).
EVERY = pytest.mark.parametrize("protocol", MODELS)
HLRC = pytest.mark.parametrize("protocol", dsm.HLRC)

DOUBLES = 512  # float64 / int64 per 4 KiB page
SPIN_SECONDS = 10.0  # bound on every lock-polling loop


def error_of(call: Any, kind: type[BaseException] = DsmError) -> str | None:
    """The message of the `kind` exception `call()` raises, None if it returns (bodies must not raise before a
    DSM barrier: their peers would wait in it)."""
    try:
        call()
    except kind as exc:
        return str(exc)
    return None


def poll_under_lock(lock: dsm.Lock, ready: Any) -> bool:
    """Acquire, test `ready()`, release, until it holds (True) or SPIN_SECONDS pass (False)."""
    deadline = time.monotonic() + SPIN_SECONDS
    while time.monotonic() < deadline:
        with lock:
            if ready():
                return True
    return False


# ----------------------------------------------------------------- release -> acquire
@EVERY
@pytest.mark.parametrize("where", ["inside", "before"])
def test_data_written_before_a_release_is_seen_after_the_matching_acquire(protocol: str, where: str) -> None:
    """Rank 0 writes three pages of data (inside, or before, its critical section) and sets a flag under the lock;
    rank 1 polls the flag under the lock only (no barrier in between) and then reads the data."""
    expected = np.arange(3 * DOUBLES, dtype=np.float64) * 0.5 + 1

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        data = mem.array(3 * DOUBLES, np.float64)
        flag = mem.array(1, np.int64)
        lock = mem.lock()
        seen = None
        if rt.rank == 0:
            if where == "before":
                with data.write() as v:
                    v[:] = expected
            with lock:
                if where == "inside":
                    with data.write() as v:
                        v[:] = expected
                flag[0] = 1
        elif poll_under_lock(lock, lambda: flag[0] == 1):
            seen = data[...]
        stats = mem.statistics()
        mem.barrier()
        return seen, stats.page_fetches + stats.grant_pages

    (_, _), (seen, brought) = run_ranks(2, body, protocol)
    assert seen is not None, "rank 1 never saw the flag through the lock"
    assert np.array_equal(seen, expected)
    # the flag's page and the three data pages came from their home (fetched, or with a grant) -- under cashmere,
    # whose homes are taken by the first touch, read or write, rank 1's polls may have made it the flag's home
    assert brought >= (4 if protocol in dsm.HLRC else 3)


@EVERY
@pytest.mark.parametrize("locks", [1, 2])
def test_write_notices_pass_along_a_chain_of_lock_holders(protocol: str, locks: int) -> None:
    """Rank 0 writes data and flag=1 under lock A; rank 1 waits for 1 under A and sets 2 under B (A itself with
    one lock); rank 2 waits for 2 under B and sees rank 0's data, which rank 1 never touched."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        data = mem.array(2 * DOUBLES, np.float64)
        flag = mem.array(1, np.int64)
        first = mem.lock()
        second = mem.lock() if locks == 2 else first
        seen = None
        if rt.rank == 0:
            with first:
                data[:] = 42.0
                flag[0] = 1
        elif rt.rank == 1:
            if poll_under_lock(first, lambda: flag[0] == 1):
                with second:
                    flag[0] = 2
                seen = "handed on"
        elif poll_under_lock(second, lambda: flag[0] == 2):
            seen = data[...]
        mem.barrier()
        return seen

    results = run_ranks(3, body, protocol)
    assert results[1] == "handed on"
    assert results[2] is not None and np.all(results[2] == 42.0)


# ----------------------------------------------------------------- multiple writers
@EVERY
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("layout", ["blocks", "interleaved"])
def test_ranks_writing_disjoint_parts_of_one_page_all_see_every_part_after_a_barrier(
    protocol: str, size: int, layout: str
) -> None:
    def part(rank: int) -> slice:
        if layout == "blocks":
            return slice(rank * DOUBLES // size, (rank + 1) * DOUBLES // size)
        return slice(rank, DOUBLES, size)

    expected = np.zeros(DOUBLES)
    for r in range(size):
        expected[part(r)] = np.arange(DOUBLES)[part(r)] + 1000.0 * (r + 1)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)  # one page
        mine = part(rt.rank)
        with a.write(mine) as v:
            v[:] = np.arange(DOUBLES)[mine] + 1000.0 * (rt.rank + 1)
        mem.barrier()
        return a[...], mem.statistics().homes_taken

    results = run_ranks(size, body, protocol)
    for rank, (seen, _) in enumerate(results):
        assert np.array_equal(seen, expected), f"rank {rank}"
    assert sum(homes for _, homes in results) == 1  # one first toucher won the page


# ----------------------------------------------------------------- locks: mutual exclusion
@EVERY
@pytest.mark.parametrize("neighbours", [False, True], ids=["alone", "with-other-data-on-its-page"])
def test_lock_protected_increments_of_a_shared_counter_add_up(protocol: str, neighbours: bool) -> None:
    """4 ranks x 25 increments = 100; with `neighbours`, each rank also bumps its own slot of the counter's page
    outside the lock (false sharing between the locked counter and unlocked data)."""
    ranks, rounds = 4, 25

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.int64)
        lock = mem.lock()
        slot = 1 + rt.rank
        for _ in range(rounds):
            if neighbours:
                a[slot] = a[slot] + 1
            with lock:
                a[0] = a[0] + 1
        mem.barrier()
        return a[: 1 + ranks].tolist()

    results = run_ranks(ranks, body, protocol)
    expected = [ranks * rounds] + [rounds if neighbours else 0] * ranks
    assert results == [expected] * ranks


# ----------------------------------------------------------------- LRC: stale but never torn
@EVERY
def test_an_unsynchronised_reader_sees_stale_but_never_torn_or_older_data(protocol: str) -> None:
    """Rank 0 is the page's home, rank 1 rewrites 1000 int32 with k = 1..K under a lock, rank 2 never takes the
    lock and refetches the page from the home over and over: every copy it gets is uniform and k never drops."""
    rounds, n = 60, 1000
    spread = 0x01010101  # k * spread changes every byte of every element: each diff is one 4000-byte run

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(1024, np.int32)  # one 4 KiB page
        lock = mem.lock()
        region = a._region
        if rt.rank == 0:
            a[1023] = -1  # first touch: rank 0 is the home
        mem.barrier()
        seen: list[int] = []
        torn: list[list[int]] = []
        # (HLRC learns homes from write notices; cashmere looks it up at the default home's table)
        home = int(region.home[0]) if protocol in dsm.HLRC else mem._home(region, 0)  # type: ignore[attr-defined]
        if rt.rank == 1:
            for k in range(1, rounds + 1):
                with lock, a.write(np.s_[:n]) as v:
                    v[:] = k * spread
        elif rt.rank == 2 and home == 0:
            deadline = time.monotonic() + SPIN_SECONDS
            while (not seen or seen[-1] < rounds) and time.monotonic() < deadline:
                region.state[0] = 0  # INVALID: force a fetch from the home
                if protocol not in dsm.HLRC:  # cashmere: its copy of the page, between two reads of its seqlock
                    mem._read(region, 0, [(0, [(0, region.page_size)])])  # type: ignore[attr-defined]
                else:
                    mem._fetch(region, 0)
                values = region.data[: 4 * n].view(np.int32)
                if np.all(values == values[0]) and values[0] % spread == 0:
                    seen.append(int(values[0]) // spread)
                else:
                    torn.append(np.unique(values).tolist())
        stats = mem.statistics()
        mem.barrier()
        return seen, torn, stats, home

    results = run_ranks(3, body, protocol)
    seen, torn, stats, home = results[2]
    assert home == 0
    assert torn == [], f"torn copies (values in one copy): {torn[:5]}"
    assert seen and seen[-1] == rounds, f"the reader never saw the last write: {seen[-5:]}"
    assert seen == sorted(seen), f"values went backwards: {seen}"
    assert stats.page_fetches >= len(seen)
    assert stats.fetch_retries >= 0  # onesided and cashmere retry a read that overlapped a write; async never does
    if protocol == "async":
        assert stats.fetch_retries == 0


# ----------------------------------------------------------------- invalidation
@EVERY
def test_after_a_barrier_only_pages_another_rank_wrote_are_refetched(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(4 * DOUBLES, np.float64)  # page 0: rank 0 writes; 1: nobody; 2: rank 1 writes; 3: both
        fetches = []

        def fetched(page: int) -> int:
            before = mem.statistics().page_fetches
            a[page * DOUBLES]
            return mem.statistics().page_fetches - before

        for value in (1.0, 2.0):
            if rt.rank == 0:
                a[0] = value
                a[3 * DOUBLES] = value
            else:
                a[2 * DOUBLES] = value
                a[3 * DOUBLES + 1] = value
            mem.barrier()
            if rt.rank == 1:
                fetches.append([fetched(page) for page in range(4)])
                fetches.append([fetched(page) for page in range(4)])  # again: all cached now
                fetches.append([a[0], a[3 * DOUBLES], a[3 * DOUBLES + 1]])
            mem.barrier()
        return fetches

    fetches = run_ranks(2, body, protocol)[1]
    for value, start in ((1.0, 0), (2.0, 3)):
        first, again, values = fetches[start : start + 3]
        assert first[0] == 1 and first[1] == 0 and first[2] == 0, first  # page 3 depends on who homed it
        assert again == [0, 0, 0, 0]
        assert values == [value] * 3


@HLRC
@pytest.mark.parametrize("homes", [1, 2])
def test_the_invalid_pages_of_one_access_are_fetched_in_one_round(protocol: str, homes: int) -> None:
    """A read of 12 invalid pages (homed at one rank, or at two) fetches them all in one round, more than the
    one-sided scratch area batches at once, and every value is the home's; a write of invalid pages too."""
    pages = 12

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(pages * DOUBLES, np.float64)
        if rt.rank < homes:  # rank 0 homes every page (or ranks 0 and 1 every other page)
            for page in range(rt.rank, pages, homes):
                with a.write(slice(page * DOUBLES, (page + 1) * DOUBLES)) as v:
                    v[:] = page + 1
        mem.barrier()
        if rt.rank != homes:
            mem.barrier()
            return None
        before = mem.statistics()
        with a.read(slice(0, pages * DOUBLES)) as v:
            seen = v[::DOUBLES].tolist()
        after = mem.statistics()
        with a.write(slice(0, pages * DOUBLES)) as v:  # all valid now: nothing to fetch, only twins
            v[1::DOUBLES] = -1.0
        written = mem.statistics()
        mem.barrier()
        return seen, after.page_fetches - before.page_fetches, after.fetch_rounds - before.fetch_rounds, written

    seen, fetched, rounds, written = run_ranks(homes + 1, body, protocol)[homes]
    assert seen == [float(page + 1) for page in range(pages)]
    assert (fetched, rounds) == (pages, 1)
    assert written.page_fetches == pages and written.twins == pages


@EVERY
def test_a_page_is_not_refetched_at_its_home(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        if rt.rank == 0:
            a[0] = 1.0  # rank 0 homes the page
        mem.barrier()
        if rt.rank == 1:
            a[1] = 2.0  # its diff goes to rank 0
        mem.barrier()
        before = mem.statistics().page_fetches
        values = a[:2].tolist()
        return values, mem.statistics().page_fetches - before, int(a._region.home[0])

    results = run_ranks(2, body, protocol)
    assert results[0] == ([1.0, 2.0], 0, 0)
    assert results[1][0] == [1.0, 2.0] and results[1][2] == 0


# ----------------------------------------------------------------- homes
@HLRC
def test_the_first_rank_to_write_a_page_becomes_its_home_and_writes_it_without_a_twin(protocol: str) -> None:
    """Page p's default home is p mod 2; rank 1 first-touches page 0 and rank 0 page 1, so neither is the default."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(2 * DOUBLES, np.float64)
        mine = 1 - rt.rank
        with a.write(np.s_[mine * DOUBLES : (mine + 1) * DOUBLES]) as v:
            v[:] = rt.rank + 1.0
        first = dataclasses.replace(mem.statistics())
        homes_before = a._region.home.tolist()
        mem.barrier()
        homes_after = a._region.home.tolist()
        if rt.rank == 0:
            a[0] = 9.0  # page 0 is homed at rank 1: this write needs a twin and a diff
        mem.barrier()
        return first, homes_before, homes_after, mem.statistics(), a[...]

    results = run_ranks(2, body, protocol)
    for rank, (first, homes_before, homes_after, last, _) in enumerate(results):
        mine = 1 - rank
        assert first.homes_taken == 1 and first.home_lookups == 1 and first.twins == 0, (rank, first)
        assert homes_before[mine] == rank
        assert homes_after == [1, 0]
        assert last.diffs == (1 if rank == 0 else 0)
    assert results[0][3].twins == 1 and results[1][3].twins == 0
    for *_, data in results:
        assert data[0] == 9.0 and np.all(data[1:DOUBLES] == 2.0) and np.all(data[DOUBLES:] == 1.0)


# ----------------------------------------------------------------- statistics
@HLRC
def test_statistics_are_a_frozen_snapshot(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        stats = mem.statistics()

        def assign() -> None:
            stats.barriers = 5  # type: ignore[misc]

        refused = error_of(assign, dataclasses.FrozenInstanceError)
        mem.barrier()
        return stats, mem.statistics(), refused

    for before, after, refused in run_ranks(2, body, protocol):
        assert refused is not None and "barriers" in refused
        assert isinstance(before, dsm.Statistics) and before.protocol == protocol
        assert before.barriers == 0 and after.barriers == 1
        assert "barrier" not in before.messages and after.messages["barrier"] == 1
        assert after.as_dict()["barriers"] == 1


@HLRC
def test_statistics_count_locks_barriers_diffs_and_messages_by_type(protocol: str) -> None:
    """Rank 0 homes the page and the lock; rank 1 writes 3 x 3 int64 of -1 (24 changed bytes, one run) under it."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.int64)
        lock = mem.lock()  # lock 0: homed at rank 0
        if rt.rank == 0:
            a[DOUBLES - 1] = 5
        mem.barrier()
        if rt.rank == 1:
            for j in range(3):
                with lock:
                    a[8 + 8 * j : 11 + 8 * j] = -1
        mem.barrier()
        return mem.statistics(), a[:40].tolist()

    (home, data0), (writer, data1) = run_ranks(2, body, protocol)
    expected = [0] * 40
    for j in range(3):
        expected[8 + 8 * j : 11 + 8 * j] = [-1] * 3
    assert data0 == data1 == expected
    assert (writer.rank, home.rank) == (1, 0)
    assert writer.lock_acquires == 3 and home.lock_acquires == 0
    assert writer.barriers == home.barriers == 2
    assert writer.diffs == 3 and writer.diff_bytes == 72 and home.diffs == 0
    assert writer.page_fetches == 1 and writer.twins == 3 and writer.intervals == 3
    assert home.homes_taken == 1 and home.twins == 0
    for kind, count in {"acquire": 3, "release": 3, "barrier": 2}.items():
        assert writer.messages[kind] == count, (kind, writer.messages)
    assert home.messages["grant"] == 3 and home.messages["release_ack"] == 3
    assert home.messages["barrier_reply"] == 4  # rank 0 answers every rank's arrival at both barriers
    if protocol == "async":
        assert writer.messages["diff"] == 3 and writer.messages["page"] == 1
        assert home.diffs_applied == 3 and home.pages_served == 1 and home.messages["diff_ack"] == 3
    else:
        assert "diff" not in writer.messages and "page" not in writer.messages
        assert writer.messages["stamp"] == 3 and writer.messages["rdma_write"] == 3
        assert writer.message_bytes["rdma_write"] == 72
        assert writer.messages["rdma_read"] == 1 + writer.fetch_retries
        assert home.messages["cas"] == 1
        assert home.diffs_applied == 0 and home.pages_served == 0  # the home's CPU took no part
    for stats in (home, writer):
        parts = stats.compute_seconds + stats.page_seconds + stats.wait_seconds + stats.lock_seconds
        assert parts <= stats.total_seconds + 1e-6, stats
        assert min(stats.compute_seconds, stats.page_seconds, stats.wait_seconds, stats.lock_seconds) >= 0


class SlowFlushClock:
    """`time` as dsm._memory, dsm._intervals and dsm._stats see it: the real clock, plus FLUSH seconds for every
    diff flush."""

    FLUSH = 100.0

    def __init__(self) -> None:
        self.extra = 0.0
        self.mutex = threading.Lock()

    def perf_counter(self) -> float:
        return time.perf_counter() + self.extra

    def flushed(self) -> None:
        with self.mutex:
            self.extra += self.FLUSH

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize(
    "flushed_at",
    [
        "release",
        "barrier",
        "acquire",
    ],
)
@HLRC
def test_the_time_breakdown_counts_a_diff_flush_once(
    protocol: str, flushed_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flush of rank 1's diffs takes 100 s of (patched) clock: the parts must still add up to at most the
    total, whether the flush happens at a release, a barrier or an acquire."""
    import dsm._intervals
    import dsm._memory
    import dsm._stats

    clock = SlowFlushClock()
    send_diffs = dsm.Memory._send_diffs

    def slow_send_diffs(self: dsm.Memory, outgoing: Any, interval: int, then: Any = None) -> None:
        send_diffs(self, outgoing, interval, then)
        if outgoing:
            clock.flushed()

    monkeypatch.setattr(dsm._memory, "time", clock)
    monkeypatch.setattr(dsm._intervals, "time", clock)
    monkeypatch.setattr(dsm._stats, "time", clock)
    monkeypatch.setattr(dsm.Memory, "_send_diffs", slow_send_diffs)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.int64)
        lock = mem.lock()
        if rt.rank == 0:
            a[0] = 1  # rank 0 homes the page: rank 1's writes are diffs
        mem.barrier()
        if rt.rank == 1:
            if flushed_at == "release":
                with lock:
                    a[1] = 2
            elif flushed_at == "acquire":
                a[1] = 2
                with lock:
                    pass
            else:
                a[1] = 2
        mem.barrier()
        return mem.statistics()

    writer = run_ranks(2, body, protocol)[1]
    # a release's diffs leave with it (`Memory.release`): their flush is the release's time
    flush = writer.lock_seconds if flushed_at == "release" else writer.flush_seconds
    assert writer.diffs == 1 and flush >= SlowFlushClock.FLUSH
    assert writer.total_seconds >= SlowFlushClock.FLUSH
    parts = writer.page_seconds + writer.wait_seconds + writer.lock_seconds
    assert parts <= writer.total_seconds, writer


# ----------------------------------------------------------------- lock misuse
@EVERY
def test_releasing_a_lock_this_rank_does_not_hold_raises(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        lock = mem.lock()
        errors = [error_of(lock.release)]  # never acquired
        if rt.rank == 0:
            lock.acquire()
        mem.barrier()
        if rt.rank == 1:  # held, but by rank 0
            errors.append(error_of(lock.release))
        mem.barrier()
        if rt.rank == 0:
            lock.release()
        return errors

    refused = "lock 0 is not held by this rank"
    assert run_ranks(2, body, protocol) == [[refused], [refused, refused]]


@HLRC
def test_the_lock_home_refuses_a_release_from_a_rank_that_does_not_hold_it(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str:
        lock = mem.lock()
        mem.held[lock.id] = [0] * mem.size  # this rank believes it holds the lock; its home knows better
        with pytest.raises(DsmError, match="rank 0 released lock 0, which it does not hold") as info:
            lock.release()
        return str(info.value)

    assert run_ranks(1, body, protocol) == ["rank 0: rank 0 released lock 0, which it does not hold"]


@EVERY
def test_acquiring_a_lock_twice_raises_because_locks_are_not_reentrant(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        lock = mem.lock()
        with lock:
            with pytest.raises(DsmError, match="lock 0 is already held by this rank"):
                lock.acquire()
            assert lock.held
        held_after = lock.held
        with lock:  # it was released exactly once, and can be taken again
            pass
        return held_after, mem.statistics().lock_acquires

    assert run_ranks(1, body, protocol) == [(False, 2)]


@EVERY
def test_a_with_block_releases_the_lock_on_exception(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(1, np.int64)
        lock = mem.lock()
        held = None
        if rt.rank == 0:
            with pytest.raises(ZeroDivisionError), lock:
                a[0] = 7
                _ = 1 / 0
            held = lock.held
        mem.barrier()
        if rt.rank == 1:
            with lock:  # would wait forever had rank 0 kept it
                held = int(a[0])
        mem.barrier()
        return held

    assert run_ranks(2, body, protocol) == [False, 7]


@HLRC
def test_locks_are_homed_round_robin(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        locks = [mem.lock() for _ in range(5)]
        for lock in locks:
            with lock:
                pass
        mem.barrier()
        return [lock.id for lock in locks], sorted(mem.handler.locks)

    results = run_ranks(2, body, protocol)
    assert results[0] == ([0, 1, 2, 3, 4], [0, 2, 4])
    assert results[1] == ([0, 1, 2, 3, 4], [1, 3])


# ----------------------------------------------------------------- barriers
@HLRC
def test_barriers_out_of_step_are_reported_to_every_rank(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str:
        if rt.rank == 1:
            mem.epoch += 1  # as if rank 1 had passed one barrier more than rank 0
        with pytest.raises(DsmError, match="DSM barriers out of step") as info:
            mem.barrier()
        return str(info.value)

    for message in run_ranks(2, body, protocol):
        assert "rank 0 at barrier 1" in message and "rank 1 at barrier 2" in message


# ----------------------------------------------------------------- pickling
@HLRC
def test_the_pickled_state_drops_the_per_process_fields(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(DOUBLES, np.float64)
        a[0] = 1.0
        mem.barrier()
        state = mem.__getstate__()
        handler_state = mem.handler.__getstate__()
        return set(state), set(handler_state), mem._thread is not None and mem._thread.is_alive()

    for keys, handler_keys, alive in run_ranks(2, body, protocol):
        assert alive  # dropping them from the state leaves the live memory alone
        assert not keys & {"_thread", "_stop", "_failure", "_pm", "_fire"}
        assert {"vt", "regions", "known", "counters", "handler", "client", "server", "epoch"} <= keys
        assert "mutex" not in handler_keys and {"locks", "arrivals", "waiting"} <= handler_keys


@HLRC
@pytest.mark.parametrize(("extensions", "ordered"), [({}, False), ({"ckpt_remotelog": object()}, True)])
def test_an_image_from_before_pipelined_releases_keeps_releases_ordered_under_a_plugin(
    protocol: str, extensions: dict[str, Any], ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dsm_attached` does not fire on a restore: a memory a plugin kept state in (remote or stable logging) must
    not start pipelining releases its recovery assumes are ordered; one no plugin touched may."""
    monkeypatch.setattr(dsm.Memory, "_live", lambda self: setattr(self, "_plugins", object()))  # no threads here
    mem = dsm.Memory.__new__(dsm.Memory)
    mem.__setstate__({"protocol": protocol, "extensions": extensions})
    assert mem.release_after_diffs is ordered


@HLRC
def test_close_stops_the_handler_thread_and_frees_the_verbs_objects(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[bool, bool]:
        a = mem.array(16, np.int64)
        a[rt.rank] = rt.rank
        mem.barrier()
        return mem._thread is not None and mem._thread.is_alive(), True

    closed: list[dsm.Memory] = []

    def keep(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[bool, bool]:
        closed.append(mem)
        return body(mem, rt)

    assert run_ranks(2, keep, protocol) == [(True, True), (True, True)]
    for mem in closed:  # run_ranks closed them
        assert mem._thread is None
        assert mem.ctx._closed
        assert mem.statistics().barriers == 1


@EVERY
def test_two_ranks_writing_different_fields_of_one_record_both_survive(protocol: str) -> None:
    record = np.dtype([("a", "i4"), ("b", "i4")])

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[int, int]:
        a = mem.array(4, record)
        if rt.rank == 0:
            a[3] = (0, 0)  # rank 0 is the home; ranks 1 and 2 write through twins and diffs
        mem.barrier()
        if rt.rank in (1, 2):
            with a.write(np.s_[0:1]) as v:
                v["a" if rt.rank == 1 else "b"] = 11 * rt.rank
        mem.barrier()
        got = a[0]
        return int(got["a"]), int(got["b"])

    assert run_ranks(3, body, protocol) == [(11, 22)] * 3


@HLRC
def test_an_error_reply_fails_its_own_request_only(protocol: str) -> None:
    """After a refused request, the next request gets its own reply (not the old error), and locks work."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> list[str]:
        lock = mem.lock()
        seen = []
        if rt.rank == 1:
            try:
                forged = ReleaseRequest(mem._next_rid(), lock.id, mem.vt, [], 0)  # of a lock not held
                mem._request(0, forged, Ack, "a forged release")
            except DsmError as exc:
                seen.append("refused" if "does not hold" in str(exc) else str(exc))
            with lock:
                seen.append("acquired")
        mem.barrier()
        with lock:
            seen.append("again")
        return seen

    assert run_ranks(2, body, protocol) == [["again"], ["refused", "acquired", "again"]]


@EVERY
def test_a_lock_or_barrier_inside_a_write_block_is_refused(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> list[str]:
        a = mem.array(8, np.int64)
        lock = mem.lock()
        refused = []
        with a.write(np.s_[:]) as v:
            v[rt.rank] = 1
            for call in (lock.acquire, mem.barrier):
                try:
                    call()
                except DsmError as exc:
                    refused.append("refused" if "inside a `with a.write" in str(exc) else str(exc))
        mem.barrier()  # outside the block: fine
        return refused

    assert run_ranks(2, body, protocol) == [["refused", "refused"]] * 2


@EVERY
def test_a_barrier_waits_for_a_slow_rank_longer_than_the_fetch_timeout(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dsm._onesided

    monkeypatch.setattr(dsm._onesided, "FETCH_TIMEOUT", 0.2)
    gate = threading.Event()

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str:
        if rt.rank == 0:
            gate.wait(timeout=0.6)  # rank 1 waits in the barrier well past the (patched) timeout
        mem.barrier()
        return "passed"

    assert run_ranks(2, body, protocol) == ["passed", "passed"]


@HLRC
def test_a_release_that_fails_leaves_the_lock_held_so_it_can_be_retried(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[bool, bool]:
        lock = mem.lock()
        still_held = True
        if rt.rank == 0:
            lock.acquire()
            real = mem._request
            calls = []

            def failing(*args: Any, **kwargs: Any) -> Any:
                if not calls:
                    calls.append(1)
                    raise DsmError("simulated failure")
                return real(*args, **kwargs)

            mem._request = failing  # type: ignore[method-assign]
            try:
                lock.release()
            except DsmError:
                still_held = lock.held
            lock.release()
            mem._request = real  # type: ignore[method-assign]
        mem.barrier()
        with lock:
            pass
        return still_held, lock.held

    assert run_ranks(2, body, protocol) == [(True, False), (True, False)]


@HLRC
def test_a_home_that_twins_its_own_pages_sends_no_notice_for_one_rewritten_unchanged(protocol: str) -> None:
    """With twin_homes on (remote logging), a home's own page rewritten with the same bytes is like a page
    homed elsewhere with an empty diff: no write notice (one would name an interval no logged diff holds, which
    a copy rebuilt from the logs after a failure could never show: its readers would wait for it forever)."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[int, int, list[int]]:
        mem.twin_homes = True
        a = mem.array(2 * DOUBLES, np.int64)
        if rt.rank == 0:
            a[:DOUBLES] = 7  # first touch: rank 0 is the home of page 0
        mem.barrier()
        before = mem.vt[0]
        if rt.rank == 0:
            a[:DOUBLES] = 7  # the same bytes
        mem.barrier()
        unchanged = mem.vt[0] - before
        if rt.rank == 0:
            a[:1] = 8
        mem.barrier()
        return unchanged, mem.vt[0] - before, a[:2].tolist()

    assert run_ranks(2, body, protocol) == [(0, 1, [8, 7])] * 2


# ----------------------------------------------------------------- long waits, reported
def _held_by_rank_0(mem: dsm.Memory, rt: ThreadRuntime) -> dsm.Lock:
    """A new lock, which rank 0 holds before any other rank can ask for it (collective)."""
    lock = mem.lock()
    if rt.rank == 0:
        lock.acquire()
    mem.barrier()
    return lock


@HLRC
def test_a_long_wait_is_reported_while_it_lasts_and_cleared_when_it_ends(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 waits for a lock rank 0 holds, then in a barrier rank 0 has not reached: each wait, once it has
    lasted STUCK_AFTER, is in the KV as `ckpt status` reads it (STATS_NS `1/dsm`), and gone once it ends; and
    rank 0, the lock's home and the barrier manager, says what stands there (its `facts`)."""
    import dsm._net
    import dsm._waits

    monkeypatch.setattr(dsm._net, "STUCK_AFTER", 0.2)
    monkeypatch.setattr(dsm._waits, "STUCK_AFTER", 0.2)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        lock = _held_by_rank_0(mem, rt)
        if rt.rank == 1:
            with lock:
                pass
            mem.barrier()
            # a report was made: its thread and callback are still this process's alone
            return set(mem.__getstate__()), set(mem.client.__getstate__())

        def reported() -> list[Any]:
            value = rt.kv.get(STATS_NS, "1/dsm")
            return [] if value is None else [(w["what"], w["since"]) for w in value["waits"]]

        def facts() -> list[str]:  # rank 0's, as the lock's home and the barrier manager
            value = rt.kv.get(STATS_NS, "0/dsm")
            return [] if value is None else [f["what"] for f in value["facts"]]

        # (a slow setup barrier may have been reported first)
        shown = wait_for(lambda: [w for w in reported() if w[0].startswith("lock")], 10, "rank 1's wait for the lock")
        held = wait_for(lambda: [f for f in facts() if f.startswith("lock")], 10, "the lock's home says it is held")
        unlocked = time.time()
        lock.release()
        in_barrier = wait_for(lambda: [w for w in reported() if w[0].startswith("barrier")], 10, "the barrier")
        arrived = wait_for(lambda: [f for f in facts() if f.startswith("barrier")], 10, "the manager's arrivals")
        still, still_facts = reported(), facts()
        mem.barrier()
        wait_for(lambda: rt.kv.get(STATS_NS, "1/dsm")["waits"] == [], 10, "rank 1's report cleared")
        wait_for(lambda: facts() == [], 10, "rank 0's facts cleared")
        return (
            lock.id,
            shown,
            unlocked,
            in_barrier,
            still,
            rt.kv.get(STATS_NS, "1/dsm")["incarnation"],
            (
                held,
                arrived,
                still_facts,
            ),
        )

    started = time.time()
    ranks = run_ranks(2, body, protocol)
    (lock_id, shown, unlocked, in_barrier, still, incarnation, (held, arrived, still_facts)), pickles = ranks
    assert not {"_wait_report", "_standing"} & pickles[0] and "on_stuck" not in pickles[1]
    epoch = in_barrier[0][0].removeprefix("barrier ")
    assert held == [f"lock {lock_id} is held by rank 0, wanted by rank 1"]
    assert arrived == [f"barrier {epoch} waits for rank 0 (rank 1 arrived)"]
    assert still_facts == arrived  # the lock's stand is over and taken back
    assert [what for what, _ in shown] == [f"lock {lock_id}"]
    assert started <= shown[0][1] <= unlocked - 0.2  # since the wait began, as a wall-clock time
    assert [what for what, _ in still] == [in_barrier[0][0]]  # the lock's wait is over and no longer shown
    assert incarnation == 0


@HLRC
def test_a_wait_shorter_than_stuck_after_is_never_reported(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 waits about 0.3 s for a lock (long enough for its wait to go idle and ask whether to report):
    under a STUCK_AFTER of 5 s nothing is published."""
    import dsm._net

    monkeypatch.setattr(dsm._net, "STUCK_AFTER", 5.0)
    held = threading.Event()

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        lock = _held_by_rank_0(mem, rt)
        if rt.rank == 0:
            held.wait(0.3)  # rank 1 waits this long for the lock
            lock.release()
        else:
            with lock:
                pass
        mem.barrier()
        return mem._wait_report is not None and mem._wait_report._thread is None

    assert run_ranks(2, body, protocol) == [True, True]  # no report was begun: no thread to publish one


@HLRC
def test_a_contended_lock_that_keeps_changing_hands_is_never_reported_as_standing(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ranks take one lock in turn for a second: its home sees ranks queued at nearly every look, but a
    new holder each time -- nothing stands still, so nothing is reported (STUCK_AFTER patched to 0.2 s)."""
    import dsm._waits

    monkeypatch.setattr(dsm._waits, "STUCK_AFTER", 0.2)
    looked: list[int] = []
    reported: list[list[tuple[str, float]]] = []
    look, set_facts = dsm._waits.Standing.look, dsm._waits.WaitReport.set_facts

    def counting_look(self: Any, facts: dict[Any, str], now: float) -> None:
        looked.append(len(facts))
        look(self, facts, now)

    def recording(self: Any, facts: list[tuple[str, float]]) -> None:
        reported.append(facts)
        set_facts(self, facts)

    monkeypatch.setattr(dsm._waits.Standing, "look", counting_look)
    monkeypatch.setattr(dsm._waits.WaitReport, "set_facts", recording)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> int:
        lock = mem.lock()
        mem.barrier()
        deadline, turns = time.monotonic() + 1.0, 0
        while time.monotonic() < deadline:
            with lock:
                turns += 1
        mem.barrier()
        return turns

    assert min(run_ranks(3, body, protocol)) > 10
    assert any(looked), "the lock's home never saw a rank queued: the test did not contend"
    assert reported == []


@HLRC
def test_a_home_whose_report_fails_serves_on(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing what stands at a home fails (no thread to be had): the handler logs it and serves on."""
    import dsm._waits

    monkeypatch.setattr(dsm._waits, "STUCK_AFTER", 0.0)
    failures: list[Any] = []

    def failing(self: Any, facts: list[tuple[str, float]]) -> None:
        failures.append(facts)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(dsm._waits.WaitReport, "set_facts", failing)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        lock = _held_by_rank_0(mem, rt)
        if rt.rank == 0:
            wait_for(lambda: failures, 10, "a failed report of rank 1 queued for the lock")
            lock.release()
        else:
            with lock:
                pass
        mem.barrier()
        return mem._failure

    assert run_ranks(2, body, protocol) == [None, None]
    assert failures
