"""ckpt.verbs front-end objects: context managers and closing order, memory regions, enum spellings."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from verbs_util import (
    ACCESS_ALL,
    Endpoint,
    connect_rc,
    init_attr,
    make_endpoint,
    poll_one,
    post_recv,
    rdma_wr,
    send_wr,
)

from ckpt import verbs as v
from ckpt.verbs import _enums

pytestmark = pytest.mark.timeout(60)


# ====================================================================== closing
def test_closing_a_pd_closes_its_qps_and_mrs_first(ctxs: tuple[v.Context, ...]) -> None:
    a, _ = connect_rc(*ctxs)
    extra = v.MR(a.pd, 4096, v.IBV_ACCESS_LOCAL_WRITE)
    a.pd.close()
    assert a.qp._closed and a.mr._closed and extra._closed
    assert not a.scq._closed  # a CQ belongs to the context, not the PD
    with pytest.raises(v.PyverbsUserError):
        a.mr.read(4, 0)
    with pytest.raises(v.PyverbsUserError):
        extra.write(b"x", 1, 0)
    with pytest.raises(v.PyverbsUserError):
        v.MR(a.pd, 4096, v.IBV_ACCESS_LOCAL_WRITE)
    with pytest.raises(v.PyverbsUserError):
        v.QP(a.pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=a.scq, rcq=a.scq))


def test_context_manager_closes_everything(provider: str) -> None:
    with v.Context(name=f"{provider}0") as ctx:
        with v.PD(ctx) as pd:
            cq = v.CQ(ctx, 16)
            qp = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq))
            mr = v.MR(pd, 4096, v.IBV_ACCESS_LOCAL_WRITE)
        assert qp._closed and mr._closed and not cq._closed
        srq = v.SRQ(v.PD(ctx), v.SrqInitAttr())
        channel = v.CompChannel(ctx)
    assert cq._closed and srq._closed and channel._closed and ctx._closed
    with pytest.raises(v.PyverbsUserError):
        ctx.query_port(1)
    with pytest.raises(v.PyverbsUserError):
        v.PD(ctx)


def test_closing_a_qp_frees_its_number_for_the_peer(ctxs: tuple[v.Context, ...]) -> None:
    a, b = connect_rc(*ctxs, timeout=8, retry_cnt=1)
    b.qp.close()
    b.qp.close()  # closing twice is harmless
    a.qp.post_send(send_wr([a.sge(0, 8)]))
    assert poll_one(a.scq).status == v.IBV_WC_RETRY_EXC_ERR


_QP_USES: dict[str, Callable[[Endpoint], Any]] = {
    "post_send": lambda ep: ep.qp.post_send(send_wr([ep.sge(0, 8)])),
    "post_recv": lambda ep: post_recv(ep),
    "modify": lambda ep: ep.qp.to_init(init_attr()),
    "query": lambda ep: ep.qp.query(),
}


@pytest.mark.parametrize("use", sorted(_QP_USES))
def test_using_a_closed_qp_is_a_user_error(ctxs: tuple[v.Context, ...], use: str) -> None:
    ep = make_endpoint(ctxs[0])
    ep.qp.close()
    with pytest.raises(v.PyverbsUserError):
        _QP_USES[use](ep)


def test_using_a_closed_cq_is_a_user_error(ctxs: tuple[v.Context, ...]) -> None:
    cq = v.CQ(ctxs[0], 16)
    cq.close()
    with pytest.raises(v.PyverbsUserError):
        cq.poll()


def test_deregistered_mr_keys_are_invalid(ctxs: tuple[v.Context, ...]) -> None:
    a, b = connect_rc(*ctxs)
    extra = v.MR(b.pd, np.zeros(64, np.uint8), ACCESS_ALL)
    rkey, addr = extra.rkey, extra.buf
    extra.close()
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), rkey, addr))
    assert poll_one(a.scq).status == v.IBV_WC_REM_ACCESS_ERR


# ====================================================================== memory regions
def test_mr_allocates_its_own_buffer(ctxs: tuple[v.Context, ...]) -> None:
    pd = v.PD(ctxs[0])
    mr = v.MR(pd, 4096, v.IBV_ACCESS_LOCAL_WRITE)
    assert isinstance(mr.buf, int) and mr.buf != 0
    assert mr.length == 4096
    assert mr.read(8, 0) == bytes(8)
    mr.write(b"hello", 5, 100)
    assert mr.read(5, 100) == b"hello"
    mr.write("text", 4, 0)
    assert mr.read(4, 0) == b"text"
    with pytest.raises(v.PyverbsUserError):
        mr.read(8, 4092)
    with pytest.raises(v.PyverbsUserError):
        mr.write(b"abc", 3, 4094)


def _unclosed_pd() -> v.PD:
    """A PD in a context nobody closes."""
    return v.PD(v.Context(name="simib0"))


@pytest.mark.parametrize("what", ["MR", "QP", "CQ"])
def test_refused_creation_leaves_nothing_to_close(what: str) -> None:
    ctx = v.Context(name="simib0")  # not closed on purpose: closing it is what fails
    pd = v.PD(ctx)
    with pytest.raises(v.PyverbsError):
        if what == "MR":
            v.MR(pd, b"read only", v.IBV_ACCESS_LOCAL_WRITE)
        elif what == "QP":
            cq = v.CQ(ctx, 4)
            v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_UD, scq=cq, rcq=cq))
        else:
            v.CQ(ctx, 0)
    pd.close()
    ctx.close()


def test_mr_of_nonpositive_length_is_refused() -> None:
    pd = _unclosed_pd()
    with pytest.raises(v.PyverbsError):
        v.MR(pd, 0, v.IBV_ACCESS_LOCAL_WRITE)


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview", "mmap", "own"])
def test_registered_memory_is_the_callers_memory(ctxs: tuple[v.Context, ...], kind: str) -> None:
    """A remote WRITE lands in the very object registered, and the HCA reads the caller's latest bytes."""
    a, b = connect_rc(*ctxs)
    size = 4096
    obj: Any
    if kind == "numpy":
        obj = np.zeros(size // 8, dtype=np.float64)
    elif kind == "bytearray":
        obj = bytearray(size)
    elif kind == "memoryview":
        obj = memoryview(bytearray(size))[:]
    elif kind == "mmap":
        obj = mmap.mmap(-1, size)
    else:
        obj = size
    mr = v.MR(b.pd, obj, ACCESS_ALL)
    view = memoryview(mr.memory).cast("B") if kind == "own" else memoryview(obj).cast("B")
    a.buf[:size] = np.arange(size) % 199
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, size), mr.rkey, mr.buf))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert bytes(view) == bytes(a.buf[:size])
    if kind == "numpy":
        assert np.array_equal(obj.view(np.uint8), a.buf[:size])
    view[:4] = b"\x01\x02\x03\x04"  # the program writes; a remote READ sees it
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(8192, 4), mr.rkey, mr.buf))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert bytes(a.buf[8192:8196]) == b"\x01\x02\x03\x04"
    view.release()


