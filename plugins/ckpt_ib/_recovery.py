"""Single-rank recovery: a rank respawned alone among live peers, and what its peers drop about it."""

# FT-KDSM (remote-logging-hlrc-dsm-via.txt §5), DESIGN §8: under
# `ckpt launch --on-failure recover` a failed rank R is respawned from its own
# latest image while the other ranks run on.  For the verbs plugin that is a
# restart of one process only, with two differences from a whole-job restart:
#
# * R's peers are not restarting: they never publish new real IDs for the QPs
#   R's image was connected to (those QPs, at the peers, failed when R died).
#   So R must not replay a connection to another rank.  Its QPs whose modify
#   history names a peer's QP are left in the ERROR state instead -- what
#   hardware shows after the peer died: every posted WR (the receives now, the
#   logged sends at RESUME) completes with WR_FLUSH_ERR, and their owner (the
#   DSM's network layer, or the program) replaces them with fresh QPs made
#   through the ordinary verbs API, which this plugin virtualizes like any QP
#   made after start.  QPs connected within R (loopback) are rebuilt as in a
#   restart.
#
# * R publishes its objects' real IDs again under the same virtual IDs, in the
#   same generation (`ib/<kind>/<virtual>` is overwritten), and the list of
#   those virtual IDs under a key scoped by its incarnation:
#
#       ib/rank/<rank>/<incarnation> -> {"qpn": [...], "lid": [...], "rkey": [...]}
#
#   A survivor's `ckpt_rank_recovered` (which fires after R's RESTART phase,
#   so after these publications) drops its cached translations of exactly
#   those IDs; its next look-up of R's LID or rkeys reads the new value.  A
#   look-up that raced with the drop is used once and not cached
#   (`Virtualizer.cache_epoch`), so no stale real ID outlives the hook.

from __future__ import annotations

import logging
from typing import Any

from ckpt import verbs as v
from ckpt.verbs import QPAttr
from ckpt_ib._shadows import ShadowQP
from ckpt_ib._virtual import NS, Virtualizer

log = logging.getLogger(__name__)


def ids_key(rank: int, incarnation: int) -> str:
    return f"rank/{rank}/{incarnation}"


def own_ids(vz: Virtualizer) -> dict[str, list[int]]:
    """The virtual IDs of this process's objects that peers look up: qp_nums, LIDs, rkeys."""
    reg = vz.registry
    return {
        "qpn": [qp.qp_num for qp in reg.qps],
        "lid": [vlid for dev in reg.devices for vlid in dev.vlids],
        "rkey": [mr.rkey for mr in reg.mrs],
    }


def publish_ids(vz: Virtualizer, rt: Any) -> None:
    """On the recovered rank, at RESTART: which virtual IDs its peers must look up again."""
    rt.kv.publish(NS, ids_key(rt.rank, rt.incarnation), own_ids(vz))


def forget_remote(vz: Virtualizer, ids: dict[str, list[int]] | None) -> int:
    """Drop cached translations of peers' virtual IDs (`ids` by kind: qpn, lid, rkey; None: all); how many."""
    vz.cache_epoch += 1  # first: a look-up in progress on another thread will not cache what it read
    caches: dict[str, dict[int, Any]] = {"qpn": vz.remote_qpn, "lid": vz.remote_lid, "rkey": vz.remote_key}
    dropped = 0
    for kind, cache in caches.items():
        if ids is None:
            dropped += len(cache)
            cache.clear()
            continue
        for virtual in ids.get(kind, ()):
            dropped += cache.pop(int(virtual), None) is not None
    return dropped


def forget_rank(vz: Virtualizer, rt: Any, rank: int, incarnation: int) -> int:
    """On a survivor: drop the cached translations of `rank`'s IDs (all of them if it did not say which)."""
    ids = rt.kv.get(NS, ids_key(rank, incarnation))
    dropped = forget_remote(vz, dict(ids) if ids is not None else None)
    log.debug("rank %d (incarnation %d) recovered: %d cached translation(s) dropped", rank, incarnation, dropped)
    return dropped


def connects_elsewhere(qp: ShadowQP, own: set[int]) -> bool:
    """Was `qp` connected to a QP of another rank (a destination that is none of this process's QPs)?"""
    return any(mask & v.IBV_QP_DEST_QPN and attr.dest_qp_num not in own for attr, mask in qp.modifies)


def leave_in_error(vz: Virtualizer, qp: ShadowQP) -> None:
    """Rebuild `qp` up to its connection (RESET -> INIT), then move it to ERROR, as its dead peer left it.

    Its history becomes what was applied, so a later restart rebuilds it in ERROR too; the
    caller re-posts its logged receives (and, at RESUME, sends), which complete as flushed.
    """
    applied = []
    for attr, mask in qp.modifies:
        if mask & v.IBV_QP_DEST_QPN:
            break
        vz.apply_modify(qp, attr, mask, record=False)
        applied.append((attr, mask))
    qp.modifies[:] = applied
    if qp.state == int(v.IBV_QPS_RESET):  # RESET -> ERR is no transition of the QP state machine
        return
    vz.apply_modify(qp, QPAttr(qp_state=v.IBV_QPS_ERR), int(v.IBV_QP_STATE), record=True)
