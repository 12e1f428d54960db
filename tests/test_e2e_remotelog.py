"""End-to-end: DSM programs under `ckpt launch --logging remote|stable`, checkpointed, killed and restarted.

The logs change nothing a program computes: each run's result lines must be those of
an uninterrupted run of the same program without logging (thread-ranks in process).
The checkpoint the job resumes from exercises the discard (RDMA on the DSM's queue
pairs, under the verbs plugin, right after the manifest is written); the restart
brings the rings back from the images and keeps logging.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dsm_cases import CASES, DsmCase
from ib_cases import Hold, Pauses, launch_args, take
from test_e2e_dsm import PROGRAM_ENV, uninterrupted

from ckpt.testing import Job, one_error_line, results, run
from harness import PROGRAMS, small_disk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
BY_NAME = {case.name: case for case in CASES}


# CI runs async (and onesided logging end to end in test_a_logged_job_gives_the_uninterrupted_answer);
# the onesided checkpoint-kill-restart is the stress run.
@pytest.mark.parametrize("protocol", ["async", pytest.param("onesided", marks=pytest.mark.stress)])
def test_a_logged_job_checkpointed_killed_and_restarted_gives_the_uninterrupted_answer(
    protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    case = BY_NAME["water"]
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    first, second = case.checkpoint_at // 2, case.checkpoint_at
    pauses = Pauses(tmp_path, first, second)
    env = {PROGRAM_ENV: case.name, **hold.env, **pauses.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    options = ("--dsm-protocol", protocol, "--logging", "remote")
    job = start_job(*launch_args(ckpt_dir, argv, *options), ckpt_dir=ckpt_dir, extra_env=env)
    pauses.wait(first)
    take(ckpt_dir, "--wait")
    pauses.open(first)
    pauses.wait(second)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    pauses.open(second)
    hold.release()
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == uninterrupted(case, protocol)


# suite time: TSP under onesided with remote logging runs in CI in test_e2e_replay (mid-lock), killed and replayed
@pytest.mark.parametrize(
    ("name", "protocol", "logging"),
    [pytest.param("tsp", "onesided", "remote", marks=pytest.mark.stress), ("isort", "async", "stable")],
)
def test_a_logged_job_gives_the_uninterrupted_answer(
    name: str, protocol: str, logging: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    case: DsmCase = BY_NAME[name]
    ckpt_dir = tmp_path / "ckpt"
    argv = [str(Path(__file__).parent.parent / "dsm" / "programs" / f"{name}.py"), *case.long]
    job = start_job(*launch_args(ckpt_dir, argv, "--dsm-protocol", protocol, "--logging", logging), ckpt_dir=ckpt_dir)
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == uninterrupted(case, protocol)
    if logging == "stable":
        assert sorted(p.name for p in ckpt_dir.glob("remotelog-stable-*.log")) == [
            f"remotelog-stable-{rank}.log" for rank in range(4)
        ]


def test_stable_logging_on_a_disk_that_fills_stops_the_job_in_one_line_naming_the_log(tmp_path: Path) -> None:
    """A release must not leave unlogged: the rank whose flush the full disk refuses stops, and the job with it
    (--on-failure abort), in one line -- not a traceback, not a job that goes on without its log."""
    disk = tmp_path / "disk"
    argv = [str(Path(__file__).parent.parent / "dsm" / "programs" / "isort.py"), *BY_NAME["isort"].long]
    done = run(
        "launch", "-n", "4", "--ckpt-dir", str(tmp_path / "ckpt"), "--logging", "stable", "--log-dir", str(disk),
        *argv, prefix=small_disk(disk, "128k"), timeout=240,
    )  # fmt: skip
    one_error_line(done, "ckpt_remotelog: stable logging cannot write", str(disk), "No space left on device")
    assert not results(done.stdout)


def test_an_unknown_logging_mode_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run("launch", "-n", "2", "--ckpt-dir", str(tmp_path / "c"), "--logging", "disk", "x.py", timeout=60)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "Traceback" not in out and "--logging" in out and "disk" in out, out


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--log-home-offset", "2", "--log-home-offset 2 makes every rank its own log home with 2 ranks"),
        ("--log-ring-bytes", "16", "--log-ring-bytes 16: a log ring needs at least"),
    ],
)
def test_a_log_placement_no_rank_could_use_is_refused_before_the_job_starts(
    tmp_path: Path, option: str, value: str, says: str
) -> None:
    """One line from the launcher, not one DsmError per rank at attach."""
    argv = [str(Path(__file__).parent.parent / "dsm" / "programs" / "sor.py")]
    ckpt_dir = tmp_path / "ckpt"
    done = run("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), "--logging", "remote", option, value, *argv)
    one_error_line(done, says)
    assert not (ckpt_dir / "fabric.json").exists()  # the fabric that started first was stopped
