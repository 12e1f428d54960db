"""RESTART and REFRESH: real objects again, in dependency order, with the peers' new IDs; the log re-posted."""

# A restarted process has none of the real resources its shadows stood for,
# and its HCA hands out new qp_nums, keys and LIDs (the fabric is new too).
#
# * RESTART (`rebuild`): create every real object in dependency order --
#   device, PD, MR (the same program buffer, now at another address), channel,
#   CQ (re-armed if the program had armed it), SRQ (limit re-armed), QP, AH --
#   and publish the new real IDs under the old virtual ones.
# * REFRESH (`reconnect`), after every rank has published: replay each QP's
#   modify history with the peers' new qp_nums and LIDs (RESET -> INIT -> RTR
#   -> RTS, and anything after), so both ends of a connection start again from
#   the PSNs they were set up with; re-post the receives that had not
#   completed.  The history is replayed on the paths the QP was really on
#   (`replayed`): migrations are not replayed but already in them.  A rank
#   recovered alone (`recovered`) replays only its connections within itself
#   and leaves the others in ERROR (_recovery.py).
# * RESUME (`repost_sends`), after every rank has its receives posted again:
#   re-post the send WRs that had not landed at DRAIN -- exactly those.

from __future__ import annotations

from typing import Any

from ckpt import verbs as v
from ckpt.verbs import SGE, SrqAttr
from ckpt_ib._recovery import connects_elsewhere, leave_in_error
from ckpt_ib._shadows import SendEntry, ShadowQP
from ckpt_ib._virtual import Virtualizer, copy_ah, copy_attr


def rebuild(vz: Virtualizer) -> None:
    vz.reset_translations()
    reg = vz.registry
    for dev in reg.devices:
        vz.attach_device(dev)
    for pd in reg.pds:
        pd.real = vz.inner.alloc_pd(pd.device.real)
    for mr in reg.mrs:
        vz.attach_mr(mr)
    for ch in reg.channels:
        ch.real = vz.inner.create_comp_channel(ch.device.real)
    for cq in reg.cqs:
        vz.attach_cq(cq)
        if cq.armed:
            vz.inner.req_notify_cq(cq.real, cq.armed == 2)
    for srq in reg.srqs:
        vz.attach_srq(srq)
        if srq.limit:
            vz.inner.modify_srq(srq.real, SrqAttr(srq_limit=srq.limit), v.IBV_SRQ_LIMIT)
    for qp in reg.qps:
        vz.attach_qp(qp)
    for ah in reg.ahs:
        ah.real = vz.inner.create_ah(ah.pd.real, ah.attr)


def reconnect(vz: Virtualizer, recovered: bool = False) -> None:
    """Replay every QP's modify history and re-post its receives; `recovered`: only QPs within this rank."""
    own = {qp.qp_num for qp in vz.registry.qps}
    for qp in vz.registry.qps:
        if recovered and connects_elsewhere(qp, own):
            leave_in_error(vz, qp)
        else:
            for attr, mask in replayed(qp):
                vz.apply_modify(qp, attr, mask, record=False)
        if qp.recvs and qp.state != int(v.IBV_QPS_RESET):
            vz.inner.post_recv(qp.real, vz.real_recv_chain(list(qp.recvs.values())))
    for srq in vz.registry.srqs:
        if srq.recvs:
            vz.inner.post_srq_recv(srq.real, vz.real_recv_chain(list(srq.recvs.values())))


_ARMING = (int(v.IBV_MIG_REARM), int(v.IBV_MIG_ARMED))
_REARMABLE = (int(v.IBV_QPS_RTS), int(v.IBV_QPS_SQD))


def replayed(qp: ShadowQP) -> list[tuple[v.QPAttr, int]]:
    """`qp`'s modify history as a restart replays it: on the paths the QP was on at the checkpoint.

    Automatic and manual migrations swapped its primary and alternate paths (the shadow follows them,
    `Virtualizer.track_path`), so every step that set a path sets the one the QP is on now: the primary
    path (AV, port, timeout, pkey) where it set the primary, the alternate where it loaded one.  Path
    migration states are never replayed: REARM turns ARMED only a moment later, so a replayed REARM
    then MIGRATED would be refused (EINVAL) -- and the migration is in the paths already.  Instead,
    an alternate path that was ARMED (or being armed) is re-armed once the QP is back in RTS; one that
    was not stays loaded but unarmed, as the program left it.
    """
    steps: list[tuple[v.QPAttr, int]] = []
    state = int(v.IBV_QPS_RESET)
    for attr, mask in qp.modifies:
        step, kept = _on_current_paths(qp, attr, mask & ~v.IBV_QP_PATH_MIG_STATE)
        target = int(step.qp_state) if kept & v.IBV_QP_STATE else state
        if not kept or (kept == v.IBV_QP_STATE and target == state):
            continue  # only a migration state change (RTS -> RTS): nothing left to replay
        steps.append((step, kept))
        state = target
    if qp.mig_state in _ARMING and qp.alt_ah.dlid and state in _REARMABLE:
        arm = v.QPAttr(qp_state=state, path_mig_state=v.IBV_MIG_REARM)
        arm, mask = _on_current_paths(qp, arm, v.IBV_QP_STATE | v.IBV_QP_ALT_PATH | v.IBV_QP_PATH_MIG_STATE)
        steps.append((arm, mask))
    return steps


def _on_current_paths(qp: ShadowQP, attr: v.QPAttr, mask: int) -> tuple[v.QPAttr, int]:
    step = copy_attr(attr)
    if mask & v.IBV_QP_AV:
        step.ah_attr = copy_ah(qp.ah)
    if mask & v.IBV_QP_PORT and qp.port_num:
        step.port_num = qp.port_num
    if mask & v.IBV_QP_TIMEOUT and qp.timeout:
        step.timeout = qp.timeout
    if mask & v.IBV_QP_PKEY_INDEX:
        step.pkey_index = qp.pkey_index
    if mask & v.IBV_QP_ALT_PATH:
        step.alt_ah_attr = copy_ah(qp.alt_ah)
        step.alt_port_num, step.alt_timeout, step.alt_pkey_index = qp.alt_port_num, qp.alt_timeout, qp.alt_pkey_index
    return step, mask


def repost_sends(vz: Virtualizer) -> int:
    """Re-post every send WR still in a log; how many."""
    count = 0
    for qp in vz.registry.qps:
        pending = list(qp.sends)
        if not pending:
            continue
        qp.sends.clear()
        staged = _Scratch(vz, qp, pending) if any(e.inline is not None for e in pending) else None
        if staged is not None:
            vz.scratch[id(qp)] = staged
        try:
            vz.post_entries(qp, pending)
        finally:
            if staged is not None:
                del vz.scratch[id(qp)]
                staged.close()  # inline data is copied when posted
        count += len(pending)
    return count


class _Scratch:
    """Registered staging memory for re-posting inline WRs: their bytes as they were when first posted."""

    def __init__(self, vz: Virtualizer, qp: ShadowQP, entries: list[SendEntry]) -> None:
        self.vz = vz
        self.buf = bytearray(max(1, sum(len(e.inline or b"") for e in entries)))
        self.mr: Any = vz.inner.reg_mr(qp.pd.real, self.buf, v.IBV_ACCESS_LOCAL_WRITE)
        self.offset = 0

    def stage(self, data: bytes) -> SGE:
        start = self.offset
        self.buf[start : start + len(data)] = data
        self.offset += len(data)
        return SGE(int(self.mr.addr) + start, len(data), int(self.mr.lkey))

    def close(self) -> None:
        self.vz.inner.dereg_mr(self.mr)