def test_read_only_memory_cannot_be_registered_for_writing() -> None:
    pd = _unclosed_pd()
    data = b"read only data!!"
    for access in (v.IBV_ACCESS_LOCAL_WRITE, ACCESS_ALL):
        with pytest.raises(v.PyverbsRDMAError):
            v.MR(pd, data, access)
    frozen = np.zeros(16, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(v.PyverbsRDMAError):
        v.MR(pd, frozen, v.IBV_ACCESS_LOCAL_WRITE)


def test_read_only_memory_can_be_read_remotely(ctxs: tuple[v.Context, ...]) -> None:
    a, b = connect_rc(*ctxs)
    mr = v.MR(b.pd, b"constant bytes..", v.IBV_ACCESS_REMOTE_READ)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(0, 16), mr.rkey, mr.buf))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert bytes(a.buf[:16]) == b"constant bytes.."


def test_remote_write_needs_local_write() -> None:
    pd = _unclosed_pd()
    with pytest.raises(v.PyverbsRDMAError):
        v.MR(pd, bytearray(64), v.IBV_ACCESS_REMOTE_WRITE)


def test_send_from_numpy_array_uses_current_contents(ctxs: tuple[v.Context, ...]) -> None:
    a, b = connect_rc(*ctxs)
    post_recv(b, 0, 64)
    a.buf[:3] = [7, 8, 9]
    a.qp.post_send(send_wr([a.sge(0, 3)]))
    poll_one(b.rcq)
    assert list(b.buf[:3]) == [7, 8, 9]


