"""ckpt.verbs handles in one process (`_handles`): CQ overflow, completion channels and their events, SRQs."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from verbs_util import (
    QUIET,
    WAIT,
    Endpoint,
    bring_up,
    connect_rc,
    drain_events,
    events_of,
    make_endpoint,
    poll_one,
    poll_until,
    post_recv,
    rdma_wr,
    recv_wr,
    send_wr,
    wait_event,
    wait_state,
)

from ckpt import verbs as v

pytestmark = pytest.mark.timeout(60)

ETIMEDOUT = 110


# ====================================================================== CQ overflow
def test_cq_overflow_raises_cq_err_event(ctxs: tuple[v.Context, ...]) -> None:
    a, b = connect_rc(*ctxs, endpoint_a={"cqe": 2})
    drain_events(a.ctx)
    for i in range(4):
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(0), wr_id=i))
    ev = wait_event(a.ctx, v.IBV_EVENT_CQ_ERR, a.scq)
    assert ev.element is a.scq


# ====================================================================== completion channels
def _channel_pair(ctxs: tuple[v.Context, ...]) -> tuple[Endpoint, Endpoint, v.CompChannel]:
    channel = v.CompChannel(ctxs[1])
    a, b = connect_rc(*ctxs, endpoint_b={"channel": channel, "separate_cqs": True})
    return a, b, channel


def test_req_notify_is_one_shot(ctxs: tuple[v.Context, ...]) -> None:
    a, b, channel = _channel_pair(ctxs)
    for i in range(3):
        post_recv(b, 0, 64, wr_id=i)
    b.rcq.req_notify()
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    assert channel.get_cq_event(b.rcq, timeout=WAIT) is b.rcq
    b.rcq.ack_events(1)
    assert poll_one(b.rcq).wr_id == 0
    # not re-armed: a second completion gives no event
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    assert poll_one(b.rcq).wr_id == 1
    with pytest.raises(v.PyverbsRDMAError) as info:
        channel.get_cq_event(b.rcq, timeout=QUIET)
    assert info.value.error_code == ETIMEDOUT
    # re-armed: the next one does
    b.rcq.req_notify()
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    assert channel.get_cq_event(b.rcq, timeout=WAIT) is b.rcq
    b.rcq.ack_events(1)
    assert poll_one(b.rcq).wr_id == 2


def test_destroying_a_cq_with_unacked_events_fails(ctxs: tuple[v.Context, ...]) -> None:
    a, b, channel = _channel_pair(ctxs)
    post_recv(b, 0, 64)
    b.rcq.req_notify()
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    channel.get_cq_event(b.rcq, timeout=WAIT)
    poll_one(b.rcq)
    b.qp.close()
    with pytest.raises(v.PyverbsRDMAError) as info:
        b.rcq.close()
    assert info.value.error_code == errno.EBUSY
    b.rcq.ack_events(1)
    b.rcq.close()


def test_solicited_only_fires_for_solicited_send(ctxs: tuple[v.Context, ...]) -> None:
    a, b, channel = _channel_pair(ctxs)
    for i in range(2):
        post_recv(b, 0, 64, wr_id=i)
    b.rcq.req_notify(solicited_only=True)
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    assert poll_one(b.rcq).wr_id == 0
    with pytest.raises(v.PyverbsRDMAError) as info:
        channel.get_cq_event(b.rcq, timeout=QUIET)
    assert info.value.error_code == ETIMEDOUT
    a.qp.post_send(send_wr([a.sge(0, 8)], flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_SOLICITED))
    assert channel.get_cq_event(b.rcq, timeout=WAIT) is b.rcq
    b.rcq.ack_events(1)
    assert poll_one(b.rcq).wr_id == 1


def test_solicited_only_fires_for_error_completion(ctxs: tuple[v.Context, ...]) -> None:
    _, b, channel = _channel_pair(ctxs)
    post_recv(b, 0, 64, wr_id=5)
    b.rcq.req_notify(solicited_only=True)
    b.qp.modify(v.QPAttr(qp_state=v.IBV_QPS_ERR), v.IBV_QP_STATE)  # flushes the receive
    assert channel.get_cq_event(b.rcq, timeout=WAIT) is b.rcq
    b.rcq.ack_events(1)
    wc = poll_one(b.rcq)
    assert (wc.wr_id, wc.status) == (5, v.IBV_WC_WR_FLUSH_ERR)


def test_send_completions_are_not_solicited(ctxs: tuple[v.Context, ...]) -> None:
    channel = v.CompChannel(ctxs[0])
    a, b = connect_rc(*ctxs, endpoint_a={"channel": channel, "separate_cqs": True})
    post_recv(b, 0, 64)
    a.scq.req_notify(solicited_only=True)
    a.qp.post_send(send_wr([a.sge(0, 8)], flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_SOLICITED))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    with pytest.raises(v.PyverbsRDMAError):
        channel.get_cq_event(a.scq, timeout=QUIET)


# ====================================================================== SRQ
def _srq_pairs(ctxs: tuple[v.Context, ...], n: int, max_wr: int = 16) -> tuple[v.SRQ, list[Endpoint], list[Endpoint]]:
    """`n` requesters on HCA 0, each connected to a responder QP on HCA 1 attached to one SRQ."""
    pd = v.PD(ctxs[1])
    srq = v.SRQ(pd, v.SrqInitAttr(v.SrqAttr(max_wr=max_wr, max_sge=1)))
    cq = v.CQ(ctxs[1], 256)
    senders, receivers = [], []
    for _ in range(n):
        a = make_endpoint(ctxs[0])
        init = v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, srq=srq, cap=v.QPCap(max_send_wr=16))
        qp = v.QP(pd, init)
        buf = np.zeros(1 << 16, np.uint8)
        b = Endpoint(ctxs[1], pd, cq, cq, qp, buf, v.MR(pd, buf, v.IBV_ACCESS_LOCAL_WRITE))
        bring_up(a.qp, b.qp.qp_num, b.lid)
        bring_up(b.qp, a.qp.qp_num, a.lid)
        senders.append(a)
        receivers.append(b)
    return srq, senders, receivers


def _srq_post(srq: v.SRQ, ep: Endpoint, wr_ids: range) -> None:
    for i in wr_ids:
        srq.post_recv(recv_wr([ep.sge(64 * (i % 512), 64)], wr_id=i))


def test_srq_is_shared_by_several_qps(ctxs: tuple[v.Context, ...]) -> None:
    srq, senders, receivers = _srq_pairs(ctxs, 3)
    _srq_post(srq, receivers[0], range(6))
    for round_ in range(2):
        for k, a in enumerate(senders):
            a.buf[:1] = 10 * k + round_
            a.qp.post_send(send_wr([a.sge(0, 1)]))
            poll_one(a.scq)
    wcs = poll_until(receivers[0].rcq, 6)
    assert sorted(wc.wr_id for wc in wcs) == list(range(6))
    assert all(wc.status == v.IBV_WC_SUCCESS for wc in wcs)
    assert {wc.qp_num for wc in wcs} == {b.qp.qp_num for b in receivers}
    with pytest.raises(v.PyverbsRDMAError):  # a QP on an SRQ takes no receives of its own
        post_recv(receivers[0])


def test_srq_limit_event_fires_once_until_rearmed(ctxs: tuple[v.Context, ...]) -> None:
    srq, (a,), (b,) = _srq_pairs(ctxs, 1)
    _srq_post(srq, b, range(8))
    drain_events(b.ctx)
    srq.arm(5)
    assert srq.query().srq_limit == 5

    def consume(n: int) -> None:
        for _ in range(n):
            a.qp.post_send(send_wr([a.sge(0, 1)]))
            poll_one(a.scq)
            poll_one(b.rcq)

    consume(3)  # 5 left: not below the limit
    assert events_of(b.ctx, v.IBV_EVENT_SRQ_LIMIT_REACHED, srq, window=0.05) == []
    consume(1)  # 4 left
    wait_event(b.ctx, v.IBV_EVENT_SRQ_LIMIT_REACHED, srq)
    assert srq.query().srq_limit == 0  # the event disarms the limit
    consume(2)
    assert events_of(b.ctx, v.IBV_EVENT_SRQ_LIMIT_REACHED, srq, window=0.05) == []
    srq.arm(2)  # 2 left
    consume(1)
    wait_event(b.ctx, v.IBV_EVENT_SRQ_LIMIT_REACHED, srq)


def test_srq_limit_above_max_wr_is_refused(ctxs: tuple[v.Context, ...]) -> None:
    pd = v.PD(ctxs[0])
    srq = v.SRQ(pd, v.SrqInitAttr(v.SrqAttr(max_wr=8, max_sge=1)))
    with pytest.raises(v.PyverbsRDMAError) as info:
        srq.arm(9)
    assert info.value.error_code == errno.EINVAL
    assert srq.query().srq_limit == 0
    srq.arm(8)
    assert srq.query().srq_limit == 8


def test_srq_receives_are_not_flushed_and_last_wqe_is_reached(ctxs: tuple[v.Context, ...]) -> None:
    srq, (_a1, a2), (b1, b2) = _srq_pairs(ctxs, 2)
    _srq_post(srq, b1, range(2))
    drain_events(b1.ctx)
    b1.qp.modify(v.QPAttr(qp_state=v.IBV_QPS_ERR), v.IBV_QP_STATE)
    wait_event(b1.ctx, v.IBV_EVENT_QP_LAST_WQE_REACHED, b1.qp)
    n, wcs = b1.rcq.poll(4)
    assert n == 0, f"SRQ receives were flushed: {wcs}"
    # the receives are still in the SRQ for the other QP
    a2.qp.post_send(send_wr([a2.sge(0, 4)]))
    a2.qp.post_send(send_wr([a2.sge(0, 4)]))
    wcs = poll_until(b2.rcq, 2)
    assert [(wc.wr_id, wc.status, wc.qp_num) for wc in wcs] == [
        (0, v.IBV_WC_SUCCESS, b2.qp.qp_num),
        (1, v.IBV_WC_SUCCESS, b2.qp.qp_num),
    ]


def test_srq_error_on_remote_access_keeps_srq_receives(ctxs: tuple[v.Context, ...]) -> None:
    srq, (a1, a2), (b1, b2) = _srq_pairs(ctxs, 2)
    _srq_post(srq, b1, range(1))
    a1.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a1.sge(0, 4), 0xBAD, 0))
    assert poll_one(a1.scq).status == v.IBV_WC_REM_ACCESS_ERR
    wait_state(b1.qp, v.IBV_QPS_ERR)
    a2.qp.post_send(send_wr([a2.sge(0, 4)]))
    assert poll_one(b2.rcq).wr_id == 0
