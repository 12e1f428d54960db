"""The handshake gate: one thread that accepts connections and authenticates them before they cost anything."""

# Why a gate: whoever can reach a server's port can open connections, and until
# a connection has answered the challenge it must cost the server almost
# nothing, however many there are and whatever they send.  A thread and a
# frame-sized buffer per connection do not pass that test (1000 connections
# announcing 64 MiB frames each were enough to take a coordinator to gigabytes).
#
# The algorithm: one selector thread owns the listening socket and every
# connection that has not authenticated yet.  It accepts, sends the challenge,
# and reads the hello with a _wire.FrameReader, which never buffers more
# than HANDSHAKE_MAX_FRAME bytes and refuses a longer frame from its length
# alone.  Every handshake gets the same timeout from its accept, so deadlines
# come in accept order and a FIFO finds the expired ones in O(1) each: one
# deadline for the whole handshake, however the peer paces its bytes.  At most
# `max_pending` handshakes wait; past that, or when the process runs out of
# descriptors, the oldest one is dropped to make room.
#
# The invariant: no thread and no buffer larger than HANDSHAKE_MAX_FRAME exists
# for a connection before its hello has verified.  Then `on_hello` gets the
# socket (blocking again) and starts what the server needs (typically a
# PeerConnection and a reader thread, see ckpt._server).  A malformed, unauthenticated or late
# hello closes that connection and nothing else.

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import final

from ckpt import _wire
from ckpt._errors import ProtocolError

log = logging.getLogger(__name__)

#: Handshakes that may be in progress at once; the oldest is dropped for a newer one past that.
MAX_PENDING_HANDSHAKES = 4096
#: How long accepting pauses when the process has no descriptor left and no handshake to drop.
_OUT_OF_DESCRIPTORS_PAUSE = 0.1
_ACCEPTS_PER_WAKEUP = 64
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class GateStatistics:
    """Counters of one handshake gate since it started."""

    pending: int  # handshakes in progress now
    accepted: int  # connections accepted
    authenticated: int  # hellos that verified and were handed to the server
    refused: int  # closed for a malformed frame, a wrong op or a wrong answer
    expired: int  # closed at the handshake deadline
    dropped: int  # closed to make room for newer connections


class _Handshake:
    __slots__ = ("deadline", "done", "nonce", "peer", "reader", "sock")

    def __init__(self, sock: socket.socket, peer: str, nonce: bytes, deadline: float) -> None:
        self.sock: socket.socket | None = sock
        self.peer = peer
        self.nonce = nonce
        self.deadline = deadline
        self.reader: _wire.FrameReader | None = _wire.FrameReader(_wire.HANDSHAKE_MAX_FRAME)
        self.done = False


