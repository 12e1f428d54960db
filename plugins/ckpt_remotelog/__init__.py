"""ckpt_remotelog: remote logging (FT-KDSM) and the stable-logging baseline for the DSM -- failure-free part.

``ckpt launch --logging remote prog.py``: every rank's diffs and write notices are
logged by RDMA into a neighbour's memory (its *log home*, ``--log-home-offset``) and
each home keeps a diff log of its pages; ``--logging stable`` fsyncs them to a local
file at every release and barrier instead; ``off`` (the default) costs nothing: no DSM
hook of this plugin but ``dsm_attached`` is implemented unless logging is on.  The
plugin answers ``ckpt_single_rank_recovery`` for the DSM and the verbs plugin beneath
it; under ``remote`` it serves minimal page versions (``memory.versions``) and, on a
recovered rank (``dsm_recovering``), rebuilds its home pages from its log home and
hands the DSM the replay of its log (`_recover`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ckpt
from ckpt.plugin import JobInfo, lazy_exports
from dsm import hookspecs

from ._ring import MIN_CAPACITY, own_home_refusal

if TYPE_CHECKING:
    from ._remote import RemoteLog
    from ._stable import StableLog

__all__ = ["CKPT_HOOKSPECS", "MIN_CAPACITY", "MODES", "RemoteLog", "StableLog"]
# The logs themselves (and the DSM they need) are imported when a memory attaches with logging on: every
# rank and `ckpt launch` load this plugin, and most jobs log nothing.
if not TYPE_CHECKING:  # (type checkers see the imports above)
    __getattr__ = lazy_exports(__name__, {"RemoteLog": "._remote", "StableLog": "._stable"})


__version__ = "0.1.0"
CKPT_PLUGIN_API = 2
CKPT_HOOKSPECS = hookspecs
MODES = ("remote", "stable", "off")
RING_BYTES = 4 << 20  # per logged rank: its log ring and its own ring (a home diff log: twice)
EXTENSION = "remotelog"


@ckpt.hookimpl
def ckpt_add_options() -> list[dict[str, Any]]:
    return [
        {
            "name": "logging",
            "help": "log DSM diffs and write notices for single-rank recovery: remote, stable or off (default off)",
            "default": "off",
            "type": "str",
            "choices": list(MODES),
            "launch_only": True,  # the logs' state is in the images
        },
        {
            "name": "log-home-offset",
            "help": "rank R's log home is (R + N) mod size (default 1)",
            "default": 1,
            "type": "int",
            "launch_only": True,
        },
        {
            "name": "log-ring-bytes",
            "help": f"bytes of each log ring, per logged rank (default {RING_BYTES}, at least {MIN_CAPACITY}, "
            "rounded up to a multiple of 8; a home diff log: twice that)",
            "default": RING_BYTES,
            "type": "int",
            "launch_only": True,
        },
        {
            "name": "log-dir",
            "help": "directory of the stable log files (default: the checkpoint directory)",
            "default": None,
            "type": "str",
        },
    ]


@ckpt.hookimpl
def ckpt_job_start(job: JobInfo) -> None:
    """Refuse, before anything starts and in one line, the options every rank would refuse at attach."""
    options = job.options
    refused = protocol_refusal(options)
    if refused is not None:
        raise ckpt.CkptError(refused)
    if (options.get("logging") or "off") != "remote":
        return None
    ring = options.get("log_ring_bytes")
    if ring is not None and int(ring) < MIN_CAPACITY:
        raise ckpt.CkptError(f"--log-ring-bytes {ring}: a log ring needs at least {MIN_CAPACITY} bytes")
    refused = own_home_refusal(int(options.get("log_home_offset", 1)), job.size)
    if refused is not None:
        raise ckpt.CkptError(refused)
    return None


def protocol_refusal(options: dict[str, Any]) -> str | None:
    """Why these options cannot run, if logging is on under a protocol that has no intervals to log (cashmere)."""
    mode, protocol = options.get("logging") or "off", options.get("dsm_protocol") or "async"
    if mode != "off" and protocol == "cashmere":
        return (
            f"--logging {mode} logs HLRC's intervals and diffs: use --dsm-protocol async or onesided "
            "(cashmere writes through and has none)"
        )
    return None


#: What remote logging answers for: the DSM's state across ranks, and the queue pairs the DSM reconnects
#: through the verbs plugin (``ckpt_ib`` refuses alone: a plain verbs program cannot be replayed).
RECOVERS = ["ib", "dsm"]
#: Stable logging keeps the logs on the rank's own disk: nothing replays them yet.
NO_STABLE_REPLAY = (
    "stable logging keeps each rank's logs on its own disk, but recovery replays remote logs only: "
    "use --logging remote with --on-failure recover"
)


@ckpt.hookimpl
def ckpt_single_rank_recovery(job: JobInfo) -> str | list[str] | None:
    """With logging off this plugin keeps nothing across ranks: no answer.  With remote logging it recovers
    a DSM rank by replay and answers for the DSM and its connections; stable logging is refused."""
    mode = job.options.get("logging") or "off"
    if mode == "off":
        return None
    return RECOVERS if mode == "remote" else NO_STABLE_REPLAY


@ckpt.hookimpl
def dsm_attached(memory: Any) -> None:
    options = getattr(memory.rt, "options", {}) or {}
    mode = options.get("logging") or "off"
    if mode in ("remote", "stable"):
        # remote: a rank's logs say an interval is complete only once its diffs are at their homes (a recovery
        # does not send them again), so its release must not overtake them; stable, which nothing replays, runs
        # the same protocol so that the two are compared on logging alone (FT-KDSM's Figure 4)
        memory.release_after_diffs = True
    if mode == "remote":
        from ._remote import RemoteLog

        ring = int(options.get("log_ring_bytes") or RING_BYTES)
        memory.extensions[EXTENSION] = RemoteLog(memory, int(options.get("log_home_offset", 1)), ring)
    elif mode == "stable":
        from ._stable import StableLog

        directory = options.get("log_dir") or getattr(memory.rt, "ckpt_dir", "") or "."
        memory.extensions[EXTENSION] = StableLog(memory, str(directory))
