"""ckpt._sched: the policy lands on the calling thread and on what it starts; bad names are refused; a policy
chosen from outside is kept; where the platform has no policies, or refuses, nothing changes."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from ckpt import _sched as sched

_SET = os.sched_setscheduler  # the real one: the tests below take it away


def _in_fresh_thread(body: Any, start: int = os.SCHED_OTHER) -> Any:
    """body() on a new thread that starts under policy `start` (the policy is a thread's: the runner's stays)."""
    out: list[Any] = []

    def run() -> None:
        _SET(0, start, os.sched_param(0))
        out.append(body())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert out, "the thread did not finish"
    return out[0]


def test_apply_sets_the_calling_threads_policy_and_threads_it_starts_inherit_it() -> None:
    runner = os.sched_getscheduler(0)

    def body() -> tuple[int, int]:
        sched.apply("batch")
        child: list[int] = []
        inner = threading.Thread(target=lambda: child.append(os.sched_getscheduler(0)))
        inner.start()
        inner.join(10)
        return os.sched_getscheduler(0), child[0]

    assert _in_fresh_thread(body) == (os.SCHED_BATCH, os.SCHED_BATCH)
    assert os.sched_getscheduler(0) == runner, "the runner's thread must not change"


def test_other_returns_a_batch_thread_to_the_default() -> None:
    def body() -> int:
        sched.apply("other")
        return os.sched_getscheduler(0)

    assert _in_fresh_thread(body, start=os.SCHED_BATCH) == os.SCHED_OTHER


def test_a_policy_chosen_from_outside_is_kept() -> None:
    def body() -> int:
        sched.apply("batch")
        return os.sched_getscheduler(0)

    assert _in_fresh_thread(body, start=os.SCHED_IDLE) == os.SCHED_IDLE


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'fifo': one of batch, other"):
        sched.apply("fifo")


def test_a_platform_without_policies_or_one_that_refuses_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def body() -> int:
        sched.apply("batch")  # no error
        return os.sched_getscheduler(0)

    monkeypatch.delattr(os, "sched_setscheduler")
    assert _in_fresh_thread(body) == os.SCHED_OTHER

    def refuse(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    assert _in_fresh_thread(body) == os.SCHED_OTHER
