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

Connections are owned here (FT-KDSM, remote-logging-hlrc-dsm-via.txt §5: a
failed rank is respawned while the others run on).  Each peer's link is in one
of three states:

* ``UP``: messages and one-sided operations flow;
* ``FAILED``: the peer died.  Its QP gave an error completion (RETRY_EXC_ERR,
  then flushes: what hardware reports for a dead peer) or the runtime said so
  (``ckpt_rank_failed``).  Nothing is posted to it: a message to it is dropped
  (the caller learns it from `send`'s None: a request is re-sent later, a
  reply owed to the dead incarnation is lost with it), one-sided operations
  wait;
* ``JOINING``: a fresh QP (made through the ordinary verbs API, so ckpt_ib
  virtualizes it like any QP made after start) replaced the dead one and is
  connected to the peer's new incarnation, whose end may not be ready yet.
  The first message that arrives on it proves it is (the peer sends nothing
  before its end is connected), and so does the peer's ``ready`` key in the
  KV (`dsm._reconnect`); either moves the link to ``UP``.

Every replacement bumps the peer's *link number*.  A message is stamped with
the link it arrived on, so a request of a dead incarnation still in the inbox
is told apart from its successor's; a one-sided operation whose link changed
under it is issued again, whole, on the new link.

Threads and the invariant.  The owner thread of an endpoint (program or
handler) posts and polls; the runtime thread that runs ``ckpt_rank_failed`` /
``ckpt_rank_recovered`` replaces QPs.  ``Endpoint.lock`` guards a peer's QP,
send slots, partial fragments, link number and state: whoever posts to,
reaps from or replaces a peer's QP holds it, and never blocks while holding it
(waiting on the completion channel happens outside).  So a post never reaches
a QP that is being destroyed, a completion of a retired QP (recognised by its
qp_num: it is no longer in `live`) is dropped instead of being taken for the
new one's, and a message is never split across two QPs: fragments are posted
only while the link number the message started on is current.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from ckpt import verbs

from ._errors import DsmError
from ._messages import Message
from ._waits import STUCK_AFTER

log = logging.getLogger("dsm")

REMOTE = verbs.IBV_ACCESS_REMOTE_READ | verbs.IBV_ACCESS_REMOTE_WRITE | verbs.IBV_ACCESS_REMOTE_ATOMIC
ACCESS = verbs.IBV_ACCESS_LOCAL_WRITE | REMOTE
RECV, SEND, RDMA = 1 << 40, 2 << 40, 3 << 40
KIND_MASK = 3 << 40
MORE, LAST = 1, 0
SPIN = 64  # empty polls before blocking on the channel
POLL_BATCH = 32  # completions one poll takes at most
WAKE = 0.05  # seconds a blocked wait sleeps on the channel before it looks at its deadline / stop flag
MAX_SEND_WR = 512
RDMA_CHUNK = 128  # one-sided WRs posted before waiting for the chunk's (signaled) last one
UP, FAILED, JOINING = "up", "failed", "joining"
#: How long a peer may stay failed before a rank waiting on anything gives up (respawning a rank and
#: loading its image takes seconds; under --on-failure abort the job is ended long before).
RECOVERY_TIMEOUT = 300.0
#: Completion statuses that mean the peer is gone (its HCA stopped answering, or our QP was flushed
#: after that): the link fails and waits for the peer's next incarnation.  Any other error is a bug
#: (a wrong key, a bad address) and raises.
PEER_GONE = frozenset({int(verbs.IBV_WC_RETRY_EXC_ERR), int(verbs.IBV_WC_WR_FLUSH_ERR)})
#: One-sided work requests, or a function that builds them (called again for every issue).
WorkRequests = Sequence[verbs.SendWR] | Callable[[], Sequence[verbs.SendWR]]


def pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def unpack(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Endpoint:
    """A CQ (with a completion channel), one RC QP per rank, and registered send / receive slots."""

    # per-process parts, made by _transient() (at creation and after unpickling), never pickled
    lock: threading.Lock
    state: list[str]
    failed_at: dict[int, float]
    live: dict[int, int]
    #: Set by the owner for a wait that lasts (`dsm._waits`): called with (what, seconds so far) once the wait has
    #: lasted STUCK_AFTER seconds; the function it returns is called when the wait ends.  None: not reported.
    on_stuck: Callable[[str, float], Callable[[], None]] | None
    #: RDMA WRITEs WITH IMM received (a class default: images from before it unpickle without it).
    notifications = 0

    def __init__(self, ctx: verbs.Context, pd: verbs.PD, size: int, slot: int, nrecv: int, nsend: int) -> None:
        self.size, self.slot, self.nrecv, self.nsend = size, slot, nrecv, nsend
        self.pd = pd
        self.channel = verbs.CompChannel(ctx)
        self.cq = verbs.CQ(ctx, size * (nrecv + nsend) + MAX_SEND_WR * size, None, self.channel, 0)
        self.qps = [self.new_qp() for _ in range(size)]
        self.buf = np.zeros(size * (nrecv + nsend) * slot, dtype=np.uint8)
        self.mr = verbs.MR(pd, self.buf, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.free = [list(range(nsend)) for _ in range(size)]
        self.partial: list[list[bytes]] = [[] for _ in range(size)]
        self.inbox: list[tuple[int, Any, int, int]] = []  # (peer, message, bytes, link) complete, not yet taken
        self.rdma_done: set[int] = set()
        self.armed = False
        self.link = [0] * size  # per peer: how many times its QP was replaced
        self.reconnections = 0  # all peers together: a cheap "did any link change" for the owner thread
        self._transient()

    def _transient(self) -> None:
        self.lock = threading.Lock()
        self.state = [UP] * self.size
        self.failed_at = {}
        self.live = {qp.qp_num: j for j, qp in enumerate(self.qps)}  # qp_num -> peer, current QPs only
        self.on_stuck = None

    def new_qp(self) -> verbs.QP:
        """A QP of this endpoint in RESET (a peer's first one, or a replacement after the peer failed)."""
        cap = verbs.QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=self.nrecv, max_send_sge=1, max_recv_sge=1)
        init = verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        return verbs.QP(self.pd, init)

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

    # ------------------------------------------------------------ peers failing and coming back
    def fail(self, peer: int, why: str) -> None:
        """The peer died: stop posting to it (its messages are dropped, one-sided operations wait)."""
        with self.lock:
            self._fail(peer, why)

    def _fail(self, peer: int, why: str) -> None:
        if self.state[peer] != FAILED:
            log.info("DSM: the link to rank %d failed (%s); waiting for its next incarnation", peer, why)
            self.state[peer] = FAILED
            self.failed_at[peer] = time.monotonic()

    def attach(self, peer: int, qp: verbs.QP, lid: int, qpn: int) -> None:
        """Replace the peer's QP by `qp` (fresh, from `new_qp`), connected to (lid, qpn); the link is JOINING.

        The old QP is destroyed, its send slots and partial fragments forgotten, and receives
        are posted on the new one before it can be used: nothing of the old link leaks into the new.
        """
        verbs.connect_rc(qp, lid, qpn, REMOTE, rd_atomic=16)
        with self.lock:
            old = self.qps[peer]
            self.live.pop(old.qp_num, None)  # its completions still in the CQ are dropped from now on
            old.close()
            self.qps[peer] = qp
            self.live[qp.qp_num] = peer
            self.free[peer] = list(range(self.nsend))
            self.partial[peer] = []
            for s in range(self.nrecv):
                self._post_recv(peer, s)
            self.link[peer] += 1
            self.reconnections += 1
            self.state[peer] = JOINING
            self.failed_at.setdefault(peer, time.monotonic())

    def up(self, peer: int) -> None:
        """The peer's end of the new link is ready (its ``ready`` key): messages flow again."""
        with self.lock:
            self._up(peer)

    def _up(self, peer: int) -> None:
        if self.state[peer] == JOINING:
            self.state[peer] = UP
            self.failed_at.pop(peer, None)
            self.reconnections += 1  # the owner thread re-sends what waited for this link

    def forget_everything(self) -> None:
        """A restored image in a process that replaced a failed rank: every link will be rebuilt.

        Messages received in the previous life are forgotten (the peers re-send their requests;
        no request of this rank was in flight at a step boundary); every link is FAILED until
        its replacement is attached.
        """
        with self.lock:
            self.inbox.clear()
            self.rdma_done.clear()
            now = time.monotonic()
            for peer in range(self.size):
                self.state[peer] = FAILED
                self.failed_at[peer] = now

    # ------------------------------------------------------------ messages
    def send(self, peer: int, msg: Message) -> int | None:
        """Queue `msg` to `peer`; its size in bytes, or None when the link is not up (the message is dropped).

        Completions are reaped by `poll`.  A message the link fails under is dropped as a whole
        (its fragments go to one QP or none of them to the next).
        """
        data = pack(msg)
        room = self.slot - 1
        link = self.link[peer]
        for start in range(0, max(len(data), 1), room):
            chunk = data[start : start + room]
            flag = MORE if start + room < len(data) else LAST
            while True:
                with self.lock:
                    if self.state[peer] != UP or self.link[peer] != link:
                        return None
                    if self.free[peer]:
                        slot = self.free[peer].pop()
                        offset = self._offset(peer, slot, True)
                        self.buf[offset] = flag
                        self.buf[offset + 1 : offset + 1 + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                        sge = verbs.SGE(self.mr.buf + offset, len(chunk) + 1, self.mr.lkey)
                        wr = verbs.SendWR(wr_id=SEND | peer << 20 | slot, opcode=verbs.IBV_WR_SEND, num_sge=1, sg=[sge])
                        self.qps[peer].post_send(wr)
                        break

                def room_or_down() -> bool:
                    return bool(self.free[peer]) or self.state[peer] != UP or self.link[peer] != link

                self.wait(room_or_down, f"a send slot towards rank {peer}")
        return len(data)

    def poll(self) -> bool:
        """Reap completions: free send slots, move complete messages to `inbox`; True if any completion came.

        An error completion of a peer's current QP fails that link (or raises, for an error that
        is not a dead peer's); completions of QPs retired since are dropped.
        """
        return self._poll() > 0

    def _poll(self) -> int:
        """`poll`'s work: how many completions one poll of at most POLL_BATCH took."""
        with self.lock:
            n, wcs = self.cq.poll(POLL_BATCH)
            for wc in wcs:
                peer = self.live.get(wc.qp_num)
                if peer is None:
                    continue  # a QP replaced after its peer failed: flushes, or a reply of the dead incarnation
                kind, slot = wc.wr_id & KIND_MASK, wc.wr_id & 0xFFFFF
                if wc.status != verbs.IBV_WC_SUCCESS:
                    status = verbs.ibv_wc_status(wc.status).name
                    if wc.status not in PEER_GONE:
                        raise DsmError(f"DSM work request {wc.wr_id:#x} to rank {peer} failed: {status} (a wrong key?)")
                    self._fail(peer, status)
                    if kind == SEND:
                        self.free[peer].append(slot)
                    continue
                if kind == SEND:
                    self.free[peer].append(slot)
                elif kind == RECV and wc.opcode == verbs.IBV_WC_RECV_RDMA_WITH_IMM:
                    # a peer's RDMA WRITE WITH IMM (`dsm._cashmere`): its data is in place; the completion only
                    # wakes a wait on this endpoint, whose `done()` looks at that memory
                    self._post_recv(peer, slot)
                    self.notifications += 1
                elif kind == RECV:
                    offset = self._offset(peer, slot, False)
                    flag, chunk = int(self.buf[offset]), self.buf[offset + 1 : offset + wc.byte_len].tobytes()
                    self._post_recv(peer, slot)
                    if self.state[peer] == FAILED:
                        # sent by the incarnation declared lost (its QP stays live until `attach`; a rank
                        # lost for heartbeat silence may even still run): nothing it asks is answered
                        self.partial[peer].clear()
                        continue
                    self._up(peer)  # a message on a JOINING link: the peer's end is ready
                    self.partial[peer].append(chunk)
                    if flag == LAST:
                        data = b"".join(self.partial[peer])
                        self.partial[peer].clear()
                        self.inbox.append((peer, unpack(data), len(data), self.link[peer]))
                else:
                    self.rdma_done.add(wc.wr_id)
        return n

    def take_signalled(self) -> None:
        """Take what completed since the last look, without paying for an empty poll when nothing did.

        A simulated CQ's empty poll waits up to ``CKPT_SIMIB_POLL_WAIT`` (0.5 ms) for a completion
        (docs/verbs.md): right for a thread that waits, a tax on one that only tidies up, as Cashmere
        does at every lock operation (`dsm._mcs.Control.reap`).  So the CQ is left armed between
        looks, and its channel says whether anything completed since: only then is the CQ polled,
        batch by batch until one comes back short.  A CQ not armed (the first look, or after `wait`
        took its event) is armed and then polled once, the usual arm-then-poll order that misses
        nothing.
        """
        if self.armed and not self._event(0):
            return  # nothing completed since the CQ was armed
        self._arm_and_take()

    def _event(self, timeout: float) -> bool:
        """Take the channel's event (waiting up to `timeout` s for one): the armed CQ got a completion since."""
        try:
            self.channel.get_cq_event(self.cq, timeout)
        except verbs.PyverbsRDMAError:
            return False
        self.cq.ack_events(1)
        self.armed = False
        return True

    def _arm_and_take(self) -> None:
        """Arm the CQ, then poll it until a batch comes back short: a completion that came before the arming fired
        no event, and only this poll takes it."""
        self.cq.req_notify()
        self.armed = True
        while self._poll() == POLL_BATCH:
            pass

    def wait(
        self,
        done: Callable[[], bool],
        what: str,
        timeout: float = 120.0,
        stop: Callable[[], bool] | None = None,
        recovery_bound: bool = True,
        on_idle: Callable[[], None] | None = None,
    ) -> bool:
        """Poll until `done()`; after a short spin, sleep on the completion channel.

        Returns False if `stop()` became true first; raises DsmError after `timeout` seconds
        (not counting time while a peer is failed and may come back: that is bounded by
        RECOVERY_TIMEOUT since its failure, unless `recovery_bound` is False -- the handler's
        idle wait, which waits on no peer in particular and must outlive any recovery).  `on_idle()`
        is called each time a sleep of WAKE seconds ends with nothing arrived.  A wait that lasts STUCK_AFTER
        seconds is reported through `on_stuck` until it ends.
        """
        started = time.monotonic()
        deadline = started + timeout
        idle = 0
        reported: Callable[[], None] | None = None
        try:
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
                    # if the completion that makes done() true came before the arming, take_signalled (which
                    # polls only after events) would never take it: it is polled here
                    self._arm_and_take()
                    continue
                if not self._event(WAKE):
                    if on_idle is not None:
                        on_idle()
                    if reported is None:
                        reported = self.report_stuck(what, started)
                    now = time.monotonic()
                    if self.failed_at and recovery_bound:
                        self._check_recovery(now, what)
                        deadline = max(deadline, now + timeout)
                    if now > deadline:
                        raise DsmError(f"DSM: no progress for {timeout:.0f} s waiting for {what}")
            return True
        finally:
            if reported is not None:
                reported()

    def report_stuck(self, what: str, started: float) -> Callable[[], None] | None:
        """Report a wait for `what` that began at `started` (`time.monotonic()`) once it has lasted STUCK_AFTER:
        the function that ends the report, else None (too early, no `on_stuck`, or the report itself failed --
        never the wait: it is asked again at the next idle moment)."""
        waited = time.monotonic() - started
        if self.on_stuck is None or waited < STUCK_AFTER:
            return None
        try:
            return self.on_stuck(what, waited)
        except Exception as exc:  # e.g. no thread can be started to publish it
            log.debug("dsm: the wait for %s was not reported: %s", what, exc)
            return None

    def _check_recovery(self, now: float, what: str) -> None:
        for peer, since in list(self.failed_at.items()):
            if now - since > RECOVERY_TIMEOUT:
                raise DsmError(
                    f"DSM: rank {peer} failed {now - since:.0f} s ago and has not come back (waiting for {what})"
                )

    # ------------------------------------------------------------ one-sided
    def run(self, peer: int, wrs: WorkRequests, seq: list[int]) -> None:
        """Post one-sided `wrs` to `peer` in chunks, each chunk's last WR signaled, and wait for all of them.

        While the link is not up the operation waits; if the link is replaced under it (the peer
        failed and its next incarnation is connected) the whole operation is issued again on the
        new link.  `wrs` may be a function that builds them, called for every issue, so the
        peer's re-exchanged addresses are used (a list is re-posted as it is: its rkeys are
        virtual under ckpt_ib, the same for the peer's next incarnation).
        """
        while True:
            self.wait(lambda: self.state[peer] == UP, f"rank {peer} to come back")
            link = self.link[peer]
            if self._issue(peer, list(wrs() if callable(wrs) else wrs), seq, link):
                return

    def post(self, peer: int, wrs: Sequence[verbs.SendWR], seq: list[int]) -> int:
        """Post one-sided `wrs` (at most MAX_SEND_WR) to `peer` as one chain, the last signaled, and return at once:
        the wr_id `rdma_done` holds once they all completed.  For a protocol without recovery (the link must be up)."""
        seq[0] += 1
        wr_id = RDMA | (seq[0] & 0xFFFFFFFFFF)
        with self.lock:
            if self.state[peer] != UP:
                raise DsmError(f"DSM: the link to rank {peer} is {self.state[peer]}")
            for wr in wrs[:-1]:
                wr.send_flags = 0
                wr.wr_id = RDMA
            wrs[-1].send_flags, wrs[-1].wr_id = verbs.IBV_SEND_SIGNALED, wr_id
            self.qps[peer].post_send(chain(wrs))
        return wr_id

    def _issue(self, peer: int, wrs: list[verbs.SendWR], seq: list[int], link: int) -> bool:
        """One issue of `run`: True once every WR completed, False if the link changed first."""
        for start in range(0, len(wrs), RDMA_CHUNK):
            chunk = wrs[start : start + RDMA_CHUNK]
            seq[0] += 1
            wr_id = RDMA | (seq[0] & 0xFFFFFFFFFF)
            with self.lock:
                if self.link[peer] != link or self.state[peer] != UP:
                    return False
                for wr in chunk[:-1]:
                    wr.send_flags = 0
                    wr.wr_id = RDMA
                last = chunk[-1]
                last.send_flags, last.wr_id = verbs.IBV_SEND_SIGNALED, wr_id
                self.qps[peer].post_send(chain(chunk))  # one doorbell for the chunk

            def landed_or_moved(wr_id: int = wr_id) -> bool:
                return wr_id in self.rdma_done or self.link[peer] != link

            self.wait(landed_or_moved, f"one-sided operations on rank {peer}")
            if wr_id not in self.rdma_done:
                return False
            self.rdma_done.discard(wr_id)
        return True

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("lock", "state", "failed_at", "live", "on_stuck"):
            del state[name]
        state["armed"] = False  # a restarted CQ is not armed; at a checkpoint a re-arm is harmless
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._transient()


def chain(wrs: Sequence[verbs.SendWR]) -> verbs.SendWR:
    """Link `wrs` through ``next_wr`` (the last one ends the chain) and return the first: one post_send, one
    doorbell, for all of them."""
    for wr, following in itertools.pairwise(wrs):
        wr.next_wr = following
    wrs[-1].next_wr = None
    return wrs[0]


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
