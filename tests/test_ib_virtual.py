"""ckpt_ib._virtual: virtual IDs and addresses, their translation, devices across transports."""

from __future__ import annotations

import numpy as np
import pytest
from ib_util import IbEnv, real_of
from verbs_util import (
    ACCESS_ALL,
    Endpoint,
)

from ckpt import verbs as v

pytestmark = pytest.mark.timeout(30)


def _real_lid(ib: IbEnv, ep: Endpoint, port: int = 1) -> int:
    return int(ib.vz.inner.query_port(real_of(ep.ctx), port).lid)


def test_program_sees_virtual_ids_from_the_coordinator(ib: IbEnv) -> None:
    a, b = ib.pair()
    alloc = ib.rt.allocated
    for ep in (a, b):
        assert ep.qp.qp_num in alloc["ib.qpn"] and ep.qp.qp_num != real_of(ep.qp).qp_num
        assert ep.mr.lkey in alloc["ib.key"] and ep.mr.lkey != real_of(ep.mr).lkey
        assert ep.mr.rkey in alloc["ib.key"] and ep.mr.rkey != real_of(ep.mr).rkey
        for port in (1, 2):
            lid = ep.ctx.query_port(port).lid
            assert lid in alloc["ib.lid"] and lid != _real_lid(ib, ep, port)
    assert len({a.qp.qp_num, b.qp.qp_num}) == 2 and len({a.lid, a.lid2, b.lid, b.lid2}) == 4


def test_mr_buf_is_the_address_of_the_first_registration(ib: IbEnv) -> None:
    ctx = ib.context(0)
    pd = v.PD(ctx)
    buf = np.zeros(4096, dtype=np.uint8)
    mr = v.MR(pd, buf, ACCESS_ALL)
    assert mr.buf == buf.ctypes.data == real_of(mr).addr
    assert mr.handle.delta == 0


def test_kv_maps_virtual_ids_to_real_ones(ib: IbEnv) -> None:
    a, b = ib.pair()
    kv = ib.rt.kv
    for ep in (a, b):
        assert kv.get("ib", f"qpn/{ep.qp.qp_num}") == real_of(ep.qp).qp_num
        assert kv.get("ib", f"lid/{ep.lid}") == _real_lid(ib, ep, 1)
        assert kv.get("ib", f"lid/{ep.lid2}") == _real_lid(ib, ep, 2)
        assert kv.get("ib", f"rkey/{ep.mr.rkey}") == [real_of(ep.mr).rkey, 0]


def test_modify_qp_translates_dest_qp_num_and_dlid(ib: IbEnv) -> None:
    a, b = ib.pair()
    mask = v.IBV_QP_DEST_QPN | v.IBV_QP_AV
    real_attr, _ = ib.vz.inner.query_qp(real_of(a.qp), mask)
    assert real_attr.dest_qp_num == real_of(b.qp).qp_num
    assert real_attr.ah_attr.dlid == _real_lid(ib, b)
    seen, _ = a.qp.query(mask)  # the program sees what it set
    assert (seen.dest_qp_num, seen.ah_attr.dlid) == (b.qp.qp_num, b.lid)


# ====================================================================== restarts across transports
@pytest.mark.parametrize(
    ("wrapped", "shadow", "opened"),
    [
        ("tcp", "simib1", "tcp1"),  # checkpointed on simib, restarted with --transport tcp
        ("simib", "tcp0", "simib0"),
        ("tcp", "simib", "tcp0"),
        ("tcp", "tcp2", "tcp2"),
        ("simib", "ibt_a3", "ibt_a3"),  # not a transport: opened as it is
    ],
)
def test_a_shadow_device_is_opened_on_the_active_transport(wrapped: str, shadow: str, opened: str) -> None:
    from ckpt.testing import FakeRuntime
    from ckpt_ib._virtual import Virtualizer

    v.register_transport("tcp")  # as a rank does for the transports its plugins declare (ib2tcp's)
    vz = Virtualizer(FakeRuntime())
    vz.provider = wrapped
    assert vz.real_device_name(shadow) == opened


@pytest.mark.parametrize(
    ("wrapped", "shadow", "opened"),
    [
        ("simib", "simib1", "simib1"),  # the same transport: unchanged
        ("ibt_a", "ibt_b2", "ibt_b2"),  # neither is a transport
        ("ibt_a", "ibt_a1", "ibt_a1"),
    ],
)
def test_a_shadow_device_of_no_other_transport_keeps_its_name(wrapped: str, shadow: str, opened: str) -> None:
    from ckpt.testing import FakeRuntime
    from ckpt_ib._virtual import Virtualizer

    vz = Virtualizer(FakeRuntime())
    vz.provider = wrapped
    assert vz.real_device_name(shadow) == opened


def test_a_transport_device_stays_when_the_wrapped_provider_is_no_transport() -> None:
    from ckpt.testing import FakeRuntime
    from ckpt_ib._virtual import Virtualizer

    vz = Virtualizer(FakeRuntime())
    vz.provider = "ibt_a"
    assert vz.real_device_name("simib1") == "simib1"


def test_path_records_come_back_with_virtual_lids(ib: IbEnv) -> None:
    a, b = ib.pair()
    lids = [b.ctx.query_port(p).lid for p in (1, 2)]
    expected = [v.PathRecord(sport, lids[dport - 1], dport, True) for sport in (1, 2) for dport in (1, 2)]
    assert a.ctx.query_paths(b.lid2) == a.ctx.query_paths(b.lid) == expected
