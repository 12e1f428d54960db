"""End-to-end: ckpt.verbs between real processes on one simulated fabric (programs/verbs_peer.py).

Every verb runs in a peer process (the pytest process opens no HCA, so no test leaves one bound
to a fabric that is gone); the test relays connection details between peers, injects faults
(kill -9, `ckpt fabric fail-link`) and checks what each peer reports.  Timing checks are lower
bounds, or generous upper bounds that only catch a hang.  The tests that need no subnet manager
(one-sided operations on a parked peer, a killed peer, large transfers) run on both providers:
simib, and ib2tcp's tcp (`any_fabric`: the peers' HCAs find each other through a directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckpt.testing import env, kill_pids, run
from ckpt.verbs import _enums as e
from ckpt.verbs._qpbase import ack_timeout
from ckpt.verbs.fabric import ENV_ADDRESS, ENV_TOKEN, LinkModel, SubnetManager
from harness import PROGRAMS, start_fabric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PEER = PROGRAMS / "verbs_peer.py"
SUCCESS = int(e.IBV_WC_SUCCESS)
RETRY_EXC = int(e.IBV_WC_RETRY_EXC_ERR)
FLUSH = int(e.IBV_WC_WR_FLUSH_ERR)
PATH_MIG = int(e.IBV_EVENT_PATH_MIG)
MIGRATED, ARMED = int(e.IBV_MIG_MIGRATED), int(e.IBV_MIG_ARMED)
QPS_RTS = int(e.IBV_QPS_RTS)
MiB = 1 << 20
PEER_ARGS: list[str] = []  # ["--debug"] puts the engine's debug log in each peer's stderr file


# ----------------------------------------------------------------- fabrics
class Fabric:
    """Where a fabric listens: the environment that puts a peer on it, and the device the peer opens."""

    def __init__(
        self, address: str, token: str, directory: Path | None = None, sm: SubnetManager | None = None
    ) -> None:
        self.address, self.token, self.directory, self.sm = address, token, directory, sm
        self.device = "simib0"

    @property
    def env(self) -> dict[str, str]:
        return {ENV_ADDRESS: self.address, ENV_TOKEN: self.token}

    def fail_link(self, lid: int) -> None:
        """Through the SM directly: no CLI start-up between the trigger and the failure."""
        assert self.sm is not None
        self.sm.fail_link(lid)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`ckpt fabric ARGS --dir D`, as a user types it."""
        assert self.directory is not None
        done = run("fabric", *args, "--dir", str(self.directory), timeout=60)
        assert done.returncode == 0, done.stderr
        return done


class TcpFabric(Fabric):
    """ib2tcp's tcp provider: no subnet manager, the peers' HCAs find each other through files in a directory."""

    def __init__(self, directory: Path) -> None:
        super().__init__("", "", directory)
        self.device = "tcp0"

    @property
    def env(self) -> dict[str, str]:
        return {"CKPT_TCP_DIRECTORY": str(self.directory)}


@pytest.fixture
def sm_fabric() -> Iterator[Callable[..., Fabric]]:
    """sm_fabric(latency=, bandwidth=) -> a subnet manager served from the pytest process; stopped at teardown."""
    sms: list[SubnetManager] = []

    def start(latency: float = 0.0, bandwidth: float = 0.0) -> Fabric:
        sm = SubnetManager(link_model=LinkModel(latency, bandwidth)).start()
        sms.append(sm)
        return Fabric(sm.address, sm.token, sm=sm)

    yield start
    for sm in sms:
        sm.stop()


@pytest.fixture
def any_fabric(provider: str, sm_fabric: Callable[..., Fabric], tmp_path: Path) -> Callable[[], Fabric]:
    """any_fabric() -> a fabric of the test's provider (conftest `provider`): a subnet manager, or a tcp directory."""
    if provider == "simib":
        return sm_fabric
    return lambda: TcpFabric(tmp_path / "tcp-directory")


@pytest.fixture
def cli_fabric(tmp_path: Path) -> Iterator[Callable[..., Fabric]]:
    """cli_fabric(*start_args) -> a fabric started by `ckpt fabric start --dir D`; its process is killed at teardown."""
    pids: list[int] = []

    def start(*args: str) -> Fabric:
        directory = tmp_path / f"fabric{len(pids)}"
        record, _ = start_fabric(directory, *args)
        pids.append(record["pid"])
        return Fabric(record["address"], record["token"], directory)

    yield start
    kill_pids(pids)


