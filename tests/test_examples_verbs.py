"""The verbs examples, run as a user runs them: rc_pingpong and rdma_write_bw, both sides, output parsed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpt.testing import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 90.0

ADDRESS = re.compile(r"^ {2}(local|remote) address: +LID 0x([0-9a-f]{4}), QPN 0x([0-9a-f]{6}), PSN 0x([0-9a-f]{6})")
BYTES = re.compile(r"^(\d+) bytes in (\d+\.\d\d) seconds = (\d+\.\d\d) Mbit/sec$")
ITERS = re.compile(r"^(\d+) iters in (\d+\.\d\d) seconds = (\d+\.\d\d) usec/iter$")
BW_ROW = re.compile(r"^ (\d+) +(\d+) +(\d+\.\d\d) +(\d+\.\d{6})$")
BW_DEST = re.compile(r"^ (local|remote) address: LID 0x([0-9a-f]{4}) QPN 0x([0-9a-f]{6}) PSN 0x([0-9a-f]{6}) RKey")


def env_without_fabric() -> dict[str, str]:
    return {k: val for k, val in os.environ.items() if k not in ("CKPT_FABRIC", "CKPT_FABRIC_TOKEN")}


def run_example(name: str, *args: str) -> str:
    """Run examples/NAME with ARGS to completion (killed by PID after TIMEOUT); its stdout. Fails on non-zero exit."""
    proc = subprocess.Popen(
        [sys.executable, "-P", str(EXAMPLES / name), *args],  # -P: the example finds its shared module on its own
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_without_fabric(),
        start_new_session=True,  # so the forked server dies with it if the test times out
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}\n{out}\n{err}"
    return out


def kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


def sides(out: str) -> tuple[list[str], list[str]]:
    """(client lines, server lines) of a --pair run; the server's are relayed with a 'server: ' prefix."""
    client = [line for line in out.splitlines() if not line.startswith("server: ")]
    server = [line.removeprefix("server: ") for line in out.splitlines() if line.startswith("server: ")]
    return client, server


def addresses(lines: list[str], pattern: re.Pattern[str]) -> dict[str, tuple[int, int, int]]:
    found = {}
    for line in lines:
        match = pattern.match(line)
        if match:
            found[match[1]] = (int(match[2], 16), int(match[3], 16), int(match[4], 16))
    return found


def check_pingpong_side(lines: list[str], size: int, iters: int) -> None:
    byte_lines = [m for m in map(BYTES.match, lines) if m]
    iter_lines = [m for m in map(ITERS.match, lines) if m]
    assert len(byte_lines) == 1 and len(iter_lines) == 1, lines
    assert int(byte_lines[0][1]) == size * iters * 2
    assert float(byte_lines[0][3]) > 0
    assert int(iter_lines[0][1]) == iters
    assert float(iter_lines[0][3]) > 0


def test_rc_pingpong_pair() -> None:
    size, iters = 64, 50
    client, server = sides(run_example("rc_pingpong.py", "--pair", "-s", str(size), "-n", str(iters), "-r", "8"))
    check_pingpong_side(client, size, iters)
    check_pingpong_side(server, size, iters)
    mine, theirs = addresses(client, ADDRESS), addresses(server, ADDRESS)
    assert mine["local"] == theirs["remote"] and mine["remote"] == theirs["local"]
    assert mine["local"][0] != mine["remote"][0], "the two processes' ports must have different LIDs"


def test_rc_pingpong_server_and_client(tmp_path: Path) -> None:
    """The two-command form: the server starts a fabric and prints it; the client joins it with those variables."""
    size, iters = 100, 30
    server_out = tmp_path / "server.out"
    with server_out.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "rc_pingpong.py"), "-p", "0", "-s", str(size), "-n", str(iters), "-e"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env_without_fabric(),
        )
    try:

        def listening() -> bool:
            assert server.poll() is None, server_out.read_text()
            return "waiting for a client" in server_out.read_text()

        wait_for(listening, TIMEOUT, "the server to start listening")
        text = server_out.read_text()
        fabric_vars = dict(item.split("=", 1) for item in re.search(r"^fabric: (.*)$", text, re.M)[1].split())
        port = re.search(r"waiting for a client on 127\.0\.0\.1 port (\d+)", text)[1]
        client = subprocess.run(
            [sys.executable, str(EXAMPLES / "rc_pingpong.py"), "-p", port, "-s", str(size), "-n", str(iters), "-e",
             "127.0.0.1"],
            capture_output=True,
            text=True,
            env={**env_without_fabric(), **fabric_vars},
            timeout=TIMEOUT,
        )  # fmt: skip
        assert client.returncode == 0, client.stdout + client.stderr
        assert server.wait(timeout=TIMEOUT) == 0, server_out.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    check_pingpong_side(client.stdout.splitlines(), size, iters)
    check_pingpong_side(server_out.read_text().splitlines(), size, iters)


