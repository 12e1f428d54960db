"""ckpt_ib._rebuild: a simulated restart (image, new real objects, modify replay, re-posts) the program does not see."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from ib_util import IbEnv, real_of
from verbs_util import (
    FAST_RETRY,
    FAST_TIMEOUT,
    Endpoint,
    assert_no_completion,
    connect_rc,
    exchange,
    paths,
    poll_one,
    poll_until,
    post_recv,
    rdma_wr,
    send_wr,
    wait_for,
    wait_link,
)
from verbs_util import subnet_manager as fabric_manager

from ckpt import verbs as v

pytestmark = pytest.mark.timeout(30)


def _pair(ib: IbEnv, **opts: Any) -> tuple[Endpoint, Endpoint]:
    return connect_rc(ib.context(0), ib.context(1), **opts)


def _restart(ib: IbEnv, a: Endpoint, b: Endpoint) -> tuple[Endpoint, Endpoint]:
    state = ib.restart({"a": a, "b": b})
    return state["a"], state["b"]


def _ids(ib: IbEnv, ep: Endpoint) -> dict[str, Any]:
    return {
        "virtual": (ep.qp.qp_num, ep.mr.lkey, ep.mr.rkey, ep.mr.buf, ep.lid, ep.lid2),
        "qp_num": real_of(ep.qp).qp_num,
        "lkey": real_of(ep.mr).lkey,
        "rkey": real_of(ep.mr).rkey,
        "lid": ib.vz.inner.query_port(real_of(ep.ctx), 1).lid,
    }


def test_restart_keeps_virtual_ids_and_changes_real_ones(ib: IbEnv) -> None:
    a, b = _pair(ib)
    before = [_ids(ib, ep) for ep in (a, b)]
    a, b = _restart(ib, a, b)
    after = [_ids(ib, ep) for ep in (a, b)]
    for old, new in zip(before, after, strict=True):
        assert new["virtual"] == old["virtual"]
        for key in ("qp_num", "lkey", "rkey", "lid"):
            assert new[key] != old[key], key
    assert ib.rt.kv.get("ib", f"qpn/{a.qp.qp_num}") == after[0]["qp_num"]  # published in the new generation


def test_front_end_objects_work_again_after_restart(ib: IbEnv) -> None:
    a, b = _pair(ib)
    a, b = _restart(ib, a, b)
    post_recv(b, offset=64, length=64, wr_id=5)
    a.buf[:3] = [1, 2, 3]
    a.qp.post_send(send_wr([a.sge(0, 3)], wr_id=6))
    assert poll_one(a.scq).wr_id == 6
    wc = poll_one(b.rcq)
    assert (wc.wr_id, wc.qp_num, wc.src_qp, wc.slid) == (5, b.qp.qp_num, a.qp.qp_num, a.lid)
    assert list(b.buf[64:67]) == [1, 2, 3]
    b.buf[4096:4100] = [9, 8, 7, 6]
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(128, 4), b.mr.rkey, b.addr(4096), wr_id=7))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert list(a.buf[128:132]) == [9, 8, 7, 6]
    assert a.qp.query(v.IBV_QP_DEST_QPN)[0].dest_qp_num == b.qp.qp_num


def test_rnr_blocked_send_is_delivered_exactly_once_after_restart(ib: IbEnv) -> None:
    a, b = _pair(ib)
    post_recv(b, offset=0, length=64, wr_id=10)
    a.buf[:4] = list(b"one!")
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=1))
    a.buf[64:68] = list(b"two!")
    a.qp.post_send(send_wr([a.sge(64, 4)], wr_id=2))  # no receive for it: blocked at DRAIN

    a, b = _restart(ib, a, b)
    assert [e.wr_id for e in a.qp.handle.sends] == [2]

    post_recv(b, offset=64, length=64, wr_id=11)
    post_recv(b, offset=128, length=64, wr_id=12)  # room for a duplicate, if one came
    assert [w.wr_id for w in poll_until(b.rcq, 2)] == [10, 11]  # 10 from the private queue, taken at DRAIN
    assert [w.wr_id for w in poll_until(a.scq, 2)] == [1, 2]
    assert bytes(b.buf[0:4]) == b"one!" and bytes(b.buf[64:68]) == b"two!"
    assert_no_completion(b.rcq, 0.1)
    assert bytes(b.buf[128:132]) == b"\0\0\0\0"


def test_pending_receives_are_reposted(ib: IbEnv) -> None:
    a, b = _pair(ib)
    post_recv(b, offset=256, length=64, wr_id=33)
    a, b = _restart(ib, a, b)
    assert [e.wr_id for e in b.qp.handle.recvs.values()] == [33]
    a.buf[:2] = [5, 6]
    a.qp.post_send(send_wr([a.sge(0, 2)], wr_id=1))
    wc = poll_one(b.rcq)
    assert (wc.wr_id, wc.byte_len) == (33, 2)
    assert list(b.buf[256:258]) == [5, 6]


def test_inline_send_is_reposted_with_the_bytes_captured_at_post_time(ib: IbEnv) -> None:
    a, b = _pair(ib, endpoint_a={"max_inline": 64})
    a.buf[:4] = list(b"abcd")
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=1, flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_INLINE))
    a.buf[:4] = list(b"zzzz")  # the program reuses its buffer: allowed once an inline WR is posted

    a, b = _restart(ib, a, b)
    post_recv(b, offset=0, length=64, wr_id=2)
    assert poll_one(b.rcq).byte_len == 4
    assert bytes(b.buf[:4]) == b"abcd"
    assert poll_one(a.scq).wr_id == 1


def test_registered_array_is_the_programs_array_after_restart(ib: IbEnv) -> None:
    a, b = _pair(ib)
    a, b = _restart(ib, a, b)
    assert a.mr.handle.obj is a.buf and a.mr.memory is a.buf
    assert real_of(a.mr).addr == a.buf.ctypes.data  # registered again where it lives now
    b.buf[:8] = np.arange(8, dtype=np.uint8) + 1
    b.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, b.sge(0, 8), a.mr.rkey, a.addr(512), wr_id=1))
    assert poll_one(b.scq).status == v.IBV_WC_SUCCESS
    assert list(a.buf[512:520]) == list(range(1, 9))


def test_two_restarts_in_a_row(ib: IbEnv) -> None:
    a, b = _pair(ib)
    a.qp.post_send(send_wr([a.sge(0, 4)], wr_id=1))
    a, b = _restart(ib, a, b)
    a, b = _restart(ib, a, b)
    post_recv(b, wr_id=2)
    assert poll_one(b.rcq).wr_id == 2
    assert poll_one(a.scq).wr_id == 1
    assert_no_completion(b.rcq, 0.05)


def test_inline_send_without_lkey_after_restart(ib: IbEnv) -> None:
    a, b = _pair(ib, endpoint_a={"max_inline": 64})
    a, b = _restart(ib, a, b)
    post_recv(b, wr_id=1)
    a.buf[:4] = list(b"wxyz")
    a.qp.post_send(send_wr([v.SGE(a.addr(0), 4, 0)], wr_id=2, flags=v.IBV_SEND_SIGNALED | v.IBV_SEND_INLINE))
    assert poll_one(b.rcq).wr_id == 1
    assert bytes(b.buf[:4]) == b"wxyz"


def test_mr_read_and_write_see_the_live_buffer_after_restart(ib: IbEnv) -> None:
    a, b = _pair(ib)
    a, b = _restart(ib, a, b)
    a.buf[:2] = [4, 2]
    assert a.mr.read(2, 0) == b"\x04\x02"
    a.mr.write(b"\x01", 1, 0)
    assert a.buf[0] == 1


# ---------------------------------------------------------------- automatic path migration
def _load_alternate(ep: Endpoint, peer: Endpoint, *, rearm: bool = True) -> None:
    """Port 2 to the peer's port 2 as the alternate path; REARMed (and waited ARMED) unless `rearm` is False."""
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS)
    attr.alt_ah_attr = v.AHAttr(dlid=peer.lid2, port_num=2)
    attr.alt_port_num, attr.alt_timeout = 2, FAST_TIMEOUT
    mask = v.IBV_QP_STATE | v.IBV_QP_ALT_PATH
    if rearm:
        attr.path_mig_state = v.IBV_MIG_REARM
        mask |= v.IBV_QP_PATH_MIG_STATE
    ep.qp.modify(attr, mask)
    if rearm:
        wait_for(lambda: paths(ep)[2] == v.IBV_MIG_ARMED, what="the alternate path to be ARMED")


