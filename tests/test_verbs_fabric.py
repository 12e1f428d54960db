"""The simulated fabric's subnet manager and client: LIDs, routing, link pushes, authentication, parsing."""

from __future__ import annotations

import itertools
import os
import queue
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckpt import CkptError
from ckpt import _wire as wire
from ckpt.verbs import _subnet, fabric
from ckpt.verbs.fabric import (
    FabricClient,
    FabricError,
    LinkModel,
    SubnetManager,
    parse_bandwidth,
    parse_latency,
)
from harness import closed_by_peer, trickle_until_closed

pytestmark = pytest.mark.timeout(60)

PUSH_TIMEOUT = 10.0
StartSM = Callable[..., SubnetManager]
Connect = Callable[..., FabricClient]


@pytest.fixture
def connect() -> Iterator[Callable[..., FabricClient]]:
    clients: list[FabricClient] = []

    def make(sm: SubnetManager, on_link: Callable[[int, bool], None] | None = None) -> FabricClient:
        client = FabricClient(sm.address, sm.token, on_link)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


class Pushes:
    """Collects a client's link pushes; `next()` waits for one."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[int, bool]] = queue.Queue()

    def __call__(self, lid: int, up: bool) -> None:
        self.queue.put((lid, up))

    def next(self) -> tuple[int, bool]:
        return self.queue.get(timeout=PUSH_TIMEOUT)

    def take(self, count: int) -> set[tuple[int, bool]]:
        return {self.next() for _ in range(count)}


def register(client: FabricClient, guid: int, port: int = 7000) -> dict[str, Any]:
    return client.register(guid=guid, name="simib0", endpoint=f"127.0.0.1:{port + guid}", pid=os.getpid(), host="h")


# ----------------------------------------------------------- LIDs
def test_every_hca_gets_two_unique_unicast_lids(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    client = connect(sm)
    lids = [lid for guid in range(40) for lid in register(client, guid)["lids"]]
    assert len(lids) == 80
    assert len(set(lids) | {sm.sm_lid}) == 81
    assert all(1 <= lid <= fabric.MAX_UNICAST_LID for lid in [*lids, sm.sm_lid])


def test_lids_are_not_sequential_and_differ_between_fabrics(start_sm: StartSM, connect: Connect) -> None:
    first, second = start_sm(), start_sm()
    a = [lid for guid in range(5) for lid in register(connect(first), guid)["lids"]]
    b = [lid for guid in range(5) for lid in register(connect(second), guid)["lids"]]
    assert a != b
    for lids in (a, b):
        assert all(abs(y - x) != 1 for x, y in itertools.pairwise(lids)), lids


def test_a_fabric_never_hands_out_a_lid_twice() -> None:
    allocator = _subnet._LidAllocator(random.Random(7))
    lids = [allocator.allocate() for _ in range(fabric.MAX_UNICAST_LID)]
    assert sorted(lids) == list(range(1, fabric.MAX_UNICAST_LID + 1))
    with pytest.raises(FabricError, match="all 49151 unicast LIDs"):
        allocator.allocate()


# ----------------------------------------------------------- registration, routing
def test_register_hands_out_the_link_model_and_every_known_link(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm(link_model=LinkModel(latency=2e-6, bandwidth=4e9))
    first = register(connect(sm), 1)
    second = register(connect(sm), 2)
    assert second["latency"] == 2e-6 and second["bandwidth"] == 4e9
    assert second["sm_lid"] == sm.sm_lid and second["fabric"] == sm.fabric_id
    assert second["links"] == {lid: True for lid in [*first["lids"], *second["lids"]]}


def test_resolve_and_routes(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    owner, other = connect(sm), connect(sm)
    lid1, lid2 = register(owner, 1)["lids"]
    assert other.resolve(lid1) == ("127.0.0.1:7001", 1, True)
    assert other.resolve(lid2) == ("127.0.0.1:7001", 2, True)
    assert other.resolve(sm.sm_lid) == (None, None, False)
    routes = other.routes()
    assert routes[lid2] == {"endpoint": "127.0.0.1:7001", "port": 2, "up": True, "name": "simib0", "pid": os.getpid()}
    assert set(routes) == {lid1, lid2}
    assert sm.statistics().resolves == 3


def test_a_guid_registers_once(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    register(connect(sm), 5)
    with pytest.raises(FabricError, match="already registered"):
        register(connect(sm), 5)


def test_a_bad_endpoint_is_refused(start_sm: StartSM, connect: Connect) -> None:
    client = connect(start_sm())
    with pytest.raises(FabricError, match="bad HCA endpoint"):
        client.register(guid=1, name="simib0", endpoint="nowhere", pid=1, host="h")


# ----------------------------------------------------------- link faults
def test_fail_and_restore_reach_every_hca(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    owner_pushes, peer_pushes = Pushes(), Pushes()
    owner, peer = connect(sm, owner_pushes), connect(sm, peer_pushes)
    register(peer, 2)
    lids = register(owner, 1)["lids"]
    assert peer_pushes.take(2) == {(lid, True) for lid in lids}  # the new HCA's ports came up
    lid = lids[0]
    control = connect(sm)
    control.fail_link(lid)
    assert owner_pushes.next() == (lid, False)
    assert peer_pushes.next() == (lid, False)
    assert control.resolve(lid) == ("127.0.0.1:7001", 1, False)
    control.fail_link(lid)  # already down: nothing changes, nothing is pushed
    sm.restore_link(lid)  # in-process fault injection has the same effect as the request
    assert owner_pushes.next() == (lid, True)
    assert peer_pushes.next() == (lid, True)
    stats = sm.statistics()
    assert (stats.links_failed, stats.links_restored) == (1, 1)
    assert owner_pushes.queue.empty() and peer_pushes.queue.empty()


def test_an_unknown_lid_is_an_error_reply(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    client = connect(sm)
    unknown = 1 if sm.sm_lid != 1 else 2
    with pytest.raises(FabricError, match=f"no HCA port has LID {unknown} on fabric {sm.fabric_id}"):
        client.fail_link(unknown)
    with pytest.raises(FabricError, match="subnet manager's own LID"):
        client.restore_link(sm.sm_lid)
    with pytest.raises(FabricError):
        sm.fail_link(-1)
    assert client.status()["fabric"] == sm.fabric_id  # the connection survives an error reply


def test_a_dead_hca_leaves_the_fabric_and_its_links_go_down(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    pushes = Pushes()
    survivor = connect(sm, pushes)
    register(survivor, 1)
    dying = FabricClient(sm.address, sm.token)
    lids = register(dying, 2)["lids"]
    assert pushes.take(2) == {(lid, True) for lid in lids}
    dying.close()
    assert pushes.take(2) == {(lid, False) for lid in lids}
    assert survivor.resolve(lids[0]) == (None, None, False)
    assert set(survivor.routes()).isdisjoint(lids)
    stats = sm.statistics()
    assert (stats.hcas_registered, stats.hcas_present, stats.hcas_lost) == (2, 1, 1)
    assert [h["name"] for h in sm.status()["hcas"]] == ["simib0"]


def test_a_node_gets_its_lids_and_its_cut_cables_back_after_its_process_died(
    start_sm: StartSM, connect: Connect
) -> None:
    """A cable belongs to the node, not to the process: port 1 fails while the node's first HCA lives, port 2
    while no HCA is on the node; the node's next HCA gets the same LIDs with both links still down."""
    sm = start_sm()
    pushes = Pushes()
    survivor = connect(sm, pushes)
    register(survivor, 1)

    def on_node(client: FabricClient, guid: int) -> dict[str, Any]:
        return client.register(guid=guid, name="simib0", endpoint="127.0.0.1:7100", pid=1, host="h", node="rank3")

    first = FabricClient(sm.address, sm.token)
    lids = on_node(first, 2)["lids"]
    assert pushes.take(2) == {(lid, True) for lid in lids}
    survivor.fail_link(lids[0])
    assert pushes.next() == (lids[0], False)
    first.close()
    assert pushes.next() == (lids[1], False)  # it left: its live port went down with it
    survivor.fail_link(lids[1])  # the node's cable, with no process on the node
    (node,) = sm.status()["nodes"]
    assert (node["node"], node["present"]) == ("rank3", False)
    assert [(p["lid"], p["up"]) for p in node["ports"]] == [(lids[0], False), (lids[1], False)]
    stranger = register(connect(sm), 3)["lids"]
    assert pushes.take(2) == {(lid, True) for lid in stranger}
    assert set(stranger).isdisjoint(lids)  # a process without a node never gets a node's LIDs
    again = on_node(connect(sm), 4)
    assert again["lids"] == lids and again["links"][lids[0]] is False and again["links"][lids[1]] is False
    assert pushes.take(2) == {(lid, False) for lid in lids}
    assert [p["up"] for h in sm.status()["hcas"] if h["node"] == "rank3" for p in h["ports"]] == [False, False]
    twin = on_node(connect(sm), 5)["lids"]  # the node's LIDs are held: a second HCA there gets its own
    assert set(twin).isdisjoint(lids)
    survivor.restore_link(lids[0])
    assert pushes.take(3) == {(lid, True) for lid in twin} | {(lids[0], True)}
    assert sm.statistics().links_failed == 2 and sm.statistics().links_restored == 1


