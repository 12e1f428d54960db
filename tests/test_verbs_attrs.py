"""The verbs attribute and work-request classes: pyverbs defaults, setters, chaining, repr, errors."""

from __future__ import annotations

import pickle

import pytest

from ckpt.verbs._attrs import (
    GID,
    SGE,
    WC,
    AHAttr,
    AsyncEvent,
    DeviceAttr,
    GlobalRoute,
    PortAttr,
    QPAttr,
    QPCap,
    QPInitAttr,
    RecvWR,
    SendWR,
    SrqAttr,
    SrqInitAttr,
)
from ckpt.verbs._enums import (
    IBV_EVENT_QP_FATAL,
    IBV_MIG_MIGRATED,
    IBV_MTU_1024,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPT_RC,
    IBV_QPT_UD,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
)
from ckpt.verbs._errors import PyverbsError, PyverbsRDMAError, PyverbsUserError


# ----------------------------------------------------------------- QP attributes
def test_qpcap_defaults_are_pyverbs() -> None:
    assert QPCap() == QPCap(max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0)


def test_qpinitattr_defaults_and_fresh_cap() -> None:
    a, b = QPInitAttr(), QPInitAttr()
    assert a.qp_type == IBV_QPT_UD and a.sq_sig_all == 1
    assert a.scq is None and a.rcq is None and a.srq is None and a.qp_context is None
    assert a.cap == QPCap() and a.cap is not b.cap
    cq = object()
    c = QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=64))
    assert c.send_cq is cq and c.recv_cq is cq and c.cap.max_send_wr == 64


def test_qpattr_defaults_are_pyverbs() -> None:
    attr = QPAttr()
    assert (attr.qp_state, attr.cur_qp_state, attr.port_num, attr.path_mtu) == (
        IBV_QPS_INIT,
        IBV_QPS_RESET,
        1,
        IBV_MTU_1024,
    )
    assert attr.path_mig_state == IBV_MIG_MIGRATED
    # pyverbs leaves these zeroed; a program sets them for RTR/RTS.
    for name in ("timeout", "retry_cnt", "rnr_retry", "max_rd_atomic", "max_dest_rd_atomic", "min_rnr_timer"):
        assert getattr(attr, name) == 0, name
    assert attr.ah_attr == AHAttr() and attr.alt_ah_attr == AHAttr()
    assert attr.ah_attr is not attr.alt_ah_attr


def test_qpattr_takes_every_field_by_keyword_and_is_mutable() -> None:
    attr = QPAttr(qp_state=IBV_QPS_RESET, timeout=14, retry_cnt=7, rnr_retry=7, dest_qp_num=0x42, alt_port_num=2)
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.dest_qp_num, attr.alt_port_num) == (14, 7, 7, 0x42, 2)
    attr.sq_psn = 99
    assert attr.sq_psn == 99
    with pytest.raises(AttributeError):
        attr.no_such_field = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        QPAttr(1, 0, 1, 3, 0)  # type: ignore[call-arg]  # past path_mtu the fields are keyword-only


def test_qpattr_pickles() -> None:
    attr = QPAttr(timeout=3, ah_attr=AHAttr(dlid=7))
    assert pickle.loads(pickle.dumps(attr)) == attr


# ----------------------------------------------------------------- addressing
def test_gid_str_form_and_parsing() -> None:
    gid = GID("fe80:0000:0000:0000:0002:c903:0001:0001")
    assert str(gid) == "fe80:0000:0000:0000:0002:c903:0001:0001"
    assert gid.gid == str(gid)
    assert GID("fe80::2:c903:1:1") == gid
    assert GID(gid.raw) == gid and len(gid.raw) == 16
    assert str(GID()) == ":".join(["0000"] * 8)
    assert repr(gid) == "GID('fe80:0000:0000:0000:0002:c903:0001:0001')"
    assert len({gid, GID("fe80::2:c903:1:1")}) == 1
    with pytest.raises(PyverbsUserError):
        GID("not a gid")
    with pytest.raises(PyverbsUserError):
        GID(b"short")


