"""ckpt_ib2tcp: the tcp provider's table, where its HCAs listen, and a connection between two processes."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import ckpt_ib2tcp
import numpy as np
import pytest
from verbs_util import ACCESS_ALL, contexts, poll_one, rdma_wr, wait_for

from ckpt import verbs as v
from ckpt.testing import FakeKeyValue
from ckpt.verbs import _hca

pytestmark = pytest.mark.timeout(60)

PEER = Path(__file__).parent / "programs" / "tcp_peer.py"


@pytest.fixture(autouse=True)
def registered() -> None:
    if "tcp" not in v.providers():
        ckpt_ib2tcp.register()


def test_the_plugin_contributes_the_tcp_table() -> None:
    assert ckpt_ib2tcp.ckpt_verbs_providers() == {"tcp": ckpt_ib2tcp.make_ops}
    assert ckpt_ib2tcp.make_ops().provider == "tcp"


def test_listen_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ckpt_ib2tcp.HOST_ENV, "192.0.2.7")
    assert ckpt_ib2tcp.listen_host() == "192.0.2.7"
    monkeypatch.delenv(ckpt_ib2tcp.HOST_ENV)
    monkeypatch.setattr(ckpt_ib2tcp, "_coordinator", "127.0.0.1:7777")
    assert ckpt_ib2tcp.listen_host() == "127.0.0.1"  # the local address on the route to the coordinator
    monkeypatch.setattr(ckpt_ib2tcp, "_coordinator", None)
    assert ckpt_ib2tcp.listen_host() == "127.0.0.1"


class RouteProbe:
    """A stand-in for the UDP socket listen_host connects to pick a route: records where, answers a fixed address."""

    targets: list[tuple[str, int]] = []
    answer = "10.9.8.7"
    refuse = False

    def __init__(self, family: int, kind: int) -> None:
        assert (family, kind) == (socket.AF_INET, socket.SOCK_DGRAM)

    def __enter__(self) -> RouteProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def connect(self, address: tuple[str, int]) -> None:
        RouteProbe.targets.append(address)
        if RouteProbe.refuse:
            raise OSError(101, "Network is unreachable")

    def getsockname(self) -> tuple[str, int]:
        return RouteProbe.answer, 40000


@pytest.fixture
def route_probe(monkeypatch: pytest.MonkeyPatch) -> type[RouteProbe]:
    """listen_host's sockets are RouteProbes (only in ckpt_ib2tcp: other threads' sockets stay real)."""
    monkeypatch.delenv(ckpt_ib2tcp.HOST_ENV, raising=False)
    monkeypatch.setattr(RouteProbe, "targets", [])
    monkeypatch.setattr(RouteProbe, "refuse", False)
    fake = SimpleNamespace(socket=RouteProbe, AF_INET=socket.AF_INET, SOCK_DGRAM=socket.SOCK_DGRAM)
    monkeypatch.setattr(ckpt_ib2tcp, "socket", fake)
    return RouteProbe


def test_listen_host_is_the_local_address_on_the_route_to_the_coordinator(
    route_probe: type[RouteProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_ib2tcp, "_coordinator", "192.0.2.10:7000")
    assert ckpt_ib2tcp.listen_host() == "10.9.8.7"
    assert route_probe.targets == [("192.0.2.10", 9)]  # the coordinator's host, whatever its port


def test_listen_host_prefers_the_environment_to_the_route(
    route_probe: type[RouteProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_ib2tcp, "_coordinator", "192.0.2.10:7000")
    monkeypatch.setenv(ckpt_ib2tcp.HOST_ENV, "192.0.2.99")
    assert ckpt_ib2tcp.listen_host() == "192.0.2.99"
    assert route_probe.targets == []


def test_listen_host_without_a_route_to_the_coordinator_is_loopback(
    route_probe: type[RouteProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_ib2tcp, "_coordinator", "192.0.2.10:7000")
    route_probe.refuse = True
    assert ckpt_ib2tcp.listen_host() == "127.0.0.1"
    assert route_probe.targets == [("192.0.2.10", 9)]


def _fresh_device() -> str:
    """A tcp device name whose HCA this process has not created (an HCA keeps the directory it was made with)."""
    return next(f"tcp{i}" for i in itertools.count(7) if f"tcp{i}" not in _hca._hcas)


def test_under_a_runtime_hcas_register_in_the_coordinators_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_ib2tcp, "_kv", ckpt_ib2tcp._kv)  # restored after the test, whatever ckpt_init sets
    monkeypatch.setattr(ckpt_ib2tcp, "_coordinator", ckpt_ib2tcp._coordinator)
    monkeypatch.delenv(ckpt_ib2tcp.HOST_ENV, raising=False)
    kv = FakeKeyValue()
    ckpt_ib2tcp.ckpt_init(SimpleNamespace(kv=kv, coordinator="127.0.0.1:1"))  # type: ignore[arg-type]
    name = _fresh_device()
    device = ckpt_ib2tcp.make_ops().open_device(name)
    hca = _hca._hcas[name]
    assert device.hca is hca and type(hca.sm).__name__ == "KvDirectory"
    assert hca.endpoint.startswith("127.0.0.1:")  # the route to the coordinator
    for port, lid in enumerate(hca.lids, start=1):
        assert kv.get("ib2tcp", f"claim/{lid}") == 1
        assert kv.get("ib2tcp", f"lid/{lid}")["endpoint"] == hca.endpoint
        assert kv.get("ib2tcp", f"lid/{lid}")["port"] == port


def test_opening_a_tcp_device_creates_no_simib_hca() -> None:
    assert "simib6" not in _hca._hcas  # no test of this process opens simib6
    for (ctx,) in contexts("tcp6"):
        assert ctx.handle.hca is _hca._hcas["tcp6"] and ctx.handle.hca.provider == "tcp"
    assert "simib6" not in _hca._hcas


def test_a_tcp_device_is_an_hca_of_its_own() -> None:
    for _ in contexts("tcp5", "simib5"):
        tcp, simib = _hca._hcas["tcp5"], _hca._hcas["simib5"]
        assert tcp is not simib and not set(tcp.lids) & set(simib.lids)
        assert (tcp.provider, simib.provider) == ("tcp", "simib")
        assert type(tcp.sm).__module__ == "ckpt_ib2tcp._directory"  # no subnet manager behind it


def test_device_and_port_attributes() -> None:
    for ctx, _ in contexts("tcp0", "tcp1"):
        assert "tcp" in ctx.query_device().fw_version
        port = ctx.query_port(1)
        assert port.sm_lid == 0 and port.state == v.IBV_PORT_ACTIVE and 0 < port.lid <= 0xBFFF


@pytest.fixture
def peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another process with a tcp HCA, both finding each other through files in tmp_path."""
    directory = tmp_path / "directory"
    monkeypatch.setenv("CKPT_TCP_DIRECTORY", str(directory))
    environment = {k: val for k, val in os.environ.items() if k != "CKPT_VERBS_PROVIDER"}
    process = subprocess.Popen(
        [sys.executable, "-P", str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment
    )
    try:
        yield process, directory
    finally:
        process.kill()
        process.wait()


def test_rdma_write_between_two_processes_through_a_file_directory(
    peer: tuple[subprocess.Popen[str], Path],
) -> None:
    process, directory = peer
    assert process.stdin is not None and process.stdout is not None
    theirs = json.loads(process.stdout.readline())
    # A device name this test process has not opened yet: its HCA is created now, with the directory above.
    ctx = v.Context(name=_fresh_device())
    try:
        wait_for(lambda: (directory / f"{theirs['lid']}.json").exists(), 10, "the peer's record")
        pd = v.PD(ctx)
        cq = v.CQ(ctx, 16)
        buf = np.arange(64, dtype=np.uint8)
        mr = v.MR(pd, buf, ACCESS_ALL)
        qp = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, sq_sig_all=1))
        v.connect_rc(qp, theirs["lid"], theirs["qpn"], ACCESS_ALL)
        process.stdin.write(json.dumps({"lid": ctx.query_port(1).lid, "qpn": qp.qp_num}) + "\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline()) == {"connected": True}
        qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, v.SGE(mr.buf, 64, mr.lkey), theirs["rkey"], theirs["addr"]))
        assert poll_one(cq).status == v.IBV_WC_SUCCESS
        process.stdin.write("read\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline()) == {"bytes": list(range(64))}
    finally:
        ctx.close()
