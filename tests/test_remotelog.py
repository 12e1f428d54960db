"""Remote logging, failure-free (FT-KDSM §4): every ring holds exactly the records the paper requires, in time.

Thread-ranks (tests/dsm_util.py) run the DSM programs with the ckpt_remotelog plugin in
each rank's plugin host; a recording plugin beside it notes what the DSM did (diffs
made, notices received, acquires, barriers) and checks, at every interval's close, that
what the rank used so far is already at its log home.  The rings are then read back
(they are in this process's memory) and compared with what happened.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from dsm_util import FIRST_HCA

import ckpt
import ckpt.testing
import ckpt_remotelog
import dsm
from ckpt.runtime.plugins import PluginHost
from ckpt.testing import ThreadRuntime, run_threads, wait_for
from ckpt_remotelog import RemoteLog
from ckpt_remotelog._records import (
    HEADER_SIZE,
    OWN_KINDS,
    Record,
    RecordKind,
    as_kind,
    decode_at,
    diff_record,
    encode,
    gids_of,
    notices_of,
    parse,
    per_page,
    record_size,
    seal,
    walk,
)
from ckpt_remotelog._ring import CONTROL, LogRing, circular_write
from ckpt_remotelog._writer import LOG, WAITS
from dsm import Diff, DsmError
from dsm._messages import NAMES
from dsm._net import Endpoint
from dsm.programs import program_class

pytestmark = pytest.mark.timeout(120)
SIZE = 4
PROGRAMS = [
    ("sor", ["64", "8"]),
    ("tsp", ["8", "3", "8"]),
    ("water", ["64", "4", "4"]),
    ("isort", ["2048", "128", "3"]),
]


@dataclass
class Seen:
    """What one rank's DSM did, as its hooks told (some on the handler thread: hence the lock)."""

    rank: int
    logs: list[RemoteLog | None]
    diffs: list[tuple[int, int, int, bytes]] = field(default_factory=list)  # (gid, home, interval, payload runs)
    grants: list[list[Any]] = field(default_factory=list)  # the notices of each acquire, in order
    barrier_notices: list[list[Any]] = field(default_factory=list)
    received: list[Any] = field(default_factory=list)
    late: list[str] = field(default_factory=list)  # violations of "logged before the next interval completes"
    lock: threading.Lock = field(default_factory=threading.Lock)

    @ckpt.hookimpl
    def dsm_attached(self, memory: Any) -> None:
        self.logs[self.rank] = memory.extensions["remotelog"]  # runs after the plugin's (registered first)

    @ckpt.hookimpl
    def dsm_diff_created(self, gid: int, home: int, interval: int, diff: Diff) -> None:
        self.diffs.append((gid, home, interval, b"".join(o.to_bytes(4, "little") + d for o, d in diff)))

    @ckpt.hookimpl
    def dsm_write_notices_received(self, source: str, notices: list[Any]) -> None:
        self.received.extend(list(n) for n in notices)  # tuples here, lists once through msgpack

    @ckpt.hookimpl
    def dsm_lock_acquired(self, memory: Any) -> None:
        self.grants.append(self.received)
        self.received = []

    @ckpt.hookimpl
    def dsm_barrier_passed(self, memory: Any) -> None:
        self.barrier_notices.append(self.received)
        self.received = []

    @ckpt.hookimpl
    def dsm_interval_closed(self, memory: Any, interval: int) -> None:
        """The acquires and barriers before this interval are logged at this rank's log home by now."""
        used = int(memory.counters.lock_acquires) + int(memory.counters.barriers)
        if len(mine := own_records(self.logs, self.rank)) != used:
            self.late.append(f"interval {interval}: {len(mine)} records for {used} acquires and barriers")


def own_ring(logs: list[RemoteLog | None], rank: int) -> list[Record]:
    """The committed records of `rank`'s own ring at its log home, between the head and tail its writer keeps."""
    log = logs[rank]
    assert log is not None
    holder = logs[log.log_home(rank)]
    assert holder is not None
    head, tail = log.writer.own_head, log.writer.own_tail
    return walk(holder.own_ring.contents(head, tail), head)


def own_records(logs: list[RemoteLog | None], rank: int) -> list[Record]:
    """The NOTICES and BARRIER records `rank` wrote, from its own ring at its log home."""
    return [r for r in own_ring(logs, rank) if r.kind in (RecordKind.NOTICES, RecordKind.BARRIER)]


