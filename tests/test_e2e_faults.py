"""End-to-end fault tests: kill -9 of a rank at each phase of a checkpoint, and while running.

Every time: the checkpoint in progress is aborted and leaves nothing behind,
`launch` exits non-zero with one clear line, `ckpt status` says what happened,
and the previous checkpoint restarts to the uninterrupted run's result.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt import _jobdir as jobdir
from ckpt.testing import Job, results, run, uninterrupted, wait_for
from harness import PROGRAMS, counter_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

#: 400 steps of 25 ms (10 s at least: a job runs on through the faults a test injects -- as long, on a machine so loaded
#: that an allgather takes 5 ms, as the 1200 steps of 4 ms this once was); restarted, the steps take no delay (a restart
#: only finishes). The results depend on neither: the steps' collectives are what costs CPU, a third of them now.
COUNTER = [str(PROGRAMS / "counter.py"), "400", "0.025", "0"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted run (which `counter_results` computes too: checked here, for every test that uses it)."""
    got = uninterrupted(tmp_path_factory.mktemp("plain") / "ckpt", 3, *COUNTER[:2], "0")
    assert got == counter_results(3, int(COUNTER[1]))
    return got


def _launch_with_faults(start_job: Callable[..., Job], ckpt_dir: Path, fault_env: dict[str, str]) -> Job:
    """The counter program on 3 ranks with the fault-injecting plugin, armed by `fault_env`."""
    return start_job(
        "launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_faults", *COUNTER, extra_env=fault_env
    )


def _first_checkpoint(job: Job, ckpt_dir: Path) -> None:
    job.wait_step(20)
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    job.wait_step(40)


def _assert_failed_and_restartable(
    job: Job,
    ckpt_dir: Path,
    expected: dict[int, str],
    start_job: Callable[..., Job],
    lost: int,
    plugins: tuple[str, ...] = ("--with-plugin", "ckpt_faults"),
) -> None:
    assert job.wait() == 1
    (line,) = job.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: ") and f"rank {lost}" in line and "the latest checkpoint is 1" in line, line
    assert "Traceback" not in job.stderr
    assert not (ckpt_dir / "ckpt_counter_2.json").exists()
    assert not list(ckpt_dir.glob("*ckpt_counter_*_2.ckpt*")), "the aborted checkpoint left files behind"
    assert (ckpt_dir / "latest").read_text().strip() == "ckpt_counter_1.json"
    status = run("status", "--json", "--ckpt-dir", str(ckpt_dir))
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["state"] == "failed" and f"rank {lost}" in state["message"]
    assert state["last_checkpoint"]["number"] == 1
    assert [r["state"] for r in state["ranks"]].count("failed") == 1  # the lost one; the others were killed
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), *plugins)  # the same plugins, unarmed now
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == expected


@pytest.mark.parametrize("point", ["presuspend", "drain", "image"])
def test_a_rank_killed_during_a_checkpoint_phase(
    point: str, start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = _launch_with_faults(start_job, ckpt_dir, {"CKPT_TEST_FAULT": f"{point}:1:2"})
    _first_checkpoint(job, ckpt_dir)
    second = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    assert second.returncode == 1
    assert "error:" in second.stderr and "Traceback" not in second.stderr
    _assert_failed_and_restartable(job, ckpt_dir, expected, start_job, lost=1)


def _second_checkpoint_held_at_the_gate(start_job: Callable[..., Job], tmp_path: Path) -> tuple[Job, Job, Path]:
    """(the job, its `checkpoint --wait`, the gate): checkpoint 2 with rank 2's image written and rank 0
    held at the gate in precheckpoint, before the manifest."""
    ckpt_dir = tmp_path / "ckpt"
    gate = tmp_path / "gate"
    job = _launch_with_faults(start_job, ckpt_dir, {"CKPT_TEST_FAULT": "gate:0:2", "CKPT_TEST_GATE": str(gate)})
    _first_checkpoint(job, ckpt_dir)
    second = start_job("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    wait_for((ckpt_dir / "ckpt_counter_2_2.ckpt").exists, 60, "rank 2's image of checkpoint 2")
    return job, second, gate


def test_a_rank_killed_after_writing_its_image_before_the_manifest(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job, second, gate = _second_checkpoint_held_at_the_gate(start_job, tmp_path)
    os.kill(job.rank_pids()[2], signal.SIGKILL)
    # rank 2 may have reported its image already: the gate opens once the coordinator has noticed the loss, or
    # rank 0's report could complete the checkpoint first (on a loaded machine it did)
    wait_for(lambda: job.process.poll() is not None or (job.status() or {}).get("state") == "failed", 60, "the loss")
    gate.touch()
    assert second.wait() == 1
    _assert_failed_and_restartable(job, ckpt_dir, expected, start_job, lost=2)


def test_a_rank_killed_while_running(start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *COUNTER)
    _first_checkpoint(job, ckpt_dir)
    os.kill(job.rank_pids()[0], signal.SIGKILL)
    _assert_failed_and_restartable(job, ckpt_dir, expected, start_job, lost=0, plugins=())


@pytest.mark.parametrize("point,hook", [("raise", "ckpt_precheckpoint"), ("barrier", "ckpt_drain")])
def test_a_failing_plugin_aborts_the_checkpoint_and_the_job_goes_on(
    point: str, hook: str, start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = _launch_with_faults(start_job, ckpt_dir, {"CKPT_TEST_FAULT": f"{point}:1:2"})
    _first_checkpoint(job, ckpt_dir)
    second = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), timeout=60)
    assert second.returncode == 1
    assert f"checkpoint 2 aborted: rank 1: plugin 'ckpt_faults' failed in {hook}" in second.stderr
    third = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), timeout=60)
    assert third.returncode == 0, third.stderr
    assert "checkpoint 3 written" in third.stdout
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == expected
    assert not list(ckpt_dir.glob("*ckpt_counter_*_2.ckpt*")) and not (ckpt_dir / "ckpt_counter_2.json").exists()


