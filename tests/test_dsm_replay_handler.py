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
from ckpt.testing import FakeRuntime, ThreadRuntime, wait_for
from dsm import _handler as dsm_handler
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


def _attached(
    proc: RankProcess, memories: dict[int, dsm.Memory], protocol: str, pages: int, nlocks: int, imaged: bool
) -> tuple[dsm.Memory, Any, list[Any], bytes]:
    """Attach, make an array of `pages` pages (rank r first-touches page r: its home) and `nlocks` locks, pass
    a barrier; `imaged`: take this rank's image there, quiesced as at a checkpoint (else the image is b"")."""
    mem = memories[proc.rank] = dsm.attach(proc.rt, protocol)
    a = mem.array(pages * WORDS, np.int64)
    locks = [mem.lock() for _ in range(nlocks)]
    a[proc.rank * WORDS] = proc.rank + 1
    mem.barrier()
    image = b""
    if imaged:
        mem._halt()
        image = proc.snapshot((mem, a, locks))
        mem._start()
    return mem, a, locks, image


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
    standing: dict[Any, str] = {}

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
        standing.update(mem.handler.standing())  # what `ckpt status` would show of it (`dsm._waits.Standing`)
        with locks[0]:
            a[WORDS] = 20  # its own home page: the notice reaches rank 2 only through lock 1's rebuilt state
            a[4 * WORDS + 1] = 41  # page 4 is rank 0's (its claim): a diff to rank 0
        mem.handler.replay_done()
        replayed.set()
        return mem, a, locks

    def rank_main(proc: RankProcess) -> list[int]:
        me = proc.rank
        mem, a, locks, image = _attached(proc, memories, protocol, 6, 3, imaged=me == 1)
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
    assert standing == {("held back", 1): "requests of rank 2 wait for this rank's replay and the rebuild of its locks"}
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
    assert report == {
        "vt": [2, 1],
        "known": [[0, 2, [5, 0]]],
        "held": {1: [4, [3, 1]]},
        "claims": [],
        "releasing": [],
        "barrier": None,
    }
    memory.known[(0, 3)] = [5, 0]
    assert _reconnect.survivor_report(cast(Any, memory), 1)["vt"] == [3, 1]


# ---------------------------------------------------------------------- rebuilding the locks homed at a recovered rank
# A `Handler` on a stand-in memory (its program state, a key-value store, a server endpoint that records
# what is sent): what `replay_done` publishes, waits for and rebuilds, and how the rebuilt locks answer
# the release a replay sends again.


class Endpoint:
    """The server endpoint as the handler uses it: replies recorded, every link up, an inbox to wake."""

    def __init__(self, size: int) -> None:
        self.sent: list[tuple[int, Any]] = []
        self.state = [UP] * size
        self.link = [0] * size
        self.lock = threading.Lock()
        self.inbox: list[tuple[int, Any, int, int]] = []

    def send(self, dst: int, msg: Any) -> int:
        self.sent.append((dst, msg))
        return 1


def _home(rank: int, size: int, **program: Any) -> tuple[Any, dsm_handler.Handler, FakeRuntime]:
    """Recovered rank `rank` (incarnation 1) of `size`, its locks held back; `program`: its state after its replay."""
    rt = FakeRuntime()
    mem = SimpleNamespace(
        rank=rank, size=size, mid=7, rt=rt, regions=[], server=Endpoint(size),
        vt=[0] * size, floor=[0] * size, known={}, held={}, tokens={}, releasing=set(),
    )  # fmt: skip
    for name, value in program.items():
        setattr(mem, name, value)
    mem.handler = handler = dsm_handler.Handler(cast(Any, mem))
    handler.hold_locks(1)
    return mem, handler, rt


def _report(
    size: int, held: dict[int, list[Any]], vt: list[int] | None = None, releasing: list[int] | None = None
) -> dict[str, Any]:
    return {"vt": vt or [0] * size, "known": [], "held": held, "claims": [], "releasing": releasing or []}


