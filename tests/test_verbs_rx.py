"""ckpt.verbs' receive engine (`ckpt.verbs._rx`): poll-driven progress, reader threads, carried ACKs, doorbells."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from verbs_util import (
    WAIT,
    connect_rc,
    poll_one,
    post_recv,
    rdma_wr,
    send_wr,
    wait_for,
)

from ckpt import verbs as v
from ckpt.verbs import _hca, _rx

pytestmark = pytest.mark.timeout(60)

ROUNDS = 50


def _unsignaled_pair(ctxs: tuple[v.Context, ...]) -> tuple[object, object]:
    return connect_rc(
        *ctxs,
        endpoint_a={"sq_sig_all": 0, "separate_cqs": True, "max_send_wr": 256},
        endpoint_b={"sq_sig_all": 0, "separate_cqs": True, "max_send_wr": 256},
    )


def test_a_thread_that_polls_executes_the_packets_it_waits_for(ctxs: tuple[v.Context, ...]) -> None:
    """Poll-driven progress: B's program thread, polling its receive CQ, runs B's receive engine itself, so each
    SEND it waits for is executed on that thread, not handed over from a reader thread."""
    a, b = connect_rc(*ctxs)
    engine = _hca.hca(ctxs[1].name).rx
    before = ctxs[1].statistics().packets_polled
    for i in range(ROUNDS):
        post_recv(b, wr_id=i)
        got: list[v.WC] = []
        poller = threading.Thread(target=lambda found=got: found.append(poll_one(b.rcq)), daemon=True)
        poller.start()
        wait_for(engine._driver.locked, what="B's poller to drive B's engine")
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=i))  # arrives while B's poller waits in the engine
        poller.join(WAIT)
        assert got and got[0].status == v.IBV_WC_SUCCESS and got[0].wr_id == i
        assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert ctxs[1].statistics().packets_polled - before == ROUNDS


def test_a_completion_on_another_cq_does_not_wake_the_thread_that_drives(
    ctxs: tuple[v.Context, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's poller waits in B's engine for its receive CQ; a completion another thread queues on B's send CQ (as
    a direct placement does) leaves it asleep, one on the receive CQ wakes it at once."""
    _, b = connect_rc(*ctxs, endpoint_b={"separate_cqs": True})
    engine = _hca.hca(ctxs[1].name).rx
    wakes: list[int] = []
    woken = engine.wake
    monkeypatch.setattr(engine, "wake", lambda: (wakes.append(1), woken()))
    got: list[v.WC] = []
    poller = threading.Thread(target=lambda: got.append(poll_one(b.rcq)), daemon=True)
    poller.start()
    wait_for(lambda: engine.driving, what="B's poller to wait in B's engine")
    b.scq.handle.push(v.WC(wr_id=1))
    assert wakes == [] and not got
    b.rcq.handle.push(v.WC(wr_id=2))
    poller.join(WAIT)
    assert wakes == [1] and [wc.wr_id for wc in got] == [2]


def test_once_nobody_polls_the_reader_threads_serve_one_sided_operations(ctxs: tuple[v.Context, ...]) -> None:
    """B's thread drove B's engine, then stops polling (it computes, or is parked): within the lease B's reader
    threads take over, and an RDMA READ and an atomic on B's memory complete without B's program."""
    a, b = connect_rc(*ctxs)
    b.buf[:64] = 7
    post_recv(b, offset=1024)
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    assert poll_one(b.rcq).status == v.IBV_WC_SUCCESS  # B's thread drove its engine: the lease is B's
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    polled = ctxs[1].statistics().packets_polled
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(128, 64), b.mr.rkey, b.addr(0)))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    fetch = send_wr([a.sge(256, 8)], opcode=v.IBV_WR_ATOMIC_FETCH_AND_ADD)
    fetch.set_wr_atomic(b.mr.rkey, b.addr(64), 5)
    a.qp.post_send(fetch)
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert (a.buf[128:192] == 7).all() and int(b.buf[64:72].view(np.uint64)[0]) == 5
    assert ctxs[1].statistics().packets_polled == polled  # served by B's readers: nobody polled B