def test_a_rank_lost_in_resume_after_the_commit_leaves_that_checkpoint_the_latest(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = _launch_with_faults(start_job, ckpt_dir, {"CKPT_TEST_FAULT": "resume:1:2"})
    _first_checkpoint(job, ckpt_dir)
    second = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    # the manifest was written before rank 1 died: --wait reports it written, not aborted
    assert second.returncode == 0, second.stderr
    assert "checkpoint 2 written" in second.stdout
    assert job.wait() == 1
    assert "rank 1" in job.stderr and "the latest checkpoint is 2" in job.stderr, job.stderr
    assert (ckpt_dir / "latest").read_text().strip() == "ckpt_counter_2.json"
    assert len(list(ckpt_dir.glob("ckpt_counter_*_2.ckpt"))) == 3
    start_job("restart", "--ckpt-dir", str(ckpt_dir)).finishes_with(expected)


def test_the_coordinator_killed_mid_checkpoint_leaves_nothing_the_next_restart_keeps(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job, second, gate = _second_checkpoint_held_at_the_gate(start_job, tmp_path)
    assert job.process is not None
    os.kill(job.process.pid, signal.SIGKILL)  # the launcher and its embedded coordinator (and fabric)
    second.wait()
    wait_for(lambda: jobdir.owner(ckpt_dir) is None, 30, "the killed launcher's claim on the directory to go")
    gate.touch()
    assert list(ckpt_dir.glob("ckpt_counter_*_2.ckpt")), "the test needs images of the unfinished checkpoint"
    gone = run("status", "--ckpt-dir", str(ckpt_dir))
    assert gone.returncode == 1 and "exited without recording an end" in gone.stderr, gone.stderr
    assert "ckpt_counter_1.json" in gone.stderr
    start_job("restart", "--ckpt-dir", str(ckpt_dir)).finishes_with(expected)
    assert not list(ckpt_dir.glob("ckpt_counter_*_2.ckpt*")), "the uncommitted images of checkpoint 2 are still there"
    assert not list(ckpt_dir.glob("*.tmp"))


def test_a_resume_phase_that_times_out_after_the_commit_reports_the_checkpoint_written(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    gate = tmp_path / "gate"
    fault = {"CKPT_TEST_FAULT": "resumegate:1:2", "CKPT_TEST_GATE": str(gate)}
    job = start_job(
        "launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--phase-timeout", "4", "--with-plugin", "ckpt_faults",
        *COUNTER, extra_env=fault,
    )  # fmt: skip
    _first_checkpoint(job, ckpt_dir)
    second = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))  # rank 1 hangs in ckpt_resume
    gate.touch()
    assert second.returncode == 0, second.stderr
    assert "checkpoint 2 written" in second.stdout
    assert job.wait() == 1
    assert "checkpoint 2 was written, but its RESUME phase failed" in job.stderr, job.stderr
    assert (ckpt_dir / "latest").read_text().strip() == "ckpt_counter_2.json"
    start_job("restart", "--ckpt-dir", str(ckpt_dir)).finishes_with(expected)
