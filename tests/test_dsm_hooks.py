"""The DSM hookspecs: which hooks fire where under each protocol, and how a plugin implementing them loads."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import ckpt
import dsm
from ckpt.runtime.plugins import PluginError, PluginHost
from ckpt.testing import ThreadRuntime

WORDS = 512  # float64 per 4 KiB page


class Recorder:
    """A plugin object counting the DSM hooks fired on one rank (some on the handler thread: hence the lock)."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.applied: list[tuple[int, int, int]] = []
        # dsm_diffs_received: (writer, interval, gids, the pages' applied columns for the writer then)
        self.messages: list[tuple[int, int, list[int], list[int]]] = []

    def _note(self, name: str) -> None:
        with self.lock:
            self.seen[name] += 1

    @ckpt.hookimpl
    def dsm_interval_closed(self, memory: Any, interval: int, pages: list[int]) -> None:
        self._note("interval_closed")

    @ckpt.hookimpl
    def dsm_diff_created(self, gid: int, home: int, interval: int, diff: Any) -> None:
        self._note("diff_created")

    @ckpt.hookimpl
    def dsm_diff_sent(self, gid: int, home: int, interval: int, nbytes: int) -> None:
        self._note("diff_sent")

    @ckpt.hookimpl
    def dsm_diffs_received(self, memory: Any, writer: int, interval: int, diffs: list[tuple[int, Any]]) -> None:
        self._note("diffs_received")
        # each page's applied column for the writer, as the hook sees it: before any of the message is applied
        columns = [int(memory.regions[gid >> 32].meta[gid & 0xFFFFFFFF, writer]) for gid, _ in diffs]
        with self.lock:
            self.messages.append((writer, interval, [gid for gid, _ in diffs], columns))

    @ckpt.hookimpl
    def dsm_diff_received(self, writer: int, gid: int, interval: int, diff: Any) -> None:
        self._note("diff_received")

    @ckpt.hookimpl
    def dsm_diff_applied(self, writer: int, gid: int, interval: int) -> None:
        self._note("diff_applied")
        with self.lock:
            self.applied.append((writer, gid, interval))

    @ckpt.hookimpl
    def dsm_write_notices_received(self, source: str, notices: list[Any]) -> None:
        self._note("write_notices_received")

    @ckpt.hookimpl
    def dsm_page_served(self, requester: int, gid: int) -> None:
        self._note("page_served")

    @ckpt.hookimpl
    def dsm_lock_acquired(self, lock: int, seconds: float) -> None:
        self._note("lock_acquired")

    @ckpt.hookimpl
    def dsm_lock_released(self, lock: int) -> None:
        self._note("lock_released")

    @ckpt.hookimpl
    def dsm_barrier_passed(self, epoch: int) -> None:
        self._note("barrier_passed")


def exchange(mem: dsm.Memory, rt: ThreadRuntime) -> None:
    """Rank 0 homes a page; rank 1 writes into it under a lock; both pass barriers; rank 1 reads it back."""
    a = mem.array(WORDS, np.float64)
    lock = mem.lock()  # id 0: homed at rank 0
    if rt.rank == 0:
        a[0] = 1.0  # first touch: rank 0 is the home
    mem.barrier()
    if rt.rank == 1:
        with lock:
            a[1] = 2.0  # a twin, then a diff to rank 0 at the release
    mem.barrier()
    if rt.rank == 0:
        a[2] = 3.0
    mem.barrier()
    if rt.rank == 1:
        assert a[2] == 3.0  # invalidated by the barrier: fetched from rank 0
    mem.barrier()


def recorded(protocol: str, body: Any = exchange) -> tuple[list[Recorder], list[Any]]:
    """Run `body` on 2 ranks, each with a Recorder plugin: the recorders and what the ranks returned."""
    recorders = [Recorder(), Recorder()]

    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)  # as the dsm plugin's CKPT_HOOKSPECS does
        plugins.register(recorders[rank], f"recorder-{rank}")
        return plugins

    results = run_ranks(2, body, protocol, plugins=host)
    return recorders, results


def test_async_fires_the_writer_side_and_the_home_side_hooks() -> None:
    (home, writer), _ = recorded("async")
    assert writer.seen["diff_created"] == writer.seen["diff_sent"] == 1
    assert writer.seen["lock_acquired"] == writer.seen["lock_released"] == 1
    assert home.seen["diff_received"] == home.seen["diff_applied"] == home.seen["diffs_received"] == 1
    assert home.applied == [(1, 0, 1)]  # rank 1's first interval, page 0 of array 0
    assert home.seen["page_served"] >= 1 and writer.seen["page_served"] == 0
    assert writer.seen["write_notices_received"] >= 1
    for rec in (home, writer):
        assert rec.seen["barrier_passed"] == 4
        assert rec.seen["interval_closed"] >= 1


