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
    from ._api import SharedMemory
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
            "SharedMemory": "._api",
            "SharedArray": "._array",
            "Diff": "._diff",
            "Memory": "._memory",
            "PageVersions": "._replay",
            "Replay": "._replay",
            "Statistics": "._stats",
        },
    )


__all__ = [
    "FILLS",
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
    "SharedMemory",
    "Statistics",
    "attach",
]

PROTOCOL_ENV = "CKPT_DSM_PROTOCOL"
FILL_ENV = "CKPT_DSM_FILL"
#: How Cashmere's faults fill pages (``--dsm-fill``): copy the page, or bring the touched lines (`dsm._cashmere`).
FILLS = ("copy", "line")


def attach(
    rt: Any, protocol: str | None = None, page_size: int = 4096, fill: str | None = None, unsafe: int | None = None
) -> SharedMemory:
    """Collective: this rank's handle on a new shared memory of `rt`'s ranks.

    `protocol` is one of `PROTOCOLS`; by default ``ckpt launch --dsm-protocol``,
    else ``$CKPT_DSM_PROTOCOL``, else ``"async"``.  Under ``"cashmere"`` the handle
    is a `dsm._cashmere.Cashmere`, with the same API for programs, and `fill` is
    how its faults fill pages: ``"copy"`` (the default) or ``"line"`` (by default
    ``ckpt launch --dsm-fill``, else ``$CKPT_DSM_FILL``).  The HLRC protocols copy.
    `unsafe` (``--dsm-unsafe``; cashmere only) makes a page *unsafe* once one release
    would send notices to that many readers: its writers then send none, and its
    readers read its directory row at their acquires instead (0, the default: never).
    """
    options = getattr(rt, "options", {}) or {}
    chosen = protocol or options.get("dsm_protocol") or os.environ.get(PROTOCOL_ENV)
    filling = fill or options.get("dsm_fill") or os.environ.get(FILL_ENV)
    threshold = int(unsafe if unsafe is not None else options.get("dsm_unsafe") or 0)
    if chosen == "cashmere":
        from ._cashmere import Cashmere

        return Cashmere(rt, page_size, filling or "copy", threshold)
    if filling not in (None, "copy"):
        raise DsmError(f"the {filling!r} fill is the cashmere protocol's: {chosen or 'async'} copies whole pages")
    if threshold:
        raise DsmError(f"unsafe pages are the cashmere protocol's: {chosen or 'async'} has no write notice lists")
    from ._memory import Memory

    return Memory(rt, chosen or "async", page_size)
