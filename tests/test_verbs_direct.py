"""Direct placement: one-sided WRs into a same-host responder's shared memory, executed by the requester (`_direct`)."""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from verbs_util import (
    FAST_RETRY,
    FAST_TIMEOUT,
    WAIT,
    atomic_wr,
    bring_up,
    make_endpoint,
    poll_one,
    rdma_wr,
    subnet_manager,
    wait_for,
)

from ckpt import verbs as v
from ckpt.verbs import _hca, _shm
from ckpt.verbs import fabric as fab

pytestmark = pytest.mark.timeout(60)

PEER = Path(__file__).with_name("shm_peer.py")
_fresh = itertools.count(200)


@dataclass
class Peer:
    """The responder process (tests/shm_peer.py) and this process's endpoint connected to it."""

    proc: subprocess.Popen[str]
    remote: dict[str, Any]
    ep: Any

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return _line(self.proc)

    def dump(self) -> tuple[bytes, bytes]:
        shared, private = json.loads(self.ask("dump"))
        return bytes.fromhex(shared), bytes.fromhex(private)

    def counts(self) -> dict[str, int]:
        return dict(_hca.hca(self.ep.ctx.name).counts)


def _line(proc: subprocess.Popen[str], timeout: float = 20.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"the peer said nothing for {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"the peer exited ({proc.wait(5)})")
    return line.strip()


@pytest.fixture
def start_peer() -> Iterator[Callable[..., Peer]]:
    """start_peer(**env) -> a responder process connected to a new endpoint here; killed by PID at the end."""
    started: list[subprocess.Popen[str]] = []
    sm = subnet_manager()

    def start(dlid_port: int = 1, **env: str) -> Peer:
        environ = {**os.environ, fab.ENV_ADDRESS: sm.address, fab.ENV_TOKEN: sm.token, **env}
        proc = subprocess.Popen(
            [sys.executable, str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ
        )
        started.append(proc)
        remote = json.loads(_line(proc))
        while (name := f"simib{next(_fresh)}") in _hca._hcas:
            pass
        ep = make_endpoint(v.Context(name=name))
        bring_up(ep.qp, remote["qpn"], remote["lid"], timeout=FAST_TIMEOUT, retry_cnt=FAST_RETRY)
        assert proc.stdin is not None
        dlid = ep.lid if dlid_port == 1 else ep.lid2  # where the responder's answers go
        proc.stdin.write(json.dumps({"qpn": ep.qp.qp_num, "dlid": dlid}) + "\n")
        proc.stdin.flush()
        assert _line(proc) == "ready"
        return Peer(proc, remote, ep)

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def _write(
    peer: Peer, data: bytes, *, private: bool = False, rkey: int | None = None, offset: int = 0, wait: float = WAIT
) -> v.WC:
    ep, r = peer.ep, peer.remote
    ep.buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    key = rkey if rkey is not None else r["private_rkey" if private else "rkey"]
    addr = r["private_addr" if private else "addr"] + offset
    ep.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, ep.sge(0, len(data)), key, addr))
    return poll_one(ep.scq, timeout=wait)


def test_one_sided_wrs_into_shared_memory_complete_at_post_time_without_packets(start_peer: Any) -> None:
    peer = start_peer()
    ep, r = peer.ep, peer.remote
    before = peer.counts()
    data = bytes(range(64))
    ep.buf[:64] = np.frombuffer(data, dtype=np.uint8)
    ep.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, ep.sge(0, 64), r["rkey"], r["addr"]))
    wcs = ep.scq.poll(4)[1]  # queued before post_send returned: no wait
    assert [(wc.status, wc.opcode, wc.byte_len) for wc in wcs] == [(v.IBV_WC_SUCCESS, v.IBV_WC_RDMA_WRITE, 64)]
    assert peer.dump()[0] == data
    # READ back into another place, then CAS and FETCH_AND_ADD on the first word
    ep.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, ep.sge(4096, 64), r["rkey"], r["addr"], wr_id=2))
    assert poll_one(ep.scq).status == v.IBV_WC_SUCCESS
    assert bytes(ep.buf[4096:4160]) == data
    first = int.from_bytes(data[:8], "little")
    cas = atomic_wr(v.IBV_WR_ATOMIC_CMP_AND_SWP, ep.sge(8192, 8), r["rkey"], r["addr"], first, 1000, wr_id=3)
    faa = atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, ep.sge(8200, 8), r["rkey"], r["addr"], 5, wr_id=4)
    cas.next_wr = faa
    ep.qp.post_send(cas)
    assert [poll_one(ep.scq).wr_id for _ in range(2)] == [3, 4]
    assert ep.buf[8192:8208].view(np.uint64).tolist() == [first, 1000]
    assert int.from_bytes(peer.dump()[0][:8], "little") == 1005
    after = peer.counts()
    assert after["direct_ops"] - before["direct_ops"] == 4
    assert after["packets_sent"] == before["packets_sent"]
    # four WRs consumed four PSNs on both sides, as packets would have
    assert ep.qp.query(v.IBV_QP_SQ_PSN)[0].sq_psn == 4
    assert int(peer.ask("psn")) == 4
    # and a packet after them is in sequence: a SEND needs a receive, so it takes the packet path
    assert _write(peer, b"private!", private=True).status == v.IBV_WC_SUCCESS
    assert int(peer.ask("psn")) == 5 and peer.counts()["direct_ops"] == after["direct_ops"]