def test_a_survivor_holding_a_lock_the_recovered_home_replayed_holding_has_it_and_the_release_sent_again_is_a_dup() -> (
    None
):
    """Rank 0, lock 0's home, replayed its acquire and its release of lock 0, the release logged last: the DSM
    sends it again once live.  Its previous incarnation had served it, and rank 1 has acquired the lock since."""
    mem, handler, rt = _home(0, 2, vt=[3, 1], known={(0, 3): [5, 0]}, held={0: [0, 0]}, tokens={0: 3}, releasing={0})
    handler.reports = {1: _report(2, {0: [5, [3, 1]]}, [3, 2])}
    handler.replay_done()
    lock = handler.locks[0]
    assert (handler.holding, lock.holder, lock.token, lock.released, lock.vt) == (False, 1, 5, {0: 3}, [3, 2])
    post = rt.kv.get(_reconnect.KV_NS, _reconnect.post_key(7, 0, 1))
    assert post == {
        "vt": [3, 1],
        "known": [[0, 3, [5, 0]]],
        "held": {0: [3, [0, 0]]},
        "claims": [],
        "releasing": [0],
        "barrier": None,
    }
    handler._release(0, 11, 0, [3, 1], [], 3)  # sent again: acked, changes nothing
    assert (lock.holder, lock.token) == (1, 5)
    handler._release(1, 12, 0, [3, 2], [], 5)
    assert (lock.holder, lock.released) == (-1, {0: 3, 1: 5})
    assert [(dst, type(msg).__name__) for dst, msg in mem.server.sent] == [(0, "Ack"), (1, "Ack")]
    assert rt.fall_backs == []


def test_a_recovered_home_rebuilds_its_locks_once_the_ranks_that_recovered_with_it_published_their_state() -> None:
    """Rank 0 of 4 recovered with rank 2 (no report from it) while rank 3 was lost, and lost again as incarnation 1:
    the locks homed at 0 wait for rank 2's state after its replay and for rank 3's incarnation 2's."""
    mem, handler, rt = _home(0, 4, vt=[2, 0, 0, 0], known={(0, 2): [9, 0]}, floor=[1, 0, 0, 0])
    handler.awaited = {2: 1, 3: 1}
    handler.held_back = [(2, "a release of lock 4", 0)]
    handler.replay_done()
    assert rt.kv.get(_reconnect.KV_NS, _reconnect.post_key(7, 0, 1))["known"] == [[0, 2, [9, 0]]]
    assert handler.holding and handler.locks == {}  # nothing rebuilt: the lock requests still wait
    rank2 = _report(4, {4: [7, [0, 0, 0, 0]], 1: [1, [0, 0, 0, 0]]}, [1, 0, 5, 0])  # lock 1 is homed at rank 1
    rank2["known"] = [[2, 5, [4, 2]]]
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 2, 1), rank2)
    rt.kv.publish(RANKS_NS, "failed/3", 1)
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 3, 2), _report(4, {8: [2, [0, 0, 0, 0]]}, [0, 0, 0, 4]))
    wait_for(lambda: not handler.holding, HANG, "the locks of rank 0 to be rebuilt")
    assert sorted((lock, s.holder, s.token) for lock, s in handler.locks.items()) == [(4, 2, 7), (8, 3, 2)]
    assert handler.locks[4].vt == [2, 0, 5, 4]
    assert set(handler.locks[4].notices) == {(0, 2), (2, 5)}
    assert mem.server.inbox[0][1] == dsm_handler.WAKE  # the handler thread serves what was held back
    assert rt.fall_backs == []


def test_of_two_ranks_recovered_at_once_that_hold_a_lock_the_one_not_releasing_it_has_it() -> None:
    """Rank 0 (lock 0's home) and rank 2 both replayed an acquire of lock 0, rank 0's release logged last (served
    before the failure: it is sending it again): rank 2, whose log ends in its acquisition, holds it -- also when
    their states are equal (the CI's stress campaign: the lock carried rank 0's timestamp to rank 2)."""
    for rank2_vt in ([2, 1, 1], [2, 1, 0]):
        _, handler, rt = _home(0, 3, vt=[2, 1, 0], known={(0, 2): [5, 0]}, held={0: [0, 0, 0]}, tokens={0: 3})
        handler.mem.releasing = {0}
        handler.awaited = {2: 1}
        rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 2, 1), _report(3, {0: [4, [0, 0, 0]]}, rank2_vt))
        handler.replay_done()
        wait_for(lambda handler=handler: not handler.holding, HANG, "the locks of rank 0 to be rebuilt")
        assert (handler.locks[0].holder, handler.locks[0].token, handler.locks[0].released) == (2, 4, {0: 3})
        assert rt.fall_backs == []