def test_a_thread_blocked_on_a_completion_channel_is_woken_by_the_reader_thread(ctxs: tuple[v.Context, ...]) -> None:
    """A thread blocked in get_cq_event does not drive (it would wrestle the role from a polling thread): B's
    reader thread executes the SEND and wakes it."""
    channel = v.CompChannel(ctxs[1])
    a, b = connect_rc(*ctxs, endpoint_b={"channel": channel})
    post_recv(b)
    b.rcq.req_notify()
    got: list[v.CQ] = []
    waiter = threading.Thread(target=lambda: got.append(channel.get_cq_event(b.rcq, WAIT)), daemon=True)
    waiter.start()
    polled = ctxs[1].statistics().packets_polled
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    waiter.join(WAIT)
    assert got == [b.rcq]
    assert ctxs[1].statistics().packets_polled == polled
    b.rcq.ack_events(1)
    assert poll_one(b.rcq).status == v.IBV_WC_SUCCESS


def test_a_request_carries_the_ack_its_qp_owes(ctxs: tuple[v.Context, ...]) -> None:
    """Ping-pong of unsignaled SENDs: each side's reply carries the ACK of the request it answers, so hardly any
    ACK packet is sent, and every SEND still retires (a signaled one at the end completes)."""
    a, b = _unsignaled_pair(ctxs)
    before = [c.statistics() for c in ctxs]
    for i in range(ROUNDS):
        post_recv(b, wr_id=i)
        post_recv(a, wr_id=i)
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=i, flags=0))
        assert poll_one(b.rcq).wr_id == i
        b.qp.post_send(send_wr([b.sge(0, 8)], wr_id=i, flags=0))
        assert poll_one(a.rcq).wr_id == i
    after = [c.statistics() for c in ctxs]
    assert after[1].acks_carried - before[1].acks_carried >= ROUNDS - 5
    assert after[0].acks_carried - before[0].acks_carried >= ROUNDS - 6
    assert after[1].acks_sent - before[1].acks_sent <= 10
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=99, flags=v.IBV_SEND_SIGNALED))
    post_recv(b, wr_id=99)
    assert poll_one(a.scq).wr_id == 99  # RC: everything before it retired too


def test_posts_behind_work_requests_in_flight_leave_with_the_next_poll(ctxs: tuple[v.Context, ...]) -> None:
    """Doorbell batching: 64 small WRITEs posted one by one behind one in flight leave in a few writes to the
    link (the next poll flushes them), not 64; every byte lands."""
    a, b = _unsignaled_pair(ctxs)
    a.buf[:4096] = np.arange(4096, dtype=np.uint64).astype(np.uint8)
    before = ctxs[0].statistics().doorbells
    for i in range(64):
        flags = v.IBV_SEND_SIGNALED if i == 63 else 0
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(64 * i, 64), b.mr.rkey, b.addr(64 * i), wr_id=i, flags=flags))
    assert poll_one(a.scq).wr_id == 63
    assert ctxs[0].statistics().doorbells - before <= 8
    assert (b.buf[:4096] == a.buf[:4096]).all()


def test_a_post_held_back_for_a_poll_leaves_anyway_when_nobody_polls(ctxs: tuple[v.Context, ...]) -> None:
    """A WRITE posted behind one in flight, by a program that then never polls, still lands: the first one's
    coalesced ACK, executed by a reader thread, pumps the QP."""
    a, b = _unsignaled_pair(ctxs)
    a.buf[:128] = 3
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 64), b.mr.rkey, b.addr(0), flags=0))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(64, 64), b.mr.rkey, b.addr(64), flags=0))
    started = time.monotonic()
    wait_for(lambda: (b.buf[:128] == 3).all(), what="both WRITEs to land without a poll")
    assert time.monotonic() - started < WAIT


def test_the_lease_is_short() -> None:
    """The reader threads are off their sockets for at most LEASE after a poll: a program that stops polling
    has its memory served again within it (and DELAYED_ACK stays below the shortest retransmission timer)."""
    from ckpt.verbs._qpbase import _MIN_TIMER

    assert 0 < _rx.LEASE <= 0.005
    assert _rx.DELAYED_ACK < _MIN_TIMER / 2


