"""Run-length diffs of a page against its twin: what a writer sends to the page's home at release.

A diff is a list of runs ``(offset, bytes)``: maximal stretches of *units* that differ
from the twin.  Only changed units travel, so two ranks writing disjoint elements of
one page (false sharing) never overwrite each other at the home: that is what makes
the protocol multiple-writer.  The unit is the array's element size for plain
integers and floats of 2, 4 or 8 bytes (a race-free program never has two writers
of one such element, and an element whose low byte alone changed stays one run
with its neighbours: one RDMA WRITE under DRAW instead of one per byte), else one
byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Diff = list[tuple[int, bytes]]


_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def diff_unit(dtype: np.dtype[Any]) -> int:
    """The unit a shared array of `dtype` is diffed in: a plain integer or float's size if 2, 4 or 8 bytes, else 1.

    Records, complex numbers and byte strings are diffed bytewise: two ranks may write
    different fields (real and imaginary parts, characters) of one element.
    """
    plain = dtype.fields is None and dtype.subdtype is None and dtype.kind in "iuf"
    return dtype.itemsize if plain and dtype.itemsize in _WORDS else 1


def make_diff(page: np.ndarray, twin: np.ndarray, unit: int = 1) -> Diff:
    """The runs of `page` (uint8) that differ from `twin` (uint8, same length), compared `unit` bytes at a time.

    [] when nothing changed.  The page's length must be a multiple of `unit`.
    """
    if unit in _WORDS:
        changed = np.flatnonzero(page.view(_WORDS[unit]) != twin.view(_WORDS[unit]))
    else:
        changed, unit = np.flatnonzero(page != twin), 1
    if changed.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(changed) > 1)
    starts = np.concatenate((changed[:1], changed[breaks + 1])) * unit
    ends = (np.concatenate((changed[breaks], changed[-1:])) + 1) * unit
    data = page.tobytes()  # one copy, then bytes slices: a fragmented page (SOR's red-black) has hundreds of runs
    return [(s, data[s:e]) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


def apply_diff(page: np.ndarray, diff: Diff) -> None:
    """Write the runs of `diff` into `page` (uint8)."""
    for offset, data in diff:
        page[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


def diff_size(diff: Diff) -> int:
    """Payload bytes of a diff (the runs' data, not their headers)."""
    return sum(len(data) for _, data in diff)
