"""DSM links to a peer declared lost: nothing of its dead incarnation is served, nothing waits forever on it."""

# Three (or four) thread-ranks, each a verbs process of its own under ckpt_ib
# (recovery_util).  Lock l lives at rank l.  The tests drive the runtime's
# notifications by hand, as the coordinator would: `ckpt_rank_failed` on the
# survivors with `RANKS_NS failed/<R>` published, and for a recovery
# `incarnation/<R>` then `ckpt_rank_recovered` (REFRESH on the new one).
# A request of a lost incarnation must not be served: a lock granted to it
# would stay held by a rank that ignores the grant, and the next acquirer
# (rank 2 here) would wait forever -- which is what these tests would do
# before the fixes (bounded by the job's timeout).

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from recovery_util import RankProcess, RecoveryJob, concurrently

import dsm
from ckpt.plugin import RANKS_NS
from ckpt.testing import wait_for
from dsm import _net, _reconnect
from dsm._messages import AcquireRequest
from dsm._net import FAILED, UP

pytestmark = pytest.mark.timeout(120)

WORDS = 512  # int64 per 4 KiB page
HANG = 20.0  # seconds after which a thread-rank that has not finished is a deadlock


def _lost(proc: RankProcess, victim: int, incarnation: int = 0) -> None:
    """What the coordinator does on `proc` when `victim`'s `incarnation` is lost: the KV key, then the hook."""
    proc.rt.kv.publish(RANKS_NS, f"failed/{victim}", incarnation)
    proc.call("ckpt_rank_failed", rank=victim, incarnation=incarnation)


def _stale_acquire(mem: dsm.Memory, lock: int) -> None:
    """Send an acquire of `lock` to its home as the program would, without waiting for the grant;
    return once the home's HCA has it (every send slot towards it is free again)."""
    home = lock % mem.size
    assert mem.client.send(home, AcquireRequest(mem._next_rid(), lock, list(mem.vt), 0)) is not None

    def landed() -> bool:
        mem.client.poll()
        return len(mem.client.free[home]) == mem.client.nsend

    wait_for(landed, HANG, "the acquire to land at the lock's home")


def _three_ranks(
    stale: Any, survivor: Any, *, protocol: str = "async", timeout: float = HANG
) -> tuple[RecoveryJob, dict[int, dsm.Memory]]:
    """Rank 1 is declared lost by rank 0 (`stale(proc, mem, step)` on ranks 0 and 1 arranges what reaches
    rank 0 and when); rank 2 then takes lock 0 (homed at rank 0) and must get it (`survivor` checks more)."""
    job = RecoveryJob(3, {"dsm_protocol": protocol})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    steps = [threading.Barrier(2, timeout=HANG) for _ in range(3)]
    done = threading.Event()

    def body(proc: RankProcess) -> None:
        mem = memories[proc.rank] = dsm.attach(proc.rt, protocol)
        locks = [mem.lock() for _ in range(3)]
        mem.barrier()
        if proc.rank in (0, 1):
            for k, step in enumerate(steps):
                stale(proc, mem, k)
                step.wait()
            done.set()
        else:
            assert done.wait(HANG), "ranks 0 and 1 did not arrange the stale request"
            survivor(mem, memories)
            with locks[0]:  # the lock is free: no grant to a lost incarnation holds it
                pass

    job.run([body] * 3, timeout=timeout)
    return job, memories


def test_a_request_arriving_after_its_sender_was_declared_lost_is_dropped() -> None:
    def stale(proc: RankProcess, mem: dsm.Memory, step: int) -> None:
        if step == 0 and proc.rank == 0:
            _lost(proc, 1)  # e.g. heartbeat silence: rank 1 still runs, its QP to rank 0 is still live
            mem._halt()  # rank 0 reaps the completion below itself
        if step == 1 and proc.rank == 1:
            _stale_acquire(mem, 0)
        if step == 2 and proc.rank == 0:
            # its completion is in rank 0's CQ since rank 1's HCA had the ack: reap until the CQ is empty
            wait_for(lambda: not mem.server.poll(), HANG, "rank 0's server CQ to be drained")
            assert mem.server.inbox == []  # dropped as it came
            mem._start()

    def survivor(mem: dsm.Memory, memories: dict[int, dsm.Memory]) -> None:
        pass

    _, memories = _three_ranks(stale, survivor)
    assert memories[0].handler.locks[0].holder == -1
    assert memories[0].server.state[1] == FAILED and memories[0].server.inbox == []


def test_a_request_in_the_inbox_when_its_sender_is_declared_lost_is_dropped() -> None:
    def stale(proc: RankProcess, mem: dsm.Memory, step: int) -> None:
        if step == 0 and proc.rank == 0:
            mem._halt()  # the request waits in the inbox, unserved, until after the failure
        if step == 1 and proc.rank == 1:
            _stale_acquire(mem, 0)
        if step == 2 and proc.rank == 0:
            server = mem.server
            wait_for(lambda: server.poll() or server.inbox, HANG, "the acquire in rank 0's inbox")
            assert [peer for peer, *_ in server.inbox] == [1]
            _lost(proc, 1)
            mem._start()

    def survivor(mem: dsm.Memory, memories: dict[int, dsm.Memory]) -> None:
        pass

    _, memories = _three_ranks(stale, survivor)
    assert memories[0].handler.locks[0].holder == -1


