"""ckpt.verbs queue pairs in one process: state machine, every RC/UC opcode, flags, protection, RNR, retries, APM."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from verbs_util import (
    ACCESS_ALL,
    FAST_RETRY,
    FAST_TIMEOUT,
    QUIET,
    WAIT,
    Endpoint,
    assert_no_completion,
    atomic_wr,
    bring_up,
    connect_rc,
    contexts,
    drain_events,
    init_attr,
    make_endpoint,
    poll_one,
    poll_until,
    post_recv,
    qp_attr,
    rdma_wr,
    recv_wr,
    rtr_attr,
    rts_attr,
    send_wr,
    subnet_manager,
    wait_event,
    wait_for,
    wait_link,
    wait_state,
)

from ckpt import verbs as v
from ckpt.verbs import _hca
from ckpt.verbs._qpbase import SQ_FULL_GRACE, ack_timeout

pytestmark = pytest.mark.timeout(60)

RECV_OFF = 32768  # receives land in the upper half of a buffer, sends read the lower half


@pytest.fixture(params=["two_hcas", "same_hca", "self"])
def pair(request: pytest.FixtureRequest, ctxs: tuple[v.Context, ...]) -> tuple[Endpoint, Endpoint]:
    """A connected RC pair: A and B on two HCAs, on one HCA, or A = B (a QP connected to itself)."""
    ca, cb = ctxs
    opts = {"separate_cqs": True}
    if request.param == "two_hcas":
        return connect_rc(ca, cb, endpoint_a=opts, endpoint_b=opts)
    if request.param == "same_hca":
        return connect_rc(ca, ca, endpoint_a=opts, endpoint_b=opts)
    ep = make_endpoint(ca, **opts)
    bring_up(ep.qp, ep.qp.qp_num, ep.lid)
    return ep, ep


def rc_two(ctxs: tuple[v.Context, ...], **kw: object) -> tuple[Endpoint, Endpoint]:
    opts = {"separate_cqs": True, **dict(kw.pop("endpoint", {}))}  # type: ignore[call-overload]
    return connect_rc(ctxs[0], ctxs[1], endpoint_a=opts, endpoint_b=opts, **kw)  # type: ignore[arg-type]


def u64(ep: Endpoint, offset: int) -> np.ndarray:
    return ep.buf[offset : offset + 8].view(np.uint64)


def fresh_qp(ctx: v.Context, qp_type: int = v.IBV_QPT_RC) -> v.QP:
    return make_endpoint(ctx, qp_type=qp_type).qp


def to_state(qp: v.QP, state: int) -> None:
    qp.modify(v.QPAttr(qp_state=state), v.IBV_QP_STATE)


# ====================================================================== state machine
def test_rc_goes_reset_init_rtr_rts(ctxs: tuple[v.Context, ...]) -> None:
    qp = fresh_qp(ctxs[0])
    peer = fresh_qp(ctxs[1])
    assert qp.qp_state == v.IBV_QPS_RESET
    qp.to_init(init_attr())
    assert qp.qp_state == v.IBV_QPS_INIT
    qp.to_rtr(rtr_attr(peer.qp_num, ctxs[1].query_port(1).lid))
    assert qp.qp_state == v.IBV_QPS_RTR
    qp.to_rts(rts_attr())
    assert qp.qp_state == v.IBV_QPS_RTS


def test_rts_to_sqd_and_back(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    to_state(a.qp, v.IBV_QPS_SQD)
    assert a.qp.qp_state == v.IBV_QPS_SQD
    with pytest.raises(v.PyverbsRDMAError):  # SQD -> RTR does not exist
        to_state(a.qp, v.IBV_QPS_RTR)
    to_state(a.qp, v.IBV_QPS_RTS)
    assert a.qp.qp_state == v.IBV_QPS_RTS
    post_recv(b, RECV_OFF)
    a.qp.post_send(send_wr([a.sge(0, 16)]))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS


def _qp_in(ctxs: tuple[v.Context, ...], state: int) -> v.QP:
    """A QP brought to `state` by the kernel's path (RESET, INIT, RTR, RTS, SQD, ERR)."""
    if state in (v.IBV_QPS_RTS, v.IBV_QPS_SQD, v.IBV_QPS_ERR):
        a, _ = rc_two(ctxs)
        if state != v.IBV_QPS_RTS:
            to_state(a.qp, state)
        return a.qp
    qp = fresh_qp(ctxs[0])
    if state >= v.IBV_QPS_INIT:
        qp.to_init(init_attr())
    if state >= v.IBV_QPS_RTR:
        qp.to_rtr(rtr_attr(0x123, ctxs[1].query_port(1).lid))
    return qp


@pytest.mark.parametrize("start", [v.IBV_QPS_INIT, v.IBV_QPS_RTR, v.IBV_QPS_RTS, v.IBV_QPS_SQD, v.IBV_QPS_ERR])
def test_any_state_to_err(ctxs: tuple[v.Context, ...], start: int) -> None:
    qp = _qp_in(ctxs, start)
    assert qp.qp_state == start
    to_state(qp, v.IBV_QPS_ERR)
    assert qp.qp_state == v.IBV_QPS_ERR


def test_reset_to_err_is_not_in_the_kernel_table(ctxs: tuple[v.Context, ...]) -> None:
    qp = fresh_qp(ctxs[0])
    with pytest.raises(v.PyverbsRDMAError) as info:
        to_state(qp, v.IBV_QPS_ERR)
    assert info.value.error_code == errno.EINVAL
    assert qp.qp_state == v.IBV_QPS_RESET


@pytest.mark.parametrize(
    "start", [v.IBV_QPS_RESET, v.IBV_QPS_INIT, v.IBV_QPS_RTR, v.IBV_QPS_RTS, v.IBV_QPS_SQD, v.IBV_QPS_ERR]
)
def test_any_state_to_reset_and_up_again(ctxs: tuple[v.Context, ...], start: int) -> None:
    qp = _qp_in(ctxs, start)
    to_state(qp, v.IBV_QPS_RESET)
    assert qp.qp_state == v.IBV_QPS_RESET
    attr = qp_attr(qp)
    assert attr.dest_qp_num == 0 and attr.ah_attr.dlid == 0  # RESET forgets the connection
    qp.to_init(init_attr())
    assert qp.qp_state == v.IBV_QPS_INIT


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (v.IBV_QPS_RESET, v.IBV_QPS_RTR),
        (v.IBV_QPS_RESET, v.IBV_QPS_RTS),
        (v.IBV_QPS_RESET, v.IBV_QPS_SQD),
        (v.IBV_QPS_INIT, v.IBV_QPS_RTS),
        (v.IBV_QPS_INIT, v.IBV_QPS_SQD),
        (v.IBV_QPS_RTR, v.IBV_QPS_SQD),
        (v.IBV_QPS_RTR, v.IBV_QPS_INIT),
        (v.IBV_QPS_RTS, v.IBV_QPS_INIT),
        (v.IBV_QPS_RTS, v.IBV_QPS_RTR),
        (v.IBV_QPS_ERR, v.IBV_QPS_RTS),
        (v.IBV_QPS_ERR, v.IBV_QPS_INIT),
    ],
)
def test_invalid_transition_is_refused_and_changes_nothing(
    ctxs: tuple[v.Context, ...], start: int, target: int
) -> None:
    qp = _qp_in(ctxs, start)
    before = qp_attr(qp)
    attr = v.QPAttr(qp_state=target)
    with pytest.raises(v.PyverbsRDMAError) as info:
        qp.modify(attr, v.IBV_QP_STATE)
    assert info.value.error_code == errno.EINVAL
    assert qp_attr(qp) == before


