"""Queue-pair state shared by the requester and the responder: identity, attributes, paths, flushing."""

# The transport follows the InfiniBand RC rules closely enough that the virtualization plugin
# meets the situations it would meet on hardware; the requester (_requester.py) and the
# responder (_responder.py) each open with the rules they keep.  What is here is what both
# sides touch: the attributes of ibv_qp_attr, the primary and alternate paths with
# migration, and entering ERR, which flushes every outstanding WR, signaled or not, with
# WR_FLUSH_ERR (receive WRs on an SRQ stay there).
#
# Locking: `lock` guards requester state and state changes; the responder state is touched
# only by the reader thread of the peer's connection, except by modify (which takes the
# lock).  A payload is never received while the lock is held, so a program's post_send is
# never stuck behind a 4 MiB READ.

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace
from typing import Any

from ckpt.verbs import _enums as e
from ckpt.verbs import _wire as w
from ckpt.verbs._attrs import WC, AHAttr, QPCap, QPInitAttr
from ckpt.verbs._errors import PyverbsRDMAError
from ckpt.verbs._handles import (
    EINVAL,
    EOPNOTSUPP,
    MAX_INLINE,
    MAX_SGE,
    CQHandle,
    NotCheckpointable,
    PDHandle,
)

log = logging.getLogger(__name__)

PSN_MASK = 0xFFFFFF
_RESET, _INIT, _RTR, _RTS, _SQD, _SQE, _ERR = (
    int(s)
    for s in (
        e.IBV_QPS_RESET,
        e.IBV_QPS_INIT,
        e.IBV_QPS_RTR,
        e.IBV_QPS_RTS,
        e.IBV_QPS_SQD,
        e.IBV_QPS_SQE,
        e.IBV_QPS_ERR,
    )
)
_RC, _UC = int(e.IBV_QPT_RC), int(e.IBV_QPT_UC)
_SEND, _SEND_IMM = int(e.IBV_WR_SEND), int(e.IBV_WR_SEND_WITH_IMM)
_WRITE, _WRITE_IMM = int(e.IBV_WR_RDMA_WRITE), int(e.IBV_WR_RDMA_WRITE_WITH_IMM)
_READ, _CAS, _FAA = int(e.IBV_WR_RDMA_READ), int(e.IBV_WR_ATOMIC_CMP_AND_SWP), int(e.IBV_WR_ATOMIC_FETCH_AND_ADD)
_RD_ATOMIC = (_READ, _CAS, _FAA)
_UC_OPCODES = (_SEND, _SEND_IMM, _WRITE, _WRITE_IMM)
_RC_OPCODES = (*_UC_OPCODES, *_RD_ATOMIC)
_WC_OPCODE = {
    _SEND: int(e.IBV_WC_SEND),
    _SEND_IMM: int(e.IBV_WC_SEND),
    _WRITE: int(e.IBV_WC_RDMA_WRITE),
    _WRITE_IMM: int(e.IBV_WC_RDMA_WRITE),
    _READ: int(e.IBV_WC_RDMA_READ),
    _CAS: int(e.IBV_WC_COMP_SWAP),
    _FAA: int(e.IBV_WC_FETCH_ADD),
}
_SIGNALED, _FENCE, _SOLICITED, _INLINE = (
    int(f) for f in (e.IBV_SEND_SIGNALED, e.IBV_SEND_FENCE, e.IBV_SEND_SOLICITED, e.IBV_SEND_INLINE)
)
_LOCAL_WRITE, _REMOTE_WRITE, _REMOTE_READ, _REMOTE_ATOMIC = (
    int(a)
    for a in (e.IBV_ACCESS_LOCAL_WRITE, e.IBV_ACCESS_REMOTE_WRITE, e.IBV_ACCESS_REMOTE_READ, e.IBV_ACCESS_REMOTE_ATOMIC)
)
_OK, _FLUSH = int(e.IBV_WC_SUCCESS), int(e.IBV_WC_WR_FLUSH_ERR)
_NAK_STATUS = {
    w.NAK_ACCESS: int(e.IBV_WC_REM_ACCESS_ERR),
    w.NAK_INV_REQ: int(e.IBV_WC_REM_INV_REQ_ERR),
    w.NAK_OP: int(e.IBV_WC_REM_OP_ERR),
}
_RECV, _RECV_IMM, _WITH_IMM = int(e.IBV_WC_RECV), int(e.IBV_WC_RECV_RDMA_WITH_IMM), int(e.IBV_WC_WITH_IMM)
_ARMED, _REARM, _MIGRATED = int(e.IBV_MIG_ARMED), int(e.IBV_MIG_REARM), int(e.IBV_MIG_MIGRATED)
_U64 = (1 << 64) - 1
_MIN_TIMER = 0.002  # a software NIC does not wake for every 4 us timeout
_ATOMIC_CACHE = 64
SQ_FULL_GRACE = 0.2  # seconds post_send waits for a full send queue to drain before ENOMEM
ACK_EVERY = 16  # a requester asks for an ACK at least every this many packets (or half its send queue)
LATE_ACK_LIMIT = 1.0  # seconds of silence from a reachable peer after which timeouts count as retries


