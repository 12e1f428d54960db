"""The wire both ckpt servers speak: framing, versioning, authentication, heartbeats, the client's connection."""

# Why a module of its own: the coordinator and the simulated fabric's subnet
# manager are reachable over TCP, possibly from other hosts, and an image is
# code (pickle).  Everything that crosses the wire
# is therefore parsed in one place with hard limits:
#
# * a frame is a 4-byte big-endian length followed by that many bytes of
#   msgpack; a length above the limit closes the connection before anything is
#   allocated.  The limit is MAX_FRAME once a peer has authenticated and
#   HANDSHAKE_MAX_FRAME (4 KiB) before: whoever can reach the port must not be
#   able to make the server hold more than that per connection;
# * every message is a map with "v" (PROTOCOL_VERSION) and "op" (a string);
# * a connection is authenticated by challenge/response before anything else:
#   the server sends a random nonce, the client answers with a small "hello"
#   holding HMAC-SHA256(token, nonce), so the job token never travels in clear.
#   The whole handshake has one deadline (HANDSHAKE_TIMEOUT), not one per read,
#   so a peer trickling a byte at a time cannot hold a connection open.  What a
#   peer has to say about itself (a rank's program, argv, plugins) follows in
#   its first frame after the hello, under the authenticated limit;
# * liveness both ways: each side of a connection with a heartbeat sends a
#   "heartbeat" when it has sent nothing for Heartbeat.interval, and treats a
#   connection that stayed silent for Heartbeat.timeout as lost.  Heartbeats go
#   out from threads of their own, so a busy, parked or debugged program thread
#   never makes its process look dead;
# * anything malformed raises ProtocolError, and the caller closes that one
#   connection and nothing else.
#
# This module is neutral: it knows no server's operations (the coordinator's
# are typed in ckpt.coordinator.protocol), so that ckpt.verbs can use it without
# importing the coordinator.  Both clients (CoordinatorClient, FabricClient)
# share the client side below: the handshake and a connection that matches
# replies to requests by id.  The servers share theirs in ckpt._server.

from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import math
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from ckpt._errors import ProtocolError

#: 2: the hello carries only the authentication (and role); heartbeats.
PROTOCOL_VERSION = 2
#: The largest frame an authenticated peer may send.
MAX_FRAME = 64 * 1024 * 1024
#: The largest frame before authentication (a challenge or a hello is well under 100 bytes).
HANDSHAKE_MAX_FRAME = 4096
#: Seconds from accept (or connect) to the end of the handshake, all reads together.
HANDSHAKE_TIMEOUT = 10.0
_LENGTH = struct.Struct(">I")

Message = dict[str, Any]

#: Environment variables that set the heartbeat of coordinator connections (seconds).
ENV_HEARTBEAT_INTERVAL = "CKPT_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_TIMEOUT = "CKPT_HEARTBEAT_TIMEOUT"


