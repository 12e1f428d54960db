"""The servers' shared connection pieces: the handshake gate (before authentication) and the authenticated peer."""

from __future__ import annotations

import queue
import resource
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckpt import _wire as wire
from ckpt._gate import HandshakeGate
from ckpt._server import PeerConnection
from ckpt.testing import wait_for
from harness import closed_by_peer, trickle_until_closed

pytestmark = pytest.mark.timeout(60)

TOKEN = "gate-token-0123456789"
WAIT = 5.0
Handed = queue.Queue[tuple[socket.socket, str, dict[str, Any]]]


class Gate:
    """A running gate on 127.0.0.1 whose authenticated connections land in `handed`."""

    def __init__(self, **kwargs: Any) -> None:
        listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.address = listener.getsockname()[:2]
        self.handed: Handed = queue.Queue()
        self.gate = HandshakeGate(
            listener, TOKEN, lambda sock, peer, hello: self.handed.put((sock, peer, hello)), name="test-gate", **kwargs
        ).start()

    def connect(self) -> tuple[socket.socket, bytes]:
        """A client socket past the challenge: (socket, nonce)."""
        sock = socket.create_connection(self.address, timeout=WAIT)
        challenge = wire.recv(sock)
        assert challenge["op"] == "challenge"
        return sock, challenge["nonce"]

    def hello(self, nonce: bytes, **fields: Any) -> bytes:
        return wire.encode({"op": "hello", "auth": wire.auth_answer(TOKEN, nonce), **fields})


