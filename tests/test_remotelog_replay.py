"""Recovery by replay, remote logging's side (issue 13 part 5): the log a replay needs, and what it is built into.

Thread-ranks (ckpt.testing.run_threads) run the DSM with ckpt_remotelog; the rings live in
this process, so a test reads them directly.  Covered: the records a replay relies on are
committed before what they log can be observed (a spy on the serving handler); a home
regenerates exact old page versions across independent and coordinated checkpoints; the
hole-skipping scan; the `LogReplay` object; and a recovered rank's `dsm_recovering` --
a rank's state is taken mid-run as its image would hold it, the run goes on, the state is
put back and rebuilt from the log, and the result is compared with the live one.
"""

from __future__ import annotations

import pickle
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from dsm_util import FIRST_HCA

import ckpt_remotelog
import dsm
from ckpt import verbs
from ckpt.plugin import RANKS_NS
from ckpt.runtime.plugins import PluginHost
from ckpt.testing import ThreadRuntime, run_threads
from ckpt_remotelog._records import (
    HEADER_SIZE,
    Record,
    RecordKind,
    diff_record,
    encode,
    notices_payload,
    seal,
    walk,
)
from ckpt_remotelog._replay import LogReplay
from ckpt_remotelog._ring import LogRing
from ckpt_remotelog._versions import HomeVersions
from dsm import Diff
from dsm._handler import Handler
from dsm._messages import BarrierRequest, ReleaseRequest, decode

pytestmark = pytest.mark.timeout(120)
SIZE = 4
WORDS = 512  # float64 per 4 KiB page


def _hosts(rank: int) -> PluginHost:
    plugins = PluginHost()
    plugins.add_hookspecs(dsm.hookspecs)
    plugins.register(ckpt_remotelog, "remotelog")
    return plugins


def _options(protocol: str) -> dict[str, Any]:
    return {"dsm_protocol": protocol, "logging": "remote"}