# ====================================================================== enums
@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [
        ("ibv_qp_state", "IBV_QPS_RTS", 3),
        ("ibv_qp_state", "IBV_QPS_ERR", 6),
        ("ibv_wc_status", "IBV_WC_REM_ACCESS_ERR", 10),
        ("ibv_wc_status", "IBV_WC_WR_FLUSH_ERR", 5),
        ("ibv_wc_status", "IBV_WC_RNR_RETRY_EXC_ERR", 13),
        ("ibv_access_flags", "IBV_ACCESS_REMOTE_ATOMIC", 8),
        ("ibv_wr_opcode", "IBV_WR_SEND", 2),
        ("ibv_wr_opcode", "IBV_WR_ATOMIC_FETCH_AND_ADD", 6),
        ("ibv_send_flags", "IBV_SEND_INLINE", 8),
        ("ibv_wc_opcode", "IBV_WC_RECV_RDMA_WITH_IMM", 129),
        ("ibv_mig_state", "IBV_MIG_ARMED", 2),
        ("ibv_event_type", "IBV_EVENT_PATH_MIG", 6),
        ("ibv_event_type", "IBV_EVENT_SRQ_LIMIT_REACHED", 15),
        ("ibv_qp_attr_mask", "IBV_QP_ALT_PATH", 1 << 14),
        ("ibv_qp_attr_mask", "IBV_QP_DEST_QPN", 1 << 20),
    ],
)
def test_enums_both_spellings_with_libibverbs_values(cls: str, name: str, value: int) -> None:
    qualified = getattr(getattr(v, cls), name)
    assert qualified == getattr(v, name) == value
    assert getattr(_enums, cls)(value).name == name


def test_connect_rc_brings_a_pair_to_rts_with_the_given_attributes(ctxs: tuple[v.Context, ...]) -> None:
    a, b = make_endpoint(ctxs[0]), make_endpoint(ctxs[1])
    for me, peer, sq in ((a, b, 5), (b, a, 9)):
        v.connect_rc(me.qp, peer.lid, peer.qp.qp_num, ACCESS_ALL, rd_atomic=4, sq_psn=sq, rq_psn=14 - sq, rnr_retry=3)
    attr, _ = a.qp.query()
    assert (attr.qp_state, attr.dest_qp_num, attr.ah_attr.dlid) == (v.IBV_QPS_RTS, b.qp.qp_num, b.lid)
    assert (attr.sq_psn, attr.rq_psn, attr.max_rd_atomic, attr.rnr_retry) == (5, 9, 4, 3)
    post_recv(b)
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=3))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert poll_one(b.rcq).byte_len == 8


# ====================================================================== path records (APM's raw material)
def test_query_paths_lists_every_port_pair_to_the_peers_hca(ctxs: tuple[v.Context, ...], provider: str) -> None:
    """simib: from each of this HCA's ports to each of the peer's, from the subnet manager's routes, whichever
    of the peer's LIDs is asked; tcp has no subnet manager, so no paths."""
    a, b = ctxs
    lids = [b.query_port(p).lid for p in (1, 2)]
    expected = [v.PathRecord(sport, lids[dport - 1], dport, True) for sport in (1, 2) for dport in (1, 2)]
    for dlid in lids:
        assert a.query_paths(dlid) == (expected if provider == "simib" else [])
    assert a.query_paths(0xBFFE) == []  # no HCA has it
