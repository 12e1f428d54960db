"""A simulated queue pair: the state machine (modify / query) over the requester and the responder."""

from __future__ import annotations

import time
from dataclasses import replace

from ckpt.verbs import _enums as e
from ckpt.verbs._attrs import QPAttr, QPInitAttr
from ckpt.verbs._errors import PyverbsRDMAError
from ckpt.verbs._handles import (
    EINVAL,
    EOPNOTSUPP,
    MAX_RD_ATOMIC,
    PDHandle,
)
from ckpt.verbs._qpbase import (
    _ARMED,
    _ERR,
    _MIGRATED,
    _REARM,
    _RESET,
    _RTS,
    _SQD,
    _SQE,
    PSN_MASK,
    _copy_ah,
)
from ckpt.verbs._qpstate import check_modify
from ckpt.verbs._requester import Requester
from ckpt.verbs._responder import Responder


class QPHandle(Requester, Responder):
    """The simulated QP: what the simib provider hands out for ibv_create_qp."""

    def __init__(self, pd: PDHandle, init_attr: QPInitAttr) -> None:
        super().__init__(pd, init_attr)
        self.hca.qps[self.qp_num] = self  # from now on the HCA delivers packets to it

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
            else:
                self._apply(attr, mask, cur, new)
            self._publish()

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
            # direct WRs before this counted towards the old PSN space (`_shm`)
            self.direct_seen = self.hca.table.direct_psns(self.qp_num) if self.hca.table is not None else 0
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
        self.absorb_direct()
        with self.lock:
            attr = QPAttr(qp_state=self.state, cur_qp_state=self.state, port_num=self.port_num)
            attr.path_mtu = self.path_mtu
            attr.path_mig_state = self.mig_state
            attr.qkey = self.qkey
            attr.rq_psn = self.epsn
            attr.sq_psn = self.sq_psn
            attr.dest_qp_num = self.dest_qp_num
            attr.qp_access_flags = self.access
            attr.cap = replace(self.cap)
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
            self.hca.unsent.pop(self, None)
            if self.hca.table is not None:
                self.hca.table.remove_qp(self)