# ---------------------------------------------------------------------- what is logged, and when
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_release_and_an_arrival_are_in_the_own_ring_when_they_reach_the_manager(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock's home and the barrier manager look, as each release / arrival is served, for its record at
    the sender's log home: it must be committed there already (the invariant a replay stands on)."""
    logs: list[Any] = [None] * SIZE
    missing: list[str] = []
    checked = Counter[str]()
    serve = Handler.serve

    def spy(self: Handler, src: int, raw: Any, link: int | None = None) -> None:
        msg = decode(raw)
        if isinstance(msg, ReleaseRequest | BarrierRequest):
            held, writer = logs[(src + 1) % SIZE].own_ring, logs[src].writer  # the sender's own ring
            head, tail = writer.own_head, writer.own_tail
            if isinstance(msg, ReleaseRequest):
                key = (RecordKind.RELEASE, msg.lock, msg.token)
            else:
                key = (RecordKind.BARRIER_ARRIVAL, msg.epoch, 0)
            if not any((r.kind, r.tag, r.interval) == key for r in walk(held.contents(head, tail), head)):
                missing.append(f"rank {src}: {key}")
            checked[type(msg).__name__] += 1
        serve(self, src, raw, link)

    monkeypatch.setattr(Handler, "serve", spy)

    def body(rt: ThreadRuntime) -> None:
        memory = dsm.attach(rt, protocol)
        rt.at_end(memory.close)
        logs[rt.rank] = memory.extensions["remotelog"]
        a = memory.array((SIZE * WORDS,), np.float64)
        locks = [memory.lock() for _ in range(2)]
        rt.barrier()  # every log is known before anything is served
        for step in range(6):
            with locks[step % 2]:
                with a.write(slice(rt.rank * WORDS, rt.rank * WORDS + 8)) as v:
                    v[:] = step + 1
            memory.barrier()

    run_threads(SIZE, body, first_device=FIRST_HCA, plugins=_hosts, options=_options(protocol))
    assert checked["ReleaseRequest"] == 6 * SIZE and checked["BarrierRequest"] == 6 * SIZE
    assert not missing, missing


# ---------------------------------------------------------------------- minimal versions
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_home_regenerates_every_version_since_the_coordinated_checkpoint(protocol: str) -> None:
    """Ranks take turns writing overlapping slices of two pages homed at rank 0 (its own writes too); after
    each barrier rank 0 keeps (vt, its pages).  A coordinated checkpoint at step 3 takes the base and releases
    the home diff log; an independent one of rank 0 at step 6 must not release it.  At the end every version
    kept since step 3 is regenerated exactly; a final coordinated checkpoint empties the home diff log."""
    steps, coordinated, independent = 12, 3, 6

    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, protocol)
        rt.at_end(memory.close)
        log = memory.extensions["remotelog"]
        a = memory.array((2 * WORDS,), np.float64)
        region = memory.regions[-1]
        lock = memory.lock()
        if rt.rank == 0:
            with a.write(slice(0, 2 * WORDS)) as v:
                v[:] = -1.0  # rank 0 becomes the home of both pages
        memory.barrier()
        kept: list[tuple[list[int], list[bytes]]] = []
        released: list[int] = []
        for step in range(steps):
            if rt.rank == step % SIZE:
                lo = (step * 137) % (2 * WORDS - 300)
                with lock:
                    with a.write(slice(lo, lo + 300)) as v:
                        v[:] = step + 1
            memory.barrier()
            if rt.rank == 0:
                kept.append((list(memory.vt), [region.page(p).tobytes() for p in (0, 1)]))
            rt.barrier()  # the next writer's diff must not reach rank 0's handler before rank 0 has kept its copy
            if step == coordinated:
                rt.barrier()
                log.ckpt_precheckpoint(independent=False)
                rt.barrier()
                log.discard()
                released.append(len(log.home_log.records()))
                rt.barrier()
            if step == independent and rt.rank == 0:
                before = log.home_log.head
                # through the plugin host, as the runtime fires them: the hook is told it is independent
                rt.plugins.call("ckpt_precheckpoint", rt=rt, image=None, independent=True)
                rt.plugins.call("ckpt_checkpointed", rt=rt, info={"number": 2, "manifest": "", "independent": True})
                released.append(log.home_log.head - before)  # the others write on meanwhile: look at its head
        if rt.rank != 0:
            memory.barrier()
            return None
        gids = [region.aid << 32 | p for p in (0, 1)]
        versions = [[memory.versions.page(gid, vt) for gid in gids] for vt, _ in kept]
        retained = len(log.home_log.records())
        memory.barrier()
        log.ckpt_precheckpoint(independent=False)
        log.discard()
        last_vt = list(memory.vt)
        after = (log.home_log.records(), [memory.versions.page(gid, last_vt) for gid in gids])
        return kept, versions, released, retained, after, [region.page(p).tobytes() for p in (0, 1)]

    kept, versions, released, retained, after, final = run_threads(
        SIZE, body, first_device=FIRST_HCA, plugins=_hosts, options=_options(protocol)
    )[0]
    assert released == [0, 0]  # the coordinated checkpoint released all of it; the independent one nothing
    assert retained >= steps - coordinated - 1 - steps // SIZE  # the others' diffs since step 3 at least
    for step in range(coordinated, steps):
        assert versions[step] == kept[step][1], f"step {step}"
    assert any(versions[s] != kept[-1][1] for s in range(coordinated, steps - 1))  # they are old versions
    records, pages = after
    assert records == [] and pages == final


