"""The DSM handler's service to a recovery by replay: duplicate releases, repeated arrivals, minimal page versions."""

# Thread-ranks attached to one DSM (dsm_util.run_ranks); the requests a
# recovered rank sends again after its replay (design of issue 13 part 5,
# §2.5, §2.6) are built by hand and sent as the DSM sends them.  Lock l lives
# at rank l mod N; rank 0 manages barriers.

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from dsm_util import run_ranks
from recovery_util import RankProcess, RecoveryJob, concurrently

import ckpt
import dsm
from ckpt.plugin import RANKS_NS
from ckpt.testing import ThreadRuntime, wait_for
from dsm import _reconnect
from dsm._messages import Ack, BarrierReply, BarrierRequest, OldPageRequest, PageReply, ReleaseRequest
from dsm._net import JOINING, UP
from dsm._region import gid_of

pytestmark = pytest.mark.timeout(60)

WORDS = 512  # int64 per 4 KiB page
ANSWER = 10.0  # seconds: a request the handler answers at once
HANG = 20.0  # seconds after which a thread-rank that has not finished is a deadlock


def _release_again(mem: dsm.Memory, lock: int, token: int) -> Ack:
    """A release of `lock` as `Memory.release` sends it (token `token`), answered by the lock's home."""
    request = ReleaseRequest(mem._next_rid(), lock, list(mem.vt), [], token)
    return mem._request(lock % mem.size, request, Ack, f"release of lock {lock} again", ANSWER)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_release_sent_again_is_acked_and_changes_nothing(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[int, int, dict[int, int], list[int]] | None:
        mem.lock()
        lock1 = mem.lock()  # home: rank 1
        if rt.rank == 0:
            lock1.acquire()  # token 1
            lock1.release()
            _release_again(mem, 1, 1)  # the replay's last release, whose log record cannot say it left
            lock1.acquire()  # token 2: held again when the duplicate of token 1 comes
            _release_again(mem, 1, 1)
            with pytest.raises(dsm.DsmError, match="rank 0 released lock 0, which it does not hold"):
                _release_again(mem, 0, 5)  # lock 0 (home: rank 0) was never acquired: no duplicate, an error
            lock1.release()
        mem.barrier()
        if rt.rank == 1:
            state = mem.handler.locks[1]
            return state.holder, state.token, dict(state.released), list(state.vt)
        return None

    holder, token, released, vt = run_ranks(2, body, protocol)[1]
    # the second acquisition was released once, by its own token, and nothing else changed the lock
    assert (holder, token, released) == (-1, 0, {0: 2})
    assert vt[0] == 0  # rank 0 wrote nothing: no release raised the lock's timestamp


def test_the_barrier_manager_answers_an_arrival_at_its_last_barrier_from_its_stored_reply() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[list[int], list[list[object]]] | None:
        a = mem.array(2 * WORDS, np.int64)
        a[rt.rank * WORDS] = rt.rank + 1  # an interval each: the barrier's union holds both notices
        mem.barrier()
        if rt.rank == 1:  # its reply lost with the manager's previous incarnation: it arrives again
            again = BarrierRequest(mem._next_rid(), mem.epoch, [0, 0], [])
            reply = mem._request(0, again, BarrierReply, "barrier 1 again", ANSWER)
            assert reply.vt == mem.vt
            return reply.vt, reply.notices
        return None

    vt, notices = run_ranks(2, body, "async")[1]
    assert vt == [1, 1]
    assert sorted((q, i) for q, i, _ in notices) == [(0, 1), (1, 1)]


def test_a_barrier_the_manager_replayed_answers_an_arrival_at_it() -> None:
    answered = threading.Event()
    mem_of: dict[int, dsm.Memory] = {}

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[list[int], list[list[object]]] | None:
        mem_of[rt.rank] = mem
        mem.barrier()
        if rt.rank == 0:  # replayed barrier 2 from its log: its predecessor completed it
            mem.handler.replayed_barrier(2, [3, 4], [[1, 4, [7, 1]]])
            mem.handler.replayed_barrier(1, [9, 9], [])  # older than the one kept: ignored
            assert answered.wait(HANG)
            return None
        wait_for(lambda: (mem_of[0].handler.last_barrier or [0])[0] == 2, HANG, "rank 0 to replay barrier 2")
        again = BarrierRequest(mem._next_rid(), 2, [0, 4], [])
        reply = mem._request(0, again, BarrierReply, "barrier 2 again", ANSWER)
        answered.set()
        return reply.vt, reply.notices

    assert run_ranks(2, body, "async")[1] == ([3, 4], [[1, 4, [7, 1]]])


class Versions:
    """A fake `dsm.PageVersions`: every version is the page filled with the sum of its timestamp."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.asked: list[tuple[int, list[int]]] = []

    def page(self, gid: int, vt: list[int]) -> bytes:
        self.asked.append((gid, list(vt)))
        return bytes([sum(vt) % 256]) * self.page_size


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_minimal_page_versions_are_served_by_the_home_from_its_page_versions(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[list[tuple[int, list[int]]], int] | None:
        a = mem.array(2 * WORDS, np.int64)
        a[rt.rank * WORDS] = rt.rank + 1  # rank r is the home of page r
        mem.barrier()
        versions = Versions(mem.page_size)
        if rt.rank == 1:
            mem.versions = versions
        mem.barrier()
        if rt.rank == 0:
            old = OldPageRequest(mem._next_rid(), gid_of(0, 1), [2, 3])
            reply = mem._request(1, old, PageReply, "page 1 at [2, 3]", ANSWER)
            assert reply.data == bytes([5]) * mem.page_size
            with pytest.raises(dsm.DsmError, match=r"page 0x0 is not homed here"):
                mem._request(1, OldPageRequest(mem._next_rid(), gid_of(0, 0), [0, 0]), PageReply, "page 0", ANSWER)
            with pytest.raises(dsm.DsmError, match="no page versions are kept here"):
                mem._request(0, OldPageRequest(mem._next_rid(), gid_of(0, 0), [0, 0]), PageReply, "page 0", ANSWER)
        mem.barrier()
        if rt.rank == 1:
            return versions.asked, mem.statistics().versions_served
        return None

    assert run_ranks(2, body, protocol)[1] == ([(gid_of(0, 1), [2, 3])], 1)


# ---------------------------------------------------------------------- a recovered rank's reconnection
# Three thread-ranks, each a verbs process of its own (recovery_util); rank 1, R, is the victim.  After
# R's image, rank 0 takes lock 1 (homed at R) and claims page 4 of the array (default home: R) by its
# first touch; then R dies.  Rank 2 asks for lock 1: its request is re-sent to R's next incarnation and
# waits there until R's "replay" ends -- simulated: the test's dsm_recovering sets a replay so the DSM
# does not end it at once, and R's program then does live work (an interval released through lock 0)
# before it calls `replay_done`, as the DSM does when a replay's last logged operation is done.


class Recorder:
    """R's dsm_recovering: what it saw of the reconnection, and a replay so the locks stay held back."""

    def __init__(self, survivors: dict[int, dsm.Memory]) -> None:
        self.survivors = survivors
        self.reports: dict[int, dict[str, Any]] = {}
        self.seen: dict[str, Any] = {}

    @ckpt.hookimpl
    def dsm_recovering(self, memory: dsm.Memory, incarnation: int, reports: dict[int, dict[str, Any]]) -> None:
        kv = memory.rt.kv
        self.reports = reports
        self.seen = {
            "incarnation": incarnation,
            "ready_published": [
                kv.get(_reconnect.KV_NS, _reconnect.ready_key(memory.mid, 1, j, _reconnect.link_tag(1, 1, j, 0)))
                for j in self.survivors
            ],
            "survivor_links": [(m.client.state[1], m.server.state[1]) for m in self.survivors.values()],
            "own_links": [(memory.client.state[j], memory.server.state[j]) for j in self.survivors],
            "handler_running": memory._thread is not None,
            "table": int(memory.regions[0].table[4]),
        }
        memory.replay = cast(Any, "replaying")  # the DSM's replay mode is not under test: only that it is not None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_recovered_rank_rebuilds_its_locks_from_the_survivors_reports_once_its_replay_is_done(
    protocol: str,
) -> None:
    job = RecoveryJob(3, {"dsm_protocol": protocol})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    imaged, acted = threading.Barrier(3, timeout=HANG), threading.Barrier(3, timeout=HANG)
    died, replayed = threading.Event(), threading.Event()
    recorder = Recorder({})
    held_back: list[int] = []

    def victim(proc: RankProcess, mem: dsm.Memory, image: bytes) -> tuple[dsm.Memory, Any, list[Any]]:
        acted.wait()
        mem._halt()
        proc.kill()
        died.set()
        survivors = [job.ranks[0], job.ranks[2]]
        proc.rt.kv.publish(RANKS_NS, "failed/1", 0)  # what the coordinator does, then the survivors' hooks
        for other in survivors:
            other.call("ckpt_rank_failed", rank=1, incarnation=0)
        wait_for(lambda: any(dst == 1 for dst, _, _ in list(memories[2].pending.values())), HANG, "rank 2's acquire")
        mem, a, locks = proc.respawn(image)
        memories[1] = mem
        recorder.survivors.update({0: memories[0], 2: memories[2]})
        proc.host.register(recorder, name="recorder")
        mem._decide_hooks()  # the recorder came after the image was loaded (a real plugin is there before)

        def recovered(other: RankProcess) -> Any:
            return lambda: other.call("ckpt_rank_recovered", rank=1, incarnation=1)

        concurrently(lambda: proc.call("ckpt_refresh"), *(recovered(other) for other in survivors))
        proc.call("ckpt_resume", restarted=True, aborted=False, independent=False)
        mem.replay = None  # the "replay" ends with live work (an interval released through lock 0)
        wait_for(lambda: len(mem.handler.held_back) == 1, HANG, "rank 2's acquire, held back at rank 1")
        held_back.append(len(mem.handler.held_back))
        with locks[0]:
            a[WORDS] = 20  # its own home page: the notice reaches rank 2 only through lock 1's rebuilt state
            a[4 * WORDS + 1] = 41  # page 4 is rank 0's (its claim): a diff to rank 0
        mem.handler.replay_done()
        replayed.set()
        return mem, a, locks

    def rank_main(proc: RankProcess) -> list[int]:
        me = proc.rank
        mem = memories[me] = dsm.attach(proc.rt, protocol)
        a = mem.array(6 * WORDS, np.int64)
        locks = [mem.lock() for _ in range(3)]
        a[me * WORDS] = me + 1  # rank r is the home of page r
        mem.barrier()
        image = b""
        if me == 1:
            mem._halt()  # quiesced, as at a checkpoint
            image = proc.snapshot((mem, a, locks))
            mem._start()
        imaged.wait()
        seen = -1
        if me == 0:
            locks[1].acquire()
            a[4 * WORDS] = 40  # first touch of page 4 at its default home, rank 1: after its image
            acted.wait()
            assert replayed.wait(HANG)
            locks[1].release()  # held by rank 0 in the rebuilt lock: no error
        elif me == 2:
            seen = int(a[WORDS])  # a valid copy of rank 1's page, from before its death
            acted.wait()
            assert died.wait(HANG)
            with locks[1]:  # re-sent to rank 1's next incarnation, held back, then queued behind rank 0
                seen = int(a[WORDS])
        else:
            mem, a, locks = victim(proc, mem, image)
        mem.barrier()
        lock1 = memories[1].handler.locks[1]
        assert (lock1.holder, lock1.queue) == (-1, deque())
        return [seen, int(a[WORDS]), int(a[4 * WORDS]), int(a[4 * WORDS + 1])]

    results = job.run([rank_main] * 3, timeout=HANG * 3)
    assert results == [[-1, 20, 40, 41], [-1, 20, 40, 41], [20, 20, 40, 41]]
    assert held_back == [1]
    assert recorder.seen == {
        "incarnation": 1,
        "ready_published": [None, None],  # the survivors wait for the hook
        "survivor_links": [(JOINING, JOINING)] * 2,
        "own_links": [(UP, UP)] * 2,  # its one-sided operations may reach its log home
        "handler_running": False,
        "table": 1,  # rank 0's claim, from its report: rank 1 does not claim page 4 again
    }
    assert recorder.reports[0]["held"] == {1: [1, [0, 0, 0]]}  # rank 0's token; the vt of the grant (no release yet)
    assert recorder.reports[0]["claims"] == [gid_of(0, 4)]
    assert recorder.reports[2]["held"] == {} and recorder.reports[2]["claims"] == []
    assert {(q, i) for q, i, _ in recorder.reports[0]["known"]} == set()  # rank 0's interval is still open


def test_a_survivors_report_leaves_out_an_interval_caught_between_its_timestamp_and_its_notice() -> None:
    """`Memory._close_interval` raises vt[me] just before it records the interval's notice: a report read in
    between must not name an interval whose notice it lacks (a grant would then carry no notice for it)."""
    memory = SimpleNamespace(
        rank=0,
        size=2,
        vt=[3, 1],
        floor=[1, 1],
        known={(0, 2): [5, 0]},  # interval 3 of rank 0: its timestamp raised, its notice not yet recorded
        held={1: [3, 1], 0: [1, 1]},
        tokens={1: 4, 0: 2},
        regions=[],
    )
    report = _reconnect.survivor_report(cast(Any, memory), 1)
    assert report == {"vt": [2, 1], "known": [[0, 2, [5, 0]]], "held": {1: [4, [3, 1]]}, "claims": []}
    memory.known[(0, 3)] = [5, 0]
    assert _reconnect.survivor_report(cast(Any, memory), 1)["vt"] == [3, 1]