def test_missing_required_attribute_is_refused_and_changes_nothing(ctxs: tuple[v.Context, ...]) -> None:
    qp = fresh_qp(ctxs[0])
    qp.to_init(init_attr())
    before = qp_attr(qp)
    attr = rtr_attr(0x4242, 77, rq_psn=555, path_mtu=v.IBV_MTU_512)
    attr.qp_state = v.IBV_QPS_RTR
    full = (
        v.IBV_QP_STATE
        | v.IBV_QP_AV
        | v.IBV_QP_PATH_MTU
        | v.IBV_QP_DEST_QPN
        | v.IBV_QP_RQ_PSN
        | v.IBV_QP_MAX_DEST_RD_ATOMIC
        | v.IBV_QP_MIN_RNR_TIMER
    )
    for missing in (v.IBV_QP_DEST_QPN, v.IBV_QP_AV, v.IBV_QP_MIN_RNR_TIMER, v.IBV_QP_MAX_DEST_RD_ATOMIC):
        with pytest.raises(v.PyverbsRDMAError) as info:
            qp.modify(attr, full & ~missing)
        assert info.value.error_code == errno.EINVAL
        after = qp_attr(qp)
        assert after == before
        assert after.qp_state == v.IBV_QPS_INIT and after.dest_qp_num == 0 and after.rq_psn == 0
    qp.modify(attr, full)
    assert qp_attr(qp).dest_qp_num == 0x4242


def test_missing_rc_retry_attribute_in_rtr_to_rts_is_refused(ctxs: tuple[v.Context, ...]) -> None:
    qp = _qp_in(ctxs, v.IBV_QPS_RTR)
    before = qp_attr(qp)
    attr = rts_attr(sq_psn=99, timeout=9)
    attr.qp_state = v.IBV_QPS_RTS
    mask = v.IBV_QP_STATE | v.IBV_QP_SQ_PSN | v.IBV_QP_RETRY_CNT | v.IBV_QP_RNR_RETRY | v.IBV_QP_MAX_QP_RD_ATOMIC
    with pytest.raises(v.PyverbsRDMAError) as info:
        qp.modify(attr, mask)  # no IBV_QP_TIMEOUT
    assert info.value.error_code == errno.EINVAL
    assert qp_attr(qp) == before


def test_attribute_not_allowed_in_transition_is_refused(ctxs: tuple[v.Context, ...]) -> None:
    qp = fresh_qp(ctxs[0])
    attr = init_attr()
    attr.qp_state = v.IBV_QPS_INIT
    attr.sq_psn = 7
    mask = v.IBV_QP_STATE | v.IBV_QP_PKEY_INDEX | v.IBV_QP_PORT | v.IBV_QP_ACCESS_FLAGS
    with pytest.raises(v.PyverbsRDMAError):
        qp.modify(attr, mask | v.IBV_QP_SQ_PSN)
    assert qp.qp_state == v.IBV_QPS_RESET
    qp.modify(attr, mask)
    assert qp.qp_state == v.IBV_QPS_INIT


def test_uc_transitions_take_no_rc_only_attributes(ctxs: tuple[v.Context, ...]) -> None:
    qp = fresh_qp(ctxs[0], v.IBV_QPT_UC)
    qp.to_init(init_attr(v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE))
    connect = v.IBV_QP_STATE | v.IBV_QP_AV | v.IBV_QP_PATH_MTU | v.IBV_QP_DEST_QPN | v.IBV_QP_RQ_PSN
    attr = rtr_attr(0x77, ctxs[1].query_port(1).lid)
    attr.qp_state = v.IBV_QPS_RTR
    with pytest.raises(v.PyverbsRDMAError):  # responder resources are RC only
        qp.modify(attr, connect | v.IBV_QP_MAX_DEST_RD_ATOMIC | v.IBV_QP_MIN_RNR_TIMER)
    qp.modify(attr, connect)  # UC needs no responder resources and no RNR timer
    assert qp.qp_state == v.IBV_QPS_RTR
    attr = rts_attr(sq_psn=3)
    attr.qp_state = v.IBV_QPS_RTS
    with pytest.raises(v.PyverbsRDMAError):  # UC has no ACK timeout and no retries
        qp.modify(attr, v.IBV_QP_STATE | v.IBV_QP_SQ_PSN | v.IBV_QP_TIMEOUT | v.IBV_QP_RETRY_CNT)
    assert qp.qp_state == v.IBV_QPS_RTR
    qp.modify(attr, v.IBV_QP_STATE | v.IBV_QP_SQ_PSN)
    assert qp.qp_state == v.IBV_QPS_RTS


def test_rc_rtr_to_rts_needs_the_retry_attributes_uc_does_not(ctxs: tuple[v.Context, ...]) -> None:
    qp = _qp_in(ctxs, v.IBV_QPS_RTR)
    attr = rts_attr()
    attr.qp_state = v.IBV_QPS_RTS
    with pytest.raises(v.PyverbsRDMAError):
        qp.modify(attr, v.IBV_QP_STATE | v.IBV_QP_SQ_PSN)
    assert qp.qp_state == v.IBV_QPS_RTR


@pytest.mark.parametrize("state", [v.IBV_QPS_RESET, v.IBV_QPS_INIT, v.IBV_QPS_RTR])
def test_post_send_below_rts_fails(ctxs: tuple[v.Context, ...], state: int) -> None:
    ep = make_endpoint(ctxs[0])
    if state >= v.IBV_QPS_INIT:
        ep.qp.to_init(init_attr())
    if state >= v.IBV_QPS_RTR:
        ep.qp.to_rtr(rtr_attr(0x55, ctxs[1].query_port(1).lid))
    with pytest.raises(v.PyverbsRDMAError) as info:
        ep.qp.post_send(send_wr([ep.sge(0, 8)]))
    assert info.value.error_code == errno.EINVAL
    assert ep.scq.poll(1)[0] == 0


def test_post_recv_in_reset_fails_and_in_init_works(ctxs: tuple[v.Context, ...]) -> None:
    ep = make_endpoint(ctxs[0])
    with pytest.raises(v.PyverbsRDMAError) as info:
        post_recv(ep)
    assert info.value.error_code == errno.EINVAL
    ep.qp.to_init(init_attr())
    post_recv(ep)


# ---------------------------------------------------------------------- to_init / to_rtr / to_rts
# pyverbs' qp.pyx: to_rts calls to_rtr unless the QP is in RTR, to_rtr calls to_init unless it is
# in INIT, each step sending its own fixed mask (RESET->INIT, INIT->RTR, RTR->RTS required attributes).
INIT_MASK = v.IBV_QP_STATE | v.IBV_QP_PKEY_INDEX | v.IBV_QP_PORT | v.IBV_QP_ACCESS_FLAGS
UC_RTR_MASK = v.IBV_QP_STATE | v.IBV_QP_AV | v.IBV_QP_PATH_MTU | v.IBV_QP_DEST_QPN | v.IBV_QP_RQ_PSN
RC_RTR_MASK = UC_RTR_MASK | v.IBV_QP_MAX_DEST_RD_ATOMIC | v.IBV_QP_MIN_RNR_TIMER
UC_RTS_MASK = v.IBV_QP_STATE | v.IBV_QP_SQ_PSN
RC_RTS_MASK = UC_RTS_MASK | v.IBV_QP_TIMEOUT | v.IBV_QP_RETRY_CNT | v.IBV_QP_RNR_RETRY | v.IBV_QP_MAX_QP_RD_ATOMIC


