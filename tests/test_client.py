"""The coordinator server and its client together, in-process, over loopback TCP."""

from __future__ import annotations

import queue
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest

from ckpt import _wire as wire
from ckpt._errors import CoordinatorError
from ckpt.coordinator.client import CoordinatorClient, control
from ckpt.coordinator.server import Coordinator
from ckpt.plugin import STATS_NS
from harness import trickle_until_closed

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-0123456789"
WAIT = 5.0


# ----------------------------------------------------------------- fixtures and helpers
@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path).start()
    yield coord
    coord.stop()


@pytest.fixture
def connect(coordinator: Coordinator) -> Iterator[Callable[..., CoordinatorClient]]:
    """connect(hello=None, token=TOKEN, **client_kwargs) -> a client closed at teardown."""
    clients: list[CoordinatorClient] = []

    def make(hello: dict[str, Any] | None = None, token: str = TOKEN, **kwargs: Any) -> CoordinatorClient:
        client = CoordinatorClient(coordinator.address, token, hello or {"role": "control"}, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def rank_hello(rank: int, size: int, **extra: Any) -> dict[str, Any]:
    return {
        "role": "rank",
        "rank": rank,
        "size": size,
        "pid": 1000 + rank,
        "host": "h",
        "program": {"name": "p", "path": "/p.py", "class": "P", "sha256": ""},  # a manifest needs all four
        **extra,
    }


@pytest.fixture
def ranks(connect: Callable[..., CoordinatorClient]) -> Callable[..., list[CoordinatorClient]]:
    """ranks(n) -> n joined rank clients of one job."""

    def make(size: int, **kwargs: Any) -> list[CoordinatorClient]:
        return [connect(rank_hello(r, size), **kwargs) for r in range(size)]

    return make


def status(coordinator: Coordinator) -> dict[str, Any]:
    """Ask over the wire, with a fresh control connection (so it proves the coordinator still serves)."""
    client = control(coordinator.address, TOKEN)
    try:
        return client.call("status", reply_timeout=WAIT)["status"]
    finally:
        client.close()


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        tick.wait(0.01)


def _collective(client: CoordinatorClient, seq: int, kind: str, step: int, data: Any) -> dict[str, Any]:
    return client.call("collective", reply_timeout=WAIT, seq=seq, kind=kind, step=step, data=data)


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def raw_connect(coordinator: Coordinator) -> tuple[socket.socket, bytes]:
    """A plain socket past the server's challenge; returns (socket, nonce)."""
    host, port = wire.parse_address(coordinator.address)
    sock = socket.create_connection((host, port), timeout=WAIT)
    challenge = wire.recv(sock)
    assert challenge["op"] == "challenge" and isinstance(challenge["nonce"], bytes)
    return sock, challenge["nonce"]


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """The next message that is not a heartbeat."""
    while (message := wire.recv(sock))["op"] == "heartbeat":
        pass
    return message


def send_rank_hello(sock: socket.socket, nonce: bytes, rank: int, size: int, **extra: Any) -> None:
    """What CoordinatorClient sends for a rank: the hello (authentication), then the join (who it is)."""
    wire.send(sock, {"op": "hello", "auth": wire.auth_answer(TOKEN, nonce), "role": "rank"})
    fields = {k: v for k, v in rank_hello(rank, size, **extra).items() if k != "role"}
    wire.send(sock, {"op": "join", **fields})


def raw_control(coordinator: Coordinator) -> socket.socket:
    """A plain socket authenticated as a control client."""
    sock, nonce = raw_connect(coordinator)
    wire.send(sock, {"op": "hello", "auth": wire.auth_answer(TOKEN, nonce), "role": "control"})
    assert recv_message(sock)["op"] == "welcome"
    return sock


class RawRank:
    """A rank spoken to frame by frame.

    Needed for "subscribe": its server-side "timeout" field cannot be sent through
    CoordinatorClient.call (its own wait is `reply_timeout`).
    """

    def __init__(self, coordinator: Coordinator, rank: int, size: int) -> None:
        self.sock, nonce = raw_connect(coordinator)
        send_rank_hello(self.sock, nonce, rank, size)
        self.welcome = recv_message(self.sock)
        assert self.welcome["op"] == "welcome"
        self._ids = iter(range(1, 1_000_000))

    def send(self, op: str, **fields: Any) -> int:
        rid = next(self._ids)
        wire.send(self.sock, {"op": op, "id": rid, **fields})
        return rid

    def recv(self, timeout: float = WAIT) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        return recv_message(self.sock)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        rid = self.send(op, **fields)
        reply = self.recv()
        assert reply["op"] == "reply" and reply["id"] == rid, reply
        return reply

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_rank(coordinator: Coordinator) -> Iterator[Callable[[int, int], RawRank]]:
    made: list[RawRank] = []

    def make(rank: int, size: int) -> RawRank:
        made.append(RawRank(coordinator, rank, size))
        return made[-1]

    yield make
    for raw in made:
        raw.close()


def assert_closed_by_server(sock: socket.socket) -> None:
    """The server closes the connection (replies already queued may come first)."""
    try:
        while True:
            wire.recv(sock)
    except (EOFError, ConnectionResetError):
        pass
    except TimeoutError:
        pytest.fail("the coordinator kept a bad connection open")
    finally:
        sock.close()


# ----------------------------------------------------------------- control connections and status
def test_control_client_gets_a_welcome_and_status(
    connect: Callable[..., CoordinatorClient], coordinator: Coordinator
) -> None:
    client = connect()
    assert client.welcome["op"] == "welcome"
    assert client.welcome["address"] == coordinator.address
    answer = client.call("status", reply_timeout=WAIT)
    assert answer["op"] == "reply"
    assert answer["status"]["state"] == "waiting"
    assert answer["status"]["ranks"] == []


def test_status_shows_what_each_ranks_plugins_publish_as_statistics(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    r0, r1 = ranks(2)
    r1.call("publish", reply_timeout=WAIT, ns=STATS_NS, key="1/apm", value={"rearms": 2})
    r1.call("publish", reply_timeout=WAIT, ns=STATS_NS, key="1/other", value=[1])
    r0.call("publish", reply_timeout=WAIT, ns=STATS_NS, key="10/apm", value={"rearms": 9})  # rank 10 is not rank 1
    shown = [r["plugins"] for r in status(coordinator)["ranks"]]
    assert shown == [{}, {"apm": {"rearms": 2}, "other": [1]}]


def test_status_shape(coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]) -> None:
    clients = ranks(2)
    job = clients[0].welcome["job"]
    assert clients[1].welcome["job"] == job
    assert clients[0].welcome["generation"] == 0 and clients[0].welcome["size"] == 2
    st = status(coordinator)
    assert {"job", "generation", "state", "unanimous", "ranks", "last_checkpoint"} <= st.keys()
    assert st["job"] == job
    assert st["generation"] == 0
    assert st["state"] == "running"
    assert st["unanimous"] is True
    assert st["last_checkpoint"] is None
    assert (st["fallbacks"], st["checkpoint_holds"]) == (None, [])
    shown = {"step": 0, "host": "h", "incarnation": 0, "replay": None, "plugins": {}, "latest_image": None}
    assert st["ranks"] == [
        {"rank": 0, "state": "running", "pid": 1000, **shown},
        {"rank": 1, "state": "running", "pid": 1001, **shown},
    ]


def test_status_follows_steps_and_finished_ranks(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    r0, r1 = ranks(2)
    r0.notify("step", step=7)
    r1.call("finished", reply_timeout=WAIT, result="42", step=3)
    wait_until(lambda: status(coordinator)["ranks"][0]["step"] == 7)
    st = status(coordinator)
    assert [(r["state"], r["step"]) for r in st["ranks"]] == [("running", 7), ("finished", 3)]
    assert st["state"] == "running"  # the minimum over the ranks
    assert st["unanimous"] is False


def test_all_ranks_finished_ends_the_job(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    pushes: list[dict[str, Any]] = []
    done = threading.Event()

    def on_push(message: dict[str, Any]) -> None:
        pushes.append(message)
        done.set()

    r0, r1 = ranks(2, on_push=on_push)
    r0.call("finished", reply_timeout=WAIT, result="a", step=2)
    r1.call("finished", reply_timeout=WAIT, result=None, step=2)
    assert coordinator.ended.wait(WAIT)
    assert coordinator.outcome is not None
    assert coordinator.outcome["status"] == "finished"
    assert coordinator.outcome["results"] == {0: "a", 1: None}
    assert done.wait(WAIT)
    assert pushes[0]["op"] == "done"
    assert status(coordinator)["state"] == "finished"


def test_kill_from_a_control_client(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]], connect: Callable[..., CoordinatorClient]
) -> None:
    killed = threading.Event()
    reasons: list[str] = []

    def on_push(message: dict[str, Any]) -> None:
        if message["op"] == "kill":
            reasons.append(message["reason"])
            killed.set()

    ranks(1, on_push=on_push)
    connect().call("kill", reply_timeout=WAIT, reason="enough")
    assert killed.wait(WAIT)
    assert reasons == ["enough"]
    assert coordinator.outcome == {
        "status": "killed",
        "message": "enough",
        "results": {0: None},
        "last_checkpoint": None,
    }


# ----------------------------------------------------------------- authentication
def test_wrong_token_is_refused_and_others_are_still_served(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    for _ in range(3):
        with pytest.raises(CoordinatorError, match="wrong CKPT_TOKEN"):
            connect(token="not-the-token")
        with pytest.raises(CoordinatorError):
            connect(rank_hello(0, 1), token="")
    assert connect().call("status", reply_timeout=WAIT)["status"]["ranks"] == []
    r0 = connect(rank_hello(0, 1))
    assert r0.welcome["size"] == 1


def test_a_wrong_token_does_not_disturb_a_running_job(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]], connect: Callable[..., CoordinatorClient]
) -> None:
    r0, r1 = ranks(2)
    with pytest.raises(CoordinatorError):
        connect(rank_hello(1, 2), token="bad")
    r0.call("publish", reply_timeout=WAIT, ns="n", key="k", value=1)
    assert r1.call("get", reply_timeout=WAIT, ns="n", key="k")["value"] == 1
    assert coordinator.outcome is None
    assert [r["state"] for r in status(coordinator)["ranks"]] == ["running", "running"]


