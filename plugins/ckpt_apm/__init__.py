"""ckpt_apm: automatic path migration for every RC queue pair, with no change to the program.

    ckpt launch -n 4 --apm auto examples/ring.py       # or --apm balance; --apm off (the default) loads nothing

After Vishnu, Mamidala, Narravula and Panda, "Automatic Path Migration over InfiniBand: Early
Experiences": the alternate path specification, path loading and path migration modules and an
asynchronous event thread (`_apm.py`), interposed on the verbs operations table above ckpt_ib, so
every QP a program brings to RTS gets an alternate path through the other port pair, is re-armed
after each migration, and is rebuilt on the path it is on by a restart.  See docs/apm.md.
"""

from __future__ import annotations

import logging
from typing import Any

import ckpt
from ckpt import verbs
from ckpt.plugin import STATS_NS

from ._apm import Apm, Statistics

__all__ = ["POLICIES", "Apm", "Statistics", "statistics"]
__version__ = "0.1.0"
CKPT_PLUGIN_API = 2
#: Above ckpt_ib (100): its wrappers see the program's shadow objects, and its modifies go into their histories.
CKPT_PLUGIN_ORDER = 200
POLICIES = ("off", "auto", "balance")
BALANCE_INTERVAL = 2.0

log = logging.getLogger(__name__)
_apm: Apm | None = None  # this process's, once its verbs table is wrapped
_restored: dict[str, Any] | None = None  # the image's state, between RESTART and RESUME


@ckpt.hookimpl
def ckpt_add_options() -> list[dict[str, Any]]:
    return [
        {
            "name": "apm",
            "help": "automatic path migration for RC queue pairs: auto, balance or off (default off)",
            "default": "off",
            "type": "str",
            "choices": list(POLICIES),
        },
        {
            "name": "apm-interval",
            "help": f"seconds between the migrations of --apm balance (default {BALANCE_INTERVAL})",
            "default": BALANCE_INTERVAL,
            "type": "float",
        },
    ]


def _policy(rt: Any) -> str:
    options = getattr(rt, "options", {}) or {}
    return str(options.get("apm") or "off")


@ckpt.hookimpl
def ckpt_wrap_verbs(rt: ckpt.Runtime, ops: verbs.VerbsOps) -> None:
    global _apm
    policy = _policy(rt)
    if policy == "off":
        return
    options = getattr(rt, "options", {}) or {}
    kv, rank = getattr(rt, "kv", None), rt.rank

    def publish(stats: dict[str, Any]) -> None:
        if kv is not None:
            kv.publish(STATS_NS, f"{rank}/apm", stats)

    _apm = Apm(policy, float(options.get("apm_interval") or BALANCE_INTERVAL), publish)
    _apm.install(ops)
    log.debug("rank %d: APM %s on the %s provider", rank, policy, ops.provider)


@ckpt.hookimpl
def ckpt_drain(rt: ckpt.Runtime, independent: bool) -> None:
    if _apm is not None:
        _apm.pause()


@ckpt.hookimpl
def ckpt_precheckpoint(rt: ckpt.Runtime, image: Any, independent: bool) -> None:
    if _apm is not None:
        image.add("apm", _apm.__getstate__())


@ckpt.hookimpl
def ckpt_restart(rt: ckpt.Runtime, image: Any) -> None:
    global _restored
    _restored = image.get("apm")


@ckpt.hookimpl
def ckpt_resume(rt: ckpt.Runtime, restarted: bool, aborted: bool, independent: bool) -> None:
    global _restored
    if _apm is None:
        return
    _apm.resume()
    if restarted and _restored is not None:
        state, _restored = _restored, None
        _apm.restored(state)


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    if _apm is not None:
        _apm.stop()


def statistics() -> Statistics:
    """This process's APM counters (all zero with --apm off)."""
    return _apm.stats if _apm is not None else Statistics()
