"""Many RC QPs per rank, all-to-all, a little traffic per step: the job of the ckpt_ib checkpoint benchmark.

    ckpt launch -n 4 benchmarks/programs/ib_manyqp.py [QPS] [STEP_MS] [STAMP_FILE]

Each rank opens the device, allocates a PD, registers one 1 MiB buffer and
creates QPS (default 64) RC QPs on one send CQ and one receive CQ.  QP j of
rank r is connected to QP j of rank r XOR (1 + j mod (size - 1)), so the QPs
are spread evenly over all the other ranks (the number of ranks must be a
power of two).  Every QP keeps RECVS receives posted.  Each step sends one
64-byte SEND on every QP (signaled), waits for all its send completions and
for this step's message on every QP (re-posting each receive as it
completes), then sleeps STEP_MS
milliseconds (default 5); it runs until the job is killed.

With STAMP_FILE, the first step after a restart writes a JSON object to
STAMP_FILE.<rank> (atomically): `imported`, the `time.time()` at which the
rank imported this file (early in its start-up), and `first_step`, the
`time.time()` at which the program continued.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

import ckpt
from ckpt import verbs

IMPORTED = time.time()
ACCESS = verbs.IBV_ACCESS_LOCAL_WRITE | verbs.IBV_ACCESS_REMOTE_WRITE
MESSAGE = 64
RECVS = 4
BUFFER = 1 << 20


class ManyQP(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        if rt.size < 2 or rt.size & (rt.size - 1):
            raise ValueError(f"the number of ranks must be a power of two, at least 2 (not {rt.size})")
        self.nqp = int(rt.argv[0]) if rt.argv else 64
        self.delay = (float(rt.argv[1]) if len(rt.argv) > 1 else 5.0) / 1000
        self.stamp = rt.argv[2] if len(rt.argv) > 2 else ""
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.send_cq = verbs.CQ(self.ctx, 2 * self.nqp)
        self.recv_cq = verbs.CQ(self.ctx, RECVS * self.nqp)
        # per QP: one 64-byte send slot, then RECVS receive slots
        self.buf = np.zeros(BUFFER, dtype=np.uint8)
        self.mr = verbs.MR(self.pd, self.buf, ACCESS)
        if self.nqp * (1 + RECVS) * MESSAGE > BUFFER:
            raise ValueError(f"{self.nqp} QPs do not fit in {BUFFER} bytes")
        cap = verbs.QPCap(max_send_wr=4, max_recv_wr=RECVS)
        init = verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap, sq_sig_all=0)
        self.qps = [verbs.QP(self.pd, init) for _ in range(self.nqp)]
        me = {"lid": self.ctx.query_port(1).lid, "qpns": [qp.qp_num for qp in self.qps]}
        peers = rt.allgather(me)
        self.by_qpn = {}
        for j, qp in enumerate(self.qps):
            peer = peers[rt.rank ^ (1 + j % (rt.size - 1))]
            verbs.connect_rc(qp, peer["lid"], peer["qpns"][j], ACCESS)
            self.by_qpn[qp.qp_num] = j
            for k in range(RECVS):
                self._post_recv(j, k)
        self.inbox = [0] * self.nqp  # messages received on each QP, not yet counted for a step
        self.i = 0
        self.stamped = False
        rt.barrier()

    def _slot(self, j: int, k: int) -> int:
        """Address of slot k of QP j (k = 0: its send slot, 1..RECVS: its receive slots)."""
        return int(self.mr.buf) + (j * (1 + RECVS) + k) * MESSAGE

    def _post_recv(self, j: int, k: int) -> None:
        sge = verbs.SGE(self._slot(j, 1 + k), MESSAGE, self.mr.lkey)
        self.qps[j].post_recv(verbs.RecvWR(wr_id=j * RECVS + k, num_sge=1, sg=[sge]))

    def step(self, rt: ckpt.Runtime) -> bool:
        if rt.restarted and self.stamp and not self.stamped:
            self.stamped = True
            _stamp(f"{self.stamp}.{rt.rank}", {"imported": IMPORTED, "first_step": time.time()})
        for j, qp in enumerate(self.qps):
            wr = verbs.SendWR(
                wr_id=j,
                opcode=verbs.IBV_WR_SEND,
                num_sge=1,
                sg=[verbs.SGE(self._slot(j, 0), MESSAGE, self.mr.lkey)],
                send_flags=verbs.IBV_SEND_SIGNALED,
            )
            qp.post_send(wr)
        # count arrivals per QP: a partner may already be one step ahead, and its next message must
        # count for the next step, or this rank would wait in this step for a message that the
        # partner only sends after a checkpoint's target boundary (and the checkpoint would hang)
        sent = 0
        deadline = time.monotonic() + 60
        while sent < self.nqp or 0 in self.inbox:
            for cq in (self.send_cq, self.recv_cq):
                _, wcs = cq.poll(self.nqp)
                for wc in wcs:
                    if wc.status != verbs.IBV_WC_SUCCESS:
                        raise RuntimeError(f"work completion failed: {verbs.ibv_wc_status(wc.status).name}")
                    if wc.opcode & verbs.IBV_WC_RECV:
                        j, k = divmod(wc.wr_id, RECVS)
                        self.inbox[j] += 1
                        self._post_recv(j, k)
                    else:
                        sent += 1
            if time.monotonic() > deadline:
                missing = self.inbox.count(0)
                raise RuntimeError(f"step {self.i}: {sent} sends done, {missing} QPs without a message after 60 s")
        self.inbox = [n - 1 for n in self.inbox]
        self.i += 1
        time.sleep(self.delay)
        return True

    def result(self) -> int:
        return self.i


def _stamp(path: str, record: dict[str, float]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
