"""End-to-end: `ckpt fabric` as a user drives it, and the fabric `ckpt launch` gives a job's ranks."""

from __future__ import annotations

import json
import os
import queue
import signal
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.testing import Job, kill_pids, one_error_line, results, run, wait_for
from ckpt.verbs.fabric import FabricClient
from ckpt_simib import FABRIC_FILE
from harness import PROGRAMS, start_fabric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

FabricStart = Callable[..., dict[str, Any]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fabric_start(tmp_path: Path) -> Iterator[FabricStart]:
    """fabric_start(*args, directory=...) -> fabric.json of a started fabric; its process is killed at teardown."""
    pids: list[int] = []

    def start(*args: str, directory: Path | None = None) -> dict[str, Any]:
        record, stdout = start_fabric(directory or tmp_path / "ckpt", *args)
        pids.append(record["pid"])
        lines = dict(line.split("=", 1) for line in stdout.splitlines())
        assert lines == {"CKPT_FABRIC": record["address"], "CKPT_FABRIC_TOKEN": record["token"]}
        return record

    yield start
    kill_pids(pids)


def _status(directory: Path) -> dict[str, Any]:
    done = run("fabric", "status", "--json", "--dir", str(directory))
    assert done.returncode == 0, done.stderr
    state: dict[str, Any] = json.loads(done.stdout)
    return state


def test_start_status_fail_restore_stop(fabric_start: FabricStart, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    record = fabric_start("--fabric-latency", "2us", "--fabric-bandwidth", "4GB/s")
    assert record["latency"] == 2e-6 and record["bandwidth"] == 4e9
    pushes: queue.Queue[tuple[int, bool]] = queue.Queue()
    with FabricClient(record["address"], record["token"], lambda lid, up: pushes.put((lid, up))) as hca:
        lids = hca.register(guid=7, name="simib0", endpoint="127.0.0.1:9", pid=os.getpid(), host="test")["lids"]
        state = _status(directory)
        assert state["fabric"] == record["fabric"] and state["latency"] == 2e-6
        (shown,) = state["hcas"]
        assert shown["lids"] == lids and all(port["up"] for port in shown["ports"])

        done = run("fabric", "fail-link", "--dir", str(directory), str(lids[1]))
        assert done.returncode == 0, done.stderr
        assert pushes.get(timeout=10) == (lids[1], False)
        state = _status(directory)
        assert [port["up"] for port in state["hcas"][0]["ports"]] == [True, False]
        assert state["statistics"]["links_failed"] == 1
        human = run("fabric", "status", "--dir", str(directory))
        assert f"LID {lids[1]:<6} DOWN" in human.stdout and "latency 2us  bandwidth 4GB/s" in human.stdout

        done = run("fabric", "restore-link", "--fabric", record["address"], str(lids[1]),
                   extra_env={"CKPT_FABRIC_TOKEN": record["token"]})  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert pushes.get(timeout=10) == (lids[1], True)
        assert all(port["up"] for port in _status(directory)["hcas"][0]["ports"])

    done = run("fabric", "stop", "--dir", str(directory))
    assert done.returncode == 0, done.stderr
    assert not (directory / FABRIC_FILE).exists()
    wait_for(lambda: not _alive(record["pid"]), 30, "the subnet manager process to exit")


def test_errors_are_one_line(fabric_start: FabricStart, tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    one_error_line(run("fabric", "status", "--dir", str(nowhere)), "no fabric.json")
    one_error_line(run("fabric", "fail-link", "--dir", str(nowhere), "12"), "no fabric.json")
    one_error_line(run("fabric", "start", "--dir", str(nowhere), "--fabric-latency", "fast"), "bad latency")
    one_error_line(run("fabric", "start", "--dir", str(nowhere), "--fabric-bandwidth", "4XB/s"), "bad bandwidth")

    directory = tmp_path / "ckpt"
    record = fabric_start()
    port = record["address"].rsplit(":", 1)[1]
    one_error_line(run("fabric", "start", "--dir", str(directory)), "already running")
    one_error_line(run("fabric", "start", "--dir", str(tmp_path / "other"), "--port", port), "in use")
    unknown = 1 if _status(directory)["sm_lid"] != 1 else 2
    one_error_line(run("fabric", "fail-link", "--dir", str(directory), str(unknown)), f"no HCA port has LID {unknown}")
    one_error_line(run("fabric", "restore-link", "--dir", str(directory), "zero"), "bad LID")
    one_error_line(run("fabric", "status", "--fabric", record["address"]), "CKPT_FABRIC_TOKEN")
    wrong = {"CKPT_FABRIC_TOKEN": "wrong"}
    one_error_line(run("fabric", "status", "--fabric", record["address"], extra_env=wrong), "CKPT_FABRIC_TOKEN")

    os.kill(record["pid"], signal.SIGKILL)
    wait_for(lambda: not _alive(record["pid"]), 30, "the subnet manager process to die")
    one_error_line(run("fabric", "fail-link", "--dir", str(directory), "12"), "cannot reach the fabric")
    one_error_line(run("fabric", "stop", "--dir", str(directory)), "stale")
    assert not (directory / FABRIC_FILE).exists()


PROBE = '''
"""Registers a pretend HCA on the job's fabric; with "wait", steps until the fabric reports a link down."""

import json
import os
import threading

import ckpt
from ckpt.verbs import fabric


class FabricProbe(ckpt.Program):
    def setup(self, rt):
        self.down = threading.Event()
        self.client = fabric.connect_default(lambda lid, up: None if up else self.down.set())
        reply = self.client.register(guid=1000 + rt.rank, name="simib0", endpoint=f"127.0.0.1:{9000 + rt.rank}",
                                     pid=os.getpid(), host="localhost")
        self.lids = reply["lids"]
        self.seen = {"address": os.environ[fabric.ENV_ADDRESS], "lids": self.lids, "latency": reply["latency"]}
        self.wait = "wait" in rt.argv

    def step(self, rt):
        return self.wait and not self.down.wait(0.05)

    def result(self):
        return json.dumps(self.seen)
'''


@pytest.fixture
def probe(tmp_path: Path) -> str:
    path = tmp_path / "probe.py"
    path.write_text(textwrap.dedent(PROBE))
    return str(path)


def test_launch_gives_every_job_a_fresh_fabric(probe: str, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    seen = []
    for _ in range(2):
        done = run("launch", "-n", "2", "--ckpt-dir", str(directory), "--fabric-latency", "5us", probe, timeout=90)
        assert done.returncode == 0, done.stderr
        ranks = {rank: json.loads(value) for rank, value in results(done.stdout).items()}
        assert sorted(ranks) == [0, 1]
        assert ranks[0]["address"] == ranks[1]["address"] and ranks[0]["latency"] == 5e-6
        seen.append(ranks)
        assert not (directory / FABRIC_FILE).exists()  # the job's fabric ended with it
    assert seen[0][0]["address"] != seen[1][0]["address"]
    assert seen[0][0]["lids"] != seen[1][0]["lids"]


def test_fail_link_reaches_a_running_job(probe: str, tmp_path: Path, start_job: Callable[..., Job]) -> None:
    directory = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(directory), probe, "wait")
    state = wait_for(lambda: (directory / FABRIC_FILE).exists() and _registered(directory, 2), 60, "2 HCAs")
    lid = state["hcas"][1]["lids"][0]
    done = run("fabric", "fail-link", "--dir", str(directory), str(lid))
    assert done.returncode == 0, done.stderr
    assert job.wait(timeout=60) == 0, job.stderr
    assert sorted(results(job.stdout)) == [0, 1]
    assert not (directory / FABRIC_FILE).exists()


def _registered(directory: Path, count: int) -> dict[str, Any] | None:
    done = run("fabric", "status", "--json", "--dir", str(directory))
    if done.returncode != 0:
        return None
    state: dict[str, Any] = json.loads(done.stdout)
    return state if len(state["hcas"]) == count else None


def test_launch_on_an_existing_fabric(probe: str, fabric_start: FabricStart, tmp_path: Path) -> None:
    fabric_dir = tmp_path / "fabric"
    record = fabric_start(directory=fabric_dir)
    token = {"CKPT_FABRIC_TOKEN": record["token"]}
    job_dir = str(tmp_path / "ckpt")
    done = run("launch", "-n", "2", "--ckpt-dir", job_dir, "--fabric", record["address"], probe, extra_env=token)
    assert done.returncode == 0, done.stderr
    assert {json.loads(v)["address"] for v in results(done.stdout).values()} == {record["address"]}
    stats = _status(fabric_dir)["statistics"]
    assert (stats["hcas_registered"], stats["hcas_present"]) == (2, 0)

    conflicting = ("--fabric", record["address"], "--fabric-latency", "2us")
    one_error_line(run("launch", "--ckpt-dir", job_dir, *conflicting, probe, extra_env=token), "--fabric-latency")
    one_error_line(run("launch", "--ckpt-dir", str(fabric_dir), probe), "pass --fabric")


# The link model is a plugin option of ckpt_simib, so the manifest records it and a restart keeps it;
# --fabric names a fabric of one run, so a restart does not go back to it.
COUNTER = [str(PROGRAMS / "counter.py"), "100000", "0.01"]


def test_a_restart_keeps_the_link_model(start_job: Callable[..., Job], tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    where = ["--ckpt-dir", str(directory)]
    job = start_job("launch", *where, "--fabric-latency", "5us", "--fabric-bandwidth", "1GB/s", *COUNTER)
    job.wait_step(3)
    first = _status(directory)
    assert (first["latency"], first["bandwidth"]) == (5e-6, 1e9)
    done = run("checkpoint", "--kill", *where, timeout=60)
    assert done.returncode == 0, done.stderr
    assert job.wait() == 0, job.stderr
    job = start_job("restart", *where)
    job.wait_step(4)
    again = _status(directory)
    assert again["fabric"] != first["fabric"]  # a fresh fabric, with the recorded link model
    assert (again["latency"], again["bandwidth"]) == (5e-6, 1e9)
    assert run("kill", *where).returncode == 0
    assert job.wait() == 0, job.stderr
    assert not (directory / FABRIC_FILE).exists()


def test_a_restart_does_not_reuse_the_fabric_it_was_given(
    fabric_start: FabricStart, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    record = fabric_start(directory=tmp_path / "fabric")
    directory = tmp_path / "ckpt"
    where = ["--ckpt-dir", str(directory)]
    token = {"CKPT_FABRIC_TOKEN": record["token"]}
    job = start_job("launch", *where, "--fabric", record["address"], *COUNTER, extra_env=token)
    job.wait_step(3)
    assert not (directory / FABRIC_FILE).exists()  # it runs on the standalone fabric
    done = run("checkpoint", "--kill", *where, timeout=60)
    assert done.returncode == 0, done.stderr
    assert job.wait() == 0, job.stderr
    job = start_job("restart", *where)
    job.wait_step(4)
    own = json.loads((directory / FABRIC_FILE).read_text())
    assert own["job"] is not None and own["address"] != record["address"]
    assert run("kill", *where).returncode == 0
    assert job.wait() == 0, job.stderr