def test_of_two_ranks_recovered_at_once_both_releasing_a_lock_the_later_grantee_has_it() -> None:
    """Both logged their release of lock 0 last: the one whose state covers the other's was granted it later, and
    its release may not have reached the home.  Equal states cannot tell which was later, and need not: the later
    one's critical section closed no interval, so the lowest rank is named holder (its release, sent again, frees
    the lock; the other's is acked as done).  The CI's stress campaign met it: TSP's bound lock is taken to read."""
    _, handler, rt = _home(
        0, 3, vt=[2, 1, 0], known={(0, 2): [5, 0]}, held={0: [0, 0, 0]}, tokens={0: 3}, releasing={0}
    )
    handler.awaited = {2: 1}
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 2, 1), _report(3, {0: [4, [0, 0, 0]]}, [2, 1, 1], [0]))
    handler.replay_done()
    wait_for(lambda: not handler.holding, HANG, "the locks of rank 0 to be rebuilt")
    assert (handler.locks[0].holder, handler.locks[0].token, handler.locks[0].released) == (2, 4, {0: 3})

    _, handler, rt = _home(
        0, 3, vt=[2, 1, 0], known={(0, 2): [5, 0]}, held={0: [0, 0, 0]}, tokens={0: 3}, releasing={0}
    )
    handler.reports = {1: _report(3, {}, [2, 1, 0])}
    handler.awaited = {2: 1}
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 2, 1), _report(3, {0: [4, [0, 0, 0]]}, [2, 1, 0], [0]))
    handler.replay_done()
    wait_for(lambda: not handler.holding, HANG, "the locks of rank 0 to be rebuilt")
    assert (handler.locks[0].holder, handler.locks[0].token, handler.locks[0].released) == (0, 3, {2: 4})
    assert rt.fall_backs == []


def test_two_recovered_ranks_neither_releasing_a_lock_is_an_error_that_falls_back() -> None:
    _, handler, rt = _home(0, 3, vt=[2, 1, 0], known={(0, 2): [5, 0]}, held={0: [0, 0, 0]}, tokens={0: 3})
    handler.awaited = {2: 1}
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 2, 1), _report(3, {0: [4, [0, 0, 0]]}, [2, 1, 1]))
    handler.replay_done()
    wait_for(lambda: bool(rt.fall_backs), HANG, "rank 0 to fall back")
    assert rt.fall_backs == ["rank 0: lock 0 is held by both rank 0 and rank 2, neither releasing it"]


def test_a_rank_that_publishes_no_state_after_its_replay_fails_the_wait_in_one_line() -> None:
    mem, _, rt = _home(0, 2)
    with pytest.raises(dsm.DsmError, match=r"^DSM: rank 1 \(incarnation 1\) published no state after its replay"):
        _reconnect.await_posts(cast(Any, mem), {1: 1}, timeout=0.3)
    rt.kv.publish(RANKS_NS, "failed/1", 1)  # incarnation 1 is lost: its next one's state is the one to wait for
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 1, 2), _report(2, {}, [0, 6]))
    assert _reconnect.await_posts(cast(Any, mem), {1: 1}, timeout=0.3)[1]["vt"] == [0, 6]


