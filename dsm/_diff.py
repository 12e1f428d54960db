"""Run-length diffs of a page against its twin: what a writer sends to the page's home at release.

A diff is a list of runs ``(offset, bytes)``: maximal stretches of bytes that differ
from the twin.  Only changed bytes travel, so two ranks writing disjoint parts of
one page (false sharing) never overwrite each other at the home: that is what makes
the protocol multiple-writer.
"""

from __future__ import annotations

import numpy as np

Diff = list[tuple[int, bytes]]


def make_diff(page: np.ndarray, twin: np.ndarray) -> Diff:
    """The runs of `page` (uint8) that differ from `twin` (uint8, same length); [] when nothing changed."""
    changed = np.flatnonzero(page != twin)
    if changed.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(changed) > 1)
    starts = np.concatenate((changed[:1], changed[breaks + 1]))
    ends = np.concatenate((changed[breaks], changed[-1:])) + 1
    return [(int(s), page[s:e].tobytes()) for s, e in zip(starts, ends, strict=True)]


def apply_diff(page: np.ndarray, diff: Diff) -> None:
    """Write the runs of `diff` into `page` (uint8)."""
    for offset, data in diff:
        page[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


def diff_size(diff: Diff) -> int:
    """Payload bytes of a diff (the runs' data, not their headers)."""
    return sum(len(data) for _, data in diff)
