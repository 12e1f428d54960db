"""Tests of image pickling: naming the part of a state that does not pickle (`find_unpicklable`)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest

from ckpt.runtime import _pickling
from ckpt.runtime._pickling import Unpicklable, find_unpicklable, pickling_error

LOCK_REASON = "TypeError: cannot pickle '_thread.lock' object"


class Holder:
    """A program-like object: its attributes are its state."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


class Slotted:
    __slots__ = ("count", "guard")

    def __init__(self, count: int, guard: object) -> None:
        self.count, self.guard = count, guard


class LeavesOut:
    """Picklable through __getstate__, which drops what its __dict__ holds that is not (as verbs shadows do)."""

    def __init__(self) -> None:
        self.real = threading.Lock()
        self.value = 3

    def __getstate__(self) -> dict[str, Any]:
        return {"value": self.value}


def test_state_that_pickles_gives_none() -> None:
    assert find_unpicklable(Holder(a=np.zeros(10), b=[1, {"c": LeavesOut()}]), "program") is None


def test_nested_attribute() -> None:
    sock = socket.socket()
    try:
        found = find_unpicklable(Holder(steps=3, conn=Holder(host="h", _sock=sock)), "program")
    finally:
        sock.close()
    assert found == Unpicklable("program.conn._sock", "socket.socket", "TypeError: cannot pickle 'socket' object")
    assert found.name == "program.conn._sock (a socket.socket)"


def test_dict_value_and_list_item() -> None:
    found = find_unpicklable(Holder(config={"io": {"lock": threading.Lock()}}), "program")
    assert found is not None and found.path == "program.config['io']['lock']"
    found = find_unpicklable(Holder(items=[1, "two", np.ones(3), threading.Lock()]), "program")
    assert found == Unpicklable("program.items[3]", "_thread.lock", LOCK_REASON)
    assert str(found) == f"attribute program.items[3] (a _thread.lock) cannot be pickled: {LOCK_REASON}"


def test_a_root_dicts_keys_name_its_parts() -> None:
    graph = {"program": Holder(lock=threading.Lock()), "runtime": {"step": 3}}
    found = find_unpicklable(graph)
    assert found is not None and found.path == "program.lock"
    assert find_unpicklable(threading.Lock()) == Unpicklable("<root>", "_thread.lock", LOCK_REASON)
    assert str(find_unpicklable(threading.Lock())).startswith("<root> (a _thread.lock) cannot be pickled")


def test_slots_object() -> None:
    found = find_unpicklable(Holder(counter=Slotted(1, threading.Lock())), "program")
    assert found is not None and found.path == "program.counter.guard" and found.type_name == "_thread.lock"


def test_what_getstate_leaves_out_is_not_blamed() -> None:
    found = find_unpicklable(Holder(shadow=LeavesOut(), other=threading.RLock()), "program")
    assert found is not None and found.path == "program.other"


def test_a_cycle_is_followed_once_and_the_shortest_path_named() -> None:
    a, b = Holder(name="a"), Holder(name="b")
    a.peer, b.peer = b, a  # type: ignore[attr-defined]
    b.guard = threading.Lock()  # type: ignore[attr-defined]
    found = find_unpicklable(Holder(first=a, second=b), "program")
    assert found is not None and found.path == "program.second.guard"  # not program.first.peer.guard
    found = find_unpicklable(a, "program")
    assert found is not None and found.path == "program.peer.guard"


def test_a_function_closing_over_a_lock_is_named_as_a_whole() -> None:
    guard = threading.Lock()
    found = find_unpicklable(Holder(callback=lambda: guard.locked()), "program")
    assert found == Unpicklable("program.callback", "function", LOCK_REASON)


def test_depth_limit_names_the_deepest_object_reached_not_exactly() -> None:
    root = node = Holder()
    for _ in range(40):
        node.next = Holder()  # type: ignore[attr-defined]
        node = node.next  # type: ignore[attr-defined]
    node.guard = threading.Lock()  # type: ignore[attr-defined]
    found = find_unpicklable(root, "program")
    assert found is not None and not found.exact
    assert found.path == "program" + ".next" * 32 and found.type_name.endswith("Holder")
    assert found.name.startswith("something inside program.next.next")
    assert str(found).startswith("something inside attribute program.next")
    assert found.reason == LOCK_REASON


