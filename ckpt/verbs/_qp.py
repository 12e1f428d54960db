"""A simulated queue pair: the state machine, the RC/UC requester and responder, and path migration."""

# The transport follows the InfiniBand RC rules closely enough that the
# virtualization plugin meets the situations it would meet on hardware:
#
# * Requester: WRs execute in order; each message takes ceil(len / MTU) PSNs
#   (one frame carries it, but sq_psn / rq_psn advance as on the wire).  SEND
#   and WRITE complete on ACK, READ and atomics on their response; a response
#   for PSN p acknowledges everything before p.  FENCE waits for earlier READ /
#   atomic responses; at most max_rd_atomic of those are outstanding.
# * Loss: a packet is lost when a link on its path is down, the peer HCA is
#   gone, or the responder drops it (no such QP, QP not ready).  On the local
#   ACK timeout (4.096 us * 2**timeout) a known loss costs one retry and a
#   go-back-N retransmission from the oldest unacknowledged WR; retry_cnt
#   exhausted -> RETRY_EXC_ERR.  With an ARMED alternate path the first loss
#   migrates instead (IBV_EVENT_PATH_MIG) and the retransmission takes the
#   new path.
# * Responder: PSN == expected executes; PSN behind is a duplicate (re-ACK,
#   re-read, or the cached atomic result: atomics execute exactly once); PSN
#   ahead is a sequence error (one NAK, the requester goes back).  No receive
#   WQE -> RNR NAK with min_rnr_timer; the requester backs off and retries up
#   to rnr_retry times (7 = forever) -> RNR_RETRY_EXC_ERR.  Access and length
#   violations NAK the requester (REM_ACCESS_ERR / REM_INV_REQ_ERR /
#   REM_OP_ERR) and move the responder QP to ERR too (IB class C errors).
# * ERR flushes every outstanding WR, signaled or not, with WR_FLUSH_ERR;
#   receive WRs on an SRQ stay there.
#
# Locking: `lock` guards requester state and state changes; the responder
# state is touched only by the reader thread of the peer's connection, except
# by modify (which takes the lock).  A payload is never received while the
# lock is held, so a program's post_send is never stuck behind a 4 MiB READ.

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ckpt.verbs import _enums as e
from ckpt.verbs import _wire as w
from ckpt.verbs._attrs import WC, AHAttr, QPAttr, QPCap, QPInitAttr
from ckpt.verbs._errors import PyverbsRDMAError
from ckpt.verbs._hca import (
    EINVAL,
    ENOMEM,
    EOPNOTSUPP,
    MAX_INLINE,
    MAX_RD_ATOMIC,
    MAX_SGE,
    CQHandle,
    NotCheckpointable,
    PDHandle,
)
from ckpt.verbs._qpstate import check_modify

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
DELAYED_ACK = 0.001  # seconds a responder may sit on an ACK nobody asked for


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

    def __init__(self, wr: Any, signaled: bool, length: int) -> None:
        self.wr_id = wr.wr_id
        self.opcode = int(wr.opcode)
        self.flags = int(wr.send_flags)
        self.signaled = signaled
        self.sg = [(s.addr, s.length, s.lkey) for s in wr.sg[: wr.num_sge or len(wr.sg)]]
        self.inline: bytes | None = None
        self.rkey = wr.rkey or 0
        self.raddr = wr.remote_addr or 0
        self.compare_add = (wr.compare_add or 0) & _U64
        self.swap = (wr.swap or 0) & _U64
        self.imm = int(wr.imm_data or 0) & 0xFFFFFFFF
        self.length = length
        self.psn = 0
        self.npkts = 1
        self.sent = False
        self.done = False
        self.status = _OK
        self.dest: list[memoryview] | None = None


