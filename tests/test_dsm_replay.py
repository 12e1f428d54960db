"""The DSM's replay mode (dsm._replay): a recovering rank's synchronisation answered from its log, on thread-ranks.

A scripted `dsm.Replay` stands for the log ckpt_remotelog reads at the log home: the tests
check what the DSM does with it -- no message for a replayed operation, the logged notices
merged, the program's view kept apart from the master copies, minimal versions asked of the
homes, the live hand-over at the end, and a divergence turned into a whole-job fallback.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime
from dsm import Diff
from dsm._messages import Notice
from dsm._region import INVALID, gid_of

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("protocol", dsm.HLRC)]

DOUBLES = 512  # int64 per 4 KiB page


class ScriptedReplay:
    """A log of operations, consumed in order like the real one: ("acquire", lock, token, vt, notices),
    ("release", lock, token), ("arrive", epoch), ("barrier", epoch, vt, notices)."""

    def __init__(self, ops: list[tuple[Any, ...]], home_diffs: list[tuple[int, int, int, bytes]] | None = None) -> None:
        self.ops, self.at = ops, 0
        self.diffs = list(home_diffs or [])  # (writer, interval, gid, bytes at offset 0)
        self.given: set[int] = set()

    @property
    def done(self) -> bool:
        return self.at == len(self.ops)

    def progress(self) -> tuple[int, int]:
        return self.at, len(self.ops)

    def _next(self, kind: str, *key: int) -> tuple[Any, ...]:
        op = self.ops[self.at]
        if op[0] != kind or tuple(op[1 : 1 + len(key)]) != key:
            raise dsm.ReplayDiverged(f"the log has {op[:3]} next, the program asked for {(kind, *key)}")
        self.at += 1
        return op

    def acquire(self, lock: int, token: int) -> tuple[list[int], list[Notice]] | None:
        op = self._next("acquire", lock, token)
        return op[3], op[4]

    def release(self, lock: int, token: int) -> bool:
        self._next("release", lock, token)
        return not self.done

    def arrive(self, epoch: int) -> bool:
        self._next("arrive", epoch)
        return True

    def barrier(self, epoch: int) -> tuple[list[int], list[Notice]] | None:
        if self.done:
            return None
        op = self._next("barrier", epoch)
        return op[2], op[3]

    def home_diffs(self, vt: list[int]) -> list[tuple[int, Diff]]:
        out = []
        for k, (writer, interval, gid, data) in enumerate(self.diffs):
            if k not in self.given and interval <= vt[writer]:
                self.given.add(k)
                out.append((gid, Diff.of_runs([(0, data)])))
        return out


class Versions:
    """A home's page history stand-in: the page as of `vt` is `vt[0]` in every element."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, list[int]]] = []

    def page(self, gid: int, vt: list[int]) -> bytes:
        self.asked.append((gid, list(vt)))
        return np.full(DOUBLES, vt[0], dtype=np.int64).tobytes()


def end_replay(mem: dsm.Memory) -> None:
    """End a scripted replay whose log is not consumed, as its last operation and the catch-up would."""
    dsm._replay._log_ended(mem)
    dsm._replay.finish(mem)


def watch_checkpoint_holds(rt: ThreadRuntime) -> list[str]:
    calls: list[str] = []
    rt.hold_checkpoints = lambda reason: calls.append(f"hold {reason}")  # type: ignore[method-assign]
    rt.release_checkpoints = lambda: calls.append("release")  # type: ignore[method-assign]
    rt.fall_back = lambda reason: calls.append(f"fall back: {reason}")  # type: ignore[method-assign]
    return calls


