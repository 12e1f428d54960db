"""A single timer thread for the coordinator: deadlines run a callback under the coordinator's lock."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(order=True)
class Timer:
    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)
    _scheduler: Scheduler | None = field(default=None, compare=False, repr=False)  # set while in its heap

    def cancel(self) -> None:
        scheduler = self._scheduler
        if scheduler is None:
            self.cancelled = True
        else:
            scheduler._cancel(self)


class Scheduler:
    """Runs callbacks at monotonic deadlines on one daemon thread, each under `lock`.

    A cancelled timer leaves the heap: every checkpoint arms phase timers of minutes and cancels
    them seconds later, so with interval checkpoints the heap would otherwise grow without bound.
    Removal is lazy (the heap is rebuilt once more than half of it is cancelled), so a cancel
    costs O(1) amortized.
    """

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._cv = threading.Condition(threading.Lock())
        self._heap: list[Timer] = []
        self._cancelled_in_heap = 0
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ckpt-coord-timers", daemon=True)
        self._thread.start()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, next(self._seq), callback, _scheduler=self)
        with self._cv:
            heapq.heappush(self._heap, timer)
            self._cv.notify()
        return timer

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _cancel(self, timer: Timer) -> None:
        """Cancel `timer`, counting it if it is still in the heap; compact a heap that is mostly dead."""
        with self._cv:
            if timer.cancelled:
                return
            timer.cancelled = True
            if timer._scheduler is None:  # popped already: it ran, or runs now and sees the flag under the lock
                return
            self._cancelled_in_heap += 1
            if self._cancelled_in_heap * 2 > len(self._heap):
                self._heap = [t for t in self._heap if not t.cancelled]
                heapq.heapify(self._heap)
                self._cancelled_in_heap = 0

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._heap or self._heap[0].when > time.monotonic()):
                    timeout = self._heap[0].when - time.monotonic() if self._heap else None
                    self._cv.wait(None if timeout is None else min(timeout, 3600.0))
                if self._stopped:
                    return
                timer = heapq.heappop(self._heap)
                timer._scheduler = None
                if timer.cancelled:
                    self._cancelled_in_heap -= 1
                    continue
            with self._lock:
                if not timer.cancelled:
                    try:
                        timer.callback()
                    except Exception:  # one bad callback must not stop every later timer
                        log.exception("coordinator timer callback failed")
