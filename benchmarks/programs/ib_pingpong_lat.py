"""8-byte SEND/RECV ping-pong between two ranks over one RC QP each: the verbs round-trip latency under ckpt.

    ckpt launch -n 2 [--native | --disable-plugin ib] benchmarks/programs/ib_pingpong_lat.py
        [ROUND_TRIPS] [PER_STEP] [SIGNAL_EVERY]

Rank 0 sends 8 bytes (IBV_SEND_INLINE, unsignaled except every
SIGNAL_EVERY-th, default 64) and waits for rank 1's 8-byte answer; every 64
sends, a rank reaps the send completions it asked for.  SIGNAL_EVERY 1 makes
a native run signal every send, as ckpt_ib does underneath (for profiling). ROUND_TRIPS (default 2000) round trips,
PER_STEP (default 100) of them in each step, so the job is checkpointable
between steps.  Both ranks busy-poll their receive CQ, as rdma-core's
ibv_rc_pingpong does without --events.  The program times its own round
trips (`time.perf_counter()` from the start of its first step to the end of
its last; setup ends with a barrier, so both ranks start together), and
`result()` is the mean microseconds of one round trip.  The timing is only
meaningful for an uninterrupted run.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt
from ckpt import verbs

ACCESS = verbs.IBV_ACCESS_LOCAL_WRITE
REAP_EVERY = 64
RECVS = 16


class PingPong(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        if rt.size != 2:
            raise ValueError(f"the ping-pong runs on 2 ranks, not {rt.size}")
        self.round_trips = int(rt.argv[0]) if rt.argv else 2000
        self.per_step = int(rt.argv[1]) if len(rt.argv) > 1 else 100
        self.signal_every = int(rt.argv[2]) if len(rt.argv) > 2 else REAP_EVERY
        if REAP_EVERY % self.signal_every:
            raise ValueError(f"SIGNAL_EVERY must divide {REAP_EVERY}")
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.send_cq = verbs.CQ(self.ctx, 2 * REAP_EVERY)
        self.recv_cq = verbs.CQ(self.ctx, 64)
        self.buf = np.zeros(2, dtype=np.int64)  # slot 0: what this rank sends, slot 1: what it receives
        self.mr = verbs.MR(self.pd, self.buf, ACCESS)
        cap = verbs.QPCap(max_send_wr=2 * REAP_EVERY, max_recv_wr=RECVS, max_inline_data=64)
        init = verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap, sq_sig_all=0)
        self.qp = verbs.QP(self.pd, init)
        me = {"lid": self.ctx.query_port(1).lid, "qpn": self.qp.qp_num}
        peer = rt.allgather(me)[1 - rt.rank]
        verbs.connect_rc(self.qp, peer["lid"], peer["qpn"], ACCESS)
        for i in range(RECVS):
            self._post_recv(i)
        self.done = 0  # round trips completed
        self.sent = 0
        self.started = 0.0
        self.elapsed = 0.0
        rt.barrier()

    def _post_recv(self, wr_id: int) -> None:
        sge = verbs.SGE(self.mr.buf + 8, 8, self.mr.lkey)
        self.qp.post_recv(verbs.RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))

    def _send(self, value: int) -> None:
        self.buf[0] = value
        self.sent += 1
        flags = verbs.IBV_SEND_INLINE
        if self.sent % self.signal_every == 0:
            flags |= verbs.IBV_SEND_SIGNALED
        wr = verbs.SendWR(
            wr_id=self.sent,
            opcode=verbs.IBV_WR_SEND,
            num_sge=1,
            sg=[verbs.SGE(self.mr.buf, 8, self.mr.lkey)],
            send_flags=flags,
        )
        self.qp.post_send(wr)
        if self.sent % REAP_EVERY == 0:  # frees the send queue of the WRs before
            for _ in range(REAP_EVERY // self.signal_every):
                self._wait(self.send_cq)

    def _wait(self, cq: verbs.CQ) -> verbs.WC:
        deadline = time.monotonic() + 60
        while True:
            _, wcs = cq.poll(1)
            if wcs:
                (wc,) = wcs
                if wc.status != verbs.IBV_WC_SUCCESS:
                    raise RuntimeError(f"work completion failed: {verbs.ibv_wc_status(wc.status).name}")
                return wc
            if time.monotonic() > deadline:
                raise RuntimeError("no completion for 60 s")

    def _receive(self) -> int:
        wc = self._wait(self.recv_cq)
        value = int(self.buf[1])
        self._post_recv(wc.wr_id)
        return value

    def step(self, rt: ckpt.Runtime) -> bool:
        if self.done == 0:
            self.started = time.perf_counter()
        for _ in range(min(self.per_step, self.round_trips - self.done)):
            if rt.rank == 0:
                self._send(self.done)
                answer = self._receive()
            else:
                answer = self._receive()
                self._send(answer)
            if answer != self.done:
                raise RuntimeError(f"round trip {self.done}: got {answer}")
            self.done += 1
        if self.done < self.round_trips:
            return True
        self.elapsed = time.perf_counter() - self.started
        return False

    def result(self) -> str:
        return f"{self.elapsed / self.round_trips * 1e6:.3f}"