def test_a_parked_reader_thread_sleeps_while_a_thread_drives_even_with_a_lease_of_zero(
    ctxs: tuple[v.Context, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CKPT_SIMIB_POLL_LEASE=0: a reader thread parked while another thread drives re-checks the lease at most
    every PARK_MIN, instead of spinning on the GIL for as long as the driver drives."""
    monkeypatch.setattr(_rx, "LEASE", 0.0)
    engine = _hca.hca(ctxs[1].name).rx
    stop = threading.Event()
    driver = threading.Thread(target=lambda: engine.drive(stop.is_set, 10.0), daemon=True)
    driver.start()
    wait_for(engine._driver.locked, what="the test's thread to drive B's engine")
    cpu: list[float] = []

    def park() -> None:
        started = time.thread_time()
        engine._park_while_leased()  # as a reader thread does when it wakes while a thread drives
        cpu.append(time.thread_time() - started)

    parked = threading.Thread(target=park, daemon=True)
    parked.start()
    try:
        assert not stop.wait(0.3)  # the window measured: the driver drives, the reader stays parked
        assert parked.is_alive()
    finally:
        stop.set()
        engine.wake()
        driver.join(WAIT)
        parked.join(WAIT)
    assert cpu and cpu[0] < 0.05, f"a parked reader used {cpu[0] if cpu else None} s of CPU in 0.3 s"


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf", "1e400"])
def test_a_timing_variable_that_is_not_a_number_of_seconds_is_named(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_SIMIB_TEST_SECONDS", raw)
    with pytest.raises(ValueError, match=r"CKPT_SIMIB_TEST_SECONDS=.*: expected a number of seconds >= 0"):
        _rx.env_seconds("CKPT_SIMIB_TEST_SECONDS", 1.0)


@pytest.mark.parametrize(("raw", "seconds"), [(None, 0.25), ("", 0.25), (" 0.002 ", 0.002), ("0", 0.0)])
def test_a_timing_variable_unset_or_a_number_of_seconds(
    raw: str | None, seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    if raw is None:
        monkeypatch.delenv("CKPT_SIMIB_TEST_SECONDS", raising=False)
    else:
        monkeypatch.setenv("CKPT_SIMIB_TEST_SECONDS", raw)
    assert _rx.env_seconds("CKPT_SIMIB_TEST_SECONDS", 0.25) == seconds


class _ForgivingQP:
    """A QP whose ACK a post on another thread carries while the channel sends its due ACKs (the race CI hit:
    `forgive` takes no channel lock, so an entry can leave `owed` between the snapshot and its removal)."""

    def __init__(self, chan: _rx.RxChannel) -> None:
        self.chan, self.acks_sent = chan, 0

    @property
    def ack_owed(self) -> bool:
        self.chan.forgive(self)  # the other thread's post, at the worst moment
        return True

    def send_ack(self) -> None:
        self.acks_sent += 1


def test_an_ack_carried_by_a_post_while_due_acks_are_sent_is_neither_sent_nor_an_error() -> None:
    engine = type("Engine", (), {"owing": set(), "next_due": float("inf")})()
    chan = _rx.RxChannel.__new__(_rx.RxChannel)
    chan.engine, chan.owed = engine, {}
    qps = [_ForgivingQP(chan) for _ in range(3)]
    for qp in qps:
        chan.owe(qp, 0.0)
    chan.send_due(1.0)  # raised KeyError on the reader thread, killing the connection
    assert chan.owed == {} and engine.owing == set()
    assert [qp.acks_sent for qp in qps] == [0, 0, 0]  # each went with its request


class _OwedEmptiedMeanwhile(dict):  # type: ignore[type-arg]
    """`owed` whose last entry a post on another thread carries between a check of it and the read of it."""

    def values(self) -> Any:
        self.clear()
        return super().values()


def test_the_next_due_ack_of_a_channel_emptied_meanwhile_is_none() -> None:
    """The reader thread's `next_due` (CI hit it: `min()` of an empty sequence killed the connection, and the
    job saw RETRY_EXC_ERR)."""
    chan = _rx.RxChannel.__new__(_rx.RxChannel)
    chan.owed = _OwedEmptiedMeanwhile({object(): 1.0})
    assert chan.next_due() is None
