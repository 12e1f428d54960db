"""ckpt.verbs HCA services in one process (`_hca`): identities, devices and ports, one-sidedness, statistics."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from verbs_util import (
    WAIT,
    connect_rc,
    make_endpoint,
    poll_one,
    poll_until,
    post_recv,
    rdma_wr,
    send_wr,
    wait_for,
)

from ckpt import verbs as v

pytestmark = pytest.mark.timeout(60)


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