def psn_diff(a: int, b: int) -> int:
    """a - b in 24-bit serial-number arithmetic."""
    d = (a - b) & PSN_MASK
    return d - 0x1000000 if d >= 0x800000 else d


def ack_timeout(code: int) -> float:
    """Seconds of the local ACK timeout for ibv_qp_attr.timeout `code` (0 = infinite)."""
    return 0.0 if code == 0 else max(4.096e-6 * (1 << code), _MIN_TIMER)


def rnr_delay(code: int) -> float:
    """Seconds of the RNR NAK timer for min_rnr_timer `code` (IB spec table: 0 means 655.36 ms)."""
    table_ms: tuple[float, ...] = (
        655.36,
        0.01,
        0.02,
        0.03,
        0.04,
        0.06,
        0.08,
        0.12,
        0.16,
        0.24,
        0.32,
        0.48,
        0.64,
        0.96,
        1.28,
        1.92,
    )
    table_ms += (2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84, 245.76)
    table_ms += (327.68, 491.52)
    return table_ms[code & 31] / 1000.0


class SendEntry:
    """One posted send WR in the send queue."""

    __slots__ = (
        "compare_add",
        "dest",
        "done",
        "flags",
        "imm",
        "inline",
        "length",
        "npkts",
        "opcode",
        "psn",
        "raddr",
        "rkey",
        "sent",
        "sg",
        "signaled",
        "status",
        "swap",
        "wr_id",
    )

    def __init__(
        self, wr: Any, opcode: int, flags: int, signaled: bool, sg: list[tuple[int, int, int]], length: int
    ) -> None:
        self.wr_id = wr.wr_id
        self.opcode = opcode
        self.flags = flags
        self.signaled = signaled
        self.sg = sg
        self.inline: bytes | None = None
        self.rkey = wr.rkey or 0
        self.raddr = wr.remote_addr or 0
        if opcode == _CAS or opcode == _FAA:  # the operands only an atomic carries
            self.compare_add = (wr.compare_add or 0) & _U64
            self.swap = (wr.swap or 0) & _U64
        else:
            self.compare_add = self.swap = 0
        imm = wr.imm_data
        self.imm = int(imm) & 0xFFFFFFFF if imm else 0
        self.length = length
        self.psn = 0
        self.npkts = 1
        self.sent = False
        self.done = False
        self.status = _OK
        self.dest: list[memoryview] | None = None


