"""Unit tests of the coordinator's timer thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ckpt.coordinator._scheduler import Scheduler

pytestmark = pytest.mark.timeout(30)

WAIT = 5.0


@pytest.fixture
def lock() -> threading.RLock:
    return threading.RLock()


@pytest.fixture
def scheduler(lock: threading.RLock) -> Iterator[Scheduler]:
    s = Scheduler(lock)
    yield s
    s.stop()
    s._thread.join(WAIT)


def recorder(log: list[str], name: str, done: threading.Event | None = None) -> Callable[[], None]:
    def callback() -> None:
        log.append(name)
        if done is not None:
            done.set()

    return callback


def hold_the_timer_thread(scheduler: Scheduler) -> tuple[threading.Event, threading.Event]:
    """Park the timer thread inside a callback; returns (parked, release)."""
    parked, release = threading.Event(), threading.Event()

    def block() -> None:
        parked.set()
        release.wait(WAIT)

    scheduler.call_at(time.monotonic() - 10.0, block)
    assert parked.wait(WAIT)
    return parked, release


def test_callbacks_run_in_deadline_order(scheduler: Scheduler) -> None:
    _, release = hold_the_timer_thread(scheduler)
    log: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    for offset, name in [(-3, "c"), (-5, "a"), (-1, "e"), (-4, "b"), (-2, "d")]:
        scheduler.call_at(now + offset, recorder(log, name, done if name == "e" else None))
    release.set()
    assert done.wait(WAIT)
    assert log == ["a", "b", "c", "d", "e"]


def test_equal_deadlines_run_in_scheduling_order(scheduler: Scheduler) -> None:
    _, release = hold_the_timer_thread(scheduler)
    log: list[str] = []
    done = threading.Event()
    when = time.monotonic() - 1.0
    names = [f"t{i}" for i in range(10)]
    for name in names:
        scheduler.call_at(when, recorder(log, name, done if name == names[-1] else None))
    release.set()
    assert done.wait(WAIT)
    assert log == names


def test_a_future_deadline_waits_and_an_earlier_one_preempts_it(scheduler: Scheduler) -> None:
    log: list[str] = []
    soon = threading.Event()
    later = scheduler.call_at(time.monotonic() + 60.0, recorder(log, "later"))
    scheduler.call_at(time.monotonic() + 0.05, recorder(log, "soon", soon))
    assert soon.wait(WAIT)
    assert log == ["soon"]
    later.cancel()


def test_a_short_future_deadline_fires(scheduler: Scheduler) -> None:
    fired = threading.Event()
    start = time.monotonic()
    scheduler.call_at(start + 0.1, fired.set)
    assert fired.wait(WAIT)
    assert time.monotonic() - start >= 0.1


def test_a_cancelled_timer_never_runs(scheduler: Scheduler) -> None:
    _, release = hold_the_timer_thread(scheduler)
    log: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    scheduler.call_at(now - 3, recorder(log, "a"))
    doomed = scheduler.call_at(now - 2, recorder(log, "doomed"))
    scheduler.call_at(now - 1, recorder(log, "c", done))
    doomed.cancel()
    assert doomed.cancelled
    release.set()
    assert done.wait(WAIT)
    assert log == ["a", "c"]


def test_a_callback_can_cancel_a_later_timer(scheduler: Scheduler) -> None:
    _, release = hold_the_timer_thread(scheduler)
    log: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    victim = scheduler.call_at(now - 2, recorder(log, "victim"))
    scheduler.call_at(now - 3, victim.cancel)
    scheduler.call_at(now - 1, recorder(log, "after", done))
    release.set()
    assert done.wait(WAIT)
    assert log == ["after"]


def test_a_timer_cancelled_by_a_lock_holder_does_not_run(scheduler: Scheduler, lock: threading.RLock) -> None:
    # The coordinator cancels timers under its lock; a timer already popped must not run after that.
    ran = threading.Event()
    with lock:
        timer = scheduler.call_at(time.monotonic() - 1.0, ran.set)
        timer.cancel()
    after = threading.Event()
    scheduler.call_at(time.monotonic() - 0.5, after.set)
    assert after.wait(WAIT)
    assert not ran.is_set()


def test_callbacks_run_under_the_lock(scheduler: Scheduler, lock: threading.RLock) -> None:
    observed: list[bool] = []
    done = threading.Event()

    def callback() -> None:
        # Another thread cannot take the lock while the callback runs.
        probe = threading.Thread(target=lambda: observed.append(lock.acquire(blocking=False)))
        probe.start()
        probe.join(WAIT)
        done.set()

    scheduler.call_at(time.monotonic(), callback)
    assert done.wait(WAIT)
    assert observed == [False]


def test_callbacks_wait_for_the_lock(scheduler: Scheduler, lock: threading.RLock) -> None:
    fired = threading.Event()
    with lock:
        scheduler.call_at(time.monotonic() - 1.0, fired.set)
        assert not fired.wait(0.1)
    assert fired.wait(WAIT)


def test_callbacks_run_on_the_timer_thread(scheduler: Scheduler) -> None:
    names: list[str] = []
    done = threading.Event()

    def callback() -> None:
        names.append(threading.current_thread().name)
        done.set()

    scheduler.call_at(time.monotonic(), callback)
    assert done.wait(WAIT)
    assert names == ["ckpt-coord-timers"]


def test_stop_ends_the_thread_and_drops_pending_timers(lock: threading.RLock) -> None:
    scheduler = Scheduler(lock)
    ran = threading.Event()
    scheduler.call_at(time.monotonic() + 60.0, ran.set)
    scheduler.stop()
    scheduler._thread.join(WAIT)
    assert not scheduler._thread.is_alive()
    assert not ran.is_set()


def test_stop_while_idle(lock: threading.RLock) -> None:
    scheduler = Scheduler(lock)
    scheduler.stop()
    scheduler._thread.join(WAIT)
    assert not scheduler._thread.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_callback_does_not_stop_later_timers(scheduler: Scheduler) -> None:
    def boom() -> None:
        raise RuntimeError("callback failed")

    fired = threading.Event()
    now = time.monotonic()
    scheduler.call_at(now - 1.0, boom)
    scheduler.call_at(now - 0.5, fired.set)
    assert fired.wait(2.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_very_distant_deadline_does_not_stop_the_scheduler(scheduler: Scheduler) -> None:
    scheduler.call_at(time.monotonic() + 1e12, lambda: None)
    first = threading.Event()
    scheduler.call_at(time.monotonic() + 0.01, first.set)
    assert first.wait(WAIT)
    scheduler._thread.join(1.0)  # give the thread time to go back to waiting for the far deadline
    second = threading.Event()
    scheduler.call_at(time.monotonic() + 0.05, second.set)
    assert second.wait(2.0)


def test_cancelled_timers_leave_the_heap(scheduler: Scheduler) -> None:
    # Each checkpoint arms phase timers (300 s by default) and cancels them when the phase ends:
    # cancelled timers must not pile up until their deadlines.
    far = time.monotonic() + 3600.0
    for _ in range(10_000):
        scheduler.call_at(far, lambda: None).cancel()
    assert len(scheduler._heap) <= 1
    armed = [scheduler.call_at(far + i, lambda: None) for i in range(10_000)]
    for timer in armed:
        timer.cancel()
    assert len(scheduler._heap) <= 1


def test_cancelling_some_timers_keeps_the_others(scheduler: Scheduler) -> None:
    _, release = hold_the_timer_thread(scheduler)
    log: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    timers = [scheduler.call_at(now - 100 + i, recorder(log, f"t{i}")) for i in range(99)]
    for i, timer in enumerate(timers):
        if i % 3:
            timer.cancel()
    timers[0].cancel()  # twice: still counted once
    timers[1].cancel()
    scheduler.call_at(now - 0.5, recorder(log, "last", done))
    assert len(scheduler._heap) <= 2 * (99 // 3 + 1)
    release.set()
    assert done.wait(WAIT)
    assert log == [f"t{i}" for i in range(3, 99, 3)] + ["last"]


def test_cancelling_a_timer_that_already_ran_changes_nothing(scheduler: Scheduler) -> None:
    fired = threading.Event()
    timer = scheduler.call_at(time.monotonic() - 1.0, fired.set)
    assert fired.wait(WAIT)
    keep = threading.Event()
    later = scheduler.call_at(time.monotonic() + 0.05, keep.set)
    timer.cancel()
    assert not later.cancelled
    assert keep.wait(WAIT)
