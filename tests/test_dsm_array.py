"""Unit tests of dsm.SharedArray on one thread-rank: which pages an index maps to, views, argument errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime
from dsm import DsmError, SharedArray

pytestmark = pytest.mark.timeout(60)


def pages_of(shape: int | tuple[int, ...], dtype: Any, indexes: list[Any], page_size: int = 4096) -> list[list[int]]:
    """The pages each index of `indexes` maps to, on a fresh array of `shape` and `dtype` (one rank)."""

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> list[list[int]]:
        a = mem.array(shape, dtype)
        return [a._pages(a._view, index).tolist() for index in indexes]

    pages: list[list[int]] = run_ranks(1, body, "async", page_size=page_size)[0]
    return pages


def on_one_rank(body: Any, **attach: Any) -> Any:
    return run_ranks(1, body, "async", **attach)[0]


# ----------------------------------------------------------------- page mapping
def test_a_row_slice_maps_to_exactly_the_pages_of_those_rows() -> None:
    # 512 float64 = one 4 KiB page per row; 256 float64 = two rows per page
    assert pages_of((16, 512), np.float64, [np.s_[3:6], np.s_[0:1], np.s_[15:], np.s_[:]]) == [
        [3, 4, 5],
        [0],
        [15],
        list(range(16)),
    ]
    assert pages_of((32, 256), np.float64, [np.s_[3:6], np.s_[4:6], np.s_[5:6]]) == [[1, 2], [2], [2]]


def test_a_scalar_index_maps_to_the_one_page_of_its_element() -> None:
    assert pages_of((16, 512), np.float64, [(3, 7), (3, 511), 0, -1]) == [[3], [3], [0], [15]]
    assert pages_of(64, np.int64, [0, 7, 8, 63], page_size=64) == [[0], [0], [1], [7]]


def test_an_element_that_straddles_a_page_boundary_maps_to_both_pages() -> None:
    # itemsize 12, 64-byte pages: element 5 is bytes 60..71, element 4 bytes 48..59
    assert pages_of(40, "V12", [5, 4, np.s_[5:6], [5], [4, 5]], page_size=64) == [
        [0, 1],
        [0],
        [0, 1],
        [0, 1],
        [0, 1],
    ]
    packed = np.dtype([("a", "<i4"), ("b", "<f8")])  # a structured dtype, also 12 bytes
    assert pages_of(40, packed, [5, 21], page_size=64) == [[0, 1], [3, 4]]


def test_a_fancy_index_maps_element_by_element() -> None:
    # 8 int64 per 64-byte page: the pages between the first and the last element are not all touched
    assert pages_of(64, np.int64, [[0, 17, 63], [63, 0, 0], np.array([9, 10, 11])], page_size=64) == [
        [0, 2, 7],
        [0, 7],
        [1],
    ]
    assert pages_of((8, 8), np.int64, [([0, 7], [0, 7]), (slice(None), [0])], page_size=64) == [
        [0, 7],
        list(range(8)),
    ]


def test_a_boolean_mask_maps_element_by_element() -> None:
    mask = np.zeros(64, dtype=bool)
    mask[[9, 40, 41]] = True
    assert pages_of(64, np.int64, [mask, np.zeros(64, dtype=bool)], page_size=64) == [[1, 5], []]


def test_an_empty_slice_maps_to_no_page() -> None:
    assert pages_of((16, 512), np.float64, [np.s_[5:5], np.s_[3:6, 4:4], np.array([], dtype=np.int64)]) == [
        [],
        [],
        [],
    ]


def test_a_strided_slice_maps_to_a_superset_of_its_pages() -> None:
    # basic indexes are over-approximated by their byte bounds: never fewer pages than touched
    assert pages_of(64, np.int64, [np.s_[::16], np.s_[1:60:20]], page_size=64) == [
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5],
    ]
    assert pages_of((8, 8), np.int64, [np.s_[:, 0]], page_size=64) == [list(range(8))]


def test_an_index_with_a_leading_ellipsis_selects_as_in_numpy() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array((8, 8), np.int64)
        a[:, 3] = np.arange(8)
        with a.read(np.s_[..., 3]) as column:
            seen = column.tolist()
        return seen, a._pages(a._view, np.s_[..., 3]).tolist(), a[..., 2, 3]

    assert on_one_rank(body, page_size=64) == (list(range(8)), list(range(8)), 2)


def test_a_whole_array_smaller_than_a_page_is_one_page() -> None:
    assert pages_of(3, np.float64, [..., np.s_[:], 2]) == [[0], [0], [0]]


# ----------------------------------------------------------------- views and values
def test_the_view_of_a_read_is_read_only() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        a = mem.array((4, 4), np.float64)
        a[1, 2] = 5.0
        with a.read() as v:
            assert not v.flags.writeable
            assert v[1, 2] == 5.0
            with pytest.raises(ValueError, match="read-only"):
                v[0, 0] = 1.0
        with a.read(np.s_[1]) as row:
            assert not row.flags.writeable
        assert a[0, 0] == 0.0

    on_one_rank(body)


def test_a_write_view_changes_the_array_and_getitem_returns_a_copy() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        a = mem.array(10, np.int32)
        with a.write(np.s_[2:5]) as v:
            v[:] = [7, 8, 9]
        copy = a[2:5]
        copy[:] = 0
        assert a[2:5].tolist() == [7, 8, 9]
        assert np.asarray(a).tolist() == [0, 0, 7, 8, 9, 0, 0, 0, 0, 0]
        assert isinstance(a, SharedArray) and len(a) == 10 and a.shape == (10,) and a.dtype == np.int32

    on_one_rank(body)


@pytest.mark.parametrize("kind", ["fancy", "mask"])
def test_write_with_a_fancy_index_or_a_mask_is_refused_not_silently_lost(kind: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> list[int] | str:
        a = mem.array(8, np.int64)
        index: Any = [1, 3] if kind == "fancy" else np.arange(8) % 2 == 1
        try:
            with a.write(index) as v:
                v[...] = 5
        except DsmError as exc:
            return str(exc)
        return list(a[...].tolist())

    result = on_one_rank(body)
    assert isinstance(result, str) and "needs a basic index" in result, result


def test_writing_a_scalar_index_through_write_raises() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        a = mem.array(10, np.float64)
        with pytest.raises(DsmError, match="needs an index that selects an array"), a.write(3):
            pass
        a[3] = 1.5  # the way to write one element
        assert a[3] == 1.5

    on_one_rank(body)


def test_an_out_of_range_index_raises_index_error() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        a = mem.array((4, 5), np.float64)
        with pytest.raises(IndexError, match=r"shape \(4, 5\)"):
            a[4, 0]
        with pytest.raises(IndexError):
            a[0, -6]
        with pytest.raises(IndexError):
            a[[0, 9]]
        with pytest.raises(IndexError):
            a[7] = 1.0
        with pytest.raises(IndexError), a.read((0, 5)):
            pass
        with pytest.raises(IndexError), a.write(np.s_[9, :]):
            pass

    on_one_rank(body)


# ----------------------------------------------------------------- attach arguments
@pytest.mark.parametrize("page_size", [1000, 32, 0, 4097])
def test_a_bad_page_size_is_refused(page_size: int) -> None:
    with pytest.raises(DsmError, match=f"page size must be a power of two of at least 64 bytes, not {page_size}"):
        on_one_rank(lambda mem, rt: None, page_size=page_size)


def test_an_unknown_protocol_is_refused_naming_the_choices() -> None:
    with pytest.raises(DsmError, match=r"unknown DSM protocol 'twosided': choose one of async, onesided"):
        run_ranks(1, lambda mem, rt: None, "twosided")


def test_the_smallest_page_size_64_is_accepted() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[int, int]:
        a = mem.array(100, np.int64)
        a[99] = 3
        return mem.page_size, a._region.npages

    assert on_one_rank(body, page_size=64) == (64, 13)


def test_write_of_an_empty_basic_slice_is_a_no_op() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> int:
        a = mem.array(8, np.float64)
        with a.write(slice(2, 2)) as v:
            assert v.size == 0
        return mem.statistics().write_faults

    assert on_one_rank(body) == 0