def test_the_token_never_travels_in_clear(coordinator: Coordinator) -> None:
    sock, nonce = raw_connect(coordinator)
    hello = wire.encode({"op": "hello", "auth": wire.auth_answer(TOKEN, nonce), "role": "control"})
    assert TOKEN.encode() not in hello
    sock.sendall(hello)
    assert recv_message(sock)["op"] == "welcome"
    sock.close()


def test_a_replayed_answer_is_refused(coordinator: Coordinator) -> None:
    sock, nonce = raw_connect(coordinator)
    answer = wire.auth_answer(TOKEN, nonce)
    wire.send(sock, {"op": "hello", "auth": answer, "role": "control"})
    assert recv_message(sock)["op"] == "welcome"
    sock.close()
    sock, _ = raw_connect(coordinator)  # a new nonce: the old answer is worthless
    wire.send(sock, {"op": "hello", "auth": answer, "role": "control"})
    assert_closed_by_server(sock)
    assert status(coordinator)["ranks"] == []


@pytest.mark.parametrize(
    "hello",
    [
        {"op": "status", "role": "control"},  # right answer, wrong op
        {"op": "hello", "role": "control", "auth": "a string"},
        {"op": "hello", "role": "control"},  # no answer at all
        {"op": "hello", "role": "superuser", "good_auth": True},
        {"op": "hello", "good_auth": True},  # no role
        {"op": "hello", "role": 7, "good_auth": True},
        {"op": "join", "role": "rank", "rank": 0, "size": 1, "good_auth": True},  # the join before the hello
    ],
)
def test_bad_hellos_close_the_connection(coordinator: Coordinator, hello: dict[str, Any]) -> None:
    sock, nonce = raw_connect(coordinator)
    message = dict(hello)
    if message.pop("good_auth", False) or message["op"] == "status":
        message["auth"] = wire.auth_answer(TOKEN, nonce)
    wire.send(sock, message)
    assert_closed_by_server(sock)
    assert status(coordinator)["ranks"] == []


@pytest.mark.parametrize(
    "join",
    [
        {"op": "join"},  # no rank / size
        {"op": "join", "rank": "0", "size": 1},
        {"op": "join", "rank": True, "size": 1},
        {"op": "join", "rank": 0, "size": None},
        {"op": "status", "id": 1},  # anything but a join
        {"op": "hello", "role": "rank", "rank": 0, "size": 1},
    ],
)
def test_bad_joins_close_the_connection(coordinator: Coordinator, join: dict[str, Any]) -> None:
    sock, nonce = raw_connect(coordinator)
    wire.send(sock, {"op": "hello", "auth": wire.auth_answer(TOKEN, nonce), "role": "rank"})
    wire.send(sock, join)
    assert_closed_by_server(sock)
    assert status(coordinator)["ranks"] == []