@dataclass(frozen=True)
class Heartbeat:
    """Send a heartbeat after `interval` s without sending; a peer silent for `timeout` s is lost."""

    interval: float = 1.0
    timeout: float = 15.0

    def __post_init__(self) -> None:
        for name, value in (("interval", self.interval), ("timeout", self.timeout)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ProtocolError(f"heartbeat {name} must be a number of seconds > 0, not {value!r}")
        if self.timeout <= self.interval:
            raise ProtocolError(
                f"heartbeat timeout ({self.timeout:g} s) must be longer than the interval ({self.interval:g} s)"
            )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Heartbeat:
        """The heartbeat set by $CKPT_HEARTBEAT_INTERVAL / $CKPT_HEARTBEAT_TIMEOUT (defaults 1 s / 15 s)."""
        env = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for field_name, variable in (("interval", ENV_HEARTBEAT_INTERVAL), ("timeout", ENV_HEARTBEAT_TIMEOUT)):
            raw = env.get(variable, "").strip()
            if not raw:
                continue
            try:
                values[field_name] = float(raw)
            except ValueError:
                raise ProtocolError(f"{variable}={raw!r}: expected a number of seconds") from None
        try:
            return cls(**values)
        except ProtocolError as exc:
            raise ProtocolError(f"{exc} (from {ENV_HEARTBEAT_INTERVAL} / {ENV_HEARTBEAT_TIMEOUT})") from None


def new_token() -> str:
    """A fresh random job token (hex)."""
    return secrets.token_hex(16)


def token_bytes(token: str) -> bytes:
    """The key bytes of a token as used for HMACs (of frames' nonces and of images)."""
    return token.encode("utf-8")


def auth_answer(token: str, nonce: bytes) -> bytes:
    """What a client must answer to the server's challenge `nonce`."""
    return hmac.new(token_bytes(token), b"ckpt-auth:" + nonce, hashlib.sha256).digest()


def check_answer(token: str, nonce: bytes, answer: object) -> bool:
    """Constant-time check of a client's answer to a challenge."""
    return isinstance(answer, bytes) and hmac.compare_digest(auth_answer(token, nonce), answer)


def new_nonce() -> bytes:
    return os.urandom(16)


def encode(message: Message) -> bytes:
    """One frame for `message` (adds the protocol version)."""
    body: bytes = msgpack.packb({"v": PROTOCOL_VERSION, **message}, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(
            f"message {message.get('op')!r} is {len(body)} bytes, over the {MAX_FRAME}-byte frame limit"
        )
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """Parse and validate one frame body."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a map")
    if message.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.get('v')!r}, expected {PROTOCOL_VERSION}")
    if not isinstance(message.get("op"), str):
        raise ProtocolError("frame has no op")
    return message


def _wait_readable(sock: socket.socket, deadline: float | None, idle: float | None) -> None:
    """Block until `sock` has data (or EOF); TimeoutError past `deadline` or after `idle` s of silence.

    poll(), not a socket timeout: another thread may be sending on this socket, and a timeout set here
    would cut its sendall short.  poll(), not select(): a server may have more than 1024 descriptors.
    """
    wait, why = idle, "" if idle is None else f"silent for {idle:g} s"
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        if wait is None or left < wait:
            wait, why = left, "deadline passed"
    fd = sock.fileno()
    if fd < 0:  # closed by another thread (a writer that hit an error, close())
        raise OSError(errno.EBADF, "the socket is closed")
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(None if wait is None else math.ceil(wait * 1000)):
        raise TimeoutError(why)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None, idle: float | None = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None or idle is not None:
            _wait_readable(sock, deadline, idle)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def recv(
    sock: socket.socket, *, limit: int | None = None, deadline: float | None = None, idle: float | None = None
) -> Message:
    """Receive one message of at most `limit` bytes (MAX_FRAME); EOFError on a clean close, ProtocolError on
    anything malformed, TimeoutError past the monotonic `deadline` or after `idle` s without a byte."""
    limit = MAX_FRAME if limit is None else limit
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline, idle))
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes announced, limit is {limit}")
    return decode(_recv_exact(sock, length, deadline, idle))


class FrameReader:
    """One frame read from a non-blocking socket in whatever pieces arrive, never holding more than `limit`.

    It reads no byte past its frame, so what the peer sent next stays in the socket for whoever reads it.
    """

    def __init__(self, limit: int = HANDSHAKE_MAX_FRAME) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._need = _LENGTH.size
        self._header = True

    def read_from(self, sock: socket.socket) -> Message | None:
        """Read what is there; the message once it is complete, else None. EOFError, ProtocolError."""
        try:
            data = sock.recv(self._need - len(self._buf))
        except (BlockingIOError, InterruptedError):
            return None
        if not data:
            raise EOFError("connection closed")
        self._buf += data
        if len(self._buf) < self._need:
            return None
        if self._header:
            (length,) = _LENGTH.unpack(self._buf)
            if length > self._limit:
                raise ProtocolError(f"frame of {length} bytes announced, limit is {self._limit}")
            self._header, self._need, self._buf = False, length, bytearray()
            if length:
                return None
        return decode(bytes(self._buf))


def send(sock: socket.socket, message: Message) -> None:
    sock.sendall(encode(message))


def require(message: Message, key: str, kind: type | tuple[type, ...]) -> Any:
    """message[key], checked to be of `kind`, or ProtocolError."""
    value = message.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"op {message['op']!r}: field {key!r} missing or of the wrong type")
    return value


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); ProtocolError with a clear line naming `what` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ProtocolError(f"bad {what} {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


HEARTBEAT: Message = {"op": "heartbeat"}


# ----------------------------------------------------------- the client side
def client_handshake(
    sock: socket.socket,
    token: str,
    server: str,
    *,
    role: str | None = None,
    then: Message | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> Message:
    """Answer the challenge on a new connection (as `role`), send `then` right behind the hello if given,
    and return the server's answer (its welcome or refusal), all within `timeout` s.

    ProtocolError if the peer does not challenge as a ckpt `server` does; EOFError or OSError if it closes;
    TimeoutError if the handshake takes longer than `timeout`.
    """
    deadline = time.monotonic() + timeout
    challenge = recv(sock, limit=HANDSHAKE_MAX_FRAME, deadline=deadline)
    nonce = challenge.get("nonce")
    if challenge["op"] != "challenge" or not isinstance(nonce, bytes):
        raise ProtocolError(f"the peer is not a ckpt {server}")
    hello: Message = {"op": "hello", "auth": auth_answer(token, nonce)}
    if role is not None:
        hello["role"] = role
    sock.sendall(encode(hello) + (encode(then) if then is not None else b""))
    while True:  # the server's heartbeats may start before its answer
        answer = recv(sock, deadline=deadline)
        if answer["op"] != "heartbeat":
            return answer


@dataclass
class _Pending:
    event: threading.Event
    answer: Message | None = None


class ClientConnection:
    """An authenticated connection after its handshake: requests carry an id, and a daemon reader thread
    matches each reply to its caller and hands every other message to `on_message`.

    Every failure raises `error`. `peer` names the server in a missing answer ("no answer from the
    {peer} to ..."); `lost` is what a lost connection says, with `lost_hint` added by the reader.
    With a `heartbeat`, a daemon thread sends a heartbeat whenever nothing was sent for its interval,
    and a server silent for its timeout is lost: "{silent} for T s".

    On a lost connection `on_lost` runs before the waiting callers fail, so that a process which ends
    in `on_lost` says why in one line, not once more from every thread that was waiting.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        error: type[Exception],
        peer: str,
        lost: str,
        lost_hint: str = "",
        on_message: Callable[[Message], None],
        on_lost: Callable[[str], None] | None,
        thread_name: str,
        heartbeat: Heartbeat | None = None,
        silent: str = "",
    ) -> None:
        self._sock = sock
        self._error = error
        self._peer = peer
        self._lost_text = lost
        self._lost_hint = lost_hint
        self._silent = silent or f"no word from the {peer}"
        self._on_message = on_message
        self._on_lost = on_lost
        self._heartbeat = heartbeat
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._lost: str | None = None
        self._closing = False
        self._ended = threading.Event()  # closed or lost: the heartbeat thread stops
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name=thread_name, daemon=True)
        self._reader.start()
        if heartbeat is not None:
            threading.Thread(
                target=self._heartbeat_loop, args=(heartbeat.interval,), name=f"{thread_name}-hb", daemon=True
            ).start()

    def call(self, op: str, reply_timeout: float | None, /, **fields: Any) -> Message:
        """Send a request and wait (up to `reply_timeout` s) for its reply; `error` on an error reply or a lost
        link. Positional-only, so that a request may have a field named "timeout" (subscribe has)."""
        rid = next(self._ids)
        pending = _Pending(threading.Event())
        with self._lock:
            if self._lost is not None:
                raise self._error(self._lost)
            self._pending[rid] = pending
        self.send({"op": op, "id": rid, **fields})
        if not pending.event.wait(reply_timeout):
            with self._lock:
                self._pending.pop(rid, None)
            raise self._error(f"no answer from the {self._peer} to {op!r} within {reply_timeout} s")
        answer = pending.answer
        if answer is None:
            raise self._error(self._lost or self._lost_text)
        if "error" in answer:
            raise self._error(str(answer["error"]))
        return answer

    def send(self, message: Message) -> None:
        """Send one message (thread-safe); `error` if the connection is lost."""
        frame = encode(message)
        try:
            with self._send_lock:
                self._sock.sendall(frame)
                self._last_sent = time.monotonic()
        except OSError as exc:
            self._fail_all(f"{self._lost_text}: {exc}")
            raise self._error(self._lost or str(exc)) from None

    def _heartbeat_loop(self, interval: float) -> None:
        frame = encode(HEARTBEAT)
        while not self._ended.wait(max(0.0, self._last_sent + interval - time.monotonic())):
            if time.monotonic() - self._last_sent < interval:
                continue  # something else went out meanwhile
            try:
                with self._send_lock:
                    self._sock.sendall(frame)
                    self._last_sent = time.monotonic()
            except OSError:
                return  # the reader sees the connection go and reports it, once

    def _read_loop(self) -> None:
        reason = self._lost_text + self._lost_hint
        idle = self._heartbeat.timeout if self._heartbeat is not None else None
        try:
            while True:
                message = recv(self._sock, idle=idle)
                op = message["op"]
                if op == "reply":
                    with self._lock:
                        pending = self._pending.pop(message.get("id", -1), None)
                    if pending is not None:
                        pending.answer = message
                        pending.event.set()
                elif op != "heartbeat":
                    self._on_message(message)
        except TimeoutError as exc:
            reason = f"{self._silent} for {idle:g} s" if idle is not None else f"{reason}: {exc}"
        except (EOFError, OSError):
            pass
        except ProtocolError as exc:
            reason += f": {exc}"
        self._ended.set()
        if self._on_lost is not None and not self._closing:
            self._on_lost(reason)
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = reason
            pending, self._pending = self._pending, {}
        for item in pending.values():
            item.event.set()

    def close(self) -> None:
        self._closing = True
        self._ended.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