def one_attr(dest_qp_num: int, dlid: int, *, sq_psn: int = 0x111, rq_psn: int = 0x222) -> v.QPAttr:
    """One QPAttr with what INIT, RTR and RTS all need, as pyverbs programs pass to to_rts."""
    attr = rtr_attr(dest_qp_num, dlid, rq_psn=rq_psn)
    attr.qp_access_flags = ACCESS_ALL
    attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = sq_psn, 14, 7, 7, 16
    return attr


class RecordingOps:
    """Delegates to a QP's operations table, noting the (state, mask) of every modify_qp."""

    def __init__(self, ops: object) -> None:
        self.ops = ops
        self.modifies: list[tuple[int, int]] = []

    def modify_qp(self, handle: object, attr: v.QPAttr, mask: int) -> None:
        self.modifies.append((int(attr.qp_state), int(mask)))
        self.ops.modify_qp(handle, attr, mask)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.ops, name)


def recording(qp: v.QP, monkeypatch: pytest.MonkeyPatch) -> RecordingOps:
    ops = RecordingOps(qp._ops)
    monkeypatch.setattr(qp, "_ops", ops)
    return ops


@pytest.mark.parametrize("start", [v.IBV_QPS_RESET, v.IBV_QPS_INIT, v.IBV_QPS_RTR], ids=["RESET", "INIT", "RTR"])
def test_to_rts_walks_from_reset_init_or_rtr_with_one_attr(
    ctxs: tuple[v.Context, ...], start: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    qp = _qp_in(ctxs, start)
    ops = recording(qp, monkeypatch)
    attr = one_attr(0x123, ctxs[1].query_port(1).lid)
    qp.to_rts(attr)
    assert qp.qp_state == v.IBV_QPS_RTS and attr.qp_state == v.IBV_QPS_RTS
    steps = [(v.IBV_QPS_INIT, INIT_MASK), (v.IBV_QPS_RTR, RC_RTR_MASK), (v.IBV_QPS_RTS, RC_RTS_MASK)]
    assert ops.modifies == steps[[v.IBV_QPS_RESET, v.IBV_QPS_INIT, v.IBV_QPS_RTR].index(start) :]
    after = qp_attr(qp)
    assert (after.sq_psn, after.timeout, after.max_rd_atomic) == (0x111, 14, 16)
    if start == v.IBV_QPS_RESET:
        assert (after.dest_qp_num, after.rq_psn, after.qp_access_flags) == (0x123, 0x222, ACCESS_ALL)


def test_to_rtr_walks_from_reset_with_one_attr(ctxs: tuple[v.Context, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    qp = fresh_qp(ctxs[0])
    ops = recording(qp, monkeypatch)
    qp.to_rtr(one_attr(0x321, ctxs[1].query_port(1).lid))
    assert qp.qp_state == v.IBV_QPS_RTR
    assert ops.modifies == [(v.IBV_QPS_INIT, INIT_MASK), (v.IBV_QPS_RTR, RC_RTR_MASK)]
    after = qp_attr(qp)
    assert (after.dest_qp_num, after.qp_access_flags) == (0x321, ACCESS_ALL)


def test_uc_to_rts_from_reset_sends_the_uc_masks(ctxs: tuple[v.Context, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    qp = fresh_qp(ctxs[0], v.IBV_QPT_UC)
    ops = recording(qp, monkeypatch)
    qp.to_rts(one_attr(0x77, ctxs[1].query_port(1).lid))  # RC-only attributes set, but not sent
    assert qp.qp_state == v.IBV_QPS_RTS
    assert ops.modifies == [(v.IBV_QPS_INIT, INIT_MASK), (v.IBV_QPS_RTR, UC_RTR_MASK), (v.IBV_QPS_RTS, UC_RTS_MASK)]


def test_to_init_from_init_applies_the_init_attributes_again(ctxs: tuple[v.Context, ...]) -> None:
    qp = _qp_in(ctxs, v.IBV_QPS_INIT)
    qp.to_init(init_attr(v.IBV_ACCESS_LOCAL_WRITE))  # INIT -> INIT, with port, pkey index and access flags
    assert qp.qp_state == v.IBV_QPS_INIT and qp_attr(qp).qp_access_flags == v.IBV_ACCESS_LOCAL_WRITE


@pytest.mark.parametrize("method", ["to_rtr", "to_rts"])
def test_to_rtr_from_rtr_and_to_rts_from_rts_fail_in_to_init_as_in_pyverbs(
    ctxs: tuple[v.Context, ...], method: str
) -> None:
    qp = _qp_in(ctxs, v.IBV_QPS_RTR if method == "to_rtr" else v.IBV_QPS_RTS)
    before = qp_attr(qp)
    with pytest.raises(v.PyverbsRDMAError) as info:
        getattr(qp, method)(one_attr(0x123, ctxs[1].query_port(1).lid))
    assert info.value.error_code == errno.EINVAL
    assert "INIT" in str(info.value)  # the step that failed: to_init, from RTR or RTS
    assert qp_attr(qp) == before


def test_rc_pair_connected_by_to_rts_alone_passes_data(ctxs: tuple[v.Context, ...]) -> None:
    a, b = make_endpoint(ctxs[0], separate_cqs=True), make_endpoint(ctxs[1], separate_cqs=True)
    a.qp.to_rts(one_attr(b.qp.qp_num, b.lid, sq_psn=5, rq_psn=9))
    b.qp.to_rts(one_attr(a.qp.qp_num, a.lid, sq_psn=9, rq_psn=5))
    a.buf[:5] = np.frombuffer(b"hello", np.uint8)
    post_recv(b, RECV_OFF, 64, wr_id=3)
    a.qp.post_send(send_wr([a.sge(0, 5)], wr_id=4))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert (poll_one(b.rcq).wr_id, bytes(b.buf[RECV_OFF : RECV_OFF + 5])) == (3, b"hello")
    b.buf[:8] = 7
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(100, 8), b.mr.rkey, b.mr.buf))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert (a.buf[100:108] == 7).all()


# ====================================================================== opcodes
def test_send(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    a.buf[:11] = np.frombuffer(b"hello world", np.uint8)
    post_recv(b, RECV_OFF, 64, wr_id=77)
    a.qp.post_send(send_wr([a.sge(0, 11)], wr_id=5))
    rwc = poll_one(b.rcq)
    swc = poll_one(a.scq)
    assert bytes(b.buf[RECV_OFF : RECV_OFF + 11]) == b"hello world"
    assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len) == (77, v.IBV_WC_SUCCESS, v.IBV_WC_RECV, 11)
    assert (rwc.qp_num, rwc.src_qp, rwc.slid) == (b.qp.qp_num, a.qp.qp_num, a.lid)
    assert not rwc.wc_flags & v.IBV_WC_WITH_IMM
    assert (swc.wr_id, swc.status, swc.opcode, swc.qp_num) == (5, v.IBV_WC_SUCCESS, v.IBV_WC_SEND, a.qp.qp_num)


def test_send_with_imm(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    post_recv(b, RECV_OFF, 64)
    a.qp.post_send(send_wr([a.sge(0, 4)], opcode=v.IBV_WR_SEND_WITH_IMM, imm=0xDEADBEEF))
    rwc = poll_one(b.rcq)
    assert rwc.status == v.IBV_WC_SUCCESS and rwc.opcode == v.IBV_WC_RECV and rwc.byte_len == 4
    assert rwc.wc_flags & v.IBV_WC_WITH_IMM
    assert rwc.imm_data == 0xDEADBEEF
    assert poll_one(a.scq).opcode == v.IBV_WC_SEND


def test_rdma_write_consumes_no_receive(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    a.buf[:4096] = np.arange(4096) % 251
    post_recv(b, RECV_OFF + 8192, 64, wr_id=99)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 4096), b.mr.rkey, b.addr(RECV_OFF), wr_id=3))
    swc = poll_one(a.scq)
    assert (swc.wr_id, swc.status, swc.opcode, swc.byte_len) == (3, v.IBV_WC_SUCCESS, v.IBV_WC_RDMA_WRITE, 4096)
    assert np.array_equal(b.buf[RECV_OFF : RECV_OFF + 4096], np.arange(4096) % 251)
    assert_no_completion(b.rcq, 0.05)
    a.qp.post_send(send_wr([a.sge(0, 8)]))  # the receive is still there for the next SEND
    assert poll_one(b.rcq).wr_id == 99


def test_rdma_write_with_imm_consumes_a_receive(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    a.buf[:100] = 7
    post_recv(b, RECV_OFF + 8192, 16, wr_id=42)
    wr = rdma_wr(v.IBV_WR_RDMA_WRITE_WITH_IMM, a.sge(0, 100), b.mr.rkey, b.addr(RECV_OFF), imm=0x1234)
    a.qp.post_send(wr)
    rwc = poll_one(b.rcq)
    assert rwc.wr_id == 42 and rwc.status == v.IBV_WC_SUCCESS
    assert rwc.opcode == v.IBV_WC_RECV_RDMA_WITH_IMM
    assert rwc.byte_len == 100
    assert rwc.wc_flags & v.IBV_WC_WITH_IMM and rwc.imm_data == 0x1234
    assert (b.buf[RECV_OFF : RECV_OFF + 100] == 7).all()
    assert (b.buf[RECV_OFF + 8192 : RECV_OFF + 8192 + 16] == 0).all()  # the receive buffer is untouched
    assert poll_one(a.scq).opcode == v.IBV_WC_RDMA_WRITE


def test_rdma_read(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    b.buf[RECV_OFF : RECV_OFF + 5000] = np.arange(5000) % 13
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(100, 5000), b.mr.rkey, b.addr(RECV_OFF), wr_id=8))
    wc = poll_one(a.scq)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (8, v.IBV_WC_SUCCESS, v.IBV_WC_RDMA_READ, 5000)
    assert np.array_equal(a.buf[100:5100], np.arange(5000) % 13)


def test_atomic_compare_and_swap(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    u64(b, RECV_OFF)[0] = 5
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_CMP_AND_SWP, a.sge(8, 8), b.mr.rkey, b.addr(RECV_OFF), 5, 9))
    wc = poll_one(a.scq)
    assert (wc.status, wc.opcode, wc.byte_len) == (v.IBV_WC_SUCCESS, v.IBV_WC_COMP_SWAP, 8)
    assert u64(a, 8)[0] == 5 and u64(b, RECV_OFF)[0] == 9
    # a failed compare returns the current value and leaves it alone
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_CMP_AND_SWP, a.sge(16, 8), b.mr.rkey, b.addr(RECV_OFF), 5, 11))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert u64(a, 16)[0] == 9 and u64(b, RECV_OFF)[0] == 9


