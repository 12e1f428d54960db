"""Unit tests of the run-length page diffs (dsm._diff): make_diff, Diff (apply, encode, decode)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsm._diff import EMPTY, Diff, diff_unit, make_diff
from dsm._errors import DsmError

PAGE = 4096


def page_of(values: dict[int, int], size: int = 64) -> np.ndarray:
    page = np.zeros(size, dtype=np.uint8)
    for offset, value in values.items():
        page[offset] = value
    return page


def assert_maximal(diff: Diff, page: np.ndarray, twin: np.ndarray) -> None:
    """Every run is changed bytes only, runs are sorted and never touch, and they cover every changed byte."""
    covered = np.zeros(page.size, dtype=bool)
    end = -1
    for offset, data in diff:
        assert data, "empty run"
        assert offset > end, f"run at {offset} touches or overlaps the previous one (ending at {end})"
        run = slice(offset, offset + len(data))
        assert bytes(page[run]) == data
        assert np.all(page[run] != twin[run]), f"run at {offset} holds unchanged bytes"
        covered[run] = True
        end = offset + len(data)
    assert np.array_equal(covered, page != twin)


# ----------------------------------------------------------------- make_diff
def test_an_unchanged_page_has_an_empty_diff() -> None:
    page = np.arange(PAGE, dtype=np.int64).astype(np.uint8)
    diff = make_diff(page, page.copy())
    assert not diff and len(diff) == 0 and diff.nbytes == 0 and diff == EMPTY


def test_adjacent_changed_bytes_merge_into_one_run() -> None:
    twin = page_of({})
    page = page_of({3: 1, 4: 2, 5: 3})
    assert make_diff(page, twin).runs() == [(3, b"\x01\x02\x03")]


def test_one_unchanged_byte_between_changes_splits_the_run() -> None:
    twin = page_of({})
    page = page_of({3: 1, 5: 2, 6: 3, 10: 4})
    assert make_diff(page, twin).runs() == [(3, b"\x01"), (5, b"\x02\x03"), (10, b"\x04")]


def test_a_byte_written_with_its_old_value_is_not_a_change() -> None:
    twin = page_of({4: 7})
    page = page_of({3: 1, 4: 7, 5: 2})
    assert make_diff(page, twin).runs() == [(3, b"\x01"), (5, b"\x02")]


def test_changes_at_the_first_and_last_byte_are_kept() -> None:
    twin = page_of({})
    page = page_of({0: 9, 63: 8})
    assert make_diff(page, twin).runs() == [(0, b"\x09"), (63, b"\x08")]


def test_a_fully_rewritten_page_is_one_run() -> None:
    twin = np.zeros(PAGE, dtype=np.uint8)
    page = np.full(PAGE, 0xFF, dtype=np.uint8)
    diff = make_diff(page, twin)
    assert diff.runs() == [(0, bytes(page))]
    assert diff.nbytes == PAGE


def test_nbytes_counts_the_runs_data_not_their_headers() -> None:
    assert Diff.of_runs([(0, b"abc"), (100, b"de")]).nbytes == 5


def test_the_diff_holds_copies_not_views_of_the_page() -> None:
    twin = page_of({})
    page = page_of({1: 5})
    diff = make_diff(page, twin)
    page[1] = 6
    assert diff.runs() == [(1, b"\x05")]


# ----------------------------------------------------------------- Diff.apply
def test_applying_an_empty_diff_leaves_the_page_alone() -> None:
    page = np.arange(64, dtype=np.uint8)
    EMPTY.apply(page)
    assert np.array_equal(page, np.arange(64, dtype=np.uint8))


@pytest.mark.parametrize("seed", range(8))
def test_applying_the_diff_to_the_twin_reproduces_the_page(seed: int) -> None:
    rng = np.random.default_rng(seed)
    twin = rng.integers(0, 256, PAGE, dtype=np.uint8)
    page = twin.copy()
    for _ in range(int(rng.integers(0, 40))):  # writes of random lengths, some overlapping, some adjacent
        start = int(rng.integers(0, PAGE))
        length = int(rng.integers(1, 200))
        page[start : start + length] = rng.integers(0, 256, min(length, PAGE - start), dtype=np.uint8)
    flips = rng.random(PAGE) < 0.01  # and scattered single bytes
    page[flips] ^= 0x5A
    diff = make_diff(page, twin)
    assert_maximal(diff, page, twin)
    assert diff.nbytes == int(np.count_nonzero(page != twin))
    rebuilt = twin.copy()
    diff.apply(rebuilt)
    assert np.array_equal(rebuilt, page)


@pytest.mark.parametrize("seed", range(4))
def test_diffs_of_disjoint_writes_against_one_twin_both_apply_in_either_order(seed: int) -> None:
    """Two writers of one page (false sharing): the home applies both diffs and loses neither."""
    rng = np.random.default_rng(100 + seed)
    twin = rng.integers(0, 256, PAGE, dtype=np.uint8)
    mine = rng.random(PAGE) < 0.5  # writer A owns these bytes, writer B the others
    a, b = twin.copy(), twin.copy()
    a[mine] = ~twin[mine]
    b[~mine] = ~twin[~mine]
    expected = np.where(mine, a, b)
    diff_a, diff_b = make_diff(a, twin), make_diff(b, twin)
    for first, second in ((diff_a, diff_b), (diff_b, diff_a)):
        home = twin.copy()
        first.apply(home)
        second.apply(home)
        assert np.array_equal(home, expected)


def test_interleaved_writers_produce_interleaved_runs_that_merge_at_the_home() -> None:
    twin = np.zeros(64, dtype=np.uint8)
    even, odd = twin.copy(), twin.copy()
    even[0::2] = 1
    odd[1::2] = 2
    diff_even, diff_odd = make_diff(even, twin), make_diff(odd, twin)
    assert len(diff_even) == len(diff_odd) == 32
    home = twin.copy()
    diff_odd.apply(home)
    diff_even.apply(home)
    assert home.tolist() == [1, 2] * 32


# ----------------------------------------------------------------- element-sized units
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.float64])
def test_a_diff_in_element_units_is_one_run_for_consecutive_changed_elements(dtype: Any) -> None:
    twin = np.arange(4096 // np.dtype(dtype).itemsize, dtype=dtype)
    page = twin.copy()
    page[10:20] += 1  # only the low byte of each changes: bytewise that would be ten runs
    unit = diff_unit(np.dtype(dtype))
    diff = make_diff(page.view(np.uint8), twin.view(np.uint8), unit)
    size = np.dtype(dtype).itemsize
    assert diff.runs() == [(10 * size, page[10:20].tobytes())]
    rebuilt = twin.copy()
    diff.apply(rebuilt.view(np.uint8))
    assert np.array_equal(rebuilt, page)


def test_the_unit_is_the_size_of_a_plain_number_and_one_byte_for_records_complex_and_bytes() -> None:
    plain = [diff_unit(np.dtype(t)) for t in (np.int8, np.int16, np.uint32, np.float32, np.int64, np.float64)]
    assert plain == [1, 2, 4, 4, 8, 8]
    others = [np.complex64, np.complex128, "V8", "S8", np.dtype([("a", "i4"), ("b", "i4")]), np.dtype(("i4", 2))]
    assert [diff_unit(np.dtype(t)) for t in others] == [1] * len(others)


# ----------------------------------------------------------------- one encoding: wire, log rings, stable logs
@pytest.mark.parametrize("seed", range(6))
def test_a_diff_decodes_to_itself_and_applies_the_same(seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    twin = rng.integers(0, 256, PAGE, dtype=np.uint8)
    page = twin.copy()
    page[rng.random(PAGE) < [0.001, 0.01, 0.3, 0.5, 0.9, 1.0][seed]] ^= 0x11  # from a few runs to one
    diff = make_diff(page, twin)
    decoded = Diff.decode(diff.encode(), PAGE)
    assert decoded == diff and decoded.runs() == diff.runs()
    rebuilt = twin.copy()
    decoded.apply(rebuilt)
    assert np.array_equal(rebuilt, page)


def test_a_diff_of_many_runs_applies_like_one_of_few() -> None:
    """Beyond a few runs `apply` scatters every byte at once: same result as copying run by run."""
    runs = [(8 * k + 3, bytes([k + 1]) * (1 + k % 3)) for k in range(40)]
    many = np.zeros(PAGE, dtype=np.uint8)
    Diff.of_runs(runs).apply(many)
    few = np.zeros(PAGE, dtype=np.uint8)
    for k in range(0, 40, 4):
        Diff.of_runs(runs[k : k + 4]).apply(few)
    assert np.array_equal(many, few)
    assert [int(many[8 * k + 3]) for k in range(40)] == [k + 1 for k in range(40)]


def test_iteration_gives_the_runs_and_of_runs_reverses_it() -> None:
    runs = [(0, b"ab"), (10, b"c"), (4000, b"defg")]
    diff = Diff.of_runs(runs)
    assert list(diff) == runs and len(diff) == 3 and diff.nbytes == 7
    assert Diff.of_runs(diff) == diff


def _encoded(offsets: list[int], lengths: list[int], data: bytes) -> bytes:
    count = len(offsets).to_bytes(4, "little")
    return count + np.array(offsets, "<u4").tobytes() + np.array(lengths, "<u4").tobytes() + data


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"", "too short for its count"),
        (_encoded([0], [4], b"abc"), "fewer bytes than its lengths"),
        (_encoded([0], [2], b"abc"), "more bytes than its lengths"),
        (_encoded([0, 10], [0, 3], b"abc"), "an empty run"),
        (_encoded([10, 0], [2, 2], b"abcd"), "runs out of order"),
        (_encoded([0, 1], [2, 2], b"abcd"), "overlapping runs"),
        (_encoded([PAGE - 1], [2], b"ab"), "a run past the page"),
        (b"\xff\xff\xff\x00" + b"x" * 16, "a count larger than the payload"),
        (b"\x00\x00\x00\x00x", "bytes but no runs"),
        # and with many runs (checked by numpy rather than run by run)
        (_encoded(list(range(0, 200, 10)), [2] * 19 + [0], b"x" * 38), "many runs, one empty"),
        (_encoded(list(range(0, 200, 10)), [11] + [2] * 19, b"x" * 49), "many runs, two overlapping"),
        (_encoded(list(range(0, 200, 10)), [2] * 20, b"x" * 39), "many runs, a byte short"),
        (_encoded([*range(0, 190, 10), PAGE - 1], [2] * 20, b"x" * 40), "many runs, the last past the page"),
    ],
)
def test_a_malformed_diff_is_refused_in_one_clear_error(payload: bytes, why: str) -> None:
    """A home decodes what arrives from the network: a hostile or damaged diff never reaches its page."""
    with pytest.raises(DsmError, match="malformed diff"):
        Diff.decode(payload, PAGE)


def test_a_diff_is_encoded_once_and_a_received_one_keeps_its_bytes() -> None:
    """A writer encodes a diff for its home and for its log record, an async home logs what it received: one
    encoding each (`Diff.encoded`).  A diff decoded from a buffer that may change keeps no reference to it."""
    made = Diff.of_runs([(0, b"\x01\x02"), (64, b"\xff")])
    first = made.encode()
    assert made.encode() is first
    received = bytes(first)
    assert Diff.decode(received, PAGE).encode() is received
    buffer = bytearray(first)
    from_buffer = Diff.decode(buffer, PAGE)
    buffer[-1] = 0  # a receive buffer reused after the decode
    assert from_buffer.encode() == first and from_buffer.runs() == [(0, b"\x01\x02"), (64, b"\xff")]
