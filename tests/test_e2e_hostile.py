"""End-to-end: a thousand hostile connections against a running job's coordinator and against a subnet manager.

Before authentication a connection may cost a server a few KiB and nothing else: the process's RSS stays
within +50 MB while the connections are open, and the server goes on serving (the job checkpoints, the
fabric registers an HCA).
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckpt import _wire as wire
from ckpt.testing import Job, kill_pids, run, wait_for
from ckpt.verbs.fabric import FabricClient
from harness import PROGRAMS, closed_by_peer, start_fabric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

#: Connections that stay in their handshake: a nearly full 4 KiB frame, then a byte now and then.
TRICKLING = 1000
#: Connections that announce a 64 MiB frame and keep sending its body (a server that believes them allocates it).
ANNOUNCING = 300
RSS_BOUND = 50 << 20


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """Room for the hostile sockets, here and in the servers this test starts (they inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if wanted < 2 * (TRICKLING + ANNOUNCING) + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM: the peak RSS so far) of `pid`, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


class Flood:
    """Hostile connections to `address`; a thread keeps trickling bytes into them until stop()."""

    def __init__(self, address: str) -> None:
        self.address = wire.parse_address(address)
        self.trickling: list[socket.socket] = []
        self.announcing: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)

    def open(self) -> Flood:
        for i in range(TRICKLING + ANNOUNCING):
            sock = socket.create_connection(self.address, timeout=10)
            wire.recv(sock, limit=wire.HANDSHAKE_MAX_FRAME)  # the challenge: the server took it in
            if i % 4 == 3 and len(self.announcing) < ANNOUNCING:
                sock.sendall(struct.pack(">I", 64 << 20) + b"\x81" + b"x" * 4000)
                self.announcing.append(sock)
            else:
                sock.sendall(struct.pack(">I", wire.HANDSHAKE_MAX_FRAME) + b"\x81" + b"x" * 3500)
                self.trickling.append(sock)
        self._thread.start()
        return self

    def _trickle(self) -> None:
        while not self._stop.wait(0.5):
            for sock in self.announcing + self.trickling:
                try:
                    sock.send(b"x", socket.MSG_DONTWAIT)
                except OSError:
                    pass

    def open_count(self, socks: list[socket.socket]) -> int:
        return sum(not closed_by_peer(sock, 0) for sock in socks)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5)
        for sock in self.trickling + self.announcing:
            sock.close()


@pytest.fixture
def flood() -> Iterator[Callable[[str], Flood]]:
    floods: list[Flood] = []

    def start(address: str) -> Flood:
        floods.append(Flood(address))
        return floods[-1].open()

    yield start
    for each in floods:
        each.stop()


@pytest.mark.usefixtures("many_descriptors")
def test_a_running_job_shrugs_off_a_thousand_hostile_connections(
    start_job: Callable[..., Job], tmp_path: Path, flood: Callable[[str], Flood]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "counter.py"), "100000", "0.01")
    job.wait_step(3)
    assert job.process is not None
    launcher = job.process.pid  # the embedded coordinator's process
    before, _ = _memory(launcher)
    hostile = flood(json.loads((ckpt_dir / "coordinator.json").read_text())["address"])
    wait_for(lambda: hostile.open_count(hostile.announcing) == 0, 10, "the 64 MiB announcements to be refused")
    assert hostile.open_count(hostile.trickling) == TRICKLING
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), timeout=30)
    assert taken.returncode == 0, taken.stderr
    assert "checkpoint 1 written" in taken.stdout
    after, peak = _memory(launcher)
    assert hostile.open_count(hostile.trickling) == TRICKLING  # they were all there during the checkpoint
    assert peak - before <= RSS_BOUND, f"RSS {before >> 20} MB before, {after >> 20} MB after, peak {peak >> 20} MB"
    assert job.process.poll() is None
    _, stderr = job.read()
    assert "Traceback" not in stderr and "closing connection" not in stderr  # a flood must not flood the terminal


@pytest.mark.usefixtures("many_descriptors")
def test_a_subnet_manager_shrugs_off_a_thousand_hostile_connections(
    tmp_path: Path, flood: Callable[[str], Flood]
) -> None:
    record, _ = start_fabric(tmp_path / "fabric")
    try:
        before, _ = _memory(record["pid"])
        hostile = flood(record["address"])
        wait_for(lambda: hostile.open_count(hostile.announcing) == 0, 10, "the 64 MiB announcements to be refused")
        assert hostile.open_count(hostile.trickling) == TRICKLING
        status = run("fabric", "status", "--json", "--dir", str(tmp_path / "fabric"), timeout=30)
        assert status.returncode == 0, status.stderr
        with FabricClient(record["address"], record["token"]) as hca:
            lids = hca.register(guid=7, name="simib0", endpoint="127.0.0.1:9", pid=1, host="h")["lids"]
            assert len(lids) == 2
        after, peak = _memory(record["pid"])
        assert hostile.open_count(hostile.trickling) == TRICKLING
        assert peak - before <= RSS_BOUND, f"RSS {before >> 20} MB before, {after >> 20} MB after, peak {peak >> 20} MB"
    finally:
        kill_pids([record["pid"]])