def test_atomic_fetch_and_add_wraps_at_2_64(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    u64(b, RECV_OFF + 64)[0] = 2**64 - 1
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(8, 8), b.mr.rkey, b.addr(RECV_OFF + 64), 2))
    wc = poll_one(a.scq)
    assert (wc.status, wc.opcode) == (v.IBV_WC_SUCCESS, v.IBV_WC_FETCH_ADD)
    assert u64(a, 8)[0] == 2**64 - 1
    assert u64(b, RECV_OFF + 64)[0] == 1


def test_multiple_sges_gather_and_scatter(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    a.buf[0:3] = np.frombuffer(b"abc", np.uint8)
    a.buf[1000:1004] = np.frombuffer(b"defg", np.uint8)
    a.buf[2000:2003] = np.frombuffer(b"hij", np.uint8)
    sges = [b.sge(RECV_OFF, 2), b.sge(RECV_OFF + 500, 5), b.sge(RECV_OFF + 900, 100)]
    b.qp.post_recv(recv_wr(sges, wr_id=4))
    a.qp.post_send(send_wr([a.sge(0, 3), a.sge(1000, 4), a.sge(2000, 3)]))
    rwc = poll_one(b.rcq)
    assert rwc.status == v.IBV_WC_SUCCESS and rwc.byte_len == 10
    assert bytes(b.buf[RECV_OFF : RECV_OFF + 2]) == b"ab"
    assert bytes(b.buf[RECV_OFF + 500 : RECV_OFF + 505]) == b"cdefg"
    assert bytes(b.buf[RECV_OFF + 900 : RECV_OFF + 903]) == b"hij"
    assert poll_one(a.scq).byte_len == 10


def test_multiple_sges_rdma_write(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    a.buf[0:4] = 1
    a.buf[100:104] = 2
    wr = send_wr([a.sge(0, 4), a.sge(100, 4)], opcode=v.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(b.mr.rkey, b.addr(RECV_OFF))
    a.qp.post_send(wr)
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert list(b.buf[RECV_OFF : RECV_OFF + 8]) == [1, 1, 1, 1, 2, 2, 2, 2]


def test_zero_length_send(pair: tuple[Endpoint, Endpoint]) -> None:
    a, b = pair
    post_recv(b, RECV_OFF, 64, wr_id=6)
    a.qp.post_send(v.SendWR(wr_id=9, opcode=v.IBV_WR_SEND, num_sge=0, sg=[]))
    rwc = poll_one(b.rcq)
    assert (rwc.wr_id, rwc.status, rwc.byte_len) == (6, v.IBV_WC_SUCCESS, 0)
    swc = poll_one(a.scq)
    assert (swc.wr_id, swc.status, swc.byte_len) == (9, v.IBV_WC_SUCCESS, 0)


def test_send_with_a_zero_length_sge(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    post_recv(b, RECV_OFF, 64, wr_id=6)
    a.qp.post_send(send_wr([a.sge(0, 0)], wr_id=9))
    assert poll_one(b.rcq).byte_len == 0
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS


def test_large_send_spans_many_packets(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, endpoint={"size": 1 << 20})
    a.buf[:] = np.arange(a.buf.size) % 241
    post_recv(b, 0, 1 << 20)
    a.qp.post_send(send_wr([a.sge(0, 1 << 20)]))
    assert poll_one(b.rcq).byte_len == 1 << 20
    assert np.array_equal(a.buf, b.buf)


# ====================================================================== UC
UC_ACCESS = int(v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE)


def uc_two(ctxs: tuple[v.Context, ...]) -> tuple[Endpoint, Endpoint]:
    opts = {"separate_cqs": True}
    return connect_rc(
        *ctxs, qp_type=v.IBV_QPT_UC, access_a=UC_ACCESS, access_b=UC_ACCESS, endpoint_a=opts, endpoint_b=opts
    )


def test_uc_send(ctxs: tuple[v.Context, ...]) -> None:
    a, b = uc_two(ctxs)
    a.buf[:3] = np.frombuffer(b"abc", np.uint8)
    post_recv(b, RECV_OFF, 64, wr_id=1)
    a.qp.post_send(send_wr([a.sge(0, 3)]))
    rwc = poll_one(b.rcq)
    assert (rwc.status, rwc.byte_len, rwc.src_qp) == (v.IBV_WC_SUCCESS, 3, a.qp.qp_num)
    assert bytes(b.buf[RECV_OFF : RECV_OFF + 3]) == b"abc"
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS


def test_uc_rdma_write(ctxs: tuple[v.Context, ...]) -> None:
    a, b = uc_two(ctxs)
    a.buf[:3] = np.frombuffer(b"xyz", np.uint8)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 3), b.mr.rkey, b.addr(1000)))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    wait_for(lambda: bytes(b.buf[1000:1003]) == b"xyz", what="the UC write to land")


def test_uc_several_messages(ctxs: tuple[v.Context, ...]) -> None:
    a, b = uc_two(ctxs)
    for i in range(3):
        post_recv(b, RECV_OFF + 64 * i, 64, wr_id=i)
    for i in range(3):
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=i))
    assert [wc.wr_id for wc in poll_until(a.scq, 3, timeout=2)] == [0, 1, 2]
    assert [wc.wr_id for wc in poll_until(b.rcq, 3, timeout=2)] == [0, 1, 2]


