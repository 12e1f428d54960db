"""A log ring in registered memory: three control words (tail, head, lost) and a circular byte area.

Rationale.  A ring is written by remote ranks with no help from the rank that holds it
(FT-KDSM §4.1): a writer reserves ``n`` bytes with one FETCH_AND_ADD on ``tail`` (the
word only grows: it is the absolute position of the next record), reads ``head`` in
the same round trip, and may fill its bytes once ``old tail + n - head <= capacity``.
Position ``p`` lies at offset ``p mod capacity``; records are 8-byte aligned, so a
commit word never straddles the end.  ``head`` is written by the ring's *owner* only
(the rank whose logs it holds, or, for a home diff log, the home), when a checkpoint
made everything before it useless; writers only read it, and a stale value is
conservative (head only grows).  Invariant: ``head <= tail`` and the bytes between
hold records in reservation order, each committed or still being written.

An *own* ring (a rank's own records, `_writer.RingWriter.own`) has a single writer, the
rank whose records it holds, which keeps tail and head itself: there, only ``lost`` is
used.

``lost`` is 1 while the ring cannot be trusted: the rank holding it was itself recovered
from an image, so records written after that image are gone (FT-KDSM: "the process whose
log home is the failed process takes a checkpoint").  The holder sets it (with head =
tail) when it recovers; the owner clears it, after its head, in the discard that follows
its next checkpoint (if the holder was not recovered again since that checkpoint's
image).  A recovery that finds its ring lost cannot replay: it falls back.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ckpt import verbs

from ._records import HEADER_SIZE, scan, sealed, walk

CONTROL = 24  # tail, head, lost (int64)
REMOTE = (
    verbs.IBV_ACCESS_LOCAL_WRITE
    | verbs.IBV_ACCESS_REMOTE_READ
    | verbs.IBV_ACCESS_REMOTE_WRITE
    | verbs.IBV_ACCESS_REMOTE_ATOMIC
)


#: The smallest log ring (``--log-ring-bytes``): room for four record headers.
MIN_CAPACITY = 4 * HEADER_SIZE


class LogRing:
    """A ring this rank holds (and registers): written remotely by RDMA, or locally by `append_local`."""

    def __init__(self, pd: verbs.PD, capacity: int) -> None:
        if capacity < MIN_CAPACITY or capacity % 8:
            raise ValueError(f"a log ring needs a multiple of 8 bytes, at least {MIN_CAPACITY}, not {capacity}")
        self.capacity = capacity
        self.buf = verbs.shared_array(CONTROL + capacity, np.uint8)  # writers place records by RDMA
        self.mr = verbs.MR(pd, self.buf, REMOTE)
        self._views()

    def _views(self) -> None:
        self.mutex = threading.Lock()  # local appenders only (the async home diff log: program + handler)
        self.control = self.buf[:CONTROL].view(np.int64)  # tail, head, lost
        self.area = self.buf[CONTROL:]

    @property
    def tail(self) -> int:
        return int(self.control[0])

    @property
    def head(self) -> int:
        return int(self.control[1])

    @property
    def lost(self) -> bool:
        return bool(self.control[2])

    def set_head(self, position: int) -> None:
        self.control[1] = position

    def mark_lost(self) -> None:
        """What this ring held since the image it came back from is gone: empty it, and say so."""
        self.control[1] = self.control[0]
        self.control[2] = 1

    def scan(self, size: int) -> list[Any]:
        """The committed records from head to tail, past holes (local: no RDMA; `_records.scan`)."""
        head = self.head
        return scan(self.contents(head, self.readable_end()), head, size)

    def address(self) -> dict[str, int]:
        return {"addr": self.mr.buf, "rkey": self.mr.rkey, "capacity": self.capacity}

    def contents(self, start: int, end: int) -> bytes:
        """The bytes of positions [start, end) (at most one lap)."""
        return circular_read(self.area, start, end)

    def records(self) -> list[Any]:
        """The committed records from head on, up to the first that is not (local: no RDMA)."""
        head = self.head
        return walk(self.contents(head, self.readable_end()), head)

    def readable_end(self) -> int:
        """Where a read of this ring ends: its tail, at most one lap past its head (writers reserve past a full
        ring's end and wait for room)."""
        head = self.head
        return min(max(head, self.tail), head + self.capacity)

    def committed_end(self) -> int:
        """The position just past the last record of the committed prefix from head."""
        found = self.records()
        return found[-1].position + found[-1].size if found else self.head

    def append_local(self, *records: bytearray) -> int:
        """Append `records` here, in order, by the CPU (never mixed with remote FETCH_AND_ADDs on the same ring).

        How many were appended: those that fit before head (the rest are not written).
        """
        with self.mutex:
            start = end = int(self.control[0])
            room, fit = int(self.control[1]) + self.capacity, 0
            while fit < len(records) and end + len(records[fit]) <= room:
                end += len(records[fit])
                fit += 1
            if fit:
                circular_write(self.area, start, sealed(records[:fit], start))
                self.control[0] = end
            return fit

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for view in ("mutex", "control", "area"):
            del state[view]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()


def circular_read(area: np.ndarray, start: int, end: int) -> bytes:
    capacity = len(area)
    if end - start > capacity:
        raise ValueError(f"{end - start} bytes do not fit a ring of {capacity}")
    lo, hi = start % capacity, (start % capacity) + (end - start)
    if hi <= capacity:
        return area[lo:hi].tobytes()
    return area[lo:].tobytes() + area[: hi - capacity].tobytes()


def circular_write(area: np.ndarray, position: int, data: bytes | bytearray) -> None:
    capacity = len(area)
    lo = position % capacity
    first = min(len(data), capacity - lo)
    source = np.frombuffer(data, dtype=np.uint8)
    area[lo : lo + first] = source[:first]
    if first < len(data):
        area[: len(data) - first] = source[first:]


def spans(capacity: int, position: int, length: int) -> list[tuple[int, int, int]]:
    """(offset in the ring area, offset in the data, length) pieces of writing `length` bytes at `position`."""
    lo = position % capacity
    first = min(length, capacity - lo)
    pieces = [(lo, 0, first)]
    if first < length:
        pieces.append((0, first, length - first))
    return pieces


def own_home_refusal(offset: int, size: int) -> str | None:
    """Why `offset` cannot place log homes among `size` ranks (every rank its own log home), or None."""
    if size > 1 and offset % size == 0:
        return f"--log-home-offset {offset} makes every rank its own log home with {size} ranks"
    return None
