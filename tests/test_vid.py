"""Unit tests of the virtual-ID tables."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import cloudpickle
import pytest

from ckpt._errors import CkptError
from ckpt.plugin import VirtualIdTable
from ckpt.plugin import _vid as vid


@pytest.fixture(autouse=True)
def no_global_allocator() -> Iterator[None]:
    vid.set_global_allocator(None)
    yield
    vid.set_global_allocator(None)


class CountingAllocator:
    """Stands in for the coordinator: per-namespace counters starting at `start`."""

    def __init__(self, start: int = 1) -> None:
        self.start = start
        self.counters: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []

    def __call__(self, ns: str, count: int) -> int:
        self.calls.append((ns, count))
        first = self.counters.get(ns, self.start)
        self.counters[ns] = first + count
        return first


# ----------------------------------------------------------------- allocate / add / bind
def test_allocate_is_unique_and_starts_at_first() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp", first=100)
    ids = [table.allocate() for _ in range(10)]
    assert ids == list(range(100, 110))


def test_add_binds_both_ways() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    a, b = table.add(0x1234), table.add(0x99)
    assert a != b
    assert table.real(a) == 0x1234 and table.real(b) == 0x99
    assert table.virtual(0x1234) == a and table.virtual(0x99) == b
    assert len(table) == 2 and a in table and b in table and 12345 not in table
    assert sorted(table) == sorted([a, b])
    assert sorted(table.items()) == sorted([(a, 0x1234), (b, 0x99)])


def test_allocate_skips_ids_bound_explicitly() -> None:
    table: VirtualIdTable[str] = VirtualIdTable("pd")
    table.bind(1, "x")
    table.bind(2, "y")
    table.bind(4, "z")
    assert [table.allocate() for _ in range(3)] == [3, 5, 6]


def test_a_removed_virtual_id_is_not_handed_out_again() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("mr")
    first = table.add(10)
    table.remove(first)
    assert table.add(10) != first


def test_tuple_reals_are_allowed() -> None:
    table: VirtualIdTable[tuple[int, int]] = VirtualIdTable("rkey")
    v = table.add((3, 0xABC))
    assert table.virtual((3, 0xABC)) == v


def test_bind_refuses_a_bound_virtual_id() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    table.bind(7, 70)
    with pytest.raises(CkptError, match="qp: virtual id 7 is already bound"):
        table.bind(7, 71)
    assert table.real(7) == 70
    with pytest.raises(CkptError):
        table.virtual(71)


def test_bind_refuses_a_bound_real_id() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    table.bind(7, 70)
    with pytest.raises(CkptError, match="qp: real id 70 is already bound to 7"):
        table.bind(8, 70)
    assert 8 not in table
    with pytest.raises(CkptError, match="already bound"):
        table.add(70)
    assert len(table) == 1


# ----------------------------------------------------------------- real / virtual lookups
def test_lookups_of_unknown_ids_raise_ckpt_error() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("lkey")
    with pytest.raises(CkptError, match="lkey: unknown virtual id 5"):
        table.real(5)
    with pytest.raises(CkptError, match="lkey: no virtual id for real 5"):
        table.virtual(5)


# ----------------------------------------------------------------- update / remove
def test_update_rebinds_a_virtual_id_to_a_new_real() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    v = table.add(100)
    table.update(v, 200)
    assert table.real(v) == 200
    assert table.virtual(200) == v
    with pytest.raises(CkptError):
        table.virtual(100)
    table.add(100)  # the old real id is free again


def test_update_to_the_same_real_is_a_no_op() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    v = table.add(100)
    table.update(v, 100)
    assert table.real(v) == 100 and table.virtual(100) == v


def test_update_can_swap_reals_through_a_free_value() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    a, b = table.add(1), table.add(2)
    table.update(a, 3)
    table.update(b, 1)
    table.update(a, 2)
    assert (table.real(a), table.real(b)) == (2, 1)
    assert (table.virtual(2), table.virtual(1)) == (a, b)
    with pytest.raises(CkptError):
        table.virtual(3)


def test_update_of_an_unknown_virtual_id_raises() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    with pytest.raises(CkptError, match="qp: unknown virtual id 9"):
        table.update(9, 1)
    assert len(table) == 0


def test_update_to_a_real_bound_elsewhere_takes_over_its_reverse_mapping() -> None:
    """After a restart every real id is stale: a new real may equal another entry's old one."""
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    a, b = table.add(1), table.add(2)
    table.update(a, 2)
    assert table.real(a) == 2 and table.virtual(2) == a
    table.update(b, 1)
    assert table.real(b) == 1 and table.virtual(1) == b


def test_remove_forgets_both_directions() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("cq")
    v = table.add(5)
    table.remove(v)
    assert v not in table and len(table) == 0
    with pytest.raises(CkptError):
        table.real(v)
    with pytest.raises(CkptError):
        table.virtual(5)
    table.bind(v, 6)  # the virtual id can be bound again explicitly


def test_remove_of_an_unknown_virtual_id_raises_ckpt_error() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("cq")
    with pytest.raises(CkptError, match="unknown virtual id 3"):
        table.remove(3)