def test_uc_read_and_atomics_are_refused_at_post_time(ctxs: tuple[v.Context, ...]) -> None:
    a, b = uc_two(ctxs)
    with pytest.raises(v.PyverbsRDMAError) as info:
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(0, 8), b.mr.rkey, b.addr(0)))
    assert info.value.error_code == errno.EINVAL
    for opcode in (v.IBV_WR_ATOMIC_CMP_AND_SWP, v.IBV_WR_ATOMIC_FETCH_AND_ADD):
        with pytest.raises(v.PyverbsRDMAError) as info:
            a.qp.post_send(atomic_wr(opcode, a.sge(0, 8), b.mr.rkey, b.addr(0), 1, 2))
        assert info.value.error_code == errno.EINVAL
    assert a.qp.qp_state == v.IBV_QPS_RTS
    assert_no_completion(a.scq, 0.05)


# ====================================================================== send flags
def test_unsignaled_wrs_do_not_complete_with_sq_sig_all_0(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, endpoint={"sq_sig_all": 0})
    for i in range(6):
        flags = v.IBV_SEND_SIGNALED if i in (1, 4) else 0
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(i, 1), b.mr.rkey, b.addr(i), wr_id=i, flags=flags))
    assert [wc.wr_id for wc in poll_until(a.scq, 2)] == [1, 4]
    assert_no_completion(a.scq, 0.05)


def test_sq_sig_all_1_signals_every_wr(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, endpoint={"sq_sig_all": 1})
    for i in range(5):
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(i, 1), b.mr.rkey, b.addr(i), wr_id=i, flags=0))
    assert [wc.wr_id for wc in poll_until(a.scq, 5)] == [0, 1, 2, 3, 4]


def test_inline_data_is_copied_at_post_time(ctxs: tuple[v.Context, ...]) -> None:
    # No receive yet: the SEND is RNR-NAKed and retransmitted after the receive is posted,
    # long after the program overwrote its buffer.  Inline data must go out as it was at post time.
    a, b = rc_two(ctxs, endpoint={"max_inline": 64}, rnr_retry=7, min_rnr_timer=1)
    a.buf[:8] = np.frombuffer(b"original", np.uint8)
    a.qp.post_send(send_wr([a.sge(0, 8)], flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_INLINE))
    a.buf[:8] = np.frombuffer(b"modified", np.uint8)
    assert_no_completion(a.scq, 0.05)
    post_recv(b, RECV_OFF, 64)
    assert poll_one(b.rcq).byte_len == 8
    assert bytes(b.buf[RECV_OFF : RECV_OFF + 8]) == b"original"
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS


def test_inline_longer_than_max_inline_data_is_refused(ctxs: tuple[v.Context, ...]) -> None:
    a, _ = rc_two(ctxs, endpoint={"max_inline": 64})
    with pytest.raises(v.PyverbsRDMAError) as info:
        a.qp.post_send(send_wr([a.sge(0, 65)], flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_INLINE))
    assert info.value.error_code == errno.EINVAL
    assert a.qp.qp_state == v.IBV_QPS_RTS


def test_fence_waits_for_earlier_read(ctxs: tuple[v.Context, ...]) -> None:
    # READ B[x] into A[y], then SEND A[y] with FENCE: the SEND must carry the bytes the READ brought.
    a, b = rc_two(ctxs)
    b.buf[RECV_OFF : RECV_OFF + 1024] = 0x5A
    post_recv(b, 0, 2048)
    read = rdma_wr(v.IBV_WR_RDMA_READ, a.sge(4096, 1024), b.mr.rkey, b.addr(RECV_OFF), wr_id=1)
    read.next_wr = send_wr([a.sge(4096, 1024)], wr_id=2, flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_FENCE)
    a.qp.post_send(read)
    assert [wc.wr_id for wc in poll_until(a.scq, 2)] == [1, 2]
    assert poll_one(b.rcq).byte_len == 1024
    assert (b.buf[:1024] == 0x5A).all()


def test_rc_ordering_writes_visible_when_send_completes(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, endpoint={"sq_sig_all": 0, "max_send_wr": 128})
    a.buf[: 50 * 256] = np.repeat(np.arange(1, 51, dtype=np.uint8), 256)
    post_recv(b, RECV_OFF, 64)
    for i in range(50):
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(i * 256, 256), b.mr.rkey, b.addr(i * 256), flags=0))
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=99))
    poll_one(b.rcq)
    assert np.array_equal(b.buf[: 50 * 256], a.buf[: 50 * 256])


def test_chained_wrs_complete_in_order(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    head = None
    for i in reversed(range(8)):
        wr = rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(i, 1), b.mr.rkey, b.addr(i), wr_id=i)
        wr.next_wr = head
        head = wr
    a.qp.post_send(head)
    assert [wc.wr_id for wc in poll_until(a.scq, 8)] == list(range(8))


