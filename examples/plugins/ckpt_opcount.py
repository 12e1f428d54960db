"""ckpt_opcount: count every verbs call a rank makes, by operation, across checkpoints and restarts.

An example of a *verbs wrapper* plugin (docs/plugins.md walks through it).  Load it by module
name, on launch and again on restart, with the module on ``PYTHONPATH``::

    export PYTHONPATH=examples/plugins
    CKPT_OPCOUNT_FILE='ops-{rank}.json' ckpt launch -n 2 --with-plugin ckpt_opcount examples/ring.py 2000

How it works:

* ``ckpt_wrap_verbs`` runs once per provider table, when the table is first built: it replaces
  each entry of the table with a counting closure that calls the previous entry.  Every
  ``Context`` dispatches through the wrapped table, so the hot path (``post_send``,
  ``poll_cq``) is one extra Python call and never goes through pluggy.
* Its ``CKPT_PLUGIN_ORDER`` is high, so it registers after ``ckpt_ib`` and its wrappers sit
  *outside* the virtualization: it counts the calls the program makes, with the program's
  (virtual) handles, not the ones ``ckpt_ib`` makes while draining or rebuilding.
* The counts go into the image (``ckpt_precheckpoint``) and come back at ``ckpt_restart``, so
  a restarted rank keeps counting from where its checkpoint was; calls made after that
  checkpoint and before the kill are lost with the process, as the program's own work is.
* ``ckpt_exit`` writes ``{"generation": G, "ops": {name: count}}`` as JSON to
  ``$CKPT_OPCOUNT_FILE`` (``{rank}`` replaced by the rank).
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ckpt

if TYPE_CHECKING:
    from ckpt.plugin import ImageContents, VerbsOpsTable

CKPT_PLUGIN_API = 2
CKPT_PLUGIN_NAME = "opcount"
CKPT_PLUGIN_ORDER = 500  # above ckpt_ib (whose order is lower): count what the program calls
__version__ = "1.0"

ENV_FILE = "CKPT_OPCOUNT_FILE"
IMAGE_KEY = "opcount"
#: The entries counted: the ones a program calls in its steps (creating objects happens once).
COUNTED = ("post_send", "post_recv", "post_srq_recv", "poll_cq", "req_notify_cq", "modify_qp")

_counts: Counter[str] = Counter()
_lock = threading.Lock()  # the HCA's threads may poll too


def _counting(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with _lock:
            _counts[name] += 1
        return inner(*args)

    return call


@ckpt.hookimpl
def ckpt_wrap_verbs(ops: VerbsOpsTable) -> None:
    for name in COUNTED:
        setattr(ops, name, _counting(name, getattr(ops, name)))


@ckpt.hookimpl
def ckpt_precheckpoint(image: ImageContents) -> None:
    with _lock:
        image.add(IMAGE_KEY, dict(_counts))


@ckpt.hookimpl
def ckpt_restart(image: ImageContents) -> None:
    with _lock:
        _counts.clear()
        _counts.update(image.get(IMAGE_KEY, {}))


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    pattern = os.environ.get(ENV_FILE)
    if not pattern:
        return
    with _lock:
        summary = {"generation": rt.generation, "ops": dict(_counts)}
    Path(pattern.replace("{rank}", str(rt.rank))).write_text(json.dumps(summary))
