"""The simulated link layer between two HCAs: packet header, batched reads into registered memory, writers."""

# Every packet is a fixed header followed by `length` payload bytes.  The
# reader keeps one staging buffer per connection and fills it with as much as
# the socket has (so a burst of small packets costs one recv), but a payload
# that is not already staged is received straight into its destination -- a
# memoryview of registered memory -- with recv_into: a 4 MiB RDMA WRITE is
# never copied in user space.
#
# Writers: a connection carries requests posted by a program thread and
# responses (ACKs, NAKs, READ responses) produced by the HCA's reader threads.
# A reader thread must never block on a socket or on a lock a blocked writer
# holds -- two HCAs streaming at each other would deadlock, each reader waiting
# for the other to read.  So HCA threads only append to an outbox and flush it
# without blocking if the connection is free; a writer thread finishes the
# rest.  Program threads take the connection lock, flush the outbox, then send
# their own packets with blocking writes (a doorbell that stalls while the
# peer's NIC drains its queue, which is how a full send queue feels).

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# Packet kinds.
REQ, ACK, NAK, READ_RESP, ATOMIC_RESP, LOST = 1, 2, 3, 4, 5, 6

# NAK syndromes (the requester's resulting WC status is chosen by the requester).
NAK_RNR, NAK_SEQ, NAK_ACCESS, NAK_INV_REQ, NAK_OP = 1, 2, 3, 4, 5

# Header flags.  F_ACK: a request that also acknowledges, for the reverse direction of its QP, every
# request up to the PSN in its `ack` field -- an ACK the responder owed, carried by the next request
# it sends instead of a packet of its own (a ping-pong then sends no ACK packets at all).
F_SOLICITED, F_MIGRATE, F_IMM, F_ACKREQ, F_ACK = 1, 2, 4, 8, 16

#: kind, opcode/syndrome, flags, spare, dqpn, sqpn, psn, npkts, length, imm, rkey, slid, dlid,
#: raddr, arg1 (compare_add / atomic result / rnr delay ns), arg2 (swap), arrival (monotonic seconds, 0 = now),
#: ack (with F_ACK)
HEADER = struct.Struct("<BBBBIIIIIIIHHQQQdI")
HEADER_SIZE = HEADER.size

_STAGE = 256 * 1024