def test_global_route_and_ahattr_defaults() -> None:
    gr = GlobalRoute()
    assert (gr.dgid, gr.flow_label, gr.sgid_index, gr.hop_limit, gr.traffic_class) == (GID(), 0, 0, 1, 0)
    ah = AHAttr()
    assert (ah.dlid, ah.sl, ah.src_path_bits, ah.static_rate, ah.is_global, ah.port_num, ah.gr) == (
        0,
        0,
        0,
        0,
        0,
        1,
        None,
    )
    assert ah.dgid is None and ah.hop_limit is None


def test_global_ahattr_exposes_grh_and_requires_it() -> None:
    gid = GID("fe80::1")
    ah = AHAttr(dlid=3, is_global=1, gr=GlobalRoute(dgid=gid, sgid_index=2, hop_limit=64))
    assert ah.dgid == gid and ah.sgid_index == 2 and ah.hop_limit == 64
    assert ah.flow_label == 0 and ah.traffic_class == 0
    with pytest.raises(PyverbsUserError, match="gr parameter is None"):
        AHAttr(is_global=1)


# ----------------------------------------------------------------- work requests
def test_sge_is_positional_in_pyverbs_order() -> None:
    sge = SGE(0x1000, 64, 0xABC)
    assert (sge.addr, sge.length, sge.lkey) == (0x1000, 64, 0xABC)
    assert sge == SGE(addr=0x1000, length=64, lkey=0xABC)


def test_recv_wr_defaults_and_num_sge() -> None:
    wr = RecvWR()
    assert (wr.wr_id, wr.num_sge, wr.sg, wr.next_wr) == (0, 0, [], None)
    sg = [SGE(1, 2, 3), SGE(4, 5, 6)]
    assert RecvWR(wr_id=7, sg=sg).num_sge == 2
    assert RecvWR(wr_id=7, num_sge=1, sg=sg).num_sge == 1


def test_send_wr_defaults() -> None:
    wr = SendWR()
    assert (wr.wr_id, wr.opcode, wr.num_sge, wr.imm_data, wr.sg, wr.send_flags, wr.next_wr) == (
        0,
        IBV_WR_SEND,
        0,
        0,
        [],
        IBV_SEND_SIGNALED,
        None,
    )
    assert (wr.rkey, wr.remote_addr, wr.compare_add, wr.swap) == (0, 0, 0, 0)
    assert (wr.ah, wr.remote_qpn, wr.remote_qkey) == (None, 0, 0)
    assert SendWR(sg=[SGE(1, 2, 3)]).num_sge == 1


def test_set_wr_rdma_atomic_ud() -> None:
    wr = SendWR(opcode=IBV_WR_RDMA_WRITE, sg=[SGE(0x10, 8, 1)])
    wr.set_wr_rdma(0x77, 0x2000)
    assert (wr.rkey, wr.remote_addr) == (0x77, 0x2000)

    atomic = SendWR(opcode=IBV_WR_ATOMIC_CMP_AND_SWP, sg=[SGE(0x10, 8, 1)])
    atomic.set_wr_atomic(0x78, 0x3000, 5, 9)
    assert (atomic.rkey, atomic.remote_addr, atomic.compare_add, atomic.swap) == (0x78, 0x3000, 5, 9)
    atomic.set_wr_atomic(rkey=1, addr=2, compare_add=3)
    assert atomic.swap == 0

    ud = SendWR()
    ah = object()
    ud.set_wr_ud(ah, 0x99, 0x11111111)
    assert (ud.ah, ud.remote_qpn, ud.remote_qkey) == (ah, 0x99, 0x11111111)


def test_chained_work_requests() -> None:
    last = SendWR(wr_id=3)
    first = SendWR(wr_id=1, next_wr=SendWR(wr_id=2, next_wr=last))
    ids = []
    wr: SendWR | None = first
    while wr is not None:
        ids.append(wr.wr_id)
        wr = wr.next_wr
    assert ids == [1, 2, 3]
    recv = RecvWR(wr_id=1, next_wr=RecvWR(wr_id=2))
    assert recv.next_wr is not None and recv.next_wr.wr_id == 2


