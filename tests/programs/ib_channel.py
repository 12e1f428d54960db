"""A SEND/RECV ring whose receives are waited for on a completion channel (blocking get_cq_event).

    ckpt launch -n 4 tests/programs/ib_channel.py [STEPS]

Each step a rank SENDs its running value to its right neighbour and waits for
its left neighbour's on a receive CQ bound to a CompChannel: poll; if empty,
req_notify, poll again (a completion may have come before the arming), and only
then block in get_cq_event.  Events are acknowledged in batches of ACK_EVERY,
so unacknowledged events and armed notifications are part of the state at many
step boundaries.  Values mix as in examples/ring.py, so the result is the ring's.
"""

from __future__ import annotations

import numpy as np
from ib_common import WAIT_LIMIT, Deadline, connect_links, held, pausable, poll

import ckpt
from ckpt import verbs

DEPTH = 16  # pre-posted receives (and receive slots)
SIGNAL_EVERY = 16
ACK_EVERY = 8


class ChannelRing(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 500
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.channel = verbs.CompChannel(self.ctx)
        self.send_cq = verbs.CQ(self.ctx, 128)
        self.recv_cq = verbs.CQ(self.ctx, 128, channel=self.channel)
        self.send_buf = np.zeros(DEPTH, dtype=np.int64)
        self.recv_buf = np.zeros(DEPTH, dtype=np.int64)
        self.send_mr = verbs.MR(self.pd, self.send_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = verbs.MR(self.pd, self.recv_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        right, left = (rt.rank + 1) % rt.size, (rt.rank - 1) % rt.size
        qps, _ = connect_links(
            rt, self.ctx, self.pd, self.send_cq, {(right, "ring"), (left, "ring")}, recv_cq=self.recv_cq
        )
        self.to_right, self.from_left = qps[(right, "ring")], qps[(left, "ring")]
        self.posted = 0
        for _ in range(DEPTH):
            self._post_recv()
        self.received = 0
        self.unacked = 0
        self.events = 0
        self.value = rt.rank + 1
        self.i = 0

    @held
    @pausable
    def step(self, rt: ckpt.Runtime) -> bool:
        slot = self.i % DEPTH
        self.send_buf[slot] = self.value
        signaled = self.i % SIGNAL_EVERY == SIGNAL_EVERY - 1
        wr = verbs.SendWR(
            wr_id=self.i,
            opcode=verbs.IBV_WR_SEND,
            num_sge=1,
            sg=[verbs.SGE(self.send_mr.buf + slot * 8, 8, self.send_mr.lkey)],
            send_flags=verbs.IBV_SEND_SIGNALED if signaled else 0,
        )
        self.to_right.post_send(wr)
        poll(self.send_cq)
        received = self._receive()
        self.value = (self.value * 31 + received + self.i) % 1_000_003
        self.i += 1
        if self.i < self.steps:
            return True
        self.recv_cq.ack_events(self.unacked)
        self.unacked = 0
        return False

    def _receive(self) -> int:
        deadline = Deadline(f"step {self.i}'s value from the left")
        while True:
            wcs = poll(self.recv_cq, 1)
            if not wcs:
                self.recv_cq.req_notify()
                wcs = poll(self.recv_cq, 1)
            if not wcs:
                self.channel.get_cq_event(self.recv_cq, timeout=WAIT_LIMIT)
                self.events += 1
                self.unacked += 1
                if self.unacked >= ACK_EVERY:
                    self.recv_cq.ack_events(self.unacked)
                    self.unacked = 0
                deadline.check()
                continue
            (wc,) = wcs
            if wc.wr_id != self.received or wc.opcode != verbs.IBV_WC_RECV:
                raise RuntimeError(f"receive {wc.wr_id} came as number {self.received}")
            value = int(self.recv_buf[self.received % DEPTH])
            self.received += 1
            self._post_recv()
            return value

    def _post_recv(self) -> None:
        slot = self.posted % DEPTH
        sge = verbs.SGE(self.recv_mr.buf + slot * 8, 8, self.recv_mr.lkey)
        self.from_left.post_recv(verbs.RecvWR(wr_id=self.posted, num_sge=1, sg=[sge]))
        self.posted += 1

    def result(self) -> int:
        return self.value
