"""A home's page history since the last coordinated checkpoint: minimal page versions for a replaying rank."""

# Rationale (FT-KDSM §5, "regeneration of minimal versions").  A rank that replays its logs
# must read, at a page fault, the page as it was when it first read it -- holding exactly the
# intervals its vector timestamp covers then -- not the home's current copy, which may hold
# later writes.  The home can rebuild any such version from two things it keeps:
#
# * its *base*: a copy of every page it is home of, taken at each coordinated checkpoint C
#   (the one a whole-job restart goes back to), with the page's applied columns -- which
#   writer intervals it holds.  It is pickled with the memory, so it is in every image after
#   C; a page never snapshotted (made after C, or homed here after C) has a zero base, as
#   every page starts as zeros;
# * its *home diff log* (HOME_DIFF records, `_remote`), kept since C: it is not released at
#   this rank's independent checkpoints any more, only at the next coordinated one, once the
#   new base is taken.  Under ``onesided`` the home's records of its own writes are kept
#   beside the ring, by the CPU (`RemoteLog._keep_own`), each with the ring's tail when it was
#   made: it goes before the ring's records from that position on, which is where the home's
#   copy had it (a diff that happened before it was reserved below that tail, one that
#   happened after it at or above).
#
# page(gid, vt) = base + every logged diff of gid with base applied[w] < interval <= vt[w],
# in log order (the order the home applied them: for ordered diffs, happened-before order;
# concurrent ones touch disjoint bytes in a data-race-free program, so their order does not
# matter).  The log's committed prefix is indexed by page as it grows; what lies past a hole
# (a writer still writing, under onesided) is scanned at each call.

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from dsm import Diff

from ._records import Record, RecordKind, gids_of, parse, per_page, scan, walk
from ._ring import LogRing


class HomeVersions:
    """`dsm.PageVersions` for one home: its base and its home diff log (set as ``memory.versions``)."""

    def __init__(
        self, memory: Any, home_log: LogRing, overflow: list[bytearray], own_diffs: list[tuple[int, bytearray]]
    ) -> None:
        self.memory, self.home_log, self.overflow, self.own_diffs = memory, home_log, overflow, own_diffs
        self.base: dict[int, tuple[bytes, np.ndarray]] = {}  # gid -> (page, applied columns) at the last C
        self.mutex = threading.Lock()  # the handler serves pages; the program thread takes bases
        self._reset_index()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("mutex", "_index", "_indexed", "_indexed_head"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.mutex = threading.Lock()
        self._reset_index()

    def _reset_index(self) -> None:
        self._index: dict[int, list[Record]] = {}
        self._indexed_head = self.home_log.head
        self._indexed = self._indexed_head  # ring position up to which the committed records are indexed

    # ------------------------------------------------------------------ the base
    def take_base(self) -> None:
        """Snapshot every page this rank is home of (program thread, at a coordinated checkpoint)."""
        rank = self.memory.rank
        base: dict[int, tuple[bytes, np.ndarray]] = {}
        for region in self.memory.regions:
            applied = region.applied()
            for page in map(int, np.flatnonzero(region.home == rank)):
                gid = region.aid << 32 | page
                base[gid] = (region.page(page).tobytes(), applied[page])
        with self.mutex:
            self.base = base

    # ------------------------------------------------------------------ versions
    def diffs_of(self, gid: int) -> list[Record]:
        """The HOME_DIFF records of page `gid` from the home diff log's head on, in log order (the home's own,
        kept beside the ring under onesided, where their positions put them)."""
        ring = self.home_log
        with self.mutex:
            head = ring.head
            if head != self._indexed_head or self._indexed < head:  # released at a coordinated checkpoint
                self._reset_index()
            tail = ring.tail
            for record in walk(ring.contents(self._indexed, max(self._indexed, tail)), self._indexed):
                if record.kind == RecordKind.HOME_DIFF:
                    for one in per_page(record):
                        self._index.setdefault(one.gid, []).append(one)
                self._indexed = record.position + record.size
            found = list(self._index.get(gid, []))
            # past the first hole (a writer still writing): not indexed, since the hole may fill in later
            rest = ring.contents(self._indexed, max(self._indexed, tail))
            found += _of_page(scan(rest, self._indexed, self.memory.size), gid)
            own = [
                (at, one)
                for at, record in self.own_diffs
                if gid in gids_of(record)
                for one in _of_page([parse(record)], gid)
            ]
            found = _merged(found, own) + _of_page(map(parse, list(self.overflow)), gid)
        return found

    def page(self, gid: int, vt: list[int]) -> bytes:
        """Page `gid` holding the intervals (q, i) with i <= vt[q] (`dsm.PageVersions`)."""
        with self.mutex:
            kept = self.base.get(gid)
        size = self.memory.page_size
        data = np.frombuffer(kept[0], np.uint8).copy() if kept is not None else np.zeros(size, np.uint8)
        applied = kept[1] if kept is not None else np.zeros(self.memory.size, dtype=np.int64)
        for record in self.diffs_of(gid):
            if int(applied[record.writer]) < record.interval <= vt[record.writer]:
                Diff.decode(record.payload, size).apply(data)
        return data.tobytes()  # counted by the DSM's handler (versions_served), which asks


def _of_page(records: Iterable[Record], gid: int) -> list[Record]:
    """The diffs of page `gid` in `records`' HOME_DIFF records, one record each (`per_page`), in order."""
    return [one for r in records if r.kind == RecordKind.HOME_DIFF for one in per_page(r) if one.gid == gid]


def _merged(ring: list[Record], own: list[tuple[int, Record]]) -> list[Record]:
    """`ring`'s records (ring order) with each own one put before the first whose position is at or past the
    ring's tail it was kept with, own ones in the order they were made (those tails never decrease)."""
    if not own:
        return ring
    out: list[Record] = []
    k = 0
    for record in ring:
        while k < len(own) and own[k][0] <= record.position:
            out.append(own[k][1])
            k += 1
        out.append(record)
    return out + [record for _, record in own[k:]]