def test_private_memory_and_bad_keys_take_the_packet_path_with_its_errors(start_peer: Any) -> None:
    peer = start_peer()
    before = peer.counts()
    assert _write(peer, b"private!", private=True).status == v.IBV_WC_SUCCESS
    assert peer.dump()[1][:8] == b"private!"
    after = peer.counts()
    assert after["direct_ops"] == before["direct_ops"] and after["packets_sent"] > before["packets_sent"]
    # out of bounds of the shared region: the responder NAKs it, as on the packet path, and the QP errs
    wc = _write(peer, b"x" * 16, offset=(1 << 16) - 8)
    assert wc.status == v.IBV_WC_REM_ACCESS_ERR
    assert peer.counts()["direct_ops"] == before["direct_ops"]
    assert peer.ep.qp.qp_state == v.IBV_QPS_ERR


def test_a_region_known_to_be_private_is_not_held_again_until_the_peers_rows_change(
    start_peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding a peer and asking whether it lives are system calls on every post: once its rows were read and
    the region was not among them, a WR to it takes the packet path at once, until the rows change."""
    peer = start_peer()
    assert _write(peer, b"private!", private=True).status == v.IBV_WC_SUCCESS  # the rows read once
    held: list[int] = []
    hold = _shm.Peer.hold
    monkeypatch.setattr(_shm.Peer, "hold", lambda self: (held.append(1), hold(self))[1])
    monkeypatch.setattr(_shm.Peer, "alive", lambda self: held.append(2) or True)
    for k in range(3):
        assert _write(peer, b"again!!%d" % k, private=True).status == v.IBV_WC_SUCCESS
    assert held == [] and peer.dump()[1][:8] == b"again!!2"
    assert _write(peer, b"shared!!").status == v.IBV_WC_SUCCESS and held == [2, 1]  # placed directly
    assert peer.ask("dereg") == "done"  # a row changes: what was read of them is stale
    del held[:]
    assert _write(peer, b"private?", private=True).status == v.IBV_WC_SUCCESS and held == [2, 1]
    assert _write(peer, b"private.", private=True).status == v.IBV_WC_SUCCESS and held == [2, 1]


def test_a_wrong_rkey_gets_rem_access_err(start_peer: Any) -> None:
    peer = start_peer()
    assert _write(peer, b"y" * 8, rkey=peer.remote["rkey"] ^ 0x5A5A).status == v.IBV_WC_REM_ACCESS_ERR
    assert peer.dump()[0][:8] == bytes(8)


def test_a_responder_qp_in_error_is_not_written(start_peer: Any) -> None:
    peer = start_peer()
    assert peer.ask("error") == "done"
    wc = _write(peer, b"z" * 8)
    assert wc.status == v.IBV_WC_RETRY_EXC_ERR  # its packets are dropped, as by an HCA whose QP is in ERR
    assert peer.dump()[0][:8] == bytes(8)


def test_a_dead_responder_gets_retry_exc_err_not_a_success(start_peer: Any) -> None:
    peer = start_peer()
    assert _write(peer, b"alive!!!").status == v.IBV_WC_SUCCESS
    peer.proc.kill()
    peer.proc.wait(10)
    assert _write(peer, b"dead!!!!").status == v.IBV_WC_RETRY_EXC_ERR


def test_atomics_exclude_the_responders_own_across_processes(start_peer: Any) -> None:
    peer = start_peer()
    ep, r = peer.ep, peer.remote
    n = 1500
    answer: list[str] = []
    theirs = threading.Thread(target=lambda: answer.append(peer.ask(f"add {n}")))
    theirs.start()
    for i in range(n):
        ep.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, ep.sge(0, 8), r["rkey"], r["addr"], 1, wr_id=i))
        assert poll_one(ep.scq).status == v.IBV_WC_SUCCESS
    theirs.join(30)
    assert answer == ["done"]
    assert int.from_bytes(peer.dump()[0][:8], "little") == 2 * n


def test_direct_placement_can_be_turned_off(start_peer: Any) -> None:
    peer = start_peer(CKPT_SIMIB_DIRECT="0")  # the responder publishes nothing
    before = peer.counts()
    assert _write(peer, b"packets!").status == v.IBV_WC_SUCCESS
    assert peer.dump()[0][:8] == b"packets!"
    assert peer.counts()["direct_ops"] == before["direct_ops"]


def test_a_restarted_peer_is_not_reached_through_the_old_mapping(start_peer: Any) -> None:
    first = start_peer()
    assert _write(first, b"first!!!").status == v.IBV_WC_SUCCESS
    hca = _hca.hca(first.ep.ctx.name)
    endpoint = hca._routes[first.remote["lid"]][0]
    assert hca._peers[endpoint] is not None
    first.proc.kill()
    first.proc.wait(10)
    wait_for(lambda: hca.direct_peer(first.remote["lid"]) is None, what="the dead peer's mapping dropped")
    second = start_peer()
    before = second.counts()["direct_ops"]
    assert _write(second, b"second!!").status == v.IBV_WC_SUCCESS
    assert second.dump()[0][:8] == b"second!!"
    assert second.counts()["direct_ops"] == before + 1


def test_atomics_from_two_hcas_of_one_process_exclude_each_other(start_peer: Any) -> None:
    peer = start_peer()
    r = peer.remote
    while (name := f"simib{next(_fresh)}") in _hca._hcas:
        pass
    other = make_endpoint(v.Context(name=name))
    bring_up(other.qp, r["qpn2"], r["lid"])
    assert peer.ask(f"connect {other.qp.qp_num} {other.lid}") == "done"
    n = 1500

    def add(ep: Any) -> None:
        for i in range(n):
            ep.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, ep.sge(0, 8), r["rkey"], r["addr"], 1, wr_id=i))
            assert poll_one(ep.scq).status == v.IBV_WC_SUCCESS

    before = peer.counts()["direct_ops"]
    threads = [threading.Thread(target=add, args=(ep,)) for ep in (peer.ep, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert int.from_bytes(peer.dump()[0][:8], "little") == 2 * n
    assert peer.counts()["direct_ops"] - before == n  # (the other HCA counts its own)


def test_a_deregistered_region_is_not_written(start_peer: Any) -> None:
    peer = start_peer()
    assert _write(peer, b"before!!").status == v.IBV_WC_SUCCESS
    assert peer.ask("dereg") == "done"
    assert _write(peer, b"after!!!").status == v.IBV_WC_REM_ACCESS_ERR


def test_a_responder_whose_answers_cannot_come_back_gets_packets(start_peer: Any) -> None:
    peer = start_peer(dlid_port=2)  # the responder answers to this HCA's port 2; requests leave port 1
    ep, r = peer.ep, peer.remote
    sm = subnet_manager()
    hca = _hca.hca(ep.ctx.name)
    sm.fail_link(ep.lid2)
    try:
        wait_for(lambda: not hca.link_up.get(ep.lid2, True), what="the link down")
        before = peer.counts()["direct_ops"]
        ep.buf[:8] = np.frombuffer(b"later!!!", dtype=np.uint8)
        ep.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, ep.sge(0, 8), r["rkey"], r["addr"]))
        assert ep.scq.poll(1)[0] == 0  # not completed at post time: it went as a packet, whose ACK is lost
        assert peer.counts()["direct_ops"] == before
    finally:
        sm.restore_link(ep.lid2)
    assert poll_one(ep.scq, timeout=30).status == v.IBV_WC_SUCCESS  # a retransmission's ACK comes back


def test_an_atomic_with_more_than_one_sge_is_refused_at_post(start_peer: Any) -> None:
    peer = start_peer()
    ep, r = peer.ep, peer.remote
    wr = atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, ep.sge(0, 4), r["rkey"], r["addr"], 7)
    wr.sg, wr.num_sge = [ep.sge(0, 4), ep.sge(4, 4)], 2
    with pytest.raises(v.PyverbsRDMAError) as raised:
        ep.qp.post_send(wr)
    assert raised.value.error_code == 22
    assert peer.dump()[0][:8] == bytes(8)


# ----------------------------------------------------------------- loopback: two QPs of one HCA
@pytest.fixture
def loopback() -> Iterator[tuple[Any, Any, v.MR]]:
    """Two QPs of one simib HCA connected to each other, and shared memory registered on the second's PD."""
    while (name := f"simib{next(_fresh)}") in _hca._hcas:
        pass
    ctx = v.Context(name=name)
    try:
        a, b = make_endpoint(ctx), make_endpoint(ctx)
        bring_up(a.qp, b.qp.qp_num, b.lid)
        bring_up(b.qp, a.qp.qp_num, a.lid)
        yield a, b, v.MR(b.pd, 4096, v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE | v.IBV_ACCESS_REMOTE_ATOMIC)
    finally:
        ctx.close()


def test_a_qp_connected_to_another_qp_of_its_own_hca_places_directly_too(loopback: Any) -> None:
    """A loopback (a DSM rank's link to itself: it is the log home of its neighbour's pages) is served like a
    same-host peer: at post time, no packet, PSNs consumed on both QPs."""
    a, b, shared = loopback
    counts = _hca.hca(a.ctx.name).counts
    before = dict(counts)
    a.buf[:16] = np.frombuffer(b"loopback, direct", dtype=np.uint8)
    write = rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 16), shared.rkey, shared.buf + 8)
    write.next_wr = atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(64, 8), shared.rkey, shared.buf, 3, wr_id=2)
    a.qp.post_send(write)
    assert [wc.status for wc in a.scq.poll(4)[1]] == [v.IBV_WC_SUCCESS, v.IBV_WC_SUCCESS]  # no wait
    assert bytes(shared.read(16, 8)) == b"loopback, direct" and int.from_bytes(shared.read(8, 0), "little") == 3
    assert counts["direct_ops"] - before["direct_ops"] == 2 and counts["packets_sent"] == before["packets_sent"]
    assert b.qp.query(v.IBV_QP_RQ_PSN)[0].rq_psn == 2


