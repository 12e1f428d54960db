"""The server base of the coordinator and the subnet manager: listening, authenticated peers, graceful stop."""

# Why one base: the coordinator and the simulated fabric's subnet manager are
# the same kind of server (a port anyone may reach, a challenge/response
# handshake, one reader and one writer thread per authenticated peer, replies
# that must not be lost when the server stops), and two copies of that loop
# had already drifted apart.  What differs is what a peer says first, what a
# request does and what a lost peer means; a subclass supplies those, and
# everything else lives here once:
#
# * the listening socket and the handshake gate (ckpt._gate): nothing is spent
#   on a connection before its hello has verified;
# * a PeerConnection per authenticated peer: replies and pushes go into an
#   outbox that a writer thread drains, so the server never blocks on a peer
#   that does not read while it holds its lock;
# * a reader thread per peer that receives frames (with the heartbeat timeout
#   as its idle limit, if the server has heartbeats) and hands each request to
#   the subclass; a malformed frame closes that one connection;
# * a graceful close: what was posted before a connection (or the server) is
#   closed still goes out, within a bounded time, and the writer ends its side
#   with a FIN behind the last frame, so the answer to `ckpt kill`, to a last
#   `finished` or to a fabric's `stop` reaches a peer that is reading.

from __future__ import annotations

import abc
import logging
import queue
import socket
import threading
import time
from typing import Any, Generic, TypeVar

from ckpt import _wire
from ckpt._errors import ProtocolError
from ckpt._gate import HandshakeGate

log = logging.getLogger(__name__)

#: How long stop(), or the end of one connection, lets the writers send what was posted.
FLUSH_TIMEOUT = 5.0
#: What a graceful close reads and discards at most before it closes: a socket closed with unread
#: input sends a reset, which may destroy the last reply before the peer has read it.
_DISCARD_LIMIT = 1 << 20


