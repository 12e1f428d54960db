"""The coordinator wire protocol: framing, versioning, authentication and message shapes."""

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

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
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
