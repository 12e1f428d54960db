"""HLRC distributed shared memory over ckpt.verbs: ``mem = dsm.attach(rt)``, then shared arrays, locks, barriers.

    mem = dsm.attach(rt)                      # collective; protocol from --dsm-protocol / $CKPT_DSM_PROTOCOL
    grid = mem.array((512, 512), np.float64)  # collective: the same handle on every rank
    lock = mem.lock()                         # collective
    with grid.write((slice(lo, hi), slice(None))) as v:
        v[:] = ...
    mem.barrier()

See docs/dsm.md for the protocols and how to write a DSM program.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ckpt.plugin import lazy_exports

from ._errors import DsmError, ReplayDiverged

if TYPE_CHECKING:
    from ._array import Lock, SharedArray
    from ._diff import Diff
    from ._memory import Memory
    from ._replay import PageVersions, Replay
    from ._stats import Statistics

#: The protocols `attach` knows (``--dsm-protocol``): the two HLRC ones, and Cashmere.
PROTOCOLS = ("async", "onesided", "cashmere")
#: The home-based lazy release consistency protocols (twins, diffs, intervals, a protocol handler).
HLRC = ("async", "onesided")

# The rest is imported when first used: every rank and `ckpt launch` load the DSM's plugins (its
# hookspecs, remote logging's options), and most jobs never attach a shared memory.
if not TYPE_CHECKING:  # (type checkers see the imports above, and still catch a name that is not there)
    __getattr__ = lazy_exports(
        __name__,
        {
            "Lock": "._array",
            "SharedArray": "._array",
            "Diff": "._diff",
            "Memory": "._memory",
            "PageVersions": "._replay",
            "Replay": "._replay",
            "Statistics": "._stats",
        },
    )


__all__ = [
    "HLRC",
    "PROTOCOLS",
    "Diff",
    "DsmError",
    "Lock",
    "Memory",
    "PageVersions",
    "Replay",
    "ReplayDiverged",
    "SharedArray",
    "Statistics",
    "attach",
]

PROTOCOL_ENV = "CKPT_DSM_PROTOCOL"


def attach(rt: Any, protocol: str | None = None, page_size: int = 4096) -> Memory:
    """Collective: this rank's handle on a new shared memory of `rt`'s ranks.

    `protocol` is one of `PROTOCOLS`; by default ``ckpt launch --dsm-protocol``,
    else ``$CKPT_DSM_PROTOCOL``, else ``"async"``.  Under ``"cashmere"`` the handle
    is a `dsm._cashmere.Cashmere`, with the same API for programs.
    """
    chosen = protocol or (getattr(rt, "options", {}) or {}).get("dsm_protocol") or os.environ.get(PROTOCOL_ENV)
    if chosen == "cashmere":
        from ._cashmere import Cashmere

        return Cashmere(rt, page_size)  # type: ignore[return-value]  # the programs' API, not HLRC's internals
    from ._memory import Memory

    return Memory(rt, chosen or "async", page_size)
