"""All-to-all SENDs whose receives all come from one shared receive queue (SRQ) per rank.

    ckpt launch -n 4 tests/programs/ib_srq.py [STEPS]

Every rank has an RC QP to every other rank, all attached to the rank's one SRQ.
Each step a rank SENDs (its rank, the step, its value) to every other rank and
waits for the step's messages from all of them; a peer up to one step ahead may
already have sent its next one, so messages are kept by step.  The new value is
(value * 31 + sum of the peers' values + step) mod 1_000_003.  The SRQ is armed
with a limit it never reaches, so a modify-SRQ is part of the state.
"""

from __future__ import annotations

import numpy as np
from ib_common import Deadline, connect_links, held, pausable, poll

import ckpt
from ckpt import verbs

DEPTH = 64  # receives posted on the SRQ (and receive slots)
SIGNAL_EVERY = 8
FIELDS = 3  # int64s per message: source rank, step, value


class SharedReceiveQueue(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 500
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.cq = verbs.CQ(self.ctx, 512)
        self.srq = verbs.SRQ(self.pd, verbs.SrqInitAttr(verbs.SrqAttr(max_wr=DEPTH, max_sge=1)))
        self.srq.arm(2)
        self.peers = [r for r in range(rt.size) if r != rt.rank]
        self.send_buf = np.zeros((DEPTH, FIELDS), dtype=np.int64)
        self.recv_buf = np.zeros((DEPTH, FIELDS), dtype=np.int64)
        self.send_mr = verbs.MR(self.pd, self.send_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = verbs.MR(self.pd, self.recv_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        qps, _ = connect_links(rt, self.ctx, self.pd, self.cq, {(p, "all") for p in self.peers}, srq=self.srq)
        self.qps = [qps[(p, "all")] for p in self.peers]
        for slot in range(DEPTH):
            self._post_recv(slot)
        self.early: dict[int, list[int]] = {}  # step -> values received for it
        self.sent = 0
        self.value = rt.rank + 1
        self.i = 0

    @held
    @pausable
    def step(self, rt: ckpt.Runtime) -> bool:
        for qp in self.qps:
            slot = self.sent % DEPTH
            self.send_buf[slot] = (rt.rank, self.i, self.value)
            signaled = self.sent % SIGNAL_EVERY == SIGNAL_EVERY - 1
            wr = verbs.SendWR(
                wr_id=self.sent,
                opcode=verbs.IBV_WR_SEND,
                num_sge=1,
                sg=[verbs.SGE(self.send_mr.buf + slot * FIELDS * 8, FIELDS * 8, self.send_mr.lkey)],
                send_flags=verbs.IBV_SEND_SIGNALED if signaled else 0,
            )
            qp.post_send(wr)
            self.sent += 1
        deadline = Deadline(f"step {self.i}'s messages")
        while len(self.early.get(self.i, ())) < len(self.peers):
            for wc in poll(self.cq):
                if wc.opcode != verbs.IBV_WC_RECV:
                    continue
                source, step, value = (int(v) for v in self.recv_buf[wc.wr_id])
                if not self.i <= step <= self.i + 1 or source not in self.peers:
                    raise RuntimeError(f"step {self.i}: a message of rank {source} for step {step}")
                self.early.setdefault(step, []).append(value)
                self._post_recv(wc.wr_id)
                deadline.progress()
            deadline.check()
        values = self.early.pop(self.i)
        self.value = (self.value * 31 + sum(values) + self.i) % 1_000_003
        self.i += 1
        return self.i < self.steps

    def _post_recv(self, slot: int) -> None:
        sge = verbs.SGE(self.recv_mr.buf + slot * FIELDS * 8, FIELDS * 8, self.recv_mr.lkey)
        self.srq.post_recv(verbs.RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def result(self) -> int:
        return self.value