def three_pages(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
    """Rank 0 homes three pages; rank 1 writes into all three in one interval (one lock hold).  Rank 1 returns
    how many DIFF messages it sent meanwhile, rank 0 what the three pages hold afterwards."""
    a = mem.array(3 * WORDS, np.float64)
    lock = mem.lock()
    if rt.rank == 0:
        with a.write(slice(0, 3 * WORDS)) as v:
            v[:] = 0.0  # first touch: rank 0 is the home of all three
    mem.barrier()
    before = mem.statistics().messages.get("diff", 0)
    if rt.rank == 1:
        with lock:
            for page in range(3):
                a[page * WORDS + 1] = page + 1.0
    sent = mem.statistics().messages.get("diff", 0) - before
    mem.barrier()
    held = [float(a[page * WORDS + 1]) for page in range(3)] if rt.rank == 0 else []
    mem.barrier()
    return held if rt.rank == 0 else sent


def test_async_sends_an_intervals_diffs_for_one_home_in_one_message() -> None:
    (home, writer), (held, sent) = recorded("async", three_pages)
    assert sent == 1  # one DIFF message (and one ack) for the three pages
    assert held == [1.0, 2.0, 3.0]
    # pages 0-2 of array 0, rank 1's first interval, in one call, made before any of them was applied
    assert home.messages == [(1, 1, [0, 1, 2], [0, 0, 0])]
    assert home.seen["diff_received"] == home.seen["diff_applied"] == 3
    assert writer.seen["diff_created"] == writer.seen["diff_sent"] == 3


def test_onesided_homes_see_no_diff_or_page_service_but_writers_do() -> None:
    (home, writer), _ = recorded("onesided")
    assert writer.seen["diff_created"] == writer.seen["diff_sent"] == 1
    assert home.seen["diff_received"] == home.seen["diff_applied"] == home.seen["page_served"] == 0
    assert home.seen["diffs_received"] == 0
    assert home.seen["barrier_passed"] == writer.seen["barrier_passed"] == 4


def test_cashmere_fires_the_lock_and_barrier_hooks_and_none_of_hlrcs() -> None:
    """It has no intervals, diffs, notices by message or page service: only its locks and barriers are hooks."""
    (home, writer), _ = recorded("cashmere")
    assert writer.seen["lock_acquired"] == writer.seen["lock_released"] == 1
    assert home.seen["barrier_passed"] == writer.seen["barrier_passed"] == 4
    fired = set(home.seen) | set(writer.seen)
    assert fired == {"lock_acquired", "lock_released", "barrier_passed"}, fired


def granted(mem: dsm.Memory, rt: ThreadRuntime, written: threading.Event) -> int:
    """Rank 0 homes a page and the lock and writes the page under it; rank 1 then takes the lock, whose grant
    carries the page (`Handler._riders`).  Rank 1's count of pages that came with grants."""
    a = mem.array(WORDS, np.float64)
    lock = mem.lock()
    if rt.rank == 0:
        a[0] = 1.0
    mem.barrier()
    if rt.rank == 0:
        with lock:
            a[1] = 2.0
        written.set()
    else:
        assert written.wait(10)
        with lock:
            assert a[1] == 2.0
    brought = mem.statistics().grant_pages
    mem.barrier()
    return brought


@pytest.mark.parametrize("protocol", dsm.HLRC)
def test_a_page_that_rides_with_a_grant_is_a_page_served_under_both_protocols(protocol: str) -> None:
    recorders = [Recorder(), Recorder()]
    written = threading.Event()

    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        plugins.register(recorders[rank], f"recorder-{rank}")
        return plugins

    _, brought = run_ranks(2, lambda mem, rt: granted(mem, rt, written), protocol, plugins=host)
    assert brought == 1 and recorders[0].seen["page_served"] == 1 and recorders[1].seen["page_served"] == 0


PLUGIN = """
import ckpt
CKPT_PLUGIN_API = 2

@ckpt.hookimpl
def dsm_barrier_passed(memory, epoch):
    pass
"""


def test_a_plugin_implementing_dsm_hooks_loads_with_the_dsm_plugin_and_not_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ckpt_dsmprobe.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = "ckpt_dsmprobe"
    host = PluginHost().load([plugin], [])
    assert {"dsm", "ckpt_dsmprobe"} <= {p.name for p in host.plugins}
    assert host.pm.hook.dsm_barrier_passed.spec is not None
    with pytest.raises(PluginError, match="dsm_barrier_passed"):
        PluginHost().load([plugin], ["dsm", "remotelog"])  # both bring the DSM hookspecs


def test_adding_the_dsm_hookspecs_twice_is_harmless() -> None:
    host = PluginHost().load([], [])
    host.add_hookspecs(dsm.hookspecs)
    host.add_hookspecs(dsm.hookspecs)
    assert host.pm.hook.dsm_diff_applied.spec is not None


class Failing:
    """A plugin whose hook fails on the handler thread (async homes fire dsm_page_served there)."""

    @ckpt.hookimpl
    def dsm_page_served(self, requester: int, gid: int) -> None:
        raise ValueError("the plugin is broken")


def test_a_hook_failing_on_the_handler_fails_that_request_and_the_handler_serves_on() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str:
        a = mem.array(WORDS, np.float64)
        if rt.rank == 0:
            a[0] = 1.0
        mem.barrier()
        outcome = "home"
        if rt.rank == 1:
            try:
                a[0]  # a page fault: rank 0 serves it, then its hook raises
                outcome = "no error"
            except dsm.DsmError as exc:
                named = "plugin 'failing' failed in dsm_page_served: ValueError: the plugin is broken"
                outcome = "refused" if named in str(exc) else str(exc)
        mem.barrier()  # the handler on rank 0 still serves: barriers go through it
        return outcome

    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        plugins.register(Failing(), "failing")
        return plugins

    assert run_ranks(2, body, "async", plugins=host) == ["home", "refused"]


class Ordered:
    """A plugin noting, in one list shared with the others, that it saw dsm_barrier_passed."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    @ckpt.hookimpl
    def dsm_barrier_passed(self, epoch: int) -> None:
        self.calls.append(self.name)


def test_dsm_hooks_run_down_in_registration_order_through_the_host() -> None:
    assert set(dsm.hookspecs.ORDER) == set(dsm._memory.HOOKS)  # every hook has a declared direction
    calls: dict[int, list[str]] = {0: [], 1: []}

    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        for name in ("first", "second", "third"):
            plugins.register(Ordered(name, calls[rank]), f"{name}-{rank}")
        return plugins

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        mem.barrier()
        mem.barrier()

    run_ranks(2, body, "async", plugins=host)
    assert calls == {rank: ["first", "second", "third"] * 2 for rank in (0, 1)}


class FailsOnTheProgramThread:
    @ckpt.hookimpl
    def dsm_barrier_passed(self, epoch: int) -> None:
        raise RuntimeError("no room for the log")


def test_a_hook_failing_on_the_program_thread_reaches_the_program_naming_the_plugin() -> None:
    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        plugins.register(FailsOnTheProgramThread(), "remote-log")
        return plugins

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        mem.barrier()

    expected = "plugin 'remote-log' failed in dsm_barrier_passed: RuntimeError: no room for the log"
    with pytest.raises(PluginError, match=expected):
        run_ranks(2, body, "async", plugins=host)


def test_without_implementations_no_dsm_hook_reaches_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a hook fires is decided once, at attach: the hot path makes no host call for hooks nobody implements."""
    called: list[str] = []
    real_call = PluginHost.call

    def counting(self: PluginHost, hook: str, **kwargs: Any) -> list[Any]:
        called.append(hook)
        return real_call(self, hook, **kwargs)

    monkeypatch.setattr(PluginHost, "call", counting)
    recorders = [Recorder(), Recorder()]

    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        if rank == 0:
            plugins.register(recorders[0], "recorder-0")
        return plugins

    run_ranks(2, exchange, "async", plugins=host)
    assert called and all(recorders[0].seen[hook.removeprefix("dsm_")] for hook in called)
    assert sum(recorders[0].seen.values()) == len(called)  # rank 1 has no implementation: it called nothing
    assert sum(recorders[1].seen.values()) == 0


def test_nothing_in_dsm_touches_the_pluggy_manager() -> None:
    for source in Path(dsm.__file__).parent.rglob("*.py"):
        text = source.read_text()
        for forbidden in ("pluggy", ".pm", ".hook."):
            assert forbidden not in text, f"{source.name} uses {forbidden!r}: go through rt.plugins"
