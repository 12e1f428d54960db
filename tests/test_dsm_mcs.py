"""Unit tests of the MCS queue locks on remote atomics (dsm._mcs.Control), through Cashmere memories on thread-ranks."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from dsm_util import run_ranks

from ckpt import verbs
from ckpt.testing import ThreadRuntime, wait_for
from dsm import DsmError
from dsm import _cashmere as cashmere
from dsm._mcs import FLAG, NEXT, NODE_WORDS, NODES, ONE, READ, SOURCE, TAILS
from dsm._net import Endpoint, rdma

pytestmark = pytest.mark.timeout(60)
NODE = 5  # the queue node the tests use (a program lock's: nothing else touches it here)


def test_waiters_get_the_lock_in_the_order_they_joined_with_the_holders_data() -> None:
    """Rank 0 holds; ranks 1, 2, 3 join in that order (each once the one before is linked in); each holder hands
    the lock on with its rank * 10 as data: the grants go 1, 2, 3, each with its predecessor's data, and the lock
    ends free."""
    mems: dict[int, Any] = {}
    holding = threading.Event()
    order: list[tuple[int, int]] = []
    node = NODES + NODE * NODE_WORDS

    def linked(rank: int) -> bool:  # `rank` is in line: its predecessor's node names it
        return int(mems[rank - 1].control.words[node + NEXT]) == rank + 1

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        mems[rt.rank] = mem
        control = mem.control
        mem.barrier()
        tail = control.remote(0, TAILS + 7)  # a tail word at rank 0
        if rt.rank == 0:
            free = control.acquire(0, tail, NODE, "the test lock")
            holding.set()
            wait_for(lambda: linked(3), 30, "ranks 1, 2, 3 in line")
        else:
            assert holding.wait(30)
            if rt.rank > 1:
                wait_for(lambda: linked(rt.rank - 1), 30, f"rank {rt.rank - 1} in line")
            free = control.acquire(0, tail, NODE, "the test lock")
            order.append((rt.rank, int(control.node_data(NODE, 1)[0])))
        control.words[SOURCE] = rt.rank * 10
        control.release(0, tail, NODE, "the test lock", data=(SOURCE, 1))
        mem.barrier()
        return free, int(control.words[TAILS + 7])

    results = run_ranks(4, body, "cashmere")
    assert [free for free, _ in results] == [True, False, False, False]
    assert order == [(1, 0), (2, 10), (3, 20)]
    assert results[0][1] == 0  # free again


def test_an_entry_read_with_a_losing_swap_is_read_again_when_a_later_swap_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock looks held at the first swap (whose chained READ brings what the holder is changing); the holder
    writes the data back and frees it before the second swap: the swap that wins must bring the data again."""

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        control = mem.control
        words = control.words
        if rt.rank == 1:
            return None
        words[TAILS + 3] = 2  # "rank 1 holds it"
        words[TAILS + 4] = 111  # what the holder is changing
        real = control.cas
        calls = []

        def cas(*args: Any, **kwargs: Any) -> int:
            old = real(*args, **kwargs)
            calls.append(old)
            if len(calls) == 1:  # the holder writes its data back and frees the lock
                words[TAILS + 4] = 222
                words[TAILS + 3] = 0
            return old

        monkeypatch.setattr(control, "cas", cas)
        read = [rdma(verbs.IBV_WR_RDMA_READ, control.local(READ, 1), *control.remote(0, TAILS + 4))]
        free = control.acquire(0, control.remote(0, TAILS + 3), NODE, "the test lock", read)
        return free, calls, int(words[READ]), int(words[TAILS + 3])

    free, calls, data, tail = run_ranks(2, body, "cashmere")[0]
    assert free and calls == [2, 0, 0]  # held; freed under the second swap; won by the third
    assert data == 222, "the winning swap kept the data the first one read"
    assert tail == 1  # rank 0 holds it


def test_a_barrier_releases_nobody_before_everyone_arrived_and_everyone_after() -> None:
    arrived = [threading.Event() for _ in range(3)]

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        if rt.rank == 2:
            for event in arrived[:2]:
                assert event.wait(30)
        arrived[rt.rank].set()
        mem.barrier()
        return all(event.is_set() for event in arrived), mem.statistics().barriers

    assert run_ranks(3, body, "cashmere") == [(True, 1)] * 3


