"""ckpt._sched: the policy lands on the calling thread and on what it starts; bad names are refused; where the
platform has no policies, or refuses, nothing changes."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from ckpt import _sched as sched


def _in_fresh_thread(body: Any) -> Any:
    """body() on a new thread (the policy is a thread's: the test runner's own stays as it was)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(body()))
    thread.start()
    thread.join(10)
    assert out, "the thread did not finish"
    return out[0]


def test_apply_sets_the_calling_threads_policy_and_threads_it_starts_inherit_it() -> None:
    def body() -> tuple[int, int, int]:
        before = os.sched_getscheduler(0)
        sched.apply("batch")
        child: list[int] = []
        inner = threading.Thread(target=lambda: child.append(os.sched_getscheduler(0)))
        inner.start()
        inner.join(10)
        mine = os.sched_getscheduler(0)
        sched.apply("other")
        return before, mine, child[0]

    before, mine, child = _in_fresh_thread(body)
    assert before == os.SCHED_OTHER
    assert mine == os.SCHED_BATCH and child == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the test runner's thread must not change"


def test_other_returns_a_batch_thread_to_the_default() -> None:
    def body() -> int:
        sched.apply("batch")
        sched.apply("other")
        return os.sched_getscheduler(0)

    assert _in_fresh_thread(body) == os.SCHED_OTHER


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'fifo': one of batch, other"):
        sched.apply("fifo")


def test_a_platform_without_policies_or_one_that_refuses_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_setscheduler")
    sched.apply("batch")  # no error
    monkeypatch.undo()

    def refuse(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)

    def body() -> int:
        sched.apply("batch")  # no error
        return os.sched_getscheduler(0)

    assert _in_fresh_thread(body) == os.SCHED_OTHER
