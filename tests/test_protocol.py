"""Unit tests of the wire both servers speak (ckpt._wire): framing, limits, decoding, auth, addresses, handshake."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest

from ckpt import _wire as wire
from ckpt._errors import CkptError, ProtocolError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


V = wire.PROTOCOL_VERSION


def body(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def frame(obj: object) -> bytes:
    data = body(obj)
    return struct.pack(">I", len(data)) + data


# ----------------------------------------------------------------- encode / decode
def test_protocol_error_is_a_ckpt_error() -> None:
    assert issubclass(ProtocolError, CkptError)


def test_encode_prefixes_a_big_endian_length_and_adds_the_version() -> None:
    data = wire.encode({"op": "status", "id": 3})
    (length,) = struct.unpack(">I", data[:4])
    assert length == len(data) - 4
    assert msgpack.unpackb(data[4:], raw=False) == {"v": wire.PROTOCOL_VERSION, "op": "status", "id": 3}


def test_round_trip_keeps_bytes_strings_and_nesting() -> None:
    message = {"op": "publish", "ns": "ib", "key": "qp/0", "value": {"raw": b"\x00\xff", "list": [1, "a", None]}}
    decoded = wire.decode(wire.encode(message)[4:])
    assert decoded == {"v": wire.PROTOCOL_VERSION, **message}
    assert isinstance(decoded["value"]["raw"], bytes)


def test_a_message_cannot_override_the_protocol_version() -> None:
    with pytest.raises(ProtocolError, match="protocol version"):
        wire.decode(wire.encode({"op": "x", "v": 99})[4:])


def test_encode_refuses_a_message_over_the_frame_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_FRAME", 64)
    wire.encode({"op": "small"})
    with pytest.raises(ProtocolError, match=r"'big'.*64-byte frame limit"):
        wire.encode({"op": "big", "data": b"x" * 100})


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", "undecodable"),
        (b"\xc1", "undecodable"),  # never-used msgpack byte
        (b"\x92\x01", "undecodable"),  # truncated array
        (body([1, 2, 3]), "not a map"),
        (body("status"), "not a map"),
        (body(7), "not a map"),
        (body(None), "not a map"),
        (body({"op": "status"}), "protocol version None"),
        (body({"v": 99, "op": "status"}), "protocol version 99"),
        (body({"v": 1, "op": "status"}), "protocol version 1, expected 2"),  # a peer of the previous version
        (body({"v": str(V), "op": "status"}), "protocol version"),
        (body({"v": V}), "no op"),
        (body({"v": V, "op": 5}), "no op"),
        (body({"v": V, "op": b"status"}), "no op"),
        (body({"v": V, "op": "x"}) + b"\x00", "undecodable"),  # trailing data
    ],
)
def test_decode_rejects_malformed_bodies(raw: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(raw)


def test_decode_of_random_garbage_only_ever_raises_protocol_error() -> None:
    rng = random.Random(20240611)
    for _ in range(3000):
        raw = rng.randbytes(rng.randrange(0, 64))
        try:
            message = wire.decode(raw)
        except ProtocolError:
            continue
        assert message["v"] == wire.PROTOCOL_VERSION and isinstance(message["op"], str)


def test_decode_of_mutated_valid_frames_only_ever_raises_protocol_error() -> None:
    rng = random.Random(7)
    valid = wire.encode({"op": "publish", "ns": "n", "key": "k", "value": [1, 2.5, b"x", {"a": None}]})[4:]
    for _ in range(3000):
        mutated = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            message = wire.decode(bytes(mutated))
        except ProtocolError:
            continue
        assert isinstance(message, dict) and isinstance(message["op"], str)


# ----------------------------------------------------------------- recv / send on sockets
def test_send_and_recv_over_a_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    wire.send(a, {"op": "one", "n": 1})
    wire.send(a, {"op": "two", "payload": b"\x01" * 100_000})
    assert wire.recv(b)["op"] == "one"
    second = wire.recv(b)
    assert second["op"] == "two" and second["payload"] == b"\x01" * 100_000


def test_recv_reassembles_a_frame_sent_one_byte_at_a_time(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = wire.encode({"op": "slow", "value": list(range(50))})

    def trickle() -> None:
        for i in range(len(data)):
            a.sendall(data[i : i + 1])

    writer = threading.Thread(target=trickle)
    writer.start()
    try:
        assert wire.recv(b) == {"v": V, "op": "slow", "value": list(range(50))}
    finally:
        writer.join(5.0)


def test_recv_raises_eof_on_a_clean_close(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    with pytest.raises(EOFError):
        wire.recv(b)


def test_recv_raises_eof_when_the_peer_closes_mid_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = wire.encode({"op": "cut", "value": "x" * 100})
    a.sendall(data[:30])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        wire.recv(b)


def test_recv_raises_eof_when_the_peer_closes_inside_the_length(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(b"\x00\x00")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        wire.recv(b)


@pytest.mark.timeout(10)
def test_recv_refuses_an_oversize_length_before_reading_the_body(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    # Only the header is sent: reading the body would block (and hit the socket timeout).
    a.sendall(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="limit"):
        wire.recv(b)
    a.sendall(struct.pack(">I", 0xFFFFFFFF))
    with pytest.raises(ProtocolError, match="limit"):
        wire.recv(b)


def test_recv_honours_the_frame_limit_exactly(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    ok = body({"v": V, "op": "fits"})
    monkeypatch.setattr(wire, "MAX_FRAME", len(ok))
    a.sendall(struct.pack(">I", len(ok)) + ok)
    assert wire.recv(b)["op"] == "fits"
    a.sendall(struct.pack(">I", len(ok) + 1))
    with pytest.raises(ProtocolError):
        wire.recv(b)


def test_recv_of_a_zero_length_frame_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", 0))
    with pytest.raises(ProtocolError):
        wire.recv(b)


def test_recv_of_a_non_map_frame_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(frame(["op", "status"]))
    with pytest.raises(ProtocolError, match="not a map"):
        wire.recv(b)


# ----------------------------------------------------------------- authentication helpers
def test_new_token_is_random_hex() -> None:
    tokens = {wire.new_token() for _ in range(20)}
    assert len(tokens) == 20
    for token in tokens:
        assert len(token) == 32
        int(token, 16)


def test_new_nonce_is_16_random_bytes() -> None:
    nonces = {wire.new_nonce() for _ in range(20)}
    assert len(nonces) == 20
    assert all(isinstance(n, bytes) and len(n) == 16 for n in nonces)


def test_auth_answer_is_an_hmac_that_does_not_contain_the_token() -> None:
    nonce = wire.new_nonce()
    answer = wire.auth_answer("sekrit", nonce)
    assert answer == wire.auth_answer("sekrit", nonce)
    assert len(answer) == 32
    assert b"sekrit" not in answer
    assert answer != wire.auth_answer("sekrit", wire.new_nonce())
    assert answer != wire.auth_answer("other", nonce)


def test_check_answer_accepts_only_the_right_answer() -> None:
    nonce = wire.new_nonce()
    right = wire.auth_answer("tok", nonce)
    assert wire.check_answer("tok", nonce, right)
    assert not wire.check_answer("tok", nonce, wire.auth_answer("bad", nonce))
    assert not wire.check_answer("tok", nonce, wire.auth_answer("tok", wire.new_nonce()))
    assert not wire.check_answer("tok", nonce, right[:-1])
    assert not wire.check_answer("tok", nonce, b"")


@pytest.mark.parametrize("answer", [None, "tok", 0, [1], bytearray(32)])
def test_check_answer_rejects_non_bytes(answer: object) -> None:
    assert not wire.check_answer("tok", wire.new_nonce(), answer)


def test_token_bytes_is_utf8() -> None:
    assert wire.token_bytes("jöb") == "jöb".encode()


# ----------------------------------------------------------------- require
def test_require_returns_the_checked_field() -> None:
    message = {"op": "x", "n": 3, "name": "a", "t": 1.5}
    assert wire.require(message, "n", int) == 3
    assert wire.require(message, "name", str) == "a"
    assert wire.require(message, "t", (int, float)) == 1.5
    assert wire.require(message, "n", (int, float)) == 3


@pytest.mark.parametrize(
    ("key", "kind"),
    [("missing", int), ("name", int), ("n", str), ("flag", int), ("t", int), ("none", str)],
)
def test_require_rejects_missing_and_mistyped_fields(key: str, kind: type) -> None:
    message = {"op": "x", "n": 3, "name": "a", "flag": True, "t": 1.5, "none": None}
    with pytest.raises(ProtocolError, match=rf"op 'x': field '{key}'"):
        wire.require(message, key, kind)


# ----------------------------------------------------------------- addresses
@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:7779", ("127.0.0.1", 7779)),
        ("localhost:1", ("localhost", 1)),
        ("node-3.cluster:65535", ("node-3.cluster", 65535)),
        ("[::1]:7000", ("::1", 7000)),
    ],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert wire.parse_address(address) == expected


@pytest.mark.parametrize(
    "address",
    ["", "host", "host:", ":80", "host:0", "host:65536", "host:abc", "host:-1", "host: 80", "host:8o"],
)
def test_parse_address_rejects_bad_addresses_with_a_clear_line(address: str) -> None:
    with pytest.raises(ProtocolError, match=r"^bad address .*: expected HOST:PORT$"):
        wire.parse_address(address)
    with pytest.raises(ProtocolError, match=r"^bad HCA endpoint .*: expected HOST:PORT$"):
        wire.parse_address(address, "HCA endpoint")


def test_parse_address_rejects_non_ascii_digits() -> None:
    with pytest.raises(ProtocolError, match="expected HOST:PORT"):
        wire.parse_address("host:²")


# ----------------------------------------------------------------- limits and deadlines (issue #11)
def test_recv_takes_a_smaller_limit_before_authentication(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", wire.HANDSHAKE_MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match=f"limit is {wire.HANDSHAKE_MAX_FRAME}"):
        wire.recv(b, limit=wire.HANDSHAKE_MAX_FRAME)


@contextlib.contextmanager
def _trickling(sock: socket.socket, data: bytes, every: float) -> Iterator[None]:
    """Send `data` one byte every `every` seconds from another thread while the block runs."""
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(data)):
            if stop.wait(every):
                return
            sock.sendall(data[i : i + 1])

    writer = threading.Thread(target=trickle)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(5.0)


def test_recv_has_one_deadline_for_the_whole_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    # a byte every 0.1 s: each read is quick, the frame is not
    with _trickling(a, wire.encode({"op": "slow", "pad": "x" * 100}), 0.1):
        with pytest.raises(TimeoutError, match="deadline"):
            wire.recv(b, deadline=time.monotonic() + 0.5)


def test_recv_idle_counts_silence_not_frame_time(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with _trickling(a, wire.encode({"op": "slow", "pad": "x" * 20}), 0.02):
        # ~0.6 s for the frame, never 0.5 s without a byte
        assert wire.recv(b, idle=0.5)["op"] == "slow"
        with pytest.raises(TimeoutError, match=r"silent for 0\.2 s"):
            wire.recv(b, idle=0.2)


def test_recv_on_a_socket_closed_by_another_thread_is_an_os_error(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    b.close()
    with pytest.raises(OSError):
        wire.recv(b, idle=1.0)


def test_frame_reader_reassembles_pieces_and_reads_nothing_past_its_frame(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.setblocking(False)
    reader = wire.FrameReader()
    first = wire.encode({"op": "hello", "n": 1})
    assert reader.read_from(b) is None  # nothing there yet
    for byte in first[:-1]:
        a.sendall(bytes([byte]))
        assert reader.read_from(b) is None
    a.sendall(first[-1:] + wire.encode({"op": "next"}))
    assert reader.read_from(b) == {"v": V, "op": "hello", "n": 1}
    b.setblocking(True)
    assert wire.recv(b)["op"] == "next"


@pytest.mark.parametrize("announced", [wire.HANDSHAKE_MAX_FRAME + 1, 64 << 20, 0xFFFFFFFF])
def test_frame_reader_refuses_an_oversize_length_from_the_header_alone(
    pair: tuple[socket.socket, socket.socket], announced: int
) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", announced))
    with pytest.raises(ProtocolError, match="limit is 4096"):
        wire.FrameReader().read_from(b)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (struct.pack(">I", 0), ProtocolError),
        (struct.pack(">I", 2) + b"\x92\x01", ProtocolError),
        (b"\x00\x00", EOFError),  # closed inside the length
        (struct.pack(">I", 10) + b"abc", EOFError),  # closed inside the body
    ],
)
def test_frame_reader_on_garbage_and_early_closes(
    pair: tuple[socket.socket, socket.socket], data: bytes, error: type[Exception]
) -> None:
    a, b = pair
    a.sendall(data)
    a.shutdown(socket.SHUT_WR)
    reader = wire.FrameReader()
    with pytest.raises(error):
        while reader.read_from(b) is None:
            pass


def test_client_handshake_skips_heartbeats_before_the_answer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    nonce = wire.new_nonce()
    wire.send(a, {"op": "challenge", "nonce": nonce})
    wire.send(a, wire.HEARTBEAT)  # the server's writer may heartbeat before the welcome goes out
    wire.send(a, {"op": "welcome", "job": "j"})
    answer = wire.client_handshake(b, "tok", "coordinator", role="rank", then={"op": "join", "rank": 0})
    assert answer["op"] == "welcome"
    hello, join = wire.recv(a), wire.recv(a)
    assert hello == {"v": V, "op": "hello", "auth": wire.auth_answer("tok", nonce), "role": "rank"}
    assert join == {"v": V, "op": "join", "rank": 0}


def test_client_handshake_bounds_the_challenge(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", wire.HANDSHAKE_MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="limit"):
        wire.client_handshake(b, "tok", "coordinator")


def test_client_handshake_has_one_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    wire.send(a, {"op": "challenge", "nonce": wire.new_nonce()})
    with pytest.raises(TimeoutError):
        wire.client_handshake(b, "tok", "coordinator", timeout=0.3)


# ----------------------------------------------------------------- heartbeat settings
def test_heartbeat_defaults() -> None:
    assert wire.Heartbeat.from_environment({}) == wire.Heartbeat(1.0, 15.0)


def test_heartbeat_from_the_environment() -> None:
    env = {"CKPT_HEARTBEAT_INTERVAL": "0.25", "CKPT_HEARTBEAT_TIMEOUT": " 3 "}
    assert wire.Heartbeat.from_environment(env) == wire.Heartbeat(0.25, 3.0)
    assert wire.Heartbeat.from_environment({"CKPT_HEARTBEAT_TIMEOUT": "60"}) == wire.Heartbeat(1.0, 60.0)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"CKPT_HEARTBEAT_INTERVAL": "soon"}, r"CKPT_HEARTBEAT_INTERVAL='soon': expected a number of seconds"),
        ({"CKPT_HEARTBEAT_TIMEOUT": "0"}, "heartbeat timeout must be a number of seconds > 0"),
        ({"CKPT_HEARTBEAT_TIMEOUT": "-1"}, "heartbeat timeout must be"),
        ({"CKPT_HEARTBEAT_INTERVAL": "nan"}, "heartbeat interval must be"),
        ({"CKPT_HEARTBEAT_INTERVAL": "inf"}, "heartbeat interval must be"),
        ({"CKPT_HEARTBEAT_INTERVAL": "20"}, r"timeout \(15 s\) must be longer than the interval \(20 s\)"),
    ],
)
def test_bad_heartbeat_settings_are_one_clear_line(env: dict[str, str], match: str) -> None:
    with pytest.raises(ProtocolError, match=match) as caught:
        wire.Heartbeat.from_environment(env)
    assert "\n" not in str(caught.value)