def test_a_node_name_must_be_a_string(start_sm: StartSM, connect: Connect) -> None:
    client = connect(start_sm())
    with pytest.raises(FabricError, match="bad 'node'"):
        client._call("register", guid=1, name="simib0", endpoint="127.0.0.1:7001", pid=1, host="h", node=7)


def test_stop_closes_every_connection_without_link_pushes(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    pushes, lost = Pushes(), queue.Queue[str]()
    hca = FabricClient(sm.address, sm.token, pushes, on_lost=lost.put)
    register(hca, 1)
    connect(sm).stop()
    assert sm.wait(PUSH_TIMEOUT)
    assert "lost" in lost.get(timeout=PUSH_TIMEOUT)
    assert pushes.queue.empty()
    with pytest.raises(FabricError):
        hca.resolve(1)
    with pytest.raises(FabricError, match="cannot reach"):
        FabricClient(sm.address, sm.token, timeout=5)
    sm.stop()  # idempotent
    hca.close()


def test_wait_returns_only_after_the_reply_to_stop_has_been_sent(
    start_sm: StartSM, connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ckpt fabric start` exits when wait() returns: the connections' writers must be done by then."""
    writers_may_finish = threading.Event()
    shutdown = _subnet._Connection._shutdown

    def held_shutdown(conn: Any) -> None:  # a writer that has sent its frames but is not done yet
        writers_may_finish.wait(timeout=PUSH_TIMEOUT)
        shutdown(conn)

    monkeypatch.setattr(_subnet._Connection, "_shutdown", held_shutdown)
    sm = start_sm()
    connect(sm).stop()  # its reply came: the frame was sent before the writer's shutdown
    assert not sm.wait(0.3), "wait() returned while a connection's writer was still running"
    writers_may_finish.set()
    assert sm.wait(PUSH_TIMEOUT)


# ----------------------------------------------------------- security and errors
def test_a_wrong_token_is_refused_and_the_fabric_keeps_serving(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm()
    with pytest.raises(FabricError, match="CKPT_FABRIC_TOKEN") as caught:
        FabricClient(sm.address, "not-the-token")
    assert isinstance(caught.value, CkptError) and "\n" not in str(caught.value)
    host, port = sm.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"\xff\xff\xff\xffgarbage")
    assert register(connect(sm), 1)["fabric"] == sm.fabric_id


def _raw(sm: SubnetManager) -> tuple[socket.socket, bytes]:
    """A plain socket past the SM's challenge: (socket, nonce)."""
    host, port = wire.parse_address(sm.address)
    sock = socket.create_connection((host, port), timeout=PUSH_TIMEOUT)
    return sock, wire.recv(sock)["nonce"]


@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">I", wire.HANDSHAKE_MAX_FRAME + 1),  # refused from its length, body or not
        struct.pack(">I", wire.MAX_FRAME) + b"x" * 100,
        struct.pack(">I", 3) + b"abc",
        wire.encode({"op": "register", "guid": 1}),  # a request before the hello
        wire.encode({"op": "hello", "auth": b"\x00" * 32}),
    ],
)
def test_bad_frames_before_authentication_close_that_connection_at_once(
    start_sm: StartSM, connect: Connect, data: bytes
) -> None:
    sm = start_sm()  # 10 s handshake deadline: closing within 5 s is the server's doing
    sock, _ = _raw(sm)
    with sock:
        sock.sendall(data)
        assert closed_by_peer(sock, 5.0), "the subnet manager kept a bad connection open"
    assert register(connect(sm), 1)["fabric"] == sm.fabric_id


def test_a_trickled_handshake_hits_one_deadline(start_sm: StartSM, connect: Connect) -> None:
    sm = start_sm(handshake_timeout=1.0)
    sock, nonce = _raw(sm)
    with sock:
        hello = wire.encode({"op": "hello", "auth": wire.auth_answer(sm.token, nonce)})
        elapsed, _ = trickle_until_closed(sock, hello, pace=0.2)
    assert elapsed <= 3.0
    assert register(connect(sm), 1)["fabric"] == sm.fabric_id


def test_a_taken_port_is_one_clear_error(start_sm: StartSM) -> None:
    sm = start_sm()
    port = int(sm.address.rsplit(":", 1)[1])
    with pytest.raises(FabricError, match=rf"cannot start a subnet manager on 127.0.0.1:{port}: .*in use"):
        SubnetManager(port=port).start()


def test_an_unreachable_fabric_is_one_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # held, never listening: refused, and no other test can take the port
        address = f"127.0.0.1:{probe.getsockname()[1]}"
        with pytest.raises(FabricError, match=f"cannot reach the fabric at {address}"):
            FabricClient(address, "token", timeout=5)
    with pytest.raises(FabricError, match="bad fabric address"):
        FabricClient("no-port", "token")


# ----------------------------------------------------------- parsing the link model
@pytest.mark.parametrize(
    "text,seconds",
    [("2us", 2e-6), ("1.5ms", 1.5e-3), ("0", 0.0), ("3e-6", 3e-6), ("10ns", 1e-8), ("1s", 1.0), ("5 µs", 5e-6)],
)
def test_parse_latency(text: str, seconds: float) -> None:
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text,rate",
    [("4GB/s", 4e9), ("100MB/s", 1e8), ("10Gb/s", 1.25e9), ("1e9", 1e9), ("0", 0.0), ("2GiB/s", 2**31),
     ("800Mbps", 1e8), ("512KiB/s", 512 * 1024)],
)  # fmt: skip
def test_parse_bandwidth(text: str, rate: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["", "fast", "-2us", "2 parsecs", "1e999", "2us3"])
def test_bad_latency(text: str) -> None:
    with pytest.raises(ValueError, match="bad latency") as caught:
        parse_latency(text)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text", ["", "lots", "-1GB/s", "4GB/h", "4XB/s"])
def test_bad_bandwidth(text: str) -> None:
    with pytest.raises(ValueError, match="bad bandwidth"):
        parse_bandwidth(text)


def test_a_link_model_is_never_negative() -> None:
    with pytest.raises(ValueError, match="latency"):
        LinkModel(latency=-1.0)


# ----------------------------------------------------------- finding a fabric
def test_connect_default_without_environment_uses_one_private_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fabric.ENV_ADDRESS, raising=False)
    with fabric.connect_default() as first, fabric.connect_default() as second:
        assert first.fabric == second.fabric
        lids = register(first, 1)["lids"]
        assert second.resolve(lids[0])[0] == "127.0.0.1:7001"


def test_connect_default_follows_the_environment(start_sm: StartSM, monkeypatch: pytest.MonkeyPatch) -> None:
    sm = start_sm()
    monkeypatch.setenv(fabric.ENV_ADDRESS, sm.address)
    monkeypatch.setenv(fabric.ENV_TOKEN, sm.token)
    with fabric.connect_default() as client:
        assert client.fabric == sm.fabric_id
    monkeypatch.setenv(fabric.ENV_TOKEN, "wrong")
    with pytest.raises(FabricError, match="CKPT_FABRIC_TOKEN"):
        fabric.connect_default()
    monkeypatch.delenv(fabric.ENV_TOKEN)
    with pytest.raises(FabricError, match="CKPT_FABRIC_TOKEN is not"):
        fabric.connect_default()
