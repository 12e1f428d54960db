"""End-to-end: `ckpt launch --sched` / $CKPT_SCHED reach every thread of every rank (and the launcher), a
restart takes its own (the policy is not recorded), a wrong value is one line."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import Job, results, run
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

POLICY = str(PROGRAMS / "policy.py")


def _launcher_policies(job: Job) -> dict[int, int]:
    """The policy of each thread of the launcher process (one that ended meanwhile is left out)."""
    assert job.process is not None
    found = {}
    for tid in os.listdir(f"/proc/{job.process.pid}/task"):
        try:
            found[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:
            continue
    return found


def test_batch_by_default_on_every_thread_of_the_ranks_and_the_launcher(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(tmp_path / "ckpt"), POLICY, "60")
    job.wait_step(2)
    launcher = _launcher_policies(job)
    assert launcher and set(launcher.values()) == {os.SCHED_BATCH}, launcher
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {0: "batch", 1: "batch"}


def test_other_by_option_or_environment_and_a_restart_takes_its_own(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    given = run("launch", "-n", "2", "--sched", "other", "--ckpt-dir", str(tmp_path / "a"), POLICY, "3")
    assert given.returncode == 0, given.stderr
    assert results(given.stdout) == {0: "other", 1: "other"}
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), POLICY, "400", extra_env={"CKPT_SCHED": "other"})
    job.wait_step(5)
    taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0, job.stderr
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))  # not recorded: this run's default
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == {0: "batch", 1: "batch"}


def test_a_wrong_policy_is_one_line(tmp_path: Path) -> None:
    for args, env in ((["--sched", "fifo"], {}), ([], {"CKPT_SCHED": "fifo"})):
        done = run("launch", *args, "--ckpt-dir", str(tmp_path / "ckpt"), POLICY, "3", extra_env=env)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "'fifo' is not one of 'batch', 'other'" in lines[0], done.stderr
