"""Pass values around a ring of ranks over RC queue pairs (SEND/RECV and RDMA WRITE WITH IMM).

    ckpt launch -n 4 examples/ring.py [STEPS] [WORK_US] [TIMING_FILE]

Each rank connects one RC QP to its right neighbour and one to its left.  In
every step a rank writes its running value into the right neighbour's slot
with RDMA_WRITE_WITH_IMM (the step number as immediate data), mostly
unsignaled, and receives the left neighbour's value the same way; values mix
deterministically, so the result is the same for every run with the same
STEPS and ranks.

For overhead measurements (benchmarks/bench_ib.py): WORK_US (default 0) adds
that many microseconds of the rank's own CPU time of numpy work to every step,
and with TIMING_FILE each rank writes the mean wall time of one step, in
seconds, to TIMING_FILE.<rank> when it finishes (timed from the start of its
first step to the end of its last, so start-up and setup are not counted).
Neither changes the result.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import ckpt
from ckpt import verbs

ACCESS = verbs.IBV_ACCESS_LOCAL_WRITE | verbs.IBV_ACCESS_REMOTE_WRITE
SIGNAL_EVERY = 16
PATH_CHECK = 1.0  # seconds without the left neighbour's value before its path is looked at


class Ring(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 200
        self.work = float(rt.argv[1]) / 1e6 if len(rt.argv) > 1 else 0.0
        self.timing = rt.argv[2] if len(rt.argv) > 2 else ""
        self.scratch = np.ones(64)
        self.started = 0.0
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.cq = verbs.CQ(self.ctx, 256)
        # slot 0: value sent to the right (local source), slot 1: value written by the left neighbour
        self.buf = np.zeros(2, dtype=np.int64)
        self.mr = verbs.MR(self.pd, self.buf, ACCESS)
        cap = verbs.QPCap(max_send_wr=64, max_recv_wr=64)
        init = verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp_right = verbs.QP(self.pd, init)  # sends to the right neighbour's qp_left
        self.qp_left = verbs.QP(self.pd, init)  # receives from the left neighbour's qp_right
        me = {
            "lid": self.ctx.query_port(1).lid,
            "right": self.qp_right.qp_num,
            "left": self.qp_left.qp_num,
            "rkey": self.mr.rkey,
            "addr": self.mr.buf,
        }
        peers = rt.allgather(me)
        right, left = peers[(rt.rank + 1) % rt.size], peers[(rt.rank - 1) % rt.size]
        self.right = {"rkey": right["rkey"], "addr": right["addr"]}
        verbs.connect_rc(self.qp_right, right["lid"], right["left"], ACCESS)
        verbs.connect_rc(self.qp_left, left["lid"], left["right"], ACCESS)
        for i in range(32):
            self.qp_left.post_recv(verbs.RecvWR(wr_id=i))
        self.value = rt.rank + 1
        self.i = 0
        rt.barrier()

    def step(self, rt: ckpt.Runtime) -> bool:
        if self.i == 0:
            self.started = time.perf_counter()
        if self.work:
            _busy(self.scratch, self.work)
        self.buf[0] = self.value
        wr = verbs.SendWR(
            wr_id=self.i,
            opcode=verbs.IBV_WR_RDMA_WRITE_WITH_IMM,
            num_sge=1,
            sg=[verbs.SGE(self.mr.buf, 8, self.mr.lkey)],
            imm_data=self.i,
            send_flags=verbs.IBV_SEND_SIGNALED if self.i % SIGNAL_EVERY == SIGNAL_EVERY - 1 else 0,
        )
        wr.set_wr_rdma(self.right["rkey"], self.right["addr"] + 8)
        self.qp_right.post_send(wr)
        received = None
        deadline = time.monotonic() + 60
        check = time.monotonic() + PATH_CHECK
        while received is None:
            _, wcs = self.cq.poll(8)
            for wc in wcs:
                if wc.status != verbs.IBV_WC_SUCCESS:
                    raise RuntimeError(f"work completion failed: {verbs.ibv_wc_status(wc.status).name}")
                if wc.opcode == verbs.IBV_WC_RECV_RDMA_WITH_IMM:
                    if wc.imm_data != self.i:
                        raise RuntimeError(f"step {self.i}: got the value of step {wc.imm_data}")
                    received = int(self.buf[1])
                    self.qp_left.post_recv(verbs.RecvWR(wr_id=self.i))
            now = time.monotonic()
            if now > check:
                check = now + PATH_CHECK
                self._check_path()
            if now > deadline:
                raise RuntimeError(f"step {self.i}: nothing from the left neighbour for 60 s")
        self.value = (self.value * 31 + received + self.i) % 1_000_003
        self.i += 1
        # the neighbour must not overwrite slot 1 before we read it: one write in flight per step,
        # so wait for the step's exchange on both sides (collectives are step-aligned)
        rt.barrier()
        if self.i < self.steps:
            return True
        if self.timing:
            elapsed = time.perf_counter() - self.started
            Path(f"{self.timing}.{rt.rank}").write_text(f"{elapsed / self.steps:.9f}\n")
        return False

    def _check_path(self) -> None:
        """Nothing from the left for a while: fail at once if nothing can come.

        The left neighbour's WRITE on a failed link ends with RETRY_EXC_ERR, but that neighbour
        sees it only when it next polls -- and if this rank's own WRITE got through first, it is
        waiting in the step's barrier.  So a waiting rank looks at the path itself: the subnet
        manager's path records (`Context.query_paths`; none on a transport without one).
        """
        attr, _ = self.qp_left.query()
        used = [(attr.port_num, attr.ah_attr.dlid)]
        if attr.path_mig_state == verbs.IBV_MIG_ARMED:  # a failure would migrate the QP (ckpt_apm)
            used.append((attr.alt_port_num, attr.alt_ah_attr.dlid))
        up = {(p.port_num, p.dlid): p.up for p in self.ctx.query_paths(attr.ah_attr.dlid)}
        if up and not any(up.get(path, True) for path in used):
            raise RuntimeError(
                f"step {self.i}: the path to the left neighbour is down (port {attr.port_num} to LID "
                f"{attr.ah_attr.dlid}) and no alternate path is armed: nothing can come"
            )

    def result(self) -> int:
        return self.value


def _busy(scratch: np.ndarray, seconds: float) -> None:
    """Numpy work until this thread has used `seconds` of CPU (CPU time, so a descheduled rank still does it all)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        np.sqrt(scratch, out=scratch)
