"""ckpt_ib._shadows: what pickles with the program (never a real handle), the registry, the logs' entries."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
from ib_util import IbEnv, real_of
from verbs_util import ACCESS_ALL, connect_rc, post_recv, send_wr

from ckpt import verbs as v
from ckpt_ib._shadows import Registry, SendEntry, ShadowDevice, ShadowMR, ShadowPD, ShadowQP

pytestmark = pytest.mark.timeout(30)


def test_real_handles_are_not_pickled(ib: IbEnv) -> None:
    a, b = connect_rc(ib.context(0), ib.context(1))
    post_recv(b, wr_id=3)
    with pytest.raises(v.PyverbsError, match="ckpt_ib"):
        pickle.dumps(real_of(a.qp))  # a real simib handle refuses to be pickled

    registry, qp, mr = cloudpickle.loads(cloudpickle.dumps((ib.vz.registry, a.qp, a.mr)))

    shadows = [*registry.devices, *registry.pds, *registry.mrs, *registry.cqs, *registry.qps]
    assert shadows and all(s.real is None for s in shadows)
    assert qp.handle is registry.qps[0] and mr.handle is registry.mrs[0]  # one object graph with the program's
    assert (qp.qp_num, mr.lkey, mr.rkey, mr.buf) == (a.qp.qp_num, a.mr.lkey, a.mr.rkey, a.mr.buf)
    assert [e.wr_id for e in registry.qps[1].recvs.values()] == [3]  # the logs go with them
    assert registry.qps[0].modifies and registry.vlids == ib.vz.registry.vlids
    assert real_of(a.qp) is not None  # pickling did not detach the live shadow


def test_shadow_getstate_drops_real() -> None:
    dev = ShadowDevice("x0", [1, 2])
    dev.real = object()
    assert "real" not in dev.__getstate__()
    copy = pickle.loads(pickle.dumps(dev))
    assert copy.real is None and (copy.name, copy.vlids) == ("x0", [1, 2])


class _RealMR:
    addr, lkey = 0x5000, 0x77


def test_registered_array_pickles_with_its_shadow() -> None:
    buf = np.arange(16, dtype=np.uint8)
    mr = ShadowMR(ShadowPD(ShadowDevice("x0", [1, 2])), buf, ACCESS_ALL, 10, 11, 0x1000, 16)
    mr.attach(_RealMR())
    arr, copy = pickle.loads(pickle.dumps((buf, mr)))
    assert copy.obj is arr and list(arr) == list(range(16))
    assert copy.real is None and copy.memory is None  # this process's handle and view of the memory stay here


def test_mr_attach_records_where_the_buffer_lives_now() -> None:
    mr = ShadowMR(ShadowPD(ShadowDevice("x0", [1, 2])), bytearray(b"abcd"), 0, 10, 11, 0x1000, 4)
    mr.attach(_RealMR())
    assert (mr.addr, mr.delta, mr.real_lkey) == (0x1000, 0x4000, 0x77)
    assert mr.memory is not None and bytes(mr.memory[1:3]) == b"bc"


def test_registry_forget_removes_exactly_that_shadow() -> None:
    reg = Registry()
    dev = ShadowDevice("x0", [1, 2])
    pd1, pd2 = ShadowPD(dev), ShadowPD(dev)
    reg.devices.append(dev)
    reg.pds.extend([pd1, pd2])
    reg.forget(pd1)
    assert reg.pds == [pd2] and reg.devices == [dev]
    reg.forget(pd1)  # unknown: nothing happens
    reg.forget(dev)
    assert reg.pds == [pd2] and reg.devices == []


def test_closing_program_objects_forgets_their_shadows(ib: IbEnv) -> None:
    ctx = ib.context(0)
    pd = v.PD(ctx)
    mr = v.MR(pd, np.zeros(64, dtype=np.uint8), ACCESS_ALL)
    cq = v.CQ(ctx, 8)
    qp = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, cap=v.QPCap()))
    reg = ib.vz.registry
    assert (reg.mrs, reg.qps) == ([mr.handle], [qp.handle])
    qp.close()
    mr.close()
    assert reg.qps == [] and reg.mrs == [] and reg.cqs == [cq.handle]
    ctx.close()
    assert (reg.devices, reg.pds, reg.cqs) == ([], [], [])


def test_needs_recv_is_true_for_the_opcodes_that_consume_a_receive() -> None:
    def entry(opcode: int) -> SendEntry:
        return SendEntry(1, 1, int(opcode), 0, True, [], 0, 0, 0, 0, 0, None)

    consuming = {v.IBV_WR_SEND, v.IBV_WR_SEND_WITH_IMM, v.IBV_WR_RDMA_WRITE_WITH_IMM}
    others = {v.IBV_WR_RDMA_WRITE, v.IBV_WR_RDMA_READ, v.IBV_WR_ATOMIC_CMP_AND_SWP, v.IBV_WR_ATOMIC_FETCH_AND_ADD}
    assert all(entry(op).needs_recv for op in consuming)
    assert not any(entry(op).needs_recv for op in others)


def test_send_log_keeps_what_a_repost_needs(ib: IbEnv) -> None:
    a, _ = connect_rc(ib.context(0), ib.context(1), endpoint_a={"sq_sig_all": 0})
    wr = send_wr([a.sge(8, 4)], wr_id=0xABC, opcode=v.IBV_WR_SEND_WITH_IMM, flags=0, imm=0x77)
    a.qp.post_send(wr)  # no receive at the peer: stays in the log
    (entry,) = a.qp.handle.sends
    assert isinstance(a.qp.handle, ShadowQP)
    assert (entry.wr_id, entry.opcode, entry.imm, entry.signaled) == (0xABC, v.IBV_WR_SEND_WITH_IMM, 0x77, False)
    assert entry.sg == [(a.addr(8), 4, a.mr.lkey)]  # virtual address and key
    assert (entry.psn, entry.npkts) == (0, 1)
