"""The async home's handler (`dsm._handler`): what it does with a diff message it cannot apply whole."""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import ckpt
import dsm
import dsm._handler
from ckpt.runtime.plugins import PluginHost
from ckpt.testing import ThreadRuntime
from dsm import Diff, DsmError
from dsm._memory import HANDLER_HOOKS
from dsm._messages import Ack, DiffRequest, PageReply, PageRequest

WORDS = 512  # float64 per 4 KiB page
GOOD = Diff.of_runs([(0, np.float64(7.0).tobytes())]).encode()  # page 0's first word becomes 7.0
DAMAGED = b"\xff\xff\xff\x00" + b"x" * 16  # a count larger than its payload


def _with(plugin: object, name: str) -> Any:
    """Each rank's plugin host (`run_ranks`' `plugins`): the DSM hookspecs and one `plugin` object."""

    def host(rank: int) -> PluginHost:
        plugins = PluginHost()
        plugins.add_hookspecs(dsm.hookspecs)
        plugins.register(plugin, name)
        return plugins

    return host


def _refused(mem: dsm.Memory, request: DiffRequest | PageRequest) -> str:
    """Send `request` to rank 0 as a writer or a reader would; the error the home answered with ("" if it
    acked or sent the page)."""
    expect = Ack if isinstance(request, DiffRequest) else PageReply
    try:
        mem._request(0, request, expect, "an answer from rank 0", timeout=20)
    except DsmError as exc:
        return str(exc)
    return ""


def _page_0_homed_at_rank_0(mem: dsm.Memory, rt: ThreadRuntime) -> None:
    """Collective: a one-page array that rank 0 writes first, so that it is the page's home."""
    a = mem.array(WORDS, np.float64)
    if rt.rank == 0:
        with a.write(slice(0, WORDS)) as v:
            v[:] = 0.0
    mem.barrier()