def _migrate(ep: Endpoint) -> None:
    ep.qp.modify(v.QPAttr(qp_state=v.IBV_QPS_RTS, path_mig_state=v.IBV_MIG_MIGRATED), v.IBV_QP_PATH_MIG_STATE)


def _real_path(ib: IbEnv, ep: Endpoint) -> tuple[int, int]:
    """(port, dlid) of the real QP: the dlid a real LID, the real port LID of the peer's port that is meant."""
    attr = ib.vz.inner.query_qp(real_of(ep.qp), v.IBV_QP_PORT | v.IBV_QP_AV)[0]
    return attr.port_num, attr.ah_attr.dlid


def _real_lid(ib: IbEnv, ep: Endpoint, port: int) -> int:
    return int(ib.vz.inner.query_port(real_of(ep.ctx), port).lid)


def test_query_after_a_manual_migration_shows_the_path_the_qp_is_on(ib: IbEnv) -> None:
    a, b = _pair(ib)
    _load_alternate(a, b)
    assert paths(a) == ((1, b.lid), (2, b.lid2), v.IBV_MIG_ARMED)
    _migrate(a)
    assert paths(a) == ((2, b.lid2), (1, b.lid), v.IBV_MIG_MIGRATED)
    exchange(a, b, 1)


def test_a_restart_rebuilds_an_armed_qp_on_its_primary_path_and_arms_it_again(ib: IbEnv) -> None:
    a, b = _pair(ib)
    _load_alternate(a, b)
    a, b = _restart(ib, a, b)
    wait_for(lambda: paths(a)[2] == v.IBV_MIG_ARMED, what="the alternate path to be ARMED again")
    assert paths(a) == ((1, b.lid), (2, b.lid2), v.IBV_MIG_ARMED)
    assert _real_path(ib, a) == (1, _real_lid(ib, b, 1))
    exchange(a, b, 2)


