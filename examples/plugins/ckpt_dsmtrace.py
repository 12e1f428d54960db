"""ckpt_dsmtrace: what the DSM's coherence protocol did on each rank -- diffs, notices, locks, barriers.

An example of a plugin implementing *DSM hooks* (docs/plugins.md walks through it).  The hooks
come from ``dsm.hookspecs``, which the ``dsm`` plugin brings (``CKPT_HOOKSPECS``), so this plugin
validates at load time like any other; it needs no change to the program::

    export PYTHONPATH=examples/plugins
    CKPT_DSMTRACE_FILE='trace-{rank}.json' ckpt launch -n 4 --with-plugin ckpt_dsmtrace dsm/programs/tsp.py

How it works:

* ``dsm_diff_created`` / ``dsm_diff_sent`` count the diffs this rank sends to page homes and
  their bytes; ``dsm_write_notices_received`` counts the notices it learns (at lock grants
  and barriers); ``dsm_lock_acquired`` adds up the time spent waiting for locks;
  ``dsm_barrier_passed`` counts barriers.  All run on the program thread.
* ``dsm_page_served`` runs on the protocol-handler thread (under ``onesided`` only for the
  pages a lock grant carries: the home's CPU serves no page request), hence the lock.  A DSM
  hook must not block and must not call back into the DSM.
* The totals are plain data, kept in the image (``ckpt_precheckpoint`` / ``ckpt_restart``), so
  they survive a restart; ``ckpt_exit`` writes them as JSON to ``$CKPT_DSMTRACE_FILE``
  (``{rank}`` replaced by the rank).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ckpt

if TYPE_CHECKING:
    from ckpt.plugin import ImageContents
    from dsm import Diff

CKPT_PLUGIN_API = 2
CKPT_PLUGIN_NAME = "dsmtrace"
CKPT_PLUGIN_ORDER = 500  # above the dsm plugin, whose hookspecs it implements
__version__ = "1.0"

ENV_FILE = "CKPT_DSMTRACE_FILE"
IMAGE_KEY = "dsmtrace"
FIELDS = ("diffs", "diff_bytes", "notices", "lock_acquires", "lock_wait_s", "barriers", "pages_served")

_totals: dict[str, float] = dict.fromkeys(FIELDS, 0)
_lock = threading.Lock()  # dsm_page_served runs on the handler thread


def _add(field: str, amount: float = 1) -> None:
    with _lock:
        _totals[field] += amount


@ckpt.hookimpl
def dsm_diff_created(diff: Diff) -> None:
    _add("diffs")


@ckpt.hookimpl
def dsm_diff_sent(nbytes: int) -> None:
    _add("diff_bytes", nbytes)


@ckpt.hookimpl
def dsm_write_notices_received(notices: list[Any]) -> None:
    _add("notices", len(notices))


@ckpt.hookimpl
def dsm_lock_acquired(seconds: float) -> None:
    _add("lock_acquires")
    _add("lock_wait_s", seconds)


@ckpt.hookimpl
def dsm_barrier_passed(epoch: int) -> None:
    _add("barriers")


@ckpt.hookimpl
def dsm_page_served(requester: int, gid: int) -> None:
    _add("pages_served")


@ckpt.hookimpl
def ckpt_precheckpoint(image: ImageContents) -> None:
    with _lock:
        image.add(IMAGE_KEY, dict(_totals))


@ckpt.hookimpl
def ckpt_restart(image: ImageContents) -> None:
    with _lock:
        _totals.update(image.get(IMAGE_KEY, {}))


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    pattern = os.environ.get(ENV_FILE)
    if pattern:
        with _lock:
            summary = {"generation": rt.generation, **_totals}
        Path(pattern.replace("{rank}", str(rt.rank))).write_text(json.dumps(summary))
