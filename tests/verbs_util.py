"""Helpers for the single-process ckpt.verbs tests: connected endpoints, bounded waits, work requests."""

# Every wait here has a deadline and fails with what it saw so far: a test
# never sleeps to let the simulated NIC "catch up".  The only fixed waits are
# the short windows in which a test asserts that something does *not* happen.

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ckpt.testing
from ckpt import verbs as v
from ckpt.verbs import _hca, fabric

ACCESS_ALL = int(
    v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE | v.IBV_ACCESS_REMOTE_READ | v.IBV_ACCESS_REMOTE_ATOMIC
)
WAIT = 5.0  # seconds a test waits for something that must happen
QUIET = 0.2  # seconds a test watches for something that must not happen

# Fast failure settings: ack timeout 2**8 * 4.096 us (the engine floors it at 2 ms), two retries.
FAST_TIMEOUT, FAST_RETRY = 8, 2


@dataclass
class Endpoint:
    """One side of a connection: its context, PD, CQs, QP and a registered numpy buffer."""

    ctx: v.Context
    pd: v.PD
    scq: v.CQ
    rcq: v.CQ
    qp: v.QP
    buf: np.ndarray
    mr: v.MR

    @property
    def lid(self) -> int:
        return int(self.ctx.query_port(1).lid)

    @property
    def lid2(self) -> int:
        return int(self.ctx.query_port(2).lid)

    @property
    def cq(self) -> v.CQ:
        return self.scq

    def addr(self, offset: int = 0) -> int:
        return self.mr.buf + offset

    def sge(self, offset: int, length: int) -> v.SGE:
        return v.SGE(self.mr.buf + offset, length, self.mr.lkey)


def make_endpoint(
    ctx: v.Context,
    *,
    qp_type: int = v.IBV_QPT_RC,
    pd: v.PD | None = None,
    size: int = 1 << 16,
    mr_access: int = ACCESS_ALL,
    separate_cqs: bool = False,
    cqe: int = 256,
    channel: v.CompChannel | None = None,
    srq: v.SRQ | None = None,
    sq_sig_all: int = 1,
    max_send_wr: int = 64,
    max_recv_wr: int = 64,
    max_sge: int = 4,
    max_inline: int = 0,
) -> Endpoint:
    pd = pd or v.PD(ctx)
    scq = v.CQ(ctx, cqe, channel=channel)
    rcq = v.CQ(ctx, cqe, channel=channel) if separate_cqs else scq
    cap = v.QPCap(
        max_send_wr=max_send_wr,
        max_recv_wr=max_recv_wr,
        max_send_sge=max_sge,
        max_recv_sge=max_sge,
        max_inline_data=max_inline,
    )
    init = v.QPInitAttr(qp_type=qp_type, scq=scq, rcq=rcq, srq=srq, cap=cap, sq_sig_all=sq_sig_all)
    qp = v.QP(pd, init)
    buf = np.zeros(size, dtype=np.uint8)
    mr = v.MR(pd, buf, mr_access)
    return Endpoint(ctx, pd, scq, rcq, qp, buf, mr)


def init_attr(qp_access: int = ACCESS_ALL, port: int = 1) -> v.QPAttr:
    attr = v.QPAttr(port_num=port)
    attr.qp_access_flags = qp_access
    return attr


def rtr_attr(
    dest_qp_num: int,
    dlid: int,
    *,
    rq_psn: int = 0,
    path_mtu: int = v.IBV_MTU_1024,
    max_dest_rd_atomic: int = 16,
    min_rnr_timer: int = 1,
    port: int = 1,
) -> v.QPAttr:
    attr = v.QPAttr(path_mtu=path_mtu)
    attr.dest_qp_num = dest_qp_num
    attr.ah_attr = v.AHAttr(dlid=dlid, port_num=port)
    attr.rq_psn = rq_psn
    attr.max_dest_rd_atomic = max_dest_rd_atomic
    attr.min_rnr_timer = min_rnr_timer
    return attr


def rts_attr(
    *, sq_psn: int = 0, timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7, max_rd_atomic: int = 16
) -> v.QPAttr:
    attr = v.QPAttr()
    attr.sq_psn = sq_psn
    attr.timeout = timeout
    attr.retry_cnt = retry_cnt
    attr.rnr_retry = rnr_retry
    attr.max_rd_atomic = max_rd_atomic
    return attr