def test_a_flag_write_wakes_a_rank_blocked_on_its_completion_channel() -> None:
    """Rank 1 waits on its own word (blocked on the channel after its spin); rank 0's WRITE WITH IMM sets it."""
    waiting = threading.Event()

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        control = mem.control
        mem.barrier()
        word = NODES + NODE * NODE_WORDS + 1
        if rt.rank == 1:
            waiting.set()
            control.wait(lambda: bool(control.words[word]), "the test flag")
            return int(control.words[word]), mem.server.notifications
        assert waiting.wait(30)
        control.run(1, [control.notify_write(control.local(5), 1, word)])  # ME: rank 0 + 1
        return None

    flag, notifications = run_ranks(2, body, "cashmere")[1]
    assert flag == 1 and notifications >= 1


def test_a_look_for_notifications_polls_only_once_one_came() -> None:
    """`Control.reap` runs at every lock operation.  With nothing arrived it must not poll: an empty poll of a
    simulated CQ waits up to 0.5 ms, which was half of a Cashmere run.  Once a WRITE WITH IMM has landed, a look
    takes it (its receive is given back)."""
    looked, sent = threading.Event(), threading.Event()

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        control = mem.control
        mem.barrier()
        word = NODES + NODE * NODE_WORDS + 1
        if rt.rank == 0:
            assert looked.wait(30)
            control.run(1, [control.notify_write(control.local(5), 1, word)])  # ME: rank 0 + 1
            sent.set()
            return None
        control.reap()  # the CQ armed (the barrier's looks may have done it), and what came taken
        polls: list[int] = []
        real = mem.server._poll
        mem.server._poll = lambda: polls.append(real()) or polls[-1]
        for _ in range(50):
            control.reap()
        idle = polls.count(0)  # polls that found nothing (one that takes a late barrier wake-up is fine)
        before = mem.server.notifications
        looked.set()
        assert sent.wait(30)
        wait_for(lambda: control.reap() or mem.server.notifications > before, 10, "the notification taken")
        return idle, polls.count(0), mem.server.notifications - before, int(control.words[word])

    assert run_ranks(2, body, "cashmere")[1] == (0, 0, 1, 1)


def test_a_completion_that_lands_while_a_wait_arms_the_cq_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoint.wait arms the CQ after its spin.  A notification whose completion comes between its last empty poll
    and the arming fires no event; if its data makes `done()` true, the wait must still take it (arm, then poll),
    since `reap` polls only after an event.  Else its receive is never given back, and with one receive per peer the
    peer's next notification finds none (found by review)."""
    monkeypatch.setattr(cashmere, "NOTIFY_RECVS", 1)
    monkeypatch.setattr(Endpoint.wait, "__defaults__", (1.0, None, True, None))  # 120 s -> 1 s
    go, waited = threading.Event(), threading.Event()
    first, second = NODES + 5 * NODE_WORDS + FLAG, NODES + 6 * NODE_WORDS + FLAG

    def body(mem: Any, rt: ThreadRuntime) -> Any:
        control = mem.control
        mem.barrier()
        if rt.rank == 1:
            assert go.wait(30)
            control.run(0, [control.notify_write(control.local(ONE), 0, first)])
            assert waited.wait(30)  # rank 0's wait is over
            try:  # a second notification: it needs the receive the first one took back at rank 0
                control.run(0, [control.notify_write(control.local(ONE), 0, second)])
            except DsmError as exc:
                return f"no receive: {exc}"
            return "delivered"
        server, cq = mem.server, mem.server.cq
        real_arm = cq.req_notify

        def arm(*args: Any) -> None:  # the wait's arming: rank 1's completion lands just before it
            cq.req_notify = real_arm
            go.set()
            wait_for(lambda: cq.handle.entries, 10, "rank 1's completion")
            real_arm(*args)

        control.reap()
        while True:  # where a wait is once it took an event: the CQ not armed, the channel empty
            try:
                server.channel.get_cq_event(cq, 0)
            except verbs.PyverbsRDMAError:
                break
            cq.ack_events(1)
        server.armed = False
        cq.handle.armed = 0
        cq.req_notify = arm
        server.wait(lambda: bool(control.words[first]), "the first notification", timeout=float("inf"))
        waited.set()
        wait_for(lambda: control.reap() or control.words[second], 10, "the second notification")
        return None

    assert run_ranks(2, body, "cashmere")[1] == "delivered"