# ----------------------------------------------------------------- peers
class Peer:
    """One verbs_peer.py process: JSON commands in on stdin, JSON lines out on stdout (read by a thread)."""

    def __init__(self, fabric: Fabric, log_dir: Path, name: str, size: int = MiB) -> None:
        self.name = name
        self._err = open(log_dir / f"{name}.{time.monotonic_ns()}.err", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-P", str(PEER), "--size", str(size), "--device", fabric.device, *PEER_ARGS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env(**fabric.env),
            start_new_session=True,
        )
        self.pid = self.process.pid  # the peer leads its own process group (start_new_session)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> Peer:
        self.info = self.expect(lambda m: m.get("ready"), 30, "the ready line")
        assert self.info["pid"] == self.pid
        return self

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()[-4000:]

    def expect(self, match: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> dict[str, Any]:
        """The next stdout line that `match`es (earlier ones are dropped); fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {what} within {timeout} s; stderr:\n{self.stderr()}") from None
            if message is None:
                raise AssertionError(f"{self.name} exited waiting for {what}; stderr:\n{self.stderr()}")
            assert "error" not in message, f"{self.name}: {message['error']}"
            if match(message):
                return message

    def send(self, op: str, **fields: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()

    def reply(self, op: str, timeout: float = 30) -> dict[str, Any]:
        return self.expect(lambda m: m.get("op") == op, timeout, f"reply to {op!r}")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Run one command; a `timeout` field is the peer's own, the reply may take 30 s more."""
        self.send(op, **fields)
        return self.reply(op, fields.get("timeout", 0) + 30)

    def phase(self, name: str, timeout: float = 30) -> dict[str, Any]:
        return self.expect(lambda m: m.get("phase") == name, timeout, f"phase {name!r}")

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self._err):
            if stream is not None:
                stream.close()

    def remote(self) -> dict[str, Any]:
        """What the other side of a connection needs to know about this peer."""
        return {k: self.info[k] for k in ("qpn", "lid1", "lid2", "rkey", "addr")}

    def kill(self) -> None:
        """SIGKILL the peer's process group (once: a reaped PID may belong to someone else later)."""
        if self.process.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Callable[..., Peer]]:
    """peers(fabric, name, size=) -> a running Peer; every one is killed (by process group) at teardown."""
    started: list[Peer] = []

    def start(fabric: Fabric, name: str = "peer", size: int = MiB) -> Peer:
        peer = Peer(fabric, tmp_path, f"{name}{len(started) + 1}", size)
        started.append(peer)  # before waiting for it: a peer that fails to start is reaped too
        return peer.wait_ready()

    yield start
    for peer in started:
        peer.kill()
        peer.close()


