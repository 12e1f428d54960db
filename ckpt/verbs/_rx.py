"""The receive engine of a simulated HCA: a reader thread per incoming connection, and poll-driven progress."""

# Rationale.  A packet reaches a program through the HCA's receive engine: it is
# read, executed (data placed, atomic run, completion queued) and answered (ACK,
# READ response).  Each incoming connection has a reader thread -- the NIC -- so
# one-sided operations on a busy or parked program are served without it.  But a
# program waiting for a reply then gets it through a second thread: the reader
# wakes, executes, rings the doorbell, and the program wakes -- two thread
# wake-ups and GIL hand-overs per direction, most of a small message's round trip
# (docs/benchmarks.md).
#
# Poll-driven progress, as UCX and libfabric's manual progress mode do it: a
# thread that polls an empty CQ of this HCA becomes the *driver*: it waits on
# every incoming connection at once (epoll) and executes what arrives itself, so
# a reply it polls for completes on its own thread.  One thread drives at a time;
# the others wait on the doorbell as before and are woken by the completions the
# driver queues.  A thread blocked on a completion channel does not drive: a
# protocol handler idling there would take the role from the program's polling
# thread, and hand it back, on every message (measured: the DSM's page fetch
# got slower, not faster).
#
# The reader threads step aside while someone drives: a reader that wakes while a
# thread drives, or while the *lease* is live (one drove within LEASE seconds),
# parks, off its socket, so a packet wakes one thread, not two.  Once nobody has
# driven for LEASE, the readers take over again: a program that stops polling
# (computing, parked at a checkpoint) has its memory served within LEASE.
#
# Coalesced ACKs are kept here too, with no timer thread: a request nobody asked
# an ACK for leaves its QP *owing* one (`RxChannel.owed`); the QP's next request
# carries it (`_wire.F_ACK`), or whichever thread runs the engine sends it once
# DELAYED_ACK has passed -- the driver bounds its epoll wait by the earliest such
# deadline, a reader thread its poll.  (A timer thread woken for every coalescing
# window cost a ping-pong more than a fifth of its round trip in GIL hand-overs.)
#
# Invariant: a connection's bytes are read, and its packets executed in order, by
# one thread at a time -- whoever holds that channel's lock -- so the responder
# state a reader thread alone used to touch still has a single writer at a time.

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt.verbs import _links
from ckpt.verbs import _wire as w

if TYPE_CHECKING:
    from ckpt.verbs._hca import Hca

log = logging.getLogger(__name__)


def env_seconds(name: str, default: float) -> float:
    """$`name` as a number of seconds >= 0, or `default` when it is unset; ValueError naming it otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):  # NaN fails too
        raise ValueError(f"{name}={raw!r}: expected a number of seconds >= 0")
    return value


#: Seconds the reader threads keep off their sockets after a driver was last active.
LEASE = env_seconds("CKPT_SIMIB_POLL_LEASE", 0.001)
#: Shortest sleep of a parked reader thread before it looks at the lease again (a lease of 0 would make it spin
#: for as long as a thread drives, taking the GIL from everyone: measured, a page fetch 12x slower).
PARK_MIN = 0.0005
#: CKPT_SIMIB_POLL_PROGRESS=0 turns poll-driven progress off (the reader threads do everything: the old engine,
#: for comparison in benchmarks/bench_verbs.py).
ENABLED = os.environ.get("CKPT_SIMIB_POLL_PROGRESS", "1") != "0"

#: Seconds a responder may sit on an ACK nobody asked for (well below the requester's shortest
#: retransmission timer, _qpbase._MIN_TIMER, which a late ACK would set off).
DELAYED_ACK = 0.0005
#: What executing a request asks of the responder (`Responder.on_request`).
ACK_NONE, ACK_NOW, ACK_LATER = 0, 1, 2


class RxChannel:
    """One incoming connection: its socket, its packet reader, and the ACKs its requests are owed."""

    __slots__ = ("acks", "closed", "engine", "lock", "owed", "reader", "sock")

    def __init__(self, sock: socket.socket, engine: ReceiveEngine) -> None:
        self.sock = sock
        self.engine = engine
        self.reader = w.PacketReader(sock)
        self.lock = threading.Lock()  # held by whoever reads and executes this connection's packets
        self.acks: dict[Any, None] = {}  # QPs to ACK at the end of this burst (ordered, no duplicates)
        self.owed: dict[Any, float] = {}  # QPs owing a coalesced ACK -> when it is due
        self.closed = False

    def owe(self, qp: Any, due: float) -> None:
        """`qp` owes its peer an ACK, due at `due` (channel lock held); a request of its own that carries
        the ACK takes it back (`forgive`)."""
        self.owed[qp] = due
        qp.owed_on = self
        engine = self.engine
        engine.owing.add(self)
        if due < engine.next_due:
            engine.next_due = due

    def forgive(self, qp: Any) -> None:
        """`qp`'s ACK went with one of its requests (any thread: a single dict operation)."""
        self.owed.pop(qp, None)

    def next_due(self) -> float | None:
        # a post on another thread may `forgive` the last entry between a check and a read: one snapshot
        due = list(self.owed.values())
        return min(due) if due else None

    def send_due(self, now: float) -> None:
        """Send the coalesced ACKs that are due (channel lock held); forget those a request carried."""
        owed = self.owed
        for qp, due in list(owed.items()):
            # a post on another thread may `forgive` any entry meanwhile (it does not take the channel lock):
            # pop, never del, and send only an ACK still owed here
            if not qp.ack_owed:
                owed.pop(qp, None)
            elif due <= now and owed.pop(qp, None) is not None:
                qp.send_ack()
        if not owed:
            self.engine.owing.discard(self)


