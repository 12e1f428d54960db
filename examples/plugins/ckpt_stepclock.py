"""ckpt_stepclock: how long every checkpoint phase takes on each rank, kept across restarts.

An example plugin (docs/plugins.md walks through it).  Load it by module name,
on launch and again on restart, with the module on ``PYTHONPATH``::

    export PYTHONPATH=examples/plugins
    ckpt launch -n 4 --with-plugin ckpt_stepclock --stepclock-file 'clock-{rank}.json' examples/heat.py 2000
    ckpt checkpoint --kill
    ckpt restart --with-plugin ckpt_stepclock --stepclock-file 'clock-{rank}.json'

What it does, hook by hook:

* ``ckpt_presuspend`` / ``ckpt_drain`` / ``ckpt_precheckpoint`` /
  ``ckpt_checkpointed`` / ``ckpt_resume`` each note the time, so a record holds
  the length of each phase on this rank: *presuspend* (waiting at the
  PRESUSPEND barrier for every rank to park), *drain*, *checkpoint* (the image
  write, the CHECKPOINT barrier and the manifest) and *suspended* (from
  ``ckpt_presuspend`` to ``ckpt_resume``: nearly all the time the program
  thread stays parked).
* At drain, every rank publishes its presuspend time in the key-value store and
  reads everybody's, so each record also lists every rank's time: the slowest
  rank is the one the others waited for.
* The history (plain lists and dicts) goes into the image, so it survives a
  restart; a restart adds a record of its own phases (image load, RESTART,
  REFRESH) with every rank's load time, exchanged the restart way: published at
  ``ckpt_restart``, subscribed to at ``ckpt_refresh``.
* ``ckpt_exit`` writes the whole history as JSON to the file named by the
  ``--stepclock-file`` option it adds to ``launch`` / ``restart``, or else by
  ``$CKPT_STEPCLOCK_FILE`` (``{rank}`` in the name is replaced by the rank;
  without it, ``.rank<R>`` is appended).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ckpt

if TYPE_CHECKING:
    from ckpt.plugin import ImageContents

CKPT_PLUGIN_API = 2
CKPT_PLUGIN_NAME = "stepclock"
# Low: registered first, so it sits at the bottom of the stack.  Its down hooks
# (presuspend, drain, precheckpoint) run before every other plugin's and its up
# hooks (checkpointed, resume, restart, refresh) after them, so each phase it
# times includes the other plugins' work in that phase.
CKPT_PLUGIN_ORDER = 10
__version__ = "1.0"

ENV_FILE = "CKPT_STEPCLOCK_FILE"
NAMESPACE = "stepclock"  # our key-value namespace
IMAGE_KEY = "stepclock"  # our entry in the image
EXCHANGE_TIMEOUT = 60.0  # seconds to wait for the other ranks' values

log = logging.getLogger(__name__)

# Imported while the rank process loads its plugins, before a restarted rank
# reads its image: ckpt_restart - this is how long connecting and loading took.
_IMPORTED = time.monotonic()


@dataclass
class _Clock:
    """This process's state; only the plain-data part goes into the image."""

    history: list[dict[str, Any]] = field(default_factory=list)  # one record per checkpoint, oldest first
    restarts: list[dict[str, Any]] = field(default_factory=list)  # one record per restart, oldest first
    drains: int = 0  # checkpoints that reached DRAIN: equal on every rank, so it names kv keys
    aborted: int = 0
    current: dict[str, Any] | None = None  # the checkpoint (or restart) in progress
    marks: dict[str, float] = field(default_factory=dict)  # monotonic times of the hooks seen so far

    def mark(self, name: str) -> float:
        now = self.marks[name] = time.monotonic()
        return now

    def since(self, name: str, now: float) -> float | None:
        start = self.marks.get(name)
        return None if start is None else round(now - start, 6)

    def saved(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "restarts": self.restarts,
            "drains": self.drains,
            "aborted": self.aborted,
            "current": self.current,
        }


_clock = _Clock()


# --------------------------------------------------------------------- lifecycle
@ckpt.hookimpl
def ckpt_add_options() -> list[dict[str, Any]]:
    return [
        {
            "name": "stepclock-file",
            "help": "Write each rank's checkpoint timings here at exit ({rank} is replaced by the rank).",
            "default": None,
            "type": "str",
        }
    ]


@ckpt.hookimpl
def ckpt_init(rt: ckpt.Runtime) -> None:
    # Fires in every process, a restarted one too (then before ckpt_restart).
    _clock.marks = {"init": time.monotonic()}


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    if _clock.current is not None and "number" in _clock.current:
        # `ckpt checkpoint --kill`: checkpointed, then exit, no resume.
        _clock.history.append({**_clock.current, "ended": "killed"})
        _clock.current = None
    summary = {
        "plugin": CKPT_PLUGIN_NAME,
        "version": __version__,
        "job": rt.job,
        "rank": rt.rank,
        "size": rt.size,
        "pid": os.getpid(),
        "generation": rt.generation,
        "step": rt.step,
        "aborted": _clock.aborted,
        "checkpoints": _clock.history,
        "restarts": _clock.restarts,
    }
    path = _summary_path(rt)
    if path is None:
        log.info("rank %d: %d checkpoint(s) timed: %s", rt.rank, len(_clock.history), summary["checkpoints"])
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)  # a reader never sees half a summary