class PeerConnection:
    """One authenticated peer of a server: frames go out through an outbox that a writer thread drains,
    so the server never blocks on a peer that does not read.

    With `heartbeat_interval`, the writer sends a heartbeat whenever it had nothing to send for that long.
    close() lets what was posted go out first; abort() does not wait.
    """

    def __init__(self, sock: socket.socket, peer: str, *, thread_name: str, heartbeat_interval: float | None) -> None:
        self.sock = sock
        self.peer = peer
        self.closed = False
        self._heartbeat_interval = heartbeat_interval
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name=thread_name, daemon=True)
        self._writer.start()

    def post(self, message: dict[str, Any]) -> None:
        """Queue `message` (ProtocolError if it cannot be encoded); dropped once the connection is closed."""
        if not self.closed:
            self._outbox.put(_wire.encode(message))

    def _write_loop(self) -> None:
        heartbeat = _wire.encode(_wire.HEARTBEAT)
        graceful = False
        while True:
            try:
                frame = self._outbox.get(timeout=self._heartbeat_interval)
            except queue.Empty:
                frame = heartbeat
            if frame is None:
                graceful = True
                break
            try:
                self.sock.sendall(frame)
            except OSError:
                break
        self.closed = True
        if graceful:
            self._finish()
        else:
            self._shutdown()

    def close(self) -> None:
        """Close once what is already posted (e.g. the reply to `stop`, a refusal) has been sent."""
        if not self.closed:
            self.closed = True
            self._outbox.put(None)

    def flushed(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until the writer has sent what was posted before `close`."""
        if threading.current_thread() is not self._writer:
            self._writer.join(timeout)

    def abort(self) -> None:
        """Close now, dropping whatever is still queued (a writer blocked on the peer is woken)."""
        self.closed = True
        self._outbox.put(None)
        self._shutdown()

    def _finish(self) -> None:
        """After the last frame: a FIN behind it, the unread input discarded, then the socket closed."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            left = _DISCARD_LIMIT
            while left > 0:
                data = self.sock.recv(min(left, 65536), socket.MSG_DONTWAIT)
                if not data:
                    break
                left -= len(data)
        except OSError:  # BlockingIOError: nothing unread; anything else: the peer is gone already
            pass
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread, which may be waiting in poll()
        except OSError:
            pass
        self.sock.close()


ConnT = TypeVar("ConnT", bound=PeerConnection)


class Server(abc.ABC, Generic[ConnT]):
    """A TCP server of authenticated peers; a subclass says what a connection is and what a request does.

    `name` prefixes the threads' names ("ckpt-coord", "ckpt-sm"); `what` names the server in refusals and
    log lines ("coordinator", "subnet manager"). With `heartbeat`,
    every connection sends heartbeats and a peer silent for its timeout is lost. `refusal` is sent to a
    peer whose answer to the challenge is wrong. The subclass's state is guarded by `lock`, which the
    base holds while it welcomes a peer, forgets a lost one and closes the connections in stop().
    """

    def __init__(
        self,
        token: str,
        *,
        name: str,
        what: str,
        lock: threading.Lock | threading.RLock,
        heartbeat: _wire.Heartbeat | None,
        handshake_timeout: float = _wire.HANDSHAKE_TIMEOUT,
        refusal: str | None = None,
    ) -> None:
        self.token = token
        self.address = ""
        self._name = name
        self._what = what
        self._lock = lock
        self._heartbeat = heartbeat
        self._handshake_timeout = handshake_timeout
        self._refusal = refusal
        self._gate: HandshakeGate | None = None
        self._connections: set[ConnT] = set()
        self._stopped = False
        self._down = threading.Event()  # set last by stop(), once the posted frames have left

    # ----------------------------------------------------------- life cycle
    def _bind(self, host: str, port: int) -> None:
        """Listen on host:port (OSError if that fails); `address` is then the bound HOST:PORT."""
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        bound_host, bound_port = sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        self._gate = HandshakeGate(
            sock,
            self.token,
            self._admit,
            name=f"{self._name}-gate",
            timeout=self._handshake_timeout,
            refusal=self._refusal,
        )

    def _serve_in_background(self) -> None:
        """Start accepting (after _bind)."""
        assert self._gate is not None, "_bind() first"
        self._gate.start()

    def stop(self) -> None:
        """Stop accepting, let each connection send what was posted to it (at most FLUSH_TIMEOUT s), close.

        Idempotent; a second caller waits (as long) for the first one to finish."""
        with self._lock:
            first, self._stopped = not self._stopped, True
            connections = list(self._connections)
            if first:
                for conn in connections:
                    conn.close()
        if not first:
            self._down.wait(FLUSH_TIMEOUT)
            return
        if self._gate is not None:
            self._gate.stop()
        self._stopping()
        deadline = time.monotonic() + FLUSH_TIMEOUT
        for conn in connections:
            conn.flushed(max(0.0, deadline - time.monotonic()))
            conn.abort()
        self._down.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped and flushed; False on timeout."""
        return self._down.wait(timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped

    # ----------------------------------------------------------- what a subclass supplies
    @abc.abstractmethod
    def _connection(self, sock: socket.socket, peer: str, hello: _wire.Message) -> ConnT:
        """On the gate's thread, for a verified `hello`: the connection (ProtocolError for a bad hello field).
        It must not block."""

    def _greet(self, conn: ConnT) -> _wire.Message | None:
        """On the reader thread, before the welcome: read what the peer says first, if anything."""
        return None

    @abc.abstractmethod
    def _welcome(self, conn: ConnT, greeting: _wire.Message | None) -> None:
        """Under the lock: post the welcome, or post a refusal and raise EOFError."""

    @abc.abstractmethod
    def _handle(self, conn: ConnT, message: _wire.Message) -> bool:
        """On the reader thread (not under the lock): one request; True if it asked the server to stop.
        ProtocolError closes this connection."""

    def _who(self, conn: ConnT) -> str:
        """The peer as log lines name it."""
        return conn.peer

    def _lost(self, conn: ConnT, silent: str) -> None:
        """Under the lock, once a welcomed connection ended (`silent`: why, if the peer fell silent)."""

    def _stopping(self) -> None:
        """In stop(), once no connection is accepted any more and before the outboxes are flushed."""

    # ----------------------------------------------------------- connections
    def _admit(self, sock: socket.socket, peer: str, hello: _wire.Message) -> None:
        conn = self._connection(sock, peer, hello)
        threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-r-{peer}", daemon=True).start()

    def _serve(self, conn: ConnT) -> None:
        silent = ""
        idle = None if self._heartbeat is None else self._heartbeat.timeout
        welcomed = False
        try:
            greeting = self._greet(conn)
            with self._lock:
                if self._stopped:
                    conn.post({"op": "refused", "error": f"the {self._what} is stopping"})
                    raise EOFError
                self._connections.add(conn)
                welcomed = True
                self._welcome(conn, greeting)
            while True:
                message = _wire.recv(conn.sock, idle=idle)
                if message["op"] != "heartbeat" and self._handle(conn, message):
                    self.stop()
                    return
        except TimeoutError:
            silent = f"no word from it for {idle:g} s"
            log.warning("%s: closing connection from %s: %s", self._what, self._who(conn), silent)
        except (EOFError, OSError):
            pass
        except ProtocolError as exc:
            log.warning("%s: closing connection from %s: %s", self._what, self._who(conn), exc)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("%s: closing connection from %s after an internal error", self._what, self._who(conn))
        finally:
            if welcomed:
                with self._lock:
                    self._connections.discard(conn)
                    self._lost(conn, silent)
            # What was posted (a refusal, a last reply) still goes out, unless the peer does not read it.
            conn.close()
            conn.flushed(0.0 if silent else FLUSH_TIMEOUT)
            conn.abort()