def test_iteration_is_over_a_snapshot() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    for real in range(5):
        table.add(real)
    for v in table:
        table.remove(v)
    assert len(table) == 0


# ----------------------------------------------------------------- pickling
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_pickle_round_trip_keeps_both_maps_and_the_allocator_position(dumps: object) -> None:
    table: VirtualIdTable[int | tuple[int, int]] = VirtualIdTable("rkey", first=10)
    a = table.add(0xAAAA)
    b = table.add((1, 2))
    table.bind(50, 0xBBBB)
    table.update(a, 0xCCCC)
    table.remove(b)

    copy = pickle.loads(dumps(table))  # type: ignore[operator]
    assert copy.name == "rkey"
    assert sorted(copy.items()) == sorted(table.items())
    assert copy.real(a) == 0xCCCC and copy.virtual(0xCCCC) == a
    assert copy.virtual(0xBBBB) == 50
    with pytest.raises(CkptError):
        copy.virtual(0xAAAA)
    with pytest.raises(CkptError):
        copy.virtual((1, 2))
    assert copy.allocate() == table.allocate()  # neither reuses an id handed out before
    assert copy.allocate() not in {a, b, 50}


def test_a_restarted_table_maps_old_virtual_ids_to_new_reals() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    ids = [table.add(real) for real in (0x11, 0x12, 0x13)]
    restored: VirtualIdTable[int] = pickle.loads(pickle.dumps(table))
    for v, new_real in zip(ids, (0x51, 0x52, 0x53), strict=True):
        restored.update(v, new_real)
    assert [restored.real(v) for v in ids] == [0x51, 0x52, 0x53]
    assert [restored.virtual(r) for r in (0x51, 0x52, 0x53)] == ids
    for stale in (0x11, 0x12, 0x13):
        with pytest.raises(CkptError):
            restored.virtual(stale)


def test_restart_where_the_new_reals_permute_the_old_ones() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("lid")
    a, b = table.add(1), table.add(2)
    restored: VirtualIdTable[int] = pickle.loads(pickle.dumps(table))
    restored.update(a, 2)  # the new fabric gave port a the LID port b had before
    restored.update(b, 1)
    assert (restored.real(a), restored.real(b)) == (2, 1)
    assert (restored.virtual(2), restored.virtual(1)) == (a, b)


def test_pickled_state_does_not_contain_the_global_allocator() -> None:
    vid.set_global_allocator(CountingAllocator())
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    table.add(1, global_id=True)
    state = table.__getstate__()
    assert set(state) == {"name", "next", "to_real"}
    pickle.dumps(table)


# ----------------------------------------------------------------- global allocation
def test_allocate_global_without_a_coordinator_raises() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    with pytest.raises(CkptError, match=r"allocate_global\(\) needs a running ckpt rank"):
        table.allocate_global()
    with pytest.raises(CkptError, match="needs a running ckpt rank"):
        table.add(5, global_id=True)
    assert len(table) == 0


def test_allocate_global_asks_the_allocator_in_the_table_namespace() -> None:
    allocator = CountingAllocator(start=1000)
    vid.set_global_allocator(allocator)
    qp: VirtualIdTable[int] = VirtualIdTable("qp")
    cq: VirtualIdTable[int] = VirtualIdTable("cq")
    assert qp.allocate_global() == 1000
    assert qp.allocate_global() == 1001
    assert cq.allocate_global() == 1000
    assert allocator.calls == [("vid:qp", 1), ("vid:qp", 1), ("vid:cq", 1)]


def test_add_with_global_id_binds_the_allocated_id() -> None:
    vid.set_global_allocator(CountingAllocator(start=500))
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    v = table.add(0x77, global_id=True)
    assert v == 500
    assert table.real(500) == 0x77 and table.virtual(0x77) == 500


def test_global_ids_of_two_tables_with_one_name_never_collide() -> None:
    vid.set_global_allocator(CountingAllocator())
    rank0: VirtualIdTable[int] = VirtualIdTable("qp")
    rank1: VirtualIdTable[int] = VirtualIdTable("qp")
    ids = [rank0.add(i, global_id=True) for i in range(5)] + [rank1.add(i, global_id=True) for i in range(5)]
    assert len(set(ids)) == 10


def test_a_global_id_after_local_ones_does_not_collide() -> None:
    # The documented use: objects created before a checkpoint got local ids; objects created
    # after a restart take global ids so that they cannot collide with those.
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    local = [table.add(real) for real in (0x10, 0x11)]
    restored: VirtualIdTable[int] = pickle.loads(pickle.dumps(table))
    vid.set_global_allocator(CountingAllocator())  # a fresh job's coordinator counts from 1
    new = restored.add(0x20, global_id=True)
    assert new not in local
    assert restored.real(new) == 0x20


def test_local_allocation_skips_ids_taken_globally() -> None:
    vid.set_global_allocator(CountingAllocator(start=1))
    table: VirtualIdTable[int] = VirtualIdTable("qp")
    g = table.add(0x30, global_id=True)
    assert table.add(0x31) != g


def test_repr_names_the_table_and_its_size() -> None:
    table: VirtualIdTable[int] = VirtualIdTable("lid")
    table.add(3)
    assert repr(table) == "VirtualIdTable('lid', 1 entries)"