class QPState(NotCheckpointable):
    """The state of a simulated QP.  Attribute names follow ibv_qp_attr."""

    def __init__(self, pd: PDHandle, init_attr: QPInitAttr) -> None:
        hca = pd.hca
        qp_type = int(init_attr.qp_type)
        if qp_type not in (_RC, _UC):
            raise PyverbsRDMAError(f"simib simulates RC and UC queue pairs only, not {qp_type!r}", EOPNOTSUPP)
        cap = init_attr.cap or QPCap()
        if not (1 <= cap.max_send_wr <= 16384 and 0 <= cap.max_recv_wr <= 16384):
            raise PyverbsRDMAError(f"QP capacity out of range: {cap.max_send_wr} send / {cap.max_recv_wr} recv", EINVAL)
        if cap.max_send_sge > MAX_SGE or cap.max_recv_sge > MAX_SGE or cap.max_inline_data > MAX_INLINE:
            raise PyverbsRDMAError(f"QP capacity above device limits ({MAX_SGE} SGEs, {MAX_INLINE} inline)", EINVAL)
        if init_attr.scq is None or init_attr.rcq is None:
            raise PyverbsRDMAError("a QP needs a send CQ and a receive CQ", EINVAL)
        self.hca, self.pd, self.qp_type = hca, pd, qp_type
        self.scq: CQHandle = init_attr.scq
        self.rcq: CQHandle = init_attr.rcq
        self.srq = init_attr.srq
        self.cap = replace(cap)
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        self.ack_every = max(1, min(ACK_EVERY, self.cap.max_send_wr // 2))
        self.qp_context = init_attr.qp_context
        self.lock = threading.RLock()
        self.retired = threading.Condition(self.lock)  # a WR retired: for a post waiting for room
        self.room_waiters = 0  # posts waiting on `retired` (`Requester._wait_for_room`)
        self.qp_num = hca.new_qpn()
        self._reset()

    def _reset(self) -> None:
        self.state = _RESET
        self.port_num = 1
        self.pkey_index = 0
        self.access = 0
        self.qkey = 0
        self.path_mtu = int(e.IBV_MTU_1024)
        self.dest_qp_num = 0
        self.ah = AHAttr()
        self.alt_ah = AHAttr()
        self.alt_port_num = 0
        self.alt_pkey_index = 0
        self.timeout = self.alt_timeout = 0
        self.retry_cnt = self.rnr_retry = 7
        self.min_rnr_timer = 0
        self.max_rd_atomic = self.max_dest_rd_atomic = 1
        self.mig_state = _MIGRATED
        self.mig_announce = False
        self.en_sqd_async_notify = 0
        # requester
        self.sq: deque[SendEntry] = deque()
        self.next_send = 0
        self.rd_outstanding = 0
        self.unrequested = 0
        self.sq_psn = 0
        self.retries = 0
        self.rnr_retries = 0
        self.backoff = False
        self.lost = False
        self.last_progress = 0.0
        self.progress_at = 0.0  # the last time the peer acknowledged anything
        self.timer_armed = False
        # responder
        self.rq: deque[Any] = deque()
        self.epsn = 0
        self.rnr_pending = False
        self.nak_seq_sent = False
        self.comm_est = False
        self.ack_owed = False  # requests executed that no ACK has covered yet (`Responder.ack_due`)
        self.owed_on: Any = None  # the receive channel that keeps the time of that ACK (`_rx.RxChannel.owe`)
        self.atomic_cache: dict[int, int] = {}
        self.direct_seen = 0  # of the PSNs direct WRs consumed (`_shm.Table.direct_psns`), those in epsn

    def _path(self) -> tuple[int, int]:
        return self.port_num, self.ah.dlid

    def _migrate(self, initiated_here: bool) -> None:
        """Switch to the armed alternate path (the caller holds the lock)."""
        alt = (self.alt_port_num, self.alt_ah)
        if initiated_here and not self.hca.path_ok(alt[0], alt[1].dlid):
            self.mig_state = _MIGRATED
            self.hca.event(e.IBV_EVENT_PATH_MIG_ERR, self)
            return
        self.port_num, self.ah, self.alt_port_num, self.alt_ah = alt[0], alt[1], self.port_num, self.ah
        self.timeout, self.alt_timeout = self.alt_timeout or self.timeout, self.timeout
        self.pkey_index, self.alt_pkey_index = self.alt_pkey_index, self.pkey_index
        self.mig_state = _MIGRATED
        self.mig_announce = initiated_here
        self.hca.counts["path_migrations"] += 1
        self._publish()  # its responses take the other path now
        self.hca.event(e.IBV_EVENT_PATH_MIG, self)
        log.debug("QP %#x migrated to port %d -> LID %d", self.qp_num, self.port_num, self.ah.dlid)

    def _arm_path(self) -> None:
        """What the HCA does after software sets REARM: load the alternate path and arm it."""
        with self.lock:
            if self.mig_state == _REARM and self.alt_ah.dlid and self.state in (_RTR, _RTS, _SQD):
                self.mig_state = _ARMED

    def _send_wc(self, entry: SendEntry, status: int) -> WC:
        return WC(
            wr_id=entry.wr_id,
            status=status,
            opcode=_WC_OPCODE[entry.opcode],
            byte_len=entry.length,
            qp_num=self.qp_num,
        )

    def _publish(self) -> None:
        """Show the QP's state, access, peer and path to same-host requesters (`_shm.Table`)."""
        table = self.hca.table
        if table is not None:
            lids = self.hca.lids
            table.set_qp(self, lids[self.port_num - 1] if len(lids) >= self.port_num else 0)

    def _enter_error(self) -> None:
        """Flush every outstanding WR with WR_FLUSH_ERR, signaled or not (lock held)."""
        self.state = _ERR
        self._publish()
        while self.sq:
            entry = self.sq.popleft()
            self.scq.push(self._send_wc(entry, entry.status if entry.done else _FLUSH))
        self.next_send = 0
        self.rd_outstanding = 0
        while self.rq:
            r = self.rq.popleft()
            self.rcq.push(WC(wr_id=r.wr_id, status=_FLUSH, opcode=_RECV, qp_num=self.qp_num))
        if self.srq is not None:
            self.hca.event(e.IBV_EVENT_QP_LAST_WQE_REACHED, self)

    def _flush_and_reset(self) -> None:
        self.sq.clear()
        self.rq.clear()
        self._reset()

    def _check_drained(self) -> None:
        if self.state == _SQD and self.en_sqd_async_notify and not any(x.sent and not x.done for x in self.sq):
            self.en_sqd_async_notify = 0  # one event per drain
            self.hca.event(e.IBV_EVENT_SQ_DRAINED, self)


def _copy_ah(ah: AHAttr | None) -> AHAttr:
    return AHAttr() if ah is None else replace(ah)
