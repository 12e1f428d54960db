"""ckpt_ib: transparent checkpoint, resume and restart of verbs programs (the DMTCP InfiniBand plugin's principles)."""

# The six principles of the DMTCP InfiniBand plugin (Cao, Kerr, Arya,
# Cooperman), and where each lives:
#
# 1. The program never holds a real object: shadows with virtual IDs
#    (_shadows.py).
# 2. Interpose on the provider's operations table (_virtual.py, installed by
#    ckpt_wrap_verbs once at start-up; the hot path never goes through pluggy).
# 3. Log posted WRs until they complete, and every modify-QP / modify-SRQ
#    (_shadows.py, _datapath.py).  Real WRs carry the plugin's own wr_id; an
#    unsignaled one leaves the log when a later one completes (RC completes
#    in order) or when DRAIN sees it landed at the peer, so the log is exact
#    without signaling what the program did not.
# 4. At DRAIN, drain every CQ into a private queue (_drain.py) -- and, beyond
#    the paper, keep draining until every message sent has landed or is known
#    not to have (PSN counts exchanged through the coordinator).  An
#    independent checkpoint of one rank only takes its CQs: its peers run on.
# 5. After resume or restart the program's polls are served from that queue
#    first (_datapath.py poll_cq).
# 6. What had not landed is re-posted after a restart -- exactly that, so
#    nothing is delivered twice and nothing is lost (_rebuild.py).
#
# Beyond the paper as well: addresses are virtual (a registered buffer may
# live elsewhere after a restart), virtual IDs come from the coordinator in
# every generation (they can never collide), and completion-channel events
# and armed notifications survive.
#
# Single-rank recovery (FT-KDSM, _recovery.py): a rank respawned alone
# rebuilds its objects but leaves its connections to other ranks in ERROR
# for their owner to replace; the survivors drop their cached translations of
# its IDs when it is back.  The plugin cannot replace a program's connections
# itself, so it refuses `--on-failure recover` unless another plugin (one that
# owns the connections, e.g. remote logging for the DSM) answers for it: its
# answer to ckpt_single_rank_recovery is a list that names "ib".
#
# The hooks are methods of `IbPlugin`, one per process (the module's hook
# functions call it); tests run one per thread-rank.

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import ckpt
from ckpt import verbs
from ckpt_ib._drain import collect, drain
from ckpt_ib._rebuild import rebuild, reconnect, repost_sends
from ckpt_ib._recovery import forget_rank, publish_ids
from ckpt_ib._virtual import Virtualizer

__all__ = ["IbPlugin", "drain", "rebuild", "reconnect", "repost_sends"]
__version__ = "0.1.0"
CKPT_PLUGIN_API = 2
#: When set, each rank writes the real IDs of each generation to <dir>/ib.<rank>.<generation>.json (for tests).
TRACE_ENV = "CKPT_IB_TRACE_DIR"
#: What `ckpt launch --on-failure recover` is told when no other plugin answers for the connections.
NO_SINGLE_RANK_RECOVERY = (
    "the verbs plugin alone cannot reconnect a program's queue pairs to a recovered rank "
    "(a DSM program needs ckpt_remotelog; a program without verbs may run with --disable-plugin ib)"
)

log = logging.getLogger(__name__)


