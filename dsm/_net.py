"""The DSM's verbs: message endpoints over RC queue pairs, and one-sided operations on peers' memory.

Every rank has two endpoints, each with one RC QP towards every rank (itself
included, through a loopback QP, so a request to oneself takes the same path
as any other):

* the *client* endpoint, used only by the program thread: requests out, replies
  in, and the one-sided RDMA READ / WRITE / atomics of the ``onesided`` protocol;
* the *server* endpoint, used only by the protocol-handler thread: requests in,
  replies out.

Client QP (i -> j) is connected to server QP (j <- i).  A message (one of
`dsm._messages`, decoded by its receiver) is a msgpack array, cut into
fragments of at most one slot (a flag byte says whether more follow); RC
delivers fragments in order, so reassembly needs no sequence numbers.  Every
SEND is signaled, and its completion frees its slot.  Receive slots are
re-posted as soon as their data is copied out; a sender that outruns them gets
RNR NAKs and retries forever (rnr_retry 7), so flow control needs no
credits.  Waiting arms the CQ and blocks on its completion channel after a
short spin, so idle ranks leave the CPU to the ones that work.

All state is verbs objects and numpy buffers, so an endpoint is pickled with
the program and comes back under the verbs virtualization plugin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ckpt import verbs

from ._errors import DsmError
from ._messages import Message

REMOTE = verbs.IBV_ACCESS_REMOTE_READ | verbs.IBV_ACCESS_REMOTE_WRITE | verbs.IBV_ACCESS_REMOTE_ATOMIC
ACCESS = verbs.IBV_ACCESS_LOCAL_WRITE | REMOTE
RECV, SEND, RDMA = 1 << 40, 2 << 40, 3 << 40
KIND_MASK = 3 << 40
MORE, LAST = 1, 0
SPIN = 64  # empty polls before blocking on the channel
WAKE = 0.05  # seconds a blocked wait sleeps on the channel before it looks at its deadline / stop flag
MAX_SEND_WR = 512
RDMA_CHUNK = 128  # one-sided WRs posted before waiting for the chunk's (signaled) last one


def pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def unpack(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Endpoint:
    """A CQ (with a completion channel), one RC QP per rank, and registered send / receive slots."""

    def __init__(self, ctx: verbs.Context, pd: verbs.PD, size: int, slot: int, nrecv: int, nsend: int) -> None:
        self.size, self.slot, self.nrecv, self.nsend = size, slot, nrecv, nsend
        self.channel = verbs.CompChannel(ctx)
        self.cq = verbs.CQ(ctx, size * (nrecv + nsend) + MAX_SEND_WR * size, None, self.channel, 0)
        cap = verbs.QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=nrecv, max_send_sge=1, max_recv_sge=1)
        init = verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qps = [verbs.QP(pd, init) for _ in range(size)]
        self.buf = np.zeros(size * (nrecv + nsend) * slot, dtype=np.uint8)
        self.mr = verbs.MR(pd, self.buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.free = [list(range(nsend)) for _ in range(size)]
        self.partial: list[list[bytes]] = [[] for _ in range(size)]
        self.inbox: list[tuple[int, Any, int]] = []  # (peer, message, bytes) complete, not yet taken
        self.rdma_done: set[int] = set()
        self.armed = False

    # ------------------------------------------------------------ set-up
    def address(self) -> list[int]:
        return [qp.qp_num for qp in self.qps]

    def connect(self, peers: list[dict[str, Any]], me: int, side: str) -> None:
        """Connect QP j to rank j's QP towards `me` on the other `side` ("client" or "server"); post receives."""
        for j, qp in enumerate(self.qps):
            verbs.connect_rc(qp, peers[j]["lid"], peers[j][side][me], REMOTE, rd_atomic=16)
            for s in range(self.nrecv):
                self._post_recv(j, s)

    def _offset(self, peer: int, slot: int, sending: bool) -> int:
        return ((peer * (self.nrecv + self.nsend)) + (self.nrecv + slot if sending else slot)) * self.slot

    def _post_recv(self, peer: int, slot: int) -> None:
        sge = verbs.SGE(self.mr.buf + self._offset(peer, slot, False), self.slot, self.mr.lkey)
        self.qps[peer].post_recv(verbs.RecvWR(wr_id=RECV | peer << 20 | slot, num_sge=1, sg=[sge]))

    # ------------------------------------------------------------ messages
    def send(self, peer: int, msg: Message) -> int:
        """Queue `msg` to `peer`; returns its size in bytes (completions are reaped by `poll`)."""
        data = pack(msg)
        room = self.slot - 1
        for start in range(0, max(len(data), 1), room):
            chunk = data[start : start + room]
            flag = MORE if start + room < len(data) else LAST
            while not self.free[peer]:
                self.wait(lambda: bool(self.free[peer]), f"a send slot towards rank {peer}")
            slot = self.free[peer].pop()
            offset = self._offset(peer, slot, True)
            self.buf[offset] = flag
            self.buf[offset + 1 : offset + 1 + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            sge = verbs.SGE(self.mr.buf + offset, len(chunk) + 1, self.mr.lkey)
            wr = verbs.SendWR(wr_id=SEND | peer << 20 | slot, opcode=verbs.IBV_WR_SEND, num_sge=1, sg=[sge])
            self.qps[peer].post_send(wr)
        return len(data)

    def poll(self) -> bool:
        """Reap completions: free send slots, move complete messages to `inbox`; True if any completion came."""
        n, wcs = self.cq.poll(32)
        for wc in wcs:
            if wc.status != verbs.IBV_WC_SUCCESS:
                status = verbs.ibv_wc_status(wc.status).name
                raise DsmError(f"DSM work request {wc.wr_id:#x} failed: {status} (a peer died or a key is wrong)")
            kind, peer, slot = wc.wr_id & KIND_MASK, (wc.wr_id >> 20) & 0xFFFFF, wc.wr_id & 0xFFFFF
            if kind == SEND:
                self.free[peer].append(slot)
            elif kind == RECV:
                offset = self._offset(peer, slot, False)
                flag, chunk = int(self.buf[offset]), self.buf[offset + 1 : offset + wc.byte_len].tobytes()
                self._post_recv(peer, slot)
                self.partial[peer].append(chunk)
                if flag == LAST:
                    data = b"".join(self.partial[peer])
                    self.partial[peer].clear()
                    self.inbox.append((peer, unpack(data), len(data)))
            else:
                self.rdma_done.add(wc.wr_id)
        return n > 0

    def wait(
        self, done: Callable[[], bool], what: str, timeout: float = 120.0, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Poll until `done()`; after a short spin, sleep on the completion channel.

        Returns False if `stop()` became true first; raises DsmError after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        idle = 0
        while not done():
            if stop is not None and stop():
                return False
            if self.poll():
                idle = 0
                continue
            idle += 1
            if idle < SPIN:
                continue
            if not self.armed:
                self.cq.req_notify()
                self.armed = True
                continue  # a completion may have come between the poll and the arming
            try:
                self.channel.get_cq_event(self.cq, WAKE)
                self.cq.ack_events(1)
                self.armed = False
            except verbs.PyverbsRDMAError:
                if time.monotonic() > deadline:
                    raise DsmError(f"DSM: no progress for {timeout:.0f} s waiting for {what}") from None
        return True

    # ------------------------------------------------------------ one-sided
    def run(self, peer: int, wrs: list[verbs.SendWR], seq: list[int]) -> None:
        """Post one-sided `wrs` to `peer` in chunks, each chunk's last WR signaled, and wait for all of them."""
        for start in range(0, len(wrs), RDMA_CHUNK):
            chunk = wrs[start : start + RDMA_CHUNK]
            for wr in chunk[:-1]:
                wr.send_flags = 0
                wr.wr_id = RDMA
                self.qps[peer].post_send(wr)
            seq[0] += 1
            last = chunk[-1]
            last.send_flags, last.wr_id = verbs.IBV_SEND_SIGNALED, RDMA | (seq[0] & 0xFFFFFFFFFF)
            self.qps[peer].post_send(last)
            self._wait_rdma(last.wr_id, peer)

    def _wait_rdma(self, wr_id: int, peer: int) -> None:
        self.wait(lambda: wr_id in self.rdma_done, f"one-sided operations on rank {peer}")
        self.rdma_done.discard(wr_id)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["armed"] = False  # a restarted CQ is not armed; at a checkpoint a re-arm is harmless
        return state


def rdma(opcode: int, local: tuple[int, int, int], rkey: int, addr: int) -> verbs.SendWR:
    """A READ / WRITE of `local` = (address, length, lkey) at the peer's (rkey, addr)."""
    wr = verbs.SendWR(opcode=opcode, num_sge=1, sg=[verbs.SGE(*local)])
    wr.set_wr_rdma(rkey, addr)
    return wr


def atomic(opcode: int, local: tuple[int, int], rkey: int, addr: int, compare_add: int, swap: int = 0) -> verbs.SendWR:
    """CMP_AND_SWP / FETCH_AND_ADD at the peer's (rkey, addr); the old value lands at `local` = (address, lkey)."""
    wr = verbs.SendWR(opcode=opcode, num_sge=1, sg=[verbs.SGE(local[0], 8, local[1])])
    wr.set_wr_atomic(rkey, addr, compare_add, swap)
    return wr
