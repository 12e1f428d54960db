"""ckpt_ib2tcp: the tcp provider's table, where its HCAs listen, and a connection between two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ckpt_ib2tcp
import numpy as np
import pytest
from verbs_util import ACCESS_ALL, contexts, poll_one, rdma_wr, wait_for

from ckpt import verbs as v
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
    ctx = v.Context(name="tcp7")
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
