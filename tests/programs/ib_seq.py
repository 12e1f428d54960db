"""Exactly-once delivery: every rank streams sequence-numbered messages to every other rank over RC QPs.

    ckpt launch -n 4 tests/programs/ib_seq.py [STEPS] [PER_STEP]

Each step a rank sends PER_STEP messages (default 8) to each other rank, on an
RC QP per pair, numbered 0, 1, 2, ... per (source, destination): even numbers as
a SEND carrying (source, seq, check), odd ones as an RDMA_WRITE_WITH_IMM of
(source, seq, check) into a landing slot with imm_data = seq.  Sends are mostly
unsignaled and nobody waits for them: a rank only waits until it has everything
its peers sent LAG steps ago, so up to (2 * LAG + 1) * PER_STEP messages per
pair are in flight at any step boundary.  Receivers count every sequence number
they see per source.

Result: "[(count, duplicates, gaps) per source rank, in rank order] corrupt=<n>",
which must be (STEPS * PER_STEP, 0, 0) for every source and corrupt=0 however
often the job was checkpointed, resumed or restarted.
"""

from __future__ import annotations

import numpy as np
from ib_common import ACCESS, Deadline, connect_links, held, pausable, poll

import ckpt
from ckpt import verbs

LAG = 1
RQ_DEPTH = 64  # receives posted per QP (and receive slots per source)
SLOTS = 64  # landing slots per source for RDMA_WRITE_WITH_IMM, send slots per destination
SIGNAL_EVERY = 16
FIELDS = 3  # int64s per message: source, seq, check


def check_of(source: int, seq: int, destination: int) -> int:
    return (source * 1_000_003 + seq * 7919 + destination) % (1 << 31)


class SequenceNumbers(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 400
        self.per_step = int(rt.argv[1]) if len(rt.argv) > 1 else 8
        self.total = self.steps * self.per_step
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.cq = verbs.CQ(self.ctx, 2048)
        self.peers = [r for r in range(rt.size) if r != rt.rank]
        shape = (rt.size, SLOTS, FIELDS)
        self.send_buf = np.zeros(shape, dtype=np.int64)  # [destination, slot]
        self.recv_buf = np.zeros((rt.size, RQ_DEPTH, FIELDS), dtype=np.int64)  # [source, slot] for SENDs
        self.landing = np.zeros(shape, dtype=np.int64)  # [source, slot] for RDMA writes
        self.send_mr = verbs.MR(self.pd, self.send_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = verbs.MR(self.pd, self.recv_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.landing_mr = verbs.MR(self.pd, self.landing, ACCESS)
        qps, everyone = connect_links(
            rt,
            self.ctx,
            self.pd,
            self.cq,
            {(p, "seq") for p in self.peers},
            send_wr=4 * RQ_DEPTH,
            recv_wr=RQ_DEPTH,
            publish={"landing": (self.landing_mr.rkey, self.landing_mr.buf)},
        )
        self.qps = {p: qps[(p, "seq")] for p in self.peers}
        self.remote_landing = {p: everyone[p]["landing"] for p in self.peers}
        self.sent = dict.fromkeys(self.peers, 0)
        self.posted = dict.fromkeys(self.peers, 0)
        self.received = dict.fromkeys(self.peers, 0)
        self.seen = np.zeros((rt.size, self.total), dtype=np.uint16)  # [source, seq]: times seen
        self.corrupt = 0
        for p in self.peers:
            for _ in range(RQ_DEPTH):
                self._post_recv(p)
        self.outcome = ""
        self.i = 0

    @held
    @pausable
    def step(self, rt: ckpt.Runtime) -> bool:
        for p in self.peers:
            for _ in range(self.per_step):
                self._send(rt.rank, p)
        last = self.i == self.steps - 1
        need = self.total if last else (self.i + 1 - LAG) * self.per_step
        deadline = Deadline(f"step {self.i}: {need} messages from each peer")
        while True:
            wcs = poll(self.cq, 32)
            for wc in wcs:
                self._record(rt.rank, wc)
            if wcs:
                deadline.progress()
            elif all(self.received[p] >= need for p in self.peers):
                break
            deadline.check()
        self.i += 1
        if not last:
            return True
        rt.barrier()  # every rank has all it expected: anything still arriving would be a duplicate
        for wc in poll(self.cq, 2048):
            self._record(rt.rank, wc)
        counts = []
        for p in self.peers:
            seen = self.seen[p].astype(np.int64)
            counts.append((int(seen.sum()), int(np.maximum(seen - 1, 0).sum()), int((seen == 0).sum())))
        self.outcome = f"{counts} corrupt={self.corrupt}"
        return False

    def _send(self, me: int, peer: int) -> None:
        seq = self.sent[peer]
        slot = seq % SLOTS
        self.send_buf[peer, slot] = (me, seq, check_of(me, seq, peer))
        offset = (peer * SLOTS + slot) * FIELDS * 8
        signaled = seq % SIGNAL_EVERY == SIGNAL_EVERY - 1
        wr = verbs.SendWR(
            wr_id=seq,
            opcode=verbs.IBV_WR_SEND if seq % 2 == 0 else verbs.IBV_WR_RDMA_WRITE_WITH_IMM,
            num_sge=1,
            sg=[verbs.SGE(self.send_mr.buf + offset, FIELDS * 8, self.send_mr.lkey)],
            imm_data=seq,
            send_flags=verbs.IBV_SEND_SIGNALED if signaled else 0,
        )
        if seq % 2:
            rkey, addr = self.remote_landing[peer]
            wr.set_wr_rdma(rkey, addr + (me * SLOTS + slot) * FIELDS * 8)
        self.qps[peer].post_send(wr)
        self.sent[peer] = seq + 1

    def _post_recv(self, peer: int) -> None:
        slot = self.posted[peer] % RQ_DEPTH
        sge = verbs.SGE(self.recv_mr.buf + (peer * RQ_DEPTH + slot) * FIELDS * 8, FIELDS * 8, self.recv_mr.lkey)
        self.qps[peer].post_recv(verbs.RecvWR(wr_id=peer * RQ_DEPTH + slot, num_sge=1, sg=[sge]))
        self.posted[peer] += 1

    def _record(self, me: int, wc: verbs.WC) -> None:
        if wc.opcode == verbs.IBV_WC_RECV:
            peer, slot = divmod(wc.wr_id, RQ_DEPTH)
            source, seq, check = (int(v) for v in self.recv_buf[peer, slot])
        elif wc.opcode == verbs.IBV_WC_RECV_RDMA_WITH_IMM:
            peer = wc.wr_id // RQ_DEPTH
            source, seq, check = (int(v) for v in self.landing[peer, wc.imm_data % SLOTS])
            if seq != wc.imm_data:
                self.corrupt += 1
        else:
            return  # a signaled send's completion
        self.received[peer] += 1
        self._post_recv(peer)
        if source != peer or check != check_of(source, seq, me) or not 0 <= seq < self.total:
            self.corrupt += 1
            return
        self.seen[source, seq] += 1

    def result(self) -> str:
        return self.outcome