def send_each(requests: list[tuple[int, list[Any], list[Any]]]) -> Any:
    """A body: rank 0 homes two pages; rank 1 sends each (interval, gids, diffs) as a diff message.  Rank 1
    returns the errors; rank 0 what its pages and applied columns hold afterwards (checked by the test)."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(2 * WORDS, np.float64)
        if rt.rank == 0:
            with a.write(slice(0, 2 * WORDS)) as v:
                v[:] = 0.0  # rank 0 homes both pages
        mem.barrier()
        errors = []
        if rt.rank == 1:
            for interval, gids, diffs in requests:
                errors.append(_refused(mem, DiffRequest(mem._next_rid(), interval, gids, diffs)))
        mem.barrier()
        seen = None
        if rt.rank == 0:
            region = mem.regions[0]
            seen = (float(a[0]), int(region.meta[0, 1]), int(region.meta[1, 1]), mem.statistics().diffs_applied)
        mem.barrier()
        return errors if rt.rank == 1 else seen

    return body


@pytest.mark.parametrize(
    ("interval", "gids", "diffs", "why"),
    [
        (1, [0, 1], [GOOD, DAMAGED], "malformed diff"),  # the first decodes: it must not be applied either
        (1, [0, 1], [GOOD], "malformed diff message from rank 1: interval 1, 2 page(s), 1 diff(s)"),
        (1, [], [], "malformed diff message from rank 1: interval 1, 0 page(s), 0 diff(s)"),
        ("x", [0], [GOOD], "malformed diff message from rank 1: interval 'x', 1 page(s), 1 diff(s)"),
        (0, [0], [GOOD], "malformed diff message from rank 1: interval 0"),
        (1, 0, [GOOD], "malformed diff message from rank 1: interval 1, ? page(s), 1 diff(s)"),
        (1, [0, 5], [GOOD, GOOD], "no page 5"),  # the array has two pages
        (1, [0, -(1 << 32)], [GOOD, GOOD], "no page -4294967296"),  # would be array -1: the last one
    ],
    ids=[
        "damaged-second-diff",
        "a-page-without-its-diff",
        "no-pages",
        "interval-not-a-number",
        "interval-zero",
        "gids-not-a-list",
        "a-page-that-does-not-exist",
        "a-negative-page",
    ],
)
def test_a_diff_message_that_cannot_be_applied_whole_changes_no_page_and_gets_one_error(
    interval: Any, gids: Any, diffs: Any, why: str
) -> None:
    home, errors = run_ranks(2, send_each([(interval, gids, diffs)]), "async")
    assert len(errors) == 1 and why in errors[0] and errors[0].startswith("rank 0: "), errors
    assert home == (0.0, 0, 0, 0)  # page 0 untouched, neither applied column raised, nothing counted


class Refuser:
    """A plugin whose `dsm_diffs_received` refuses every message."""

    @ckpt.hookimpl
    def dsm_diffs_received(self, writer: int, interval: int, diffs: list[tuple[int, Any]]) -> None:
        raise RuntimeError("no room for this message")


def test_a_plugin_that_refuses_a_diff_message_leaves_every_page_as_it_was() -> None:
    home, errors = run_ranks(2, send_each([(1, [0, 1], [GOOD, GOOD])]), "async", plugins=_with(Refuser(), "refuser"))
    assert "plugin 'refuser' failed in dsm_diffs_received: RuntimeError: no room for this message" in errors[0]
    assert home == (0.0, 0, 0, 0)


class PageRefuser:
    """A plugin whose `dsm_diff_received` refuses page 1 (the message's second)."""

    @ckpt.hookimpl
    def dsm_diff_received(self, writer: int, gid: int, interval: int, diff: Any) -> None:
        if gid == 1:
            raise RuntimeError("not page 1")


def test_a_plugin_that_refuses_one_page_of_a_message_leaves_the_pages_before_it_as_they_were() -> None:
    """Every `dsm_diff_received` fires before any page changes: a refusal of the second page must not leave the
    first applied (and stamped) with no ack for it."""

    home, errors = run_ranks(
        2, send_each([(1, [0, 1], [GOOD, GOOD])]), "async", plugins=_with(PageRefuser(), "pagerefuser")
    )
    assert "plugin 'pagerefuser' failed in dsm_diff_received: RuntimeError: not page 1" in errors[0]
    assert home == (0.0, 0, 0, 0)


class ServeRefuser:
    """A plugin whose `dsm_page_served` refuses to serve rank 2."""

    @ckpt.hookimpl
    def dsm_page_served(self, requester: int, gid: int) -> None:
        if requester == 2:
            raise RuntimeError("not to rank 2")


def test_a_page_request_that_waited_for_a_diff_and_then_fails_gets_its_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 2 asks for page 0 holding rank 1's interval 5, which has not arrived: the request waits at the home.
    The diff comes and the waiting request is served -- and refused by a plugin.  Rank 2 must get that error at
    once; it used to go to the diff's writer instead, leaving rank 2 to its request's timeout."""
    queued = threading.Event()  # rank 2's request waits at the home
    page = dsm._handler.Handler._page
    homes: list[Any] = []
    standing: list[list[str]] = []

    def watched(self: Any, src: int, rid: int, gid: int, need: list[int]) -> None:
        page(self, src, rid, gid, need)
        if self.waiting:
            homes.append(self)
            queued.set()

    monkeypatch.setattr(dsm._handler.Handler, "_page", watched)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        _page_0_homed_at_rank_0(mem, rt)
        got: Any = None
        if rt.rank == 2:
            got = _refused(mem, PageRequest(mem._next_rid(), 0, [0, 5, 0]))
        elif rt.rank == 1:
            assert queued.wait(20), "rank 2's page request never waited at its home"
            # what `ckpt status` would show of it at rank 0 (beside rank 0's own arrival at the barrier)
            standing.append([fact for fact in homes[0].standing().values() if fact.startswith("page")])
            got = _refused(mem, DiffRequest(mem._next_rid(), 5, [0], [GOOD]))
        mem.barrier()
        return got

    started = time.monotonic()
    _, writer_error, requester_error = run_ranks(3, body, "async", plugins=_with(ServeRefuser(), "serverefuser"))
    assert writer_error == ""  # the diff was applied and acked
    assert "plugin 'serverefuser' failed in dsm_page_served: RuntimeError: not to rank 2" in requester_error
    assert time.monotonic() - started < 15, "rank 2 waited for its request's timeout"
    assert standing == [["page 0x0, wanted by rank 2, waits for diffs: rank 1's interval 5"]]


def test_a_good_diff_message_is_applied_whole_with_one_ack() -> None:
    home, errors = run_ranks(2, send_each([(3, [0, 1], [GOOD, GOOD])]), "async")
    assert errors == [""]
    assert home == (7.0, 3, 3, 2)


def test_every_handler_hook_fires_while_a_home_replays() -> None:
    """`Memory.hook` silences the program thread's hooks while a recovered rank replays (what it does was
    logged the first time) but not the handler's: a replaying home still applies -- and must still log -- the
    diffs others send it.  The set it spares is every hookspec documented as *handler*."""
    documented = {
        name
        for name, spec in inspect.getmembers(dsm.hookspecs, inspect.isfunction)
        if name.startswith("dsm_") and (spec.__doc__ or "").startswith("*handler*")
    }
    assert documented == set(HANDLER_HOOKS)


@pytest.mark.parametrize(("need", "count"), [(7, "?"), ([0], "1"), ([0, "x"], "2")])
def test_a_page_request_with_malformed_versions_gets_one_error_and_never_waits(need: Any, count: str) -> None:
    """A `need` that is not one version per rank would be broadcast by numpy and wait at the home for ever
    (and break what the home reports of its waiting requests): refused at once."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        _page_0_homed_at_rank_0(mem, rt)
        got = _refused(mem, PageRequest(mem._next_rid(), 0, need)) if rt.rank == 1 else None
        mem.barrier()
        return got, list(mem.handler.standing().values()) if rt.rank == 0 else None

    (_, home_facts), (error, _) = run_ranks(2, body, "async")
    assert f"malformed page request from rank 1: {count} version(s) for 2 ranks" in error
    assert not [fact for fact in home_facts if fact.startswith("page")]