def test_a_version_is_the_base_and_the_covered_diffs_in_log_order_overflow_last() -> None:
    """Unit: a base with applied columns, diffs in the ring, the rest in the async overflow list (the ring was
    full); the same bytes written twice, so a wrong order shows."""
    ctx, ring = _ring()
    try:
        memory = SimpleNamespace(rank=0, size=SIZE, page_size=64, regions=[])
        overflow: list[bytearray] = []
        versions = HomeVersions(memory, ring, overflow, [])
        gid, other = 1 << 32 | 3, 1 << 32 | 4
        versions.base = {gid: (bytes([9]) * 64, np.array([0, 1, 0, 0]))}  # holds writer 1's interval 1

        def home_diff(writer: int, interval: int, byte: int, *pages: int) -> bytearray:
            payload = Diff.of_runs([(0, bytes([byte]) * 8), (32, bytes([byte]))]).encode()
            return diff_record(RecordKind.HOME_DIFF, writer, interval, [(page, payload) for page in pages or [gid]])

        # writer 2's interval 1 wrote both pages: one record holds both diffs
        for record in (home_diff(1, 1, 50), home_diff(2, 1, 1, other, gid), home_diff(1, 2, 2)):
            assert ring.append_local(record)
        overflow += [home_diff(3, 1, 3), home_diff(2, 2, 4)]
        page = lambda vt: versions.page(gid, vt)  # noqa: E731
        assert page([0, 0, 0, 0]) == bytes([9]) * 64  # interval 1 of writer 1 is in the base: not applied again
        assert page([0, 5, 1, 0])[:9] == bytes([2]) * 8 + bytes([9])  # writer 2's 1, then writer 1's 2 over it
        assert page([0, 1, 1, 0])[:8] == bytes([1]) * 8
        assert page([0, 9, 9, 9])[:8] == bytes([4]) * 8 and page([0, 9, 9, 9])[32] == 4  # the overflow, last
        assert page([0, 9, 1, 9])[:8] == bytes([3]) * 8
        assert versions.page(other, [0, 0, 1, 0])[:8] == bytes([1]) * 8 and versions.page(other, [0] * 4) == bytes(64)
        copy = HomeVersions.__new__(HomeVersions)  # as unpickled from an image (its ring's MR needs ckpt_ib)
        copy.__setstate__(versions.__getstate__())  # the index is not in the state: rebuilt from the ring
        assert copy.page(gid, [0, 5, 1, 0]) == page([0, 5, 1, 0])
    finally:
        ctx.close()


def test_a_homes_own_diffs_kept_beside_the_ring_go_where_the_rings_tail_put_them() -> None:
    """Unit, onesided: a home keeps the HOME_DIFFs of its own writes beside its ring (peers reserve in the ring
    with FETCH_AND_ADDs), each with the ring's tail when it was made, and a version applies it before the
    ring's records from that position on.  The same bytes written by all, so a wrong order shows."""
    ctx, ring = _ring()
    try:
        memory = SimpleNamespace(rank=0, size=SIZE, page_size=64, regions=[])
        own: list[tuple[int, bytearray]] = []
        versions = HomeVersions(memory, ring, [], own)
        gid = 1 << 32 | 3

        def home_diff(writer: int, interval: int, byte: int) -> bytearray:
            payload = Diff.of_runs([(0, bytes([byte]) * 8)]).encode()
            return diff_record(RecordKind.HOME_DIFF, writer, interval, [(gid, payload)])

        # peer 1's interval 1 (released before the home acquired), the home's interval 1, peer 2's interval 1
        # (acquired after the home released), the home's interval 2
        assert ring.append_local(home_diff(1, 1, 10))
        own.append((ring.tail, home_diff(0, 1, 20)))
        assert ring.append_local(home_diff(2, 1, 30))
        own.append((ring.tail, home_diff(0, 2, 40)))
        page = lambda vt: versions.page(gid, vt)[:8]  # noqa: E731
        assert page([1, 1, 0, 0]) == bytes([20]) * 8  # the home's over peer 1's
        assert page([1, 1, 1, 0]) == bytes([30]) * 8  # peer 2's over the home's
        assert page([2, 1, 1, 0]) == bytes([40]) * 8 and page([1, 0, 0, 0]) == bytes([20]) * 8
        assert page([0, 1, 1, 0]) == bytes([30]) * 8 and page([0, 0, 0, 0]) == bytes(8)
        copy = HomeVersions.__new__(HomeVersions)  # as unpickled from an image
        copy.__setstate__(versions.__getstate__())
        assert copy.page(gid, [1, 1, 0, 0])[:8] == bytes([20]) * 8
    finally:
        ctx.close()


