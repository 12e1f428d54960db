"""ckpt_ib._drain: DRAIN empties the network exactly, completions go to the private queues, polls serve them first."""

from __future__ import annotations

from typing import Any

import pytest
from ib_util import IbEnv, real_of
from verbs_util import (
    Endpoint,
    assert_no_completion,
    connect_rc,
    poll_one,
    poll_until,
    post_recv,
    rdma_wr,
    send_wr,
    wait_for,
)

from ckpt import verbs as v
from ckpt_ib import drain

pytestmark = pytest.mark.timeout(30)


def _pair(ib: IbEnv, **opts: Any) -> tuple[Endpoint, Endpoint]:
    return connect_rc(ib.context(0), ib.context(1), **opts)


def _rq_psn(ep: Endpoint) -> int:
    return int(ep.qp.query(v.IBV_QP_RQ_PSN)[0].rq_psn)


def _post_sends(ep: Endpoint, wr_ids: range, length: int = 8, flags: int = v.IBV_SEND_SIGNALED) -> None:
    for wr_id in wr_ids:
        ep.qp.post_send(send_wr([ep.sge(0, length)], wr_id=wr_id, flags=flags))


def test_drain_leaves_exactly_the_rnr_blocked_sends_in_the_log(ib: IbEnv) -> None:
    a, b = _pair(ib)  # rnr_retry=7: the blocked sends retry for ever
    for i in range(2):
        post_recv(b, offset=2048 * i, length=2048, wr_id=i)
    _post_sends(a, range(5), length=1500)  # 2 packets each at MTU 1024: PSNs 0, 2, 4, 6, 8

    drain(ib.vz, ib.rt)

    log = list(a.qp.handle.sends)
    assert [e.wr_id for e in log] == [2, 3, 4]
    assert [e.psn for e in log] == [4, 6, 8]
    assert log[0].psn == _rq_psn(b)  # the peer expects exactly the first WR left in the log
    assert not b.qp.handle.recvs
    assert [w.wr_id for w in a.scq.handle.private] == [0, 1]
    assert [w.wr_id for w in b.rcq.handle.private] == [0, 1]
    assert not real_of(a.scq).entries and not real_of(b.rcq).entries  # all taken from the real CQs


def test_drain_forgets_unsignaled_sends_that_landed(ib: IbEnv) -> None:
    a, b = _pair(ib, endpoint_a={"sq_sig_all": 0})
    for i in range(3):
        post_recv(b, offset=64 * i, length=64, wr_id=i)
    _post_sends(a, range(3), flags=0)  # no later signaled WR will ever retire them
    wait_for(lambda: _rq_psn(b) == 3, what="the 3 sends to land")
    assert len(a.qp.handle.sends) == 3

    drain(ib.vz, ib.rt)

    assert not a.qp.handle.sends, "landed sends still in the log: a restart would deliver them twice"
    assert not a.scq.handle.private
    assert [w.wr_id for w in b.rcq.handle.private] == [0, 1, 2]
    post_recv(b, wr_id=3)
    _post_sends(a, range(3, 4))  # the next signaled send completes alone
    assert [w.wr_id for w in poll_until(a.scq, 1)] == [3]
    assert_no_completion(a.scq, 0.05)


def test_drain_keeps_exactly_the_unsignaled_sends_that_did_not_land(ib: IbEnv) -> None:
    a, b = _pair(ib, endpoint_a={"sq_sig_all": 0})
    for i in range(2):
        post_recv(b, offset=2048 * i, length=2048, wr_id=i)
    _post_sends(a, range(5), length=1500, flags=0)  # PSNs 0, 2, 4, 6, 8; the last 3 meet RNR

    drain(ib.vz, ib.rt)

    log = list(a.qp.handle.sends)
    assert [e.wr_id for e in log] == [2, 3, 4]
    assert log[0].psn == _rq_psn(b) == 4
    assert not a.scq.handle.private
    assert [w.wr_id for w in b.rcq.handle.private] == [0, 1]


