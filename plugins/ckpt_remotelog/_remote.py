"""Remote logging (FT-KDSM §4): one rank's diffs and write notices, written by RDMA into its peers' log rings.

Rationale.  Rank R's *log home* is L(R) = (R + offset) mod N.  Every rank holds two
rings in registered memory (`_ring.LogRing`): the *log ring* of the one rank whose log
home it is, and its own *home diff log*.  What goes where, and when:

* a diff of a page homed at H != writer -> a DIFF record in H's log ring at L(H), and,
  under ``onesided`` (where H's CPU never sees the diff), a HOME_DIFF record in H's home
  diff log by RDMA too.  Both are written in ``dsm_interval_closing``, i.e. before the
  diff itself leaves: "the page writer can complete an interval only after the diffs are
  successfully sent to the page home and then to its log home" (§4.2), made stronger --
  the log is complete before the home can apply the diff, so whatever a home applied is
  logged (Figure 1, case i); a writer that dies before that never released (case ii).
* under ``async`` the home appends every diff it receives to its own home diff log on its
  handler thread, by the CPU (the ring is never FETCH_AND_ADDed by peers under ``async``,
  so the CPU is the only appender); its own writes (homes twin their own pages while
  logging, ``memory.twin_homes``) go there too, by the CPU under ``async`` and by RDMA
  on the loopback QP under ``onesided`` (one appender kind per ring: CPU stores and NIC
  atomics on one word do not mix).
* at a lock acquire, the grant's notices and the new vector timestamp -> a NOTICES record
  at L(acquirer), written in ``dsm_lock_acquired``, before the program thread returns to
  the program, hence before it uses them (§4.3, Figure 2: a failure before this point
  re-acquires; after it, the log holds the acquire).  Its position in the ring orders it
  after every DIFF record reserved before it; ``pointer`` is the acquirer's home diff
  log tail at that moment ("a pointer to the last diff log entry that precedes the
  acquire").
* barriers, two-phase: each rank writes its arrival notices (BARRIER_ARRIVAL) into the
  manager's (rank 0's) ring at L(0) before its arrival leaves (``dsm_barrier_arriving``);
  the merged reply is logged by each *receiving rank itself* (BARRIER at L(rank)) before
  ``Memory.barrier`` returns (``dsm_barrier_passed``).  Chosen over the manager writing
  N records: the manager's handler thread would have to drive RDMA on a client endpoint
  that belongs to the program thread, and the barrier's critical path would grow by N
  writes at one rank; written by the receiver, the invariant -- nothing a rank uses is
  unlogged at its log home when the interval that depends on it completes -- holds
  because the record is complete before the rank leaves the barrier.

How (`_writer`): records are queued and appended in batches -- one round of
FETCH_AND_ADDs on the rings' tails, one of RDMA WRITEs (each record's body before its
commit word, `_records`) -- on the DSM's own client endpoint QPs, whose completion is
the proof of logging: no ack, and the log home's threads do nothing.  A batch goes at
the interval's close (its writes waited for once the diffs are home, before the
interval completes), before a release and before a barrier arrival leaves (waited for
there); an acquire's or a barrier's record joins the next batch, which completes before
any interval that depends on it does -- the invariant above.

Bounded memory: a reservation that finds its ring half full asks for the ring owner's
checkpoint (``rt.checkpoint_rank(owner)`` where the runtime has it, else
``rt.checkpoint()``; counted in ``log_full_checkpoints``); one that does not fit waits,
re-reading ``head``, for the owner to checkpoint and discard.  That wait cannot be
unbounded: the owner may be blocked on this very writer (a lock it holds, a barrier it
has not reached), so after `FULL_TIMEOUT` seconds it fails with a DsmError naming the
ring and the option to raise, rather than hang.  Without single-rank checkpoints
(``rt.checkpoint_rank``) it fails at once: a coordinated checkpoint needs this writer
at a step boundary, which it cannot reach while it waits.  A record is never dropped:
the reservation stays, and the job stops with the error.

Discard: at its checkpoint the owner R snapshots what its image holds (the home's
``applied`` columns, its record serial, its barrier epoch); once the checkpoint exists
(``ckpt_checkpointed``) it reads its log ring at L(R) by RDMA and advances ``head`` past
the longest prefix of committed records the image covers -- exact under independent
checkpoints too, where writers keep appending meanwhile.  The home diff log is in the
image (the ring is pickled with the memory): its committed prefix is then released too.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ckpt
from dsm import DsmError

from ._records import (
    HEADER_SIZE,
    Record,
    RecordKind,
    diff_payload,
    encode,
    notices_payload,
)
from ._ring import LogRing
from ._writer import HIGH_WATER, HOME, LOG, RingWriter

log = logging.getLogger(__name__)


class RemoteLog:
    """One rank's remote logging for one `dsm.Memory` (kept in ``memory.extensions``, pickled with it)."""

    def __init__(self, memory: Any, offset: int, ring_bytes: int) -> None:
        size = memory.size
        if size > 1 and offset % size == 0:
            raise DsmError(f"--log-home-offset {offset} makes every rank its own log home with {size} ranks")
        self.memory, self.rt = memory, memory.rt
        self.rank, self.size, self.offset = int(memory.rank), int(size), offset
        self.onesided = memory.protocol == "onesided"
        ring_bytes = max(4 * HEADER_SIZE, -(-ring_bytes // 8) * 8)
        self.ring = LogRing(memory.pd, ring_bytes)  # the log ring of rank (rank - offset) mod size
        self.home_log = LogRing(memory.pd, ring_bytes)  # this rank's home diff log
        self.serial = 0  # records of this rank's own (NOTICES, BARRIER) so far
        self.diffs: list[tuple[int, int, int, list[tuple[int, bytes]]]] = []  # this interval's (gid, home, i, diff)
        self.notices: list[Any] = []  # received at the current acquire / barrier
        self.overflow: list[bytearray] = []  # async home diff log records that found it full (in the image)
        self.asked: dict[tuple[int, str], int] = {}  # ring -> its head when its owner's checkpoint was asked
        self.snapshot: dict[str, Any] | None = None
        self.home_flush = 0
        self.peers: list[dict[str, dict[str, int]]] = memory.rt.allgather(
            {LOG: self.ring.address(), HOME: self.home_log.address()}
        )
        self.writer = RingWriter(memory, self.peers, ring_bytes, self.owner, self._ask_checkpoint)
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
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.register()  # before the memory decides which DSM hooks fire (it is unpickled after this)

    def log_home(self, rank: int) -> int:
        return (rank + self.offset) % self.size

    def owner(self, peer: int, which: str) -> int:
        return (peer - self.offset) % self.size if which == LOG else peer

    # ------------------------------------------------------------------ DSM hooks (program thread unless noted)
    @ckpt.hookimpl
    def dsm_diff_created(self, gid: int, home: int, interval: int, diff: list[tuple[int, bytes]]) -> None:
        self.diffs.append((gid, home, interval, diff))

    @ckpt.hookimpl
    def dsm_interval_closing(self, interval: int) -> None:
        records: list[tuple[int, str, bytearray]] = []
        for gid, home, i, diff in self.diffs:
            payload = diff_payload(diff)
            if home == self.rank:
                own = encode(RecordKind.HOME_DIFF, self.rank, payload, interval=i, gid=gid)
                if self.onesided:
                    records.append((self.rank, HOME, own))
                else:
                    self._append_home_local(own)
                continue
            records.append((self.log_home(home), LOG, encode(RecordKind.DIFF, self.rank, payload, interval=i, gid=gid)))
            if self.onesided:
                records.append((home, HOME, encode(RecordKind.HOME_DIFF, self.rank, payload, interval=i, gid=gid)))
        self.diffs.clear()
        for peer, which, record in records:
            self.writer.add(peer, which, record)
        self.writer.start()  # reserved while the diffs go home; written and waited for when the interval is closed

    @ckpt.hookimpl(tryfirst=True)
    def dsm_interval_closed(self) -> None:
        self.writer.complete()  # the interval completes: what it depends on is logged from here on

    @ckpt.hookimpl
    def dsm_diff_received(self, writer: int, gid: int, interval: int, diff: list[tuple[int, bytes]]) -> None:
        """*handler*, async: the home keeps every diff it applies."""
        self._append_home_local(encode(RecordKind.HOME_DIFF, writer, diff_payload(diff), interval=interval, gid=gid))

    @ckpt.hookimpl
    def dsm_write_notices_received(self, source: str, notices: list[Any]) -> None:
        self.notices.extend(notices)

    @ckpt.hookimpl
    def dsm_lock_acquired(self, lock: int, seconds: float) -> None:
        payload = notices_payload(list(self.memory.vt), self.notices)
        record = encode(
            RecordKind.NOTICES, self.rank, payload, tag=lock, pointer=self.home_log.tail, serial=self._serial()
        )
        self.notices = []
        self.writer.add(self.log_home(self.rank), LOG, record, self.serial - 1)
        self.writer.start()
        self.writer.write()  # complete before the next interval completes (no hole left in the ring meanwhile)

    @ckpt.hookimpl
    def dsm_lock_releasing(self) -> None:
        self.writer.complete()  # this rank's state becomes visible through the lock

    @ckpt.hookimpl
    def dsm_barrier_arriving(self, epoch: int, notices: list[Any]) -> None:
        payload = notices_payload(list(self.memory.vt), notices)
        record = encode(RecordKind.BARRIER_ARRIVAL, self.rank, payload, tag=epoch)
        self.writer.add(self.log_home(0), LOG, record)
        self.writer.start()  # overlaps the wait at the barrier (FT-KDSM §4.3)

    @ckpt.hookimpl
    def dsm_barrier_passed(self, epoch: int) -> None:
        payload = notices_payload(list(self.memory.vt), self.notices)
        record = encode(
            RecordKind.BARRIER, self.rank, payload, tag=epoch, pointer=self.home_log.tail, serial=self._serial()
        )
        self.notices = []
        self.writer.add(self.log_home(self.rank), LOG, record, self.serial - 1)
        self.writer.start()  # writes phase 1's records, reserves this one
        self.writer.write()  # complete before the next interval completes (no hole left in the ring meanwhile)

    def flush(self) -> None:
        """Append and complete every queued record now (tests; the hooks do it as the invariant needs)."""
        self.writer.flush()

    def _serial(self) -> int:
        self.serial += 1
        return self.serial - 1

    def _append_home_local(self, record: bytearray) -> None:
        started = time.perf_counter()
        if not self.home_log.append_local(record):
            self.overflow.append(record)  # kept (and checkpointed) until the home's checkpoint: never lost
            self.memory.account("log_full_waits")
            self._ask_checkpoint(self.rank, HOME, self.home_log.head)
        elif self.home_log.tail - self.home_log.head > HIGH_WATER * self.home_log.capacity:
            self._ask_checkpoint(self.rank, HOME, self.home_log.head)
        self.memory.account("log_records")
        self.memory.account("log_bytes", len(record))
        self.memory.account("log_seconds", time.perf_counter() - started)

    def _ask_checkpoint(self, peer: int, which: str, head: int) -> None:
        """Ask once per ring fill (until its head moves) for the owner's checkpoint."""
        key = (peer, which)
        if self.asked.get(key) == head:
            return
        self.asked[key] = head
        owner = self.owner(peer, which)
        self.memory.account("log_full_checkpoints")
        log.info("rank %d: the %s ring of rank %d is filling: asking for its checkpoint", self.rank, which, owner)
        by_rank = getattr(self.rt, "checkpoint_rank", None)
        if by_rank is not None:
            by_rank(owner)
        else:
            self.rt.checkpoint()

    # ------------------------------------------------------------------ discard at checkpoint
    def remote_records(self) -> tuple[list[Record], int]:
        """The committed records of this rank's log ring at its log home, from its head (RDMA READ); the head."""
        return self.writer.read_ring(self.log_home(self.rank), LOG)

    def covered(self, record: Record, snapshot: dict[str, Any]) -> bool:
        """Does this rank's checkpoint (its `snapshot`) hold what `record` logs?"""
        if record.kind == RecordKind.DIFF:
            aid, page = record.gid >> 32, record.gid & 0xFFFFFFFF
            applied = snapshot["applied"]
            return aid < len(applied) and bool(applied[aid][page, record.writer] >= record.interval)
        if record.kind == RecordKind.BARRIER_ARRIVAL:
            return record.tag <= int(snapshot["epoch"])
        return record.writer == self.rank and record.serial < int(snapshot["serial"])

    def discard(self) -> list[Record]:
        """Advance this rank's log ring's head past what the checkpoint covers; the records discarded."""
        if self.snapshot is None:
            return []
        snapshot, self.snapshot = self.snapshot, None
        # still queued (an acquire or barrier after this rank's last interval): the image holds them, so they need
        # no logging -- writing them first could wait for room in this very ring, which only this discard makes
        self.writer.drop_own(int(snapshot["serial"]))
        records, head = self.remote_records()
        dropped: list[Record] = []
        for record in records:
            if not self.covered(record, snapshot):
                break
            dropped.append(record)
            head = record.position + record.size
        self.writer.write_word(self.log_home(self.rank), LOG, 8, head)
        with self.home_log.mutex:
            self.home_log.set_head(max(self.home_log.head, self.home_flush))
            del self.overflow[: snapshot["overflow"]]  # those are in the image; later ones are not
        return dropped

    @ckpt.hookimpl
    def ckpt_precheckpoint(self) -> None:
        memory = self.memory
        self.snapshot = {
            "applied": [region.meta[:, 2:].copy() for region in memory.regions],
            "serial": self.serial,
            "epoch": memory.epoch,
            "overflow": len(self.overflow),
        }
        self.home_flush = self.home_log.committed_end()  # what the image holds of the home diff log

    @ckpt.hookimpl
    def ckpt_checkpointed(self) -> None:
        self.discard()

    @ckpt.hookimpl
    def ckpt_resume(self, restarted: bool, aborted: bool) -> None:
        if aborted:
            self.snapshot = None
        if restarted and not getattr(self.rt, "recovered", False):
            # a whole-job restart: every rank is back at one coordinated checkpoint, so nothing logged before
            # it is needed any more (the rings came back from the images as they were when it was taken)
            self.ring.set_head(self.ring.tail)
            self.home_log.set_head(self.home_log.committed_end())
            self.overflow.clear()
            self.snapshot = None
            self.writer.drop_own(self.serial)
