"""Shared arrays with page-granular software access detection, and DSM locks.

Python has no page protection a library could use portably, so access is
checked in software: every access names the elements it touches (a numpy
index), the array maps them to pages, and pages that are invalid are fetched
(a read fault) or twinned (a write fault) before the program sees a numpy view.
A basic index (slices, integers) maps to the pages between its first and last
byte, a strided one over-approximates (more pages than needed are checked,
never fewer), and a fancy index maps element by element.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import DsmError

if TYPE_CHECKING:
    from ._api import Faults
    from ._region import Region

try:  # numpy >= 2
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]


class SharedArray:
    """A shared numpy array: ``with a.read(idx) as v``, ``with a.write(idx) as v``, ``a[idx]``, ``a[idx] = x``.

    The views handed out are valid inside the ``with`` block (and, for a read,
    until this rank's next synchronisation); keep copies, not views, across
    ``lock``/``barrier`` calls.
    """

    def __init__(self, memory: Faults, region: Region, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self._mem, self._region = memory, region
        self.shape, self.dtype = shape, dtype
        self.size = int(np.prod(shape, dtype=np.int64))
        self.ndim = len(shape)

    @property
    def _view(self) -> np.ndarray:
        return self._region.local[: self.size * self.dtype.itemsize].view(self.dtype).reshape(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<dsm.SharedArray {self._region.aid} shape={self.shape} dtype={self.dtype}>"

    # ------------------------------------------------------------------ access
    @contextmanager
    def read(self, index: Any = ...) -> Iterator[np.ndarray]:
        """A read-only numpy view of ``a[index]`` with its pages valid."""
        view = self._view
        self._mem.read_fault(self._region, *self._touched(view, index))
        sub = view[index]
        if isinstance(sub, np.ndarray):
            sub = sub.view()
            sub.flags.writeable = False
        yield sub

    @contextmanager
    def write(self, index: Any = ...) -> Iterator[np.ndarray]:
        """A writable numpy view of ``a[index]``: its pages fetched if invalid, twinned on first write.

        The index must be basic (slices, integers, ``...``): a fancy index or a mask
        selects a copy, which could not write back; use ``a[index] = values`` for those.
        No lock or barrier call may happen inside the block (it raises DsmError): the
        interval it would close could not include the block's later writes.
        """
        view = self._view
        sub = view[index]
        if not isinstance(sub, np.ndarray):
            raise DsmError("a.write(index) needs an index that selects an array; use a[index] = value for one element")
        if sub.size and not np.may_share_memory(sub, view):
            raise DsmError(
                "a.write(index) needs a basic index (slices, integers, ...); use a[index] = values "
                "for a fancy index or a mask"
            )
        pages, span = self._touched(view, index)
        self._mem.write_fault(self._region, pages, span)
        through = self._mem.through_begin(self._region, pages) if self._mem.write_through else None
        self._mem.writing += 1
        try:
            yield sub
        finally:
            self._mem.writing -= 1
            if through is not None:
                self._mem.through_end(self._region, through)

    def __getitem__(self, index: Any) -> Any:
        view = self._view
        self._mem.read_fault(self._region, *self._touched(view, index))
        sub = view[index]
        return sub.copy() if isinstance(sub, np.ndarray) else sub

    def __setitem__(self, index: Any, value: Any) -> None:
        view = self._view
        pages, span = self._touched(view, index)
        self._mem.write_fault(self._region, pages, span)
        through = self._mem.through_begin(self._region, pages) if self._mem.write_through else None
        try:
            view[index] = value
        finally:
            if through is not None:
                self._mem.through_end(self._region, through)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data: np.ndarray = self[...]
        return data if dtype is None else data.astype(dtype)

    # ------------------------------------------------------------------ pages
    def _pages(self, view: np.ndarray, index: Any) -> np.ndarray:
        """The pages `view[index]` touches (a superset for strided basic indexes)."""
        return self._touched(view, index)[0]

    def _touched(self, view: np.ndarray, index: Any) -> tuple[np.ndarray, tuple[int, int] | None]:
        """The pages `view[index]` touches (a superset for strided basic indexes), and for a basic index the bytes
        of the array between its first and last element (None for a fancy one)."""
        page_size = self._region.page_size
        probe = index if isinstance(index, tuple) else (index,)
        if not any(item is Ellipsis for item in probe):
            probe = (*probe, Ellipsis)  # a full integer index then gives a 0-d view, not a scalar copy
        try:
            sub = view[probe]
        except IndexError as exc:
            raise IndexError(f"{exc} (shared array of shape {self.shape})") from None
        if sub.size == 0:
            return np.empty(0, dtype=np.int64), None
        if np.may_share_memory(sub, view):
            base = self._region.local.__array_interface__["data"][0]
            low, high = byte_bounds(sub)
            low, high = low - base, high - base
            return np.arange(low // page_size, (high - 1) // page_size + 1, dtype=np.int64), (low, high)
        flat = np.arange(self.size, dtype=np.int64).reshape(self.shape)[index]  # fancy: element by element
        offsets = np.asarray(flat, dtype=np.int64).ravel() * self.dtype.itemsize
        first, last = offsets // page_size, (offsets + self.dtype.itemsize - 1) // page_size
        return np.unique(np.concatenate((first, last))), None


class Lock:
    """A DSM lock: ``with lock:`` acquires (taking the write notices of its last release) and releases."""

    def __init__(self, memory: Faults, lock_id: int) -> None:
        self._mem, self.id = memory, lock_id

    def acquire(self) -> None:
        self._mem.acquire(self.id)

    def release(self) -> None:
        self._mem.release(self.id)

    @property
    def held(self) -> bool:
        """Does this rank hold it?"""
        return self.id in self._mem.held

    def __enter__(self) -> Lock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<dsm.Lock {self.id} home {self.id % self._mem.size}>"
