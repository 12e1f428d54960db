"""The coordinator wire protocol: framing, versioning, authentication, message shapes, the client's connection."""

# Why a module of its own: the coordinator is reachable over TCP, possibly from
# other hosts, and an image is code (pickle).  Everything that crosses the wire
# is therefore parsed in one place with hard limits:
#
# * a frame is a 4-byte big-endian length followed by that many bytes of
#   msgpack; a length above MAX_FRAME closes the connection before anything is
#   allocated;
# * every message is a map with "v" (PROTOCOL_VERSION) and "op" (a string);
# * a connection is authenticated by challenge/response before anything else:
#   the server sends a random nonce, the client answers with
#   HMAC-SHA256(token, nonce), so the job token never travels in clear;
# * anything malformed raises ProtocolError, and the caller closes that one
#   connection and nothing else.
#
# The subnet manager of ckpt.verbs speaks the same protocol, so both clients
# (CoordinatorClient, FabricClient) share the client side below: the handshake
# and a connection that matches replies to requests by id.

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ckpt._errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_FRAME = 64 * 1024 * 1024
_LENGTH = struct.Struct(">I")

Message = dict[str, Any]


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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> Message:
    """Receive one message; EOFError on a clean close, ProtocolError on anything malformed."""
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes announced, limit is {MAX_FRAME}")
    return decode(_recv_exact(sock, length))


def send(sock: socket.socket, message: Message) -> None:
    sock.sendall(encode(message))


def require(message: Message, key: str, kind: type | tuple[type, ...]) -> Any:
    """message[key], checked to be of `kind`, or ProtocolError."""
    value = message.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"op {message['op']!r}: field {key!r} missing or of the wrong type")
    return value


def parse_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); ProtocolError with a clear line otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ProtocolError(f"bad coordinator address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


# ----------------------------------------------------------- the client side
def client_handshake(sock: socket.socket, token: str, hello: Message, server: str) -> Message:
    """Answer the challenge on a new connection with a hello carrying `hello`; the server's answer to it.

    ProtocolError if the peer does not challenge as a ckpt `server` does; EOFError or OSError if it closes.
    """
    challenge = recv(sock)
    nonce = challenge.get("nonce")
    if challenge["op"] != "challenge" or not isinstance(nonce, bytes):
        raise ProtocolError(f"the peer is not a ckpt {server}")
    send(sock, {"op": "hello", "auth": auth_answer(token, nonce), **hello})
    return recv(sock)


@dataclass
class _Pending:
    event: threading.Event
    answer: Message | None = None


class ClientConnection:
    """An authenticated connection after its handshake: requests carry an id, and a daemon reader thread
    matches each reply to its caller and hands every other message to `on_message`.

    Every failure raises `error`. `peer` names the server in a missing answer ("no answer from the
    {peer} to ..."); `lost` is what a lost connection says, with `lost_hint` added by the reader.
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
    ) -> None:
        self._sock = sock
        self._error = error
        self._peer = peer
        self._lost_text = lost
        self._lost_hint = lost_hint
        self._on_message = on_message
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._lost: str | None = None
        self._closing = False
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name=thread_name, daemon=True)
        self._reader.start()

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
        except OSError as exc:
            self._fail_all(f"{self._lost_text}: {exc}")
            raise self._error(self._lost or str(exc)) from None

    def _read_loop(self) -> None:
        reason = self._lost_text + self._lost_hint
        try:
            while True:
                message = recv(self._sock)
                if message["op"] == "reply":
                    with self._lock:
                        pending = self._pending.pop(message.get("id", -1), None)
                    if pending is not None:
                        pending.answer = message
                        pending.event.set()
                else:
                    self._on_message(message)
        except (EOFError, OSError):
            pass
        except ProtocolError as exc:
            reason += f": {exc}"
        self._fail_all(reason)
        if self._on_lost is not None and not self._closing:
            self._on_lost(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = reason
            pending, self._pending = self._pending, {}
        for item in pending.values():
            item.event.set()

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