# ====================================================================== a full send queue
def test_a_post_to_a_full_send_queue_waits_for_the_nic_to_retire_wrs(
    ctxs: tuple[v.Context, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NIC drains its queue while the CPU posts; here its threads need the GIL, so a post to a full queue
    waits for WRs in flight to complete (`SQ_FULL_GRACE` at most) instead of failing at once."""
    a, b = rc_two(ctxs, endpoint={"max_send_wr": 2})
    monkeypatch.setattr(_hca.hca(a.ctx.name), "latency", 0.002)  # every ACK comes after its post has waited
    started = time.monotonic()
    for i in range(50):
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(i, 1), b.mr.rkey, b.addr(i), wr_id=i))
    elapsed = time.monotonic() - started
    assert [wc.wr_id for wc in poll_until(a.scq, 50)] == list(range(50))
    # each wait ends when a WR retires, not when the grace runs out: 48 of those would take 48 grace periods
    assert elapsed < 24 * SQ_FULL_GRACE, elapsed


def test_a_post_to_a_full_send_queue_that_does_not_drain_fails_with_enomem(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, endpoint={"max_send_wr": 2}, timeout=20)  # A's retries (4.3 s each) outlast the grace
    to_state(b.qp, v.IBV_QPS_RESET)  # B answers nothing any more
    for i in range(2):
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(i, 1), b.mr.rkey, b.addr(i), wr_id=i))
    started = time.monotonic()
    with pytest.raises(v.PyverbsRDMAError) as raised:
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(2, 1), b.mr.rkey, b.addr(2), wr_id=2))
    assert raised.value.error_code == errno.ENOMEM and "send queue full" in str(raised.value)
    assert time.monotonic() - started >= SQ_FULL_GRACE * 0.9  # after the grace, not at once
    assert qp_attr(a.qp).qp_state == v.IBV_QPS_RTS  # the refused post changed nothing


# ====================================================================== rd/atomic depth
def test_max_rd_atomic_16_accepted_17_refused(ctxs: tuple[v.Context, ...]) -> None:
    qp = _qp_in(ctxs, v.IBV_QPS_RTR)
    with pytest.raises(v.PyverbsRDMAError) as info:
        qp.to_rts(rts_attr(max_rd_atomic=17))
    assert info.value.error_code == errno.EINVAL
    assert qp.qp_state == v.IBV_QPS_RTR
    qp.to_rts(rts_attr(max_rd_atomic=16))
    assert qp_attr(qp).max_rd_atomic == 16


def test_max_dest_rd_atomic_17_refused(ctxs: tuple[v.Context, ...]) -> None:
    qp = fresh_qp(ctxs[0])
    qp.to_init(init_attr())
    attr = rtr_attr(0x99, 5)
    attr.max_dest_rd_atomic = 17
    with pytest.raises(v.PyverbsRDMAError):
        qp.to_rtr(attr)
    assert qp.qp_state == v.IBV_QPS_INIT


@pytest.mark.parametrize("depth", [1, 4, 16])
def test_many_outstanding_reads_complete(ctxs: tuple[v.Context, ...], depth: int) -> None:
    a, b = rc_two(ctxs, max_rd_atomic=depth, endpoint={"max_send_wr": 64})
    b.buf[RECV_OFF : RECV_OFF + 48 * 64] = np.repeat(np.arange(48, dtype=np.uint8), 64)
    for i in range(48):
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(i * 64, 64), b.mr.rkey, b.addr(RECV_OFF + i * 64), wr_id=i))
    wcs = poll_until(a.scq, 48)
    assert [wc.wr_id for wc in wcs] == list(range(48))
    assert all(wc.status == v.IBV_WC_SUCCESS for wc in wcs)
    assert np.array_equal(a.buf[: 48 * 64], b.buf[RECV_OFF : RECV_OFF + 48 * 64])


# ====================================================================== protection
def _expect_local_error(a: Endpoint, status: int) -> None:
    wc = poll_one(a.scq)
    assert wc.status == status, v.ibv_wc_status(wc.status).name
    wait_state(a.qp, v.IBV_QPS_ERR)


def test_bad_lkey_is_local_protection_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    post_recv(b, RECV_OFF)
    a.qp.post_send(send_wr([v.SGE(a.addr(0), 8, a.mr.lkey ^ 0x5A5A00)]))
    _expect_local_error(a, v.IBV_WC_LOC_PROT_ERR)


def test_sge_outside_mr_is_local_protection_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    post_recv(b, RECV_OFF)
    a.qp.post_send(send_wr([a.sge(a.buf.size - 4, 8)]))
    _expect_local_error(a, v.IBV_WC_LOC_PROT_ERR)


def test_read_into_mr_without_local_write_is_local_protection_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    ro = np.zeros(64, np.uint8)
    mr = v.MR(a.pd, ro, v.IBV_ACCESS_REMOTE_READ)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, v.SGE(mr.buf, 8, mr.lkey), b.mr.rkey, b.addr(0)))
    _expect_local_error(a, v.IBV_WC_LOC_PROT_ERR)


def test_lkey_of_another_pd_is_refused(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    other = v.MR(v.PD(a.ctx), np.zeros(64, np.uint8), ACCESS_ALL)
    post_recv(b, RECV_OFF)
    a.qp.post_send(send_wr([v.SGE(other.buf, 8, other.lkey)]))
    _expect_local_error(a, v.IBV_WC_LOC_PROT_ERR)


def _expect_remote_error(a: Endpoint, b: Endpoint, status: int) -> None:
    wc = poll_one(a.scq)
    assert wc.status == status, v.ibv_wc_status(wc.status).name
    wait_state(a.qp, v.IBV_QPS_ERR)
    wait_state(b.qp, v.IBV_QPS_ERR)  # IB class C: the responder goes to ERR too


def test_bad_rkey_is_remote_access_error_and_both_qps_fail(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey ^ 0x777700, b.addr(0)))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_remote_write_out_of_bounds_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 64), b.mr.rkey, b.addr(b.buf.size - 32)))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)
    assert not b.buf[-32:].any()


def test_remote_read_out_of_bounds_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(0, 64), b.mr.rkey, b.addr(0) - 8))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_write_to_mr_without_remote_write_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    ro = v.MR(b.pd, np.zeros(64, np.uint8), v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_READ)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), ro.rkey, ro.buf))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_read_from_mr_without_remote_read_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    wo = v.MR(b.pd, np.zeros(64, np.uint8), v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(0, 8), wo.rkey, wo.buf))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_write_to_qp_without_remote_write_access_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, access_b=int(v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_READ))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(0)))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_rkey_of_another_pd_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    other = v.MR(v.PD(b.ctx), np.zeros(64, np.uint8), ACCESS_ALL)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), other.rkey, other.buf))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_misaligned_atomic_is_remote_invalid_request(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(0, 8), b.mr.rkey, b.addr(4), 1))
    _expect_remote_error(a, b, v.IBV_WC_REM_INV_REQ_ERR)


def test_atomic_on_mr_without_remote_atomic_is_remote_access_error(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    mr = v.MR(b.pd, np.zeros(64, np.uint8), v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE)
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_CMP_AND_SWP, a.sge(0, 8), mr.rkey, mr.buf, 0, 1))
    _expect_remote_error(a, b, v.IBV_WC_REM_ACCESS_ERR)


def test_receive_buffer_too_small(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    post_recv(b, RECV_OFF, 16, wr_id=3)
    a.qp.post_send(send_wr([a.sge(0, 100)]))
    rwc = poll_one(b.rcq)
    assert (rwc.wr_id, rwc.status) == (3, v.IBV_WC_LOC_LEN_ERR)
    _expect_remote_error(a, b, v.IBV_WC_REM_INV_REQ_ERR)


def test_error_flushes_every_outstanding_wr_and_receive(ctxs: tuple[v.Context, ...]) -> None:
    a, _b = rc_two(ctxs, endpoint={"sq_sig_all": 0})
    for i in range(3):
        post_recv(a, RECV_OFF + i * 64, 64, wr_id=100 + i)
    head = send_wr([v.SGE(a.addr(0), 8, a.mr.lkey + 1)], wr_id=1)  # bad lkey, signaled
    head.next_wr = send_wr([a.sge(0, 8)], wr_id=2, flags=0)  # unsignaled
    head.next_wr.next_wr = send_wr([a.sge(0, 8)], wr_id=3)
    a.qp.post_send(head)
    wcs = poll_until(a.scq, 3)
    assert [(wc.wr_id, wc.status) for wc in wcs] == [
        (1, v.IBV_WC_LOC_PROT_ERR),
        (2, v.IBV_WC_WR_FLUSH_ERR),
        (3, v.IBV_WC_WR_FLUSH_ERR),
    ]
    assert a.qp.qp_state == v.IBV_QPS_ERR
    rwcs = poll_until(a.rcq, 3)
    assert sorted(wc.wr_id for wc in rwcs) == [100, 101, 102]
    assert all(wc.status == v.IBV_WC_WR_FLUSH_ERR for wc in rwcs)
    # posting to a QP in ERR completes at once with a flush error
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=4, flags=0))
    assert (poll_one(a.scq).wr_id, a.qp.qp_state) == (4, v.IBV_QPS_ERR)
    post_recv(a, RECV_OFF, 64, wr_id=104)
    wc = poll_one(a.rcq)
    assert (wc.wr_id, wc.status) == (104, v.IBV_WC_WR_FLUSH_ERR)


def test_modify_to_err_flushes_queued_receives(ctxs: tuple[v.Context, ...]) -> None:
    a, _ = rc_two(ctxs)
    post_recv(a, 0, 64, wr_id=7)
    post_recv(a, 64, 64, wr_id=8)
    to_state(a.qp, v.IBV_QPS_ERR)
    wcs = poll_until(a.rcq, 2)
    assert [(wc.wr_id, wc.status) for wc in wcs] == [(7, v.IBV_WC_WR_FLUSH_ERR), (8, v.IBV_WC_WR_FLUSH_ERR)]


def test_error_on_one_qp_leaves_others_alone(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs)
    c, d = rc_two(ctxs)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey + 1, b.addr(0)))
    assert poll_one(a.scq).status == v.IBV_WC_REM_ACCESS_ERR
    post_recv(d, RECV_OFF)
    c.qp.post_send(send_wr([c.sge(0, 8)]))
    assert poll_one(c.scq).status == v.IBV_WC_SUCCESS
    assert c.qp.qp_state == d.qp.qp_state == v.IBV_QPS_RTS


# ====================================================================== RNR and retries
def test_rnr_retry_7_waits_for_a_receive(ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(ctxs, rnr_retry=7, min_rnr_timer=1)
    a.buf[:4] = 9
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=11))
    assert_no_completion(a.scq, QUIET)
    assert a.qp.qp_state == v.IBV_QPS_RTS
    post_recv(b, RECV_OFF, 64, wr_id=12)
    assert poll_one(b.rcq).wr_id == 12
    wc = poll_one(a.scq)
    assert (wc.wr_id, wc.status) == (11, v.IBV_WC_SUCCESS)
    assert (b.buf[RECV_OFF : RECV_OFF + 4] == 9).all()


def test_rnr_retry_exhausted(ctxs: tuple[v.Context, ...]) -> None:
    a, _b = rc_two(ctxs, rnr_retry=1, min_rnr_timer=1)
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=11))
    wc = poll_one(a.scq)
    assert (wc.wr_id, wc.status) == (11, v.IBV_WC_RNR_RETRY_EXC_ERR)
    assert a.qp.qp_state == v.IBV_QPS_ERR


@pytest.mark.parametrize("gone", ["destroyed", "reset"])
def test_peer_gone_is_retry_exceeded(ctxs: tuple[v.Context, ...], gone: str) -> None:
    a, b = rc_two(ctxs, timeout=FAST_TIMEOUT, retry_cnt=FAST_RETRY)
    if gone == "destroyed":
        b.qp.close()
    else:
        to_state(b.qp, v.IBV_QPS_RESET)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(0), wr_id=21))
    wc = poll_one(a.scq, timeout=WAIT)
    assert (wc.wr_id, wc.status) == (21, v.IBV_WC_RETRY_EXC_ERR)
    assert a.qp.qp_state == v.IBV_QPS_ERR


def test_retry_exceeded_counts_from_the_post_when_an_earlier_timer_runs_late(ctxs: tuple[v.Context, ...]) -> None:
    """The retransmission timer armed for an acknowledged WR, run only after the next post (its thread was
    starved of the CPU), must not count a retry at once: RETRY_EXC_ERR takes retry_cnt + 1 ACK timeouts
    from the post."""
    timeout, retry_cnt = 14, 1
    period = ack_timeout(timeout)  # 67 ms
    a, b = rc_two(ctxs, timeout=timeout, retry_cnt=retry_cnt)
    timers_free = threading.Event()
    a.ctx.handle.hca.timers.at(0.0, timers_free.wait)  # a's timer thread runs nothing until it is set
    try:
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(0), wr_id=1))
        assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
        acked = time.monotonic()
        b.ctx.close()  # the peer's HCA is gone: the next send is a known loss
        wait_for(lambda: time.monotonic() > acked + period, what="the first WR's timer to be overdue")
        posted = time.monotonic()
        a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(0), wr_id=2))
    finally:
        timers_free.set()
    wc = poll_one(a.scq, timeout=WAIT)
    failed = time.monotonic()
    assert (wc.wr_id, wc.status) == (2, v.IBV_WC_RETRY_EXC_ERR)
    assert failed - posted >= (retry_cnt + 1) * period, f"RETRY_EXC_ERR {failed - posted:.3f} s after the post"


# ====================================================================== query_qp
def test_query_qp_returns_the_attributes(ctxs: tuple[v.Context, ...]) -> None:
    a = make_endpoint(ctxs[0])
    b = make_endpoint(ctxs[1])
    a.qp.to_init(init_attr(v.IBV_ACCESS_REMOTE_WRITE | v.IBV_ACCESS_LOCAL_WRITE))
    a.qp.to_rtr(rtr_attr(b.qp.qp_num, b.lid, rq_psn=0x1234, path_mtu=v.IBV_MTU_2048, max_dest_rd_atomic=5,
                         min_rnr_timer=12))  # fmt: skip
    a.qp.to_rts(rts_attr(sq_psn=0x4321, timeout=17, retry_cnt=5, rnr_retry=3, max_rd_atomic=9))
    attr, init = a.qp.query(v.IBV_QP_STATE)
    assert attr.qp_state == v.IBV_QPS_RTS
    assert attr.dest_qp_num == b.qp.qp_num
    assert attr.ah_attr.dlid == b.lid and attr.port_num == 1
    assert attr.path_mtu == v.IBV_MTU_2048
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic) == (17, 5, 3, 9)
    assert (attr.max_dest_rd_atomic, attr.min_rnr_timer) == (5, 12)
    assert (attr.rq_psn, attr.sq_psn) == (0x1234, 0x4321)
    assert attr.qp_access_flags == v.IBV_ACCESS_REMOTE_WRITE | v.IBV_ACCESS_LOCAL_WRITE
    assert init.qp_type == v.IBV_QPT_RC and init.scq is a.scq and init.cap.max_send_wr == 64


@pytest.mark.parametrize(("psn_a", "psn_b"), [(100, 500), (0xFFFFFE, 0xFFFFFF)])
def test_psns_advance_by_packets_per_message(ctxs: tuple[v.Context, ...], psn_a: int, psn_b: int) -> None:
    a, b = rc_two(ctxs, psn_a=psn_a, psn_b=psn_b, path_mtu=v.IBV_MTU_1024)
    mask = 0xFFFFFF

    def psns() -> tuple[int, int, int, int]:
        qa, qb = qp_attr(a.qp), qp_attr(b.qp)
        return qa.sq_psn, qb.rq_psn, qb.sq_psn, qa.rq_psn

    assert psns() == (psn_a, psn_a, psn_b, psn_b)
    post_recv(b, RECV_OFF, 4096)
    a.qp.post_send(send_wr([a.sge(0, 3000)]))  # 3 packets of 1024
    poll_one(a.scq)
    assert psns()[:2] == ((psn_a + 3) & mask, (psn_a + 3) & mask)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 1024), b.mr.rkey, b.addr(0)))  # exactly 1 packet
    poll_one(a.scq)
    assert psns()[:2] == ((psn_a + 4) & mask, (psn_a + 4) & mask)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(0, 4097), b.mr.rkey, b.addr(0)))  # 5 response packets
    poll_one(a.scq)
    assert psns()[:2] == ((psn_a + 9) & mask, (psn_a + 9) & mask)
    post_recv(a, RECV_OFF, 4096)
    b.qp.post_send(send_wr([]))  # a zero-length message still takes one PSN
    poll_one(a.rcq)
    assert psns()[2:] == ((psn_b + 1) & mask, (psn_b + 1) & mask)


# ====================================================================== automatic path migration
@pytest.fixture
def apm_ctxs() -> Iterator[tuple[v.Context, ...]]:
    """HCAs of their own: link failures here must not disturb the other tests' HCAs."""
    yield from contexts("simib2", "simib3")


def _rearm(ep: Endpoint, peer: Endpoint) -> None:
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS)
    attr.path_mig_state = v.IBV_MIG_REARM
    attr.alt_ah_attr = v.AHAttr(dlid=peer.lid2, port_num=2)
    attr.alt_port_num = 2
    attr.alt_timeout = FAST_TIMEOUT
    ep.qp.modify(attr, v.IBV_QP_ALT_PATH | v.IBV_QP_PATH_MIG_STATE)


def _wait_armed(ep: Endpoint) -> None:
    wait_for(lambda: qp_attr(ep.qp).path_mig_state == v.IBV_MIG_ARMED, what="the alternate path to be ARMED")


def _round_trip(a: Endpoint, b: Endpoint, tag: int) -> None:
    a.buf[:4] = tag
    post_recv(b, RECV_OFF, 64, wr_id=tag)
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=tag))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    wc = poll_one(b.rcq)
    assert (wc.wr_id, wc.status) == (tag, v.IBV_WC_SUCCESS)
    assert (b.buf[RECV_OFF : RECV_OFF + 4] == tag).all()