class IbPlugin:
    """The plugin's rank-side hooks over one process's `Virtualizer`."""

    def __init__(self) -> None:
        self.vz: Virtualizer | None = None
        self.restarted = False  # between RESTART and RESUME of a restart with an image of ours

    def virtualizer(self, rt: Any) -> Virtualizer:
        if self.vz is None:
            self.vz = Virtualizer(rt)
        return self.vz

    @ckpt.hookimpl
    def ckpt_init(self, rt: ckpt.Runtime) -> None:
        self.virtualizer(rt)

    @ckpt.hookimpl
    def ckpt_wrap_verbs(self, rt: ckpt.Runtime, ops: verbs.VerbsOps) -> None:
        vz = self.virtualizer(rt)
        if vz.inner is not None:
            log.warning("ckpt_ib virtualizes one provider per process; %s is left as it is", ops.provider)
            return
        vz.install(ops)

    @ckpt.hookimpl
    def ckpt_drain(self, rt: ckpt.Runtime, independent: bool) -> None:
        vz = self.virtualizer(rt)
        if vz.inner is None:
            return
        if independent:
            # The peers keep running: nothing to agree on with them.  Take what has completed into the
            # private queues and keep the send logs whole (nothing is forgotten as landed): the image
            # is this rank's alone, for its single-rank recovery, where its peers rebuild their QPs to
            # it; a later coordinated checkpoint drains exactly, from this state, as ever.
            found = collect(vz)
            log.debug("independent checkpoint: %d completion(s) and event(s) taken, send logs kept", found)
            return
        rounds = drain(vz, rt)
        log.debug("verbs drained in %d round(s)", rounds)

    @ckpt.hookimpl
    def ckpt_precheckpoint(self, rt: ckpt.Runtime, image: Any) -> None:
        image.add("ib", self.virtualizer(rt).registry)

    @ckpt.hookimpl
    def ckpt_restart(self, rt: ckpt.Runtime, image: Any) -> None:
        registry = image.get("ib")
        vz = self.virtualizer(rt)
        if registry is not None and vz.inner is not None:
            vz.registry = registry
            rebuild(vz)
            if getattr(rt, "recovered", False):
                publish_ids(vz, rt)
            self.restarted = True

    @ckpt.hookimpl
    def ckpt_refresh(self, rt: ckpt.Runtime) -> None:
        if self.restarted and self.vz is not None:
            reconnect(self.vz, recovered=bool(getattr(rt, "recovered", False)))

    @ckpt.hookimpl
    def ckpt_resume(self, rt: ckpt.Runtime, restarted: bool, aborted: bool) -> None:
        vz = self.virtualizer(rt)
        if restarted and self.restarted:
            self.restarted = False
            reposted = repost_sends(vz)
            log.debug("restart: %d send WR(s) that had not landed re-posted", reposted)
        _trace(rt, vz)

    @ckpt.hookimpl
    def ckpt_rank_recovered(self, rt: ckpt.Runtime, rank: int, incarnation: int) -> None:
        vz = self.virtualizer(rt)
        if vz.inner is not None:
            forget_rank(vz, rt, rank, incarnation)

    @ckpt.hookimpl
    def ckpt_exit(self, rt: ckpt.Runtime) -> None:
        _trace(rt, self.virtualizer(rt))


_plugin = IbPlugin()


# The module is the plugin the entry point names: its hooks are the process's IbPlugin's.
@ckpt.hookimpl
def ckpt_single_rank_recovery(job: Any) -> str:
    """A rank recovered alone gets new queue pairs, and this plugin cannot reconnect a program's own QPs
    to them: the program made them, only it (or a layer above that owns them) knows to whom and how.
    A plugin that owns the connections overrides this refusal by answering a list that names "ib"."""
    return NO_SINGLE_RANK_RECOVERY


@ckpt.hookimpl
def ckpt_init(rt: ckpt.Runtime) -> None:
    _plugin.ckpt_init(rt)


@ckpt.hookimpl
def ckpt_wrap_verbs(rt: ckpt.Runtime, ops: verbs.VerbsOps) -> None:
    _plugin.ckpt_wrap_verbs(rt, ops)


@ckpt.hookimpl
def ckpt_drain(rt: ckpt.Runtime, independent: bool) -> None:
    _plugin.ckpt_drain(rt, independent)


@ckpt.hookimpl
def ckpt_precheckpoint(rt: ckpt.Runtime, image: Any) -> None:
    _plugin.ckpt_precheckpoint(rt, image)


@ckpt.hookimpl
def ckpt_restart(rt: ckpt.Runtime, image: Any) -> None:
    _plugin.ckpt_restart(rt, image)


@ckpt.hookimpl
def ckpt_refresh(rt: ckpt.Runtime) -> None:
    _plugin.ckpt_refresh(rt)


@ckpt.hookimpl
def ckpt_resume(rt: ckpt.Runtime, restarted: bool, aborted: bool) -> None:
    _plugin.ckpt_resume(rt, restarted, aborted)


@ckpt.hookimpl
def ckpt_rank_recovered(rt: ckpt.Runtime, rank: int, incarnation: int) -> None:
    _plugin.ckpt_rank_recovered(rt, rank, incarnation)


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    _plugin.ckpt_exit(rt)


def _trace(rt: ckpt.Runtime, vz: Virtualizer) -> None:
    """The real IDs (and the provider) of this generation, for tests: $CKPT_IB_TRACE_DIR/ib.<rank>.<gen>.json."""
    directory = os.environ.get(TRACE_ENV)
    if not directory or vz.inner is None:
        return
    reg = vz.registry
    ids = {
        "qp_num": [int(qp.real.qp_num) for qp in reg.qps if qp.real is not None],
        "lkey": [int(mr.real.lkey) for mr in reg.mrs if mr.real is not None],
        "rkey": [int(mr.real.rkey) for mr in reg.mrs if mr.real is not None],
        "lid": [int(vz.inner.query_port(dev.real, p).lid) for dev in reg.devices for p in (1, 2)],
        "virtual_qp_num": [qp.qp_num for qp in reg.qps],
        "provider": vz.provider,
    }
    path = Path(directory, f"ib.{rt.rank}.{rt.generation}.json")
    path.write_text(json.dumps(ids))
