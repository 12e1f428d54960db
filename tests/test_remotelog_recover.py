"""A recovered rank's `dsm_recovering` under remote logging: home pages rebuilt from the log home, the replay set up.

Thread-ranks run the DSM with ckpt_remotelog.  Rank R's state is taken mid-run at a point
every rank reached (what R's image would hold: its pages, their applied columns and home
table, its record serial); the run goes on -- every rank, R too, writes R's home pages under
locks, and R first-touches a page it is the default home of.  Then, every rank idle, R's
state is put back as the image would restore it and the plugin's `dsm_recovering` runs as
on a respawned rank: the rebuilt home pages must equal the live ones, the replay must hand
back R's operations since the image with what R received the first time, the ring R holds
is marked lost with its owner asked to checkpoint, and a lost log ring makes it fall back.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from dsm_util import FIRST_HCA

import ckpt_remotelog
import dsm
from ckpt import verbs
from ckpt.runtime.plugins import PluginHost
from ckpt.testing import ThreadRuntime, run_threads
from ckpt_remotelog._records import RecordKind, diff_record, parse, per_page
from ckpt_remotelog._recover import rebuild_master
from dsm import Diff
from dsm._region import Region

pytestmark = pytest.mark.timeout(120)
SIZE, R = 4, 1
WORDS = 512  # float64 per 4 KiB page


def _hosts(rank: int) -> PluginHost:
    plugins = PluginHost()
    plugins.add_hookspecs(dsm.hookspecs)
    plugins.register(ckpt_remotelog, "remotelog")
    return plugins


def _state(memory: Any) -> list[tuple[np.ndarray, ...]]:
    return [(r.data.copy(), r.meta.copy(), r.home.copy(), r.table.copy(), r.state.copy()) for r in memory.regions]


def _put_back(memory: Any, image: list[tuple[np.ndarray, ...]]) -> None:
    for region, (data, meta, home, table, state) in zip(memory.regions, image, strict=True):
        region.data[:], region.meta[:], region.home[:], region.table[:], region.state[:] = (
            data,
            meta,
            home,
            table,
            state,
        )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_recovered_rank_rebuilds_its_home_pages_from_its_log_home_and_replays_what_it_did(protocol: str) -> None:
    logs: list[Any] = [None] * SIZE

    def body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, protocol)
        rt.at_end(memory.close)
        log = logs[rt.rank] = memory.extensions["remotelog"]
        a = memory.array((4 * WORDS,), np.float64)
        b = memory.array((4 * WORDS,), np.float64)  # its page 0's default home is rank 1 (= R)
        memory.lock(), memory.lock()  # locks 0 and 1, homed at ranks 0 and 1
        if rt.rank == R:
            with a.write(slice(0, 4 * WORDS)) as v:
                v[:] = 0.5  # R is the home of a's pages
        memory.barrier()
        rt.barrier()
        image = (
            (_state(memory), log.serial, log.home_log.tail, log.writer.own_tail, len(log.own_diffs))
            if rt.rank == R
            else None
        )
        rt.barrier()
        seen: list[tuple[str, int, int, list[int]]] = []  # R's operations since the image: token, vt after it
        for step in range(5):
            lock = step % 2
            memory.acquire(lock)
            seen.append(("acquire", lock, memory.tokens[lock], list(memory.vt)))
            lo = (rt.rank * 700 + step * 211) % (4 * WORDS - 64)
            with a.write(slice(lo, lo + 64)) as v:
                v[:] = 10 * step + rt.rank
            seen.append(("release", lock, memory.tokens[lock], []))
            memory.release(lock)
            if rt.rank == R and step == 2:
                with b.write(slice(0, 16)) as v:
                    v[:] = 7.0  # first touch after the image: R claims it, as its default home
            memory.barrier()
            seen.append(("barrier", memory.epoch, 0, list(memory.vt)))
        log.flush()
        rt.barrier()
        if rt.rank != R:
            rt.barrier()
            return None
        live, live_serial, live_tail, live_own = _state(memory), log.serial, log.home_log.tail, log.writer.own_tail
        state, serial, home_tail, own_tail, own_kept = image  # type: ignore[misc]
        # what the lost incarnation had kept since the image: in the ring, and (onesided) its own writes beside it
        between = [r for r in log.home_log.scan(SIZE) if home_tail <= r.position < live_tail]
        between += [parse(record) for _, record in log.own_diffs[own_kept:]]
        between = [one for r in between for one in per_page(r)]
        del log.own_diffs[own_kept:]  # as the image has them
        _put_back(memory, state)  # what the image restores (the rings aside: their holders are the others)
        log.serial, log.writer.own_tail = serial, own_tail
        started: list[Any] = []
        held: list[str] = []
        fell: list[str] = []
        memory.start_replay = started.append  # part B's, on dsm.Memory
        rt.hold_checkpoints = held.append  # type: ignore[attr-defined]  (the runtime's, part D)
        rt.fall_back = fell.append  # type: ignore[attr-defined]
        assert "dsm_recovering" in memory._fire  # the plugin's object implements it: the DSM fires it
        memory.hook("dsm_recovering", incarnation=1, reports={})  # as dsm._reconnect does, in REFRESH
        rebuilt = _state(memory)
        appended = [r for r in log.home_log.scan(SIZE) if r.position >= live_tail]
        if protocol == "onesided":  # beside the ring, by the CPU: only the HCA appends to a onesided ring
            assert not appended
            appended = [parse(record) for _, record in log.own_diffs[own_kept:]]
        appended = [one for r in appended for one in per_page(r)]
        lost, asked = (log.ring.lost, log.own_ring.lost), list(rt.rank_checkpoints_requested)
        # the next own record goes right after the last replayed one: where the live run's next would go
        assert log.writer.own_tail == live_own
        # a ring at R's log home marked lost (its holder was recovered): no replay, a fallback
        for ring in (logs[(R + 1) % SIZE].ring, logs[(R + 1) % SIZE].own_ring):
            ring.control[2] = 1
            with pytest.raises(dsm.DsmError, match="log home"):
                log.dsm_recovering(incarnation=2, reports={})
            ring.control[2] = 0
        # the log home unreachable (it failed too): the same
        memory.client.state[(R + 1) % SIZE], up = "failed", memory.client.state[(R + 1) % SIZE]
        with pytest.raises(dsm.DsmError, match=f"its log home, rank {(R + 1) % SIZE}, is lost too"):
            log.dsm_recovering(incarnation=3, reports={})
        memory.client.state[(R + 1) % SIZE] = up
        _put_back(memory, live)
        rt.barrier()
        return live, rebuilt, serial, live_serial, log.serial, started, held, fell, seen, appended, between, lost, asked

    out = run_threads(
        SIZE, body, first_device=FIRST_HCA, plugins=_hosts, options={"dsm_protocol": protocol, "logging": "remote"}
    )
    live, rebuilt, serial, live_serial, serial_after, started, held, fell, seen, appended, between, lost, asked = out[R]
    # d, e: the master of R's home pages and R's home table, as the live run left them
    for aid, ((data, meta, home, table, _), (data2, meta2, home2, table2, _)) in enumerate(
        zip(live, rebuilt, strict=True)
    ):
        mine = np.flatnonzero(home == R)
        assert len(mine) > 0
        pages = [slice(p * 4096, (p + 1) * 4096) for p in mine]
        assert all(np.array_equal(data[s], data2[s]) for s in pages), f"array {aid}"
        assert np.array_equal(meta[mine], meta2[mine]), f"array {aid}"
        assert np.array_equal(table, table2) and np.all(home2[mine] == R), f"array {aid}"
    assert live[1][3][0] == R + 1  # b's page 0 claimed after the image, at R: claimed again
    # the home diff log gets what the lost incarnation had appended since the image
    key = lambda r: (r.writer, r.gid, r.interval)  # noqa: E731
    assert sorted(map(key, appended)) == sorted(map(key, between)) and appended
    assert all(r.kind == RecordKind.HOME_DIFF for r in appended)
    # c, g: the replay holds every operation of R since the image, with what R received then
    (replay,) = started
    assert held == [f"rank {R} is replaying its logs"] and len(fell) == 3  # either ring lost, the log home lost
    assert all("\n" not in why and why.startswith(f"rank {R} failed together with its log home") for why in fell)
    assert replay.progress() == (0, len(seen) + sum(1 for op in seen if op[0] == "barrier"))
    assert serial_after == live_serial == serial + replay.progress()[1]
    for kind, tag, token, vt in seen:
        if kind == "acquire":
            got = replay.acquire(tag, token)
            assert got is not None and got[0] == vt
        elif kind == "release":
            assert replay.release(tag, token) is (not replay.done)
        else:
            assert replay.arrive(tag) is True
            got = replay.barrier(tag)
            assert got is not None and got[0] == vt
    assert replay.done
    # f: the rings R holds (rank 0's) came back from the image: lost, and rank 0 asked to checkpoint
    assert all(lost) and asked == [(R - 1) % SIZE]


def test_a_rebuild_applies_nothing_of_a_record_one_of_whose_pages_is_malformed() -> None:
    """`rebuild_master` decodes every page of a DIFF record before it applies any: a record whose second page
    is not a diff fails in one line and leaves the first page's copy and applied column as they were."""
    ctx = verbs.Context(name=f"simib{FIRST_HCA}")
    try:
        region = Region(verbs.PD(ctx), 0, 2 * 4096, 8, 4096, 0, SIZE)
        kept: list[Any] = []
        rlog = SimpleNamespace(memory=SimpleNamespace(regions=[region]), rank=0, log_home_diffs=kept.append)
        good = Diff.of_runs([(0, b"\x07" * 8)]).encode()
        bad = parse(diff_record(RecordKind.DIFF, 1, 1, [(0, good), (1, b"\xff" * 12)]))
        with pytest.raises(dsm.DsmError, match="malformed diff"):
            rebuild_master(rlog, [bad])  # type: ignore[arg-type]
        assert not region.page(0).any() and not region.meta.any() and kept == []
        fine = parse(diff_record(RecordKind.DIFF, 1, 1, [(0, good), (1, good)]))
        assert rebuild_master(rlog, [fine]) == 2  # type: ignore[arg-type]
        assert bytes(region.page(1)[:8]) == b"\x07" * 8 and region.meta[:, 1].tolist() == [1, 1]
        (relogged,) = kept[0]  # the HOME_DIFF of what it applied, in the home diff log
        assert [(r.kind, r.gid) for r in per_page(parse(relogged))] == [
            (RecordKind.HOME_DIFF, 0),
            (RecordKind.HOME_DIFF, 1),
        ]
    finally:
        ctx.close()
