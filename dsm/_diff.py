"""Run-length diffs of a page against its twin: what a writer sends to the page's home at release.

A diff is a list of runs ``(offset, bytes)``: maximal stretches of *units* that differ
from the twin.  Only changed units travel, so two ranks writing disjoint elements of
one page (false sharing) never overwrite each other at the home: that is what makes
the protocol multiple-writer.  The unit is the array's element size for plain
integers and floats of 2, 4 or 8 bytes (a race-free program never has two writers
of one such element, and an element whose low byte alone changed stays one run
with its neighbours: one RDMA WRITE under DRAW instead of one per byte), else one
byte.

A `Diff` keeps its runs as columns -- their offsets, their lengths, and their bytes
back to back -- and has one encoding (`Diff.encode`): the same bytes travel to the
home (async), lie in the remote logs' rings and in a stable log.  Columns cost a few
numpy calls per page whatever its fragmentation, where a list of runs costs Python
work per run: SOR's red-black pages have hundreds (every other element), and with
remote logging each home diffs every page it wrote.  Iterating a `Diff` still gives
``(offset, bytes)`` runs.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ._errors import DsmError

_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_COUNT = struct.Struct("<I")
_U32 = np.dtype("<u4")
#: Up to this many runs, `Diff.apply` copies run by run; beyond, one scatter of every byte is cheaper.
_FEW = 8


class Diff:
    """A page's changed runs: ascending, non-overlapping ``(offset, length)`` columns and the runs' bytes.

    Encoded (`encode`), it is ``<u32 count> <count u32 offsets> <count u32 lengths> <bytes>``.
    """

    __slots__ = ("data", "encoded", "lengths", "offsets")

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, data: bytes) -> None:
        self.offsets = offsets  # uint32
        self.lengths = lengths  # uint32
        self.data = data  # sum(lengths) bytes
        # its encoding, once made or received (a diff never changes): a writer encodes it for its home and for its
        # log record, an async home receives it encoded and logs it encoded -- each costs one encoding, not two
        self.encoded: bytes | None = None

    @classmethod
    def of_runs(cls, runs: Iterable[tuple[int, bytes]]) -> Diff:
        """The diff of a list of ``(offset, bytes)`` runs (ascending, non-overlapping)."""
        runs = list(runs)
        return cls(
            np.array([offset for offset, _ in runs], dtype=_U32),
            np.array([len(data) for _, data in runs], dtype=_U32),
            b"".join(bytes(data) for _, data in runs),
        )

    @classmethod
    def decode(cls, payload: bytes | bytearray | memoryview, size: int | None = None) -> Diff:
        """The diff `encode` made; DsmError if `payload` is not one, or a run ends past `size` (a page's bytes)."""
        view = memoryview(payload).cast("B")
        if len(view) < _COUNT.size:
            raise DsmError(f"malformed diff: {len(view)} bytes")
        (count,) = _COUNT.unpack_from(view)
        start = _COUNT.size + 8 * count
        if len(view) < start:
            raise DsmError(f"malformed diff: {count} runs in {len(view)} bytes")
        # copies: a caller's buffer may change after the check (a ring, a receive buffer)
        offsets = np.frombuffer(view, _U32, count, _COUNT.size).copy()
        lengths = np.frombuffer(view, _U32, count, _COUNT.size + 4 * count).copy()
        if not _fits(offsets, lengths, len(view) - start, size):
            raise DsmError(f"malformed diff: {count} runs that do not fit {len(view) - start} bytes")
        diff = cls(offsets, lengths, view[start:].tobytes())
        if isinstance(payload, bytes):  # immutable: it stays what was checked (a buffer could change under it)
            diff.encoded = payload
        return diff

    def encode(self) -> bytes:
        encoded = getattr(self, "encoded", None)  # (a diff pickled before the slot existed has none)
        if encoded is None:
            parts = (_COUNT.pack(len(self.offsets)), self.offsets.tobytes(), self.lengths.tobytes(), self.data)
            encoded = self.encoded = b"".join(parts)
        return encoded

    @property
    def nbytes(self) -> int:
        """Payload bytes: the runs' data, not their offsets and lengths."""
        return len(self.data)

    def __len__(self) -> int:
        return len(self.offsets)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        at = 0
        data = self.data
        for offset, length in zip(self.offsets.tolist(), self.lengths.tolist(), strict=True):
            yield offset, data[at : at + length]
            at += length

    def runs(self) -> list[tuple[int, bytes]]:
        return list(self)

    def apply(self, page: np.ndarray) -> None:
        """Write the runs into `page` (uint8)."""
        count = len(self.offsets)
        if count == 0:
            return
        source = np.frombuffer(self.data, dtype=np.uint8)
        if count <= _FEW:
            at = 0
            for offset, length in zip(self.offsets.tolist(), self.lengths.tolist(), strict=True):
                page[offset : offset + length] = source[at : at + length]
                at += length
            return
        lengths = self.lengths.astype(np.intp)
        shift = self.offsets.astype(np.intp) - (np.cumsum(lengths) - lengths)  # page offset - data offset, per run
        page[np.arange(len(source)) + np.repeat(shift, lengths)] = source

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Diff):
            return NotImplemented
        return (
            self.data == other.data
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.lengths, other.lengths)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    def __repr__(self) -> str:
        return f"Diff({len(self)} runs, {self.nbytes} bytes)"