def test_rc_pingpong_client_without_fabric_says_what_to_do() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "rc_pingpong.py"), "127.0.0.1"],
        capture_output=True,
        text=True,
        env=env_without_fabric(),
        timeout=TIMEOUT,
    )
    assert proc.returncode == 1
    assert "CKPT_FABRIC" in proc.stderr and "--pair" in proc.stderr


@pytest.mark.parametrize(("size", "iters", "depth", "cq_mod"), [(4096, 64, 16, 4), (100_000, 10, 4, 8)])
def test_rdma_write_bw_pair(size: int, iters: int, depth: int, cq_mod: int) -> None:
    args = ["--pair", "-s", str(size), "-n", str(iters), "-t", str(depth), "-Q", str(cq_mod)]
    client, server = sides(run_example("rdma_write_bw.py", *args))
    rows = [m for m in map(BW_ROW.match, client) if m]
    assert len(rows) == 1, client
    assert (int(rows[0][1]), int(rows[0][2])) == (size, iters)
    bandwidth, rate = float(rows[0][3]), float(rows[0][4])
    assert bandwidth > 0 and rate > 0
    assert bandwidth * 2**20 / size == pytest.approx(rate * 1e6, rel=0.05)
    assert f"CQ Moderation   : {min(cq_mod, depth)}" in "\n".join(client)
    assert any("arrived intact" in line for line in server), server
    mine, theirs = addresses(client, BW_DEST), addresses(server, BW_DEST)
    assert mine["local"] == theirs["remote"] and mine["remote"] == theirs["local"]


def test_rc_pingpong_events_arms_the_cq_before_the_client_can_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """-e: a completion that lands before a CQ is armed raises no event.  The client sends as soon as the addresses
    are exchanged, so the server arms its CQ before it posts its receives, as ibv_rc_pingpong does; armed only
    when its loop began, a server whose receive had already completed waited in get_cq_event for good, and the
    client with it (a CI run, and once in 131 runs here).  Here the receive has completed before the loop."""
    import threading

    sys.path.insert(0, str(EXAMPLES))
    import rc_pingpong as rp
    from verbs_util import bring_up, make_endpoint, recv_wr, send_wr

    from ckpt import verbs as v

    peer_ctx = v.Context(name="simib41")
    try:
        peer = make_endpoint(peer_ctx, sq_sig_all=0)
        seen: list[int] = []

        def exchange(listener: Any, pp: Any, my_psn: int, mtu: int, mine: bytes) -> tuple[int, int, int]:
            """The client, in this thread: connect, send once, and return only once the server's CQ holds the
            receive completion -- before the server's loop begins."""
            listener.close()
            lid = pp.ctx.query_port(1).lid
            pp.connect(my_psn, mtu, (peer.lid, peer.qp.qp_num, 0))
            bring_up(peer.qp, pp.qp.qp_num, lid, sq_psn=0, rq_psn=my_psn)
            peer.qp.post_recv(recv_wr([peer.sge(0, 4096)]))  # for the server's answer
            peer.qp.post_send(send_wr([peer.sge(0, 100)], flags=0))
            wait_for(lambda: len(pp.cq.handle.entries) == 1, TIMEOUT, "the receive completion at the server")
            seen.append(len(pp.cq.handle.entries))
            return peer.lid, peer.qp.qp_num, 0

        monkeypatch.setattr(rp, "server_exchange", exchange)
        args = rp.parse_args(["-d", "simib40", "-p", "0", "-s", "100", "-n", "1", "-e"])
        failed: list[BaseException] = []

        def server() -> None:
            try:
                rp.run(args)
            except BaseException as exc:  # reported below
                failed.append(exc)

        thread = threading.Thread(target=server, daemon=True)  # daemon: a hung server must not hold pytest
        thread.start()
        thread.join(20.0)
        assert seen == [1] and not failed, failed
        assert not thread.is_alive(), "the server waits for a CQ event its receive completion never raised"
        wait_for(lambda: peer.rcq.poll(1)[0] == 1, TIMEOUT, "the server's answer")
    finally:
        peer_ctx.close()