def scan(ring: LogRing) -> list[Record]:
    """Every committed record between a ring's head and tail, in position order.

    Unlike `LogRing.records` (a walk, which stops at the first record still being written), it
    finds records past such a hole: a word is a record's commit word when it holds its own
    position + 1 (the positions of the ring's current lap are known from its tail).
    """
    head, tail, capacity = ring.head, ring.tail, ring.capacity
    words = ring.buf[CONTROL:].view(np.uint64)
    offsets = np.arange(len(words), dtype=np.int64) * 8
    positions = offsets + capacity * ((tail - 1 - offsets) // capacity)  # the newest position at each offset
    found = np.flatnonzero((words == (positions + 1).astype(np.uint64)) & (positions >= head))
    records = []
    for position in sorted(int(positions[k]) for k in found):
        header = ring.contents(position, min(position + HEADER_SIZE, tail))
        length = int.from_bytes(header[56:60], "little") if len(header) == HEADER_SIZE else -1
        if length >= 0 and position + record_size(length) <= tail:
            record = decode_at(ring.contents(position, position + record_size(length)), 0, position)
            if record is not None:
                records.append(record)
    return records


def hosts(seen: list[Seen]) -> Any:
    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        plugins.register(ckpt_remotelog, "remotelog")
        plugins.register(seen[rank], f"seen-{rank}")
        return plugins

    return host


def run_logged(name: str, argv: list[str], protocol: str, **options: Any) -> tuple[list[Any], list[Any], list[Seen]]:
    """Run a DSM program on SIZE thread-ranks under remote logging; (results, programs, what each rank saw)."""
    programs: list[Any] = []
    logs: list[RemoteLog | None] = [None] * SIZE
    seen = [Seen(rank, logs) for rank in range(SIZE)]

    def make() -> ckpt.Program:
        programs.append(program_class(name)())
        return programs[-1]

    results = ckpt.testing.run_program(
        make,
        SIZE,
        argv=argv,
        options={"dsm_protocol": protocol, "logging": "remote", **options},
        first_device=FIRST_HCA,
        plugins=hosts(seen),
        finish=lambda program: program.mem.extensions["remotelog"].flush(),  # the last barrier's record
    )
    by_rank = sorted(programs, key=lambda p: p.mem.rank)
    for program in by_rank:
        program.mem.close()
    return results, by_rank, seen


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("name", "argv"), PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_every_ring_holds_exactly_the_records_the_paper_requires(name: str, argv: list[str], protocol: str) -> None:
    results, programs, seen = run_logged(name, argv, protocol)
    assert all("numpy=match" in line for line in results), results
    logs: list[RemoteLog] = [p.mem.extensions["remotelog"] for p in programs]
    rings = {log.rank: scan(log.ring) for log in logs}  # the log ring each rank holds
    ring_of = {rank: rings[logs[0].log_home(rank)] for rank in range(SIZE)}  # rank -> its log ring (elsewhere)
    home_rings = {log.rank: scan(log.home_log) for log in logs}
    for log in logs:  # every record is committed: the walk (what a recovery reads) sees them all
        assert log.ring.records() == rings[log.rank] and log.home_log.records() == home_rings[log.rank]
        if protocol == "onesided":  # a home's own writes are kept beside its ring, by the CPU: none went in it
            assert all(r.writer != log.rank for r in home_rings[log.rank])
            assert [at for at, _ in log.own_diffs] == sorted(at for at, _ in log.own_diffs)
            homed = {r.aid << 32 | int(page) for r in log.memory.regions for page in np.flatnonzero(r.home == log.rank)}
            assert {gid for _, r in log.own_diffs for gid in gids_of(r)} <= homed  # its own pages only
        else:
            assert not log.own_diffs
    # the home diff log as its minimal versions read it: the ring, and (onesided) the home's own beside it
    homes = {rank: records + [parse(r) for _, r in logs[rank].own_diffs] for rank, records in home_rings.items()}
    for records in [*rings.values(), *home_rings.values()]:
        assert all(r.position < next_r.position for r, next_r in itertools.pairwise(records))
    # one DIFF record per (writer, interval, home) and one HOME_DIFF in the home's diff log: an interval's diffs
    # for the pages of one home travel together (`_records.diff_record`)
    intervals = {(s.rank, interval, home) for s in seen for _, home, interval, _ in s.diffs}
    for home in range(SIZE):
        diffs = [(r.writer, r.interval, home) for r in ring_of[home] if r.kind == RecordKind.DIFF]
        assert sorted(diffs) == sorted(key for key in intervals if key[2] == home)
        # ... and one HOME_DIFF per (writer, interval) in the home's diff log, under async too (its handler logs
        # the diffs of one message, a writer's interval for this home, in one record: `dsm_diffs_received`)
        kept = [(r.writer, r.interval, home) for r in homes[home]]
        assert sorted(kept) == sorted(diffs)
    paged = {rank: [one for r in records for one in per_page(r)] for rank, records in ring_of.items()}
    homes = {rank: [one for r in records for one in per_page(r)] for rank, records in homes.items()}
    # diffs: at the log home of the page's home (its own writes too) and in the home's diff log
    for s in seen:
        for gid, home, interval, runs in s.diffs:
            key = (s.rank, gid, interval)
            in_home_log = [r for r in homes[home] if (r.writer, r.gid, r.interval) == key]
            assert len(in_home_log) == 1, (key, home)
            assert _runs(in_home_log[0]) == runs
            logged = [r for r in paged[home] if r.kind == RecordKind.DIFF and (r.writer, r.gid, r.interval) == key]
            assert len(logged) == 1, (key, home)
            assert _runs(logged[0]) == runs
    made = Counter(h for s in seen for _, h, _, _ in s.diffs)
    for home in range(SIZE):
        assert sum(1 for r in paged[home] if r.kind == RecordKind.DIFF) == made[home]
        assert len(homes[home]) == made[home]
    # notices: one record per acquire and per barrier, in order, holding what the rank received
    for s, program in zip(seen, programs, strict=True):
        assert not s.late, s.late
        mine = own_records(logs, s.rank)
        stats = program.mem.statistics()
        assert len(mine) == stats.lock_acquires + stats.barriers
        acquires = [r for r in mine if r.kind == RecordKind.NOTICES]
        barriers = [r for r in mine if r.kind == RecordKind.BARRIER]
        assert [notices_of(r.payload)[1] for r in acquires] == s.grants
        assert [notices_of(r.payload)[1] for r in barriers] == s.barrier_notices
        assert [r.tag for r in barriers] == list(range(1, stats.barriers + 1))
        # every own record -- acquires, releases, arrivals, barrier exits -- in program order by serial
        every = own_ring(logs, s.rank)
        assert all(r.writer == s.rank and r.kind in OWN_KINDS for r in every)
        assert not any(r.kind in OWN_KINDS for r in ring_of[s.rank])  # the log ring holds diffs only
        assert [r.serial for r in every] == list(range(len(every)))
        # the gid field: the rank's own interval count after the operation (`_recover` compares DIFFs with it)
        assert [r.gid for r in every] == sorted(r.gid for r in every) and every[-1].gid == stats.intervals
        releases = [r for r in every if r.kind == RecordKind.RELEASE]
        assert len(releases) == len(acquires)
        assert [(r.tag, r.interval) for r in releases] == [(r.tag, r.interval) for r in acquires]  # lock, token
        assert [r.interval for r in acquires] == sorted({r.interval for r in acquires}) and all(
            r.interval > 0 for r in acquires
        )
        arrivals = [r.tag for r in every if r.kind == RecordKind.BARRIER_ARRIVAL]
        assert arrivals == list(range(1, stats.barriers + 1))  # phase 1, at the rank's own log home
        phases = [(r.kind, r.tag) for r in every if r.kind in (RecordKind.BARRIER_ARRIVAL, RecordKind.BARRIER)]
        assert phases == [
            (k, e) for e in range(1, stats.barriers + 1) for k in (RecordKind.BARRIER_ARRIVAL, RecordKind.BARRIER)
        ]


def _runs(record: Record) -> bytes:
    return b"".join(o.to_bytes(4, "little") + d for o, d in Diff.decode(record.payload))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_log_homes_handler_serves_no_logging_message(protocol: str) -> None:
    """Each handler serves the same kinds of requests with logging on as off, as many of each (page fetches
    aside: how many pages a rank refetches depends on timing), so none for logging; the log records exist."""
    served = {}
    for logging in ("off", "remote"):
        programs: list[Any] = []
        make = _maker("sor", programs)

        ckpt.testing.run_program(
            make,
            SIZE,
            argv=["64", "8"],
            options={"dsm_protocol": protocol, "logging": logging},
            first_device=FIRST_HCA,
            plugins=_plain_hosts,
            finish=lambda p: None,
        )
        served[logging] = {
            p.mem.rank: {k: n for k, n in p.mem.handler.counters.messages.items() if k not in TIMING} for p in programs
        }
        kinds = {k for p in programs for k in p.mem.handler.counters.messages}
        assert kinds <= set(NAMES.values()), kinds  # DSM replies only: nothing of logging's
        logged = sum(p.mem.statistics().log_records for p in programs)
        assert (logged > 0) == (logging == "remote")
        for p in programs:
            p.mem.close()
    assert served["remote"] == served["off"]


TIMING = {"page_reply", "home_reply"}  # how many a run needs depends on timing (refetches, first touches)


def _maker(name: str, programs: list[Any]) -> Any:
    """A factory of dsm/programs/<name>.py instances that keeps each one in `programs`."""

    def make() -> ckpt.Program:
        programs.append(program_class(name)())
        return programs[-1]  # type: ignore[no-any-return]

    return make


def _plain_hosts(rank: int) -> PluginHost:
    plugins = PluginHost()
    plugins.add_hookspecs(dsm.hookspecs)
    plugins.register(ckpt_remotelog, "remotelog")
    return plugins


def test_with_logging_off_the_dsm_fires_no_hook_of_the_plugin() -> None:
    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, "async")
        rt.at_end(memory.close)
        return memory._fire, memory.twin_homes, dict(memory.extensions)

    for fire, twins, extensions in run_threads(
        2, body, first_device=FIRST_HCA, plugins=_plain_hosts, options={"logging": "off"}
    ):
        assert fire == frozenset({"dsm_attached"}) and not twins and not extensions


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_tiny_ring_asks_for_the_owners_checkpoint_waits_and_loses_nothing(protocol: str) -> None:
    """Rank 1 writes rank 0's page in many intervals; each rank checkpoints (and discards) only when asked.

    Rank 0 even waits until rank 1 is blocked on the full ring (its statistics say so) before it
    takes its checkpoint, so the writer's wait is exercised every time.
    """
    intervals, words = 60, 64
    asked: list[set[int]] = [set(), set()]
    lock_asked = threading.Lock()
    discarded: list[Record] = []
    done = threading.Event()
    memories: list[Any] = [None, None]

    def ask(owner: int) -> None:
        with lock_asked:
            asked[owner].add(owner)

    def take_if_asked(rank: int, log: RemoteLog) -> None:
        with lock_asked:
            wanted, asked[rank] = bool(asked[rank]), set()
        if wanted:
            log.ckpt_precheckpoint(independent=False)  # as coordinated: it releases the home diff log too
            own = log.writer.read_own(log.writer.own_head)
            discarded.extend(log.discard())
            discarded.extend(r for r in own if r.position < log.writer.own_head)  # its own ring's head moved too

    def body(rt: ThreadRuntime) -> Any:
        rt.checkpoint_rank = ask  # type: ignore[attr-defined]  (the runtime's, when single-rank checkpoints exist)
        memory = memories[rt.rank] = dsm.attach(rt, protocol)
        rt.at_end(memory.close)
        log: RemoteLog = memory.extensions["remotelog"]
        a = memory.array((words,), np.float64)
        lock = memory.lock()  # homed at rank 0
        if rt.rank == 0:
            with a.write(slice(0, words)) as v:
                v[:] = 0  # rank 0 becomes the page's home
        memory.barrier()
        if rt.rank == 1:
            try:
                for i in range(intervals):
                    take_if_asked(1, log)  # this rank's own step boundary
                    with lock:
                        with a.write(slice(i % words, i % words + 1)) as v:
                            v[:] = i + 1
            finally:
                done.set()
        else:
            while not done.wait(0.005):  # rank 0's step boundaries: checkpoint once the writer is stuck
                if memories[1].statistics().log_full_waits > 0:
                    take_if_asked(0, log)
        ask(rt.rank)
        take_if_asked(rt.rank, log)  # a last checkpoint each, so the barrier's records find room
        memory.barrier()
        return memory.statistics(), log.remote_records()[0] + log.writer.read_own(log.writer.own_head)

    out = run_threads(
        2,
        body,
        first_device=FIRST_HCA,
        plugins=_plain_hosts,
        options={"dsm_protocol": protocol, "logging": "remote", "log_ring_bytes": 2048},
    )
    writer_stats = out[1][0]
    assert writer_stats.log_full_checkpoints > 0 and writer_stats.log_full_waits > 0
    every = [r for r in discarded + out[0][1] if r.kind == RecordKind.DIFF]
    assert sorted((r.writer, r.interval) for r in every) == [(1, i) for i in range(1, intervals + 1)]
    assert len({(r.writer, r.position) for r in every}) == len(every)
    own = [r for r in discarded + out[1][1] if r.writer == 1 and r.kind in OWN_KINDS]
    assert sorted(r.serial for r in own) == list(range(len(own)))  # rank 1's every acquire, release and barrier
    assert sum(1 for r in own if r.kind == RecordKind.NOTICES) == intervals


