"""A rank's side of single-rank recovery (ckpt/runtime/_survivor.py): its incarnation, the survivors' hooks."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from ckpt._errors import CheckpointAborted
from ckpt._schemas import ImageHeader
from ckpt.coordinator import protocol
from ckpt.plugin import hookimpl
from ckpt.runtime._survivor import SurvivorHooks, incarnation
from ckpt.runtime.plugins import PluginHost

pytestmark = pytest.mark.timeout(30)

WAIT = 5.0


class _Recorder:
    """A plugin that records each survivor hook with the thread it ran on (and may raise)."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: queue.SimpleQueue[tuple[str, int, int, str]] = queue.SimpleQueue()
        self.fail = fail

    @hookimpl
    def ckpt_rank_failed(self, rt: Any, rank: int, incarnation: int) -> None:
        if self.fail:
            raise RuntimeError(f"no way without rank {rank}")
        self.seen.put(("failed", rank, incarnation, threading.current_thread().name))

    @hookimpl
    def ckpt_rank_recovered(self, rt: Any, rank: int, incarnation: int) -> None:
        self.seen.put(("recovered", rank, incarnation, threading.current_thread().name))


def _host(plugin: object) -> PluginHost:
    host = PluginHost()
    host.register(plugin, name="recorder")
    return host


def _header(number: int) -> ImageHeader:
    return ImageHeader(program="p", job="j", rank=1, size=2, number=3, generation=0, incarnation=number)


def test_the_incarnation_is_a_recoverys_new_one_else_the_images_else_zero() -> None:
    assert incarnation({}, None) == (False, 0)
    assert incarnation({}, _header(2)) == (False, 2)  # a whole-job restart keeps it
    assert incarnation({"recover": {"incarnation": 3}}, _header(2)) == (True, 3)
    assert incarnation({"recover": {"incarnation": 3}}, None) == (False, 0)  # no image: nothing to recover


def test_hooks_wait_for_start_then_run_in_arrival_order_on_their_own_thread() -> None:
    recorder = _Recorder()
    hooks = SurvivorHooks(_host(recorder))
    assert hooks.offer(protocol.RankFailed(rank=2, incarnation=0))
    assert hooks.offer(protocol.RankRecovered(rank=2, incarnation=1))
    assert not hooks.offer(protocol.Suspend(number=4))  # not its business
    assert recorder.seen.empty()  # queued until the plugins are initialized
    fatal: queue.SimpleQueue[str] = queue.SimpleQueue()
    hooks.start(object(), fatal.put)
    hooks.offer(protocol.RankFailed(rank=0, incarnation=5))
    seen = [recorder.seen.get(timeout=WAIT) for _ in range(3)]
    assert seen == [
        ("failed", 2, 0, "ckpt-rank-events"),
        ("recovered", 2, 1, "ckpt-rank-events"),
        ("failed", 0, 5, "ckpt-rank-events"),
    ]
    assert fatal.empty()  # fatal runs on the hook thread: collected here, not raised there


def test_a_hook_that_raises_is_fatal_naming_the_plugin() -> None:
    fatal: queue.SimpleQueue[str] = queue.SimpleQueue()
    hooks = SurvivorHooks(_host(_Recorder(fail=True)))
    hooks.start(object(), fatal.put)
    hooks.offer(protocol.RankFailed(rank=1, incarnation=0))
    line = fatal.get(timeout=WAIT)
    assert "plugin 'recorder' failed in ckpt_rank_failed" in line and "no way without rank 1" in line, line


def test_without_plugins_nothing_runs() -> None:
    hooks = SurvivorHooks(None)
    fatal: queue.SimpleQueue[str] = queue.SimpleQueue()
    before = set(threading.enumerate())  # other tests' hook threads live on (daemons blocked on their queues)
    hooks.start(object(), fatal.put)
    assert hooks.offer(protocol.RankFailed(rank=1, incarnation=0))  # accepted, and dropped
    assert set(threading.enumerate()) <= before  # no thread was started to run them
    assert fatal.empty()


def test_a_rank_with_plugins_runs_the_hooks_the_one_without_does_not() -> None:
    """The same pushes through a SurvivorHooks with a recorder plugin and one without: only the first runs."""
    recorder = _Recorder()
    with_plugins, without = SurvivorHooks(_host(recorder)), SurvivorHooks(None)
    fatal: queue.SimpleQueue[str] = queue.SimpleQueue()
    for hooks in (without, with_plugins):
        hooks.start(object(), fatal.put)
        hooks.offer(protocol.RankFailed(rank=1, incarnation=0))
    assert recorder.seen.get(timeout=WAIT) == ("failed", 1, 0, "ckpt-rank-events")
    assert recorder.seen.empty() and fatal.empty()  # one run: the one with the plugin


class _Aborting:
    """A plugin whose survivor hook raises what PluginHost.call re-raises unchanged (not a PluginError)."""

    @hookimpl
    def ckpt_rank_failed(self, rt: Any, rank: int, incarnation: int) -> None:
        raise CheckpointAborted(f"aborted while rank {rank} was lost")


def test_any_exception_of_a_hook_is_fatal_in_one_line_and_later_events_still_run() -> None:
    recorder = _Recorder()
    host = _host(recorder)
    host.register(_Aborting(), name="aborting")
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def fatal(line: str) -> None:
        lines.put(line)
        raise RuntimeError("the coordinator is gone")  # ending the rank failed as well

    hooks = SurvivorHooks(host)
    hooks.start(object(), fatal)
    hooks.offer(protocol.RankFailed(rank=1, incarnation=0))
    hooks.offer(protocol.RankRecovered(rank=1, incarnation=1))
    line = lines.get(timeout=WAIT)
    assert "CheckpointAborted: aborted while rank 1 was lost" in line and "\n" not in line, line
    assert recorder.seen.get(timeout=WAIT)[:3] == ("recovered", 1, 1)  # the thread survived both
