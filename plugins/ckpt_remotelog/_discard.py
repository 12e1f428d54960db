"""Discard at checkpoint: how far a rank's checkpoint lets its log ring's head (and its home diff log) move.

A checkpoint makes logged records of the interval it covers unneeded: `discard` (at
CHECKPOINTED) advances the head of this rank's log ring, at its log home, past the
records its image covers, by RDMA, without the log home's CPU; it never passes a hole
a live rank may still fill (`_covered_prefix`, and `_writer` "Claims"), and retries
later when it stopped at one (`retry_discard`).  A coordinated checkpoint also
releases the home diff log.  A mixin of `RemoteLog` (`_remote`), whose state it uses.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from dsm._net import UP

from ._records import Record, RecordKind, scan
from ._ring import CONTROL, LogRing
from ._writer import HOME, LOG, OWN, LinkMoved, RingWriter

if TYPE_CHECKING:
    from ._replay import LogReplay
    from ._versions import HomeVersions

UNDECIDED_WAIT = 1.0  # seconds a discard polls the claims while it cannot tell whether a hole is dead
RETRY_EVERY = 0.05  # seconds between the retries of a discard that stopped at a hole (`retry_discard`)


class Discard:
    """The discard of `RemoteLog` (see the module's docstring)."""

    memory: Any
    rank: int
    size: int
    onesided: bool
    ring: LogRing
    home_log: LogRing
    home_flush: int
    writer: RingWriter
    versions: HomeVersions
    replay: LogReplay | None
    snapshot: dict[str, Any] | None
    pending: dict[str, Any] | None
    pending_link: int
    retry_at: float
    overflow: list[bytearray]
    own_diffs: list[tuple[int, bytearray]]
    own_bytes: int
    asked: dict[tuple[int, str], tuple[int, float]]

    if TYPE_CHECKING:

        def log_home(self, rank: int) -> int: ...

        def _holder_incarnation(self) -> int: ...

    def remote_records(self) -> tuple[list[Record], int]:
        """The committed records of this rank's log ring at its log home, from its head (RDMA READ); the head."""
        return self.writer.read_ring(self.log_home(self.rank), LOG)

    def covered(self, record: Record, snapshot: dict[str, Any]) -> bool:
        """Does this rank's checkpoint (its `snapshot`) hold what `record` logs?"""
        if record.kind != RecordKind.DIFF:
            return False  # a log ring holds DIFF records only (own records: the own ring, `discard`)
        applied = snapshot["applied"]
        for gid in record.gids:
            aid, page = gid >> 32, gid & 0xFFFFFFFF
            if aid >= len(applied) or applied[aid][page, record.writer] < record.interval:
                return False
        return True

    def _covered_prefix(self, snapshot: dict[str, Any], wait: float) -> tuple[list[Record], int, bool]:
        """The records of this rank's log ring its checkpoint covers, from the head on, the position after them,
        and whether it stopped at a hole (before records the checkpoint may cover, or at reserved space after
        the last committed record: `retry_discard`).

        Past a hole only when no live rank can still write there: the ring's tail is read first, then every
        rank's claim on the ring (`_writer`, "Claims"), then the ring.  Space below that tail and below every
        claim was reserved by a rank that died before writing it (a live one claims what it reserved until it
        is written); what a live rank reserves after the tail was read lies above it.  Both bounds are
        reservation boundaries, so the head may stop at either, inside a run of reservations.  While that
        cannot be told (a claim's answer in flight, a rank not up), the claims are polled for `wait` seconds.
        """
        writer, home = self.writer, self.log_home(self.rank)
        deadline, pause = time.monotonic() + wait, 1e-3
        while True:
            tail = writer.read_word(home, LOG, 0)
            dead = writer.dead_below(home, LOG, tail)  # written or dead below it
            records, head = writer.read_ring(home, LOG, holes=True)
            dropped: list[Record] = []
            for record in records:
                if record.position > head and record.position > dead:  # a hole a live rank may still fill
                    head = max(head, dead)  # ... from `dead` on: what lies before is dead (a reservation's start)
                    break
                if not self.covered(record, snapshot):
                    return dropped, max(head, record.position), False  # past a dead hole right before it too
                dropped.append(record)
                head = record.position + record.size
            else:
                # past the dead space after the last record too; space reserved after that and not written yet
                # may still get a record this checkpoint covers (a diff applied before it, logged after it) or
                # turn out dead: a hole as well, for `retry_discard` (no wait here: it is usually a live writer's)
                head = max(head, dead)
                return dropped, head, head < tail
            if dead >= 0 or time.monotonic() > deadline:
                return dropped, head, True
            # undecided (an answer in flight is one round trip; a rank not up, its recovery): a while, not for good
            time.sleep(pause)  # polling remote words, as `RingWriter.wait_for_room` does: nothing signals here
            pause = min(2 * pause, 0.05)

    def retry_discard(self, throttle: bool) -> None:
        """Pass the hole the last discard stopped at, once it can (program thread: at an interval's close and
        while a DSM request waits, `dsm_waiting`, at most every `RETRY_EVERY` seconds, and as it arrives at a
        barrier).

        A discard stops at a hole that a live rank may still fill, or that it cannot yet tell from a dead
        writer's (a rank recovering, a claim's answer in flight).  It used to stay there until this rank's
        next checkpoint.  But that checkpoint is asked for only once the ring's head has moved since the last
        ask, or by a writer already blocked on the full ring.  That writer may be one this rank waits for at a
        barrier: then no step boundary comes, and the writer would fail (docs/remotelog.md).  So the
        same checkpoint's coverage is applied again until the discard passes the hole.  What that checkpoint
        covers, every later image of this process covers too (a process restored from an image has nothing
        pending).  A try reads first whether it can move at all -- a committed record where the hole was, or
        the hole now known dead -- and only then the ring.  It never waits for a failed rank, nor mixes two
        incarnations of one (`RingWriter.strict`): while some rank is not up it does nothing, and once the
        ring's holder was replaced the try is dropped (the holder's recovery marked the ring lost, with head =
        tail; the next checkpoint's discard goes on from there).
        """
        if self.pending is None or (throttle and time.monotonic() < self.retry_at):
            return
        self.retry_at = time.monotonic() + RETRY_EVERY
        client, writer, home = self.memory.client, self.writer, self.log_home(self.rank)
        if client.link[home] != self.pending_link:
            self.pending = None
            return
        if any(state != UP for state in client.state):
            return  # its claims cannot be read, and nothing here may wait for it
        try:
            with writer.strict():
                before = writer.read_word(home, LOG, 8)
                filled = writer.read_word(home, LOG, CONTROL + before % self.ring.capacity) == before + 1
                if not filled and writer.dead_below(home, LOG, writer.read_word(home, LOG, 0)) <= before:
                    return  # still a hole that may be live, or that cannot be told yet
                self.memory.account("log_discard_retries")
                _, head, stopped = self._covered_prefix(self.pending, 0.0)
                if head > before:
                    writer.write_word(home, LOG, 8, head)
        except LinkMoved:
            return  # a rank failed meanwhile: again once it is back
        if not stopped:
            self.pending = None

    def _home_release_end(self, seen: tuple[int, dict[int, int]]) -> int:
        """How far a coordinated checkpoint releases the home diff log under onesided: past every record its
        image holds (committed when it was taken: `seen` = the tail then and those records' sizes by position),
        and past the holes then that no live rank can still fill (as `_covered_prefix`) and nobody filled since
        -- a writer that died between its reservation and its WRITE (else the log would never empty again)."""
        tail, committed = seen
        limit, log, at = self.writer.dead_below(self.rank, HOME, tail), self.home_log, self.home_flush
        filled = [r.position for r in scan(log.contents(at, max(at, log.readable_end())), at, self.size)]
        for start in [*sorted(p for p in committed if p >= at), tail]:
            if start > at and (start > limit or any(at <= p < start for p in filled)):
                break  # the hole [at, start) then: a live rank may write there, or one did since the image
            at = start + committed.get(start, 0)
        return at

    def discard(self) -> list[Record]:
        """Advance this rank's log ring's head past what the checkpoint covers, and clear its ``lost`` word
        (the checkpoint the ring's recovered holder asked for); release the home diff log if the checkpoint
        was a coordinated one; the records discarded."""
        if self.snapshot is None:
            return []
        snapshot, self.snapshot = self.snapshot, None
        self.writer.own_head = int(snapshot["own_tail"])  # the own records before the image: no recovery needs them
        # Strict (`RingWriter.strict`): a rank that fails meanwhile is not waited for, and nothing computed on the
        # holder's ring is written into its next incarnation, whose recovery marked the ring lost (head = tail)
        client, home = self.memory.client, self.log_home(self.rank)
        link = client.link[home]
        dropped: list[Record] = []
        try:
            with self.writer.strict():
                dropped, head, stopped = self._covered_prefix(snapshot, UNDECIDED_WAIT)
                self.writer.write_word(home, LOG, 8, head)
        except LinkMoved:
            stopped = True  # a rank failed or came back meanwhile: the retry goes on once every rank is up
        self.pending = snapshot if stopped and client.link[home] == link else None  # (a replaced holder's is lost)
        self.pending_link, self.retry_at = link, 0.0
        if self._holder_incarnation() == snapshot["holder"]:
            # the holder was not recovered since the image was taken: whatever it lost, this image covers (after
            # head: the ring holds what it should); else a checkpoint after its recovery clears the mark
            with contextlib.suppress(LinkMoved), self.writer.strict():
                self.writer.write_word(home, LOG, 16, 0)
                self.writer.write_word(home, OWN, 16, 0)
        self.replay = None  # the image is past every replayed operation
        if not snapshot["independent"]:
            # the new base holds what the home diff log held: kept since the last coordinated checkpoint
            # (`_versions`), it is released at the next one only
            end = self._home_release_end(snapshot["home"]) if self.onesided else self.home_flush
            with self.home_log.mutex:
                self.home_log.set_head(max(self.home_log.head, end))
                del self.overflow[: snapshot["overflow"]]  # those are in the base; later ones are not
            with self.versions.mutex:
                kept = self.own_diffs[: snapshot["own_diffs"]]
                del self.own_diffs[: snapshot["own_diffs"]]
            self.own_bytes -= sum(len(record) for _, record in kept)
            # the request past the high-water mark is answered: the next one may go (the ring's head, the key
            # of `_ask_checkpoint`, does not move when only this rank writes its pages)
            self.asked.pop((self.rank, HOME), None)
        return dropped