def _fill_rank_0s_log_ring(
    protocol: str, writer: int, other: Callable[[dsm.Memory, threading.Event], None]
) -> tuple[str, float]:
    """Rank `writer` writes rank 0's one page in 200 intervals of one step, a whole page's diff each: they fill
    rank 0's log ring at rank 1 (16 KiB), which only rank 0's own checkpoint can empty (asked for, never
    taken).  The other rank runs `other(memory, done)`; `done` is set once the writer stopped writing.  The
    writer's error and how long it wrote; the test fails if nothing did."""
    failed: list[tuple[str, float]] = []
    done = threading.Event()

    def body(rt: ThreadRuntime) -> None:
        rt.checkpoint_rank = lambda owner: None  # type: ignore[attr-defined]  (asked, never at a step boundary)
        memory = dsm.attach(rt, protocol)
        a = memory.array((512,), np.float64)  # one page
        lock = memory.lock()
        if rt.rank == 0:
            with a.write(slice(0, 512)) as v:
                v[:] = 0  # rank 0 becomes the page's home
        memory.barrier()
        if rt.rank != writer:
            other(memory, done)
            return
        started = time.monotonic()
        try:
            for i in range(200):
                with lock, a.write(slice(0, 512)) as v:
                    v[:] = i + 1
        except ckpt.PluginError as exc:  # the DsmError, out of the plugin's hook
            failed.append((str(exc), time.monotonic() - started))
        finally:
            done.set()
        if writer != 0:
            memory.barrier()  # the one rank 0 waits in: it goes on (nothing more is logged into its ring)

    options = {"dsm_protocol": protocol, "logging": "remote", "log_ring_bytes": 16384}
    run_threads(2, body, first_device=FIRST_HCA, plugins=_plain_hosts, options=options)
    assert len(failed) == 1, "rank 0's log ring never filled"
    return failed[0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_home_that_fills_its_own_log_ring_mid_step_fails_at_once(protocol: str) -> None:
    """Rank 0 fills its own log ring with its own diffs, mid-step, where it cannot take the checkpoint that would
    empty it.  Waiting for room could only end in the 60 s timeout (an IS of 2**18 keys did, on 4 MiB rings);
    it fails at once, saying what to raise."""

    def wait_for_the_writer(memory: dsm.Memory, done: threading.Event) -> None:
        assert done.wait(30)

    message, seconds = _fill_rank_0s_log_ring(protocol, 0, wait_for_the_writer)
    assert "the log ring of rank 0 at rank 1 is full" in message and "raise --log-ring-bytes" in message, message
    assert seconds < 10, f"the home waited {seconds:.1f} s for a checkpoint only it could take"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_writer_whose_owners_ring_is_full_fails_at_once_while_that_owner_waits_in_a_barrier(protocol: str) -> None:
    """Rank 1 fills rank 0's log ring while rank 0 waits in a barrier for it: rank 0's checkpoint, the only one
    that empties the ring, can come only after that barrier.  Waiting for room could only end in the 60 s
    timeout; rank 1 reads rank 0's wait word and fails at once."""

    def wait_in_a_barrier(memory: dsm.Memory, done: threading.Event) -> None:
        memory.barrier()

    message, seconds = _fill_rank_0s_log_ring(protocol, 1, wait_in_a_barrier)
    assert "the log ring of rank 0 at rank 1 is full" in message and "waits in barrier 2" in message, message
    assert "raise --log-ring-bytes" in message, message
    assert seconds < 10, f"the writer waited {seconds:.1f} s for a checkpoint its owner could not take"


NO_ROOM = 1 << 40  # a head the ring never reaches


def _blocked_writer_fails(log: RemoteLog, owner: int, needed: int = NO_ROOM) -> bool:
    """Whether a writer blocked on `owner`'s full log ring (needing head `needed`) fails at once now."""
    try:
        log.writer._owner_waits_for_this_rank(owner, "full", log.log_home(owner), LOG, needed)
    except DsmError:
        return True
    return False


def _soon(condition: Callable[[], bool], what: str) -> bool:
    """Whether `condition` holds within 10 s (the owner publishes its wait once it has waited WAKE seconds).  False,
    not an error, on a timeout: the ranks go on, so the test ends on its verdicts rather than hangs."""
    try:
        return bool(wait_for(condition, 10, what))
    except AssertionError:
        return False


def test_a_writer_blocked_on_a_full_ring_fails_at_once_when_its_owner_waits_for_it_in_a_barrier_or_a_lock() -> None:
    """The owner's wait word (`RemoteLog._publish_wait`), set from a real wait: rank 0 waits in a barrier rank 1
    has not entered, then for a lock rank 1 holds -- rank 1, blocked on rank 0's full ring, would fail at once
    -- and then for a lock rank 2 holds, which rank 1 need not release: there it keeps waiting."""

    looked = threading.Event()

    def body(rt: ThreadRuntime) -> list[bool | None]:
        memory = dsm.attach(rt, "async")
        log: RemoteLog = memory.extensions["remotelog"]
        mine, theirs = memory.lock(), memory.lock()
        memory.barrier()
        verdicts: list[bool | None] = []
        if rt.rank == 1:
            verdicts.append(_soon(lambda: _blocked_writer_fails(log, 0), "rank 0 waits in barrier 2"))
        memory.barrier()
        if rt.rank == 1:
            mine.acquire()
        elif rt.rank == 2:
            theirs.acquire()
        rt.barrier()  # the locks are held
        if rt.rank == 0:
            with mine:  # waits for rank 1
                pass
        elif rt.rank == 1:
            verdicts.append(_soon(lambda: _blocked_writer_fails(log, 0), "rank 0 waits for a lock rank 1 holds"))
            mine.release()
        rt.barrier()
        if rt.rank == 0:
            with theirs:  # waits for rank 2
                pass
        elif rt.rank == 1:
            said = _soon(lambda: log.writer.read_word(0, WAITS, 0) < 0, "rank 0 to say it waits for a lock")
            verdicts.append(_blocked_writer_fails(log, 0) if said else None)  # None: the word never came
            looked.set()
        else:
            assert looked.wait(30)  # rank 2: rank 1 has looked; rank 0 gets the lock now
            theirs.release()
        memory.barrier()
        return verdicts

    options = {"dsm_protocol": "async", "logging": "remote"}
    assert run_threads(3, body, first_device=FIRST_HCA, plugins=_plain_hosts, options=options)[1] == [True, True, False]


def test_a_writer_blocked_on_a_full_ring_keeps_waiting_while_its_owner_may_still_make_room() -> None:
    """The wait word makes a blocked writer fail only when no discard of the owner's last checkpoint is left to
    retry, and only for a barrier the writer has not entered: one the writer has passed (the owner has not
    taken in its reply yet) ends without the writer; a stopped discard, retried while the owner waits, may pass
    a dead writer's hole -- and its last retry may have made room just before the word was set (the writer
    reads the head again)."""
    # (barrier after the writer's epoch, a stopped discard pending, the head the writer needs)
    cases = [(0, False, NO_ROOM), (1, False, NO_ROOM), (1, True, NO_ROOM), (1, False, 0)]

    def body(rt: ThreadRuntime) -> list[bool]:
        memory = dsm.attach(rt, "async")
        memory.barrier()  # epoch 1 on both ranks
        log: RemoteLog = memory.extensions["remotelog"]
        verdicts = []
        for ahead, pending, needed in cases:
            if rt.rank == 0:
                memory.waiting_for, log.pending = ("barrier", memory.epoch + ahead), {"stopped": 1} if pending else None
                log._publish_wait()
            rt.barrier()  # rank 0's word is set
            if rt.rank == 1:
                verdicts.append(_blocked_writer_fails(log, 0, needed))
            rt.barrier()  # rank 1 has read it
        memory.waiting_for, log.pending = None, None
        memory.barrier()
        return verdicts

    options = {"dsm_protocol": "async", "logging": "remote"}
    failed_at_once = run_threads(2, body, first_device=FIRST_HCA, plugins=_plain_hosts, options=options)[1]
    assert failed_at_once == [False, True, False, False]


def test_a_homes_own_diffs_ask_for_a_coordinated_checkpoint_again_after_each_release() -> None:
    """onesided: a home whose pages only it writes keeps its own HOME_DIFFs beside its home diff log.  Past half
    the ring's capacity they ask for a coordinated checkpoint; the checkpoint releases them, and the next fill
    must ask again -- the ring's head, which keys the request, never moves when nobody else writes there."""
    asked = {"coordinated": 0, "rank": 0}
    kept: list[int] = []

    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, "onesided")
        rt.at_end(memory.close)
        log: RemoteLog = memory.extensions["remotelog"]
        a = memory.array((512,), np.float64)  # one page, homed at rank 0
        lock = memory.lock()  # homed at rank 0
        if rt.rank == 0:
            with a.write(slice(0, 512)) as v:
                v[:] = 0
        memory.barrier()
        if rt.rank == 0:

            def coordinated() -> int:
                asked["coordinated"] += 1
                return 0

            def by_rank(rank: int) -> int:
                asked["rank"] += 1
                return 0

            rt.checkpoint, rt.checkpoint_rank = coordinated, by_rank  # type: ignore[method-assign,attr-defined]
            answered = dict(asked)
            for i in range(150):
                if asked != answered:  # this rank's step boundary: the checkpoint asked for
                    independent = asked["coordinated"] == answered["coordinated"]
                    answered = dict(asked)
                    log.ckpt_precheckpoint(independent=independent)
                    log.discard()
                    if not independent:
                        kept.append(len(log.own_diffs))
                with lock:
                    with a.write(slice(i % 64 * 8, i % 64 * 8 + 8)) as v:
                        v[:] = i + 1
                assert all(r.writer != 0 for r in log.home_log.records())  # none of its own went into the ring
        memory.barrier()
        return None

    run_threads(
        2,
        body,
        first_device=FIRST_HCA,
        plugins=_plain_hosts,
        options={"dsm_protocol": "onesided", "logging": "remote", "log_ring_bytes": 4096},
    )
    assert asked["coordinated"] >= 3, asked  # asked again after every release, not once for good
    assert kept and all(n == 0 for n in kept), kept  # each coordinated checkpoint released them all


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_checkpoint_discards_what_it_covers_and_nothing_after_it(protocol: str) -> None:
    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, protocol)
        rt.at_end(memory.close)
        log: RemoteLog = memory.extensions["remotelog"]
        a = memory.array((SIZE * 512,), np.float64)
        lock = memory.lock()

        def work(value: float) -> None:
            with lock:
                with a.write(slice(0, 512 * SIZE)) as v:
                    v[rt.rank :: SIZE] = value
            memory.barrier()

        work(1.0)
        rt.barrier()  # every rank at a "step boundary": a coordinated checkpoint
        log.ckpt_precheckpoint(independent=False)
        rt.barrier()
        own_before = log.writer.read_own(log.writer.own_head)
        dropped = log.discard() + [r for r in own_before if r.position < log.writer.own_head]
        rt.barrier()
        left = log.remote_records()[0] + log.writer.read_own(log.writer.own_head)
        home_left = log.home_log.records()
        rt.barrier()
        work(2.0)
        log.flush()
        rt.barrier()
        after = log.remote_records()[0] + log.writer.read_own(log.writer.own_head)
        return len(dropped), left, home_left, after

    out = run_threads(
        SIZE,
        body,
        first_device=FIRST_HCA,
        plugins=_plain_hosts,
        options={"dsm_protocol": protocol, "logging": "remote"},
    )
    for rank, (dropped, left, home_left, after) in enumerate(out):
        assert dropped > 0 and left == [] and home_left == []
        assert {r.kind for r in after if r.writer == rank} >= {RecordKind.NOTICES, RecordKind.BARRIER}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stable_logging_fsyncs_at_every_release_and_barrier_and_its_file_holds_the_records(
    protocol: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_remotelog import _stable

    fsyncs = Counter[int]()
    real = _stable.os.fsync

    def counted(fd: int) -> None:
        fsyncs[threading.get_ident()] += 1
        real(fd)

    monkeypatch.setattr(_stable.os, "fsync", counted)
    programs: list[Any] = []

    def make() -> ckpt.Program:
        programs.append(program_class("tsp")())
        return programs[-1]

    results = ckpt.testing.run_program(
        make,
        SIZE,
        argv=["8", "3", "8"],
        options={"dsm_protocol": protocol, "logging": "stable", "log_dir": str(tmp_path)},
        first_device=FIRST_HCA,
        plugins=_plain_hosts,
        finish=lambda p: None,
    )
    assert all("numpy=match" in line for line in results)
    for program in programs:
        stats = program.mem.statistics()
        log = program.mem.extensions["remotelog"]
        records = walk(log.path.read_bytes(), 0)
        assert stats.stable_fsyncs > 0 and len(records) == stats.stable_records
        assert (
            sum(1 for r in records if r.kind == RecordKind.NOTICES)
            + sum(1 for r in records if r.kind == RecordKind.BARRIER)
            <= stats.lock_acquires + stats.barriers
        )
        assert stats.stable_fsyncs <= stats.lock_acquires + stats.barriers  # at most one per release / barrier
        program.mem.close()
    assert sum(fsyncs.values()) == sum(p.mem.statistics().stable_fsyncs for p in programs)


def test_the_recovery_answer_follows_the_logging_mode(tmp_path: Any) -> None:
    from ckpt.plugin import JobInfo

    def job(mode: str) -> JobInfo:
        return JobInfo(job="j", ckpt_dir=tmp_path, transport="simib", host="127.0.0.1", options={"logging": mode})

    # remote logging recovers a DSM rank by replay, answering for the DSM and the verbs plugin beneath it;
    # stable logs are on the failed rank's own disk: refused in one line; off keeps no cross-rank state
    assert ckpt_remotelog.ckpt_single_rank_recovery(job("remote")) == ["ib", "dsm"]
    answer = ckpt_remotelog.ckpt_single_rank_recovery(job("stable"))
    assert isinstance(answer, str) and "\n" not in answer and "--logging remote" in answer
    assert ckpt_remotelog.ckpt_single_rank_recovery(job("off")) is None


def test_the_launcher_refuses_what_every_rank_would_refuse_at_attach(tmp_path: Any) -> None:
    from ckpt.plugin import JobInfo

    def start(size: int, **options: Any) -> None:
        info = JobInfo(job="j", ckpt_dir=tmp_path, transport="simib", host="127.0.0.1", options=options, size=size)
        ckpt_remotelog.ckpt_job_start(info)

    start(4, logging="remote", log_home_offset=3, log_ring_bytes=ckpt_remotelog.MIN_CAPACITY)
    start(1, logging="remote", log_home_offset=0)  # one rank: its own log home, whatever the offset
    start(4, logging="stable", log_home_offset=4, log_ring_bytes=0)  # what is not remote logging is not looked at
    with pytest.raises(ckpt.CkptError, match="--log-home-offset 4 makes every rank its own log home with 2 ranks"):
        start(2, logging="remote", log_home_offset=4)
    for small in (0, -8, ckpt_remotelog.MIN_CAPACITY - 8):
        with pytest.raises(ckpt.CkptError, match=f"--log-ring-bytes {small}: a log ring needs at least"):
            start(4, logging="remote", log_ring_bytes=small)


def test_a_ring_wraps_and_a_record_is_committed_only_by_its_own_commit_word() -> None:
    from ckpt import verbs

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        ring = LogRing(verbs.PD(ctx), 512)
        written = []
        for i in range(20):
            record = encode(RecordKind.NOTICES, 3, bytes([i]) * (i % 40), serial=i)
            if not ring.append_local(record):
                ring.set_head(ring.committed_end())  # the owner discards everything: room again
                assert ring.append_local(record)
            written.append(i)
        assert [r.serial for r in ring.records()] == written[-len(ring.records()) :]
        assert ring.tail > ring.capacity  # it wrapped
        stale = bytearray(ring.contents(ring.head, ring.tail))
        assert len(walk(stale, ring.head + 8)) == 0  # the same bytes at another position are not records
    finally:
        ctx.close()


def _apply(wrs: list[Any], placed: Any = None) -> None:
    """Carry out RDMA WRITEs between buffers of this process, in order (what the log home's HCA does).

    `placed(i)`: only the bytes of the WRITEs' i-th byte on (counted over all of `wrs`) for which it is
    true -- a WRITE placed in part, in no particular order.
    """
    import ctypes

    from ckpt import verbs

    at = 0
    for wr in wrs:
        assert wr.opcode == verbs.IBV_WR_RDMA_WRITE
        src, dst, n = wr.sg[0].addr, wr.remote_addr, wr.sg[0].length
        if placed is None:
            ctypes.memmove(dst, src, n)
        else:
            for k in range(n):
                if placed(at + k):
                    ctypes.memmove(dst + k, src + k, 1)
        at += n


@pytest.mark.parametrize("tail", [0, 320], ids=["in-one-piece", "across-the-end"])
def test_a_batch_is_one_write_and_a_record_is_committed_only_when_whole(tail: int) -> None:
    """k records to one ring are one WRITE (two across the ring's end), commit words and all; whatever order
    its bytes land in, a record is invisible until every one of its bytes has landed (its check), and the
    others are whole meanwhile."""
    from types import SimpleNamespace

    from ckpt import verbs
    from ckpt_remotelog._writer import IDLE, OWN, RingWriter

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        ring = LogRing(pd, 512)
        ring.control[0] = ring.control[1] = tail  # the ring's state: `tail` bytes appended and discarded
        peers = [{LOG: ring.address(), OWN: LogRing(pd, 512).address()}]
        writer = RingWriter(
            SimpleNamespace(pd=pd), peers, 512, lambda *a: 0, lambda *a: None, 0, np.full(2, IDLE, np.int64)
        )
        batch = [encode(RecordKind.NOTICES, 0, bytes([i + 1]) * (8 * i + 8), serial=i) for i in range(3)]
        sizes = [len(r) for r in batch]
        wrs: list[Any] = []
        writer._place(0, LOG, tail, [bytearray(r) for r in batch], 0, wrs)
        ring.control[0] = tail + sum(sizes)  # the FETCH_AND_ADD's share
        assert len(wrs) == (2 if tail == 320 else 1)
        middle = sizes[0] + sizes[1] - 3  # a byte of the second record's payload
        _apply(wrs, lambda k: k % 8 == 0 or k >= sizes[0] + sizes[1])  # each commit word, the third record whole
        assert [r.serial for r in ring.scan(1)] == [2]  # the commit words alone commit nothing
        _apply(wrs, lambda k: k != middle)  # all but one byte
        assert [r.serial for r in ring.scan(1)] == [0, 2]  # the torn one fails its check ...
        assert [r.serial for r in ring.records()] == [0]  # ... and a walk stops there
        _apply(wrs, lambda k: k == middle)
        found = ring.records()
        assert [r.serial for r in found] == [0, 1, 2]
        assert [r.payload for r in found] == [bytes([i + 1]) * (8 * i + 8) for i in range(3)]
        assert found[0].position == tail and ring.committed_end() == ring.tail
    finally:
        ctx.close()


def test_a_record_with_any_byte_changed_is_not_committed() -> None:
    """The check covers the whole record, header and padding too; `seal` at another position gives
    another record."""
    record = encode(RecordKind.DIFF, 2, b"abcde", interval=7, gid=9)
    sealed = bytes(seal(bytearray(record), 64))
    assert decode_at(sealed, 0, 64) is not None
    for k in range(len(sealed)):
        bent = bytearray(sealed)
        bent[k] ^= 0x10
        assert decode_at(bent, 0, 64) is None, k
    assert decode_at(seal(bytearray(record), 72), 0, 64) is None


def test_a_diff_record_holds_an_intervals_diffs_of_several_pages_and_reads_back_one_per_page() -> None:
    """One DIFF (or HOME_DIFF) record per interval and ring: `per_page` gives each page's diff, in the order
    written, with the record's position and header; a payload that is not one is refused in one line."""
    diffs = [(1 << 32 | 3, Diff.of_runs([(8, b"a" * 8)])), (7, Diff.of_runs([(0, b"b"), (40, b"cc")]))]
    record = diff_record(RecordKind.DIFF, 2, 9, [(gid, diff.encode()) for gid, diff in diffs])
    found = decode_at(seal(record, 128), 0, 128)
    assert found is not None and found.gid == diffs[0][0] and found.gids == (diffs[0][0], 7)
    assert gids_of(record) == found.gids
    home = parse(as_kind(record, RecordKind.HOME_DIFF))  # the same diffs in the home's diff log, built once
    assert home == parse(record)._replace(kind=RecordKind.HOME_DIFF) and parse(record).kind == RecordKind.DIFF
    pages = per_page(found)
    assert [(r.position, r.kind, r.writer, r.interval, r.gid) for r in pages] == [
        (128, RecordKind.DIFF, 2, 9, gid) for gid, _ in diffs
    ]
    assert [list(Diff.decode(r.payload)) for r in pages] == [list(diff) for _, diff in diffs]
    zero_sized = diff_record(RecordKind.DIFF, 2, 9, [(5, b""), (6, diffs[0][1].encode())])
    for payload in (
        b"",
        b"\0\0\0\0",
        found.payload[:-1],
        found.payload + b"x",
        b"\xff" * 16,
        parse(zero_sized).payload,
    ):
        with pytest.raises(dsm.DsmError, match=r"^malformed diff record: "):
            per_page(found._replace(payload=payload))


def test_a_checkpoint_covers_a_diff_record_only_when_its_image_holds_every_page_of_it() -> None:
    """The discard's test (`RemoteLog.covered`): a record of several pages, one of which the image does not hold
    yet (a diff still arriving there when it was taken), keeps the ring's head before it."""
    applied = [np.zeros((4, SIZE), dtype=np.int64), np.zeros((2, SIZE), dtype=np.int64)]
    record = parse(diff_record(RecordKind.DIFF, 1, 3, [(0 << 32 | 2, b"a"), (1 << 32 | 1, b"b")]))
    covered = lambda arrays: RemoteLog.covered(RemoteLog.__new__(RemoteLog), record, {"applied": arrays})  # noqa: E731
    assert not covered(applied)
    applied[0][2, 1] = 3  # the first page holds writer 1's interval 3 ...
    assert not covered(applied)  # ... the second does not
    applied[1][1, 1] = 4
    assert covered(applied)
    assert not covered(applied[:1])  # the second page's array was made after the image


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_own_records_cost_no_reservation_round(protocol: str) -> None:
    """A rank's own records go to its own ring at its log home, which only it writes: no FETCH_AND_ADD.  A
    critical section that wrote costs one reservation round (its interval's diff records), one that wrote
    nothing none -- two each with the own records in the shared log ring.  Either way the own ring holds,
    in serial order, NOTICES then RELEASE, the log ring none of them, and the RELEASE of the section that
    wrote carries (gid) the interval of its diffs: what a recovery compares own DIFFs with."""

    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, protocol)
        rt.at_end(memory.close)
        log: RemoteLog = memory.extensions["remotelog"]
        a = memory.array((2 * 512,), np.float64)
        lock = memory.lock()  # homed at rank 0
        if rt.rank == 1:
            with a.write(slice(512, 1024)) as v:
                v[:] = 0  # rank 1 becomes the second page's home
        memory.barrier()
        out: Any = None
        if rt.rank == 1:
            log.flush()
            rounds = memory.counters.messages
            before = rounds["log_fetch_add"]
            with lock:
                with a.write(slice(0, 1024)) as v:  # rank 0's page and its own
                    v[:] = 1.0
            wrote = rounds["log_fetch_add"] - before
            with lock:
                a.read(slice(0, 8))
            idle = rounds["log_fetch_add"] - before - wrote
            ring = log.remote_records()[0]
            own = log.writer.read_own(log.writer.own_head)
            diff = max(r.interval for r in ring if r.kind == RecordKind.DIFF and r.writer == 1)
            releases = [r for r in own if r.kind == RecordKind.RELEASE]
            shared = [r.kind for r in ring if r.kind in OWN_KINDS]
            state = log.writer.__getstate__()
            pickled = state["own_head"] == log.writer.own_tail > log.writer.own_head
            out = wrote, idle, [r.kind for r in own][-4:], releases[-2].gid == diff, shared, pickled
        memory.barrier()
        return out

    out = run_threads(
        2,
        body,
        first_device=FIRST_HCA,
        plugins=_plain_hosts,
        options={"dsm_protocol": protocol, "logging": "remote"},
    )
    wrote, idle, kinds, ordered, shared, pickled = out[1]
    assert (wrote, idle, shared) == (1, 0, [])
    assert pickled  # an image's own head is its own tail: a rank recovered from it has an empty own ring
    assert kinds == [RecordKind.NOTICES, RecordKind.RELEASE] * 2 and ordered