def test_the_owners_checkpoint_clears_the_lost_mark_unless_its_log_home_was_recovered_meanwhile() -> None:
    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, "async")
        rt.at_end(memory.close)
        log = memory.extensions["remotelog"]
        held = log.ring  # rank 0's log ring at rank 1, rank 1's at rank 0
        marks = []
        for recovered_meanwhile in (False, True):
            rt.barrier()
            if rt.rank == 1:
                held.mark_lost()  # rank 1 came back from its image: the ring of rank 0 it holds is lost
            rt.barrier()
            if rt.rank == 0:
                log.ckpt_precheckpoint(independent=True)
                if recovered_meanwhile:  # rank 1 failed and came back once more before the discard
                    rt.kv.publish(RANKS_NS, "incarnation/1", 1)
                log.discard()
            rt.barrier()
            marks.append(held.lost)
        return marks

    marks = run_threads(2, body, first_device=FIRST_HCA, plugins=_hosts, options=_options("async"))[1]
    assert marks == [False, True]


# ---------------------------------------------------------------------- holes
def _ring() -> tuple[verbs.Context, LogRing]:
    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    return ctx, LogRing(verbs.PD(ctx), 4096)


def test_a_walk_stops_at_a_hole_and_a_scan_finds_every_record_past_it() -> None:
    ctx, ring = _ring()
    try:
        first = encode(RecordKind.NOTICES, 1, b"a" * 10, tag=3, serial=0)
        assert ring.append_local(first)
        hole = ring.tail
        ring.control[0] += 128  # reserved by a writer that died before writing it
        bogus = seal(bytearray(encode(RecordKind.DIFF, 1, b"torn")), hole + 64)  # a record of that position ...
        bogus[HEADER_SIZE] ^= 1  # ... one byte of which did not land: its check fails, not a record
        area = ring.buf[24:]
        area[hole + 64 : hole + 64 + len(bogus)] = np.frombuffer(bytes(bogus), dtype=np.uint8)
        later = [diff_record(RecordKind.DIFF, w, w, [(7, Diff.of_runs([(8, b"x" * w)]).encode())]) for w in (0, 2, 3)]
        for record in later:
            assert ring.append_local(record)
        assert [r.serial for r in ring.records()] == [0]  # what discard reads: up to the hole
        found = ring.scan(SIZE)
        assert [(r.kind, r.writer) for r in found] == [(RecordKind.NOTICES, 1)] + [
            (RecordKind.DIFF, w) for w in (0, 2, 3)
        ]
        assert [r.writer for r in ring.scan(3)] == [1, 0, 2]  # writer 3 of a 3-rank job: implausible
        ring.mark_lost()
        assert ring.lost and ring.records() == [] and ring.scan(SIZE) == []
    finally:
        ctx.close()


# ---------------------------------------------------------------------- the replay object
def _log(*records: bytearray, start: int = 4096) -> list[Record]:
    """Records laid out in a ring area from position `start`, as a recovery reads them."""
    data, position = bytearray(), start
    for record in records:
        data += seal(record, position)
        position += len(record)
    return walk(bytes(data), start)


def _own(kind: RecordKind, tag: int, serial: int, token: int = 0, vt: list[int] | None = None) -> bytearray:
    payload = b"" if kind == RecordKind.RELEASE else notices_payload(vt or [serial] * SIZE, [[2, serial, [5, 1]]])
    return encode(kind, 1, payload, interval=token, tag=tag, serial=serial)


def _diff(writer: int, interval: int, gid: int = 5) -> bytearray:
    return diff_record(
        RecordKind.DIFF, writer, interval, [(gid, Diff.of_runs([(8 * interval, bytes([writer]) * 8)]).encode())]
    )


LOGGED = [
    _own(RecordKind.NOTICES, 2, 4, token=1),  # before the image (serial 5): not replayed
    _diff(2, 1),
    _own(RecordKind.NOTICES, 2, 5, token=2),
    _diff(1, 3),  # the rank's own: re-executed, not handed back
    _diff(2, 2),
    _own(RecordKind.RELEASE, 2, 6, token=2),
    _diff(3, 1, gid=6),
    _own(RecordKind.BARRIER_ARRIVAL, 1, 7),
    _own(RecordKind.BARRIER, 1, 8, vt=[1, 3, 2, 1]),
    _own(RecordKind.NOTICES, 0, 9, token=3),
    _own(RecordKind.RELEASE, 0, 10, token=3),
]