def _summary_path(rt: ckpt.Runtime) -> Path | None:
    template = rt.options.get("stepclock_file") or os.environ.get(ENV_FILE)
    if not template:
        return None
    name = str(template)
    rank = str(rt.rank)
    return Path(name.replace("{rank}", rank) if "{rank}" in name else f"{name}.rank{rank}")


# --------------------------------------------------------------------- checkpoint: down
@ckpt.hookimpl
def ckpt_presuspend(rt: ckpt.Runtime) -> None:
    _clock.mark("presuspend")
    _clock.current = {"generation": rt.generation, "step": rt.step, "at": time.time()}


@ckpt.hookimpl
def ckpt_drain(rt: ckpt.Runtime) -> None:
    now = _clock.mark("drain")
    record = _clock.current
    assert record is not None, "ckpt_drain without ckpt_presuspend"
    record["presuspend"] = _clock.since("presuspend", now)
    # Every rank that passed the PRESUSPEND barrier drains, so the count agrees
    # across ranks and names this checkpoint's keys; the store is emptied at
    # each restart, and the count is restored from the image, so keys never clash.
    _clock.drains += 1
    record["seq"] = _clock.drains
    prefix = f"presuspend{_clock.drains}:"
    rt.kv.publish(NAMESPACE, f"{prefix}{rt.rank}", record["presuspend"])
    seen = rt.kv.subscribe_prefix(NAMESPACE, prefix, count=rt.size, timeout=EXCHANGE_TIMEOUT)
    record["ranks_presuspend"] = [seen[f"{prefix}{rank}"] for rank in range(rt.size)]


@ckpt.hookimpl
def ckpt_precheckpoint(rt: ckpt.Runtime, image: ImageContents) -> None:
    now = _clock.mark("precheckpoint")
    assert _clock.current is not None
    _clock.current["drain"] = _clock.since("drain", now)
    # Pickled right after the last precheckpoint hook returns, with the program,
    # so the record of this very checkpoint is saved as it is now: without the
    # checkpoint phase or number, which only exist once the image is written.
    image.add(IMAGE_KEY, _clock.saved())


# --------------------------------------------------------------------- checkpoint: up
@ckpt.hookimpl
def ckpt_checkpointed(rt: ckpt.Runtime, info: dict[str, Any]) -> None:
    now = _clock.mark("checkpointed")
    assert _clock.current is not None
    _clock.current["checkpoint"] = _clock.since("precheckpoint", now)
    _clock.current["number"] = info["number"]


@ckpt.hookimpl
def ckpt_resume(rt: ckpt.Runtime, restarted: bool, aborted: bool) -> None:
    now = time.monotonic()
    record, _clock.current = _clock.current, None
    if restarted:
        assert record is not None, "ckpt_resume(restarted=True) without ckpt_restart"
        record["refresh"] = _clock.since("refresh", now)
        _clock.restarts.append(record)
    elif aborted:
        # May come without our ckpt_presuspend having run (another plugin failed first).
        _clock.aborted += 1
    elif record is not None:
        record["suspended"] = _clock.since("presuspend", now)
        _clock.history.append(record)


# --------------------------------------------------------------------- restart: up
@ckpt.hookimpl
def ckpt_restart(rt: ckpt.Runtime, image: ImageContents) -> None:
    _clock.mark("restart")
    saved = image.get(IMAGE_KEY)
    if saved is None:
        log.warning("rank %d: the image has no stepclock history (taken without this plugin)", rt.rank)
    else:
        _clock.history = list(saved["history"])
        _clock.restarts = list(saved["restarts"])
        _clock.drains = int(saved["drains"])
        _clock.aborted = int(saved["aborted"])
        if saved["current"] is not None:
            # The checkpoint this restart comes from, as it was when its image was written.
            _clock.history.append({**saved["current"], "restored": True})
    loaded = round(_clock.marks["restart"] - _IMPORTED, 6)
    _clock.current = {"generation": rt.generation, "step": rt.step, "at": time.time(), "load": loaded}
    rt.kv.publish(NAMESPACE, f"load:{rt.rank}", loaded)


@ckpt.hookimpl
def ckpt_refresh(rt: ckpt.Runtime) -> None:
    now = _clock.mark("refresh")
    assert _clock.current is not None
    _clock.current["restart"] = _clock.since("restart", now)
    # Every rank published at ckpt_restart and a barrier followed: nothing to wait for.
    loads = rt.kv.subscribe_prefix(NAMESPACE, "load:", count=rt.size, timeout=EXCHANGE_TIMEOUT)
    _clock.current["ranks_load"] = [loads[f"load:{rank}"] for rank in range(rt.size)]
