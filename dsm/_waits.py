"""Long waits, reported: what a rank's program thread has waited for STUCK_AFTER seconds or more (`ckpt status`)."""

# Rationale.  A DSM job that hangs shows nothing from outside: every rank is
# "running" and its step stands still.  What tells the cause is what each rank
# waits for -- three ranks in barrier 7 and the fourth on a page from rank 2
# point at rank 2 at once.  Every wait of the program thread's endpoint
# (`Endpoint.wait`: a reply, a lock, a barrier, one-sided operations, room in a
# log ring) that has lasted STUCK_AFTER seconds is added here, and removed when
# it ends; the list goes to the coordinator's KV under STATS_NS "<rank>/dsm"
# ({"waits": [{"what", "since"}], "incarnation"}), which `ckpt status` prints.
#
# A publish is a round trip to the coordinator, which may be slow or stopped:
# never on the waiting thread.  One daemon thread (started at the first long
# wait) publishes the latest list whenever it changed, so a wait that ends
# while a publish is under way is published ended right after it, and nothing
# on the DSM's hot path pays anything (`Endpoint.wait` reads the clock once).

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ckpt.plugin import STATS_NS

log = logging.getLogger("dsm")

STUCK_AFTER = 2.0  # seconds a wait lasts before it is reported


class WaitReport:
    """The long waits in progress on one rank, and the thread that publishes them (`publish([{what, since}])`)."""

    def __init__(self, publish: Callable[[list[dict[str, Any]]], None]) -> None:
        self._publish = publish
        self._waits: list[tuple[str, float]] = []  # (what, since: wall-clock seconds), outermost first
        self._changed = threading.Condition()
        self._version = 0  # bumped by every change; the thread publishes until it has caught up
        self._thread: threading.Thread | None = None
        self._closed = False

    def begin(self, what: str, waited: float) -> Callable[[], None]:
        """A wait for `what` has lasted `waited` seconds: report it; the function returned ends the report."""
        entry = (what, time.time() - waited)
        with self._changed:
            self._waits.append(entry)
            self._bump()
        return lambda: self._end(entry)

    def close(self) -> None:
        """Stop the publishing thread (the memory is closed): what it had not published yet is dropped."""
        with self._changed:
            self._closed = True
            self._changed.notify()

    def _end(self, entry: tuple[str, float]) -> None:
        with self._changed:
            self._waits = [e for e in self._waits if e is not entry]
            self._bump()

    def _bump(self) -> None:
        self._version += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsm-wait-report", daemon=True)
            self._thread.start()
        self._changed.notify()

    def _run(self) -> None:
        published = 0
        while True:
            with self._changed:
                while not self._closed and self._version == published:
                    self._changed.wait()
                if self._closed:
                    return
                published = self._version
                value = [{"what": what, "since": since} for what, since in self._waits]
            try:
                self._publish(value)
            except Exception as exc:  # the coordinator is gone or refused it: the wait goes on regardless
                log.debug("dsm: the wait report was not published: %s", exc)


def report(rt: Any, rank: int) -> WaitReport | None:
    """The report of rank `rank`'s long waits, published through ``rt.kv``; None without a KV (no coordinator)."""
    kv = getattr(rt, "kv", None)
    if kv is None:
        return None
    key = f"{rank}/dsm"

    def publish(waits: list[dict[str, Any]]) -> None:
        # the incarnation now, not at attach: a recovered rank's memory is restored before it is told its own
        kv.publish(STATS_NS, key, {"waits": waits, "incarnation": int(getattr(rt, "incarnation", 0) or 0)})

    return WaitReport(publish)
