"""SEND/RECV ping-pong between rank pairs (0<->1, 2<->3, ...) over RC QPs with pre-posted receives.

    ckpt launch -n 4 tests/programs/ib_pingpong.py [STEPS] [ROUNDS] [late]

The even rank of a pair pings, the odd rank pongs back a transform of what it
got; each rank keeps a running checksum of the payloads it received, which is
its result.  The number of ranks must be even.

With `late`, the pinger sends a step's pings without waiting, and the ponger
answers them only in its next step, posting each receive late (after a short
wait, one at a time): at every step boundary the step's pings sit on the
pinger's send queue in RNR retry.  The payloads, and so the result, are the
same as without `late`; the job runs one step more.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
from ib_common import Deadline, connect_links, held, pausable, poll

import ckpt
from ckpt import verbs

SIZE = 128  # payload bytes
DEPTH = 32  # pre-posted receives (and receive slots)
SIGNAL_EVERY = 8
LATE_WAIT = 0.002  # seconds the late ponger waits before posting each receive
MODULUS = (1 << 61) - 1


def ping_payload(pair: int, message: int) -> np.ndarray:
    return ((np.arange(SIZE, dtype=np.int64) * (3 + 2 * pair) + message) % 256).astype(np.uint8)


def pong_payload(ping: np.ndarray, ponger: int) -> np.ndarray:
    return ((ping.astype(np.int64) * 7 + 1 + ponger) % 256).astype(np.uint8)


def mix(checksum: int, payload: bytes) -> int:
    return (checksum * 1_000_003 + zlib.crc32(payload)) % MODULUS


class PingPong(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 300
        self.rounds = int(rt.argv[1]) if len(rt.argv) > 1 else 8
        self.late = "late" in rt.argv[2:]
        if rt.size % 2:
            raise ValueError(f"ib_pingpong pairs ranks: run it with an even number of ranks, not {rt.size}")
        partner = rt.rank ^ 1
        self.pinger = rt.rank % 2 == 0
        self.pair = rt.rank // 2
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.cq = verbs.CQ(self.ctx, 512)
        self.recv_buf = np.zeros((DEPTH, SIZE), dtype=np.uint8)
        self.send_buf = np.zeros((DEPTH, SIZE), dtype=np.uint8)
        self.recv_mr = verbs.MR(self.pd, self.recv_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.send_mr = verbs.MR(self.pd, self.send_buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        qps, _ = connect_links(rt, self.ctx, self.pd, self.cq, [(partner, "pingpong")], send_wr=DEPTH, recv_wr=DEPTH)
        self.qp = qps[(partner, "pingpong")]
        self.posted = 0  # receives posted so far (receive n lands in slot n % DEPTH)
        self.received = 0
        self.sent = 0
        self.prepost = self.pinger or not self.late  # the late ponger posts each receive just before it needs it
        if self.prepost:
            for _ in range(DEPTH):
                self._post_recv()
        self.checksum = 0
        self.i = 0

    @held
    @pausable
    def step(self, rt: ckpt.Runtime) -> bool:
        if not self.late:
            for _ in range(self.rounds):
                if self.pinger:
                    self._send(ping_payload(self.pair, self.sent))
                    self._take()
                else:
                    ping = self._take()
                    self._send(pong_payload(ping, rt.rank))
        elif self.pinger:
            if self.i < self.steps:
                for _ in range(self.rounds):
                    self._send(ping_payload(self.pair, self.sent))
            if self.i > 0:
                for _ in range(self.rounds):
                    self._take()
        elif self.i > 0:
            for _ in range(self.rounds):
                time.sleep(LATE_WAIT)  # the receive is posted late on purpose: the ping waits in RNR retry
                self._post_recv()
                ping = self._take()
                self._send(pong_payload(ping, rt.rank))
        self.i += 1
        return self.i < self.steps + (1 if self.late else 0)

    def _post_recv(self) -> None:
        slot = self.posted % DEPTH
        sge = verbs.SGE(self.recv_mr.buf + slot * SIZE, SIZE, self.recv_mr.lkey)
        self.qp.post_recv(verbs.RecvWR(wr_id=self.posted, num_sge=1, sg=[sge]))
        self.posted += 1

    def _send(self, payload: np.ndarray) -> None:
        slot = self.sent % DEPTH
        self.send_buf[slot] = payload
        sge = verbs.SGE(self.send_mr.buf + slot * SIZE, SIZE, self.send_mr.lkey)
        signaled = self.sent % SIGNAL_EVERY == SIGNAL_EVERY - 1
        wr = verbs.SendWR(
            wr_id=self.sent,
            opcode=verbs.IBV_WR_SEND,
            num_sge=1,
            sg=[sge],
            send_flags=verbs.IBV_SEND_SIGNALED if signaled else 0,
        )
        self.qp.post_send(wr)
        self.sent += 1

    def _take(self) -> np.ndarray:
        """Wait for the next receive; checksum it, re-post a receive (unless late) and return its payload."""
        deadline = Deadline(f"message {self.received}")
        while True:
            for wc in poll(self.cq, 1):
                if wc.opcode != verbs.IBV_WC_RECV:
                    continue  # a signaled send's completion
                if wc.wr_id != self.received or wc.byte_len != SIZE:
                    raise RuntimeError(f"receive {wc.wr_id} ({wc.byte_len} bytes) came as number {self.received}")
                payload = self.recv_buf[self.received % DEPTH].copy()
                self.checksum = mix(self.checksum, payload.tobytes())
                self.received += 1
                if self.prepost:
                    self._post_recv()
                return payload
            deadline.check()

    def result(self) -> int:
        return self.checksum