def test_an_idle_handler_outlives_a_peers_recovery_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_net, "RECOVERY_TIMEOUT", 0.3)

    def stale(proc: RankProcess, mem: dsm.Memory, step: int) -> None:
        if step == 0 and proc.rank == 0:
            _lost(proc, 1)  # and it does not come back within RECOVERY_TIMEOUT
            since = mem.server.failed_at[1]
            # several of the handler's idle wake-ups (every WAKE s) past the timeout
            wait_for(lambda: time.monotonic() > since + _net.RECOVERY_TIMEOUT + 20 * _net.WAKE, HANG, "time")

    def survivor(mem: dsm.Memory, memories: dict[int, dsm.Memory]) -> None:
        assert memories[0]._failure is None, memories[0]._failure

    _three_ranks(stale, survivor)  # and rank 2 gets lock 0 from rank 0's handler


def test_a_survivor_abandons_a_reconnection_when_the_new_incarnation_is_lost_before_its_keys() -> None:
    job = RecoveryJob(2, {"dsm_protocol": "async"})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    attached = threading.Barrier(2, timeout=HANG)

    def body(proc: RankProcess) -> None:
        mem = memories[proc.rank] = dsm.attach(proc.rt, "async")
        mem.barrier()
        attached.wait()
        if proc.rank == 1:
            return  # incarnation 1 of it never publishes its keys: it dies after its RESTART barrier
        _lost(proc, 1, 0)
        proc.rt.kv.publish(RANKS_NS, "incarnation/1", 1)

        def recovered() -> None:
            proc.call("ckpt_rank_recovered", rank=1, incarnation=1)

        def dies_again() -> None:
            wait_for(lambda: proc.rt.kv.get(_reconnect.KV_NS, _reconnect.conn_key(mem.mid, 0, 1, "0.0-1.1")), HANG, "")
            proc.rt.kv.publish(RANKS_NS, "failed/1", 1)

        started = time.monotonic()
        concurrently(recovered, dies_again, timeout=HANG)  # not RECONNECT_TIMEOUT (120 s)
        assert time.monotonic() - started < 10 * _reconnect.SLICE + 5
        assert (mem.client.state[1], mem.server.state[1]) == (FAILED, FAILED)
        proc.call("ckpt_rank_failed", rank=1, incarnation=1)  # the event queued behind it runs

    job.run([body] * 2, timeout=HANG + 10)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("meet", ["both-in-refresh", "one-after-the-others-resume"])
def test_two_ranks_lost_at_once_are_both_reconnected(protocol: str, meet: str) -> None:
    """Ranks 1 and 3 of 4 die together and both come back: every link is up again, every page and lock served.

    both-in-refresh: both new incarnations are known before either reconnects, so they meet each other
    in their REFRESH (and the RankRecovered each hears after its RESUME is stale).  one-after-the-others-
    resume: rank 1 comes back while rank 3 is still lost (it skips it), and rank 3 meets it later, when
    rank 1's hooks hear that rank 3 is back.
    """
    size, victims, survivors = 4, (1, 3), (0, 2)
    job = RecoveryJob(size, {"dsm_protocol": protocol})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    imaged, killed, failed = (threading.Barrier(size, timeout=60) for _ in range(3))
    published = {v: threading.Event() for v in victims}
    resumed = {v: threading.Event() for v in victims}
    both = meet == "both-in-refresh"

    def come_back(proc: RankProcess, image: bytes) -> Any:
        me, other = proc.rank, victims[1] if proc.rank == victims[0] else victims[0]
        if not both and me == victims[1]:
            resumed[victims[0]].wait(60)  # rank 3 is lost while rank 1 comes back
        mem, *state = proc.respawn(image)  # RESTART
        memories[me] = mem
        proc.rt.kv.publish(RANKS_NS, f"incarnation/{me}", 1)  # the coordinator, once RESTART is complete
        published[me].set()
        if both:
            published[other].wait(60)
        proc.call("ckpt_refresh")
        proc.call("ckpt_resume", restarted=True, aborted=False, independent=False)
        resumed[me].set()
        published[other].wait(60)
        proc.call("ckpt_rank_recovered", rank=other, incarnation=1)  # its hooks run after its RESUME
        return (mem, *state)

    def rank_main(proc: RankProcess) -> tuple[np.ndarray, list[int]]:
        me = proc.rank
        mem = memories[me] = dsm.attach(proc.rt, protocol)
        pages, count = (mem.array(size * WORDS, np.int64) for _ in range(2))
        locks = [mem.lock() for _ in range(size)]
        pages[me * WORDS : (me + 1) * WORDS] = me + 1  # first touch: rank r is the home of page r
        count[me * WORDS] = 0
        mem.barrier()
        image = b""
        if me in victims:
            mem._halt()  # quiesced, as at a checkpoint
            image = proc.snapshot((mem, pages, count, locks))
            mem._start()
        imaged.wait()
        if me in victims:
            mem._halt()
            proc.kill()
        killed.wait()
        if me in survivors:
            for victim in victims:
                _lost(proc, victim)
        failed.wait()
        if me in victims:
            mem, pages, count, locks = come_back(proc, image)
        else:
            for victim in victims:
                published[victim].wait(60)
                proc.call("ckpt_rank_recovered", rank=victim, incarnation=1)
        mem.barrier()
        for lock, home in zip(locks, range(size), strict=True):  # each lock at its home, each counter at its rank
            with lock:
                count[home * WORDS] += 1
        mem.barrier()
        links = [(mem.client.state[j], mem.server.state[j]) for j in range(size)]
        assert links == [(UP, UP)] * size, links
        return np.asarray(pages[...]), [int(count[home * WORDS]) for home in range(size)]

    results = job.run([rank_main] * size, timeout=90)
    for pages, count in results:
        assert np.array_equal(pages, np.repeat(np.arange(1, size + 1), WORDS))
        assert count == [size] * size
