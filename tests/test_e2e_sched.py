"""End-to-end: `ckpt launch --sched` / $CKPT_SCHED reach every thread of every rank (and the launcher), a
restart takes its own (the policy is not recorded), a wrong value is one line."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import Job, results, run
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

POLICY = str(PROGRAMS / "policy.py")
NAMES = {"other": os.SCHED_OTHER, "batch": os.SCHED_BATCH}


def _started_under(policy: str) -> list[str]:
    """A `run(prefix=...)` that starts the ckpt command under `policy`, so that ckpt must change it itself."""
    code = (
        "import os, sys; os.sched_setscheduler(0, int(sys.argv[1]), os.sched_param(0)); "
        "os.execv(sys.argv[2], sys.argv[2:])"
    )
    return [sys.executable, "-c", code, str(NAMES[policy])]


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
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        pytest.skip("the test runner is not under SCHED_OTHER: a job it starts would inherit its policy")
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(tmp_path / "ckpt"), POLICY, "150")
    job.wait_step(2)
    launcher = _launcher_policies(job)
    assert launcher and set(launcher.values()) == {os.SCHED_BATCH}, launcher
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {0: "batch", 1: "batch"}


@pytest.mark.parametrize(
    ("args", "env", "want"),
    [
        (["--sched", "other"], {}, "other"),
        ([], {"CKPT_SCHED": "other"}, "other"),
        (["--sched=batch"], {"CKPT_SCHED": "other"}, "batch"),  # the option wins
    ],
)
def test_the_option_and_the_environment_choose_the_policy(
    tmp_path: Path, args: list[str], env: dict[str, str], want: str
) -> None:
    start = "batch" if want == "other" else "other"  # so that ckpt has to change it
    done = run(
        "launch", "-n", "2", *args, "--ckpt-dir", str(tmp_path / "ckpt"), POLICY, "3",
        extra_env=env, prefix=_started_under(start),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert results(done.stdout) == {0: want, 1: want}


def test_a_restart_takes_its_own_policy(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--sched", "other", "--ckpt-dir", str(ckpt_dir), POLICY, "400")
    job.wait_step(5)
    taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0, job.stderr
    again = run("restart", "--ckpt-dir", str(ckpt_dir), timeout=60, prefix=_started_under("other"))
    assert again.returncode == 0, again.stderr
    assert results(again.stdout) == {0: "batch", 1: "batch"}


def test_a_wrong_policy_is_one_line(tmp_path: Path) -> None:
    for args, env in ((["--sched", "fifo"], {}), ([], {"CKPT_SCHED": "fifo"})):
        done = run("launch", *args, "--ckpt-dir", str(tmp_path / "ckpt"), POLICY, "3", extra_env=env)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "'fifo' is not one of 'batch', 'other'" in lines[0], done.stderr
