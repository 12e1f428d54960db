"""Remote logging (FT-KDSM §4): one rank's diffs and write notices, written by RDMA into its peers' log rings.

Rationale.  Rank R's *log home* is L(R) = (R + offset) mod N.  Every rank holds three
rings in registered memory (`_ring.LogRing`): the *log ring* and the *own ring* of the
one rank whose log home it is, and its own *home diff log*.  What goes where, and when:

* an interval's diffs of the pages homed at H -> one DIFF record in H's log ring at L(H)
  (H's own writes to its pages too: so H's ring holds every change to its home pages since
  its image, in application order, which is what a recovery of H rebuilds its home copies
  from); if H != writer, under ``onesided`` (where H's CPU never sees the diff), one
  HOME_DIFF record in H's home diff log by RDMA too.  Both are reserved in
  ``dsm_interval_closing``, while the diffs go home, and written and complete before the
  interval completes (``dsm_interval_closed``): "the page writer can complete an interval
  only after the diffs are successfully sent to the page home and then to its log home"
  (§4.2).  So whatever a home applied is logged by the time anyone can observe the
  interval (Figure 1, case i); a writer that dies before that never released (case ii); a
  home that applied a diff and failed before its record landed gets the diff again from
  its writer (``dsm.Memory._send_again``).
* under ``async`` the home appends every diff it receives to its own home diff log on its
  handler thread, by the CPU, one record per message (a writer's interval for this home;
  the ring is never FETCH_AND_ADDed by peers under ``async``, so the CPU is the only
  appender); its own writes (homes twin their own pages while
  logging, ``memory.twin_homes``) go there too, by the CPU.  Under ``onesided`` peers
  reserve in that ring with FETCH_AND_ADDs, which CPU stores on the tail would not be
  atomic with, so the home keeps its own writes' records beside it (``own_diffs``, by the
  CPU, each with the ring's tail as its interval closes: that is where they go in the
  ring's order, `_keep_own`), where they went by RDMA on the loopback QP before -- a
  reservation and a WRITE per interval.
* at a lock acquire, the grant's notices and the new vector timestamp -> a NOTICES record
  in the acquirer's own ring at L(acquirer), posted in ``dsm_lock_acquired``, before the
  program thread returns to the program, and complete before any diff of the next
  interval leaves (``dsm_interval_closing`` waits for it): a diff at a home whose acquire
  is not in the log would be applied twice by a recovery, which would re-execute that
  critical section live rather than on minimal versions (§4.3, Figure 2: a failure
  before this point re-acquires; after it, the log holds the acquire).  ``pointer`` is
  the acquirer's home diff log tail at that moment ("a pointer to the last diff log
  entry that precedes the acquire").
* at a release, a RELEASE record (tag lock, interval the acquisition's token) in the
  releaser's own ring, complete before the release leaves.  When the release closes an
  interval that wrote, ``dsm_interval_closing`` says so (``release``) and the record is
  placed then and posted once the interval's records are complete (never before: they
  go to other log homes, over other QPs); otherwise in ``dsm_lock_releasing``, on its
  own.  A replay then knows which releases reached the home.
* barriers, two-phase: each rank writes its arrival (BARRIER_ARRIVAL, its notices) into
  its own ring, completed before its arrival leaves (``dsm_barrier_arriving``); the
  merged reply is logged by each *receiving rank itself* (BARRIER), posted in
  ``dsm_barrier_passed`` and complete before the next interval's diffs leave, like
  NOTICES.  Chosen over the manager writing N records: the manager's handler thread
  would have to drive RDMA on a client endpoint that belongs to the program thread,
  and the barrier's critical path would grow by N writes at one rank.
* so a rank's own records (NOTICES, RELEASE, BARRIER_ARRIVAL, BARRIER) carry its serial
  in program order and its own interval count after the operation (the gid field:
  `_recover` tells own DIFFs before the last replayed operation from later ones by it),
  and everything of it another rank can observe (a release, an arrival) is logged
  before it leaves: once a recovery has replayed the last one, no home holds a write
  that happened after the rank's current point (`_replay`).

How (`_writer`): the own ring has one writer, its owner, which keeps its tail and head
and posts each record at once, with no reservation.  DIFF and HOME_DIFF records are
queued and appended in batches -- one round of FETCH_AND_ADDs on the rings' tails, one
of RDMA WRITEs (the records' bodies before their commit words, `_records`) -- at the
interval's close (reserved while the diffs go home, written and waited for before the
interval completes).  All of it on the DSM's own client endpoint QPs, whose completion
is the proof of logging: no ack, and the log home's threads do nothing.

Bounded memory: a reservation that finds its ring half full asks for the ring owner's
checkpoint (``rt.checkpoint_rank(owner)`` where the runtime has it, else
``rt.checkpoint()``; for a home diff log always ``rt.checkpoint()``, as only a
coordinated checkpoint releases it; counted in ``log_full_checkpoints``); one that does not fit waits,
re-reading ``head``, for the owner to checkpoint and discard.  That wait cannot be
unbounded: the owner may be blocked on this very writer (a lock it holds, a barrier it
has not reached), so after `FULL_TIMEOUT` seconds it fails with a DsmError naming the
ring and the option to raise, rather than hang -- at once when the owner's wait word
says it waits in a barrier this writer has not entered, or for a lock it holds
(`_publish_wait`).  Without single-rank checkpoints (``rt.checkpoint_rank``) it fails at
once: a coordinated checkpoint needs this writer at a step boundary, which it cannot reach
while it waits.  An own record that does not
fit its own ring fails at once too, and so does a DIFF record of a home's own writes that does not fit
its log ring: in both the owner is the writer, mid-step.  A record is
never dropped: the reservation stays, and the job stops with the error.  A home's own
HOME_DIFF records never wait: under async the home diff log keeps what does not fit in
``overflow``, under onesided they are kept beside the ring (``own_diffs``); both are in
memory and in the image, and bounded only by the coordinated checkpoint they ask for.

Discard: at its checkpoint the owner R snapshots what its image holds (the home's
``applied`` columns, its record serial, its barrier epoch); once the checkpoint exists
(``ckpt_checkpointed``) it reads its log ring at L(R) by RDMA and advances ``head`` past
the longest prefix of committed records the image covers -- exact under independent
checkpoints too, where writers keep appending meanwhile --, moves its own ring's head
(which it keeps itself) to its image's own tail, and clears both rings' ``lost`` words
(`_ring`).  The home diff log is in the image (the ring is pickled with the memory),
and is kept since the last *coordinated* checkpoint, whose base copies it completes
(`_versions`): it is released only at the next coordinated checkpoint, once the new base
is taken.  Recovery from the logs: `_recover`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import ckpt
from ckpt import verbs
from ckpt.plugin import RANKS_NS
from dsm import Diff, DsmError

from . import _recover
from ._discard import Discard
from ._records import (
    RECORD_FORMAT,
    RecordKind,
    as_kind,
    diff_record,
    encode,
    notices_payload,
)
from ._replay import LogReplay
from ._ring import MIN_CAPACITY, REMOTE, LogRing, own_home_refusal
from ._versions import HomeVersions
from ._writer import CLAIMS, HIGH_WATER, HOME, IDLE, LOG, OWN, WAITS, RingWriter

log = logging.getLogger(__name__)
REASK = 5.0  # seconds after which a writer blocked on a full ring asks its owner's checkpoint again


class RemoteLog(Discard):
    """One rank's remote logging for one `dsm.Memory` (kept in ``memory.extensions``, pickled with it)."""

    def __init__(self, memory: Any, offset: int, ring_bytes: int) -> None:
        size = memory.size
        refused = own_home_refusal(offset, size)
        if refused is not None:  # (the launcher refuses it first: `ckpt_job_start`)
            raise DsmError(refused)
        self.memory, self.rt = memory, memory.rt
        self.rank, self.size, self.offset = int(memory.rank), int(size), offset
        self.onesided = memory.protocol == "onesided"
        ring_bytes = max(MIN_CAPACITY, -(-ring_bytes // 8) * 8)
        self.ring = LogRing(memory.pd, ring_bytes)  # the log ring of rank (rank - offset) mod size
        self.own_ring = LogRing(memory.pd, ring_bytes)  # the own ring of the same rank (its control words unused)
        # this rank's home diff log: twice a log ring, as it gets the same diffs as this rank's log ring but is
        # released only by coordinated checkpoints -- so a log ring fills (an independent checkpoint empties it)
        # well before the home diff log that mirrors it does
        self.home_log = LogRing(memory.pd, 2 * ring_bytes)
        self.record_format = RECORD_FORMAT  # what the rings in this image hold (`__setstate__`)
        self.serial = 0  # records of this rank's own (NOTICES, RELEASE, BARRIER_ARRIVAL, BARRIER) so far
        self.diffs: list[tuple[int, int, int, Diff]] = []  # this interval's (gid, home, i, diff)
        self.notices: list[Any] = []  # received at the current acquire / barrier
        self.overflow: list[bytearray] = []  # async home diff log records that found it full (in the image)
        # onesided: this home's HOME_DIFF records of its own writes since the last coordinated checkpoint, each
        # with the home diff log's tail when it was made (`_keep_own`; in the image)
        self.own_diffs: list[tuple[int, bytearray]] = []
        self.own_bytes = 0  # their bytes
        self.asked: dict[tuple[int, str], tuple[int, float]] = {}  # ring -> its head, and when, at the last ask
        self.snapshot: dict[str, Any] | None = None
        # the snapshot of the last discard, while that discard stopped at a hole (`retry_discard`); the link to
        # the ring's holder it was made on; when to try next
        self.pending: dict[str, Any] | None = None
        self.pending_link, self.retry_at = 0, 0.0
        self.home_flush = 0
        # this rank's claim words, one per ring it may reserve in (`_writer`, "Claims"), read by the rings' owners
        self.claims = verbs.shared_array(2 * size, np.int64)  # read by RDMA
        self.claims[:] = IDLE
        self.claims_mr = verbs.MR(memory.pd, self.claims, REMOTE)
        claims = {"addr": self.claims_mr.buf, "rkey": self.claims_mr.rkey, "capacity": 0}
        # this rank's wait word, read by a writer that waits for room in this rank's log ring
        # (`RingWriter.wait_for_room`), once nothing but this rank's next checkpoint can empty the ring (no
        # discard of its last one is left to retry): 1 + the epoch of the barrier it waits in, -(1 + the lock)
        # it waits for, else 0 -- it cannot take that checkpoint inside a wait that waits for that writer
        self.waits = verbs.shared_array(1, np.int64)
        self.waits_mr = verbs.MR(memory.pd, self.waits, REMOTE)
        waits = {"addr": self.waits_mr.buf, "rkey": self.waits_mr.rkey, "capacity": 0}
        self.peers: list[dict[str, dict[str, int]]] = memory.rt.allgather(
            {
                LOG: self.ring.address(),
                HOME: self.home_log.address(),
                OWN: self.own_ring.address(),
                CLAIMS: claims,
                WAITS: waits,
            }
        )
        own_home = self.log_home(self.rank)
        self.writer = RingWriter(
            memory, self.peers, ring_bytes, self.owner, self._ask_checkpoint, own_home, self.claims, self.retry_now
        )
        self.versions = HomeVersions(memory, self.home_log, self.overflow, self.own_diffs)
        self.replay: LogReplay | None = None  # after a recovery: the log it replayed (until the next checkpoint)
        # (lock, token) of a release whose record went into its interval's batch (`dsm_interval_closing`)
        self.release_logged: tuple[int, int] | None = None
        memory.versions = self.versions
        memory.twin_homes = True
        self.register()

    # ------------------------------------------------------------------ plugin host
    def register(self) -> None:
        host = getattr(self.rt, "plugins", None)
        if host is not None:
            from dsm import hookspecs

            host.add_hookspecs(hookspecs)
            host.register(self, name=f"remotelog-{id(self)}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["asked"] = {}  # times of this process's clock
        state.update(pending=None, retry_at=0.0)  # a discard of this process's (one from the image: at its checkpoint)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("record_format") != RECORD_FORMAT:
            # its rings' records have no check (or own rings are missing): they would read as never written
            older = "this image was written by an older ckpt_remotelog (another log record format)"
            raise DsmError(f"{older}: it cannot resume")
        # (images from before `retry_discard`, and from before the wait word)
        self.__dict__.update({"pending": None, "retry_at": 0.0, "waits": None, **state})
        if self.waits is not None:
            self.waits[0] = 0  # a process restored from an image waits for nothing
        if self.writer.retry is None:  # an image from before `retry_now`
            self.writer.retry = self.retry_now
        self.register()  # before the memory decides which DSM hooks fire (it is unpickled after this)

    def log_home(self, rank: int) -> int:
        return (rank + self.offset) % self.size

    def owner(self, peer: int, which: str) -> int:
        return (peer - self.offset) % self.size if which in (LOG, OWN) else peer

    # ------------------------------------------------------------------ DSM hooks (program thread unless noted)
    def replaying(self) -> bool:
        """The DSM is replaying this rank's log: what it does is logged already."""
        replay = self.memory.replay
        return replay is not None and not replay.done  # the catch-up after it is logged as usual

    def replayed(self, kind: RecordKind, tag: int, token: int = 0) -> bool:
        """Is this operation one the last replay answered from the log (whenever the DSM fires its hook)?"""
        return self.replaying() or (self.replay is not None and self.replay.replayed(kind, tag, token))

    @ckpt.hookimpl
    def dsm_diff_created(self, gid: int, home: int, interval: int, diff: Diff) -> None:
        if not self.replaying():
            self.diffs.append((gid, home, interval, diff))

    @ckpt.hookimpl
    def dsm_interval_closing(self, interval: int, release: int) -> None:
        # one record per ring: the interval's diffs of the pages of one home (`_records.diff_record`)
        by_home: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
        for gid, home, i, diff in self.diffs:
            by_home.setdefault((home, i), []).append((gid, diff.encode()))
        self.diffs.clear()
        for (home, i), pages in by_home.items():
            record = diff_record(RecordKind.DIFF, self.rank, i, pages)
            if home == self.rank:
                self.log_home_diffs([as_kind(record, RecordKind.HOME_DIFF)])
            elif self.onesided:
                self.writer.add(home, HOME, as_kind(record, RecordKind.HOME_DIFF))
            self.writer.add(self.log_home(home), LOG, record)
        if release >= 0:
            token = int(self.memory.tokens.get(release, 0))
            if not self.replayed(RecordKind.RELEASE, release, token):
                # placed now, posted once the interval's records are complete (`dsm_interval_closed`): the
                # release then costs no round trip of its own (`dsm_lock_releasing`)
                self._own(RecordKind.RELEASE, b"", release, token, interval=interval, last=True)
                self.release_logged = (release, token)
        self.writer.start()  # reserved while the diffs go home; written and waited for when the interval is closed
        # the acquire's NOTICES or the barrier's BARRIER (posted when it returned) is complete before a diff of this
        # interval can reach a home: a recovery that replays to that operation re-executes this interval on
        # minimal versions (a diff applied at a home whose acquire is not in the log would be applied twice by a
        # live re-execution)
        self.writer.settle()

    @ckpt.hookimpl(tryfirst=True)
    def dsm_interval_closed(self) -> None:
        self.writer.complete()  # the interval completes: what it depends on is logged from here on
        if self.pending is not None:
            self.retry_discard(throttle=True)

    def retry_now(self) -> None:
        """A home whose own diffs filled its log ring: the discard its last checkpoint began may pass its hole
        now (`RingWriter.wait_for_room`)."""
        self.retry_discard(throttle=False)

    @ckpt.hookimpl
    def dsm_waiting(self, what: str) -> None:
        """The program waits in a barrier or for a lock: the rank it waits for may be blocked on this rank's
        full log ring, behind the hole the last discard stopped at -- or, with no such hole, on nothing but
        this rank's next checkpoint, which it says in its wait word."""
        if self.pending is not None:
            self.retry_discard(throttle=True)
        self._publish_wait()

    def _publish_wait(self) -> None:
        """Set the wait word (see `__init__`) from `memory.waiting_for`: a writer blocked on this rank's full log
        ring fails at once if this rank waits for it, unless a retried discard may still make room.

        Program thread only (the lock and barrier hooks and `dsm_waiting`, which the handler thread never
        fires); the checkpoint thread changes `pending` only at a step boundary, outside every wait.  Set once
        the wait has lasted WAKE seconds (`dsm_waiting`), cleared when it ends.
        """
        if self.waits is None:  # (an image from before the wait word has none)
            return
        waiting = self.memory.waiting_for if self.pending is None else None
        if waiting is None:
            self.waits[0] = 0
        else:
            kind, what = waiting
            self.waits[0] = what + 1 if kind == "barrier" else -(what + 1)

    @ckpt.hookimpl
    def dsm_diffs_received(self, writer: int, interval: int, diffs: list[tuple[int, Diff]]) -> None:
        """*handler*, async: the home keeps every diff it applies -- a message's in one record, before any is
        applied."""
        pages = [(gid, diff.encode()) for gid, diff in diffs]
        self._append_home_local(diff_record(RecordKind.HOME_DIFF, writer, interval, pages))

    @ckpt.hookimpl
    def dsm_write_notices_received(self, source: str, notices: list[Any]) -> None:
        if not self.replaying():  # a replayed grant's or barrier's notices are in its record already
            self.notices.extend(notices)

    @ckpt.hookimpl
    def dsm_lock_acquired(self, lock: int, seconds: float) -> None:
        self._publish_wait()  # waits for nothing now
        token = int(self.memory.tokens.get(lock, 0))
        if self.replayed(RecordKind.NOTICES, lock, token):
            self.notices = []
            return
        payload = notices_payload(list(self.memory.vt), self.notices)
        self.notices = []
        # posted, not waited for: complete before the next interval's diffs leave (`dsm_interval_closing`)
        self._own(RecordKind.NOTICES, payload, lock, token)

    @ckpt.hookimpl
    def dsm_lock_releasing(self, lock: int) -> None:
        token = int(self.memory.tokens.get(lock, 0))
        if self.replayed(RecordKind.RELEASE, lock, token):
            return
        if self.release_logged != (lock, token):
            self._own(RecordKind.RELEASE, b"", lock, token)  # the interval had nothing to close: on its own
        # complete (a no-op when `dsm_interval_closed` completed it already; its interval may also have failed
        # before its records were complete, and a retried release must not log it twice)
        self.writer.flush()  # this rank's state becomes visible through the lock: logged (diffs first) before
        self.release_logged = None

    @ckpt.hookimpl
    def dsm_barrier_arriving(self, epoch: int, notices: list[Any]) -> None:
        if self.replayed(RecordKind.BARRIER_ARRIVAL, epoch):
            return
        self._own(RecordKind.BARRIER_ARRIVAL, notices_payload(list(self.memory.vt), notices), epoch)
        self.writer.flush()  # the manager can observe the arrival: logged before it leaves
        if self.pending is not None:
            self.retry_discard(throttle=False)  # a writer this barrier waits for may wait for room in the ring

    @ckpt.hookimpl
    def dsm_barrier_passed(self, epoch: int) -> None:
        self._publish_wait()  # waits for nothing now
        if self.replayed(RecordKind.BARRIER, epoch):
            self.notices = []
            return
        payload = notices_payload(list(self.memory.vt), self.notices)
        self.notices = []
        self._own(RecordKind.BARRIER, payload, epoch)  # posted, not waited for: as an acquire's NOTICES

    def _own(
        self, kind: RecordKind, payload: bytes, tag: int, token: int = 0, interval: int = -1, last: bool = False
    ) -> None:
        """Log one of this rank's own records in its own ring at its log home, with its next serial and (in the
        gid field) its own interval count after this operation -- `interval`, or ``vt[rank]`` when -1 (`last`:
        `RingWriter.own`)."""
        serial = self._serial()
        own = int(self.memory.vt[self.rank]) if interval < 0 else interval
        record = encode(
            kind, self.rank, payload, interval=token, gid=own, tag=tag, pointer=self.home_log.tail, serial=serial
        )
        self.writer.own(record, last)

    def flush(self) -> None:
        """Append and complete every queued record now (tests; the hooks do it as the invariant needs)."""
        self.writer.flush()

    def _serial(self) -> int:
        self.serial += 1
        return self.serial - 1

    def _append_home_local(self, *records: bytearray) -> None:
        started = time.perf_counter()
        # once one record overflowed, later ones follow it there: the log's order is the order applied
        appended = 0 if self.overflow else self.home_log.append_local(*records)
        if appended < len(records):
            self.overflow += records[appended:]  # kept (and checkpointed) until the home's checkpoint: never lost
            self.memory.account("log_full_waits", len(records) - appended)
            self._ask_checkpoint(self.rank, HOME, self.home_log.head)
        elif self.home_log.tail - self.home_log.head > HIGH_WATER * self.home_log.capacity:
            self._ask_checkpoint(self.rank, HOME, self.home_log.head)
        self._logged_by_cpu(records, started)

    def _logged_by_cpu(self, records: Sequence[bytearray], started: float) -> None:
        self.memory.account("log_records", len(records))
        self.memory.account("log_bytes", sum(len(record) for record in records))
        self.memory.account("log_seconds", time.perf_counter() - started)

    def log_home_diffs(self, records: list[bytearray]) -> None:
        """This home's own HOME_DIFF records (its writes; a recovery's rebuilt ones too), by the CPU: into its
        home diff log under async, beside it under onesided (`_keep_own`)."""
        if self.onesided:
            self._keep_own(records)
        else:
            self._append_home_local(*records)

    def _keep_own(self, records: list[bytearray]) -> None:
        """onesided: keep this home's HOME_DIFF records of its own writes by the CPU, beside the home diff log.

        The ring is reserved by peers' FETCH_AND_ADDs, which a CPU store on its tail would not be atomic with;
        going through the HCA cost a reservation and a WRITE on the loopback QP per interval.  Kept apart, each
        record holds the ring's tail as this interval closes, which is all `HomeVersions` needs to put it in
        the order the home's copy went through: a peer's diff that happened before this interval was reserved
        before that peer released (below the tail read now), one that happens after it is reserved after this
        rank releases (at or above it); concurrent ones touch other bytes.  A recovery's rebuild keeps the
        records it replays here too (the peers wait meanwhile, so they go before whatever is reserved after),
        so under onesided only the HCA appends to the ring.  Released with the home diff log, at coordinated
        checkpoints; past the ring's high-water mark in bytes one is asked for (once per release), but a record
        is never refused: like async's overflow, the list is bounded by that request only.
        """
        started = time.perf_counter()
        pointer = self.home_log.tail
        with self.versions.mutex:
            self.own_diffs += [(pointer, record) for record in records]
        self.own_bytes += sum(len(record) for record in records)
        if self.own_bytes > HIGH_WATER * self.home_log.capacity:
            self._ask_checkpoint(self.rank, HOME, self.home_log.head)  # once, until a coordinated one releases it
        self._logged_by_cpu(records, started)

    def _ask_checkpoint(self, peer: int, which: str, head: int, again: bool = False) -> None:
        """Ask once per ring fill (until its head moves) for the owner's checkpoint -- `again`, a writer blocked on
        the full ring, after `REASK` seconds too (a checkpoint whose discard could not pass a hole yet)."""
        key, now = (peer, which), time.monotonic()
        if key in self.asked and self.asked[key][0] == head and (not again or now - self.asked[key][1] < REASK):
            return
        self.asked[key] = (head, now)
        owner = self.owner(peer, which)
        self.memory.account("log_full_checkpoints")
        log.info("rank %d: the %s ring of rank %d is filling: asking for its checkpoint", self.rank, which, owner)
        by_rank = getattr(self.rt, "checkpoint_rank", None)
        if by_rank is not None and which in (LOG, OWN):
            by_rank(owner)
        else:  # a home diff log is released at coordinated checkpoints only (`_versions`)
            self.rt.checkpoint()

    @ckpt.hookimpl
    def ckpt_precheckpoint(self, independent: bool) -> None:  # no default: pluggy would never pass it
        memory = self.memory
        self.snapshot = {
            "applied": [region.applied() for region in memory.regions],  # a remote diff may be in progress
            "serial": self.serial,
            "own_tail": self.writer.own_tail,
            "epoch": memory.epoch,
            "overflow": len(self.overflow),
            "own_diffs": len(self.own_diffs),
            "independent": bool(independent),
            "holder": self._holder_incarnation(),
        }
        self.home_flush = self.home_log.committed_end()  # what the image holds of the home diff log
        if self.onesided and not independent:  # ... and past its first hole, which `_home_release_end` may pass
            committed = {r.position: r.size for r in self.home_log.scan(self.size) if r.position >= self.home_flush}
            self.snapshot["home"] = (self.home_log.tail, committed)
        if not independent:
            self.versions.take_base()  # in the image: a whole-job restart goes back to this checkpoint

    def _holder_incarnation(self) -> int:
        """The incarnation of this rank's log home, as the coordinator knows it (0: never recovered)."""
        return int(self.rt.kv.get(RANKS_NS, f"incarnation/{self.log_home(self.rank)}", 0))

    @ckpt.hookimpl
    def ckpt_checkpointed(self) -> None:
        self.discard()

    @ckpt.hookimpl
    def dsm_recovering(self, incarnation: int, reports: dict[int, dict[str, Any]]) -> None:
        """This rank replaced a failed one: rebuild its home copies from its log ring and start its replay."""
        _recover.recover(self, incarnation)

    @ckpt.hookimpl
    def ckpt_resume(self, restarted: bool, aborted: bool) -> None:
        if aborted:
            self.snapshot = None
        if restarted and not getattr(self.rt, "recovered", False):
            # a whole-job restart: every rank is back at one coordinated checkpoint, so nothing logged before
            # it is needed any more (the rings came back from the images as they were when it was taken)
            self.ring.set_head(self.ring.tail)
            self.ring.control[2] = 0  # its owner is back at the same checkpoint: nothing it logged is missing
            self.own_ring.control[2] = 0
            self.writer.own_head = self.writer.own_tail
            self.home_log.set_head(self.home_log.committed_end())
            self.overflow.clear()
            with self.versions.mutex:
                self.own_diffs.clear()
            self.own_bytes = 0
            self.snapshot = self.pending = None
            self.replay = None