class PacketReader:
    """Reads packets from one connection: headers from a staging buffer, payloads straight to their place."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(_STAGE)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def staged(self) -> bool:
        """True if more bytes are already staged (the caller is in the middle of a burst)."""
        return self._end > self._start

    def has_header(self) -> bool:
        """True if a whole header is staged (`header` will not block)."""
        return self._end - self._start >= HEADER_SIZE

    def fill(self) -> bool:
        """Stage what the socket has now, without blocking; False if it had nothing.  EOFError at its end."""
        if self._start:
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        if self._end == len(self._buf):
            return True  # full of staged packets (a zero-byte recv would read as the end of the stream)
        try:
            n = self.sock.recv_into(self._view[self._end :], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if n == 0:
            raise EOFError("connection closed")
        self._end += n
        return True

    def header(self) -> tuple[Any, ...] | None:
        """The next header, or None at a clean end of stream."""
        while self._end - self._start < HEADER_SIZE:
            if self._start:
                pending = self._end - self._start
                self._view[:pending] = self._view[self._start : self._end]
                self._start, self._end = 0, pending
            n = self.sock.recv_into(self._view[self._end :])
            if n == 0:
                return None
            self._end += n
        fields = HEADER.unpack_from(self._buf, self._start)
        self._start += HEADER_SIZE
        return fields

    def take_into(self, dest: memoryview) -> None:
        """Fill `dest` with the next len(dest) payload bytes."""
        n = len(dest)
        staged = min(n, self._end - self._start)
        if staged:
            dest[:staged] = self._view[self._start : self._start + staged]
            self._start += staged
        got = staged
        while got < n:
            k = self.sock.recv_into(dest[got:], n - got)
            if k == 0:
                raise EOFError("connection closed in the middle of a payload")
            got += k

    def take(self, n: int) -> bytes:
        out = bytearray(n)
        self.take_into(memoryview(out))
        return bytes(out)

    def skip(self, n: int) -> None:
        """Discard the next n payload bytes (a packet that is dropped or refused)."""
        while n > 0:
            staged = min(n, self._end - self._start)
            if staged:
                self._start += staged
                n -= staged
                continue
            k = self.sock.recv_into(self._view, min(n, _STAGE))
            if k == 0:
                raise EOFError("connection closed in the middle of a payload")
            n -= k


class Connection:
    """The sending side of one HCA-to-HCA connection."""

    def __init__(self, sock: socket.socket, endpoint: str, on_broken: Callable[[Connection], None]) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.alive = True
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._outbox: deque[memoryview] = deque()
        self._wake = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name=f"simib-writer-{endpoint}", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ program threads
    def send(self, buffers: Sequence[Any]) -> bool:
        """Send `buffers` (header bytes and payload views) in order, blocking; False if the connection is dead."""
        if not self.alive:
            return False
        with self._lock:
            try:
                if self._outbox:
                    self._flush(blocking=True)
                _sendmsg_all(self.sock, buffers)
            except OSError as exc:
                self._broken(exc)
                return False
        return True

    # ------------------------------------------------------------------ HCA threads
    def post(self, buffers: Sequence[Any]) -> bool:
        """Queue `buffers` and send what can be sent without blocking; never waits.

        Inside a burst of the receive engine (`bursting`) nothing is sent yet: the engine flushes
        every connection its burst touched once, at the end (`end_burst`), so the responses to a
        chain of requests leave in one write.
        """
        if not self.alive:
            return False
        self._outbox.extend(memoryview(b).cast("B") for b in buffers if len(b))
        touched = getattr(_burst, "touched", None)
        if touched is not None:
            touched[self] = None
            return True
        return self.flush_now()

    def flush_now(self) -> bool:
        """Send the outbox as far as the socket takes it without blocking (the writer thread does the rest)."""
        if self._lock.acquire(blocking=False):
            try:
                self._flush(blocking=False)
            except OSError as exc:
                self._broken(exc)
                return False
            finally:
                self._lock.release()
        if self._outbox:
            self._wake.set()
        return True

    def close(self) -> None:
        self.alive = False
        self._wake.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # ------------------------------------------------------------------ internals
    def _flush(self, blocking: bool) -> None:
        """Send the outbox (caller holds the lock)."""
        box = self._outbox
        while box:
            batch = list(box)[:64]
            try:
                sent = self.sock.sendmsg(batch) if blocking else self.sock.sendmsg(batch, [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            while sent:
                head = box[0]
                if sent >= len(head):
                    sent -= len(head)
                    box.popleft()
                else:
                    box[0] = head[sent:]
                    sent = 0

    def _write_loop(self) -> None:
        while self.alive:
            self._wake.wait()
            self._wake.clear()
            if not self.alive:
                return
            with self._lock:
                try:
                    self._flush(blocking=True)
                except OSError as exc:
                    self._broken(exc)
                    return

    def _broken(self, exc: BaseException) -> None:
        if self.alive:
            log.debug("connection to %s broken: %s", self.endpoint, exc)
            self.alive = False
            self._outbox.clear()
            self._on_broken(self)


_burst = threading.local()  # `touched`: the connections a burst of the receive engine posted to (on this thread)


def begin_burst() -> None:
    """From here on, this thread's `Connection.post`s only queue (the receive engine executes a burst)."""
    _burst.touched = {}


def end_burst() -> None:
    """Flush every connection the burst posted to, once."""
    touched = _burst.touched
    _burst.touched = None
    for conn in touched:
        if conn.alive:
            conn.flush_now()


def _sendmsg_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """sendmsg until every byte of `buffers` (bytes or byte-format memoryviews) is written."""
    sent = sock.sendmsg(buffers)
    if sent == sum(map(len, buffers)):
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        if views:
            sent = sock.sendmsg(views[:64])
