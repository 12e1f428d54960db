"""The responder side of a simulated RC/UC queue pair: executing requests, ACKs, NAKs, duplicates."""

# * PSN == expected executes; PSN behind is a duplicate (re-ACK, re-read, or
#   the cached atomic result: atomics execute exactly once); PSN ahead is a
#   sequence error (one NAK, the requester goes back).
# * No receive WQE -> RNR NAK carrying min_rnr_timer.
# * Access and length violations NAK the requester (REM_ACCESS_ERR /
#   REM_INV_REQ_ERR / REM_OP_ERR) and move the responder QP to ERR too (IB
#   class C errors).
# * Everything here runs on the HCA's reader thread for the peer's connection,
#   never on the program's thread: one-sided operations are one-sided.

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from ckpt.verbs import _enums as e
from ckpt.verbs import _shm
from ckpt.verbs import _wire as w
from ckpt.verbs._attrs import WC
from ckpt.verbs._errors import PyverbsRDMAError
from ckpt.verbs._handles import (
    EINVAL,
    ENOMEM,
)
from ckpt.verbs._qpbase import (
    _ARMED,
    _ATOMIC_CACHE,
    _CAS,
    _ERR,
    _FAA,
    _FLUSH,
    _LOCAL_WRITE,
    _OK,
    _RC,
    _READ,
    _RECV,
    _RECV_IMM,
    _REMOTE_ATOMIC,
    _REMOTE_READ,
    _REMOTE_WRITE,
    _RESET,
    _RTR,
    _RTS,
    _SEND,
    _SEND_IMM,
    _SQD,
    _SQE,
    _U64,
    _WITH_IMM,
    _WRITE,
    _WRITE_IMM,
    PSN_MASK,
    QPState,
    psn_diff,
    rnr_delay,
)
from ckpt.verbs._rx import ACK_LATER, ACK_NONE, ACK_NOW


