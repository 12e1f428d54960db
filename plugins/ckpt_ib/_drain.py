"""DRAIN: empty the network exactly, by counting PSNs with the peers, before the image is written."""

# Principles 4 and 6, made exact.  When DRAIN starts every program thread is
# parked, so nothing new is posted, but the NICs keep working: sends land,
# ACKs and READ/atomic responses come back, completions pile up.  Each round:
#
# 1. every CQ is polled into its shadow's private queue (principle 4) and
#    every completion-channel event is taken into the channel's shadow;
# 2. each rank publishes, per QP, the head of its send log -- each WR's
#    first PSN and packet count (computed the way the wire assigns PSNs),
#    whether it needs a receive and whether its real WR is signaled, up to
#    the first signaled one -- and, as a responder, its rq_psn and how many
#    receives it still has posted; one coordinator barrier gathers them all;
# 3. a QP is settled when every WR in its log has either landed unsignaled
#    (the peer's rq_psn is past its last PSN: nothing will ever complete it,
#    so it leaves the log here) or is blocked: it needs a receive, the peer
#    has none left, and the peer's rq_psn is exactly its PSN (it never landed,
#    and nothing after it can land before the program runs again).  A
#    signaled WR that landed is waited for: its ACK is on the way, and the
#    completion goes to the private queue.
#
# Every rank evaluates the same predicate on the same gathered states, so all
# leave the loop in the same round.  A log that is not empty must also be
# seen unchanged in two consecutive rounds.  What is still in a send log after
# the drain did not land -- exactly that is re-posted after a restart, and
# nothing else: no duplicate, no gap.

from __future__ import annotations

import itertools
import time
from typing import Any

from ckpt import verbs as v
from ckpt_ib._datapath import PSN_MASK
from ckpt_ib._shadows import ShadowQP
from ckpt_ib._virtual import Virtualizer

#: How long a round waits for progress before gathering again (seconds).
ROUND_WAIT = 0.005
_ACTIVE = (int(v.IBV_QPS_RTR), int(v.IBV_QPS_RTS), int(v.IBV_QPS_SQD))


def drain(vz: Virtualizer, rt: Any) -> int:
    """Drain until every QP of the job is settled; returns the number of rounds."""
    previous: dict[str, Any] | None = None
    for round_no in itertools.count():
        collect(vz)
        mine = {str(qp.qp_num): _state(vz, qp) for qp in vz.registry.qps}
        gathered: dict[str, Any] = {}
        for part in rt.coordinator_barrier(f"ib-drain-{round_no}", mine):
            gathered.update(part)
        pending = [s for s in gathered.values() if s["pending"]]
        if all(_settled(s, gathered) for s in pending) and (not pending or gathered == previous):
            # Every acknowledged message's receive completion exists by now (a responder queues it
            # before it ACKs), but may have appeared after this rank's last poll: collect once more.
            collect(vz)
            for qp in vz.registry.qps:
                _forget_landed(qp, gathered.get(str(qp.dest_qp_num)))
            return round_no + 1
        previous = gathered
        _wait_for_progress(vz)
    raise AssertionError("unreachable")


def collect(vz: Virtualizer) -> int:
    """Poll every real CQ into the shadows' private queues and take pending channel events; how many.

    Also follows every QP's migrations (`Virtualizer.track_path`): the image records its real path.
    """
    vz.track_paths()
    found = 0
    for cq in vz.registry.cqs:
        while True:
            wcs = vz.inner.poll_cq(cq.real, 64)
            for wc in wcs:
                seen = vz.translate(wc)
                if seen is not None:
                    cq.private.append(seen)
            found += len(wcs)
            if len(wcs) < 64:
                break
    for ch in vz.registry.channels:
        while (event := vz.take_cq_event(ch, 0)) is not None:
            ch.pending.append(event)
            found += 1
    return found


def _state(vz: Virtualizer, qp: ShadowQP) -> dict[str, Any]:
    head: list[list[Any]] = []
    for entry in qp.sends:
        head.append([entry.psn, entry.npkts, entry.needs_recv, entry.real_signaled])
        if entry.real_signaled:
            break
    srq = qp.init.srq
    rq_psn = None
    if qp.state in _ACTIVE and qp.real is not None:
        rq_psn = int(vz.inner.query_qp(qp.real, v.IBV_QP_RQ_PSN)[0].rq_psn)
    return {
        "dest": str(qp.dest_qp_num),
        "pending": len(qp.sends),
        "head": head,
        "rq_psn": rq_psn,
        "avail": len(srq.recvs) if srq is not None else len(qp.recvs),
    }


def _landed(psn: int, npkts: int, peer: dict[str, Any] | None) -> bool:
    """Whether the peer's rq_psn is past all of a WR's packets (PSNs compare modulo 2^24)."""
    if peer is None or peer["rq_psn"] is None:
        return False
    ahead = (int(peer["rq_psn"]) - psn) & PSN_MASK
    return npkts <= ahead < 1 << 23


def _settled(state: dict[str, Any], gathered: dict[str, Any]) -> bool:
    """Every WR in the log has landed unsignaled, or the first one that has not is blocked (RNR)."""
    peer = gathered.get(state["dest"])
    for psn, npkts, needs_recv, signaled in state["head"]:
        if _landed(psn, npkts, peer):
            if signaled:
                return False  # its completion is on the way
            continue
        return bool(peer is not None and needs_recv and peer["avail"] == 0 and peer["rq_psn"] == psn)
    return bool(len(state["head"]) == state["pending"])


def _forget_landed(qp: ShadowQP, peer: dict[str, Any] | None) -> None:
    """Drop the unsignaled WRs that landed from the log: no completion will ever retire them."""
    sends = qp.sends
    while sends and not sends[0].real_signaled and _landed(sends[0].psn, sends[0].npkts, peer):
        sends.popleft()


def _wait_for_progress(vz: Virtualizer) -> None:
    deadline = time.monotonic() + ROUND_WAIT
    while time.monotonic() < deadline:
        if collect(vz):
            return