def test_armed_cannot_be_set_by_software(apm_ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(apm_ctxs)
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS)
    attr.path_mig_state = v.IBV_MIG_ARMED
    attr.alt_ah_attr = v.AHAttr(dlid=b.lid2, port_num=2)
    attr.alt_port_num = 2
    with pytest.raises(v.PyverbsRDMAError):
        a.qp.modify(attr, v.IBV_QP_ALT_PATH | v.IBV_QP_PATH_MIG_STATE)
    assert qp_attr(a.qp).path_mig_state == v.IBV_MIG_MIGRATED


@pytest.mark.parametrize(
    "state", [v.IBV_MIG_REARM, v.IBV_MIG_MIGRATED], ids=["rearm_without_alternate_path", "migrate_unarmed"]
)
def test_path_mig_state_without_an_armed_path_is_refused(apm_ctxs: tuple[v.Context, ...], state: int) -> None:
    """REARM needs an alternate path, a manual migration an ARMED one; a refused request changes nothing."""
    a, _ = rc_two(apm_ctxs)
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS)
    attr.path_mig_state = state
    with pytest.raises(v.PyverbsRDMAError):
        a.qp.modify(attr, v.IBV_QP_PATH_MIG_STATE)
    assert qp_attr(a.qp).path_mig_state == v.IBV_MIG_MIGRATED
    assert qp_attr(a.qp).port_num == 1