class _LoopNic:
    """The client endpoint of a `RingWriter` in one process: every WR is carried out as it is posted (WRITE,
    READ, FETCH_AND_ADD between this process's buffers), its completion shows at the next `wait`."""

    def __init__(self, peers: int) -> None:
        from dsm._net import UP

        self.state, self.link = [UP] * peers, [0] * peers
        self.lock = threading.Lock()
        self.rdma_done: set[int] = set()
        self.pending: set[int] = set()
        self.events: list[tuple[Any, ...]] = []  # ("post", peer, [(opcode, remote addr)]) and ("wait",)
        self.qps = [SimpleNamespace(post_send=lambda wr, peer=peer: self._post(peer, wr)) for peer in range(peers)]
        self.on_stuck = None

    report_stuck = Endpoint.report_stuck  # (a long wait is reported as by the DSM's endpoint, through `on_stuck`)

    def _post(self, peer: int, wr: Any) -> None:
        import ctypes

        from ckpt import verbs

        done = []
        while wr is not None:
            sge = wr.sg[0]
            if wr.opcode == verbs.IBV_WR_RDMA_WRITE:
                ctypes.memmove(wr.remote_addr, sge.addr, sge.length)
            elif wr.opcode == verbs.IBV_WR_RDMA_READ:
                ctypes.memmove(sge.addr, wr.remote_addr, sge.length)
            else:  # FETCH_AND_ADD
                word = ctypes.c_int64.from_address(wr.remote_addr)
                ctypes.c_int64.from_address(sge.addr).value = word.value
                word.value += wr.compare_add
            done.append((wr.opcode, wr.remote_addr))
            if wr.send_flags & verbs.IBV_SEND_SIGNALED:
                self.pending.add(wr.wr_id)
            wr = wr.next_wr
        self.events.append(("post", peer, done))

    def wait(self, ready: Any, what: str) -> None:
        self.rdma_done |= self.pending
        self.pending = set()
        self.events.append(("wait",))
        assert ready(), what

    def run(self, peer: int, wrs: list[Any], seq: list[int]) -> None:
        from dsm._net import chain

        self._post(peer, chain(wrs))
        self.events.append(("wait",))


