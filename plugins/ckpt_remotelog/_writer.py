"""Appending records to peers' log rings by RDMA, on the DSM's own client endpoint: reserve, write, complete.

Rationale.  Logging must not add round trips the protocol does not already pay, or
its overhead is the network's latency times the number of records.  Two kinds of ring,
two ways in:

* a rank's *own* records (NOTICES, RELEASE, BARRIER_ARRIVAL, BARRIER) go to its own ring
  at its log home, which nobody else writes: the rank knows the ring's tail and head, so
  a record is placed with no reservation and posted at once (`own`).  An acquire and a
  barrier exit return without waiting for theirs (the next interval's close waits before
  any diff leaves); an idle release or a barrier arrival waits one round trip;
* DIFF and HOME_DIFF records go to rings that several ranks write.  They are queued and
  appended in batches, in three steps that are each posted to every peer at once and
  waited for only when the FT-KDSM invariant needs it -- nothing a rank uses is unlogged
  at its log home when an interval that depends on it completes:

  1. `start`: one round of FETCH_AND_ADDs on the tails of every ring the batch touches
     (with an RDMA READ of each head), not waited for: it overlaps the diffs' round
     trips at the interval's close.  A reserved record not yet written is a hole the
     ring's readers (the owner's discard at a checkpoint) cannot pass, so every hole is
     filled before the interval's close returns;
  2. `write`: once those have completed, the records' positions are theirs: one round
     of RDMA WRITEs (per ring, its consecutive records sealed -- commit word and check,
     `_records` -- in one WRITE), again not waited for;
  3. `complete`: wait for the WRITEs -- when an interval completes, which is when the
     invariant asks for it -- and then post and wait for a `last` own record (the
     RELEASE of a release that closes the interval).

Claims (so that a ring's owner can pass a dead writer's hole).  A writer that dies
between its reservation and its WRITE leaves a hole nobody fills, and the owner's discard
walks only up to the first hole -- the ring would fill for good.  So every rank publishes,
in registered memory, one *claim* word per ring it reserves in: ``IN_FLIGHT`` from before
its FETCH_AND_ADD is posted until `write` takes its answer (the interval's diffs leave in
between), then the lowest position it reserved and has not yet seen written, ``IDLE`` once
every WRITE is complete.  A claim is per link: after the ring's holder was replaced, its
ring starts again from its image, so an old claim says nothing about the new positions.  A hole
below every live rank's claim, and below the ring's tail read *before* those claims, is
nobody's that lives: the owner's discard passes it (`RemoteLog.discard`).

The endpoint belongs to the program thread, and so does this class (and, while the
program is parked, the checkpoint thread).  Posting goes straight to the endpoint's
QPs (a plugin that uses the DSM's connections, not QPs of its own, so that the DSM's
reconnection after a failure covers it too); the last WR of a post is signaled with a
one-sided work-request id, which `Endpoint.poll` files in ``rdma_done``.  A batch too
large for the send queue is run chunk by chunk (``Endpoint.run``), waiting as it goes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ckpt import verbs
from dsm import DsmError
from dsm._net import UP, chain

from ._records import Record, commit_word, scan, seal, sealed, walk
from ._ring import CONTROL, REMOTE, circular_read, circular_write, spans

log = logging.getLogger(__name__)
LOG, HOME, OWN = "log", "home", "own"  # the three rings every rank holds
ONE_SIDED = 3 << 40  # the kind bits `Endpoint.poll` files under one-sided completions
POST_LIMIT = 128  # WRs posted to one QP without waiting (the send queue holds 512)
FULL_TIMEOUT = 60.0  # seconds a writer waits for room in a full ring
HIGH_WATER = 0.5  # a reservation past this fill asks for the owner's checkpoint
OWN_READ = 64 << 10  # bytes of the own ring a recovery reads first (`RingWriter.read_own`)
CLAIMS = "claims"  # the peers' entry of the claim words
WAITS = "waits"  # the peers' entry of the wait word (`RemoteLog.waits`; absent in images from before it)
IDLE, IN_FLIGHT = -2, -1  # claims: nothing reserved and unwritten; a FETCH_AND_ADD whose answer is not back
NO_CLAIM = 1 << 62  # `lowest_claim` when no live rank claims anything


class LinkMoved(Exception):
    """Under `RingWriter.strict`: the peer of an operation failed, or its link was replaced, before it completed."""


class RingWriter:
    """The program thread's side of remote logging: queued records, their batches, the waits."""

    def __init__(
        self,
        memory: Any,
        peers: list[dict[str, dict[str, int]]],
        staging_bytes: int,
        owner: Callable[[int, str], int],
        ask: Callable[..., None],  # (peer, ring, head, again=False): `RemoteLog._ask_checkpoint`
        own_home: int,
        claims: np.ndarray,
        retry: Callable[[], None] | None = None,  # `RemoteLog.retry_now`: a stopped discard tries its hole again
    ) -> None:
        self.memory, self.peers, self.owner, self.ask, self.retry = memory, peers, owner, ask, retry
        self.claims = claims  # per (peer, ring): see "Claims" above; registered by the caller (`peers[r][CLAIMS]`)
        self.claim_links: dict[int, int] = {}  # claim word -> the link to its ring's holder it was made on
        # this rank's own ring at its log home: only this rank writes it, so it keeps the ring's tail and head
        # here, and `mine` mirrors it (a record is staged where it lies in the ring, and stays there until a
        # discard passes it: nothing in flight is ever overwritten)
        self.own_home, self.own_tail, self.own_head = own_home, 0, 0
        self.mine = np.zeros(peers[own_home][OWN]["capacity"], dtype=np.uint8)
        self.mine_mr = verbs.MR(memory.pd, self.mine, REMOTE)
        # records as they leave (`_place`)
        self.batch_limit = staging_bytes  # bytes of records one ring gets in one batch (`start`)
        self.staging = np.zeros(staging_bytes, dtype=np.uint8)
        self.staging_mr = verbs.MR(memory.pd, self.staging, REMOTE)
        self.landing = np.zeros(4 * len(peers) + 2, dtype=np.int64)  # per (peer, ring): old tail, head; +2 words
        self.landing_mr = verbs.MR(memory.pd, self.landing, REMOTE)
        self.queue: list[tuple[int, str, bytearray]] = []  # (peer, ring, record)
        # records per ring, FAA ids, peers not posted to (failed)
        self.reserved: tuple[dict[tuple[int, str], list[bytearray]], list[int], set[int]] | None = None
        self.writing: list[int] = []  # ids of the signaled WRITEs not yet seen complete
        self.last: list[verbs.SendWR] = []  # WRITEs of a `last` own record, posted once `writing` is done
        self.sent: dict[int, tuple[int, int]] = {}  # signaled WR id -> (peer, its link number when posted)
        self.links: list[int] | None = None  # under `strict`: every peer's link number when it began

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # an image is a point every record before it is covered by (ckpt_restart starts over from it): what is
        # queued, reserved or being written belongs to this process only
        state.update(queue=[], reserved=None, writing=[], sent={}, last=[], claim_links={}, links=None)
        # ... and every own record before it too: the discard after the checkpoint moves the head there, but only
        # in this process, after the image -- a rank recovered from the image must not count them as live
        state["own_head"] = self.own_tail
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"links": None, "retry": None, **state})  # (images from before `strict`, `retry`)
        if "claims" in state:  # else an older image, which `RemoteLog.__setstate__` refuses
            self.claims[:] = IDLE  # in place (the array is registered): a new process has nothing in flight

    # ------------------------------------------------------------------ batches
    def add(self, peer: int, which: str, record: bytearray) -> None:
        """Queue `record` for ring `which` (LOG or HOME) at `peer`: it goes with the next batch (`start`)."""
        self.queue.append((peer, which, record))

    def own(self, record: bytearray, last: bool = False) -> None:
        """Append one of this rank's own records to its own ring at its log home, posted now, not waited for.

        No reservation: only this rank writes that ring.  `last`: posted only once every WRITE posted
        before it is complete (`complete`) -- a release's record, which must not be in a log while a
        record of the interval it ends is missing from another log (RC orders one QP's WRITEs only,
        and the interval's records go to several).
        """
        peer, ring = self.own_home, self.peers[self.own_home][OWN]
        capacity, need, position = ring["capacity"], len(record), self.own_tail
        if position + need - self.own_head > HIGH_WATER * capacity:
            self.ask(peer, OWN, self.own_head)
        if position + need - self.own_head > capacity:
            # only this rank's checkpoint empties it, and this rank is not at a step boundary
            raise DsmError(
                f"rank {self.memory.rank}'s own log ring at rank {peer} is full and no checkpoint can empty it "
                "mid-step: raise --log-ring-bytes or checkpoint more often"
            )
        circular_write(self.mine, position, seal(record, position))
        self.own_tail = position + need
        base, lkey = self.mine_mr.buf, self.mine_mr.lkey
        wrs = _spanned(_write, ring, position, need, lambda ring_off, _: base + ring_off, lkey)  # sealed: one WRITE
        self.memory.counters.count("log_write", need)
        self.memory.account("log_records")
        self.memory.account("log_bytes", need)
        if last:
            self.last += wrs
        else:
            self._post(peer, wrs, self.writing)  # a failed log home: see `_post`

    def read_own(self, start: int) -> list[Record]:
        """This rank's own records at its log home from position `start` on, up to the first that is not
        committed (a recovery: from its image's `own_tail`), read back into `mine` by RDMA READ.

        From `OWN_READ` bytes on, doubled until the walk ends before what was read: a recovery waits for
        this, and the records since an image are usually a small part of the ring.
        """
        peer, ring = self.own_home, self.peers[self.own_home][OWN]
        capacity, base, lkey = ring["capacity"], self.mine_mr.buf, self.mine_mr.lkey
        size = min(capacity, OWN_READ)
        while True:
            wrs = _spanned(_read, ring, start, size, lambda ring_off, _: base + ring_off, lkey)
            self.memory.client.run(peer, wrs, self.memory.seq)
            self.memory.counters.count("log_read", size)
            data = circular_read(self.mine, start, start + size)
            records = walk(data, start)
            end = records[-1].position + records[-1].size - start if records else 0
            # the walk stopped at a word that is not the next record's commit word: nothing committed follows
            if size == capacity or (end + 8 <= size and data[end : end + 8] != commit_word(start + end)):
                return records
            size = min(capacity, 2 * size)

    def start(self) -> None:
        """Reserve room for every queued record: FETCH_AND_ADDs posted to every peer at once, not waited for."""
        if self.reserved is not None:
            self.write()  # one reservation at a time: each ring has one pair of landing words
        if not self.queue:
            return
        rings: dict[tuple[int, str], list[bytearray]] = {}
        for peer, which, record in self.queue:
            rings.setdefault((peer, which), []).append(record)
        self.queue = []
        reserve: dict[int, list[verbs.SendWR]] = {}
        for (peer, which), batch in rings.items():
            claim, link = _claim(peer, which), self.memory.client.link[peer]
            if self.claims[claim] == IDLE or self.claim_links.get(claim) != link:  # else a lower one is claimed
                self.claims[claim] = IN_FLIGHT  # before the FETCH_AND_ADD can reserve anything
                self.claim_links[claim] = link
            need, ring = sum(len(r) for r in batch), self.peers[peer][which]
            if need > min(ring["capacity"], self.batch_limit):  # `_place` stages a ring's batch at once
                too_big = f"{need} bytes of log records for one ring exceed {min(ring['capacity'], self.batch_limit)}"
                raise DsmError(f"{too_big}: raise --log-ring-bytes")
            slot = self._slot(peer, which)
            reserve.setdefault(peer, []).append(_atomic(self._land(slot), ring["rkey"], ring["addr"], need))
            reserve[peer].append(_read(self._land(slot + 1), ring["rkey"], ring["addr"] + 8))
        ids: list[int] = []
        dropped = {peer for peer, wrs in reserve.items() if not self._post(peer, wrs, ids)}
        self.memory.counters.count("log_fetch_add", 8 * len(rings))
        self.reserved = (rings, ids, dropped)

    def write(self) -> None:
        """Wait for the reservation (if any), then post its records' WRITEs, not waited for."""
        if self.reserved is None:
            return
        started = time.perf_counter()
        rings, ids, dropped = self.reserved
        self.reserved = None
        lost = dropped | self._wait(ids, "room in the log rings")
        self._drain("earlier log writes")  # they read from the staging buffer this batch fills
        total = sum(len(r) for batch in rings.values() for r in batch)
        count = sum(len(batch) for batch in rings.values())
        writes: dict[int, list[verbs.SendWR]] = {}
        at, big = 0, total > len(self.staging)
        for peer, which in rings:  # every claim first: a ring below may wait (for room, or ring by ring)
            claim, tail = _claim(peer, which), int(self.landing[self._slot(peer, which)])
            if peer not in lost and (self.claims[claim] < 0 or self.claims[claim] > tail):
                self.claims[claim] = tail
        placing = []
        for (peer, which), batch in rings.items():
            if peer in lost:  # its rings died with it: its recovery marks them lost, their owners checkpoint
                log.info("rank %d: %d log record(s) for lost rank %d dropped", self.memory.rank, len(batch), peer)
                continue
            slot = self._slot(peer, which)
            tail, head = int(self.landing[slot]), int(self.landing[slot + 1])
            # every ring's room before anything is staged: a wait may read a ring into the staging buffer (the
            # retry of a stopped discard, `wait_for_room`), which would overwrite records staged before it
            self._room(peer, which, tail, head, sum(len(r) for r in batch))
            placing.append((peer, which, tail, batch))
        for peer, which, tail, batch in placing:
            if big:  # too much for the staging buffer at once: ring by ring, each written and waited for
                alone: list[verbs.SendWR] = []
                self._place(peer, which, tail, batch, 0, alone)
                self.memory.client.run(peer, alone, self.memory.seq)
            else:
                at = self._place(peer, which, tail, batch, at, writes.setdefault(peer, []))
        for peer, wrs in writes.items():
            self._post(peer, wrs, self.writing)  # a failed peer is skipped: see above
        self.memory.counters.count("log_write", total)
        self.memory.account("log_records", count)
        self.memory.account("log_bytes", total)
        self.memory.account("log_seconds", time.perf_counter() - started)

    def complete(self) -> None:
        """Write what is reserved and wait until every WRITE has completed: from here on, it *is* logged."""
        self.write()
        started = time.perf_counter()
        self._settle("log writes to the log homes")
        self.claims[:] = IDLE  # every reservation is written (nothing is reserved here that `write` did not write)
        self.claim_links.clear()
        self.memory.account("log_seconds", time.perf_counter() - started)

    def settle(self) -> None:
        """Wait until the own records posted earlier (an acquire's NOTICES, a barrier's BARRIER) are complete;
        nothing is reserved, written or posted (a `last` record stays back)."""
        started = time.perf_counter()
        self._drain("earlier log writes")
        self.memory.account("log_seconds", time.perf_counter() - started)

    def _drain(self, what: str) -> None:
        self._wait(self.writing, what)
        self.writing = []

    def _settle(self, what: str) -> None:
        """Wait for the WRITEs posted; then post the `last` record's and wait for those too.

        One wait instead of two when everything in flight goes to the `last` record's own peer: RC
        places one QP's WRITEs in order, so the record then lands after the others anyway.
        """
        client, peer = self.memory.client, self.own_home
        if self.last and all(self.sent[w] == (peer, client.link[peer]) for w in self.writing):
            self._post_last()
        self._drain(what)
        if self.last:
            self._post_last()
            self._drain(what)

    def _post_last(self) -> None:
        self._post(self.own_home, self.last, self.writing)  # a failed log home is skipped, as in `write`
        self.last = []

    def flush(self) -> None:
        """Append every queued record now and wait for it."""
        self.start()
        self.complete()

    def _room(self, peer: int, which: str, tail: int, head: int, need: int) -> None:
        """Past the ring's high-water mark ask for its owner's checkpoint; past its capacity wait for room."""
        capacity = self.peers[peer][which]["capacity"]
        if tail + need - head > HIGH_WATER * capacity:
            self.ask(peer, which, head)
        if tail + need - head > capacity:
            self.wait_for_room(peer, which, tail + need - capacity)

    def _place(self, peer: int, which: str, tail: int, batch: list[bytearray], at: int, wrs: list[verbs.SendWR]) -> int:
        """Stage `batch` from staging offset `at` and add its WRITEs to `wrs`; the next free offset (`_room`
        has made room for it).

        The records are consecutive in the ring and each is sealed (`_records.seal`: commit word and
        check), so they go in one WRITE (two across the ring's end): a record is committed once all of
        its bytes are placed, whatever order a WRITE places them in.
        """
        ring = self.peers[peer][which]
        lkey, need = self.staging_mr.lkey, sum(len(r) for r in batch)
        base = self.staging_mr.buf + at
        self.staging[at : at + need] = np.frombuffer(sealed(batch, tail), dtype=np.uint8)
        wrs += _spanned(_write, ring, tail, need, lambda _, data_off: base + data_off, lkey)
        return at + need

    def _post(self, peer: int, wrs: list[verbs.SendWR], ids: list[int]) -> bool:
        """Post `wrs` to `peer`, the last one signaled (its id goes to `ids`); no wait unless too many.

        False, and nothing posted, when the link to `peer` is not up: a failed peer's rings are lost
        with it (its recovery marks the log ring it held lost and asks its owner's checkpoint; the
        home diff log is rebuilt from the DIFF records at its log home), so what was meant for them
        is dropped rather than waited for.
        """
        client, seq = self.memory.client, self.memory.seq
        if client.state[peer] != UP:
            return False
        if len(wrs) > POST_LIMIT:
            client.run(peer, wrs, seq)  # waits chunk by chunk: the send queue is bounded
            return True
        seq[0] += 1
        last = wrs[-1]
        with client.lock:  # the endpoint's: a post never reaches a QP being replaced (dsm._net)
            if client.state[peer] != UP:
                return False
            for wr in wrs[:-1]:
                wr.send_flags, wr.wr_id = 0, ONE_SIDED
            last.send_flags, last.wr_id = verbs.IBV_SEND_SIGNALED, ONE_SIDED | (seq[0] & 0xFFFFFFFFFF)
            client.qps[peer].post_send(chain(wrs))  # one doorbell for the batch
            self.sent[last.wr_id] = (peer, client.link[peer])
        ids.append(last.wr_id)
        return True

    def _wait(self, ids: list[int], what: str) -> set[int]:
        """Wait for the WRs `ids`; the peers whose link failed or was replaced meanwhile (theirs never complete)."""
        if not ids:
            return set()
        client = self.memory.client

        def gone(wr_id: int) -> bool:
            peer, link = self.sent[wr_id]
            return bool(client.state[peer] != UP or client.link[peer] != link)

        client.wait(lambda: all(w in client.rdma_done or gone(w) for w in ids), what)
        lost = {self.sent[w][0] for w in ids if w not in client.rdma_done}
        client.rdma_done.difference_update(ids)
        for wr_id in ids:
            self.sent.pop(wr_id, None)
        return lost

    # ------------------------------------------------------------------ full rings
    def wait_for_room(self, peer: int, which: str, head_needed: int) -> None:
        """Wait until the ring's owner has discarded up to `head_needed` (bounded: see `_remote`)."""
        self.memory.account("log_full_waits")
        owner, what = self.owner(peer, which), "log ring" if which == LOG else "home diff log"
        full = f"the {what} of rank {owner} at rank {peer} is full"
        if which == HOME or getattr(self.memory.rt, "checkpoint_rank", None) is None:
            # only a coordinated checkpoint can empty it (a home diff log is kept since the last one, for
            # minimal versions), and one needs this rank at a step boundary, which it cannot reach while it
            # waits here, so waiting could only end in the timeout
            raise DsmError(f"{full} and no checkpoint can empty it mid-step: raise --log-ring-bytes")
        if owner == self.memory.rank:
            # a home logging its own writes: only its own checkpoint empties the ring, and it is mid-step here --
            # unless the discard of its last one stopped at a hole it can pass now
            if self.retry is not None:
                self.retry()
                if self.read_word(peer, which, 8) >= head_needed:
                    return
            capacity = self.peers[peer][which]["capacity"]
            raise DsmError(
                f"{full} ({capacity} bytes logged since rank {owner}'s last checkpoint) and only its own checkpoint, "
                "which it cannot take mid-step, can empty it: raise --log-ring-bytes"
            )
        started = time.monotonic()
        deadline = started + FULL_TIMEOUT
        pause = 1e-4
        reported: Callable[[], None] | None = None  # `ckpt status` shows the wait once it lasts (dsm._waits)
        try:
            while (head := self.read_word(peer, which, 8)) < head_needed:
                self.ask(peer, which, head, again=True)  # blocked: ask again now and then
                self._owner_waits_for_this_rank(owner, full, peer, which, head_needed)
                if time.monotonic() > deadline:
                    raise DsmError(
                        f"{full} and rank {owner} did not checkpoint within {FULL_TIMEOUT:.0f} s: "
                        "raise --log-ring-bytes or checkpoint more often"
                    )
                if reported is None:
                    reported = self.memory.client.report_stuck(
                        f"room in the {what} of rank {owner} at rank {peer}", started
                    )
                time.sleep(pause)  # polling a remote word: the owner's discard is an RDMA WRITE, nothing signals here
                pause = min(pause * 2, 0.05)
        finally:
            if reported is not None:
                reported()

    def _owner_waits_for_this_rank(self, owner: int, full: str, peer: int, which: str, head_needed: int) -> None:
        """Raise if `owner` waits in a barrier this rank has not entered, or for a lock this rank holds, with no
        retry of its last discard left (`RemoteLog._publish_wait`), and the ring still has no room: the owner
        waits for this rank, which waits for its checkpoint, which it can take only at its next step boundary
        -- after that wait.

        The word may still name a barrier this rank has passed (its reply not yet taken in there): that one
        ends without this rank, so the wait goes on.  A lock the word names is one the owner has not been
        granted (it clears the word first), so while this rank holds it, the owner waits.  The head is read
        again after a set word: the owner's last retry moves the head (a completed RDMA WRITE) before it sets
        the word, so the head read before the word may be older than the room that retry made.
        """
        if WAITS not in self.peers[owner] or self.memory.client.state[owner] != UP:
            return  # an image from before the wait word; or a failed owner, whose next incarnation starts over
        word = self.read_word(owner, WAITS, 0)
        if word > 0 and word - 1 > self.memory.epoch:
            why = f"rank {owner} waits in barrier {word - 1}, which waits for this rank"
        elif word < 0 and -word - 1 in self.memory.held:
            why = f"rank {owner} waits for lock {-word - 1}, which this rank holds"
        else:
            return
        if self.read_word(peer, which, 8) < head_needed:
            only = f"only rank {owner}'s own checkpoint can empty it"
            raise DsmError(f"{full}, {only}, and {why}: raise --log-ring-bytes")

    # ------------------------------------------------------------------ single words, whole rings (synchronous)
    @contextlib.contextmanager
    def strict(self) -> Iterator[None]:
        """`read_word`, `write_word`, `read_ring` and `lowest_claim` in here never wait for a failed peer, nor go on
        with its next incarnation (as `Endpoint.run` does): they raise `LinkMoved` instead.  For work that may be
        left for later (`RemoteLog.retry_discard`), and whose reads must all come from one incarnation per peer."""
        self.links = list(self.memory.client.link)
        try:
            yield
        finally:
            self.links = None

    def _run(self, peer: int, wrs: list[verbs.SendWR]) -> None:
        """Run `wrs` on `peer` and wait for them (see `strict`)."""
        client = self.memory.client
        if self.links is None:
            client.run(peer, wrs, self.memory.seq)
            return
        ids: list[int] = []
        if client.link[peer] != self.links[peer] or not self._post(peer, wrs, ids) or self._wait(ids, "log words"):
            raise LinkMoved(peer)

    def read_word(self, peer: int, which: str, offset: int) -> int:
        ring, slot = self.peers[peer][which], len(self.landing) - 2
        self._run(peer, [_read(self._land(slot), ring["rkey"], ring["addr"] + offset)])
        self.memory.counters.count("log_read", 8)
        return int(self.landing[slot])

    def dead_below(self, peer: int, which: str, tail: int) -> int:
        """The position below which no live rank can still write in ring `which` at `peer` -- the lower of `tail`
        (the ring's tail, read *before* this call) and every live rank's claim -- or -1 when that cannot be
        known now.  Space below it that holds no committed record was reserved by a rank that died."""
        claim = self.lowest_claim(peer, which)
        return -1 if claim is None else min(tail, claim)

    def lowest_claim(self, peer: int, which: str) -> int | None:
        """The lowest position any live rank may still write at in ring `which` at `peer` (`NO_CLAIM`: none), read
        from every rank's claim word; None when that cannot be known now (an answer in flight, a rank not up)."""
        client, claim, lowest = self.memory.client, _claim(peer, which), NO_CLAIM
        for rank in range(len(self.peers)):
            if rank == self.memory.rank:
                value = int(self.claims[claim])
            elif client.state[rank] != UP:
                return None  # its next incarnation may be writing already, and its claims cannot be read
            else:  # twice, until two reads agree: a READ's bytes may be copied while the word is stored
                value, again = self.read_word(rank, CLAIMS, 8 * claim), None
                while value != again:
                    again, value = value, self.read_word(rank, CLAIMS, 8 * claim)
            if value == IN_FLIGHT:
                return None
            if value != IDLE:
                lowest = min(lowest, value)
        return lowest

    def write_word(self, peer: int, which: str, offset: int, value: int) -> None:
        ring, slot = self.peers[peer][which], len(self.landing) - 1
        self.landing[slot] = value
        self._run(peer, [_write(self._land(slot), ring["rkey"], ring["addr"] + offset)])

    def read_ring(self, peer: int, which: str, holes: bool = False) -> tuple[list[Record], int]:
        """The committed records of a ring from its head (RDMA READ), and that head.

        Up to the first hole, or (`holes`, a recovery) every committed record past holes too.
        """
        self._drain("log writes from the staging buffer")  # the READ lands there (a retry may come mid-batch)
        ring, base = self.peers[peer][which], self.staging_mr.buf
        tail, head = self.read_word(peer, which, 0), self.read_word(peer, which, 8)
        # at most one lap: writers that reserved past head + capacity wait for room before they write
        nbytes = min(tail - head, ring["capacity"])
        wrs = _spanned(_read, ring, head, nbytes, lambda _, data_off: base + data_off, self.staging_mr.lkey)
        if nbytes:
            self._run(peer, wrs)
            self.memory.counters.count("log_read", nbytes)
        data = self.staging[:nbytes].tobytes()
        return (scan(data, head, len(self.peers)) if holes else walk(data, head)), head

    def _slot(self, peer: int, which: str) -> int:
        """The landing words (old tail, head) of a reservation in ring `which` at `peer`."""
        return 4 * peer + (0 if which == LOG else 2)

    def _land(self, slot: int) -> tuple[int, int, int]:
        """Landing word `slot`, as a local (address, length, lkey)."""
        return self.landing_mr.buf + slot * 8, 8, self.landing_mr.lkey