def connect(a: Peer, b: Peer, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bring the RC QPs of a and b to RTS towards each other (the same options on both sides)."""
    a.send("connect", remote=b.remote(), **options)
    b.send("connect", remote=a.remote(), **options)
    return a.reply("connect"), b.reply("connect")


def statuses(wcs: list[dict[str, Any]]) -> list[int]:
    return [w["status"] for w in wcs]


# ----------------------------------------------------------------- 1. one-sided really is one-sided
TARGET_FAA, TARGET_CAS = 8192, 8200


def _one_sided_on_parked_target(target: Peer, initiator: Peer, park: str) -> None:
    initiator.call("fill", offset=0, length=4096, seed=11)
    expected = initiator.call("peek", offset=0, length=4096)["hex"]
    target.call("set_u64", values={TARGET_FAA: 1000, TARGET_CAS: 77})
    connect(initiator, target)

    target.send(park, seconds=30 if park == "sleep" else 10)  # both end at SIGUSR1
    parked = target.phase("sleeping" if park == "sleep" else "busy")
    wrs = [
        {"op": "write", "local": 0, "remote": 0, "len": 4096},
        {"op": "read", "local": 16384, "remote": 0, "len": 4096},
        {"op": "faa", "local": 32768, "remote": TARGET_FAA, "add": 5, "len": 8},
        {"op": "faa", "local": 32776, "remote": TARGET_FAA, "add": 10, "len": 8},
        {"op": "cas", "local": 32784, "remote": TARGET_CAS, "compare": 77, "swap": 99, "len": 8},
        {"op": "cas", "local": 32792, "remote": TARGET_CAS, "compare": 77, "swap": 55, "len": 8},
    ]
    done = initiator.call("post", wrs=wrs, timeout=4)
    assert statuses(done["wcs"]) == [SUCCESS] * len(wrs), done["wcs"]
    assert [w["wr_id"] for w in done["wcs"]] == list(range(len(wrs)))
    assert done["wcs"][-1]["t"] - done["t_post"] < 4, "one-sided ops took seconds against a parked target"
    read_back = initiator.call("peek", offset=16384, length=4096)["hex"]
    assert read_back == expected, "RDMA READ did not return what the RDMA WRITE wrote"
    fetched = initiator.call("get_u64", offsets=[32768, 32776, 32784, 32792])["values"]
    assert fetched == {"32768": 1000, "32776": 1005, "32784": 77, "32792": 99}

    os.kill(target.pid, signal.SIGUSR1)
    woke = target.reply(park, timeout=30)
    # The target's program thread was parked from before the first op to after the last completion.
    assert woke["woken"] and woke["start"] == parked["start"]
    assert woke["start"] <= done["t_post"] and done["wcs"][-1]["t"] <= woke["end"]
    if park == "busy":
        assert woke["iterations"] > 0
    assert target.call("peek", offset=0, length=4096)["hex"] == expected
    final = target.call("get_u64", offsets=[TARGET_FAA, TARGET_CAS])["values"]
    assert final == {str(TARGET_FAA): 1015, str(TARGET_CAS): 99}


@pytest.mark.parametrize("park", ["sleep", "busy"])
def test_one_sided_ops_complete_while_the_target_program_is_parked(
    park: str, any_fabric: Callable[[], Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = any_fabric()
    target, initiator = peers(fabric, "target"), peers(fabric, "initiator")
    _one_sided_on_parked_target(target, initiator, park)


# ----------------------------------------------------------------- 2. fresh IDs in every process
def _ids(fabric: Fabric, peers: Callable[..., Peer]) -> dict[str, list[int]]:
    peer = peers(fabric, "ids")
    ids = peer.call("ids", n=8)
    peer.kill()
    return ids


def test_two_fresh_processes_never_get_the_same_ids(
    sm_fabric: Callable[..., Fabric], peers: Callable[..., Peer]
) -> None:
    first, other = sm_fabric(), sm_fabric()
    a, b, c = _ids(first, peers), _ids(first, peers), _ids(other, peers)
    for x, y in ((a, b), (a, c), (b, c)):
        for kind in ("qpns", "lkeys", "rkeys"):
            assert len(x[kind]) == 8 == len(set(x[kind]))
            assert x[kind] != y[kind], f"two processes got the same {kind}: {x[kind]}"
            assert not set(x[kind]) & set(y[kind]), f"{kind} repeat across processes: {x[kind]} / {y[kind]}"
        assert x["lids"] != y["lids"]
    # One fabric never hands a LID out twice, even to a process started after the first one ended.
    assert not set(a["lids"]) & set(b["lids"]), (a["lids"], b["lids"])
    assert len(set(a["lids"])) == 2


# ----------------------------------------------------------------- 3. peer killed
TIMEOUT, RETRY_CNT = 10, 3


def _assert_retry_exceeded(wcs: list[dict[str, Any]], n: int, t_post: float) -> None:
    assert statuses(wcs) == [RETRY_EXC] + [FLUSH] * (n - 1), wcs
    assert [w["wr_id"] for w in wcs] == list(range(n))
    elapsed = wcs[0]["t"] - t_post
    lower = (RETRY_CNT + 1) * ack_timeout(TIMEOUT)  # 4 x 4.19 ms
    assert lower <= elapsed < 10, f"RETRY_EXC_ERR after {elapsed:.4f} s, expected >= {lower:.4f} s"


def test_killed_peer_gives_retry_exceeded_not_a_hang(
    any_fabric: Callable[[], Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = any_fabric()
    victim, requester = peers(fabric, "victim"), peers(fabric, "requester")
    connect(requester, victim, timeout=TIMEOUT, retry_cnt=RETRY_CNT)
    victim.call("recv", n=4)
    alive = requester.call("post", wrs=[{"op": "send"}, {"op": "write", "remote": 64}])
    assert statuses(alive["wcs"]) == [SUCCESS, SUCCESS]

    victim.kill()
    wrs = [{"op": "send"}, {"op": "write", "remote": 64, "len": 4096}, {"op": "send"}, {"op": "write"}]
    dead = requester.call("post", wrs=wrs, timeout=15)
    _assert_retry_exceeded(dead["wcs"], len(wrs), dead["t_post"])
    assert requester.call("query")["state"] == int(e.IBV_QPS_ERR)


def test_wrs_in_flight_when_the_peer_dies_complete_with_retry_exceeded(
    any_fabric: Callable[[], Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = any_fabric()
    victim, requester = peers(fabric, "victim"), peers(fabric, "requester")
    # The victim posts no receive: the SEND is answered with RNR NAKs (retried forever, 0.64 ms apart),
    # so it and the WRITEs behind it are certainly outstanding when the victim is killed.
    connect(requester, victim, timeout=TIMEOUT, retry_cnt=RETRY_CNT, min_rnr_timer=12)
    wrs = [{"op": "send"}, {"op": "write", "remote": 64, "len": 4096}, {"op": "write"}, {"op": "send"}]
    posted = requester.call("post", wrs=wrs, wait=False)
    assert requester.call("poll", n=1, timeout=0.2)["wcs"] == [], "the SEND completed without a receive"
    t_kill = time.monotonic()
    victim.kill()
    wcs = requester.call("poll", n=len(wrs), timeout=15)["wcs"]
    assert statuses(wcs) == [RETRY_EXC] + [FLUSH] * (len(wrs) - 1), wcs
    # Every retry is counted on an ACK timeout after the loss: retry_cnt + 1 of them, the first maybe at once.
    assert RETRY_CNT * ack_timeout(TIMEOUT) <= wcs[0]["t"] - t_kill < 10 and wcs[0]["t"] > posted["t_posted"]


# ----------------------------------------------------------------- 4. link failure and APM


def _stream_over_failing_link(fabric: Fabric, sink: Peer, requester: Peer) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stream of sequence-numbered SENDs; `ckpt fabric fail-link <sink's port-1 LID>` in the middle of it."""
    sink.send("sink", max_seconds=30)
    sink.phase("sinking")
    requester.send("stream", window=16, extra=300, notify_after=200, max_seconds=12)
    requester.phase("streaming")
    fabric.cli("fail-link", str(sink.info["lid1"]))
    streamed = requester.reply("stream", timeout=30)
    if streamed["errors"]:  # no END marker will come
        os.kill(sink.pid, signal.SIGUSR1)
    return streamed, sink.reply("sink", timeout=30)


def _new_connection_on_port_1_works(fabric: Fabric, sink: Peer, requester: Peer) -> None:
    fabric.cli("restore-link", str(sink.info["lid1"]))
    for peer in (sink, requester):
        peer.info["qpn"] = peer.call("new_qp")["qpn"]
    ends = connect(requester, sink, timeout=12, retry_cnt=3)
    assert all(end["port_num"] == 1 and end["state"] == QPS_RTS for end in ends), ends
    sink.call("recv", n=1, base=4096)
    again = requester.call("post", wrs=[{"op": "send"}, {"op": "write", "remote": 128}], timeout=10)
    assert statuses(again["wcs"]) == [SUCCESS, SUCCESS], again["wcs"]


def test_link_failure_migrates_to_the_alternate_path_without_losing_traffic(
    cli_fabric: Callable[..., Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = cli_fabric()
    sink, requester = peers(fabric, "sink"), peers(fabric, "requester")
    ends = connect(requester, sink, alt=True, timeout=12, retry_cnt=3)
    for end in ends:
        assert end["path_mig_state"] == ARMED and end["port_num"] == 1 and end["alt_port_num"] == 2, end

    streamed, sunk = _stream_over_failing_link(fabric, sink, requester)
    assert streamed["errors"] == [], streamed["errors"]
    assert PATH_MIG in [ev["type"] for ev in streamed["events"]], streamed["events"]
    assert streamed["completed"] == streamed["sent"] >= 500, streamed
    assert streamed["query"]["port_num"] == 2 and streamed["query"]["dlid"] == sink.info["lid2"], streamed["query"]
    assert streamed["query"]["path_mig_state"] == MIGRATED and streamed["query"]["state"] == QPS_RTS
    # Every sequence number arrived once, in order, and the END marker after them.
    assert sunk["ended"] and sunk["bad"] == [] and sunk["errors"] == [], sunk
    assert sunk["received"] == streamed["sent"]
    assert sunk["query"]["port_num"] == 2, "the responder did not follow the migration"
    assert PATH_MIG in [ev["type"] for ev in sunk["events"]], sunk["events"]

    _new_connection_on_port_1_works(fabric, sink, requester)


def test_migration_when_only_the_ack_was_lost(sm_fabric: Callable[..., Fabric], peers: Callable[..., Peer]) -> None:
    """The request arrived, its ACK is lost with the link: the retransmission on the alternate path is a
    duplicate at the responder, which must migrate on it and answer on the new path."""
    latency = 0.4  # the link fails while the ACK is on the wire: after the receive completes, before it lands
    fabric = sm_fabric(latency=latency)
    sink, requester = peers(fabric, "sink"), peers(fabric, "requester")
    connect(requester, sink, alt=True, timeout=18, retry_cnt=3)  # 1.07 s ACK timeout > the 0.8 s round trip
    sink.call("recv", n=2)
    requester.call("post", wrs=[{"op": "send"}], wait=False)
    received = sink.call("poll", cq="recv", n=1, timeout=5)["wcs"]
    assert statuses(received) == [SUCCESS]
    fabric.fail_link(sink.info["lid1"])
    assert time.monotonic() < received[0]["t"] + latency, "the link failed too late: the ACK had landed"
    done = requester.call("poll", n=1, timeout=10)["wcs"]
    assert statuses(done) == [SUCCESS], "the SEND never completed after the path migration"
    assert requester.call("query")["port_num"] == 2 and sink.call("query")["port_num"] == 2


def test_link_failure_without_an_armed_alternate_path_is_retry_exceeded(
    cli_fabric: Callable[..., Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = cli_fabric()
    sink, requester = peers(fabric, "sink"), peers(fabric, "requester")
    connect(requester, sink, timeout=TIMEOUT, retry_cnt=RETRY_CNT)
    streamed, _ = _stream_over_failing_link(fabric, sink, requester)
    assert streamed["errors"], "traffic went on over a failed link with no alternate path"
    assert statuses(streamed["errors"]) == [RETRY_EXC] + [FLUSH] * (len(streamed["errors"]) - 1)
    assert len(streamed["errors"]) == streamed["sent"] - streamed["completed"]
    assert PATH_MIG not in [ev["type"] for ev in streamed["events"]]
    assert streamed["query"]["state"] == int(e.IBV_QPS_ERR)

    _new_connection_on_port_1_works(fabric, sink, requester)


# ----------------------------------------------------------------- 5. link model
LATENCY, BANDWIDTH = 0.002, 50e6


def test_link_model_latency_and_bandwidth_are_lower_bounds(
    cli_fabric: Callable[..., Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = cli_fabric("--fabric-latency", "2ms", "--fabric-bandwidth", "50MB/s")
    echo, pinger = peers(fabric, "echo", size=8 * MiB), peers(fabric, "pinger", size=8 * MiB)
    connect(pinger, echo)
    echo.send("echo", count=10)
    echo.phase("echoing")
    rtts = pinger.call("pingpong", count=10)["rtts"]
    assert echo.reply("echo")["echoed"] == 10
    assert min(rtts) >= 2 * LATENCY, f"8-byte round trips {rtts} under 2 x {LATENCY} s latency"

    size = 4 * MiB
    wrote = pinger.call("post", wrs=[{"op": "write", "local": 0, "remote": 0, "len": size}], timeout=20)
    assert statuses(wrote["wcs"]) == [SUCCESS]
    took = wrote["wcs"][0]["t"] - wrote["t_post"]
    assert took >= size / BANDWIDTH, f"4 MiB RDMA WRITE in {took:.3f} s at {BANDWIDTH / 1e6} MB/s"


# ----------------------------------------------------------------- 6. large transfers
@pytest.mark.parametrize("size", [4 * MiB, 64 * MiB])
def test_large_rdma_write_and_read_arrive_intact(
    size: int, any_fabric: Callable[[], Fabric], peers: Callable[..., Peer]
) -> None:
    fabric = any_fabric()
    target, initiator = peers(fabric, "target", size=size), peers(fabric, "initiator", size=size)
    connect(initiator, target)
    sent = initiator.call("fill", offset=0, length=size, seed=1)["sha256"]
    wrote = initiator.call("post", wrs=[{"op": "write", "local": 0, "remote": 0, "len": size}], timeout=60)
    assert statuses(wrote["wcs"]) == [SUCCESS] and wrote["wcs"][0]["byte_len"] == size
    assert target.call("digest", offset=0, length=size)["sha256"] == sent

    served = target.call("fill", offset=0, length=size, seed=2)["sha256"]
    assert served != sent
    read = initiator.call("post", wrs=[{"op": "read", "local": 0, "remote": 0, "len": size}], timeout=60)
    assert statuses(read["wcs"]) == [SUCCESS] and read["wcs"][0]["byte_len"] == size
    assert initiator.call("digest", offset=0, length=size)["sha256"] == served
    expected = hashlib.sha256(np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8).data).hexdigest()
    assert served == expected
    # simib's HCAs in two processes of one machine link over a Unix socket (docs/verbs.md, "Same-host links"):
    # each found the other's, and the other's credentials and TCP listener checked out; tcp's stay on TCP
    want = "tcp" if fabric.device.startswith("tcp") or os.environ.get("CKPT_SIMIB_UNIX") == "0" else "unix"
    for peer in (initiator, target):
        assert set(peer.call("links")["links"].values()) == {want}