def pages_of_each_rank(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
    """An int64 array of two pages: page r first touched (so homed) by rank r."""
    a = mem.array(2 * DOUBLES, np.int64)
    a[rt.rank * DOUBLES] = 1
    mem.barrier()
    return a


def test_a_replayed_acquire_and_release_send_nothing_and_merge_the_logged_notices(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = pages_of_each_rank(mem, rt)
        lock, other = mem.lock(), mem.lock()  # homed at ranks 0 and 1
        if rt.rank == 0:
            mem.barrier()
            return None
        calls = watch_checkpoint_holds(rt)
        notice = [0, mem.vt[0] + 1, [gid_of(0, 0), 0]]  # rank 0 wrote page 0 in an interval rank 1 has not seen
        vt = [mem.vt[0] + 1, mem.vt[1]]
        t = mem.acquires + 1
        ops = [("acquire", lock.id, t, vt, [notice]), ("release", lock.id, t), ("acquire", other.id, t + 1, vt, [])]
        sent = dict(mem.statistics().messages)
        mem.start_replay(ScriptedReplay(ops))
        lock.acquire()
        state_after_acquire = int(a._region.state[0])
        lock.release()
        other.acquire()  # the last logged operation: the catch-up starts
        replayed = mem.statistics()
        catching_up = mem.replay is not None and mem.replay.done
        lock.acquire()  # its interval closed (none): live, granted by rank 0
        live = catching_up and mem.replay is None
        mem.start_replay(ScriptedReplay([("release", lock.id, mem.tokens[lock.id])]))
        lock.release()  # logged last, so sent again: the home may never have seen it
        resent = mem.statistics().messages.get("release", 0)
        mem.barrier()
        return sent, replayed, vt, list(mem.vt), state_after_acquire, live, resent, calls

    _, (sent, stats, logged_vt, vt, state, live, resent, calls) = run_ranks(2, body, protocol)
    assert stats.replayed_acquires == 2 and stats.replayed_releases == 1
    assert stats.messages.get("acquire", 0) == sent.get("acquire", 0), "a replayed acquire asked the lock's home"
    assert stats.messages.get("release", 0) == sent.get("release", 0), "a replayed release was sent"
    assert resent == sent.get("release", 0) + 1
    assert vt[0] >= logged_vt[0] and state == INVALID, "the logged notice invalidated the page"
    assert live and calls == ["release", "release"], calls


def test_the_program_writes_a_view_apart_from_the_master_copy_until_the_replay_ends(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        if rt.rank == 0:
            mem.versions = Versions()  # rank 1 writes page 0, invalid there: it asks for its minimal version
        a = pages_of_each_rank(mem, rt)
        lock = mem.lock()
        if rt.rank == 0:
            mem.barrier()
            return None  # (rank 1's catch-up barrier meets this one)
        watch_checkpoint_holds(rt)
        own = gid_of(0, 1)
        t = mem.acquires + 1
        vt = [mem.vt[0] + 1, mem.vt[1]]
        other = np.full(4, 77, dtype=np.int64).tobytes()  # rank 0's logged diff to rank 1's home page
        ops = [("acquire", lock.id, t, vt, []), ("release", lock.id, t), ("acquire", lock.id, t + 1, vt, [])]
        replay = ScriptedReplay(ops, home_diffs=[(0, vt[0], own, other)])
        master = a._region.data
        before = master.copy()
        mem.start_replay(replay)
        lock.acquire()
        shown = a[DOUBLES : DOUBLES + 4].tolist()  # the logged diff, in the view
        a[DOUBLES + 10] = 5  # re-executed write to its own home page: the view only
        a[5] = 6  # and to rank 0's page
        untouched = np.array_equal(master, before)
        lock.release()
        lock.acquire()  # the last operation: the catch-up starts
        mem.barrier()  # closes the catch-up's interval: live from here on
        live = mem.replay is None and a._region.view is None
        own_page = master[DOUBLES * 8 :].view(np.int64)
        after = (int(own_page[10]), int(master[: DOUBLES * 8].view(np.int64)[5]))
        return shown, untouched, live, after

    _, (shown, untouched, live, after) = run_ranks(2, body, protocol)
    assert shown == [77, 77, 77, 77]
    assert untouched, "a replayed write reached the master copy the other ranks read"
    # at the end the master stays the home page (it holds all that was logged), the other pages come from the view
    assert live and after == (0, 6)


def test_a_fault_while_replaying_asks_the_home_for_the_minimal_version(protocol: str) -> None:
    versions = Versions()

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        if rt.rank == 0:
            mem.versions = versions  # before the barrier after which rank 1 may ask
        a = pages_of_each_rank(mem, rt)
        lock = mem.lock()
        if rt.rank == 0:
            mem.barrier()
            return None
        watch_checkpoint_holds(rt)
        page0 = gid_of(0, 0)
        vt = [mem.vt[0] + 3, mem.vt[1]]
        token = mem.acquires + 1
        ops = [("acquire", lock.id, token, vt, [[0, vt[0], [page0, 0]]]), ("release", lock.id, token), ("arrive", 99)]
        mem.start_replay(ScriptedReplay(ops))
        lock.acquire()
        seen = int(a[7])
        stats = mem.statistics()
        lock.release()
        end_replay(mem)
        mem.barrier()
        return seen, vt, stats

    _, (seen, vt, stats) = run_ranks(2, body, protocol)
    assert versions.asked == [(gid_of(0, 0), vt)]
    assert seen == vt[0] and stats.regenerated_pages == 1


def test_a_replay_that_leaves_its_log_falls_back_to_a_whole_job_restart(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        pages_of_each_rank(mem, rt)
        lock, other = mem.lock(), mem.lock()
        if rt.rank == 0:
            mem.barrier()
            return None
        calls = watch_checkpoint_holds(rt)
        mem.start_replay(ScriptedReplay([("acquire", lock.id, mem.acquires + 1, list(mem.vt), [])]))
        try:
            other.acquire()
        except dsm.ReplayDiverged as exc:
            error = str(exc)
        end_replay(mem)
        mem.barrier()
        return calls, error

    _, (calls, error) = run_ranks(2, body, protocol)
    assert "the log has" in error
    assert len(calls) == 2 and calls[0].startswith("fall back: rank 1: its re-execution left its log"), calls


def test_replayed_barriers_leave_the_manager_alone_and_an_empty_log_is_live_at_once(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        pages_of_each_rank(mem, rt)
        calls = watch_checkpoint_holds(rt)
        epoch, vt = mem.epoch + 1, [v + 1 for v in mem.vt]
        sent = dict(mem.statistics().messages)
        # both ranks replay the same barrier (as if both failed after it): nobody asks the manager
        mem.start_replay(ScriptedReplay([("arrive", epoch), ("barrier", epoch, vt, [])]))
        mem.barrier()
        replayed = dict(mem.statistics().messages)
        floor = list(mem.floor)
        mem.barrier()  # live, one epoch on, on both ranks: the catch-up ends at its (empty) interval
        mem.start_replay(ScriptedReplay([]))  # an empty log: nothing replayed, the catch-up at once
        mem.barrier()
        empty_is_live = mem.replay is None
        stats = mem.statistics()
        return sent, replayed, floor, vt, empty_is_live, (stats.replayed_barriers, stats.replay_operations), calls

    for sent, replayed, floor, vt, empty_is_live, counts, calls in run_ranks(2, body, protocol):
        assert replayed.get("barrier", 0) == sent.get("barrier", 0)
        assert floor == vt and empty_is_live and counts == (1, 2)  # one barrier from two logged operations
        assert calls == ["release"], calls  # once, for the replay that had operations


def test_a_replayed_barrier_keeps_a_reply_that_holds_the_ranks_own_notices_too(protocol: str) -> None:
    """The log holds only the notices a rank lacked at a barrier; the reply it keeps (`Memory.last_reply`, for a
    recovered manager's repeated arrival) must hold everything the barrier's reply did, its own interval too."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(2 * DOUBLES, np.int64)
        a[rt.rank * DOUBLES] = 1  # first touch: rank r is the home of page r
        mem.barrier()
        a[(1 - rt.rank) * DOUBLES] = 5  # a write to the other rank's page: an interval with a notice
        mine = mem.vt[rt.rank] + 1  # the interval the barrier closes
        mem.start_replay(ScriptedReplay([("arrive", mem.epoch + 1), ("barrier", mem.epoch + 1, [9, 9], [])]))
        mem.barrier()
        epoch, vt, notices = mem.last_reply
        return epoch == mem.epoch, vt, sorted((q, i) for q, i, _ in notices), mine

    for rank, (same, vt, notices, mine) in enumerate(run_ranks(2, body, protocol)):
        assert same and vt == [9, 9] and (rank, mine) in notices