def _loop_writer(pd: Any, peers: list[dict[str, dict[str, int]]], staging: int) -> tuple[_LoopNic, Any]:
    """A `RingWriter` of rank 0 (its own ring at peer 0) over a `_LoopNic`, with no DSM memory behind it."""
    from ckpt_remotelog._writer import IDLE, RingWriter

    nic = _LoopNic(len(peers))
    memory = SimpleNamespace(pd=pd, client=nic, seq=[0], rank=0, counters=SimpleNamespace(count=lambda *a: None))
    memory.account = lambda name, amount=1: None
    return nic, RingWriter(
        memory, peers, staging, lambda *a: 0, lambda *a: None, 0, np.full(2 * len(peers), IDLE, np.int64)
    )


@contextlib.contextmanager
def _two_rings() -> Iterator[tuple[list[LogRing], Any, Any]]:
    """Two 1 KiB log rings, at peers 0 and 1, and rank 0's `RingWriter` over a `_LoopNic` (`_loop_writer`):
    every ring's owner is rank 0, the writer; single-rank checkpoints exist, and are never taken."""
    from ckpt import verbs
    from ckpt_remotelog._writer import LOG, OWN

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        rings, own = [LogRing(pd, 1024), LogRing(pd, 1024)], LogRing(pd, 1024)
        peers = [{LOG: rings[0].address(), OWN: own.address()}, {LOG: rings[1].address(), OWN: own.address()}]
        nic, writer = _loop_writer(pd, peers, 1024)
        writer.memory.rt = SimpleNamespace(checkpoint_rank=lambda rank: None)
        yield rings, nic, writer
    finally:
        ctx.close()


def test_a_home_whose_log_ring_its_own_diffs_filled_retries_its_discard_before_it_fails() -> None:
    """`wait_for_room` where the full ring's owner is the writer itself: no checkpoint can come mid-step, but the
    discard of its last checkpoint, stopped at a hole, may pass it now (`RemoteLog.retry_now`).  Room made by
    that retry lets the record go; none, and it fails at once."""
    from ckpt_remotelog._writer import LOG

    with _two_rings() as (rings, _, writer):  # every ring's owner is rank 0, the writer
        tries: list[int] = []
        writer.retry = lambda: tries.append(1)  # a retry that passes nothing
        with pytest.raises(DsmError, match="only its own checkpoint, which it cannot take mid-step"):
            writer.wait_for_room(1, LOG, 64)
        assert tries == [1]
        writer.retry = lambda: rings[1].set_head(64)  # ... and one that passes the hole
        writer.wait_for_room(1, LOG, 64)