@pytest.fixture
def start_gate() -> Iterator[Callable[..., Gate]]:
    gates: list[Gate] = []

    def start(**kwargs: Any) -> Gate:
        gates.append(Gate(**kwargs))
        return gates[-1]

    yield start
    for gate in gates:
        gate.gate.stop()
        while not gate.handed.empty():
            gate.handed.get()[0].close()


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """Room for a few thousand sockets in this process (the soft limit is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if wanted < 4096:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def assert_closed_soon(sock: socket.socket, timeout: float = WAIT) -> None:
    try:
        assert closed_by_peer(sock, timeout), "the gate kept a bad connection open"
    finally:
        sock.close()


# ----------------------------------------------------------------- the good path
def test_an_authenticated_hello_is_handed_over_with_what_follows_it(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate()
    sock, nonce = gate.connect()
    sock.sendall(gate.hello(nonce, role="rank") + wire.encode({"op": "join", "argv": ["x" * 50_000]}))
    served, peer, hello = gate.handed.get(timeout=WAIT)
    with served:
        assert hello["role"] == "rank" and peer == "{}:{}".format(*sock.getsockname()[:2])
        assert served.gettimeout() is None  # blocking again, for the server's reader thread
        served.settimeout(WAIT)
        assert wire.recv(served) == {"v": wire.PROTOCOL_VERSION, "op": "join", "argv": ["x" * 50_000]}
    sock.close()
    stats = gate.gate.statistics()
    assert (stats.pending, stats.accepted, stats.authenticated) == (0, 1, 1)


def test_a_hello_in_single_bytes_within_the_deadline_is_accepted(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate()
    sock, nonce = gate.connect()
    for byte in gate.hello(nonce, role="control"):
        sock.sendall(bytes([byte]))
    served, _, hello = gate.handed.get(timeout=WAIT)
    served.close()
    sock.close()
    assert hello["role"] == "control"


# ----------------------------------------------------------------- hostile peers
@pytest.mark.parametrize("announced", [wire.HANDSHAKE_MAX_FRAME + 1, 64 << 20, 0xFFFFFFFF])
def test_a_frame_over_the_handshake_limit_is_refused_from_its_length_alone(
    start_gate: Callable[..., Gate], announced: int
) -> None:
    gate = start_gate(timeout=60.0)  # what closes it is the length, not the deadline
    sock, _ = gate.connect()
    sock.sendall(struct.pack(">I", announced) + b"x" * 100)
    assert_closed_soon(sock)
    assert gate.gate.statistics().refused == 1


def test_a_frame_at_the_handshake_limit_is_read(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate()
    sock, nonce = gate.connect()
    hello = gate.hello(nonce, role="control", pad="")
    pad = "p" * (wire.HANDSHAKE_MAX_FRAME - (len(hello) - 4) - 2)  # the str header grows by 2 bytes
    hello = gate.hello(nonce, role="control", pad=pad)
    assert len(hello) - 4 == wire.HANDSHAKE_MAX_FRAME
    sock.sendall(hello)
    served, _, message = gate.handed.get(timeout=WAIT)
    served.close()
    sock.close()
    assert message["pad"] == pad


def test_a_trickled_hello_hits_one_deadline_for_the_whole_handshake(start_gate: Callable[..., Gate]) -> None:
    timeout = 1.0
    gate = start_gate(timeout=timeout)
    sock, nonce = gate.connect()
    data = gate.hello(nonce, role="control", pad="p" * 1000)
    # One byte every 0.2 s: a per-read timeout would never fire; the one deadline must.
    elapsed, _ = trickle_until_closed(sock, data, pace=0.2)
    sock.close()
    assert timeout - 0.3 <= elapsed <= timeout + 2.0, elapsed
    assert gate.gate.statistics().expired == 1
    assert gate.handed.empty()


@pytest.mark.parametrize(
    "message",
    [
        {"op": "status", "good_auth": True},  # right answer, wrong op
        {"op": "heartbeat"},
        {"op": "hello"},  # no answer
        {"op": "hello", "auth": "not bytes"},
        {"op": "hello", "auth": b"\x00" * 32},  # a wrong answer
        {"op": "hello", "wrong_token": True},
    ],
)
def test_a_wrong_op_or_answer_closes_that_connection_and_nothing_else(
    start_gate: Callable[..., Gate], message: dict[str, Any]
) -> None:
    gate = start_gate()
    good, good_nonce = gate.connect()  # a handshake in progress next to the bad one
    sock, nonce = gate.connect()
    fields = dict(message)
    if fields.pop("good_auth", False):
        fields["auth"] = wire.auth_answer(TOKEN, nonce)
    if fields.pop("wrong_token", False):
        fields["auth"] = wire.auth_answer("another-token", nonce)
    sock.sendall(wire.encode(fields))
    assert_closed_soon(sock)
    good.sendall(gate.hello(good_nonce, role="control"))
    served, _, _ = gate.handed.get(timeout=WAIT)
    served.close()
    good.close()
    assert gate.gate.statistics().refused == 1


@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">I", 0),  # an empty frame
        struct.pack(">I", 3) + b"abc",  # not msgpack
        struct.pack(">I", 3) + b"\x93\x01\x02",  # not a map
        struct.pack(">I", 4) + b"\x81\xa1v\x63",  # {"v": 99}: another version, no op
    ],
)
def test_garbage_closes_that_connection_and_the_gate_keeps_serving(
    start_gate: Callable[..., Gate], data: bytes
) -> None:
    gate = start_gate()
    sock, _ = gate.connect()
    sock.sendall(data)
    assert_closed_soon(sock)
    again, nonce = gate.connect()
    again.sendall(gate.hello(nonce, role="control"))
    served, _, _ = gate.handed.get(timeout=WAIT)
    served.close()
    again.close()


def test_a_refusal_is_sent_to_a_wrong_answer_when_asked(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate(refusal="authentication failed")
    sock, nonce = gate.connect()
    sock.sendall(wire.encode({"op": "hello", "auth": wire.auth_answer("wrong", nonce)}))
    try:
        assert wire.recv(sock) == {
            "v": wire.PROTOCOL_VERSION,
            "op": "refused",
            "error": "authentication failed",
        }
    except ConnectionResetError:  # the close may overtake the refusal; the connection is closed either way
        pass
    assert_closed_soon(sock)


def test_a_bad_hello_field_raised_by_the_server_closes_the_connection(start_gate: Callable[..., Gate]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def on_hello(sock: socket.socket, peer: str, hello: dict[str, Any]) -> None:
        raise wire.ProtocolError("unknown role")

    gate = HandshakeGate(listener, TOKEN, on_hello, name="test-gate").start()
    try:
        sock = socket.create_connection(listener.getsockname()[:2], timeout=WAIT)
        nonce = wire.recv(sock)["nonce"]
        sock.sendall(wire.encode({"op": "hello", "auth": wire.auth_answer(TOKEN, nonce)}))
        assert_closed_soon(sock)
    finally:
        gate.stop()


def test_the_oldest_handshake_makes_room_past_the_limit(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate(max_pending=3)
    socks = [gate.connect()[0] for _ in range(5)]
    try:
        assert closed_by_peer(socks[0], WAIT) and closed_by_peer(socks[1], WAIT)
        assert not any(closed_by_peer(s, 0.2) for s in socks[2:])
        stats = gate.gate.statistics()
        assert (stats.pending, stats.dropped) == (3, 2)
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.usefixtures("many_descriptors")
def test_a_thousand_pending_handshakes_cost_no_thread_and_little_memory(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate(timeout=60.0)
    threads = threading.active_count()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        hostile = []
        for i in range(1000):
            sock = socket.create_connection(gate.address, timeout=WAIT)
            # Half announce a 64 MiB frame (refused at once), half sit on a nearly complete 4 KiB one.
            if i % 2:
                sock.sendall(struct.pack(">I", 64 << 20))
            else:
                sock.sendall(struct.pack(">I", wire.HANDSHAKE_MAX_FRAME) + b"\x81" + b"x" * 4000)
            hostile.append(sock)
        sock, nonce = gate.connect()  # and an honest client still gets in
        sock.sendall(gate.hello(nonce, role="control"))
        served, _, _ = gate.handed.get(timeout=WAIT)
        served.close()
        sock.close()
        stats = wait_for(lambda: (s := gate.gate.statistics()).refused == 500 and s, WAIT, "500 refusals")
        grown = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    try:
        assert stats.pending == 500
        assert threading.active_count() <= threads  # none per handshake (one of an earlier test may have ended)
        # 500 sockets each side, 500 buffers of 4 KiB: a few MB (one 64 MiB buffer would be 64).
        assert grown < 16 << 20, f"{grown} bytes traced"
    finally:
        for sock in hostile:
            sock.close()


def test_stop_closes_pending_handshakes_and_the_port(start_gate: Callable[..., Gate]) -> None:
    gate = start_gate()
    sock, _ = gate.connect()
    gate.gate.stop()
    assert_closed_soon(sock)
    with pytest.raises(OSError):
        socket.create_connection(gate.address, timeout=WAIT).close()
    gate.gate.stop()  # idempotent


def test_stop_of_a_gate_never_started_closes_its_port() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    HandshakeGate(listener, TOKEN, lambda *args: None, name="test-gate").stop()
    assert listener.fileno() == -1


# ----------------------------------------------------------------- the authenticated peer
@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    b.settimeout(WAIT)
    yield a, b
    a.close()
    b.close()


def test_an_idle_peer_connection_sends_heartbeats(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    conn = PeerConnection(a, "peer", thread_name="test-w", heartbeat_interval=0.05)
    try:
        assert wire.recv(b)["op"] == "heartbeat"
        assert wire.recv(b)["op"] == "heartbeat"
        conn.post({"op": "push", "n": 1})
        while (message := wire.recv(b))["op"] == "heartbeat":
            pass
        assert message["n"] == 1
    finally:
        conn.abort()


def test_without_an_interval_there_are_no_heartbeats(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    conn = PeerConnection(a, "peer", thread_name="test-w", heartbeat_interval=None)
    try:
        b.settimeout(0.3)
        with pytest.raises(TimeoutError):
            wire.recv(b)
    finally:
        conn.abort()


def test_close_sends_what_was_posted_first(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    conn = PeerConnection(a, "peer", thread_name="test-w", heartbeat_interval=None)
    for n in range(3):
        conn.post({"op": "reply", "n": n})
    conn.close()
    conn.post({"op": "late"})  # dropped: the connection is closing
    assert [wire.recv(b)["n"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(EOFError):
        wire.recv(b)
    conn.flushed(WAIT)
    assert not conn._writer.is_alive()


def test_abort_wakes_a_writer_blocked_on_a_peer_that_does_not_read(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    conn = PeerConnection(a, "peer", thread_name="test-w", heartbeat_interval=None)
    for _ in range(64):
        conn.post({"op": "push", "data": b"x" * 65536})  # far more than the socket buffers hold
    conn.close()
    conn.flushed(0.3)
    assert conn._writer.is_alive(), "the writer should be blocked on the full socket"
    conn.abort()
    conn.flushed(WAIT)
    assert not conn._writer.is_alive()


def test_close_delivers_the_last_frame_to_a_tcp_peer_whose_input_was_never_read() -> None:
    # A socket closed with unread input sends a reset, and a reset may destroy what is still queued for
    # the peer: the last reply would be lost. The writer discards that input before it closes.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the frame queues up
        client.settimeout(WAIT)
        client.connect(listener.getsockname()[:2])
        server, _ = listener.accept()
    conn = PeerConnection(server, "peer", thread_name="test-w", heartbeat_interval=None)
    try:
        client.sendall(b"\0" * 65536)  # never read by the server's side (it has no reader here)
        last = b"y" * (4 << 20)  # more than the socket buffers hold: much of it is queued at close
        conn.post({"op": "reply", "last": last})
        conn.close()
        assert wire.recv(client, deadline=time.monotonic() + WAIT)["last"] == last
        with pytest.raises(EOFError):
            wire.recv(client)
        conn.flushed(WAIT)
        assert not conn._writer.is_alive()
    finally:
        conn.abort()
        client.close()