def test_budget_of_test_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pickling, "_FIND_CHECKS", 3)
    found = find_unpicklable(Holder(items=[[i] for i in range(10)] + [threading.Lock()]), "program")
    assert found is not None and not found.exact and found.path == "program.items"


class FailsOnce:
    """Fails to pickle the first time only, as a dict another thread changes under the pickler does."""

    def __init__(self) -> None:
        self.calls = 0

    def __reduce__(self) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return (int, (0,))


def test_a_failure_that_does_not_repeat_is_not_blamed() -> None:
    assert find_unpicklable(Holder(racy=FailsOnce()), "program") is None


class Grower:
    """Adds a key to `shared` each time it is pickled, up to its `pickles_at`-th time (0: every time): the dict
    the pickler is iterating grows under it, as one another thread writes to does."""

    def __init__(self, shared: dict[str, Any], pickles_at: int) -> None:
        self.shared, self.pickles_at, self.calls = shared, pickles_at, 0

    def __reduce__(self) -> Any:
        self.calls += 1
        if self.pickles_at == 0 or self.calls < self.pickles_at:
            self.shared[f"k{self.calls}"] = 0
        return (int, (0,))


def growing(pickles_at: int) -> dict[str, Any]:
    """A dict whose pickling raises "dictionary changed size during iteration" (from the C pickler) until
    its `pickles_at`-th try (0: always)."""
    shared: dict[str, Any] = {}
    shared["grower"] = Grower(shared, pickles_at)
    return shared


class SaysItChanged:
    """A reducer of its own that raises the words of a race: a defect of the object, not a race."""

    def __reduce__(self) -> Any:
        raise RuntimeError("dictionary changed size during iteration")


@pytest.mark.parametrize("pickles_at", [4, 0])  # still racing at its 4th try (as right after setup), or always
def test_state_another_thread_keeps_changing_is_not_blamed(pickles_at: int) -> None:
    assert find_unpicklable(Holder(count=1, racy=growing(pickles_at)), "program") is None


def test_a_lock_beside_state_that_keeps_changing_is_still_named() -> None:
    culprit = find_unpicklable(Holder(racy=growing(0), guard=threading.Lock()), "program")
    assert culprit is not None and culprit.path == "program.guard" and culprit.reason == LOCK_REASON


def test_an_objects_own_error_that_reads_like_a_race_is_blamed() -> None:
    culprit = find_unpicklable(Holder(bad=SaysItChanged()), "program")
    assert culprit is not None and culprit.path == "program.bad"
    assert culprit.reason == "RuntimeError: dictionary changed size during iteration"


def test_the_retries_of_one_search_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[int] = []
    pickle = _pickling.pickling_error
    monkeypatch.setattr(_pickling, "pickling_error", lambda obj: tries.append(1) or pickle(obj))
    state = Holder(**{f"racy{i}": growing(0) for i in range(50)})
    assert find_unpicklable(state, "program") is None
    assert len(tries) <= 51 + _pickling._RACE_BUDGET + 1  # one try per object and the budget's retries


def test_probe_copies_no_buffer() -> None:
    """The probe drops out-of-band buffers: pickling a big array writes a few bytes only."""
    sink = _pickling._Sink()
    _pickling._ImagePickler(sink, _pickling._OutOfBand(keep=False)).dump(Holder(big=np.ones(1 << 20)))
    assert sink.bytes < 1000
    assert pickling_error(Holder(big=np.ones(1 << 20))) is None


def test_a_generator_is_named_and_an_object_array_walked_into() -> None:
    found = find_unpicklable(Holder(numbers=(i for i in range(3))), "program")
    assert found is not None and found.path == "program.numbers" and found.type_name == "generator"
    cells = np.empty(2, dtype=object)
    cells[:] = [1, threading.Lock()]
    found = find_unpicklable(Holder(cells=cells), "program")
    assert found is not None and found.path.startswith("program.cells") and found.type_name == "_thread.lock"