def test_rearm_with_alternate_path_becomes_armed(apm_ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(apm_ctxs)
    _rearm(a, b)
    _wait_armed(a)
    attr = qp_attr(a.qp)
    assert attr.alt_ah_attr.dlid == b.lid2 and attr.alt_port_num == 2
    assert attr.ah_attr.dlid == b.lid and attr.port_num == 1  # still on the primary path


def test_manual_migration_switches_to_alternate_path(apm_ctxs: tuple[v.Context, ...]) -> None:
    a, b = rc_two(apm_ctxs)
    _round_trip(a, b, 1)
    _rearm(a, b)
    _wait_armed(a)
    drain_events(a.ctx)
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS)
    attr.path_mig_state = v.IBV_MIG_MIGRATED
    a.qp.modify(attr, v.IBV_QP_PATH_MIG_STATE)
    after = qp_attr(a.qp)
    assert after.path_mig_state == v.IBV_MIG_MIGRATED
    assert (after.port_num, after.ah_attr.dlid) == (2, b.lid2)
    wait_event(a.ctx, v.IBV_EVENT_PATH_MIG, a.qp)
    _round_trip(a, b, 2)
    _round_trip(b, a, 3)


def test_link_failure_with_armed_path_migrates_and_traffic_continues(apm_ctxs: tuple[v.Context, ...]) -> None:
    sm = subnet_manager()
    a, b = rc_two(apm_ctxs, timeout=FAST_TIMEOUT, retry_cnt=FAST_RETRY)
    _rearm(a, b)
    _rearm(b, a)
    _wait_armed(a)
    _wait_armed(b)
    _round_trip(a, b, 1)
    drain_events(a.ctx)
    failed = a.lid
    sm.fail_link(failed)
    try:
        wait_link(failed, up=False)
        for tag in range(2, 6):
            _round_trip(a, b, tag)
        wait_event(a.ctx, v.IBV_EVENT_PATH_MIG, a.qp)
        attr = qp_attr(a.qp)
        assert (attr.qp_state, attr.port_num, attr.ah_attr.dlid) == (v.IBV_QPS_RTS, 2, b.lid2)
        _round_trip(b, a, 6)
    finally:
        sm.restore_link(failed)
        wait_link(failed, up=True)


def test_link_failure_without_alternate_path_is_retry_exceeded(apm_ctxs: tuple[v.Context, ...]) -> None:
    sm = subnet_manager()
    a, b = rc_two(apm_ctxs, timeout=FAST_TIMEOUT, retry_cnt=FAST_RETRY)
    _round_trip(a, b, 1)
    failed = a.lid
    sm.fail_link(failed)
    try:
        wait_link(failed, up=False)
        assert a.ctx.query_port(1).state == v.IBV_PORT_DOWN
        a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=9))
        wc = poll_one(a.scq)
        assert (wc.wr_id, wc.status) == (9, v.IBV_WC_RETRY_EXC_ERR)
    finally:
        sm.restore_link(failed)
        wait_link(failed, up=True)
    assert a.ctx.query_port(1).state == v.IBV_PORT_ACTIVE
    c, d = rc_two(apm_ctxs)  # the restored link carries traffic again
    _round_trip(c, d, 7)


def test_path_records_show_a_failed_link_as_down(apm_ctxs: tuple[v.Context, ...]) -> None:
    sm = subnet_manager()
    a, b = apm_ctxs
    failed = a.query_port(1).lid
    sm.fail_link(failed)
    try:
        wait_link(failed, up=False)
        paths = {(p.port_num, p.dport): p.up for p in a.query_paths(b.query_port(1).lid)}
        assert paths == {(1, 1): False, (1, 2): False, (2, 1): True, (2, 2): True}
        back = {(p.port_num, p.dport): p.up for p in b.query_paths(failed)}
        assert back == {(1, 1): False, (2, 1): False, (1, 2): True, (2, 2): True}
    finally:
        sm.restore_link(failed)
        wait_link(failed, up=True)
    assert all(p.up for p in a.query_paths(b.query_port(1).lid))