def test_a_loopback_holds_off_its_own_hcas_row_changes_until_its_copies_are_done(loopback: Any) -> None:
    """Record locks do not exclude threads of one process: a loopback holds the table's own lock instead, so a
    deregistration on another thread waits until the direct operation's copies are done."""
    a, _, shared = loopback
    hca = _hca.hca(a.ctx.name)
    peer = hca.direct_peer(a.lid)
    assert peer is not None
    peer.hold()
    dereg = threading.Thread(target=shared.close, daemon=True)
    try:
        dereg.start()
        dereg.join(0.2)
        assert dereg.is_alive(), "dereg_mr returned while a direct operation held the table"
    finally:
        peer.release()
    dereg.join(WAIT)
    assert not dereg.is_alive()


def test_a_loopback_whose_region_cannot_be_mapped_takes_packets(loopback: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors (say) when the loopback first maps the region's memfd: the WR goes as packets, and
    succeeds."""
    a, _, shared = loopback
    opened = _shm.os.open

    def refuse(path: Any, *args: Any) -> int:
        if str(path).startswith("/proc/"):
            raise OSError(24, "Too many open files")
        return opened(path, *args)

    monkeypatch.setattr(_shm.os, "open", refuse)
    counts = _hca.hca(a.ctx.name).counts
    before = counts["direct_ops"]
    a.buf[:8] = np.frombuffer(b"packets!", dtype=np.uint8)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), shared.rkey, shared.buf))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert bytes(shared.read(8, 0)) == b"packets!" and counts["direct_ops"] == before