def test_drain_with_everything_landed_leaves_empty_logs(ib: IbEnv) -> None:
    a, b = _pair(ib, endpoint_a={"sq_sig_all": 0})
    for i in range(3):
        post_recv(b, offset=64 * i, length=64, wr_id=i)
    _post_sends(a, range(3))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(1024), wr_id=3, flags=0))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(64, 8), b.mr.rkey, b.addr(1024), wr_id=4))

    drain(ib.vz, ib.rt)

    assert not a.qp.handle.sends and not b.qp.handle.sends
    assert not a.qp.handle.recvs and not b.qp.handle.recvs
    assert [w.wr_id for w in a.scq.handle.private] == [0, 1, 2, 4]  # the unsignaled WRITE stays hidden
    assert [w.wr_id for w in b.rcq.handle.private] == [0, 1, 2]


def test_drain_of_an_idle_job_takes_one_round(ib: IbEnv) -> None:
    _pair(ib)
    assert drain(ib.vz, ib.rt) == 1
    assert ib.rt.barriers == ["ib-drain-0"]


def test_polls_serve_the_private_queue_first(ib: IbEnv) -> None:
    a, b = _pair(ib)
    for i in range(2):
        post_recv(b, offset=64 * i, length=64, wr_id=i)
    _post_sends(a, range(5))
    drain(ib.vz, ib.rt)
    assert len(a.scq.handle.private) == 2

    for i in range(2, 5):  # the program runs again: the blocked sends land
        post_recv(b, offset=64 * i, length=64, wr_id=i)
    wait_for(lambda: len(real_of(a.scq).entries) == 3, what="3 completions in A's real CQ")

    assert [w.wr_id for w in poll_until(a.scq, 5)] == [0, 1, 2, 3, 4]
    assert [w.wr_id for w in poll_until(b.rcq, 5)] == [0, 1, 2, 3, 4]
    assert not a.qp.handle.sends


def test_poll_takes_no_more_than_asked_from_the_private_queue(ib: IbEnv) -> None:
    a, b = _pair(ib)
    for i in range(3):
        post_recv(b, offset=64 * i, length=64, wr_id=i)
    _post_sends(a, range(3))
    drain(ib.vz, ib.rt)
    n, wcs = a.scq.poll(2)
    assert (n, [w.wr_id for w in wcs]) == (2, [0, 1])
    assert poll_one(a.scq).wr_id == 2


def test_drain_takes_completion_channel_events(ib: IbEnv) -> None:
    ctx0 = ib.context(0)
    channel = v.CompChannel(ctx0)
    a, b = connect_rc(ctx0, ib.context(1), endpoint_a={"channel": channel})
    a.scq.req_notify()
    post_recv(b)
    _post_sends(a, range(1))
    wait_for(lambda: real_of(a.scq).entries, what="A's completion")

    drain(ib.vz, ib.rt)

    assert list(channel.handle.pending) == [a.scq.handle]
    assert channel.get_cq_event(a.scq, timeout=0) is a.scq
    a.scq.ack_events(1)
    assert poll_one(a.scq).wr_id == 0


def test_drain_collects_receive_completions_of_acknowledged_sends(ib: IbEnv) -> None:
    a, b = _pair(ib)
    post_recv(b, wr_id=7)
    _post_sends(a, range(1))
    wait_for(lambda: real_of(a.scq).entries and real_of(b.rcq).entries, what="both completions")

    # In a job, B's rank polls its CQ a moment before its CQE appears, while A's rank polls after the ACK
    # came back; in one process the same order is: the first poll of B's real CQ sees nothing yet.
    poll = ib.vz.inner.poll_cq
    late = [real_of(b.rcq)]

    def poll_late(cq: Any, n: int) -> list[v.WC]:
        if cq in late:
            late.remove(cq)
            return []
        return list(poll(cq, n))

    ib.vz.inner.poll_cq = poll_late
    drain(ib.vz, ib.rt)

    assert not a.qp.handle.sends
    assert not b.qp.handle.recvs, "a receive that completed is still in the log: it would be re-posted"
    assert [w.wr_id for w in b.rcq.handle.private] == [7]
