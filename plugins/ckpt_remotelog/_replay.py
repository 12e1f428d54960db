"""A recovering rank's log, read back from its log home: the `dsm.Replay` its re-execution consumes."""

# Rationale (FT-KDSM §5, design of issue 13 part 5 §2).  Rank R's own records at L(R) --
# NOTICES (an acquire's grant), RELEASE, BARRIER_ARRIVAL, BARRIER -- are numbered by R's
# serial in program order, and each is committed before anything that depends on it can be
# observed (`_remote`).  Those with a serial at or after the image's are what R did after its
# image: the replay hands them back, one per DSM call, in that order, and checks that the
# re-executing program asks for the same operation (kind, lock or epoch, acquisition token);
# any other call means the program did not re-execute alike (a racy read): ReplayDiverged.
# The serials must be consecutive from the image's; a gap is a record its writer reserved
# and never completed (it died): nothing after it can have been observed either, so the
# operations end there.
#
# The DIFF records at L(R) by other writers that the image does not hold are the changes to
# R's home pages since the image; the program's view of those pages must show each one once
# its vector timestamp covers it (`home_diffs`), as the home copy did the first time.  R's
# own DIFFs are not returned: the program makes them again as it re-executes.

from __future__ import annotations

from typing import Any

import dsm
from dsm import Diff

from ._records import Record, RecordKind, notices_of, per_page

Notices = list[list[Any]]


def as_notices(notices: list[Any]) -> Notices:
    return [[int(q), int(i), list(flat)] for q, i, flat in notices]


def describe(record: Record | None) -> str:
    if record is None:
        return "the end of the log"
    if record.kind in (RecordKind.NOTICES, RecordKind.RELEASE):
        what = "acquire" if record.kind == RecordKind.NOTICES else "release"
        return f"the {what} of lock {record.tag} (acquisition {record.interval})"
    what = "arrival at" if record.kind == RecordKind.BARRIER_ARRIVAL else "exit of"
    return f"the {what} barrier {record.tag}"


class LogReplay:
    """`dsm.Replay` over one rank's records read back from its log home (pickleable)."""

    def __init__(self, rank: int, serial: int, records: list[Record], applied: Any, page_size: int) -> None:
        """`records`: the ring at L(rank), in ring order; `serial`: the image's next own serial;
        `applied(gid)`: the image's applied columns of home page `gid` (None: not in the image); `page_size`:
        what a logged diff's runs must fit (`dsm.Diff.decode`)."""
        own = sorted(
            (r for r in records if r.writer == rank and r.kind != RecordKind.DIFF and r.serial >= serial),
            key=lambda r: r.serial,
        )
        self.ops: list[Record] = []
        for record in own:
            if record.serial != serial + len(self.ops):
                break  # a hole: a reservation its writer never completed, and nothing after it was observed
            self.ops.append(record)
        self.rank, self.first_serial, self.next = rank, serial, 0
        self.diffs: list[tuple[int, int, int, Diff]] = []  # (gid, writer, interval, diff), others' writes
        for record in records:
            if record.kind != RecordKind.DIFF or record.writer == rank:
                continue
            for one in per_page(record):
                columns = applied(one.gid)
                if columns is None or one.interval > int(columns[one.writer]):
                    self.diffs.append((one.gid, one.writer, one.interval, Diff.decode(one.payload, page_size)))
        self.returned = 0  # diffs before this index were all returned (the others: see `taken`)
        self.taken: set[int] = set()
        self.consumed: set[tuple[int, int, int]] = set()  # (kind, lock or epoch, token) of replayed operations

    # ------------------------------------------------------------------ dsm.Replay
    @property
    def done(self) -> bool:
        return self.next >= len(self.ops)

    def progress(self) -> tuple[int, int]:
        return self.next, len(self.ops)

    @property
    def next_serial(self) -> int:
        """The serial the rank's next own record takes once the replay is over."""
        return self.first_serial + len(self.ops)

    def acquire(self, lock: int, token: int) -> tuple[list[int], Notices] | None:
        if self.done:
            return None
        record = self._take(RecordKind.NOTICES, lock, token, f"the acquire of lock {lock} (acquisition {token})")
        vt, notices = notices_of(record.payload)
        return vt, as_notices(notices)

    def release(self, lock: int, token: int) -> bool:
        if self.done:
            return False
        self._take(RecordKind.RELEASE, lock, token, f"the release of lock {lock} (acquisition {token})")
        return not self.done

    def arrive(self, epoch: int) -> bool:
        if self.done:
            return False
        self._take(RecordKind.BARRIER_ARRIVAL, epoch, 0, f"the arrival at barrier {epoch}")
        return True

    def barrier(self, epoch: int) -> tuple[list[int], Notices] | None:
        if self.done:
            return None
        record = self._take(RecordKind.BARRIER, epoch, 0, f"the exit of barrier {epoch}")
        vt, notices = notices_of(record.payload)
        return vt, as_notices(notices)

    def home_diffs(self, vt: list[int]) -> list[tuple[int, Diff]]:
        out: list[tuple[int, Diff]] = []
        for k in range(self.returned, len(self.diffs)):
            if k in self.taken:
                continue
            gid, writer, interval, diff = self.diffs[k]
            if interval <= vt[writer]:
                out.append((gid, diff))
                self.taken.add(k)
        while self.returned in self.taken:
            self.taken.discard(self.returned)
            self.returned += 1
        return out

    # ------------------------------------------------------------------ checks
    def _take(self, kind: RecordKind, tag: int, token: int, asked: str) -> Record:
        record = self.ops[self.next]
        token_matches = kind in (RecordKind.BARRIER_ARRIVAL, RecordKind.BARRIER) or record.interval == token
        if record.kind != kind or record.tag != tag or not token_matches:
            raise dsm.ReplayDiverged(
                f"rank {self.rank}'s re-execution diverged from its log at operation {self.next + 1} of "
                f"{len(self.ops)}: it asked for {asked}, the log holds {describe(record)}"
            )
        self.next += 1
        self.consumed.add((int(kind), tag, token))
        return record

    def replayed(self, kind: RecordKind, tag: int, token: int = 0) -> bool:
        """Was this operation answered from the log (so its record must not be written again)?"""
        return (int(kind), tag, token) in self.consumed