EMPTY = Diff(np.zeros(0, _U32), np.zeros(0, _U32), b"")


def _fits(offsets: np.ndarray, lengths: np.ndarray, nbytes: int, size: int | None) -> bool:
    """Runs that are not empty, ascending and apart, end by `size` and hold `nbytes` bytes in all."""
    count = len(offsets)
    if count <= _FEW:  # a diff of a few runs (most of them): plain Python is cheaper than numpy's calls
        end, total = 0, 0
        for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
            if length == 0 or offset < end:
                return False
            end, total = offset + length, total + length
        return total == nbytes and (size is None or end <= size)
    ends = offsets.astype(np.int64) + lengths
    return not (
        int(lengths.min()) == 0
        or int(lengths.sum(dtype=np.int64)) != nbytes
        or bool(np.any(offsets[1:] < ends[:-1]))
        or (size is not None and int(ends[-1]) > size)
    )


def diff_unit(dtype: np.dtype[Any]) -> int:
    """The unit a shared array of `dtype` is diffed in: a plain integer or float's size if 2, 4 or 8 bytes, else 1.

    Records, complex numbers and byte strings are diffed bytewise: two ranks may write
    different fields (real and imaginary parts, characters) of one element.
    """
    plain = dtype.fields is None and dtype.subdtype is None and dtype.kind in "iuf"
    return dtype.itemsize if plain and dtype.itemsize in _WORDS else 1


def make_diff(page: np.ndarray, twin: np.ndarray, unit: int = 1) -> Diff:
    """The runs of `page` (uint8) that differ from `twin` (uint8, same length), compared `unit` bytes at a time.

    Empty (false) when nothing changed.  The page's length must be a multiple of `unit`.
    """
    return make_diffs(page.reshape(1, -1), twin.reshape(1, -1), unit)[0]


def make_diffs(pages: np.ndarray, twins: np.ndarray, unit: int = 1) -> list[Diff]:
    """`make_diff` of each row of `pages` (pages x bytes, uint8) against the same row of `twins`, all at once.

    One pass of numpy calls over every page an interval wrote, then a few slices per page:
    an interval of SOR writes 32 pages, and a home diffs each of them while it is logged.
    """
    count, size = pages.shape
    if unit in _WORDS:
        words = pages.view(_WORDS[unit]).reshape(-1)
        changed = np.flatnonzero(words != twins.view(_WORDS[unit]).reshape(-1))
    else:
        words, unit = pages.reshape(-1), 1
        changed = np.flatnonzero(words != twins.reshape(-1))
    if changed.size == 0:
        return [EMPTY] * count
    per_page = size // unit
    # a run ends before a unit that is not the next one, or (several pages) that starts a page
    ends = np.diff(changed) > 1
    if count > 1:
        ends |= changed[1:] % per_page == 0
    breaks = np.flatnonzero(ends)
    firsts = np.concatenate((changed[:1], changed[breaks + 1]))
    lasts = np.concatenate((changed[breaks], changed[-1:]))
    # the changed units in order are the runs' bytes back to back (a copy: the pages change on)
    data = words[changed].tobytes()
    lengths = ((lasts - firsts + 1) * unit).astype(_U32)
    if count == 1:  # one page: nothing to split (most intervals of a lock-based program)
        return [Diff((firsts * unit).astype(_U32), lengths, data)]
    rows = firsts // per_page
    offsets = ((firsts - rows * per_page) * unit).astype(_U32)
    runs = np.searchsorted(rows, np.arange(count + 1)).tolist()  # row r's runs: runs[r] to runs[r + 1]
    at = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))[runs].tolist()  # and its bytes
    return [
        Diff(offsets[runs[r] : runs[r + 1]], lengths[runs[r] : runs[r + 1]], data[at[r] : at[r + 1]])
        if runs[r + 1] > runs[r]
        else EMPTY
        for r in range(count)
    ]
