"""Long waits, reported: what a rank's program thread has waited for STUCK_AFTER seconds or more (`ckpt status`)."""

# Rationale.  A DSM job that hangs shows nothing from outside: every rank is
# "running" and its step stands still.  What tells the cause is what each rank
# waits for -- three ranks in barrier 7 and the fourth on a page from rank 2
# point at rank 2 at once.  Every wait of the program thread's endpoint
# (`Endpoint.wait`: a reply, a lock, a barrier, one-sided operations) and remote
# logging's wait for room in a full log ring (`Endpoint.report_stuck`) that has
# lasted STUCK_AFTER seconds is added here, and removed when it ends; the list
# goes to the coordinator's KV under STATS_NS "<rank>/dsm" ({"waits": [{"what",
# "since"}], "facts": [...], "incarnation"}), which `ckpt status` prints.  The
# facts are the home's side (`Standing`): a lock ranks queue for and who holds
# it, a barrier some ranks have reached -- which makes a lock-order deadlock
# plain (two locks, each held by a rank the other waits for).
#
# A publish is a round trip to the coordinator, which may be slow or stopped:
# never on the waiting thread.  One daemon thread (started at the first long
# wait) publishes the latest list whenever it changed, so a wait that ends
# while a publish is under way is published ended right after it, and nothing
# on the DSM's hot path pays anything (`Endpoint.wait` reads the clock once).
# A process that exits mid-publish may leave its last list unpublished:
# `ckpt status` shows no waits of a finished, killed or failed rank.

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ckpt.plugin import STATS_NS

log = logging.getLogger("dsm")

STUCK_AFTER = 2.0  # seconds a wait lasts before it is reported
LOOK_EVERY = 0.25  # seconds between a busy home's looks at what stands (`Standing`)


class WaitReport:
    """The long waits in progress on one rank and what its home has seen stand still (`Standing`), and the
    thread that publishes them (`publish(waits, facts)`, each a list of ``{what, since}``)."""

    def __init__(self, publish: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None]) -> None:
        self._publish = publish
        self._waits: list[tuple[str, float]] = []  # (what, since: wall-clock seconds), outermost first
        self._facts: list[tuple[str, float]] = []  # (what, since), set whole by `set_facts`
        self._changed = threading.Condition()
        self._version = 0  # bumped by every change; the thread publishes until it has caught up
        self._thread: threading.Thread | None = None
        self._closed = False

    def begin(self, what: str, waited: float) -> Callable[[], None]:
        """A wait for `what` has lasted `waited` seconds: report it; the function returned ends the report."""
        entry = (what, time.time() - waited)
        with self._changed:
            self._waits.append(entry)
            try:
                self._bump()
            except BaseException:
                self._waits.remove(entry)  # not reported after all: the caller has nothing to end it with
                raise
        return lambda: self._end(entry)

    def set_facts(self, facts: list[tuple[str, float]]) -> None:
        """What this rank's handler has seen stand still for STUCK_AFTER (what, since: wall-clock), replacing
        the last list (the handler thread's, `Standing`)."""
        with self._changed:
            self._facts = list(facts)
            self._bump()

    def close(self) -> None:
        """Stop the publishing thread once it has published the latest list (the memory is closed)."""
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
            thread = threading.Thread(target=self._run, name="dsm-wait-report", daemon=True)
            thread.start()  # may raise (no thread to be had): the next change tries again
            self._thread = thread
        self._changed.notify()

    def _run(self) -> None:
        published = 0
        while True:
            with self._changed:
                while not self._closed and self._version == published:
                    self._changed.wait()
                if self._version == published:  # closed, and the latest list is out
                    return
                published = self._version
                waits = [{"what": what, "since": since} for what, since in self._waits]
                facts = [{"what": what, "since": since} for what, since in self._facts]
            try:
                self._publish(waits, facts)
            except Exception as exc:  # the coordinator is gone or refused it: the wait goes on regardless
                log.debug("dsm: the wait report was not published: %s", exc)


def report(rt: Any, rank: int) -> WaitReport | None:
    """The report of rank `rank`'s long waits, published through ``rt.kv``; None without a KV (no coordinator)."""
    if getattr(rt, "kv", None) is None:
        return None
    key = f"{rank}/dsm"

    def publish(waits: list[dict[str, Any]], facts: list[dict[str, Any]]) -> None:
        # the store and the incarnation as they are now, not at attach (a runtime double may start a generation)
        incarnation = int(getattr(rt, "incarnation", 0) or 0)
        rt.kv.publish(STATS_NS, key, {"waits": waits, "facts": facts, "incarnation": incarnation})

    return WaitReport(publish)


class Standing:
    """A home's view of what stands still, for `ckpt status`: a lock with ranks queued for it, a barrier some
    ranks have arrived at (`Handler.standing`), each reported once it has lasted STUCK_AFTER.

    Looked at by the handler thread, idle or between the requests it serves (a busy home must also take
    back what has moved on), at most every LOOK_EVERY seconds: a look walks the home's locks.  A fact is
    keyed by what stands (a lock and its holder, a barrier), so it keeps its start while its text changes
    (another rank joins the queue), and a lock handed on starts afresh.
    """

    def __init__(self, report: WaitReport) -> None:
        self.report = report
        self.first: dict[Any, float] = {}  # key -> when (monotonic) it was first seen standing
        self.shown: list[str] = []
        self.looked = -math.inf  # (monotonic) the last look

    def look(self, facts: dict[Any, str], now: float) -> None:
        """`facts` (key -> text) stand now (`time.monotonic()`): publish those that have lasted, if they changed."""
        self.looked = now
        self.first = {key: self.first.get(key, now) for key in facts}
        due = sorted((self.first[key], text) for key, text in facts.items() if now - self.first[key] >= STUCK_AFTER)
        texts = [text for _, text in due]
        if texts != self.shown:
            wall = time.time() - now
            self.report.set_facts([(text, wall + since) for since, text in due])
            self.shown = texts  # only once it is out: a report that failed is tried again at the next look

    def clear(self) -> None:
        """Nothing stands any more (the handler stopped): take back what was reported, if anything."""
        if self.shown:
            self.report.set_facts([])
            self.shown = []