def test_a_restart_after_a_manual_migration_rebuilds_the_qp_on_the_path_it_migrated_to(ib: IbEnv) -> None:
    """The history holds REARM then MIGRATED: replayed as it is, MIGRATED came before the HCA had ARMED the
    path (EINVAL in REFRESH).  The QP comes back on port 2, its alternate (the old primary) loaded, unarmed."""
    a, b = _pair(ib)
    _load_alternate(a, b)
    _load_alternate(b, a)
    _migrate(a)
    _migrate(b)
    a, b = _restart(ib, a, b)
    for ep, peer in ((a, b), (b, a)):
        assert paths(ep) == ((2, peer.lid2), (1, peer.lid), v.IBV_MIG_MIGRATED)
        assert _real_path(ib, ep) == (2, _real_lid(ib, peer, 2))
    exchange(a, b, 3)
    _load_alternate(a, b)  # the program re-arms as before: its alternate path is the other port pair again
    assert paths(a) == ((2, b.lid2), (2, b.lid2), v.IBV_MIG_ARMED)


def test_a_restart_after_an_automatic_migration_rebuilds_the_qp_on_the_path_it_migrated_to(ib: IbEnv) -> None:
    """A link fails under an ARMED QP: the HCA migrates it without the program's help (nothing in the
    history says so).  The checkpoint sees it, and the restart rebuilds the QP on port 2."""
    sm = fabric_manager()
    a, b = _pair(ib, timeout=FAST_TIMEOUT, retry_cnt=FAST_RETRY)
    _load_alternate(a, b)
    _load_alternate(b, a)
    failed = _real_lid(ib, a, 1)
    sm.fail_link(failed)
    try:
        wait_link(failed, up=False)
        exchange(a, b, 4)  # a's first send is lost on port 1: a migrates, and b, ARMED, with it
        a, b = _restart(ib, a, b)
    finally:
        sm.restore_link(failed)
        wait_link(failed, up=True)
    for ep, peer in ((a, b), (b, a)):
        assert paths(ep) == ((2, peer.lid2), (1, peer.lid), v.IBV_MIG_MIGRATED)
        assert _real_path(ib, ep) == (2, _real_lid(ib, peer, 2))
    exchange(a, b, 5)