def _replay(records: list[Record], applied: dict[int, list[int]] | None = None) -> LogReplay:
    columns = applied or {5: [0, 0, 1, 0]}  # the image holds writer 2's interval 1 of page 5
    return LogReplay(1, 5, records, lambda gid: np.array(columns[gid]) if gid in columns else None, 4096)


def test_a_replay_hands_back_the_logged_operations_in_program_order() -> None:
    replay = _replay(_log(*LOGGED))
    assert replay.progress() == (0, 6) and not replay.done
    vt, notices = replay.acquire(2, 2) or ([], [])
    assert vt == [5] * SIZE and notices == [[2, 5, [5, 1]]]
    assert replay.home_diffs([0, 0, 1, 0]) == []  # writer 2's interval 1 is in the image
    assert replay.release(2, 2) is True  # more follows: the release is known done at the home
    assert replay.arrive(1) is True
    copy = pickle.loads(pickle.dumps(replay))  # mid-replay: what an image would hold
    for r in (replay, copy):
        assert r.barrier(1) == ([1, 3, 2, 1], [[2, 8, [5, 1]]])
        assert [(g, d.runs()) for g, d in r.home_diffs([1, 3, 2, 1])] == [
            (5, [(16, b"\x02" * 8)]),
            (6, [(8, b"\x03" * 8)]),
        ]
        assert r.home_diffs([9, 9, 9, 9]) == []  # each once
        assert r.acquire(0, 3) is not None
        assert r.release(0, 3) is False  # logged last: it may not have reached the home, send it
        assert r.done and r.progress() == (6, 6) and r.next_serial == 11
        assert r.acquire(0, 4) is None  # past the log: live
    assert replay.replayed(RecordKind.RELEASE, 0, 3) and not replay.replayed(RecordKind.RELEASE, 0, 4)


def test_home_diffs_come_back_in_log_order_as_the_vector_timestamp_covers_them() -> None:
    replay = _replay(_log(_diff(2, 2), _diff(3, 1), _diff(2, 3), _diff(3, 2)), {5: [0, 0, 1, 0]})
    assert [r[1].runs() for r in replay.home_diffs([0, 0, 0, 1])] == [[(8, b"\x03" * 8)]]
    assert [r[1].runs()[0][0] for r in replay.home_diffs([0, 0, 3, 1])] == [16, 24]
    assert [r[1].runs()[0][0] for r in replay.home_diffs([0, 0, 3, 2])] == [16]
    assert replay.done  # no operation logged: nothing to replay


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda r: r.acquire(2, 3),
            "it asked for the acquire of lock 2 (acquisition 3), the log holds the acquire of lock 2 (acquisition 2)",
        ),
        (lambda r: r.acquire(1, 2), "the acquire of lock 1"),
        (lambda r: r.arrive(1), "it asked for the arrival at barrier 1, the log holds the acquire of lock 2"),
        (lambda r: r.release(2, 2), "the log holds the acquire"),
    ],
)
def test_a_replay_that_leaves_its_log_diverges_in_one_line(call: Any, message: str) -> None:
    replay = _replay(_log(*LOGGED))
    with pytest.raises(dsm.ReplayDiverged) as caught:
        call(replay)
    text = str(caught.value)
    assert message in text and "\n" not in text and "operation 1 of 6" in text


def test_a_log_ending_at_an_arrival_lets_the_barrier_go_live_and_a_serial_gap_ends_the_log() -> None:
    replay = _replay(_log(_own(RecordKind.BARRIER_ARRIVAL, 4, 5)))
    assert replay.arrive(4) is True and replay.done and replay.barrier(4) is None
    gap = _replay(
        _log(_own(RecordKind.NOTICES, 1, 5, 1), _own(RecordKind.RELEASE, 1, 6, 1), _own(RecordKind.NOTICES, 1, 8, 2))
    )
    assert gap.progress() == (0, 2) and gap.next_serial == 7  # serial 7 was never completed: nothing after it counts