def test_work_requests_compare_by_identity_and_hash() -> None:
    # A WR is a request, not a value: two equal-looking posts are two requests.
    assert SendWR(wr_id=1) != SendWR(wr_id=1)
    assert RecvWR(wr_id=1) != RecvWR(wr_id=1)
    wr = SendWR()
    assert {wr: 1}[wr] == 1


# ----------------------------------------------------------------- completions, SRQ, device, events
def test_wc_defaults_and_fields() -> None:
    wc = WC()
    assert wc.status == IBV_WC_SUCCESS and wc.wr_id == 0 and wc.byte_len == 0
    wc = WC(wr_id=5, status=10, opcode=128, byte_len=64, qp_num=0x12, src_qp=0x13, imm_data=7, wc_flags=2)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num, wc.src_qp, wc.imm_data, wc.wc_flags) == (
        5,
        10,
        128,
        64,
        0x12,
        0x13,
        7,
        2,
    )
    assert (wc.vendor_err, wc.pkey_index, wc.slid, wc.sl, wc.dlid_path_bits) == (0, 0, 0, 0, 0)
    assert WC(wr_id=5) == WC(wr_id=5)
    assert not hasattr(wc, "__dict__")


def test_srq_attrs() -> None:
    assert SrqAttr() == SrqAttr(max_wr=100, max_sge=1, srq_limit=0)
    init = SrqInitAttr()
    assert init.attr == SrqAttr() and init.srq_context is None
    init = SrqInitAttr(SrqAttr(max_wr=8, srq_limit=2))
    assert (init.max_wr, init.max_sge, init.srq_limit) == (8, 1, 2)


def test_device_and_port_attr_are_keyword_with_zero_defaults() -> None:
    dev = DeviceAttr(max_qp=4, max_qp_rd_atom=16, atomic_caps=1, fw_version="sim")
    assert dev.max_qp == 4 and dev.max_cq == 0 and dev.phys_port_cnt == 0
    assert (dev.fw_ver, dev.atomic_cap) == ("sim", 1)
    port = PortAttr(state=4, lid=12, active_mtu=5)
    assert (port.state, port.lid, port.active_mtu, port.sm_lid, port.link_layer, port.flags) == (4, 12, 5, 0, 0, 0)
    with pytest.raises(TypeError):
        PortAttr(4)  # type: ignore[call-arg]


def test_async_event() -> None:
    qp = object()
    event = AsyncEvent(IBV_EVENT_QP_FATAL, qp)
    assert event.event_type == IBV_EVENT_QP_FATAL and event.element is qp
    event.ack()
    event.ack()
    assert repr(AsyncEvent(IBV_EVENT_QP_FATAL, 1)) == "AsyncEvent(IBV_EVENT_QP_FATAL, element=1)"
    assert "event type 99" in repr(AsyncEvent(99))


def test_reprs_name_the_fields() -> None:
    assert repr(QPCap()) == "QPCap(max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0)"
    assert "wr_id=9" in repr(SendWR(wr_id=9)) and "sg=[SGE(addr=1, length=2, lkey=3)]" in repr(
        RecvWR(sg=[SGE(1, 2, 3)])
    )
    assert "timeout=14" in repr(QPAttr(timeout=14))


# ----------------------------------------------------------------- errors
def test_errors_match_pyverbs() -> None:
    err = PyverbsRDMAError("Failed to modify QP", 22)
    assert err.error_code == 22
    assert str(err) == "Failed to modify QP. Errno: 22, Invalid argument"
    assert isinstance(err, PyverbsError)
    plain = PyverbsRDMAError("Failed")
    assert plain.error_code == -1 and str(plain) == "Failed"
    user = PyverbsUserError("bad input")
    assert isinstance(user, PyverbsError) and str(user) == "bad input"


def test_errors_pickle_with_their_code() -> None:
    err = pickle.loads(pickle.dumps(PyverbsRDMAError("Failed to post send", 12)))
    assert isinstance(err, PyverbsRDMAError)
    assert err.error_code == 12 and str(err) == "Failed to post send. Errno: 12, Cannot allocate memory"
    user = pickle.loads(pickle.dumps(PyverbsUserError("bad")))
    assert isinstance(user, PyverbsUserError) and str(user) == "bad"
