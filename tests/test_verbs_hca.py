"""ckpt.verbs HCA services in one process: CQ overflow, completion channels, SRQs, identities, one-sidedness."""

from __future__ import annotations

import errno
import itertools
import threading

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
    wait_for,
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


# ====================================================================== identities and attributes
def test_ids_are_distinct_and_not_a_trivial_sequence(ctxs: tuple[v.Context, ...]) -> None:
    pd = v.PD(ctxs[0])
    eps = [make_endpoint(ctxs[0], pd=pd, size=4096) for _ in range(6)]
    qpns = [ep.qp.qp_num for ep in eps]
    keys = [k for ep in eps for k in (ep.mr.lkey, ep.mr.rkey)]
    assert len(set(qpns)) == len(qpns) and len(set(keys)) == len(keys)
    assert all(0 < q < 1 << 24 for q in qpns)
    # not 0, 1, 2 ... : the first QP number is not small and the keys do not count up by one
    assert min(qpns) > 16
    assert any(b - a != 1 for a, b in itertools.pairwise(keys))
    assert min(keys) > 16


def test_two_hcas_have_different_lids_and_ports(ctxs: tuple[v.Context, ...], provider: str) -> None:
    lids = [ctx.query_port(p).lid for ctx in ctxs for p in (1, 2)]
    assert len(set(lids)) == 4 and all(0 < lid <= 0xBFFF for lid in lids)
    for ctx in ctxs:
        port = ctx.query_port(1)
        assert port.state == v.IBV_PORT_ACTIVE
        if provider == "tcp":
            assert port.sm_lid == 0  # no subnet manager: LIDs are claimed in a directory
        else:
            assert 0 < port.sm_lid <= 0xBFFF and port.sm_lid not in lids
    assert ctxs[0].query_port(1).sm_lid == ctxs[1].query_port(1).sm_lid
    with pytest.raises(v.PyverbsRDMAError):
        ctxs[0].query_port(3)


def test_query_device(ctxs: tuple[v.Context, ...]) -> None:
    attr = ctxs[0].query_device()
    assert attr.phys_port_cnt == 2
    assert attr.max_qp_rd_atom == 16 and attr.max_qp_init_rd_atom == 16
    assert attr.node_guid and attr.node_guid != ctxs[1].query_device().node_guid


def test_query_gid(ctxs: tuple[v.Context, ...]) -> None:
    gid0, gid1 = ctxs[0].query_gid(1, 0), ctxs[1].query_gid(1, 0)
    assert str(gid0).startswith("fe80:0000:0000:0000:")
    assert gid0 != gid1
    assert ctxs[0].query_gid(2, 0) != gid0


def test_same_device_name_is_the_same_hca(ctxs: tuple[v.Context, ...], provider: str) -> None:
    with v.Context(name=f"{provider}0") as again:
        assert again.query_port(1).lid == ctxs[0].query_port(1).lid


# ====================================================================== one-sided
@pytest.mark.parametrize("op", ["write", "read", "atomic"])
def test_one_sided_completes_while_program_thread_is_blocked(ctxs: tuple[v.Context, ...], op: str) -> None:
    # The main thread parks on an Event that only the polling thread sets: the target's memory
    # must be served by the HCA's own threads.
    a, b = connect_rc(*ctxs)
    b.buf[:64] = 3
    b.buf[64:72].view(np.uint64)[0] = 40
    a.buf[:64] = 9
    done = threading.Event()
    result: list[v.WC] = []

    def poller() -> None:
        try:
            result.extend(poll_until(a.scq, 1, timeout=WAIT))
        finally:
            done.set()

    if op == "write":
        wr = rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 64), b.mr.rkey, b.addr(0))
    elif op == "read":
        wr = rdma_wr(v.IBV_WR_RDMA_READ, a.sge(128, 64), b.mr.rkey, b.addr(0))
    else:
        wr = send_wr([a.sge(256, 8)], opcode=v.IBV_WR_ATOMIC_FETCH_AND_ADD)
        wr.set_wr_atomic(b.mr.rkey, b.addr(64), 2)
    thread = threading.Thread(target=poller, daemon=True)
    thread.start()
    a.qp.post_send(wr)
    assert done.wait(WAIT + 1)
    thread.join(WAIT)
    assert result and result[0].status == v.IBV_WC_SUCCESS
    if op == "write":
        assert (b.buf[:64] == 9).all()
    elif op == "read":
        assert (a.buf[128:192] == 3).all()
    else:
        assert a.buf[256:264].view(np.uint64)[0] == 40
        assert b.buf[64:72].view(np.uint64)[0] == 42


# ====================================================================== statistics
def test_statistics_count_packets_bytes_and_rnr_naks(ctxs: tuple[v.Context, ...]) -> None:
    a, b = connect_rc(*ctxs)
    before_a, before_b = ctxs[0].statistics(), ctxs[1].statistics()
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 1000), b.mr.rkey, b.addr(0), wr_id=1))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=2))  # no receive posted yet: RNR NAK, then retried
    wait_for_stat(ctxs[0], "rnr_naks_received", before_a.rnr_naks_received + 1)
    post_recv(b)
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    after_a, after_b = ctxs[0].statistics(), ctxs[1].statistics()
    assert after_a.payload_bytes_sent - before_a.payload_bytes_sent >= 1008
    assert after_b.payload_bytes_received - before_b.payload_bytes_received >= 1008
    assert after_a.packets_sent - before_a.packets_sent >= 3  # WRITE, SEND, its retry
    assert after_b.packets_sent > before_b.packets_sent  # ACKs and the NAK
    assert after_a.retransmissions > before_a.retransmissions
    assert after_a.packets_lost == before_a.packets_lost


def wait_for_stat(ctx: v.Context, name: str, at_least: int) -> None:
    wait_for(lambda: getattr(ctx.statistics(), name) >= at_least, what=f"{name} >= {at_least}")
