"""End-to-end: a verbs job on several "hosts" -- network namespaces the test creates -- restarted on other ones.

Topology (all created here, all removed at teardown): a namespace holding a
bridge (the switch), and one namespace per host joined to it by a veth pair,
addresses 10.<x>.<y>.<n>/24.  The coordinator runs on one host; ranks are
started on two others by this test acting as the external launcher
(`ip netns exec HOST ckpt launch --coordinator ...` with PMI_RANK / PMI_SIZE),
on the tcp transport: each rank's HCA listens on the address that reaches the
coordinator and finds its peers through it.  After `checkpoint --kill`, the
ranks restart on two *other* hosts, so every endpoint changes, and the result
must be the uninterrupted run's.

Needs root and `ip` (iproute2); skipped with the reason where namespaces cannot
be created.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from ib_cases import Pauses, expected_ring, gated_steps

from ckpt.testing import CKPT, env, results, wait_for
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

RANKS = 4
#: The job idles before real step 20 until it is checkpointed there, and before step 40 of the restarted run until
#: the test has seen where its ranks run (`Pauses`): whatever the load, the checkpoint falls mid-run and the restarted
#: ranks step on new endpoints, 140 steps of them.
FIRST, SECOND = 20, 40
STEPS = gated_steps(SECOND)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], text=True, capture_output=True, timeout=30)


class Hosts:
    """Network namespaces joined by a bridge: host i has address <subnet>.<i + 1>."""

    def __init__(self, count: int) -> None:
        tag = secrets.token_hex(3)
        self.switch = f"cksw{tag}"
        self.names = [f"ckh{tag}{i}" for i in range(count)]
        self.subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.processes: list[subprocess.Popen[str]] = []

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def create(self) -> None:
        steps = [["netns", "add", self.switch], ["-n", self.switch, "link", "add", "br0", "type", "bridge"]]
        steps.append(["-n", self.switch, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.names):
            inside, outside = f"eth{i}", f"p{i}"
            steps += [
                ["netns", "add", ns],
                ["-n", ns, "link", "set", "lo", "up"],
                ["-n", self.switch, "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns],
                ["-n", self.switch, "link", "set", outside, "master", "br0", "up"],
                ["-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inside],
                ["-n", ns, "link", "set", inside, "up"],
            ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")

    def spawn(self, host: int, *ckpt_args: str, extra_env: dict[str, str]) -> subprocess.Popen[str]:
        """`ckpt ARGS` on host `host`; reaped at teardown."""
        command = ["ip", "netns", "exec", self.names[host], *CKPT, *ckpt_args]
        process = subprocess.Popen(
            command, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(**extra_env),
            start_new_session=True,
        )  # fmt: skip
        self.processes.append(process)
        return process

    def run(self, host: int, *ckpt_args: str, extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        command = ["ip", "netns", "exec", self.names[host], *CKPT, *ckpt_args]
        return subprocess.run(command, text=True, capture_output=True, env=env(**extra_env), timeout=60)

    def pids(self, host: int) -> set[int]:
        """The processes in host `host`'s network namespace."""
        listed = _ip("netns", "pids", self.names[host])
        return {int(pid) for pid in listed.stdout.split()}

    def destroy(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for ns in [*self.names, self.switch]:
            _ip("netns", "del", ns)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to create network namespaces")
    made = Hosts(5)
    try:
        made.create()
    except RuntimeError as exc:
        made.destroy()
        pytest.skip(f"this machine does not let the test create network namespaces: {exc}")
    try:
        yield made
    finally:
        made.destroy()


def _finish(process: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def _rank_env(token: dict[str, str], rank: int, pauses: Pauses) -> dict[str, str]:
    return {**token, **pauses.env, "PMI_RANK": str(rank), "PMI_SIZE": str(RANKS)}


def test_a_tcp_job_restarts_with_its_ranks_on_other_hosts(hosts: Hosts, tmp_path: Path) -> None:
    ckpt_dir, pauses = tmp_path / "ckpt", Pauses(tmp_path, FIRST, SECOND)
    token = {"CKPT_TOKEN": "multihost-job-token"}
    coordinator_host = 0
    hosts.spawn(coordinator_host, "coordinator", "--host", hosts.address(0), "--port", "0",
                "--ckpt-dir", str(ckpt_dir), extra_env=token)  # fmt: skip
    job_file = ckpt_dir / "coordinator.json"
    wait_for(job_file.exists, 30, "the coordinator's job file")
    address = json.loads(job_file.read_text())["address"]
    assert address.startswith(hosts.address(0) + ":"), address
    where = ["--coordinator", address, "--ckpt-dir", str(ckpt_dir)]
    program = [str(PROGRAMS / "ib_ring.py"), str(STEPS)]

    # Ranks 0, 1 on host 1 and ranks 2, 3 on host 2.
    first = [hosts.spawn(1 + rank // 2, "launch", "--transport", "tcp", *where, *program,
                         extra_env=_rank_env(token, rank, pauses)) for rank in range(RANKS)]  # fmt: skip

    def stepping(generation: int, at_least: int) -> dict[int, int] | None:
        """{rank: pid} once every rank of `generation` is past step `at_least`."""
        shown = hosts.run(coordinator_host, "status", "--json", *where, extra_env=token)
        state = json.loads(shown.stdout) if shown.returncode == 0 else {}
        ranks = state.get("ranks") or []
        if state.get("generation") != generation or len(ranks) != RANKS:
            return None
        return {r["rank"]: r["pid"] for r in ranks} if min(r["step"] for r in ranks) >= at_least else None

    pauses.wait(FIRST)
    pids = wait_for(lambda: stepping(0, FIRST), 60, "the 4 ranks on hosts 1 and 2 to step")
    assert {pids[0], pids[1]} <= hosts.pids(1) and {pids[2], pids[3]} <= hosts.pids(2)
    taken = hosts.run(coordinator_host, "checkpoint", "--kill", *where, extra_env=token)
    assert taken.returncode == 0, taken.stderr
    for process in first:
        code, _, err = _finish(process)
        assert code == 0, err
    pauses.open(FIRST)

    # Restart with ranks 0, 1 on host 3 and ranks 2, 3 on host 4: every endpoint is new.
    again = [hosts.spawn(3 + rank // 2, "restart", *where, extra_env=_rank_env(token, rank, pauses))
             for rank in range(RANKS)]  # fmt: skip
    pauses.wait(SECOND)
    pids = wait_for(lambda: stepping(1, SECOND), 60, "the 4 restarted ranks on hosts 3 and 4 to step")
    assert {pids[0], pids[1]} <= hosts.pids(3) and {pids[2], pids[3]} <= hosts.pids(4)
    pauses.open(SECOND)
    printed: dict[int, str] = {}
    for process in again:
        code, out, err = _finish(process)
        assert code == 0, err
        printed.update(results(out))
    assert printed == expected_ring(RANKS, STEPS)
