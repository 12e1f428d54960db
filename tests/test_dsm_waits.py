"""dsm._waits: the report of a rank's long waits, published off the waiting thread, the latest list last."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import dsm._waits
from ckpt.plugin import STATS_NS
from ckpt.testing import FakeKeyValue, wait_for
from dsm._waits import Standing, WaitReport, report

pytestmark = pytest.mark.timeout(30)


class Published:
    """A publish function that records every value (and can be made to fail or to block)."""

    def __init__(self) -> None:
        self.values: list[list[dict[str, Any]]] = []  # the waits of each publish
        self.facts: list[list[dict[str, Any]]] = []
        self.attempts = 0
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, waits: list[dict[str, Any]], facts: list[dict[str, Any]]) -> None:
        self.gate.wait(10)
        self.attempts += 1
        if self.fail:
            raise ConnectionError("the coordinator is gone")
        self.values.append(waits)
        self.facts.append(facts)

    def last(self) -> list[str] | None:
        return None if not self.values else [w["what"] for w in self.values[-1]]


def test_a_wait_is_published_with_when_it_began_and_gone_once_it_ends() -> None:
    published = Published()
    waits = WaitReport(published)
    before = time.time()
    end = waits.begin("lock 3", waited=2.5)
    wait_for(lambda: published.last() == ["lock 3"], 5, "the wait published")
    (value,) = published.values
    assert before - 2.5 <= value[0]["since"] <= time.time() - 2.5
    end()
    wait_for(lambda: published.last() == [], 5, "the wait's end published")


def test_nested_waits_are_listed_outermost_first_and_each_ends_alone() -> None:
    published = Published()
    waits = WaitReport(published)
    outer = waits.begin("barrier 4", waited=3.0)
    inner = waits.begin("room in the log rings", waited=2.0)
    wait_for(lambda: published.last() == ["barrier 4", "room in the log rings"], 5, "both waits")
    outer()
    wait_for(lambda: published.last() == ["room in the log rings"], 5, "the outer one gone")
    inner()
    wait_for(lambda: published.last() == [], 5, "none")


def test_the_latest_list_is_published_last_even_when_it_changes_during_a_publish() -> None:
    """A wait that begins and ends while a publish is under way (a slow coordinator): the last value the thread
    publishes is the current list, never a stale one."""
    published = Published()
    waits = WaitReport(published)
    published.gate.clear()  # the first publish blocks
    first = waits.begin("page 0x10003 from rank 2", waited=2.0)
    second = waits.begin("one-sided operations on rank 2", waited=2.0)
    second()
    first()
    published.gate.set()
    wait_for(lambda: published.last() == [], 5, "the empty list, last")
    assert len(published.values) <= 2  # changes made during one publish are coalesced into the next


def test_a_publish_that_fails_does_not_stop_the_next_one() -> None:
    published = Published()
    waits = WaitReport(published)
    published.fail = True
    end = waits.begin("lock 1", waited=2.0)
    wait_for(lambda: published.attempts == 1, 5, "a failed publish")
    assert not published.values
    published.fail = False
    end()
    wait_for(lambda: published.last() == [], 5, "the next publish")


def test_close_stops_the_publishing_thread() -> None:
    published = Published()
    waits = WaitReport(published)
    waits.begin("lock 1", waited=2.0)
    wait_for(lambda: published.values, 5, "the first publish")
    thread = waits._thread
    assert thread is not None and thread.is_alive()
    waits.close()
    thread.join(5)
    assert not thread.is_alive()


def test_close_publishes_the_latest_list_before_the_thread_ends() -> None:
    """A wait that ended while a publish was under way, then the memory closed: the empty list still goes out."""
    published = Published()
    waits = WaitReport(published)
    published.gate.clear()
    end = waits.begin("lock 1", waited=2.0)
    thread = waits._thread
    assert thread is not None
    end()
    waits.close()
    published.gate.set()
    thread.join(5)
    assert not thread.is_alive() and published.last() == []


def test_a_thread_that_cannot_start_fails_the_report_not_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    published = Published()
    waits = WaitReport(published)
    start = threading.Thread.start

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError):
        waits.begin("lock 1", waited=2.0)
    monkeypatch.setattr(threading.Thread, "start", start)
    waits.begin("barrier 2", waited=2.0)
    wait_for(lambda: published.last() == ["barrier 2"], 5, "the second, once a thread started")  # not the first


def test_a_report_that_fails_is_not_the_waits_failure() -> None:
    """`Endpoint.report_stuck`: too early, nobody to tell, or the report raising -- None, and the wait goes on."""
    from types import SimpleNamespace

    from dsm._net import STUCK_AFTER, Endpoint

    def broken(what: str, waited: float) -> Any:
        raise RuntimeError("can't start new thread")

    long_ago = time.monotonic() - STUCK_AFTER - 1
    assert Endpoint.report_stuck(SimpleNamespace(on_stuck=broken), "lock 1", long_ago) is None  # type: ignore[arg-type]
    assert Endpoint.report_stuck(SimpleNamespace(on_stuck=None), "lock 1", long_ago) is None  # type: ignore[arg-type]
    ends = []
    told = SimpleNamespace(on_stuck=lambda what, waited: lambda: ends.append(what))
    assert Endpoint.report_stuck(told, "lock 1", time.monotonic()) is None  # type: ignore[arg-type]
    end = Endpoint.report_stuck(told, "lock 1", long_ago)  # type: ignore[arg-type]
    assert end is not None
    end()
    assert ends == ["lock 1"]


def test_no_thread_is_started_until_a_wait_lasts() -> None:
    waits = WaitReport(Published())
    assert waits._thread is None


class Runtime:
    def __init__(self, kv: Any, incarnation: int = 0) -> None:
        self.kv, self.incarnation = kv, incarnation


def test_report_publishes_under_the_ranks_dsm_key_with_its_incarnation_then() -> None:
    """The incarnation is the runtime's when the report is published: a recovered rank's memory is restored
    (and its report made) before the runtime knows its new incarnation."""
    kv = FakeKeyValue()
    rt = Runtime(kv)
    waits = report(rt, rank=3)
    assert waits is not None
    rt.incarnation = 1
    end = waits.begin("barrier 7", waited=2.0)
    wait_for(lambda: kv.get(STATS_NS, "3/dsm"), 5, "the KV entry")
    value = kv.get(STATS_NS, "3/dsm")
    assert [w["what"] for w in value["waits"]] == ["barrier 7"] and value["incarnation"] == 1
    end()
    wait_for(lambda: kv.get(STATS_NS, "3/dsm")["waits"] == [], 5, "cleared")


def test_report_is_none_without_a_store() -> None:
    assert report(object(), rank=0) is None


def test_standing_facts_are_published_once_they_have_lasted_and_keep_their_start_as_their_text_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dsm._waits, "STUCK_AFTER", 2.0)
    published = Published()
    standing = Standing(WaitReport(published))
    lock = ("lock", 0)
    standing.look({lock: "lock 0 is held by rank 0, wanted by rank 1"}, now=100.0)
    standing.look({lock: "lock 0 is held by rank 0, wanted by rank 1"}, now=101.0)
    assert published.attempts == 0  # not yet 2 s: nothing to publish
    before = time.time()
    standing.look({lock: "lock 0 is held by rank 0, wanted by ranks 1, 2"}, now=102.5)  # a second waiter, same lock
    wait_for(lambda: published.facts, 5, "the fact published")
    ((fact,),) = published.facts
    assert fact["what"] == "lock 0 is held by rank 0, wanted by ranks 1, 2"
    assert before - 2.5 - 0.5 <= fact["since"] <= time.time() - 2.5  # since the lock was first seen standing
    standing.look({lock: "lock 0 is held by rank 0, wanted by ranks 1, 2"}, now=103.0)
    standing.look({}, now=103.5)  # it moved on
    wait_for(lambda: published.facts[-1] == [], 5, "the fact taken back")
    assert len(published.facts) == 2  # an unchanged fact is not published again
    standing.look({lock: "lock 0 is held by rank 2, wanted by rank 1"}, now=104.0)
    assert standing.first == {lock: 104.0}  # a new stand starts afresh


def test_a_fact_whose_report_failed_is_reported_again_at_the_next_look(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dsm._waits, "STUCK_AFTER", 0.0)
    published = Published()
    report = WaitReport(published)
    standing = Standing(report)
    calls: list[int] = []
    set_facts = report.set_facts

    def failing_once(facts: list[tuple[str, float]]) -> None:
        calls.append(len(facts))
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        set_facts(facts)

    monkeypatch.setattr(report, "set_facts", failing_once)
    with pytest.raises(RuntimeError):
        standing.look({("barrier", 3): "barrier 3 waits for rank 2 (ranks 0, 1 arrived)"}, now=1.0)
    standing.look({("barrier", 3): "barrier 3 waits for rank 2 (ranks 0, 1 arrived)"}, now=2.0)
    assert calls == [1, 1]
    wait_for(lambda: published.facts, 5, "the second try published")
    assert [f["what"] for f in published.facts[-1]] == ["barrier 3 waits for rank 2 (ranks 0, 1 arrived)"]


def test_closing_a_memory_takes_back_what_stood_at_its_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Memory.close`: its handler is gone, so nothing stands there any more -- published before the report's
    thread ends (a rank that goes on running must not show a lock held for ever)."""
    import dsm

    published = Published()
    report = WaitReport(published)
    report.set_facts([("lock 0 is held by rank 0, wanted by rank 1", time.time())])
    wait_for(lambda: published.facts, 5, "the fact")
    mem = dsm.Memory.__new__(dsm.Memory)
    assert Standing(WaitReport(Published())).clear() is None  # nothing shown: nothing to take back, no thread
    closed: list[bool] = []
    standing = Standing(report)
    standing.shown = ["lock 0 is held by rank 0, wanted by rank 1"]
    ctx = type("Ctx", (), {"close": lambda self: None})()
    mem.__dict__.update(_wait_report=report, _standing=standing, _plugins=None, ctx=ctx, rank=0)
    monkeypatch.setattr(dsm.Memory, "_halt", lambda self: closed.append(True))
    mem.close()
    assert closed == [True]
    thread = report._thread
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive() and published.facts[-1] == []