def bring_up(
    qp: v.QP,
    dest_qp_num: int,
    dlid: int,
    *,
    qp_access: int = ACCESS_ALL,
    rq_psn: int = 0,
    sq_psn: int = 0,
    path_mtu: int = v.IBV_MTU_1024,
    timeout: int = 14,
    retry_cnt: int = 7,
    rnr_retry: int = 7,
    min_rnr_timer: int = 1,
    max_rd_atomic: int = 16,
) -> None:
    """RESET -> INIT -> RTR -> RTS towards (dest_qp_num, dlid); UC QPs get only the attributes UC takes."""
    qp.to_init(init_attr(qp_access))
    uc = qp.qp_type == v.IBV_QPT_UC
    rtr = rtr_attr(
        dest_qp_num,
        dlid,
        rq_psn=rq_psn,
        path_mtu=path_mtu,
        min_rnr_timer=min_rnr_timer,
        max_dest_rd_atomic=0 if uc else 16,
    )
    qp.to_rtr(rtr)
    qp.to_rts(
        rts_attr(sq_psn=sq_psn, timeout=timeout, retry_cnt=retry_cnt, rnr_retry=rnr_retry, max_rd_atomic=max_rd_atomic)
    )


def connect_rc(
    ctx_a: v.Context,
    ctx_b: v.Context,
    *,
    qp_type: int = v.IBV_QPT_RC,
    access_a: int = ACCESS_ALL,
    access_b: int = ACCESS_ALL,
    psn_a: int = 0,
    psn_b: int = 0,
    endpoint_a: dict[str, Any] | None = None,
    endpoint_b: dict[str, Any] | None = None,
    **qp_opts: Any,
) -> tuple[Endpoint, Endpoint]:
    """Two endpoints (possibly on one HCA: ctx_a is ctx_b) connected to each other and in RTS.

    `psn_a` is A's first send PSN (= B's expected receive PSN) and `psn_b` the
    other way round; `qp_opts` go to `bring_up` for both sides.
    """
    a = make_endpoint(ctx_a, qp_type=qp_type, **(endpoint_a or {}))
    b = make_endpoint(ctx_b, qp_type=qp_type, **(endpoint_b or {}))
    bring_up(a.qp, b.qp.qp_num, b.lid, qp_access=access_a, sq_psn=psn_a, rq_psn=psn_b, **qp_opts)
    bring_up(b.qp, a.qp.qp_num, a.lid, qp_access=access_b, sq_psn=psn_b, rq_psn=psn_a, **qp_opts)
    return a, b


def connect_self(ctx: v.Context, **opts: Any) -> Endpoint:
    """One RC endpoint whose QP is connected to itself (a rank talking to itself)."""
    ep = make_endpoint(ctx, **opts)
    bring_up(ep.qp, ep.qp.qp_num, ep.lid)
    return ep


# ---------------------------------------------------------------- waiting
def wait_for(predicate: Callable[[], Any], timeout: float = WAIT, what: str = "condition") -> Any:
    """ckpt.testing.wait_for with this default timeout, polling every millisecond (in-process verbs are fast)."""
    return ckpt.testing.wait_for(predicate, timeout, what, interval=0.001)


def poll_until(cq: v.CQ, n: int = 1, timeout: float = WAIT) -> list[v.WC]:
    """Exactly the next `n` completions of `cq`, waiting at most `timeout` seconds for them."""
    got: list[v.WC] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        _, wcs = cq.poll(n - len(got))
        got.extend(wcs)
        if not wcs and time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s: {len(got)} of {n} completions: {got}")
    return got


def poll_one(cq: v.CQ, timeout: float = WAIT) -> v.WC:
    return poll_until(cq, 1, timeout)[0]


def assert_no_completion(cq: v.CQ, window: float = QUIET) -> None:
    """Nothing arrives on `cq` during `window` seconds (a negative check: the wait is the point)."""
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        n, wcs = cq.poll(1)
        assert n == 0, f"unexpected completion {wcs}"
        time.sleep(0.002)


def drain_events(ctx: v.Context) -> list[v.AsyncEvent]:
    """Throw away the asynchronous events queued so far (the HCA is shared by every test of the process)."""
    seen = []
    while True:
        try:
            seen.append(ctx.get_async_event(timeout=0))
        except v.PyverbsRDMAError:
            return seen


def wait_event(ctx: v.Context, event_type: int, element: Any = None, timeout: float = WAIT) -> v.AsyncEvent:
    """The next asynchronous event of `event_type` (about `element`, if given); others are skipped."""
    deadline = time.monotonic() + timeout
    skipped = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no {v.ibv_event_type(event_type).name} for {element!r} within {timeout}s; saw {skipped}")
        try:
            ev = ctx.get_async_event(timeout=left)
        except v.PyverbsRDMAError:
            continue
        if ev.event_type == event_type and (element is None or ev.element is element or ev.element == element):
            return ev
        skipped.append(ev)


def events_of(ctx: v.Context, event_type: int, element: Any, window: float = QUIET) -> list[v.AsyncEvent]:
    """Every event of `event_type` about `element` arriving within `window` seconds."""
    deadline = time.monotonic() + window
    found = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            ev = ctx.get_async_event(timeout=left)
        except v.PyverbsRDMAError:
            break
        if ev.event_type == event_type and ev.element is element:
            found.append(ev)
    return found