class Responder(QPState):
    """Receive queue and incoming requests."""

    def post_recv(self, wr: Any) -> None:
        with self.lock:
            if self.srq is not None:
                raise PyverbsRDMAError("post_recv on a QP attached to an SRQ (post to the SRQ)", EINVAL)
            if self.state == _RESET:
                raise PyverbsRDMAError("post_recv on a QP in state RESET", EINVAL)
            wrs: list[Any] = []
            while wr is not None:
                nsge = wr.num_sge or len(wr.sg)
                if nsge > self.cap.max_recv_sge:
                    raise PyverbsRDMAError(
                        f"receive WR with {nsge} SGEs, the QP allows {self.cap.max_recv_sge}", EINVAL
                    )
                if len(self.rq) + len(wrs) >= self.cap.max_recv_wr:
                    raise PyverbsRDMAError(f"receive queue full ({self.cap.max_recv_wr} WRs)", ENOMEM)
                wrs.append(wr)
                wr = wr.next_wr
            if self.state == _ERR:
                for r in wrs:
                    self.rcq.push(WC(wr_id=r.wr_id, status=_FLUSH, opcode=_RECV, qp_num=self.qp_num))
                return
            self.rq.extend(wrs)

    def send_ack(self) -> None:
        with self.lock:
            if self.state in (_RTR, _RTS, _SQD, _SQE):
                self.ack_owed = False
                self.hca.counts["acks_sent"] += 1
                self._respond(w.ACK, 0, (self.epsn - 1) & PSN_MASK, 0, [])

    def _ack_due(self, flags: int) -> int:
        """ACK now if the requester asked; otherwise later, coalesced with others: at most DELAYED_ACK
        later (the receive engine keeps the time, `_rx`), or sooner, carried by this QP's next request
        (`Requester._packet`)."""
        if flags & w.F_ACKREQ:
            return ACK_NOW
        self.ack_owed = True
        return ACK_LATER

    def _respond(self, kind: int, syndrome: int, psn: int, arg1: int, payload: list[Any]) -> None:
        port, dlid = self._path()
        length = sum(len(p) for p in payload)
        slid = self.hca.lids[port - 1]
        qpns = (self.dest_qp_num, self.qp_num)
        header = (kind, syndrome, 0, 0, *qpns, psn, 0, length, 0, 0, slid, dlid, 0, arg1, 0, 0.0, 0)
        self.hca.transmit(port, dlid, header, payload, blocking=False)

    def _error_nak(self, syndrome: int, psn: int, event: int) -> None:
        """Class C error: NAK the requester, then this QP goes to ERR too."""
        with self.lock:
            self._respond(w.NAK, syndrome, psn, 0, [])
            self.hca.event(event, self)
            self._enter_error()

    def _take_recv(self) -> Any | None:
        if self.srq is not None:
            return self.srq.take()
        try:
            return self.rq.popleft()
        except IndexError:
            return None

    def _recv_views(self, wr: Any, length: int) -> list[memoryview] | int:
        views = []
        need = length
        mrs = self.hca.mrs_by_lkey
        for sge in wr.sg[: wr.num_sge or len(wr.sg)]:
            if need <= 0:
                break
            mr = mrs.get(sge.lkey)
            if mr is None or mr.pd is not self.pd or not mr.access & _LOCAL_WRITE:
                return int(e.IBV_WC_LOC_PROT_ERR)
            off = sge.addr - mr.addr
            if off < 0 or off + sge.length > mr.length:
                return int(e.IBV_WC_LOC_PROT_ERR)
            take = min(need, sge.length)
            views.append(mr.view[off : off + take])
            need -= take
        return int(e.IBV_WC_LOC_LEN_ERR) if need > 0 else views

    def _remote_view(self, rkey: int, addr: int, length: int, access: int) -> memoryview | None:
        if not self.access & access:
            return None
        mr = self.hca.mrs_by_rkey.get(rkey)
        if mr is None or mr.pd is not self.pd or not mr.access & access:
            return None
        off = addr - mr.addr
        if off < 0 or off + length > mr.length:
            return None
        return mr.view[off : off + length]

    def on_request(self, fields: tuple[Any, ...], reader: w.PacketReader) -> int:
        """Execute one incoming request (the receive engine's thread): ACK_NONE, ACK_NOW or ACK_LATER."""
        _, op, flags, _, _, sqpn, psn, npkts, length, imm, rkey, slid, _, raddr, arg1, arg2, _, _ = fields
        table = self.hca.table
        if table is not None and table.direct_psns(self.qp_num) != self.direct_seen:
            self.absorb_direct()
        state = self.state
        if state not in (_RTR, _RTS, _SQD, _SQE) or sqpn != self.dest_qp_num:
            reader.skip(length)
            self.hca.report_lost(fields)
            return ACK_NONE
        if flags & w.F_MIGRATE and self.mig_state == _ARMED:
            # before the PSN check: the requester may have migrated to resend something we already
            # executed, whose ACK was lost on the old path -- answering it there again would loop
            with self.lock:
                self._migrate(initiated_here=False)
        rc = self.qp_type == _RC
        if rc and psn != self.epsn:
            d = psn_diff(psn, self.epsn)
            if d < 0:
                return self._duplicate(op, psn, length, rkey, raddr, arg1, reader)
            if d > 0:  # (d == 0 cannot happen: psn != epsn)
                reader.skip(length)
                if not self.rnr_pending and not self.nak_seq_sent:
                    self.nak_seq_sent = True
                    with self.lock:
                        self._respond(w.NAK, w.NAK_SEQ, self.epsn, 0, [])
                return ACK_NONE
        if state == _RTR and not self.comm_est:
            self.comm_est = True
            self.hca.event(e.IBV_EVENT_COMM_EST, self)
        self.nak_seq_sent = False
        if op in (_SEND, _SEND_IMM, _WRITE_IMM):
            view = None
            if op == _WRITE_IMM:
                view = self._remote_view(rkey, raddr, length, _REMOTE_WRITE)
                if view is None:
                    return self._refuse(rc, reader, length, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
            wr = self._take_recv()
            if wr is None:
                reader.skip(length)
                if rc:
                    self.rnr_pending = True
                    delay = int(rnr_delay(self.min_rnr_timer) * 1e9)
                    with self.lock:
                        self._respond(w.NAK, w.NAK_RNR, psn, delay, [])
                return ACK_NONE
            self.rnr_pending = False
            if view is not None:
                reader.take_into(view)
                opcode, byte_len = _RECV_IMM, length
            else:
                views = self._recv_views(wr, length)
                if isinstance(views, int):
                    self.rcq.push(WC(wr_id=wr.wr_id, status=views, opcode=_RECV, qp_num=self.qp_num, src_qp=sqpn))
                    syndrome = w.NAK_INV_REQ if views == int(e.IBV_WC_LOC_LEN_ERR) else w.NAK_OP
                    return self._refuse(rc, reader, length, syndrome, psn, e.IBV_EVENT_QP_REQ_ERR)
                for v in views:
                    reader.take_into(v)
                opcode, byte_len = _RECV, length
            self.epsn = (psn + npkts) & PSN_MASK
            with_imm = flags & w.F_IMM
            # WC fields in order: wr_id status opcode vendor_err byte_len qp_num src_qp imm_data wc_flags pkey slid
            wc = WC(
                wr.wr_id,
                _OK,
                opcode,
                0,
                byte_len,
                self.qp_num,
                sqpn,
                imm if with_imm else 0,
                with_imm and _WITH_IMM,
                0,
                slid,
            )
            self.rcq.push(wc, bool(flags & w.F_SOLICITED))
            return self._ack_due(flags) if rc else ACK_NONE
        if op == _WRITE:
            view = self._remote_view(rkey, raddr, length, _REMOTE_WRITE) if length else memoryview(b"")
            if view is None:
                return self._refuse(rc, reader, length, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
            reader.take_into(view)
            self.epsn = (psn + npkts) & PSN_MASK
            return self._ack_due(flags) if rc else ACK_NONE
        if op == _READ:
            reader.skip(length)
            view = self._remote_view(rkey, raddr, arg1, _REMOTE_READ) if arg1 else memoryview(b"")
            if view is None:
                return self._refuse(rc, reader, 0, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
            self.epsn = (psn + npkts) & PSN_MASK
            with self.lock:
                self._respond(w.READ_RESP, 0, psn, 0, [view] if arg1 else [])
            return ACK_NONE
        # atomics
        reader.skip(length)
        if raddr % 8:
            return self._refuse(rc, reader, 0, w.NAK_INV_REQ, psn, e.IBV_EVENT_QP_REQ_ERR)
        view = self._remote_view(rkey, raddr, 8, _REMOTE_ATOMIC)
        if view is None:
            return self._refuse(rc, reader, 0, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
        cell = np.frombuffer(view, dtype=np.uint64)
        # in shared memory, same-host requesters execute atomics on it too (`_direct`): lock the cell for them
        mr = self.hca.mrs_by_rkey.get(rkey)
        shared = None if mr is None or mr.shared is None else (mr.shared[0].fd, mr.shared[1] + raddr - mr.addr)
        with self.hca.atomic_lock, _shm.atomics if shared is not None else nullcontext():
            if shared is not None:
                _shm.cell_lock(*shared, True)
            try:
                orig = int(cell[0])
                if op == _CAS:
                    if orig == arg1:
                        cell[0] = arg2
                else:
                    cell[0] = (orig + arg1) & _U64
            finally:
                if shared is not None:
                    _shm.cell_lock(*shared, False)
        self.atomic_cache[psn] = orig
        if len(self.atomic_cache) > _ATOMIC_CACHE:
            del self.atomic_cache[next(iter(self.atomic_cache))]
        self.epsn = (psn + 1) & PSN_MASK
        with self.lock:
            self._respond(w.ATOMIC_RESP, 0, psn, orig, [])
        return ACK_NONE

    def absorb_direct(self) -> None:
        """Take the PSNs same-host requesters consumed by direct WRs (`_shm`) into the expected PSN."""
        table = self.hca.table
        if table is None:
            return
        with self.lock:
            total = table.direct_psns(self.qp_num)
            if total != self.direct_seen:
                self.epsn = (self.epsn + total - self.direct_seen) & PSN_MASK
                self.direct_seen = total

    def _refuse(self, rc: bool, reader: w.PacketReader, length: int, syndrome: int, psn: int, event: Any) -> int:
        reader.skip(length)
        if rc:
            self._error_nak(syndrome, psn, event)
        return ACK_NONE

    def _duplicate(self, op: int, psn: int, length: int, rkey: int, raddr: int, arg1: int, r: w.PacketReader) -> int:
        """A retransmission of something already executed: answer it again, execute nothing twice."""
        r.skip(length)
        if op == _READ:
            view = self._remote_view(rkey, raddr, arg1, _REMOTE_READ) if arg1 else memoryview(b"")
            if view is not None:
                with self.lock:
                    self._respond(w.READ_RESP, 0, psn, 0, [view] if arg1 else [])
            return ACK_NONE
        if op in (_CAS, _FAA):
            orig = self.atomic_cache.get(psn)
            if orig is not None:
                with self.lock:
                    self._respond(w.ATOMIC_RESP, 0, psn, orig, [])
            return ACK_NONE
        return ACK_NOW