def test_a_writer_waiting_for_room_in_a_full_ring_is_reported_until_the_room_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ckpt status` shows a writer's wait for its ring owner's checkpoint once it lasts (dsm._waits), and no
    longer once the owner's discard made room."""
    import dsm._net
    from ckpt_remotelog._writer import LOG

    monkeypatch.setattr(dsm._net, "STUCK_AFTER", 0.05)
    with _two_rings() as (rings, nic, writer):
        writer.owner = lambda peer, which: 1  # the ring at peer 1 is rank 1's: only its checkpoint makes room
        writer.ask = lambda *args, **kwargs: None
        shown: list[tuple[str, str]] = []

        def on_stuck(what: str, waited: float) -> Any:
            assert waited >= 0.05
            shown.append(("shown", what))
            rings[1].set_head(64)  # the owner's discard, once the wait is shown
            return lambda: shown.append(("gone", what))

        nic.on_stuck = on_stuck
        writer.wait_for_room(1, LOG, 64)
    what = "room in the log ring of rank 1 at rank 1"
    assert shown == [("shown", what), ("gone", what)]


def test_a_discard_retried_while_a_batch_waits_for_room_does_not_overwrite_the_batch() -> None:
    """A batch for two rings: ring 0 of another home, and ring 1, full of this rank's own home's records.  Waiting
    for room in ring 1, the writer retries its stopped discard, which READs ring 1 into the staging buffer --
    where ring 0's records were already staged, before every ring's room was made first: their WRITE then
    carried ring 1's bytes, and ring 0's record was lost without an error."""
    from ckpt_remotelog._writer import LOG

    with _two_rings() as (rings, _, writer):
        late = encode(RecordKind.DIFF, 0, b"B" * 64, interval=2, gid=8)
        for size in (200, 200, 200, 64, 32, 8, 0):  # ring 1 full of committed records: no room for `late`
            while rings[1].append_local(encode(RecordKind.DIFF, 0, b"z" * size, interval=1, gid=5)):
                pass
        assert rings[1].tail - rings[1].head + len(late) > rings[1].capacity

        def retry() -> None:  # what `RemoteLog.retry_discard` does: read the ring, then pass what is covered
            records, _ = writer.read_ring(1, LOG, holes=True)
            rings[1].set_head(records[-1].position + records[-1].size)

        writer.retry = retry
        writer.add(0, LOG, encode(RecordKind.DIFF, 0, b"A" * 64, interval=2, gid=7))  # staged first
        writer.add(1, LOG, late)  # needs room
        writer.start()
        writer.complete()
        assert [(r.gid, r.payload) for r in rings[0].records()] == [(7, b"A" * 64)]
        assert [r.gid for r in rings[1].records()] == [8]


def test_a_ring_read_first_waits_for_the_writes_that_gather_from_its_staging_buffer() -> None:
    """`read_ring` READs into the staging buffer a batch's WRITEs gather their bytes from (on the packet path, as
    they are transmitted).  A discard's retry can come while such WRITEs are in flight (`dsm_waiting`, while a
    diff's acknowledgment is awaited): the read waits for them first."""
    from ckpt_remotelog._writer import LOG

    with _two_rings() as (_, nic, writer):
        writer.add(1, LOG, encode(RecordKind.DIFF, 0, b"d" * 16, interval=1, gid=7))
        writer.start()
        writer.write()  # the batch's WRITE is posted, not waited for
        assert writer.writing
        nic.events.clear()
        records, _ = writer.read_ring(1, LOG)
        first_read = next(k for k, e in enumerate(nic.events) if e[0] == "post")
        assert ("wait",) in nic.events[:first_read] and not writer.writing
        assert [r.kind for r in records] == [RecordKind.DIFF]


@pytest.mark.parametrize("elsewhere", [True, False], ids=["diffs-at-two-log-homes", "diffs-at-its-own-log-home"])
def test_a_release_record_is_written_only_once_its_intervals_records_are_complete(elsewhere: bool) -> None:
    """`RingWriter.own(last=True)`: a RELEASE goes out only after every other WRITE of its batch has completed
    when some of them go to another log home, over another QP (RC orders one QP's WRITEs only); when they
    all go to its own log home, on the QP it uses too, right behind them, with no wait in between."""
    from ckpt import verbs
    from ckpt_remotelog._writer import LOG, OWN

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        rings = [LogRing(pd, 1024), LogRing(pd, 1024)]
        own = LogRing(pd, 1024)  # the releaser's own ring, at peer 0
        peers = [{LOG: rings[0].address(), OWN: own.address()}, {LOG: rings[1].address(), OWN: own.address()}]
        nic, writer = _loop_writer(pd, peers, 1024)
        if elsewhere:
            writer.add(1, LOG, encode(RecordKind.DIFF, 0, b"d" * 16, interval=1, gid=7))  # the page's home's log home
        writer.own(encode(RecordKind.RELEASE, 0, b"", tag=3, gid=1, serial=5), last=True)
        writer.add(0, LOG, encode(RecordKind.DIFF, 0, b"o" * 8, interval=1, gid=9))  # its own home page's
        writer.start()
        assert own.scan(1) == []  # placed, not posted
        writer.complete()
        release_word = own.buf.ctypes.data + CONTROL
        posts = [(k, e) for k, e in enumerate(nic.events) if e[0] == "post"]
        release_post = next(k for k, e in posts if any(addr == release_word for _, addr in e[2]))
        diff_posts = [k for k, e in posts if any(op == verbs.IBV_WR_RDMA_WRITE for op, _ in e[2]) and k != release_post]
        assert len(diff_posts) == (2 if elsewhere else 1) and max(diff_posts) < release_post
        waits = nic.events[max(diff_posts) : release_post].count(("wait",))
        assert waits == (1 if elsewhere else 0)  # the DIFFs completed first, or share its QP
        assert [(r.kind, r.serial) for r in walk(own.contents(0, writer.own_tail), 0)] == [(RecordKind.RELEASE, 5)]
        assert [r.kind for r in rings[0].records()] == [RecordKind.DIFF]
        assert [r.kind for r in rings[1].records()] == ([RecordKind.DIFF] if elsewhere else [])
    finally:
        ctx.close()


def test_a_recovery_reads_its_own_ring_in_growing_pieces_up_to_the_first_record_not_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`RingWriter.read_own` reads `OWN_READ` bytes, then twice as many while the walk reaches the end of what
    was read (a record across the piece's end included, and across the ring's end), and stops at the first
    word that is not a commit word: a record placed and never posted is not returned, nor anything after."""
    from ckpt import verbs
    from ckpt_remotelog import _writer
    from ckpt_remotelog._writer import LOG, OWN

    monkeypatch.setattr(_writer, "OWN_READ", 128)
    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        own = LogRing(pd, 1024)
        nic, writer = _loop_writer(pd, [{LOG: LogRing(pd, 512).address(), OWN: own.address()}], 512)
        writer.own_head = writer.own_tail = 800  # the image's own tail: the records wrap the ring's end
        for i in range(5):
            writer.own(encode(RecordKind.NOTICES, 0, bytes([i]) * (8 * i + 4), gid=i, serial=i))
        writer.own(encode(RecordKind.RELEASE, 0, b"", serial=5), last=True)  # placed, never posted (it died)
        writer.own_tail = writer.own_head = 800
        writer.mine[:] = 0  # what the image's mirror holds does not matter
        nic.events.clear()
        found = writer.read_own(800)
        assert [(r.kind, r.serial, r.payload) for r in found] == [
            (RecordKind.NOTICES, i, bytes([i]) * (8 * i + 4)) for i in range(5)
        ]
        reads = [e for e in nic.events if e[0] == "post"]
        assert len(reads) == 3  # 128, 256, then 512 bytes: the walk ended inside the last piece
    finally:
        ctx.close()


def test_one_rings_share_of_a_batch_is_bounded_by_the_staging_buffer_not_only_by_the_ring() -> None:
    """A home diff log is twice a log ring, the staging buffer as large as a log ring: a batch too large for the
    staging buffer is refused in one line before anything is reserved, never staged past the buffer's end."""
    from ckpt import verbs
    from ckpt_remotelog._writer import HOME, LOG, OWN

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        home = LogRing(pd, 1024)
        peers = [{LOG: LogRing(pd, 512).address(), OWN: LogRing(pd, 512).address(), HOME: home.address()}]
        nic, writer = _loop_writer(pd, peers, 512)
        for i in range(5):  # 5 x 128 bytes: fits the ring, not the staging buffer
            writer.add(0, HOME, encode(RecordKind.HOME_DIFF, 0, bytes(64), interval=i + 1, gid=1))
        with pytest.raises(dsm.DsmError, match=r"640 bytes of log records for one ring exceed 512: raise"):
            writer.start()
        assert nic.events == [] and home.tail == 0
    finally:
        ctx.close()


def test_an_image_with_another_record_format_is_refused() -> None:
    """Its rings' records would fail their checks and read as never written: refused, not silently emptied."""
    old = RemoteLog.__new__(RemoteLog)
    with pytest.raises(dsm.DsmError, match="older ckpt_remotelog"):
        old.__setstate__({"own_ring": None})  # an image from before the check: no record_format
    with pytest.raises(dsm.DsmError, match="another log record format"):
        old.__setstate__({"own_ring": None, "record_format": 1})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_discard_passes_a_hole_no_live_rank_claims_and_never_one_that_a_live_rank_may_fill(protocol: str) -> None:
    """A writer that dies between its FETCH_AND_ADD and its WRITE leaves a hole nobody fills.  Rank 0's discard
    passes such a hole -- else its log ring would never empty again and, once full, fail its writers -- but not
    one a live rank claims (reserved and not yet written), nor any while some rank's reservation is in flight,
    nor space reserved after it read the ring's tail."""
    from ckpt_remotelog._writer import IDLE, IN_FLIGHT, LOG

    def body(rt: ThreadRuntime) -> Any:
        job = _Holes(rt, protocol, LOG)
        writer, home = job.writer, job.peer

        def checkpoint() -> tuple[int, int]:
            """Rank 0's ring head and tail after a coordinated checkpoint's discard."""
            job.checkpoint()
            head, tail = writer.read_word(home, LOG, 8), writer.read_word(home, LOG, 0)
            rt.barrier()  # no rank reserves before all have read them
            return head, tail

        job.work(1.0)
        dead = job.reserve() if rt.rank == 1 else -1  # rank 1 "died" right after its reservation: no claim
        rt.barrier()
        job.work(2.0)
        passed = checkpoint()
        job.work(3.0)
        holes = [job.reserve(), 0, job.reserve()] if rt.rank == 1 else []
        rt.barrier()
        job.work(4.0)
        if rt.rank == 1:  # (set after work(4.0): its own batch ends by clearing rank 1's claims)
            job.claim(holes[2])  # the second one is reserved and not written yet: a live rank's hole
        claimed = checkpoint()
        # no interval here: rank 0 would retry its discard (`retry_discard`) once rank 1's next batch cleared its
        # claims, and pass the holes this checkpoint must find undecided
        if rt.rank == 2:
            job.claim(IN_FLIGHT)  # a reservation whose answer is not back yet
        if rt.rank == 1:
            job.claim(IDLE)  # rank 1 died after all: its hole is nobody's
        in_flight = checkpoint()
        if rt.rank == 2:
            job.claim(IDLE)
        job.work(6.0)
        late: list[int] = []
        if rt.rank == 0:  # a reservation after the discard read the claims, before it reads the ring
            original = writer.lowest_claim

            def then_reserve(peer: int, which: str) -> int | None:
                found = original(peer, which)
                late.append(job.reserve())
                return found

            writer.lowest_claim = then_reserve  # type: ignore[method-assign]
        freed = checkpoint()
        return dead, holes, passed, claimed, in_flight, freed, late

    out = _Holes.run(protocol, body)
    dead, (hole, _, live) = out[1][:2]
    passed, claimed, in_flight, freed, late = out[0][2:]
    assert dead >= 0 and passed[0] == passed[1] > dead  # past the dead hole: everything after it was covered
    assert passed[0] < hole < live < claimed[1] and claimed[0] == live  # past the dead one, up to the live one
    assert in_flight[0] == live  # nothing passed while an answer may still reserve below the tail
    assert freed[0] == late[0] < freed[1]  # all of it released, up to what was reserved after the tail was read


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_discard_stopped_at_a_hole_passes_it_at_a_later_interval_close_with_no_checkpoint(protocol: str) -> None:
    """A discard that cannot yet tell a dead writer's hole (here: a claim's answer in flight) stops there.  It
    must not wait for this rank's next checkpoint, which may never come (the writer that would ask for it can
    be blocked on the full ring while this rank waits for it at a barrier): the owner's next interval close
    tries again with the same checkpoint's coverage and passes the hole once it is known dead."""
    from ckpt_remotelog._writer import IDLE, IN_FLIGHT, LOG

    def body(rt: ThreadRuntime) -> Any:
        job = _Holes(rt, protocol, LOG)
        writer, home, head = job.writer, job.peer, job.head

        job.work(1.0)
        dead = job.reserve() if rt.rank == 1 else -1  # rank 1 "died" right after its reservation: no claim
        rt.barrier()
        job.work(2.0)
        if rt.rank == 2:
            job.claim(IN_FLIGHT)  # a reservation whose answer is not back yet: rank 0 cannot tell the hole
        job.checkpoint()
        stuck, pending = head(), job.log.pending is not None
        rt.barrier()
        if rt.rank == 2:
            job.claim(IDLE)
        rt.barrier()
        first_uncovered = writer.read_word(home, LOG, 0)  # the tail: the next record is rank 0's, after the image
        if rt.rank == 0:  # an interval of rank 0 alone, no checkpoint: nobody reserves meanwhile
            with job.lock:
                with job.array.write(slice(0, 512)) as v:
                    v[0] = 3.0
        rt.barrier()
        passed, done = head(), job.log.pending is None
        retries = job.memory.statistics().log_discard_retries
        rt.barrier()
        return dead, stuck, pending, passed, done, retries, first_uncovered

    out = _Holes.run(protocol, body)
    dead = out[1][0]
    _, stuck, pending, passed, done, retries, first_uncovered = out[0]
    assert dead >= 0 and stuck <= dead and pending  # stopped before the hole, and said so
    assert passed > dead and done and retries >= 1  # passed at the interval's close, no checkpoint between
    assert passed == first_uncovered  # ... and every record that checkpoint covers, up to the first it does not
    assert all(not o[2] and o[5] == 0 for o in out[1:])  # the other rings' discards stopped at no hole


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_discard_stopped_at_a_hole_passes_it_while_its_owner_waits_in_a_barrier(protocol: str) -> None:
    """The case the retry exists for, at its hardest: the owner waits in a barrier for ranks that may be
    blocked on its full log ring, behind a hole that becomes decidable only while it waits.  No interval
    closes and no barrier is arrived at meanwhile: the wait itself (`dsm_waiting`) passes the hole."""
    from ckpt_remotelog._writer import IDLE, IN_FLIGHT, LOG

    arrived = threading.Event()

    class Arrived:
        @ckpt.hookimpl
        def dsm_barrier_arriving(self, epoch: int) -> None:
            arrived.set()  # after remote logging's own arrival (registered after it), which retries too

    def body(rt: ThreadRuntime) -> Any:
        job = _Holes(rt, protocol, LOG)
        job.work(1.0)
        dead = job.reserve() if rt.rank == 1 else -1  # rank 1 "died" right after its reservation: no claim
        rt.barrier()
        job.work(2.0)
        if rt.rank == 2:
            job.claim(IN_FLIGHT)  # undecidable for now
        job.checkpoint()
        stuck, pending = job.head(), job.log.pending is not None
        rt.barrier()
        passed = False
        if rt.rank == 0:
            rt.plugins.register(Arrived(), "arrived")
            job.memory.barrier()  # waits for the others, who wait for its head to move
        else:
            if rt.rank == 2:
                assert arrived.wait(30)
                job.claim(IDLE)  # decidable from now on, while rank 0 waits
            deadline = time.monotonic() + 10.0
            while not passed and time.monotonic() < deadline:
                passed = job.head() > stuck
                time.sleep(0.01)  # polling a remote word: nothing signals a head's move
            job.memory.barrier()
        return dead, stuck, pending, passed

    out = _Holes.run(protocol, body)
    dead, (_, stuck, pending, _) = out[1][0], out[0]
    assert dead >= 0 and stuck <= dead and pending
    assert all(o[3] for o in out[1:]), "the head did not move while rank 0 waited in the barrier"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_discard_that_ends_at_reserved_space_nobody_wrote_yet_retries_it_too(protocol: str) -> None:
    """Space reserved after the ring's last committed record is a hole as well: its writer may still write a
    record the checkpoint covers, or die first.  The discard stops there and says so, and a later interval
    close passes the space once its writer is known dead, up to the first record not covered (right after the
    dead space) -- before, the discard ended there as if done, and it stopped before a dead hole that only an
    uncovered record followed: only the owner's next checkpoints could pass it."""
    from ckpt_remotelog._writer import IDLE, LOG

    def body(rt: ThreadRuntime) -> Any:
        job = _Holes(rt, protocol, LOG)
        writer, home, head = job.writer, job.peer, job.head

        job.work(1.0)
        live = job.reserve() if rt.rank == 1 else -1  # reserved and not written yet: rank 1 claims it
        if rt.rank == 1:
            job.claim(live)
        rt.barrier()
        job.checkpoint()
        stuck, pending = head(), job.log.pending is not None
        rt.barrier()
        if rt.rank == 1:
            job.claim(IDLE)  # rank 1 died after all: nobody writes there
        rt.barrier()
        first_uncovered = writer.read_word(home, LOG, 0)
        if rt.rank == 0:  # an interval of rank 0 alone, no checkpoint
            with job.lock:
                with job.array.write(slice(0, 512)) as v:
                    v[0] = 3.0
        rt.barrier()
        passed, done = head(), job.log.pending is None
        rt.barrier()
        return live, stuck, pending, passed, done, first_uncovered

    out = _Holes.run(protocol, body)
    live = out[1][0]
    _, stuck, pending, passed, done, first_uncovered = out[0]
    assert live >= 0 and stuck == live and pending  # up to the reserved space, and stopped there
    assert passed == first_uncovered > live and done  # passed once dead, up to the first record not covered


def test_strict_operations_never_wait_for_a_failed_peer_nor_go_on_with_its_next_incarnation() -> None:
    """`RingWriter.strict`: a read of a peer that is not up, or whose link was replaced since the block began,
    raises LinkMoved at once -- nothing posted, nothing waited for -- where `Endpoint.run` would wait for the
    peer's next incarnation and read that one.  Outside the block the same read goes through `run`."""
    from ckpt import verbs
    from ckpt_remotelog._writer import LOG, OWN, LinkMoved
    from dsm._net import FAILED, UP

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        rings = [LogRing(pd, 512), LogRing(pd, 512)]
        peers = [{LOG: r.address(), OWN: LogRing(pd, 512).address()} for r in rings]
        nic, writer = _loop_writer(pd, peers, 512)
        rings[1].control[0] = 96
        with writer.strict():
            assert writer.read_word(1, LOG, 0) == 96
            nic.events.clear()
            nic.state[1] = FAILED
            with pytest.raises(LinkMoved):
                writer.read_word(1, LOG, 0)
            nic.state[1] = UP
            nic.link[1] += 1  # replaced by its next incarnation since the block began
            with pytest.raises(LinkMoved):
                writer.read_word(1, LOG, 0)
            assert nic.events == []
        assert writer.links is None and writer.read_word(1, LOG, 0) == 96
    finally:
        ctx.close()


def test_a_retry_does_nothing_while_a_rank_is_not_up_and_is_dropped_once_the_rings_holder_was_replaced() -> None:
    """`RemoteLog.retry_discard`'s guards, before any operation: a rank not up (its claims cannot be read, and
    nothing may wait for it) keeps the try for later; a holder replaced since the discard (its ring came back
    from an image, marked lost) ends it."""
    from dsm._net import FAILED, UP

    log = RemoteLog.__new__(RemoteLog)
    client = SimpleNamespace(link=[0, 0, 0], state=[UP, UP, FAILED])
    log.memory, log.offset, log.size, log.rank = SimpleNamespace(client=client), 1, 3, 0
    log.writer = None  # any operation would fail the test
    log.pending, log.pending_link, log.retry_at = {"applied": []}, 0, 0.0
    log.retry_discard(throttle=False)
    assert log.pending is not None
    client.link[1] = 1  # rank 0's log home, rank 1, was replaced
    log.retry_discard(throttle=False)
    assert log.pending is None


@pytest.mark.parametrize("who", ["the ring's holder", "another rank"])
def test_a_discard_interrupted_by_a_failure_writes_nothing_and_leaves_the_rest_to_a_retry(who: str) -> None:
    """A rank fails or comes back while a discard reads (`RingWriter.strict` raises LinkMoved): no head is
    written.  If it was the ring's holder, its recovery marked the ring lost and nothing computed on the old
    incarnation may land in the new one: nothing is left to retry.  Another rank: the retry takes it up."""
    import contextlib

    from ckpt_remotelog._writer import LinkMoved
    from dsm._net import UP

    client = SimpleNamespace(link=[0, 0, 0], state=[UP] * 3)
    writes: list[tuple[Any, ...]] = []
    log = RemoteLog.__new__(RemoteLog)
    log.memory, log.offset, log.size, log.rank, log.replay = SimpleNamespace(client=client), 1, 3, 0, None
    log.writer = SimpleNamespace(own_head=0, strict=contextlib.nullcontext, write_word=lambda *a: writes.append(a))
    snapshot = {"own_tail": 0, "independent": True, "holder": 0}
    log.snapshot, log.pending = snapshot, None

    def interrupted(snap: Any, wait: float) -> Any:
        client.link[1 if who == "the ring's holder" else 2] += 1  # rank 0's log ring is held by rank 1
        raise LinkMoved(1)

    log._covered_prefix = interrupted  # type: ignore[method-assign]
    log._holder_incarnation = lambda: 1  # type: ignore[method-assign]  # (recovered since: no lost words to clear)
    assert log.discard() == []
    assert writes == []
    assert (log.pending is None) == (who == "the ring's holder")


def test_a_writer_claims_what_it_reserved_until_it_is_written() -> None:
    """A ring's claim word (`_writer`, "Claims"): IN_FLIGHT from before the FETCH_AND_ADD is posted until
    `write` has its answer, then the lowest reserved position not yet written -- an earlier batch's while a
    later one is reserved -- and IDLE once every WRITE is complete, or in a process restored from an image."""
    from ckpt import verbs
    from ckpt_remotelog._writer import IDLE, IN_FLIGHT, LOG, OWN, RingWriter, _claim

    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        pd = verbs.PD(ctx)
        ring = LogRing(pd, 1024)
        ring.control[0] = ring.control[1] = 64  # 64 bytes appended and discarded before
        nic, writer = _loop_writer(pd, [{LOG: ring.address(), OWN: LogRing(pd, 1024).address()}], 1024)
        claim, at_post = _claim(0, LOG), []
        post = nic._post

        def watched(peer: int, wr: Any) -> None:  # the claim as each FETCH_AND_ADD is posted
            if wr.opcode == verbs.IBV_WR_ATOMIC_FETCH_AND_ADD:
                at_post.append(int(writer.claims[claim]))
            post(peer, wr)

        nic._post = watched  # type: ignore[method-assign]
        nic.qps = [SimpleNamespace(post_send=lambda wr: watched(0, wr))]
        assert writer.claims[claim] == IDLE
        writer.add(0, LOG, encode(RecordKind.DIFF, 0, b"a" * 16, interval=1, gid=7))
        writer.start()
        assert at_post == [IN_FLIGHT] and writer.claims[claim] == IN_FLIGHT  # (answered; the writer did not look)
        writer.write()
        assert writer.claims[claim] == 64
        writer.add(0, LOG, encode(RecordKind.DIFF, 0, b"b" * 16, interval=2, gid=7))
        writer.start()  # a second reservation while the first one's WRITE is not known complete
        assert at_post == [IN_FLIGHT, 64] and writer.claims[claim] == 64  # the lower position stays claimed
        writer.write()
        assert writer.claims[claim] == 64
        writer.complete()
        assert writer.claims[claim] == IDLE and [r.interval for r in ring.records()] == [1, 2]
        writer.add(0, LOG, encode(RecordKind.DIFF, 0, b"c" * 16, interval=3, gid=7))
        writer.start()
        writer.write()
        claimed = int(writer.claims[claim])
        nic.link[0] += 1  # the ring's holder was replaced: its ring goes on from its image, maybe lower
        writer.add(0, LOG, encode(RecordKind.DIFF, 0, b"d" * 16, interval=4, gid=7))
        writer.start()
        assert claimed >= 64 and at_post[-1] == IN_FLIGHT  # an old link's claim says nothing about the new ring
        writer.complete()
        assert writer.claims[claim] == IDLE
        writer.claims[claim] = 200  # an image taken mid-batch (a failed close) ...
        restored = RingWriter.__new__(RingWriter)
        restored.__setstate__(writer.__getstate__())
        assert restored.claims[claim] == IDLE  # ... restores with nothing claimed
        assert nic.events  # (the WRs went through the in-process NIC)
    finally:
        ctx.close()


def test_a_coordinated_checkpoint_releases_a_home_diff_log_past_a_dead_writers_hole() -> None:
    """Under onesided the writers reserve in a home's diff log too: a coordinated checkpoint releases it past a
    hole no live rank claims (else it would never empty again, and a full home diff log fails its writers at
    once), never past one a live rank claims."""
    from ckpt_remotelog._writer import HOME, IDLE

    def body(rt: ThreadRuntime) -> Any:
        job = _Holes(rt, "onesided", HOME)
        home_log = job.log.home_log

        def checkpoint(fill: int = -1) -> tuple[int, int]:
            """Rank 0's home diff log head and tail after a coordinated checkpoint."""

            def written_since() -> None:  # a hole when the image was taken, written since: not in the image
                record = encode(RecordKind.HOME_DIFF, 1, b"x" * 64, interval=99, gid=0)
                circular_write(home_log.buf[CONTROL:], fill, bytes(seal(record, fill)))

            job.checkpoint(written_since if rt.rank == 0 and fill >= 0 else None)
            out = home_log.head, home_log.tail
            rt.barrier()
            return out

        job.work(1.0)
        dead = job.reserve() if rt.rank == 1 else -1
        rt.barrier()
        job.work(2.0)
        passed = checkpoint()
        live = job.reserve() if rt.rank == 1 else -1
        rt.barrier()
        job.work(3.0)
        if rt.rank == 1:
            job.claim(live)
        claimed = checkpoint()
        if rt.rank == 1:
            job.claim(IDLE)
        job.work(4.0)
        freed = checkpoint()
        late = rt.allgather(job.reserve() if rt.rank == 1 else -1)[1]  # 128 bytes: one record of 64
        job.work(5.0)
        filled = checkpoint(fill=late)
        return dead, live, passed, claimed, freed, late, filled

    out = _Holes.run("onesided", body)
    dead, live = out[1][:2]
    passed, claimed, freed, late, filled = out[0][2:]
    assert dead >= 0 and passed[0] == passed[1] > dead
    assert claimed[0] == live < claimed[1]
    assert freed[0] == freed[1]
    assert filled[0] == late < filled[1]  # the record written into the hole after the image is kept


class _Holes:
    """One rank's side of the dead-hole tests: rank 0 is every page's home, so every diff is logged at its log
    home (and, onesided, in its home diff log); `reserve` makes a reservation nobody writes in ring `which` of
    rank 0 -- what a writer killed right after its FETCH_AND_ADD leaves."""

    def __init__(self, rt: ThreadRuntime, protocol: str, which: str) -> None:
        from ckpt_remotelog._writer import LOG

        self.rt, self.which, self.memory = rt, which, dsm.attach(rt, protocol)
        rt.at_end(self.memory.close)
        self.log: RemoteLog = self.memory.extensions["remotelog"]
        self.writer = self.log.writer
        self.peer = self.log.log_home(0) if which == LOG else 0  # where rank 0's ring is
        self.array = self.memory.array((SIZE * 512,), np.float64)
        self.lock = self.memory.lock()
        if rt.rank == 0:
            with self.array.write() as v:  # first touch: rank 0 is every page's home
                v[:] = 0.0
        self.memory.barrier()

    @staticmethod
    def run(protocol: str, body: Any) -> list[Any]:
        """`body(rt)` on every rank of a job with remote logging, each making its own `_Holes`; their returns."""
        options = {"dsm_protocol": protocol, "logging": "remote"}
        return run_threads(SIZE, body, first_device=FIRST_HCA, plugins=_plain_hosts, options=options)

    def work(self, value: float) -> None:
        with self.lock:
            with self.array.write(slice(0, 512 * SIZE)) as v:
                v[self.rt.rank :: SIZE] = value
        self.memory.barrier()

    def reserve(self) -> int:
        """128 bytes reserved in rank 0's ring and never written; their position."""
        from ckpt_remotelog._writer import _atomic

        ring, slot, writer = self.writer.peers[self.peer][self.which], len(self.writer.landing) - 2, self.writer
        wr = _atomic(writer._land(slot), ring["rkey"], ring["addr"], 128)
        self.memory.client.run(self.peer, [wr], self.memory.seq)
        return int(writer.landing[slot])

    def head(self) -> int:
        """The head of rank 0's ring `which` (RDMA READ)."""
        return int(self.writer.read_word(self.peer, self.which, 8))

    def claim(self, value: int) -> None:
        from ckpt_remotelog._writer import _claim

        self.writer.claims[_claim(self.peer, self.which)] = value

    def checkpoint(self, between: Any = None) -> None:
        """A coordinated checkpoint's discard on every rank (`between`: run after the image, before it)."""
        rt = self.rt
        rt.barrier()
        self.log.ckpt_precheckpoint(independent=False)
        rt.barrier()
        if between is not None:
            between()
        rt.barrier()
        self.log.discard()
        rt.barrier()