class QPHandle(NotCheckpointable):
    """The simulated QP.  Attribute names follow ibv_qp_attr."""

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
        self.cap = QPCap(
            max_send_wr=cap.max_send_wr,
            max_recv_wr=cap.max_recv_wr,
            max_send_sge=cap.max_send_sge,
            max_recv_sge=cap.max_recv_sge,
            max_inline_data=cap.max_inline_data,
        )
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        self.ack_every = max(1, min(ACK_EVERY, self.cap.max_send_wr // 2))
        self.qp_context = init_attr.qp_context
        self.lock = threading.RLock()
        self.retired = threading.Condition(self.lock)
        self.qp_num = hca.new_qpn()
        self._reset()
        hca.qps[self.qp_num] = self

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
        self.delayed_ack = False
        self.atomic_cache: dict[int, int] = {}

    # ------------------------------------------------------------------ paths
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
        self.hca.event(e.IBV_EVENT_PATH_MIG, self)
        log.debug("QP %#x migrated to port %d -> LID %d", self.qp_num, self.port_num, self.ah.dlid)

    def _arm_path(self) -> None:
        """What the HCA does after software sets REARM: load the alternate path and arm it."""
        with self.lock:
            if self.mig_state == _REARM and self.alt_ah.dlid and self.state in (_RTR, _RTS, _SQD):
                self.mig_state = _ARMED

    def path_broken(self) -> None:
        """A connection to some peer broke; the timer decides whether it concerned this QP."""

    # ------------------------------------------------------------------ modify / query
    def modify(self, attr: QPAttr, mask: int) -> None:
        with self.lock:
            cur = self.state
            new = int(attr.qp_state) if mask & e.IBV_QP_STATE else cur
            if mask & e.IBV_QP_CUR_STATE and int(attr.cur_qp_state) != cur:
                raise PyverbsRDMAError(f"modify_qp: cur_qp_state {attr.cur_qp_state!r} but the QP is in {cur}", EINVAL)
            reason = check_modify(self.qp_type, cur, new, mask)
            if reason is not None:
                raise PyverbsRDMAError(f"modify_qp: {reason}", EINVAL)
            self._check_values(attr, mask)
            if new == _RESET:
                self._flush_and_reset()
                return
            self._apply(attr, mask, cur, new)

    def _check_values(self, attr: QPAttr, mask: int) -> None:
        def bad(what: str) -> PyverbsRDMAError:
            return PyverbsRDMAError(f"modify_qp: {what}", EINVAL)

        if mask & e.IBV_QP_PORT and attr.port_num not in (1, 2):
            raise bad(f"port_num {attr.port_num} (the HCA has ports 1 and 2)")
        if mask & e.IBV_QP_ALT_PATH and attr.alt_port_num not in (1, 2):
            raise bad(f"alt_port_num {attr.alt_port_num} (the HCA has ports 1 and 2)")
        if mask & e.IBV_QP_MAX_QP_RD_ATOMIC and not 0 <= attr.max_rd_atomic <= MAX_RD_ATOMIC:
            raise bad(f"max_rd_atomic {attr.max_rd_atomic} above {MAX_RD_ATOMIC}")
        if mask & e.IBV_QP_MAX_DEST_RD_ATOMIC and not 0 <= attr.max_dest_rd_atomic <= MAX_RD_ATOMIC:
            raise bad(f"max_dest_rd_atomic {attr.max_dest_rd_atomic} above {MAX_RD_ATOMIC}")
        if mask & e.IBV_QP_RETRY_CNT and not 0 <= attr.retry_cnt <= 7:
            raise bad(f"retry_cnt {attr.retry_cnt} (0..7)")
        if mask & e.IBV_QP_RNR_RETRY and not 0 <= attr.rnr_retry <= 7:
            raise bad(f"rnr_retry {attr.rnr_retry} (0..7)")
        if mask & e.IBV_QP_TIMEOUT and not 0 <= attr.timeout <= 31:
            raise bad(f"timeout {attr.timeout} (0..31)")
        if mask & e.IBV_QP_MIN_RNR_TIMER and not 0 <= attr.min_rnr_timer <= 31:
            raise bad(f"min_rnr_timer {attr.min_rnr_timer} (0..31)")
        if mask & e.IBV_QP_CAP:
            raise PyverbsRDMAError("modify_qp: resizing a QP (IBV_QP_CAP) is not supported by simib", EOPNOTSUPP)
        if mask & e.IBV_QP_PATH_MIG_STATE:
            target = int(attr.path_mig_state)
            if target == _ARMED:
                raise bad("path_mig_state ARMED is set by the HCA, not by software (set REARM)")
            if target == _MIGRATED and self.mig_state != _ARMED:
                raise bad("path_mig_state MIGRATED (manual migration) needs the alternate path ARMED")
            alt_loaded = self.alt_ah.dlid or (mask & e.IBV_QP_ALT_PATH and attr.alt_ah_attr.dlid)
            if target == _REARM and not alt_loaded:
                raise bad("path_mig_state REARM needs an alternate path (IBV_QP_ALT_PATH)")

    def _apply(self, attr: QPAttr, mask: int, cur: int, new: int) -> None:
        if mask & e.IBV_QP_PKEY_INDEX:
            self.pkey_index = attr.pkey_index
        if mask & e.IBV_QP_PORT:
            self.port_num = attr.port_num
        if mask & e.IBV_QP_ACCESS_FLAGS:
            self.access = int(attr.qp_access_flags)
        if mask & e.IBV_QP_QKEY:
            self.qkey = attr.qkey
        if mask & e.IBV_QP_AV:
            self.ah = _copy_ah(attr.ah_attr)
        if mask & e.IBV_QP_PATH_MTU:
            self.path_mtu = int(attr.path_mtu)
        if mask & e.IBV_QP_DEST_QPN:
            self.dest_qp_num = attr.dest_qp_num & PSN_MASK
        if mask & e.IBV_QP_RQ_PSN:
            self.epsn = attr.rq_psn & PSN_MASK
        if mask & e.IBV_QP_MAX_DEST_RD_ATOMIC:
            self.max_dest_rd_atomic = attr.max_dest_rd_atomic
        if mask & e.IBV_QP_MIN_RNR_TIMER:
            self.min_rnr_timer = attr.min_rnr_timer
        if mask & e.IBV_QP_TIMEOUT:
            self.timeout = attr.timeout
        if mask & e.IBV_QP_RETRY_CNT:
            self.retry_cnt = attr.retry_cnt
        if mask & e.IBV_QP_RNR_RETRY:
            self.rnr_retry = attr.rnr_retry
        if mask & e.IBV_QP_SQ_PSN:
            self.sq_psn = attr.sq_psn & PSN_MASK
        if mask & e.IBV_QP_MAX_QP_RD_ATOMIC:
            self.max_rd_atomic = attr.max_rd_atomic
        if mask & e.IBV_QP_ALT_PATH:
            self.alt_ah = _copy_ah(attr.alt_ah_attr)
            self.alt_port_num = attr.alt_port_num
            self.alt_timeout = attr.alt_timeout
            self.alt_pkey_index = attr.alt_pkey_index
        if mask & e.IBV_QP_EN_SQD_ASYNC_NOTIFY:
            self.en_sqd_async_notify = attr.en_sqd_async_notify
        self.state = new
        if mask & e.IBV_QP_PATH_MIG_STATE:
            target = int(attr.path_mig_state)
            if target == _MIGRATED:
                self._migrate(initiated_here=True)
            elif target == _REARM:
                self.mig_state = _REARM
                self.hca.timers.at(time.monotonic() + 0.001, self._arm_path)
        if new == _ERR and cur != _ERR:
            self._enter_error()
        elif new == _SQD:
            self._check_drained()
        elif new == _RTS and cur in (_SQD, _SQE):
            self._pump(blocking=False)

    def query(self) -> tuple[QPAttr, QPInitAttr]:
        with self.lock:
            attr = QPAttr(qp_state=self.state, cur_qp_state=self.state, port_num=self.port_num)
            attr.path_mtu = self.path_mtu
            attr.path_mig_state = self.mig_state
            attr.qkey = self.qkey
            attr.rq_psn = self.epsn
            attr.sq_psn = self.sq_psn
            attr.dest_qp_num = self.dest_qp_num
            attr.qp_access_flags = self.access
            attr.cap = QPCap(
                max_send_wr=self.cap.max_send_wr,
                max_recv_wr=self.cap.max_recv_wr,
                max_send_sge=self.cap.max_send_sge,
                max_recv_sge=self.cap.max_recv_sge,
                max_inline_data=self.cap.max_inline_data,
            )
            attr.ah_attr = _copy_ah(self.ah)
            attr.alt_ah_attr = _copy_ah(self.alt_ah)
            attr.pkey_index = self.pkey_index
            attr.alt_pkey_index = self.alt_pkey_index
            attr.en_sqd_async_notify = self.en_sqd_async_notify
            attr.sq_draining = int(self.state == _SQD and any(not x.done for x in self.sq))
            attr.max_rd_atomic = self.max_rd_atomic
            attr.max_dest_rd_atomic = self.max_dest_rd_atomic
            attr.min_rnr_timer = self.min_rnr_timer
            attr.timeout = self.timeout
            attr.retry_cnt = self.retry_cnt
            attr.rnr_retry = self.rnr_retry
            attr.alt_port_num = self.alt_port_num
            attr.alt_timeout = self.alt_timeout
            init = QPInitAttr(
                qp_type=self.qp_type,
                qp_context=self.qp_context,
                scq=self.scq,
                rcq=self.rcq,
                srq=self.srq,
                cap=attr.cap,
                sq_sig_all=int(self.sq_sig_all),
            )
            return attr, init

    def destroy(self) -> None:
        with self.lock:
            self.state = _RESET
            self.sq.clear()
            self.rq.clear()
            self.hca.qps.pop(self.qp_num, None)

    # ------------------------------------------------------------------ posting
    def post_send(self, wr: Any) -> None:
        mtu = 128 << self.path_mtu
        with self.lock:
            state = self.state
            if state in (_RESET, _INIT, _RTR):
                raise PyverbsRDMAError(f"post_send on a QP in state {e.ibv_qp_state(state).name}", EINVAL)
            entries: list[SendEntry] = []
            while wr is not None:
                if len(self.sq) + len(entries) >= self.cap.max_send_wr:
                    self._wait_for_room(len(entries))
                entries.append(self._entry(wr, len(self.sq) + len(entries), mtu))
                wr = wr.next_wr
            if state == _ERR:
                for entry in entries:
                    self.scq.push(self._send_wc(entry, _FLUSH))
                return
            for entry in entries:
                entry.psn = self.sq_psn
                self.sq_psn = (self.sq_psn + entry.npkts) & PSN_MASK
                self.sq.append(entry)
            self._pump(blocking=True)

    def _wait_for_room(self, pending: int) -> None:
        """A full send queue: give the NIC threads (which share the CPU here) a moment to retire WRs.

        On hardware the NIC retires WRs while the CPU posts; here its threads
        need the GIL, so a program that posts back-to-back could see a full
        queue that a real NIC would already have drained.  Wait (bounded) for
        in-flight WRs to complete before reporting ENOMEM.
        """
        deadline = time.monotonic() + SQ_FULL_GRACE
        while len(self.sq) + pending >= self.cap.max_send_wr and any(x.sent and not x.done for x in self.sq):
            left = deadline - time.monotonic()
            if left <= 0 or self.state != _RTS:
                return
            self.retired.wait(left)

    def _entry(self, wr: Any, depth: int, mtu: int) -> SendEntry:
        opcode = int(wr.opcode)
        allowed = _RC_OPCODES if self.qp_type == _RC else _UC_OPCODES
        if opcode not in allowed:
            raise PyverbsRDMAError(f"opcode {opcode} is not supported on this QP type", EINVAL)
        nsge = wr.num_sge or len(wr.sg)
        if nsge > self.cap.max_send_sge or nsge > len(wr.sg):
            raise PyverbsRDMAError(f"send WR with {nsge} SGEs, the QP allows {self.cap.max_send_sge}", EINVAL)
        if depth >= self.cap.max_send_wr:
            raise PyverbsRDMAError(f"send queue full ({self.cap.max_send_wr} WRs outstanding)", ENOMEM)
        length = sum(s.length for s in wr.sg[:nsge])
        flags = int(wr.send_flags)
        entry = SendEntry(wr, self.sq_sig_all or bool(flags & _SIGNALED), length)
        if opcode in (_CAS, _FAA) and length != 8:
            raise PyverbsRDMAError("an atomic WR needs exactly one 8-byte SGE", EINVAL)
        if flags & _INLINE and opcode not in _RD_ATOMIC:
            if length > self.cap.max_inline_data:
                raise PyverbsRDMAError(f"{length} bytes inline, the QP allows {self.cap.max_inline_data}", EINVAL)
            entry.inline = b"".join(bytes(self._gather_inline(s)) for s in wr.sg[:nsge])
        entry.npkts = max(1, -(-length // mtu))
        return entry

    def _gather_inline(self, sge: Any) -> memoryview:
        """Inline data is copied at post time and its lkey is not checked (ibv_post_send(3))."""
        mr = self.hca.mr_containing(sge.addr, sge.length)
        if mr is None:
            raise PyverbsRDMAError(f"inline SGE address {sge.addr:#x} is not in any registered memory", EINVAL)
        off = sge.addr - mr.addr
        return mr.view[off : off + sge.length]

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

    # ------------------------------------------------------------------ requester
    def _pump(self, blocking: bool) -> None:
        """Transmit queued WRs in order as far as fences, rd/atomic credits and back-off allow (lock held).

        Everything one call can send goes out in one write: a chain of WRs
        posted together costs one doorbell, not one per WR.
        """
        sq = self.sq
        packets: list[tuple[tuple[Any, ...], list[Any]]] = []
        sent: list[SendEntry] = []
        while self.next_send < len(sq) and self.state == _RTS and not self.backoff:
            entry = sq[self.next_send]
            if entry.opcode in _RD_ATOMIC and self.rd_outstanding >= max(1, self.max_rd_atomic):
                break
            if entry.flags & _FENCE and self.rd_outstanding:
                break
            packet = self._packet(entry)
            if packet is None:
                break
            packets.append(packet)
            sent.append(entry)
            self.next_send += 1
        if packets:
            port, dlid = self._path()
            if not self.hca.transmit_many(port, dlid, packets, blocking):
                self.lost = True
            for entry in sent:
                entry.sent = True
            if self.qp_type == _UC:
                for entry in sent:
                    entry.done = True
                self._retire()
            elif not self.timer_armed:
                self.last_progress = self.progress_at = time.monotonic()
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

    def _packet(self, entry: SendEntry) -> tuple[tuple[Any, ...], list[Any]] | None:
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
            entry.raddr,
            arg1,
            entry.swap,
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
        self._pump(blocking=False)

    def _nak(self, syndrome: int, psn: int, delay_ns: int) -> None:
        self.progress_at = time.monotonic()  # a NAK is an answer: the peer is alive
        entry = self._acknowledge(psn, inclusive=False)
        if entry is None or entry.psn != psn:
            return
        if syndrome == w.NAK_RNR:
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
        if sq and sq[0].done:
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

    def _send_wc(self, entry: SendEntry, status: int) -> WC:
        return WC(
            wr_id=entry.wr_id,
            status=status,
            opcode=_WC_OPCODE[entry.opcode],
            byte_len=entry.length,
            qp_num=self.qp_num,
        )

    def _fail(self, entry: SendEntry, status: int) -> None:
        """The first error completion: that WR completes with `status`, the QP goes to ERR (lock held)."""
        log.debug("QP %#x: wr_id %s failed with %s", self.qp_num, entry.wr_id, e.ibv_wc_status(status).name)
        entry.status = status
        entry.done = True
        self._retire()
        self.state = _ERR
        self._enter_error()

    def _enter_error(self) -> None:
        """Flush every outstanding WR with WR_FLUSH_ERR, signaled or not (lock held)."""
        self.state = _ERR
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

    # ------------------------------------------------------------------ responder
    def send_ack(self) -> None:
        with self.lock:
            if self.state in (_RTR, _RTS, _SQD, _SQE):
                self._respond(w.ACK, 0, (self.epsn - 1) & PSN_MASK, 0, [])

    def _ack_due(self, flags: int) -> bool:
        """ACK now if the requester asked; otherwise at most DELAYED_ACK later (coalesced with others)."""
        if flags & w.F_ACKREQ:
            return True
        if not self.delayed_ack:
            self.delayed_ack = True
            self.hca.timers.at(time.monotonic() + DELAYED_ACK, self._send_delayed_ack)
        return False

    def _send_delayed_ack(self) -> None:
        self.delayed_ack = False
        self.send_ack()

    def _respond(self, kind: int, syndrome: int, psn: int, arg1: int, payload: list[Any]) -> None:
        port, dlid = self._path()
        length = sum(len(p) for p in payload)
        header = (kind, syndrome, 0, 0, self.dest_qp_num, self.qp_num, psn, 0, length, 0, 0, 0, arg1, 0)
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

    def on_request(self, fields: tuple[Any, ...], reader: w.PacketReader) -> bool:
        """Execute one incoming request (HCA reader thread).  True if an ACK is due."""
        _, op, flags, _, _, sqpn, psn, npkts, length, imm, rkey, slid, _, raddr, arg1, arg2, _ = fields
        state = self.state
        if state not in (_RTR, _RTS, _SQD, _SQE) or sqpn != self.dest_qp_num:
            reader.skip(length)
            self.hca.report_lost(fields)
            return False
        if flags & w.F_MIGRATE and self.mig_state == _ARMED:
            # before the PSN check: the requester may have migrated to resend something we already
            # executed, whose ACK was lost on the old path -- answering it there again would loop
            with self.lock:
                self._migrate(initiated_here=False)
        rc = self.qp_type == _RC
        if rc:
            d = psn_diff(psn, self.epsn)
            if d < 0:
                return self._duplicate(op, psn, length, rkey, raddr, arg1, reader)
            if d > 0:
                reader.skip(length)
                if not self.rnr_pending and not self.nak_seq_sent:
                    self.nak_seq_sent = True
                    with self.lock:
                        self._respond(w.NAK, w.NAK_SEQ, self.epsn, 0, [])
                return False
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
                return False
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
            wc = WC(
                wr_id=wr.wr_id,
                status=_OK,
                opcode=opcode,
                byte_len=byte_len,
                qp_num=self.qp_num,
                src_qp=sqpn,
                imm_data=imm if flags & w.F_IMM else 0,
                wc_flags=_WITH_IMM if flags & w.F_IMM else 0,
                slid=slid,
            )
            self.rcq.push(wc, solicited=bool(flags & w.F_SOLICITED))
            return rc and self._ack_due(flags)
        if op == _WRITE:
            view = self._remote_view(rkey, raddr, length, _REMOTE_WRITE) if length else memoryview(b"")
            if view is None:
                return self._refuse(rc, reader, length, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
            reader.take_into(view)
            self.epsn = (psn + npkts) & PSN_MASK
            return rc and self._ack_due(flags)
        if op == _READ:
            reader.skip(length)
            view = self._remote_view(rkey, raddr, arg1, _REMOTE_READ) if arg1 else memoryview(b"")
            if view is None:
                return self._refuse(rc, reader, 0, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
            self.epsn = (psn + npkts) & PSN_MASK
            with self.lock:
                self._respond(w.READ_RESP, 0, psn, 0, [view] if arg1 else [])
            return False
        # atomics
        reader.skip(length)
        if raddr % 8:
            return self._refuse(rc, reader, 0, w.NAK_INV_REQ, psn, e.IBV_EVENT_QP_REQ_ERR)
        view = self._remote_view(rkey, raddr, 8, _REMOTE_ATOMIC)
        if view is None:
            return self._refuse(rc, reader, 0, w.NAK_ACCESS, psn, e.IBV_EVENT_QP_ACCESS_ERR)
        cell = np.frombuffer(view, dtype=np.uint64)
        with self.hca.atomic_lock:
            orig = int(cell[0])
            if op == _CAS:
                if orig == arg1:
                    cell[0] = arg2
            else:
                cell[0] = (orig + arg1) & _U64
        self.atomic_cache[psn] = orig
        if len(self.atomic_cache) > _ATOMIC_CACHE:
            del self.atomic_cache[next(iter(self.atomic_cache))]
        self.epsn = (psn + 1) & PSN_MASK
        with self.lock:
            self._respond(w.ATOMIC_RESP, 0, psn, orig, [])
        return False

    def _refuse(self, rc: bool, reader: w.PacketReader, length: int, syndrome: int, psn: int, event: Any) -> bool:
        reader.skip(length)
        if rc:
            self._error_nak(syndrome, psn, event)
        return False

    def _duplicate(self, op: int, psn: int, length: int, rkey: int, raddr: int, arg1: int, r: w.PacketReader) -> bool:
        """A retransmission of something already executed: answer it again, execute nothing twice."""
        r.skip(length)
        if op == _READ:
            view = self._remote_view(rkey, raddr, arg1, _REMOTE_READ) if arg1 else memoryview(b"")
            if view is not None:
                with self.lock:
                    self._respond(w.READ_RESP, 0, psn, 0, [view] if arg1 else [])
            return False
        if op in (_CAS, _FAA):
            orig = self.atomic_cache.get(psn)
            if orig is not None:
                with self.lock:
                    self._respond(w.ATOMIC_RESP, 0, psn, orig, [])
            return False
        return True


def _copy_ah(ah: AHAttr | None) -> AHAttr:
    if ah is None:
        return AHAttr()
    return AHAttr(
        gr=ah.gr,
        is_global=ah.is_global,
        dlid=ah.dlid,
        sl=ah.sl,
        src_path_bits=ah.src_path_bits,
        static_rate=ah.static_rate,
        port_num=ah.port_num,
    )