@final
class HandshakeGate:
    """Accepts connections on `listener` and runs every pending challenge/response on one thread.

    `on_hello(sock, peer, hello)` is called on that thread for each connection whose hello verified
    against `token`; it must not block.  It may raise (ProtocolError for a bad hello field) to have the
    connection closed.  `refusal`, if given, is sent to a peer whose answer is wrong before it is closed.
    The gate owns `listener` and closes it on stop().
    """

    def __init__(
        self,
        listener: socket.socket,
        token: str,
        on_hello: Callable[[socket.socket, str, _wire.Message], None],
        *,
        name: str,
        timeout: float = _wire.HANDSHAKE_TIMEOUT,
        refusal: str | None = None,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        self._listener = listener
        self._token = token
        self._on_hello = on_hello
        self._timeout = timeout
        self._refusal = None if refusal is None else _wire.encode({"op": "refused", "error": refusal})
        self._max_pending = max_pending
        self._queue: deque[_Handshake] = deque()  # in accept order, so in deadline order
        self._pending = 0
        self._counts = dict.fromkeys(("accepted", "authenticated", "refused", "expired", "dropped"), 0)
        self._paused_until: float | None = None
        self._stopped = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> HandshakeGate:
        self._listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close every pending handshake and the listening socket (idempotent)."""
        self._stopped = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if not self._thread.is_alive() and self._thread.ident is None:
            self._close_all()
        elif threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def statistics(self) -> GateStatistics:
        c = self._counts
        return GateStatistics(
            self._pending, c["accepted"], c["authenticated"], c["refused"], c["expired"], c["dropped"]
        )

    # ----------------------------------------------------------- the gate thread
    def _run(self) -> None:
        try:
            while not self._stopped:
                for key, _ in self._selector.select(self._next_wakeup()):
                    if key.data is None:
                        self._accept()
                    elif key.data is self._wake_r:
                        self._drain_wakeups()
                    else:
                        self._read(key.data)
                now = time.monotonic()
                self._expire(now)
                if self._paused_until is not None and now >= self._paused_until:
                    self._paused_until = None
                    self._selector.register(self._listener, selectors.EVENT_READ, None)
        except Exception:  # a bug must not leave the port open with nobody accepting
            log.exception("the handshake gate stopped after an internal error")
        finally:
            self._close_all()

    def _next_wakeup(self) -> float | None:
        while self._queue and self._queue[0].done:
            self._queue.popleft()
        times = [t for t in (self._queue[0].deadline if self._queue else None, self._paused_until) if t is not None]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    if not self._drop_oldest():
                        log.warning("out of file descriptors: not accepting connections for a moment")
                        self._selector.unregister(self._listener)
                        self._paused_until = time.monotonic() + _OUT_OF_DESCRIPTORS_PAUSE
                        return
                    continue
                if self._stopped:
                    return
                continue  # the peer went away before it was accepted (ECONNABORTED, ...)
            self._counts["accepted"] += 1
            if self._pending >= self._max_pending:
                self._drop_oldest()
            self._begin(sock, f"{address[0]}:{address[1]}")

    def _begin(self, sock: socket.socket, peer: str) -> None:
        nonce = _wire.new_nonce()
        challenge = _wire.encode({"op": "challenge", "nonce": nonce})
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sock.send(challenge) != len(challenge):  # a fresh socket has room for 40 bytes; else it is hostile
                raise OSError("the challenge did not fit")
            handshake = _Handshake(sock, peer, nonce, time.monotonic() + self._timeout)
            self._selector.register(sock, selectors.EVENT_READ, handshake)
        except OSError:
            sock.close()
            return
        self._queue.append(handshake)
        self._pending += 1

    def _read(self, handshake: _Handshake) -> None:
        assert handshake.sock is not None and handshake.reader is not None
        sock = handshake.sock
        try:
            hello = handshake.reader.read_from(sock)
        except (EOFError, OSError):
            self._end(handshake)
            return
        except ProtocolError as exc:
            self._refuse(handshake, str(exc))
            return
        if hello is None:
            return
        if hello["op"] != "hello" or not _wire.check_answer(self._token, handshake.nonce, hello.get("auth")):
            self._refuse(handshake, "authentication failed" if hello["op"] == "hello" else f"op {hello['op']!r}")
            return
        self._end(handshake, close=False)
        self._counts["authenticated"] += 1
        try:
            sock.setblocking(True)
            self._on_hello(sock, handshake.peer, hello)
        except ProtocolError as exc:
            log.warning("closing connection from %s: %s", handshake.peer, exc)
            sock.close()
        except (EOFError, OSError):
            sock.close()
        except Exception:  # a bug must cost one connection, never the server
            log.exception("closing connection from %s after an internal error", handshake.peer)
            sock.close()

    def _refuse(self, handshake: _Handshake, why: str) -> None:
        # Info, not warning: a port scanner or a flood would otherwise fill the server's terminal.
        log.info("closing connection from %s before authentication: %s", handshake.peer, why)
        self._counts["refused"] += 1
        if self._refusal is not None and handshake.sock is not None:
            try:
                handshake.sock.send(self._refusal)
            except OSError:
                pass
        self._end(handshake)

    def _end(self, handshake: _Handshake, close: bool = True) -> None:
        """The handshake is over (it stays in the FIFO, done, until it reaches the front)."""
        if handshake.done:
            return
        handshake.done = True
        self._pending -= 1
        sock, handshake.sock, handshake.reader = handshake.sock, None, None
        if sock is not None:
            self._selector.unregister(sock)
            if close:
                sock.close()

    def _expire(self, now: float) -> None:
        while self._queue and (self._queue[0].done or self._queue[0].deadline <= now):
            handshake = self._queue.popleft()
            if not handshake.done:
                log.info("closing connection from %s: no hello within %g s", handshake.peer, self._timeout)
                self._counts["expired"] += 1
                self._end(handshake)

    def _drop_oldest(self) -> bool:
        while self._queue:
            handshake = self._queue.popleft()
            if not handshake.done:
                self._counts["dropped"] += 1
                self._end(handshake)
                return True
        return False

    def _close_all(self) -> None:
        while self._queue:
            self._end(self._queue.popleft())
        for sock in (self._listener, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        self._selector.close()