def qp_attr(qp: v.QP) -> v.QPAttr:
    return qp.query(v.IBV_QP_STATE)[0]


def wait_state(qp: v.QP, state: int, timeout: float = WAIT) -> None:
    wait_for(lambda: qp.qp_state == state, timeout, f"QP {qp.qp_num:#x} to reach {v.ibv_qp_state(state).name}")


# ---------------------------------------------------------------- work requests
def send_wr(
    sges: list[v.SGE],
    *,
    wr_id: int = 1,
    opcode: int = v.IBV_WR_SEND,
    flags: int = v.IBV_SEND_SIGNALED,
    imm: int = 0,
) -> v.SendWR:
    return v.SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(sges), sg=sges, imm_data=imm, send_flags=flags)


def rdma_wr(
    opcode: int,
    local: v.SGE,
    rkey: int,
    raddr: int,
    *,
    wr_id: int = 1,
    flags: int = v.IBV_SEND_SIGNALED,
    imm: int = 0,
) -> v.SendWR:
    wr = send_wr([local], wr_id=wr_id, opcode=opcode, flags=flags, imm=imm)
    wr.set_wr_rdma(rkey, raddr)
    return wr


def atomic_wr(
    opcode: int,
    local: v.SGE,
    rkey: int,
    raddr: int,
    compare_add: int,
    swap: int = 0,
    *,
    wr_id: int = 1,
    flags: int = v.IBV_SEND_SIGNALED,
) -> v.SendWR:
    wr = send_wr([local], wr_id=wr_id, opcode=opcode, flags=flags)
    wr.set_wr_atomic(rkey, raddr, compare_add, swap)
    return wr


def recv_wr(sges: list[v.SGE], wr_id: int = 1) -> v.RecvWR:
    return v.RecvWR(wr_id=wr_id, num_sge=len(sges), sg=sges)


def post_recv(ep: Endpoint, offset: int = 0, length: int = 4096, wr_id: int = 1) -> None:
    ep.qp.post_recv(recv_wr([ep.sge(offset, length)], wr_id))


# ---------------------------------------------------------------- fabric
def subnet_manager() -> fabric.SubnetManager:
    """The private subnet manager this process's HCAs registered with (skip if an external fabric is in use)."""
    import os

    if os.environ.get(fabric.ENV_ADDRESS):
        pytest.skip(f"${fabric.ENV_ADDRESS} is set: the HCAs use an external fabric")
    return fabric._private_fabric()


def wait_link(lid: int, up: bool, timeout: float = WAIT) -> None:
    """Every HCA of this process on the subnet manager has heard that the link of `lid` is up / down."""
    from ckpt.verbs.fabric import FabricClient

    def heard() -> bool:
        hcas = [hca for hca in list(_hca._hcas.values()) if isinstance(hca.sm, FabricClient)]
        return all(hca.link_up.get(lid, True) == up for hca in hcas)

    wait_for(heard, timeout, f"link of LID {lid} {'up' if up else 'down'} on every HCA")


def contexts(*names: str) -> Iterator[tuple[v.Context, ...]]:
    """Open contexts for a fixture; closing them at the end closes every object a test created."""
    ctxs = tuple(v.Context(name=n) for n in names)
    try:
        yield ctxs
    finally:
        for ctx in reversed(ctxs):
            ctx.close()


# ---------------------------------------------------------------- APM
def paths(ep: Endpoint) -> tuple[tuple[int, int], tuple[int, int], int]:
    """((port, dlid) primary, (port, dlid) alternate, path_mig_state), as the program's query_qp shows them."""
    attr = ep.qp.query(v.IBV_QP_PORT | v.IBV_QP_AV | v.IBV_QP_ALT_PATH | v.IBV_QP_PATH_MIG_STATE)[0]
    return (attr.port_num, attr.ah_attr.dlid), (attr.alt_port_num, attr.alt_ah_attr.dlid), int(attr.path_mig_state)


def exchange(a: Endpoint, b: Endpoint, tag: int) -> None:
    """A 4-byte SEND each way (landing at offset 8192), both completing successfully with the bytes sent."""
    for src, dst in ((a, b), (b, a)):
        post_recv(dst, offset=8192, length=64, wr_id=tag)
        src.buf[:4] = tag
        src.qp.post_send(send_wr([src.sge(0, 4)], wr_id=tag))
        assert poll_one(src.scq).status == v.IBV_WC_SUCCESS
        wc = poll_one(dst.rcq)
        assert (wc.wr_id, wc.status) == (tag, v.IBV_WC_SUCCESS)
        assert list(dst.buf[8192:8196]) == [tag] * 4
