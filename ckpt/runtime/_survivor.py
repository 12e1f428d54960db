"""A rank's side of single-rank recovery: which incarnation it is, and the survivors' hooks on their own thread."""

# Under --on-failure recover a process may replace a failed rank (spec "recover":
# its incarnation K): it loads its own image and walks RESTART / REFRESH / RESUME
# alone in scope rankR.incK while the others run on; the collectives it
# re-executes are answered from the coordinator's record (ckpt/coordinator/
# _recovery.py).  On the survivors, the coordinator's RankFailed / RankRecovered
# pushes run ckpt_rank_failed / ckpt_rank_recovered on one thread of their own,
# in arrival order: never on the coordinator link's reader (a hook may call the
# coordinator, whose replies that thread delivers) nor on the program thread.

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ckpt._errors import PluginError
from ckpt._schemas import ImageHeader
from ckpt.coordinator import protocol
from ckpt.runtime.plugins import PluginHost

log = logging.getLogger(__name__)


def incarnation(spec: dict[str, Any], header: ImageHeader | None) -> tuple[bool, int]:
    """(recovered, incarnation) of a rank process: a recovery's new one, else the image's (a whole-job
    restart keeps each rank's), else 0 at launch."""
    recover = spec.get("recover")
    if recover is not None and header is not None:
        return True, int(recover["incarnation"])
    return False, header.incarnation if header is not None else 0


class SurvivorHooks:
    """Runs ckpt_rank_failed / ckpt_rank_recovered for the pushes `offer` accepts, one at a time, in order.

    Pushes are queued from the start (the link delivers them as soon as the rank has joined); the hooks
    run once `start` is called: after the plugins' ckpt_init at launch, after RESUME on a restarted rank
    (its image's objects are whole only then).

    A hook that raises (anything: a PluginError names the plugin) is logged and handed to `fatal` in one
    line (the rank reports it and exits, so the job fails): the plugin said it can bring a single rank
    back, and one that could not would leave the program waiting on a peer that never returns.  If
    `fatal` raises too, that is logged and the thread runs on.
    """

    def __init__(self, plugins: PluginHost | None) -> None:
        self._plugins = plugins
        self._queue: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._started = False

    def start(self, rt: Any, fatal: Callable[[str], object]) -> None:
        """Run the hooks from now on, with `rt`; `fatal(line)` ends the rank when one raises (once is enough)."""
        if self._plugins is None or self._started:
            return
        self._started = True
        plugins = self._plugins
        threading.Thread(target=self._run, args=(plugins, rt, fatal), name="ckpt-rank-events", daemon=True).start()

    def offer(self, push: protocol.Push) -> bool:
        """Queue the hook a RankFailed / RankRecovered push calls for; False for any other push."""
        match push:
            case protocol.RankFailed(rank=rank, incarnation=number):
                self._queue.put(("ckpt_rank_failed", rank, number))
            case protocol.RankRecovered(rank=rank, incarnation=number):
                self._queue.put(("ckpt_rank_recovered", rank, number))
            case _:
                return False
        return True

    def _run(self, plugins: PluginHost, rt: Any, fatal: Callable[[str], object]) -> None:
        while True:
            hook, rank, number = self._queue.get()
            try:
                plugins.call(hook, rt=rt, rank=rank, incarnation=number)
            except Exception as exc:  # PluginError names the plugin; CheckpointAborted and others pass unchanged
                what = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
                log.error("%s (rank %d, incarnation %d): %s", hook, rank, number, what)
                try:
                    fatal(f"{hook} (rank {rank}, incarnation {number}): {what}")
                except Exception as failure:  # the thread lives on: later events still run
                    log.error("ending the rank after %s failed too: %s: %s", hook, type(failure).__name__, failure)