def test_a_recovered_manager_answers_its_arrival_sent_again_from_the_reply_the_survivors_received() -> None:
    """Rank 0 completed barrier 5 and died before its own log record of it; the survivors passed it and report
    its reply: the recovered manager answers its own arrival at 5 with it, and barrier 6 completes as usual."""
    memory = SimpleNamespace(
        rank=1, size=2, vt=[4, 3], floor=[4, 3], known={}, held={}, tokens={}, regions=[], last_reply=(5, [4, 3], [])
    )
    report = _reconnect._report(_reconnect.survivor_report(cast(Any, memory), 0), 2)
    assert report["barrier"] == [5, [4, 3], []]
    assert _reconnect.survivor_report(cast(Any, memory), 1)["barrier"] is None  # only the manager needs it
    mem, handler, rt = _home(0, 2)
    handler.adopt_barrier({1: {**report, "barrier": [5, [4, 3], [[1, 3, [9, 1]]]]}})
    handler.replay_done()
    handler._barrier(0, 1, 5, [4, 2], [])
    handler._barrier(1, 2, 6, [4, 3], [])
    handler._barrier(0, 3, 6, [5, 3], [[0, 5, [2, 0]]])
    replies = [(dst, type(msg).__name__, msg.vt, msg.notices) for dst, msg in mem.server.sent]
    assert replies == [
        (0, "BarrierReply", [4, 3], [[1, 3, [9, 1]]]),
        (1, "BarrierReply", [5, 3], [[0, 5, [2, 0]]]),
        (0, "BarrierReply", [5, 3], [[0, 5, [2, 0]]]),
    ]
    assert rt.fall_backs == []


def test_a_recovered_manager_takes_a_barrier_reply_from_a_rank_recovered_with_it() -> None:
    """Rank 0 completed barrier 43 and died before its own log record of it, together with rank 2, the one rank
    that received the reply (the stress campaign: ranks 1 and 3 re-send their arrivals at 43, while rank 2,
    whose log holds the reply, replays past it and arrives at 44).  No survivor's report has the reply, rank 2's
    post-replay report has: the arrivals wait until the manager has it, then 43 is answered from it and 44
    waits for its other ranks -- no fallback."""
    mem, handler, rt = _home(0, 4)
    handler.awaited = {2: 1}
    replied = [43, [5, 3, 6, 2], [[2, 6, [4, 2]]]]
    post = {**_report(4, {}, [5, 3, 7, 2]), "barrier": replied}
    rt.kv.publish(_reconnect.KV_NS, _reconnect.post_key(7, 2, 1), post)
    for src, epoch in ((1, 43), (3, 43), (0, 43), (2, 44)):
        handler.serve(src, list(BarrierRequest(10 + src, epoch, [0, 0, 0, 0], [])))
    assert mem.server.sent == [] and rt.fall_backs == []  # held back with the lock requests
    handler.replay_done()
    wait_for(lambda: not handler.holding, HANG, "rank 0's locks to be rebuilt")
    handler.serve(0, dsm_handler.WAKE)
    answered = [(dst, type(msg).__name__, msg.vt, msg.notices) for dst, msg in mem.server.sent]
    assert answered == [(src, "BarrierReply", replied[1], replied[2]) for src in (1, 3, 0)]
    assert [a[0] for a in handler.arrivals] == [2] and rt.fall_backs == []


def test_a_recovered_manager_whose_barrier_reply_was_lost_with_its_predecessor_falls_back() -> None:
    """Rank 0 completed barrier 5 and died before its own log record of it: re-executing, it arrives at 5 again
    while rank 1, past it, waits at 6 (design §3): the job restarts whole, the arrivals get the error."""
    mem, handler, rt = _home(0, 2)
    handler.replay_done()
    handler._barrier(0, 1, 5, [0, 0], [])
    handler._barrier(1, 2, 6, [0, 0], [])
    assert rt.fall_backs == [
        "rank 0: barrier 5 completed before the manager failed, its reply is lost "
        "(rank 0 at barrier 5, rank 1 at barrier 6)"
    ]
    assert [(dst, type(msg).__name__) for dst, msg in mem.server.sent] == [(0, "ErrorReply"), (1, "ErrorReply")]
    survivor, manager, rt = _home(0, 2)
    manager.incarnation = 0  # never recovered: barriers out of step are the program's, an error as ever
    manager._barrier(0, 1, 5, [0, 0], [])
    manager._barrier(1, 2, 6, [0, 0], [])
    assert rt.fall_backs == [] and len(survivor.server.sent) == 2


