"""Unit tests of the coordinator's key-value store (no sockets, no threads: replies are recorded)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ckpt.coordinator.kvstore import KeyValueStore


class Replies:
    """A reply callable that records every payload it is given."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []

    def __call__(self, payload: dict[str, Any]) -> None:
        self.payloads.append(payload)

    @property
    def only(self) -> dict[str, Any]:
        assert len(self.payloads) == 1, self.payloads
        return self.payloads[0]


def subscribe(
    kv: KeyValueStore, ns: str, key: str, *, prefix: bool = False, count: int = 1, timeout: float = 60.0
) -> Replies:
    replies = Replies()
    kv.subscribe(ns, key, prefix=prefix, count=count, timeout=timeout, reply=replies)
    return replies


# ----------------------------------------------------------------- publish / get
def test_get_of_a_missing_key() -> None:
    assert KeyValueStore().get("ns", "k") == (False, None)


def test_publish_then_get() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", {"lid": 3})
    assert kv.get("ns", "k") == (True, {"lid": 3})
    kv.publish("ns", "k", b"new")
    assert kv.get("ns", "k") == (True, b"new")


def test_a_published_none_is_found() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", None)
    assert kv.get("ns", "k") == (True, None)


def test_namespaces_are_separate() -> None:
    kv = KeyValueStore()
    kv.publish("a", "k", 1)
    kv.publish("b", "k", 2)
    assert kv.get("a", "k") == (True, 1)
    assert kv.get("b", "k") == (True, 2)
    assert kv.get("c", "k") == (False, None)


# ----------------------------------------------------------------- subscribe: exact key
def test_subscribe_to_a_published_key_replies_at_once() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", 5)
    assert subscribe(kv, "ns", "k").only == {"value": 5}


def test_subscribe_blocks_until_the_key_is_published() -> None:
    kv = KeyValueStore()
    replies = subscribe(kv, "ns", "k")
    assert replies.payloads == []
    kv.publish("ns", "other", 1)
    kv.publish("other-ns", "k", 1)
    kv.publish("ns", "k-longer", 1)
    assert replies.payloads == []
    kv.publish("ns", "k", "here")
    assert replies.only == {"value": "here"}
    kv.publish("ns", "k", "again")
    assert replies.only == {"value": "here"}  # a subscriber is answered exactly once


def test_every_subscriber_of_a_key_is_answered() -> None:
    kv = KeyValueStore()
    waiting = [subscribe(kv, "ns", "k") for _ in range(4)]
    kv.publish("ns", "k", 9)
    assert [r.only for r in waiting] == [{"value": 9}] * 4


def test_subscribe_with_zero_timeout_still_sees_a_published_key() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", 1)
    assert subscribe(kv, "ns", "k", timeout=0).only == {"value": 1}


# ----------------------------------------------------------------- subscribe: prefix with count
def test_prefix_subscribe_waits_for_count_matching_keys() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "qp/0", "a")
    replies = subscribe(kv, "ns", "qp/", prefix=True, count=3)
    kv.publish("ns", "qp/1", "b")
    kv.publish("ns", "other/2", "x")
    kv.publish("other", "qp/2", "x")
    assert replies.payloads == []
    kv.publish("ns", "qp/1", "b2")  # overwriting does not add a key
    assert replies.payloads == []
    kv.publish("ns", "qp/2", "c")
    assert replies.only == {"values": {"qp/0": "a", "qp/1": "b2", "qp/2": "c"}}


def test_prefix_subscribe_already_satisfied_returns_every_match() -> None:
    kv = KeyValueStore()
    for i in range(5):
        kv.publish("ns", f"r{i}", i)
    kv.publish("ns", "x", "no")
    assert subscribe(kv, "ns", "r", prefix=True, count=2).only == {"values": {f"r{i}": i for i in range(5)}}


def test_prefix_subscribe_count_below_one_means_one() -> None:
    kv = KeyValueStore()
    replies = subscribe(kv, "ns", "p", prefix=True, count=0)
    assert replies.payloads == []
    kv.publish("ns", "p1", 1)
    assert replies.only == {"values": {"p1": 1}}


def test_empty_prefix_matches_the_whole_namespace() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "a", 1)
    kv.publish("ns", "b", 2)
    kv.publish("other", "c", 3)
    assert subscribe(kv, "ns", "", prefix=True, count=2).only == {"values": {"a": 1, "b": 2}}


# ----------------------------------------------------------------- expire
def test_expire_fails_only_subscribers_past_their_deadline() -> None:
    kv = KeyValueStore()
    now = time.monotonic()
    short = subscribe(kv, "ns", "k", timeout=1.0)
    long = subscribe(kv, "ns", "p/", prefix=True, count=2, timeout=100.0)
    assert kv.expire(now) == pytest.approx(now + 1.0, abs=0.5)
    assert short.payloads == [] and long.payloads == []

    upcoming = kv.expire(now + 10.0)
    assert "timed out waiting for key ns/k" in short.only["error"]
    assert long.payloads == []
    assert upcoming == pytest.approx(now + 100.0, abs=0.5)

    assert kv.expire(now + 1000.0) is None
    assert "timed out waiting for 2 keys with prefix ns/p/" in long.only["error"]
    kv.publish("ns", "k", 1)
    assert len(short.payloads) == 1  # an expired subscriber is not answered again


def test_expire_with_nothing_pending_returns_none() -> None:
    assert KeyValueStore().expire(time.monotonic()) is None


def test_a_satisfied_subscriber_is_not_failed_by_expire() -> None:
    kv = KeyValueStore()
    replies = subscribe(kv, "ns", "k", timeout=0.5)
    kv.publish("ns", "k", 1)
    assert kv.expire(time.monotonic() + 10.0) is None
    assert replies.only == {"value": 1}