@pytest.mark.parametrize(
    ("hello", "match"),
    [
        (rank_hello(2, 2), "rank 2 is out of range for a job of 2 ranks"),
        (rank_hello(0, 3), "rank 0 says the job has 3 ranks, the coordinator has 2"),
        (rank_hello(0, 2), "rank 0 has already joined job"),
        (rank_hello(1, 2, program={"name": "other"}), "rank 1 runs program 'other', the job runs 'p'"),
    ],
)
def test_a_rank_that_does_not_fit_the_job_is_refused(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient], hello: dict[str, Any], match: str
) -> None:
    connect(rank_hello(0, 2))
    with pytest.raises(CoordinatorError, match=f"the coordinator refused this rank: {match}"):
        connect(hello)
    assert coordinator.outcome is None
    assert [r["rank"] for r in status(coordinator)["ranks"]] == [0]
    connect(rank_hello(1, 2))
    assert [r["rank"] for r in status(coordinator)["ranks"]] == [0, 1]


def test_a_first_rank_whose_program_entry_does_not_fit_is_refused(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    expected = "rank 0 sent a program entry that does not fit: Object missing required field `path`"
    with pytest.raises(CoordinatorError, match=f"the coordinator refused this rank: {expected}"):
        connect(rank_hello(0, 2, program={"name": "p"}))  # every manifest records the whole entry
    assert coordinator.outcome is None and status(coordinator)["ranks"] == []
    connect(rank_hello(0, 2))
    assert [r["rank"] for r in status(coordinator)["ranks"]] == [0]


# ----------------------------------------------------------------- malformed traffic on raw sockets
def _garbage(seed: int) -> list[bytes]:
    """Byte strings that are not a valid message, each to be sent on its own connection."""
    rng = random.Random(seed)
    cases = [
        struct.pack(">I", wire.MAX_FRAME + 1),  # oversize length, no body
        struct.pack(">I", 0xFFFFFFFF) + b"x" * 16,
        struct.pack(">I", 0),  # empty frame
        frame([1, 2, 3]),  # not a map
        frame("hello"),
        frame(None),
        frame({"v": 99, "op": "status"}),  # wrong version
        frame({"v": wire.PROTOCOL_VERSION}),  # no op
        frame({"v": wire.PROTOCOL_VERSION, "op": 7}),
        frame({1: 2}),  # non-string keys
    ]
    for _ in range(12):
        body = rng.randbytes(rng.randrange(1, 200))
        cases.append(struct.pack(">I", len(body)) + body)  # random body, honest length
    for _ in range(4):
        # random bytes whose first byte announces more than MAX_FRAME
        cases.append(bytes([rng.randrange(0x05, 0x100)]) + rng.randbytes(rng.randrange(3, 100)))
    return cases


def _not_a_control_request(data: bytes) -> bool:
    (length,) = struct.unpack(">I", data[:4])
    if length > wire.MAX_FRAME:
        return True
    assert length == len(data) - 4  # a frame that never completes would only hit a timeout
    try:
        message = wire.decode(data[4:])
    except wire.ProtocolError:
        return True
    return message["op"] not in ("status", "checkpoint", "kill")


def test_garbage_before_authentication_closes_only_that_connection(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    watcher = connect()
    for data in _garbage(seed=1):
        sock, _ = raw_connect(coordinator)
        sock.sendall(data)
        assert_closed_by_server(sock)
    assert watcher.call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"
    assert status(coordinator)["ranks"] == []


def test_garbage_after_authentication_closes_only_that_connection(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    watcher = connect()
    cases = _garbage(seed=2)
    assert all(_not_a_control_request(c) for c in cases)
    for data in cases:
        sock = raw_control(coordinator)
        sock.sendall(data)
        assert_closed_by_server(sock)
    assert watcher.call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"


@pytest.mark.parametrize(
    "message",
    [
        {"op": "frobnicate"},
        {"op": "publish", "ns": "n", "key": "k", "value": 1},  # a rank op on a control connection
        {"op": "reply", "id": 1},
        {"op": ""},
    ],
)
def test_unknown_ops_close_the_connection(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient], message: dict[str, Any]
) -> None:
    watcher = connect()
    sock = raw_control(coordinator)
    wire.send(sock, {**message, "id": 1})
    answer = recv_message(sock)  # answered with what was wrong, then closed
    assert answer["id"] == 1 and f"unknown op {message['op']!r} for a control connection" in answer["error"]
    assert_closed_by_server(sock)
    assert watcher.call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"


def test_garbage_after_a_good_request_closes_the_connection(coordinator: Coordinator) -> None:
    sock = raw_control(coordinator)
    # the reply to the status request may or may not be sent before the connection is torn down
    sock.sendall(wire.encode({"op": "status", "id": 1}) + b"\x00\x00\x00\x03abc")
    assert_closed_by_server(sock)
    assert status(coordinator)["state"] == "waiting"


def test_a_silent_connection_does_not_block_others(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    host, port = wire.parse_address(coordinator.address)
    silent = [socket.create_connection((host, port), timeout=WAIT) for _ in range(5)]
    half = raw_connect(coordinator)[0]
    half.sendall(struct.pack(">I", 1000) + b"partial")  # a frame that never completes
    try:
        assert connect().call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"
        connect(rank_hello(0, 1))
    finally:
        for sock in [*silent, half]:
            sock.close()


def test_garbage_from_a_rank_fails_the_job_naming_it(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    connect(rank_hello(0, 2))
    sock, nonce = raw_connect(coordinator)
    send_rank_hello(sock, nonce, 1, 2)
    assert recv_message(sock)["op"] == "welcome"
    sock.sendall(frame(["not", "a", "map"]))
    assert_closed_by_server(sock)
    assert coordinator.ended.wait(WAIT)
    assert coordinator.outcome is not None and coordinator.outcome["status"] == "failed"
    assert "rank 1" in coordinator.outcome["message"]


# ----------------------------------------------------------------- before authentication (issue #11)
@pytest.mark.parametrize("announced", [wire.HANDSHAKE_MAX_FRAME + 1, wire.MAX_FRAME])
def test_a_large_frame_before_authentication_is_refused_at_once(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient], announced: int
) -> None:
    # The socket timeout (5 s) is shorter than the handshake deadline (10 s): only a refusal from the
    # announced length closes it in time; a server that waits for the body (after allocating it) does not.
    watcher = connect()
    sock, _ = raw_connect(coordinator)
    sock.sendall(struct.pack(">I", announced) + b"x" * 100)
    assert_closed_by_server(sock)
    assert watcher.call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"


def test_a_trickled_handshake_hits_one_deadline(tmp_path: Path) -> None:
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path, handshake_timeout=1.0).start()
    try:
        sock, nonce = raw_connect(coord)
        hello = wire.encode({"op": "hello", "auth": wire.auth_answer(TOKEN, nonce), "role": "control"})
        elapsed, _ = trickle_until_closed(sock, hello, pace=0.2)
        sock.close()
        assert elapsed <= 3.0
        assert status(coord)["state"] == "waiting"
    finally:
        coord.stop()


def test_a_rank_with_a_command_line_over_the_handshake_limit_joins(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    argv = [f"--option-{i}=" + "v" * 100 for i in range(100)]  # what a rank says about itself comes after the hello
    connect(rank_hello(0, 1, argv=argv))
    assert coordinator.job.argv == argv
    assert [r["rank"] for r in status(coordinator)["ranks"]] == [0]


# ----------------------------------------------------------------- heartbeats (issue #11)
QUICK = wire.Heartbeat(interval=0.1, timeout=1.0)


@pytest.fixture
def quick(tmp_path: Path) -> Iterator[Coordinator]:
    """A coordinator that heartbeats every 0.1 s and drops a peer silent for 1 s."""
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path / "quick", heartbeat=QUICK).start()
    yield coord
    coord.stop()


def test_the_coordinator_sends_heartbeats_to_an_idle_client(quick: Coordinator) -> None:
    sock = raw_control(quick)
    sock.settimeout(WAIT)
    assert [wire.recv(sock)["op"] for _ in range(3)] == ["heartbeat"] * 3
    sock.close()


def test_a_silent_rank_is_lost_within_the_heartbeat_timeout(quick: Coordinator) -> None:
    talking = CoordinatorClient(quick.address, TOKEN, rank_hello(1, 2), heartbeat=QUICK)
    silent = RawRank(quick, 0, 2)  # joins, then says nothing, ever
    start = time.monotonic()
    try:
        assert quick.ended.wait(WAIT)
        elapsed = time.monotonic() - start
        assert QUICK.timeout - 0.2 <= elapsed <= QUICK.timeout + 2.0, elapsed
        assert quick.outcome is not None and quick.outcome["status"] == "failed"
        assert quick.outcome["message"] == (
            "rank 0 (pid 1000 on h) was lost at step 0 (no word from it for 1 s); "
            "there is no checkpoint to restart from"
        )
    finally:
        talking.close()
        silent.close()


def test_clients_that_heartbeat_stay_in_the_job(quick: Coordinator) -> None:
    ranks = [CoordinatorClient(quick.address, TOKEN, rank_hello(r, 2), heartbeat=QUICK) for r in range(2)]
    watcher = CoordinatorClient(quick.address, TOKEN, {"role": "control"}, heartbeat=QUICK)
    try:
        assert not quick.ended.wait(3 * QUICK.timeout), quick.outcome
        assert [r["state"] for r in status(quick)["ranks"]] == ["running", "running"]
        assert watcher.call("status", reply_timeout=WAIT)["status"]["state"] == "running"
    finally:
        for client in [*ranks, watcher]:
            client.close()


def test_a_silent_control_client_is_closed_and_the_job_goes_on(quick: Coordinator) -> None:
    rank = CoordinatorClient(quick.address, TOKEN, rank_hello(0, 1), heartbeat=QUICK)
    sock = raw_control(quick)
    assert_closed_by_server(sock)
    assert quick.outcome is None
    rank.close()


def test_stop_sends_what_was_already_posted(coordinator: Coordinator) -> None:
    # e.g. the answer to `ckpt checkpoint --kill`: posted as the job ends, just before the launcher stops.
    sock = raw_control(coordinator)
    (conn,) = coordinator._connections
    for rid in range(100):
        conn.post({"op": "reply", "id": rid, "pad": b"x" * 65536})  # more than the socket buffers hold
    stopper = threading.Thread(target=coordinator.stop)
    stopper.start()
    try:
        assert [recv_message(sock)["id"] for _ in range(100)] == list(range(100))
        assert_closed_by_server(sock)
    finally:
        stopper.join(WAIT)


def stop_when_ended(coordinator: Coordinator) -> threading.Thread:
    """A thread that stops the coordinator the moment its job ends, as the launcher does."""

    def watch() -> None:
        if coordinator.ended.wait(WAIT):
            coordinator.stop()

    watcher = threading.Thread(target=watch, name="test-stopper")
    watcher.start()
    return watcher


@pytest.mark.parametrize("last", ["kill", "finished"])
def test_the_last_reply_arrives_although_the_job_ends_and_the_coordinator_stops(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient], last: str
) -> None:
    # The reply to `ckpt kill` or to the last rank's `finished` is posted after the job has ended, so the
    # launcher may be stopping the coordinator already: stop() must send it, not drop it.
    rank = connect(rank_hello(0, 1))
    asker = connect() if last == "kill" else rank
    (conn,) = [c for c in coordinator._connections if c.role == ("control" if last == "kill" else "rank")]
    for _ in range(8):  # pushes the client ignores, queued ahead of the reply: it is still queued at stop()
        conn.post({"op": "padding", "pad": b"x" * (1 << 20)})
    watcher = stop_when_ended(coordinator)
    try:
        if last == "kill":
            answer = asker.call("kill", reply_timeout=WAIT, reason="enough")
        else:
            answer = asker.call("finished", reply_timeout=WAIT, step=1, result="done")
        assert "error" not in answer and answer["op"] == "reply"
    finally:
        watcher.join(WAIT)
    assert not watcher.is_alive()
    assert coordinator.outcome is not None
    assert coordinator.outcome["status"] == ("killed" if last == "kill" else "finished")


class SilentCoordinator:
    """Completes the handshake like a coordinator, then never says a word; counts the client's heartbeats."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = "{}:{}".format(*self._server.getsockname()[:2])
        self.heartbeats = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        with conn:
            wire.send(conn, {"op": "challenge", "nonce": wire.new_nonce()})
            wire.recv(conn)
            wire.send(conn, {"op": "welcome", "job": "j", "address": self.address})
            try:
                while True:
                    self.heartbeats += wire.recv(conn)["op"] == "heartbeat"
            except (EOFError, OSError):
                pass

    def close(self) -> None:
        self._server.close()
        self._thread.join(WAIT)


def test_a_client_hears_a_silent_coordinator_within_its_timeout() -> None:
    server = SilentCoordinator()
    lost: queue.Queue[tuple[str, bool]] = queue.Queue()
    calls: list[Future[dict[str, Any]]] = []
    # on_lost runs before the waiting calls fail: a rank that exits there says why once, not twice.
    client = CoordinatorClient(
        server.address, TOKEN, {"role": "control"}, heartbeat=QUICK, on_lost=lambda r: lost.put((r, calls[0].done()))
    )
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(1) as pool:
            calls.append(pool.submit(client.call, "status"))
            reason, call_failed_first = lost.get(timeout=WAIT)
            elapsed = time.monotonic() - start
            assert reason == f"no word from the coordinator at {server.address} for 1 s"
            assert not call_failed_first
            with pytest.raises(CoordinatorError, match=r"^no word from the coordinator at \S+ for 1 s$"):
                calls[0].result(WAIT)
        assert QUICK.timeout - 0.2 <= elapsed <= QUICK.timeout + 2.0, elapsed
        assert server.heartbeats >= 3  # it kept sending its own while it waited
    finally:
        client.close()
        server.close()


def test_a_handshake_that_never_ends_is_one_clear_error() -> None:
    server = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does) but never challenges
    try:
        with pytest.raises(CoordinatorError, match=r"^the coordinator at \S+ did not answer within 0.5 s$"):
            CoordinatorClient(
                "{}:{}".format(*server.getsockname()[:2]), TOKEN, {"role": "control"}, connect_timeout=0.5
            )
    finally:
        server.close()


# ----------------------------------------------------------------- client errors
def test_client_to_an_address_nobody_listens_on() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # held, never listening: refused, and no other test can take the port
        port = probe.getsockname()[1]
        with pytest.raises(CoordinatorError, match=rf"cannot reach the coordinator at 127.0.0.1:{port}"):
            CoordinatorClient(f"127.0.0.1:{port}", TOKEN, {"role": "control"}, connect_timeout=WAIT)


def test_client_with_a_bad_address() -> None:
    with pytest.raises(CoordinatorError, match=r"^bad coordinator address 'nocolon': expected HOST:PORT$"):
        CoordinatorClient("nocolon", TOKEN, {"role": "control"})


def test_client_to_something_that_is_not_a_coordinator() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(frame({"v": wire.PROTOCOL_VERSION, "op": "greetings"}))
            conn.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(CoordinatorError, match="the peer is not a ckpt coordinator"):
            CoordinatorClient(f"127.0.0.1:{port}", TOKEN, {"role": "control"}, connect_timeout=WAIT)
    finally:
        thread.join(WAIT)
        server.close()


def test_a_lost_coordinator_fails_pending_calls(
    coordinator: Coordinator, connect: Callable[..., CoordinatorClient]
) -> None:
    lost = threading.Event()
    reasons: list[str] = []

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    r0 = connect(rank_hello(0, 2), on_lost=on_lost)
    connect(rank_hello(1, 2))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_collective, r0, 1, "allgather", 1, None)
        wait_until(lambda: status(coordinator)["ranks"][0]["step"] == 1)
        coordinator.stop()
        with pytest.raises(CoordinatorError, match="lost"):
            pending.result(WAIT)
    assert lost.wait(WAIT)
    assert "connection to the coordinator" in reasons[0]
    with pytest.raises(CoordinatorError, match="lost"):
        r0.call("get", reply_timeout=WAIT, ns="n", key="x")


def test_call_timeout_on_the_client_side(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    r0, _ = ranks(2)
    with pytest.raises(CoordinatorError, match=r"no answer from the coordinator to 'collective' within 0.2 s"):
        r0.call("collective", reply_timeout=0.2, seq=1, kind="barrier", step=0, data=None)


# ----------------------------------------------------------------- key-value store across ranks
def test_publish_and_get_across_ranks(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    r0, r1 = ranks(2)
    r0.call("publish", reply_timeout=WAIT, ns="n", key="k", value={"lid": 7, "raw": b"\x01", "l": [1, None]})
    assert r1.call("get", reply_timeout=WAIT, ns="n", key="k")["value"] == {"lid": 7, "raw": b"\x01", "l": [1, None]}
    assert r1.call("get", reply_timeout=WAIT, ns="other", key="k") == {
        "v": wire.PROTOCOL_VERSION,
        "op": "reply",
        "id": 2,
        "found": False,
        "value": None,
    }


def test_subscribe_blocks_until_another_rank_publishes(
    connect: Callable[..., CoordinatorClient], raw_rank: Callable[[int, int], RawRank]
) -> None:
    r0 = connect(rank_hello(0, 2))
    r1 = raw_rank(1, 2)
    sub = r1.send("subscribe", ns="ib", key="rank0/lid", timeout=30.0)
    # one connection's requests are handled in order: the get is answered after the subscribe
    # was registered, and a subscribe reply would have been sent before it
    assert r1.call("get", ns="ib", key="rank0/lid")["found"] is False
    r0.call("publish", reply_timeout=WAIT, ns="ib", key="other", value=0)
    r0.call("publish", reply_timeout=WAIT, ns="other", key="rank0/lid", value=0)
    assert r1.call("get", ns="ib", key="x")["found"] is False
    r0.call("publish", reply_timeout=WAIT, ns="ib", key="rank0/lid", value={"lid": 7})
    reply = r1.recv()
    assert (reply["id"], reply["value"]) == (sub, {"lid": 7})


def test_subscribe_to_a_published_key_answers_at_once(
    connect: Callable[..., CoordinatorClient], raw_rank: Callable[[int, int], RawRank]
) -> None:
    r0 = connect(rank_hello(0, 2))
    r1 = raw_rank(1, 2)
    r0.call("publish", reply_timeout=WAIT, ns="n", key="k", value=[1, 2])
    assert r1.call("subscribe", ns="n", key="k", timeout=0)["value"] == [1, 2]


def test_prefix_subscribe_with_count_across_ranks(
    connect: Callable[..., CoordinatorClient], raw_rank: Callable[[int, int], RawRank]
) -> None:
    watcher = raw_rank(0, 3)
    clients = [connect(rank_hello(r, 3)) for r in (1, 2)]
    sub = watcher.send("subscribe", ns="ib", key="qpn/", prefix=True, count=3, timeout=30.0)
    watcher.call("publish", ns="ib", key="qpn/0", value=100)
    for r, client in enumerate(clients, start=1):
        assert watcher.call("get", ns="ib", key="nothing")["found"] is False  # still waiting
        client.call("publish", reply_timeout=WAIT, ns="ib", key=f"qpn/{r}", value=100 + r)
    reply = watcher.recv()
    assert reply["id"] == sub
    assert reply["values"] == {"qpn/0": 100, "qpn/1": 101, "qpn/2": 102}


def test_subscribe_timeout_is_an_error(coordinator: Coordinator, raw_rank: Callable[[int, int], RawRank]) -> None:
    r0 = raw_rank(0, 1)
    start = time.monotonic()
    assert "timed out waiting for key n/never" in r0.call("subscribe", ns="n", key="never", timeout=0.2)["error"]
    answer = r0.call("subscribe", ns="n", key="p", prefix=True, count=2, timeout=0.1)
    assert "timed out waiting for 2 keys with prefix n/p" in answer["error"]
    assert time.monotonic() - start < 3.0
    assert coordinator.outcome is None


def test_an_error_reply_raises_coordinator_error(
    connect: Callable[..., CoordinatorClient], raw_rank: Callable[[int, int], RawRank]
) -> None:
    # raw frames here check the server side on its own; the
    # {"error"} reply is provoked with a collective mismatch instead.
    r0 = connect(rank_hello(0, 2))
    r1 = raw_rank(1, 2)
    r1.send("collective", seq=1, kind="barrier", step=0, data=None)
    with pytest.raises(CoordinatorError, match="does not match"):
        r0.call("collective", reply_reply_timeout=WAIT, seq=1, kind="allgather", step=0, data=None)


def test_subscribe_timeouts_of_several_subscribers(
    connect: Callable[..., CoordinatorClient], raw_rank: Callable[[int, int], RawRank]
) -> None:
    r0 = raw_rank(0, 2)
    publisher = connect(rank_hello(1, 2))
    late = r0.send("subscribe", ns="n", key="a", timeout=0.8)
    early = r0.send("subscribe", ns="n", key="b", timeout=0.1)
    served = r0.send("subscribe", ns="n", key="c", timeout=0.6)
    first = r0.recv()
    assert first["id"] == early and "n/b" in first["error"]
    publisher.call("publish", reply_timeout=WAIT, ns="n", key="c", value=3)
    second = r0.recv()
    assert second["id"] == served and second["value"] == 3
    third = r0.recv()
    assert third["id"] == late and "n/a" in third["error"]


def test_runtime_kv_subscribe_works_over_the_client(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    from ckpt._program import KeyValue

    r0, r1 = ranks(2)
    KeyValue(r0).publish("n", "k", 5)
    try:
        assert KeyValue(r1).subscribe("n", "k", timeout=2.0) == 5
        with pytest.raises(CoordinatorError, match="timed out waiting for key n/missing"):
            KeyValue(r1).subscribe("n", "missing", timeout=0.1)
        assert KeyValue(r1).subscribe_prefix("n", "k", 1, timeout=2.0) == {"k": 5}
    finally:
        assert coordinator.outcome is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_huge_subscribe_timeout_does_not_break_later_timeouts(
    coordinator: Coordinator, raw_rank: Callable[[int, int], RawRank]
) -> None:
    r0, r1 = raw_rank(0, 2), raw_rank(1, 2)
    r0.send("subscribe", ns="n", key="forever", timeout=600_000.0)
    r0.call("get", ns="n", key="x")  # the huge subscribe is registered
    for key in ("short", "later"):
        rid = r1.send("subscribe", ns="n", key=key, timeout=0.05)
        try:
            reply = r1.recv(timeout=2.0)
        except TimeoutError:
            pytest.fail(f"the timeout of the subscribe to n/{key} never fired")
        assert reply["id"] == rid and f"timed out waiting for key n/{key}" in reply["error"]
        coordinator._scheduler._thread.join(0.5)  # the timer thread goes back to the huge deadline


# ----------------------------------------------------------------- atomic ops and ids
def test_atomic_ops(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    r0, r1 = ranks(2)
    assert r0.call("atomic", reply_timeout=WAIT, kind="incrby", ns="n", key="c", operand=5)["value"] == 5
    assert r1.call("atomic", reply_timeout=WAIT, kind="incrby", ns="n", key="c", operand=-1)["value"] == 4
    assert r0.call("atomic", reply_timeout=WAIT, kind="min", ns="n", key="lo", operand=9)["value"] == 9
    assert r1.call("atomic", reply_timeout=WAIT, kind="min", ns="n", key="lo", operand=3)["value"] == 3
    assert r0.call("atomic", reply_timeout=WAIT, kind="min", ns="n", key="lo", operand=4)["value"] == 3
    assert r0.call("atomic", reply_timeout=WAIT, kind="max", ns="n", key="hi", operand=-5)["value"] == -5
    assert r1.call("atomic", reply_timeout=WAIT, kind="max", ns="n", key="hi", operand=8)["value"] == 8
    assert r1.call("get", reply_timeout=WAIT, ns="n", key="c")["value"] == 4


def test_atomic_errors_are_replies_not_disconnects(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    (r0,) = ranks(1)
    r0.call("publish", reply_timeout=WAIT, ns="n", key="s", value="text")
    with pytest.raises(CoordinatorError, match="n/s holds a str, not an integer"):
        r0.call("atomic", reply_timeout=WAIT, kind="incrby", ns="n", key="s", operand=1)
    with pytest.raises(CoordinatorError, match="unknown atomic op 'mul'"):
        r0.call("atomic", reply_timeout=WAIT, kind="mul", ns="n", key="c", operand=2)
    assert r0.call("atomic", reply_timeout=WAIT, kind="incrby", ns="n", key="c", operand=2)["value"] == 2
    assert coordinator.outcome is None


def test_concurrent_incrby_from_several_ranks_loses_nothing(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    clients = ranks(3)

    def bump(client: CoordinatorClient) -> list[int]:
        return [
            client.call("atomic", reply_timeout=WAIT, kind="incrby", ns="n", key="c", operand=1)["value"]
            for _ in range(40)
        ]

    with ThreadPoolExecutor(3) as pool:
        seen = [v for values in pool.map(bump, clients) for v in values]
    assert sorted(seen) == list(range(1, 121))


def test_alloc_ids_are_unique_across_clients(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    clients = ranks(3)

    def allocate(client: CoordinatorClient, seed: int) -> list[int]:
        rng = random.Random(seed)
        ids: list[int] = []
        for _ in range(25):
            count = rng.randrange(1, 5)
            first = client.call("alloc_ids", reply_timeout=WAIT, ns="vid:qp", count=count)["first"]
            ids.extend(range(first, first + count))
        return ids

    with ThreadPoolExecutor(3) as pool:
        blocks = list(pool.map(allocate, clients, range(3)))
    every = [i for block in blocks for i in block]
    assert len(every) == len(set(every))
    assert sorted(every) == list(range(1, len(every) + 1))
    assert clients[0].call("alloc_ids", reply_timeout=WAIT, ns="vid:cq", count=1)["first"] == 1


def test_alloc_ids_with_a_bad_count_drops_that_rank(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    (r0,) = ranks(1)
    # answered with what was wrong, then the connection closes: the rank is lost
    with pytest.raises(CoordinatorError, match=r"op 'alloc_ids'.*>= 1.*\$\.count"):
        r0.call("alloc_ids", reply_timeout=WAIT, ns="n", count=0)
    assert coordinator.ended.wait(WAIT)
    assert "rank 0" in coordinator.outcome["message"]  # type: ignore[index]


# ----------------------------------------------------------------- collectives
def test_allgather_returns_values_in_rank_order(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    clients = ranks(3)
    with ThreadPoolExecutor(3) as pool:
        for seq in (1, 2, 3):
            # submit in reverse rank order so that arrival order differs from rank order
            futures = [
                pool.submit(_collective, clients[r], seq, "allgather", seq, {"rank": r, "seq": seq})
                for r in reversed(range(3))
            ]
            for future in futures:
                assert future.result(WAIT)["values"] == [{"rank": r, "seq": seq} for r in range(3)]


def test_collective_barrier_releases_everyone(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    clients = ranks(3)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_collective, c, 1, "barrier", 0, None) for c in clients]
        assert [f.result(WAIT)["values"] for f in futures] == [[None, None, None]] * 3


def test_a_collective_waits_for_the_last_rank(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    clients = ranks(3)
    with ThreadPoolExecutor(3) as pool:
        first = [pool.submit(_collective, clients[r], 1, "allgather", 4, r) for r in (0, 1)]
        wait_until(lambda: [r["step"] for r in status(coordinator)["ranks"]] == [4, 4, 0])
        assert not any(f.done() for f in first)
        assert _collective(clients[2], 1, "allgather", 4, 2)["values"] == [0, 1, 2]
        assert [f.result(WAIT)["values"] for f in first] == [[0, 1, 2]] * 2


def test_mismatched_collective_kinds_are_an_error_to_all(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    clients = ranks(3)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_collective, clients[r], 1, "allgather", 5 + r, r) for r in (0, 1)]
        wait_until(lambda: [r["step"] for r in status(coordinator)["ranks"]] == [5, 6, 0])
        futures.append(pool.submit(_collective, clients[2], 1, "barrier", 9, None))
        messages = []
        for future in futures:
            with pytest.raises(CoordinatorError, match="collective #1 does not match across ranks") as info:
                future.result(WAIT)
            messages.append(str(info.value))
    assert all(m == messages[0] for m in messages)
    assert "rank 0: allgather in step 5" in messages[0]
    assert "rank 1: allgather in step 6" in messages[0]
    assert "rank 2: barrier in step 9" in messages[0]


def test_a_collective_a_finished_rank_never_enters_fails(
    ranks: Callable[..., list[CoordinatorClient]],
) -> None:
    r0, r1 = ranks(2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_collective, r0, 1, "allgather", 3, "x")
        r1.call("finished", reply_timeout=WAIT, result=None, step=3)
        with pytest.raises(CoordinatorError, match=r"allgather #1 can never complete: rank\(s\) \[1\] finished"):
            waiting.result(WAIT)


def test_collectives_out_of_step_fail_instead_of_hanging(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    """Ranks restarted from images of different moments wait in different collectives: none can complete."""
    r0, r1, r2 = ranks(3)
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(_collective, r0, 7, "allgather", 40, "a"),
            pool.submit(_collective, r1, 7, "allgather", 40, "b"),
        ]
        wait_until(lambda: [r["step"] for r in status(coordinator)["ranks"]] == [40, 40, 0])
        assert not any(f.done() for f in futures)  # rank 2 may still come: not out of step yet
        futures.append(pool.submit(_collective, r2, 9, "allgather", 42, "c"))
        for future in futures:
            with pytest.raises(CoordinatorError, match="collectives out of step, none can complete") as info:
                future.result(WAIT)
    assert "rank 0 in allgather #7 (step 40)" in str(info.value) and "rank 2 in allgather #9 (step 42)" in str(
        info.value
    )


def test_a_manifest_records_the_settings_asked_for_not_a_debug_wait(tmp_path: Path) -> None:
    from ckpt._schemas import JobRecord
    from ckpt.coordinator.job import JobSettings

    plain = JobSettings(token="t", ckpt_dir=tmp_path, interval=2.0, keep=3, phase_timeout=50.0)
    assert plain.recorded() == JobRecord(interval=2.0, keep=3, phase_timeout=50.0)
    debug = JobSettings(token="t", ckpt_dir=tmp_path, phase_timeout=7 * 24 * 3600.0, recorded_phase_timeout=50.0)
    assert debug.recorded().phase_timeout == 50.0


def test_status_names_the_job_before_any_rank_joins(tmp_path: Path) -> None:
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path, job_id="feedface0001").start()
    try:
        state = status(coord)
        assert state["job"] == "feedface0001" and state["state"] == "waiting" and state["ranks"] == []
    finally:
        coord.stop()


# ----------------------------------------------------------------- named barriers
def test_named_barrier_gathers_values(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    clients = ranks(3)
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(c.call, "barrier", WAIT, name="ib:published", value={"r": r}) for r, c in enumerate(clients)
        ]
        for future in futures:
            assert future.result(WAIT)["values"] == [{"r": 0}, {"r": 1}, {"r": 2}]


def test_named_barrier_mismatch_is_an_error_not_a_hang(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    r0, r1 = ranks(2)
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(r0.call, "barrier", WAIT, name="plugin:a", value=None)
        b = pool.submit(r1.call, "barrier", WAIT, name="plugin:b", value=None)
        for future in (a, b):
            with pytest.raises(CoordinatorError, match="barrier name mismatch"):
                future.result(WAIT)
    # both connections stay usable
    with ThreadPoolExecutor(2) as pool:
        again = [pool.submit(c.call, "barrier", WAIT, name="plugin:c", value=i) for i, c in enumerate((r0, r1))]
        assert [f.result(WAIT)["values"] for f in again] == [[0, 1], [0, 1]]


def test_a_rank_scoped_barrier_completes_with_that_rank_alone_beside_a_job_barrier(
    ranks: Callable[..., list[CoordinatorClient]],
) -> None:
    r0, r1 = ranks(2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(r0.call, "barrier", WAIT, name="job:plugin:x", value=0)  # r1 has not come
        own = r1.call("barrier", reply_timeout=WAIT, name="rank1.ckpt4:DRAIN", value="mine")
        assert own["values"] == [None, "mine"]  # no name mismatch with rank 0's job barrier
        with pytest.raises(CoordinatorError, match=r"a barrier of rank\(s\) \[1\] only"):
            r0.call("barrier", reply_timeout=WAIT, name="rank1.ckpt4:RESUME", value=None)
        r1.call("barrier", reply_timeout=WAIT, name="job:plugin:x", value=1)
        assert waiting.result(WAIT)["values"] == [0, 1]


def test_a_named_barrier_waits_for_ranks_that_have_not_joined_yet(
    connect: Callable[..., CoordinatorClient],
) -> None:
    r0 = connect(rank_hello(0, 2))
    with ThreadPoolExecutor(1) as pool:
        early = pool.submit(r0.call, "barrier", WAIT, name="gen1:RESTART", value="a")
        r0.call("get", reply_timeout=WAIT, ns="n", key="x")  # the barrier request has been handled
        r1 = connect(rank_hello(1, 2))
        late = r1.call("barrier", reply_timeout=WAIT, name="gen1:RESTART", value="b")
        assert late["values"] == ["a", "b"]
        assert early.result(WAIT)["values"] == ["a", "b"]


# ----------------------------------------------------------------- losing a rank
def test_a_rank_closing_its_socket_fails_the_job_naming_it(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    killed = threading.Event()
    reasons: list[str] = []

    def on_push(message: dict[str, Any]) -> None:
        if message["op"] == "kill":
            reasons.append(message["reason"])
            killed.set()

    clients = ranks(3, on_push=on_push)
    clients[0].notify("step", step=12)
    clients[1].close()
    assert coordinator.ended.wait(WAIT)
    outcome = coordinator.outcome
    assert outcome is not None and outcome["status"] == "failed"
    assert "rank 1 (pid 1001 on h) was lost" in outcome["message"]
    assert "no checkpoint to restart from" in outcome["message"]
    assert killed.wait(WAIT)
    assert "rank 1" in reasons[0]
    st = status(coordinator)
    assert st["state"] == "failed"
    assert [r["state"] for r in st["ranks"]] == ["killed", "failed", "killed"]


def test_a_lost_rank_ends_the_job_and_refuses_late_joiners(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]]
) -> None:
    r0, r1 = ranks(2)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_collective, r0, 1, "allgather", 1, "x")
        wait_until(lambda: status(coordinator)["ranks"][0]["step"] == 1)
        r1.close()
        assert coordinator.ended.wait(WAIT)
        r0.close()  # a real rank exits on the "kill" push; its pending call then fails
        with pytest.raises(CoordinatorError):
            pending.result(WAIT)
    assert "rank 1" in coordinator.outcome["message"]  # type: ignore[index]
    with pytest.raises(CoordinatorError, match=r"job \w+ has already ended \(failed\)"):
        CoordinatorClient(coordinator.address, TOKEN, rank_hello(1, 2))


def test_closing_a_control_client_does_not_touch_the_job(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]], connect: Callable[..., CoordinatorClient]
) -> None:
    ranks(1)
    connect().close()
    assert status(coordinator)["state"] == "running"
    assert coordinator.outcome is None


def test_a_mistyped_field_is_a_protocol_error_not_a_crash(
    coordinator: Coordinator, raw_rank: Callable[[int, int], RawRank], monkeypatch: pytest.MonkeyPatch
) -> None:
    crashes: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    r0 = raw_rank(0, 1)
    reader = "ckpt-coord-r-{}:{}".format(*r0.sock.getsockname()[:2])
    r0.send("subscribe", ns="n", key="k", timeout=1.0, count="many")
    assert_closed_by_server(r0.sock)
    assert coordinator.ended.wait(WAIT)  # the connection is closed either way: the rank is lost
    wait_until(lambda: reader not in [t.name for t in threading.enumerate()])
    assert crashes == []


def test_an_absurd_subscribe_timeout_is_a_protocol_error(
    coordinator: Coordinator, raw_rank: Callable[[int, int], RawRank]
) -> None:
    r0 = raw_rank(0, 2)
    r0.send("subscribe", ns="n", key="forever", timeout=1e12)
    answer = r0.recv(timeout=5.0)
    assert "op 'subscribe'" in answer["error"] and "$.timeout" in answer["error"]
    with pytest.raises((EOFError, OSError)):
        r0.recv(timeout=5.0)


def test_values_with_integer_keys_travel_through_the_store(ranks: Callable[..., list[CoordinatorClient]]) -> None:
    r0, r1 = ranks(2)
    r0.call("publish", reply_timeout=WAIT, ns="n", key="k", value={1: "one", 2: [3, 4]})
    assert r1.call("get", reply_timeout=WAIT, ns="n", key="k")["value"] == {1: "one", 2: [3, 4]}


def test_an_allgather_answer_over_the_frame_limit_is_an_error_not_a_lost_rank(
    coordinator: Coordinator, ranks: Callable[..., list[CoordinatorClient]], monkeypatch: pytest.MonkeyPatch
) -> None:
    r0, r1 = ranks(2)
    monkeypatch.setattr(wire, "MAX_FRAME", 1 << 20)
    payload = b"x" * (600 << 10)  # each request fits; the answer (both) does not
    answers: dict[int, BaseException | dict[str, Any]] = {}

    def gather(rank: int, client: CoordinatorClient) -> None:
        try:
            answers[rank] = _collective(client, 1, "allgather", 0, payload)
        except CoordinatorError as exc:
            answers[rank] = exc

    threads = [threading.Thread(target=gather, args=(r, c)) for r, c in enumerate((r0, r1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert all(isinstance(a, CoordinatorError) and "frame limit" in str(a) for a in answers.values()), answers
    assert coordinator.outcome is None, "no rank may be taken for lost"