# ---------------------------------------------------------------------- two ranks recovering at once
# Four thread-ranks; ranks 0 and 2 die together and come back together.  After their images, rank 2
# acquired lock 0 (homed at rank 0); its "replay" ends holding it again, as its log says (simulated, as
# above).  Rank 0 gets no report from rank 2: its locks wait for rank 2's post-replay report, and then
# rank 2's release of lock 0 finds it the holder.


class Replaying:
    """A recovered rank's dsm_recovering: a replay is set, so the locks stay held back until the test ends it."""

    @ckpt.hookimpl
    def dsm_recovering(self, memory: dsm.Memory, incarnation: int, reports: dict[int, dict[str, Any]]) -> None:
        memory.replay = cast(Any, "replaying")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_lock_home_recovering_with_a_rank_that_holds_its_lock_waits_for_that_ranks_state(protocol: str) -> None:
    job = RecoveryJob(4, {"dsm_protocol": protocol})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    imaged, acted = threading.Barrier(4, timeout=HANG), threading.Barrier(4, timeout=HANG)
    dead, back, resumed = (threading.Barrier(2, timeout=HANG) for _ in range(3))
    waited, released = threading.Event(), threading.Event()
    survivors = [job.ranks[1], job.ranks[3]]
    # a runtime runs its events one at a time, in the coordinator's order (the same on every survivor)
    first = {other.rank: threading.Event() for other in survivors}

    def victim(proc: RankProcess, mem: dsm.Memory, image: bytes) -> tuple[dsm.Memory, Any, list[Any]]:
        me = proc.rank
        acted.wait()
        mem._halt()
        proc.kill()
        if dead.wait() == 0:  # both are dead: what the coordinator and the survivors' runtimes do
            for rank in (0, 2):
                proc.rt.kv.publish(RANKS_NS, f"failed/{rank}", 0)
                for other in survivors:
                    other.call("ckpt_rank_failed", rank=rank, incarnation=0)
        mem, a, locks = proc.respawn(image)
        memories[me] = mem
        proc.host.register(Replaying(), name="replaying")
        mem._decide_hooks()
        proc.rt.kv.publish(RANKS_NS, f"incarnation/{me}", 1)
        back.wait()  # both in REFRESH at once, while the survivors hear that they are back

        def recovered(other: RankProcess) -> None:
            if me == 2:
                assert first[other.rank].wait(HANG)
            other.call("ckpt_rank_recovered", rank=me, incarnation=1)
            first[other.rank].set()

        concurrently(lambda: proc.call("ckpt_refresh"), *(lambda o=o: recovered(o) for o in survivors))
        proc.call("ckpt_resume", restarted=True, aborted=False, independent=False)
        resumed.wait()
        if me == 0:
            assert mem.handler.awaited == {2: 1}
            mem.replay = None
            mem.handler.replay_done()  # its replay is over first: its locks wait for rank 2's state
            assert mem.handler.holding
            waited.set()
        else:
            assert mem.handler.awaited == {0: 1}
            assert waited.wait(HANG)
            mem.acquires += 1  # its replay ends having acquired lock 0 again, as its log says
            mem.held[0], mem.tokens[0] = list(mem.floor), mem.acquires
            mem.replay = None
            mem.handler.replay_done()
            locks[0].release()  # live: rank 0 rebuilt lock 0 with rank 2 its holder
            released.set()
        return mem, a, locks

    def rank_main(proc: RankProcess) -> list[int]:
        me = proc.rank
        mem, a, locks, image = _attached(proc, memories, protocol, 4, 4, imaged=me in (0, 2))
        imaged.wait()
        if me == 2:
            locks[0].acquire()
        if me in (0, 2):
            mem, a, locks = victim(proc, mem, image)
        else:
            acted.wait()
            assert released.wait(HANG)
        with locks[0]:  # every rank gets lock 0 from its rebuilt home
            a[WORDS + 1] += 1
        mem.barrier()
        return [int(a[WORDS + 1]), memories[0].handler.locks[0].holder]

    assert job.run([rank_main] * 4, timeout=HANG * 3) == [[4, -1]] * 4