def test_a_deadline_exactly_now_expires() -> None:
    kv = KeyValueStore()
    replies = subscribe(kv, "ns", "k", timeout=0)
    kv.expire(time.monotonic())
    assert "error" in replies.only


# ----------------------------------------------------------------- atomic ops
def test_incrby_starts_from_zero_and_accumulates() -> None:
    kv = KeyValueStore()
    assert kv.atomic("incrby", "ns", "c", 5) == 5
    assert kv.atomic("incrby", "ns", "c", -2) == 3
    assert kv.atomic("incrby", "ns", "c", 0) == 3
    assert kv.get("ns", "c") == (True, 3)


@pytest.mark.parametrize(
    ("op", "operands", "results"),
    [
        ("min", [7, 9, 3, 4], [7, 7, 3, 3]),
        ("max", [7, 9, 3, 12], [7, 9, 9, 12]),
    ],
)
def test_min_and_max(op: str, operands: list[int], results: list[int]) -> None:
    kv = KeyValueStore()
    assert [kv.atomic(op, "ns", "m", x) for x in operands] == results
    assert kv.get("ns", "m") == (True, results[-1])


def test_atomic_on_a_published_integer() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", 10)
    assert kv.atomic("min", "ns", "k", 20) == 10
    assert kv.atomic("incrby", "ns", "k", 1) == 11


def test_atomic_on_a_non_integer_is_refused_and_changes_nothing() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", "text")
    with pytest.raises(ValueError, match="ns/k holds a str, not an integer"):
        kv.atomic("incrby", "ns", "k", 1)
    assert kv.get("ns", "k") == (True, "text")


def test_unknown_atomic_op_is_refused_and_publishes_nothing() -> None:
    kv = KeyValueStore()
    with pytest.raises(ValueError, match="unknown atomic op 'mul'"):
        kv.atomic("mul", "ns", "k", 2)
    assert kv.get("ns", "k") == (False, None)


def test_atomic_wakes_subscribers() -> None:
    kv = KeyValueStore()
    replies = subscribe(kv, "ns", "counter")
    kv.atomic("incrby", "ns", "counter", 4)
    assert replies.only == {"value": 4}


# ----------------------------------------------------------------- allocate_ids
def test_allocate_ids_gives_disjoint_consecutive_ranges_from_one() -> None:
    kv = KeyValueStore()
    seen: set[int] = set()
    expected_first = 1
    for count in (1, 5, 2, 100, 1):
        first = kv.allocate_ids("vid:qp", count)
        assert first == expected_first
        block = set(range(first, first + count))
        assert not block & seen
        seen |= block
        expected_first += count


def test_allocate_ids_namespaces_are_independent() -> None:
    kv = KeyValueStore()
    assert kv.allocate_ids("a", 3) == 1
    assert kv.allocate_ids("b", 1) == 1
    assert kv.allocate_ids("a", 1) == 4
    assert kv.id_counters == {"a": 4, "b": 1}


def test_allocate_ids_continues_from_restored_counters() -> None:
    kv = KeyValueStore(id_counters={"vid:qp": 41})
    assert kv.allocate_ids("vid:qp", 2) == 42
    assert kv.allocate_ids("vid:qp", 1) == 44


# ----------------------------------------------------------------- generations
def test_new_generation_clears_values_but_keeps_id_counters() -> None:
    kv = KeyValueStore()
    kv.publish("ns", "k", 1)
    kv.atomic("incrby", "ns", "c", 1)
    kv.allocate_ids("vid:qp", 10)
    kv.new_generation(1)
    assert kv.generation == 1
    assert kv.get("ns", "k") == (False, None)
    assert kv.get("ns", "c") == (False, None)
    assert kv.allocate_ids("vid:qp", 1) == 11


def test_new_generation_fails_pending_subscribers() -> None:
    kv = KeyValueStore()
    exact = subscribe(kv, "ns", "k")
    pref = subscribe(kv, "ns", "p", prefix=True, count=2)
    kv.new_generation(3)
    assert exact.only == {"error": "key-value generation changed to 3"}
    assert pref.only == {"error": "key-value generation changed to 3"}
    kv.publish("ns", "k", 1)
    kv.publish("ns", "p1", 1)
    kv.publish("ns", "p2", 1)
    assert len(exact.payloads) == 1 and len(pref.payloads) == 1
    assert kv.expire(time.monotonic() + 1000.0) is None


def test_new_generation_does_not_answer_satisfied_subscribers_again() -> None:
    kv = KeyValueStore()
    replies = subscribe(kv, "ns", "k")
    kv.publish("ns", "k", 1)
    kv.new_generation(1)
    assert replies.only == {"value": 1}


def test_a_value_from_an_old_generation_never_satisfies_a_new_subscriber() -> None:
    kv = KeyValueStore()
    kv.publish("ib", "rank0/qpn", 100)
    kv.new_generation(1)
    replies = subscribe(kv, "ib", "rank0/qpn")
    assert replies.payloads == []
    kv.publish("ib", "rank0/qpn", 200)
    assert replies.only == {"value": 200}


def test_a_reply_that_publishes_wakes_the_next_subscriber() -> None:
    kv = KeyValueStore()
    second = Replies()

    def first(payload: dict[str, Any]) -> None:
        kv.publish("ns", "b", payload["value"] + 1)

    kv.subscribe("ns", "a", prefix=False, count=1, timeout=60.0, reply=first)
    kv.subscribe("ns", "b", prefix=False, count=1, timeout=60.0, reply=second)
    kv.publish("ns", "a", 1)
    assert second.only == {"value": 2}
    assert kv.expire(time.monotonic()) is None
