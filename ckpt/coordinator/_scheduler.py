"""A single timer thread for the coordinator: deadlines run a callback under the coordinator's lock."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(order=True)
class Timer:
    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """Runs callbacks at monotonic deadlines on one daemon thread, each under `lock`."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._cv = threading.Condition(threading.Lock())
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ckpt-coord-timers", daemon=True)
        self._thread.start()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, next(self._seq), callback)
        with self._cv:
            heapq.heappush(self._heap, timer)
            self._cv.notify()
        return timer

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _run(self) -> None:
        import time

        while True:
            with self._cv:
                while not self._stopped and (not self._heap or self._heap[0].when > time.monotonic()):
                    timeout = self._heap[0].when - time.monotonic() if self._heap else None
                    self._cv.wait(None if timeout is None else min(timeout, 3600.0))
                if self._stopped:
                    return
                timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            with self._lock:
                if not timer.cancelled:
                    try:
                        timer.callback()
                    except Exception:  # one bad callback must not stop every later timer
                        log.exception("coordinator timer callback failed")