def _claim(peer: int, which: str) -> int:
    """The claim word of ring `which` (LOG or HOME) at `peer`."""
    return 2 * peer + (0 if which == LOG else 1)


def _spanned(
    make: Callable[[tuple[int, int, int], int, int], verbs.SendWR],
    ring: dict[str, int],
    position: int,
    length: int,
    local: Callable[[int, int], int],
    lkey: int,
) -> list[verbs.SendWR]:
    """`make` (`_write` or `_read`) for ring positions [position, position + length): one WR per piece (two across
    the ring's end), each with the local address `local(offset in the ring area, offset in the data)`."""
    return [
        make((local(ring_off, data_off), piece, lkey), ring["rkey"], ring["addr"] + CONTROL + ring_off)
        for ring_off, data_off, piece in spans(ring["capacity"], position, length)
    ]


def _atomic(local: tuple[int, int, int], rkey: int, addr: int, add: int) -> verbs.SendWR:
    """FETCH_AND_ADD `add` at the peer's (rkey, addr); the old value lands at `local` = (address, 8, lkey)."""
    wr = verbs.SendWR(opcode=verbs.IBV_WR_ATOMIC_FETCH_AND_ADD, num_sge=1, sg=[verbs.SGE(*local)])
    wr.set_wr_atomic(rkey, addr, add, 0)
    return wr


def _read(local: tuple[int, int, int], rkey: int, addr: int) -> verbs.SendWR:
    """An RDMA READ of the peer's (rkey, addr) into `local` = (address, length, lkey)."""
    wr = verbs.SendWR(opcode=verbs.IBV_WR_RDMA_READ, num_sge=1, sg=[verbs.SGE(*local)])
    wr.set_wr_rdma(rkey, addr)
    return wr


def _write(local: tuple[int, int, int], rkey: int, addr: int) -> verbs.SendWR:
    wr = verbs.SendWR(opcode=verbs.IBV_WR_RDMA_WRITE, num_sge=1, sg=[verbs.SGE(*local)])
    wr.set_wr_rdma(rkey, addr)
    return wr