class ReceiveEngine:
    """Accepts connections from peer HCAs and executes their packets, on reader threads or on a polling thread."""

    def __init__(self, hca: Hca, listeners: list[socket.socket]) -> None:
        self.hca = hca
        self._channels: dict[int, RxChannel] = {}
        self._epoll = select.epoll()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._driver = threading.Lock()  # held by the thread that drives
        #: a driver is blocked in epoll: a completion queued by another thread must wake it
        self.driving = False
        #: the completion queue (its entries) the driver waits for: a completion queued on another one by another
        #: thread -- a direct placement, a post completed at once -- does not wake it (None: any does)
        self.awaited: object = None
        self.lease_until = 0.0
        self.owing: set[RxChannel] = set()  # channels with coalesced ACKs owed
        self.next_due = float("inf")  # the earliest of their deadlines (or earlier: it is only a wake-up)
        self._park = threading.Condition()
        for listener in listeners:
            kind = "unix" if listener.family == socket.AF_UNIX else "tcp"
            name = f"{hca.name}-accept-{kind}"
            threading.Thread(target=self._accept_loop, args=(listener,), name=name, daemon=True).start()

    # ------------------------------------------------------------------ the polling thread
    def drive(self, ready: Callable[[], object], timeout: float, awaited: object = None) -> bool:
        """Execute incoming packets on this thread until `ready()` or `timeout` seconds; False if another drives.

        `awaited`: what `ready` looks at (a CQ's entries), so that only a completion queued there wakes this
        thread out of its wait (`awaited`).
        """
        if not ENABLED:
            return False
        driver = self._driver
        if not driver.acquire(blocking=False):
            return False
        self.awaited = awaited
        try:
            self._run(ready, time.monotonic() + timeout)
        finally:
            self.awaited = None
            self.lease_until = time.monotonic() + LEASE
            driver.release()
        return True

    def _run(self, ready: Callable[[], object], deadline: float) -> None:
        epoll, channels, wake_fd, hca = self._epoll, self._channels, self._wake_fd, self.hca
        while True:
            if hca.unsent:  # posts held back for a poll (`Hca.defer`): this is one
                hca.flush()
            now = time.monotonic()
            self.lease_until = now + LEASE
            if now >= self.next_due:
                self._send_due(now)
            left = min(deadline, self.next_due) - now
            if deadline <= now or ready():
                return
            self.driving = True
            try:
                if ready():  # queued before `driving` was set: nobody woke us for it
                    return
                events = epoll.poll(max(left, 0.0))
            finally:
                self.driving = False
            for fd, _ in events:
                if fd == wake_fd:
                    try:
                        os.eventfd_read(wake_fd)
                    except BlockingIOError:
                        pass
                    continue
                chan = channels.get(fd)
                if chan is None:
                    continue
                with chan.lock:  # a reader thread may be mid-burst on it: that is short
                    if not chan.closed:
                        self.hca.counts["packets_polled"] += self._drain(chan)

    def _send_due(self, now: float) -> None:
        """Send every coalesced ACK that is due, on every channel; note when the next one is."""
        self.next_due = float("inf")
        for chan in list(self.owing):
            with chan.lock:
                chan.send_due(now)
                due = chan.next_due()
            if due is not None and due < self.next_due:
                self.next_due = due

    def wake(self) -> None:
        """Wake the driver out of its epoll wait (a completion it may be waiting for came from another thread)."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # the counter is full: it is awake anyway
            pass

    # ------------------------------------------------------------------ reader threads
    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            try:
                if not _links.accepted(sock):
                    continue
            except OSError as exc:  # the peer went away before we looked at it
                log.debug("HCA %s: dropped a connection as it was accepted: %s", self.hca.name, exc)
                sock.close()
                continue
            chan = RxChannel(sock, self)
            fd = sock.fileno()
            self._channels[fd] = chan
            self._epoll.register(fd, select.EPOLLIN)
            threading.Thread(target=self._read_loop, args=(chan, fd), name=f"{self.hca.name}-rx", daemon=True).start()

    def _read_loop(self, chan: RxChannel, fd: int) -> None:
        """A reader thread: wait for the connection's data and execute it, unless a driver is about."""
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)
        try:
            while not chan.closed:
                if self._leased():
                    self._park_while_leased()  # the driver sends this channel's coalesced ACKs meanwhile
                    continue
                due = chan.next_due()
                ready = waiter.poll(None if due is None else max(0.0, due - time.monotonic()) * 1000.0)
                if self._leased():
                    continue  # a driver is about: it takes this data
                with chan.lock:
                    if ready and not chan.closed:
                        self._drain(chan)
                    if chan.owed:
                        chan.send_due(time.monotonic())
        except Exception:  # the NIC must never die silently: this connection is lost, say why
            log.exception("HCA %s: receive engine failed", self.hca.name)
            self._close(chan)
        finally:
            chan.sock.close()

    def polled(self) -> bool:
        """A thread drives the engine (it flushes held-back posts before each wait: `Hca.defer`)."""
        return self._driver.locked()

    def _leased(self) -> bool:
        """A thread drives, or drove within LEASE: the reader threads keep off their sockets."""
        return self._driver.locked() or time.monotonic() < self.lease_until

    def _park_while_leased(self) -> None:
        with self._park:
            while self._leased():
                self._park.wait(max(self.lease_until - time.monotonic(), LEASE, PARK_MIN))

    # ------------------------------------------------------------------ executing a burst (channel lock held)
    def _drain(self, chan: RxChannel) -> int:
        """Execute every complete packet the connection has for us now, then send the ACKs it owes; how many."""
        reader, dispatch, acks = chan.reader, self.hca.dispatch, chan.acks
        executed = 0
        w.begin_burst()
        try:
            # one read per wake-up: what it leaves (the socket is level-triggered) wakes us again
            if not reader.has_header() and not reader.fill():
                return 0
            while reader.has_header():
                fields = reader.header()
                assert fields is not None
                dispatch(fields, reader, chan)
                executed += 1
        except (OSError, EOFError) as exc:
            log.debug("HCA %s: receive connection ended: %s", self.hca.name, exc)
            self._close(chan)
        finally:
            if acks:
                for due in acks:
                    due.send_ack()
                acks.clear()
            w.end_burst()  # the responses and ACKs of the burst leave together
        return executed

    def _close(self, chan: RxChannel) -> None:
        """Stop reading a connection (its reader thread closes the socket on its way out)."""
        if chan.closed:
            return
        chan.closed = True
        chan.owed.clear()
        self.owing.discard(chan)
        fd = next((f for f, c in list(self._channels.items()) if c is chan), None)
        if fd is not None:
            self._channels.pop(fd, None)
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass
