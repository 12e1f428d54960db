"""The requester side of a simulated RC/UC queue pair: posting, transmission, ACKs, retries, RNR back-off."""

# * WRs execute in order; each message takes ceil(len / MTU) PSNs (one frame
#   carries it, but sq_psn advances as on the wire).  SEND and WRITE complete
#   on ACK, READ and atomics on their response; a response for PSN p
#   acknowledges everything before p.  FENCE waits for earlier READ / atomic
#   responses; at most max_rd_atomic of those are outstanding.
# * A chain of WRs posted together leaves in one write (one doorbell).  The
#   requester asks for an ACK on signaled WRs and every ACK_EVERY packets; the
#   responder may delay the others.
# * Loss: a packet is lost when a link on its path is down, the peer HCA is
#   gone, or the responder drops it (no such QP, QP not ready).  On the local
#   ACK timeout (4.096 us * 2**timeout) a known loss costs one retry and a
#   go-back-N retransmission from the oldest unacknowledged WR; retry_cnt
#   exhausted -> RETRY_EXC_ERR.  With an ARMED alternate path the first loss
#   migrates instead (IBV_EVENT_PATH_MIG) and the retransmission takes the
#   new path.  RNR NAKs back off by the responder's min_rnr_timer, up to
#   rnr_retry times (7 = forever) -> RNR_RETRY_EXC_ERR.

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ckpt.verbs import _direct
from ckpt.verbs import _enums as e
from ckpt.verbs import _wire as w
from ckpt.verbs._errors import PyverbsRDMAError
from ckpt.verbs._handles import (
    EINVAL,
    ENOMEM,
)
from ckpt.verbs._qpbase import (
    _ARMED,
    _CAS,
    _ERR,
    _FAA,
    _FENCE,
    _FLUSH,
    _INIT,
    _INLINE,
    _LOCAL_WRITE,
    _NAK_STATUS,
    _OK,
    _RC,
    _RC_OPCODES,
    _RD_ATOMIC,
    _READ,
    _RESET,
    _RTR,
    _RTS,
    _SEND_IMM,
    _SIGNALED,
    _SOLICITED,
    _SQD,
    _SQE,
    _UC,
    _UC_OPCODES,
    _WRITE_IMM,
    LATE_ACK_LIMIT,
    PSN_MASK,
    SQ_FULL_GRACE,
    QPState,
    SendEntry,
    ack_timeout,
    psn_diff,
)

log = logging.getLogger(__name__)

#: Posts of at most this many bytes behind WRs in flight are batched into the next flush (`Hca.defer`).
DEFER_BYTES = 8192
#: The opcodes `_direct` may execute in a same-host responder's shared memory.
DIRECT_OPS = frozenset(_direct.NEEDS)


class Requester(QPState):
    """Posting and the send queue."""

    def post_send(self, wr: Any) -> None:
        mtu = 128 << self.path_mtu
        with self.lock:
            state = self.state
            if state in (_RESET, _INIT, _RTR):
                raise PyverbsRDMAError(f"post_send on a QP in state {e.ibv_qp_state(state).name}", EINVAL)
            entries: list[SendEntry] = []
            sq, limit, total = self.sq, self.cap.max_send_wr, 0
            while wr is not None:
                if len(sq) + len(entries) >= limit:
                    self._wait_for_room(len(entries))
                entry = self._entry(wr, len(sq) + len(entries), mtu)
                entries.append(entry)
                total += entry.length
                wr = wr.next_wr
            if state == _ERR:
                for entry in entries:
                    self.scq.push(self._send_wc(entry, _FLUSH))
                return
            if not sq and state == _RTS and self.hca.table is not None and entries[0].opcode in DIRECT_OPS:
                if _direct.execute(self, entries):  # a same-host peer's shared memory, no packets (`_shm`)
                    return
            # small WRs behind others in flight wait for this thread's next poll (`Hca.defer`); a large
            # one would then cross the socket on whichever thread flushes it, possibly through the outbox
            busy = bool(sq) and total <= DEFER_BYTES
            psn = self.sq_psn
            for entry in entries:
                entry.psn = psn
                psn = (psn + entry.npkts) & PSN_MASK
                sq.append(entry)
            self.sq_psn = psn
            if busy and self.state == _RTS:
                self.hca.defer(self)
            else:
                self._pump(blocking=True)

    def _wait_for_room(self, pending: int) -> None:
        """A full send queue: give the NIC threads (which share the CPU here) a moment to retire WRs.

        On hardware the NIC retires WRs while the CPU posts; here its threads
        need the GIL, so a program that posts back-to-back could see a full
        queue that a real NIC would already have drained.  Wait (bounded) for
        in-flight WRs to complete before reporting ENOMEM.
        """
        self._pump(blocking=True)  # what waits for a doorbell (`Hca.defer`) goes now
        deadline = time.monotonic() + SQ_FULL_GRACE
        while len(self.sq) + pending >= self.cap.max_send_wr and any(x.sent and not x.done for x in self.sq):
            left = deadline - time.monotonic()
            if left <= 0 or self.state != _RTS:
                return
            self.room_waiters += 1
            try:
                self.retired.wait(left)
            finally:
                self.room_waiters -= 1

    def _entry(self, wr: Any, depth: int, mtu: int) -> SendEntry:
        opcode = int(wr.opcode)
        if opcode not in (_RC_OPCODES if self.qp_type == _RC else _UC_OPCODES):
            raise PyverbsRDMAError(f"opcode {opcode} is not supported on this QP type", EINVAL)
        cap = self.cap
        given = wr.sg
        nsge = wr.num_sge or len(given)
        if nsge > cap.max_send_sge or nsge > len(given):
            raise PyverbsRDMAError(f"send WR with {nsge} SGEs, the QP allows {cap.max_send_sge}", EINVAL)
        if depth >= cap.max_send_wr:
            raise PyverbsRDMAError(f"send queue full ({cap.max_send_wr} WRs outstanding)", ENOMEM)
        if nsge == 1:  # the common case, without a loop
            s = given[0]
            sg = [(s.addr, s.length, s.lkey)]
            length = s.length
        else:
            sg = [(s.addr, s.length, s.lkey) for s in given[:nsge]]
            length = sum(s[1] for s in sg)
        flags = int(wr.send_flags)
        entry = SendEntry(wr, opcode, flags, self.sq_sig_all or bool(flags & _SIGNALED), sg, length)
        if opcode in (_CAS, _FAA) and (length != 8 or nsge != 1):
            raise PyverbsRDMAError("an atomic WR needs exactly one 8-byte SGE", EINVAL)
        if flags & _INLINE and opcode not in _RD_ATOMIC:
            if length > cap.max_inline_data:
                raise PyverbsRDMAError(f"{length} bytes inline, the QP allows {cap.max_inline_data}", EINVAL)
            if nsge == 1:
                entry.inline = bytes(self._gather_inline(sg[0][0], length))
            else:
                entry.inline = b"".join([bytes(self._gather_inline(addr, size)) for addr, size, _ in sg])
        if length > mtu:
            entry.npkts = -(-length // mtu)
        return entry

    def _gather_inline(self, addr: int, length: int) -> memoryview:
        """Inline data is copied at post time and its lkey is not checked (ibv_post_send(3))."""
        mr = self.hca.mr_containing(addr, length)
        if mr is None:
            raise PyverbsRDMAError(f"inline SGE address {addr:#x} is not in any registered memory", EINVAL)
        off = addr - mr.addr
        return mr.view[off : off + length]

    def _pump(self, blocking: bool) -> None:
        """Transmit queued WRs in order as far as fences, rd/atomic credits and back-off allow (lock held).

        Everything one call can send goes out in one write: a chain of WRs
        posted together costs one doorbell, not one per WR.
        """
        sq = self.sq
        idle = self.next_send == 0  # nothing in flight: a send now starts the transport timer afresh
        packets: list[tuple[tuple[Any, ...], list[Any]]] = []
        sent: list[SendEntry] = []
        port, dlid = self._path()
        slid = self.hca.lids[port - 1]
        while self.next_send < len(sq) and self.state == _RTS and not self.backoff:
            entry = sq[self.next_send]
            if entry.opcode in _RD_ATOMIC and self.rd_outstanding >= max(1, self.max_rd_atomic):
                break
            if entry.flags & _FENCE and self.rd_outstanding:
                break
            packet = self._packet(entry, slid, dlid)
            if packet is None:
                break
            packets.append(packet)
            sent.append(entry)
            self.next_send += 1
        if packets:
            if not self.hca.transmit_many(port, dlid, packets, blocking):
                self.lost = True
            for entry in sent:
                entry.sent = True
            if self.qp_type == _UC:
                for entry in sent:
                    entry.done = True
                self._retire()
            elif idle or not self.timer_armed:
                # A timer still pending for WRs acknowledged since (its thread late for the CPU) must
                # count from this send, not from their progress, or it would count a retry at once.
                self.last_progress = self.progress_at = time.monotonic()
                if not self.timer_armed:
                    self._arm_timer()
        if self.state == _SQD:
            self._check_drained()

    def _local_views(self, entry: SendEntry, write: bool) -> list[memoryview] | int:
        """The registered memory behind the entry's SGEs, or the WC status of a local error."""
        views = []
        mrs = self.hca.mrs_by_lkey
        for addr, length, lkey in entry.sg:
            mr = mrs.get(lkey)
            if mr is None or mr.pd is not self.pd or (write and not mr.access & _LOCAL_WRITE):
                return int(e.IBV_WC_LOC_PROT_ERR)
            off = addr - mr.addr
            if off < 0 or off + length > mr.length:
                return int(e.IBV_WC_LOC_PROT_ERR)
            views.append(mr.view[off : off + length])
        return views

    def _packet(self, entry: SendEntry, slid: int, dlid: int) -> tuple[tuple[Any, ...], list[Any]] | None:
        """The request packet of one WR (lock held); None if it failed locally (the QP is now in ERR)."""
        op = entry.opcode
        payload: list[Any]
        if op in _RD_ATOMIC:
            views = self._local_views(entry, write=True)
            if isinstance(views, int):
                self._fail(entry, views)
                return None
            entry.dest = views
            payload = []
            length = 0
            arg1 = entry.length if op == _READ else entry.compare_add
            self.rd_outstanding += 1
        else:
            if entry.inline is not None:
                payload = [entry.inline] if entry.inline else []
            else:
                views = self._local_views(entry, write=False)
                if isinstance(views, int):
                    self._fail(entry, views)
                    return None
                payload = views
            length = entry.length
            arg1 = 0
        flags = (w.F_SOLICITED if entry.flags & _SOLICITED else 0) | (w.F_IMM if op in (_SEND_IMM, _WRITE_IMM) else 0)
        if self.mig_announce:
            flags |= w.F_MIGRATE
        # Ask for an ACK when the program will want to know (a signaled WR), when the send queue
        # is getting full, or every ACK_EVERY packets; otherwise the responder may delay it.
        self.unrequested += 1
        if entry.signaled or self.unrequested >= self.ack_every or op in _RD_ATOMIC:
            flags |= w.F_ACKREQ
            self.unrequested = 0
        ack = 0
        if self.ack_owed:  # the responder side owes the peer an ACK: this request carries it
            self.ack_owed = False
            flags |= w.F_ACK
            ack = (self.epsn - 1) & PSN_MASK
            self.hca.counts["acks_carried"] += 1
            if self.owed_on is not None:
                self.owed_on.forgive(self)
        header = (
            w.REQ,
            op,
            flags,
            0,
            self.dest_qp_num,
            self.qp_num,
            entry.psn,
            entry.npkts,
            length,
            entry.imm,
            entry.rkey,
            slid,
            dlid,
            entry.raddr,
            arg1,
            entry.swap,
            0.0,
            ack,
        )
        return header, payload

    def _arm_timer(self) -> None:
        period = ack_timeout(self.timeout)
        if period:
            self.timer_armed = True
            self.hca.timers.at(time.monotonic() + period, self._on_timer)

    def _on_timer(self) -> None:
        with self.lock:
            self.timer_armed = False
            if self.state not in (_RTS, _SQD) or not any(x.sent and not x.done for x in self.sq):
                return
            period = ack_timeout(self.timeout)
            now = time.monotonic()
            if now < self.last_progress + period:
                self.timer_armed = True
                self.hca.timers.at(self.last_progress + period, self._on_timer)
                return
            port, dlid = self._path()
            # A peer that is reachable but has not acknowledged anything for LATE_ACK_LIMIT is treated
            # as losing packets too (a stopped process, a responder answering on a dead path).
            silent = now - self.progress_at > max(LATE_ACK_LIMIT, 2 * period)
            known_loss = self.lost or silent or not self.hca.path_ok(port, dlid)
            self.lost = False
            # Late but not known lost: retransmit anyway (an ACK may have been lost on the way back)
            # without counting a retry -- a peer NIC starved of the CPU is not a lossy link.
            if known_loss and self.mig_state == _ARMED:
                self._migrate(initiated_here=True)
            elif known_loss:
                self.retries += 1
                if self.retries > self.retry_cnt:
                    self._fail(self.sq[0], int(e.IBV_WC_RETRY_EXC_ERR))
                    return
            self._go_back()
            self.last_progress = now
            self._pump(blocking=False)
            if not self.timer_armed:
                self._arm_timer()

    def _go_back(self) -> None:
        """Retransmit from the oldest unfinished WR (go-back-N)."""
        self.hca.counts["retransmissions"] += 1
        self.next_send = 0
        self.rd_outstanding = 0
        self.unrequested = self.ack_every  # the retransmission asks for an ACK at once
        for entry in self.sq:
            entry.sent = False

    def _end_backoff(self) -> None:
        with self.lock:
            if self.backoff:
                self.backoff = False
                self._pump(blocking=False)

    def on_piggybacked_ack(self, psn: int) -> None:
        """An ACK the peer's request carried (`_wire.F_ACK`): as if an ACK packet had come just before it."""
        with self.lock:
            if self.state in (_RTS, _SQD, _SQE) and self.qp_type == _RC:
                self._acknowledge(psn, inclusive=True)

    def on_response(self, fields: tuple[Any, ...], reader: w.PacketReader) -> None:
        """ACK / NAK / READ or atomic response for this QP's requests (HCA reader thread)."""
        kind, syndrome, psn, length = fields[0], fields[1], fields[6], fields[8]
        with self.lock:
            if self.state not in (_RTS, _SQD, _SQE) or self.qp_type != _RC:
                reader.skip(length)
                return
            if kind == w.LOST:
                self.lost = True
                return
            if kind == w.ACK:
                reader.skip(length)
                self._acknowledge(psn, inclusive=True)
                return
            if kind == w.NAK:
                reader.skip(length)
                self._nak(syndrome, psn, fields[14])
                return
            else:
                entry = self._acknowledge(psn, inclusive=False)
                if entry is None or entry.done or not entry.sent or entry.psn != psn or entry.dest is None:
                    reader.skip(length)
                    return
                dest = entry.dest
        # Outside the lock: payloads land in registered memory without blocking the program's posts.
        if kind == w.READ_RESP:
            for view in dest:
                reader.take_into(view)
        else:
            reader.skip(length)
            np.frombuffer(dest[0], dtype=np.uint64)[0] = fields[14]
        with self.lock:
            if entry.done or self.state not in (_RTS, _SQD, _SQE):
                return
            entry.done = True
            self.rd_outstanding = max(0, self.rd_outstanding - 1)
            self._progress()

    def _acknowledge(self, psn: int, inclusive: bool) -> SendEntry | None:
        """Complete the SEND/WRITE entries acknowledged by `psn` (lock held); return the first unfinished one.

        An ACK covers its own PSN (`inclusive`); a READ or atomic response for
        PSN p covers only what came before p.
        """
        found = None
        for entry in self.sq:
            if entry.done:
                continue
            d = psn_diff((entry.psn + entry.npkts - 1) & PSN_MASK, psn)
            if not entry.sent or d > 0 or (d == 0 and not inclusive) or entry.opcode in _RD_ATOMIC:
                found = entry  # a READ or atomic completes only when its data arrives
                break
            entry.done = True
        if inclusive:
            self._progress()
        return found

    def _progress(self) -> None:
        self.retries = 0
        self.last_progress = self.progress_at = time.monotonic()
        self.mig_announce = False
        self._retire()
        # what is posted and not yet sent goes now -- unless a polling thread flushes it with the other
        # held-back posts, in one blocking write
        if self.next_send < len(self.sq) and (self not in self.hca.unsent or not self.hca.rx.polled()):
            self._pump(blocking=False)

    def _nak(self, syndrome: int, psn: int, delay_ns: int) -> None:
        self.progress_at = time.monotonic()  # a NAK is an answer: the peer is alive
        entry = self._acknowledge(psn, inclusive=False)
        if entry is None or entry.psn != psn:
            return
        if syndrome == w.NAK_RNR:
            self.hca.counts["rnr_naks_received"] += 1
            self.rnr_retries += 1
            if self.rnr_retry != 7 and self.rnr_retries > self.rnr_retry:
                self._fail(entry, int(e.IBV_WC_RNR_RETRY_EXC_ERR))
                return
            self._go_back()
            self.backoff = True
            self.last_progress = time.monotonic() + delay_ns / 1e9
            self.hca.timers.at(time.monotonic() + delay_ns / 1e9, self._end_backoff)
        elif syndrome == w.NAK_SEQ:
            self._go_back()
            self._pump(blocking=False)
        else:
            self._fail(entry, _NAK_STATUS.get(syndrome, int(e.IBV_WC_REM_OP_ERR)))

    def _retire(self) -> None:
        """Pop finished WRs off the front in order, completing the signaled ones."""
        sq = self.sq
        if self.room_waiters and sq and sq[0].done:
            self.retired.notify_all()
        while sq and sq[0].done:
            entry = sq.popleft()
            self.next_send = max(0, self.next_send - 1)
            if entry.signaled or entry.status != _OK:
                self.scq.push(self._send_wc(entry, entry.status))
            if entry.opcode not in _RD_ATOMIC:
                self.rnr_retries = 0
        if self.state == _SQD:
            self._check_drained()

    def _fail(self, entry: SendEntry, status: int) -> None:
        """The first error completion: that WR completes with `status`, the QP goes to ERR (lock held)."""
        log.debug("QP %#x: wr_id %s failed with %s", self.qp_num, entry.wr_id, e.ibv_wc_status(status).name)
        entry.status = status
        entry.done = True
        self._retire()
        self.state = _ERR
        self._enter_error()
