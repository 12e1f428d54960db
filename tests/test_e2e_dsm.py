"""End-to-end: DSM programs under `ckpt launch`, checkpointed mid-run, killed and restarted, via the CLI.

Each program runs 4 ranks on one protocol; the test takes a checkpoint the job
resumes from, then one it is killed at, restarts it, and compares the result
lines with an uninterrupted run of the same program (thread-ranks in process,
tests/dsm_util.py: the same code, no checkpoint).  The job idles at two chosen
steps until the test lets it go on (tests/programs/dsm_held.py), so both
checkpoints are mid-run however fast the program is.  Each program also checks its
own answer against plain numpy (`numpy=match`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dsm_cases import CASES, RESTARTS, DsmCase
from dsm_util import expected_lines
from ib_cases import RANKS, Hold, Pauses, launch_args, random_seed, take

from ckpt.testing import Job, results, run
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROGRAM_ENV = "CKPT_TEST_DSM_PROGRAM"


def uninterrupted(case: DsmCase, protocol: str) -> dict[int, str]:
    """What an uninterrupted run of `case` prints, under either protocol (`expected_lines`: numpy's answer,
    which test_dsm_programs checks against real runs)."""
    return expected_lines(case.name, case.long, RANKS)


@pytest.mark.parametrize(("case", "protocol"), RESTARTS)
def test_checkpoint_resume_kill_restart_gives_the_uninterrupted_result(
    case: DsmCase, protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    first, second = case.checkpoint_at // 2, case.checkpoint_at
    pauses = Pauses(tmp_path, first, second)
    env = {PROGRAM_ENV: case.name, **hold.env, **pauses.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    job = start_job(*launch_args(ckpt_dir, argv, "--dsm-protocol", protocol), ckpt_dir=ckpt_dir, extra_env=env)
    pauses.wait(first)
    take(ckpt_dir, "--wait")
    pauses.open(first)  # the job resumes and runs on to the second pause
    pauses.wait(second)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    assert "cannot be pickled" not in job.stderr  # no false warning from the check after setup
    pauses.open(second)
    hold.release()
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == uninterrupted(case, protocol)


def test_a_dsm_job_restarts_over_tcp_and_runs_native(start_job: Callable[..., Job], tmp_path: Path) -> None:
    case = CASES[0]
    ckpt_dir, hold, pauses = tmp_path / "ckpt", Hold(tmp_path), Pauses(tmp_path, case.checkpoint_at)
    env = {PROGRAM_ENV: case.name, **hold.env, **pauses.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    job = start_job(*launch_args(ckpt_dir, argv, "--dsm-protocol", "onesided"), ckpt_dir=ckpt_dir, extra_env=env)
    pauses.wait(case.checkpoint_at)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    pauses.open(case.checkpoint_at)
    hold.release()
    again = start_job("restart", "--transport", "tcp", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    assert again.wait() == 0, again.stderr
    expected = uninterrupted(case, "onesided")
    assert results(again.stdout) == expected
    native = run(
        "launch",
        "-n",
        str(RANKS),
        "--native",
        "--dsm-protocol",
        "onesided",
        "--ckpt-dir",
        str(tmp_path / "native"),
        str(Path(__file__).resolve().parents[1] / "dsm" / "programs" / f"{case.name}.py"),
        *case.long,
        timeout=120,
    )
    assert native.returncode == 0, native.stderr
    assert results(native.stdout) == expected


def test_an_unknown_protocol_is_one_clear_error(tmp_path: Path) -> None:
    program = Path(__file__).resolve().parents[1] / "dsm" / "programs" / "sor.py"
    done = run("launch", "-n", "2", "--dsm-protocol", "twosided", "--ckpt-dir", str(tmp_path / "c"), str(program))
    assert done.returncode != 0
    assert "'twosided' is not one of 'async', 'onesided'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("protocol", ["async", pytest.param("onesided", marks=pytest.mark.stress)])  # suite time
def test_checkpoints_at_random_moments_of_a_lock_heavy_run(
    protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """TSP (task queue and bound under locks): three checkpoints it resumes from and one kill -> restart, each
    while requests, grants and diffs are in flight, at random moments; the answer is still the optimum."""
    seed = random_seed()
    print(f"seed {seed}")  # CKPT_TEST_SEED=<seed> replays the same moments
    rng = random.Random(seed)
    case = next(c for c in CASES if c.name == "tsp")
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    env = {PROGRAM_ENV: case.name, **hold.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    job = start_job(*launch_args(ckpt_dir, argv, "--dsm-protocol", protocol), ckpt_dir=ckpt_dir, extra_env=env)
    job.wait_step(2)
    for how in ["--wait", "--wait", "--kill", "--wait"]:
        time.sleep(rng.uniform(0.0, 0.4))  # a random moment, on purpose: what is in flight differs every time
        take(ckpt_dir, how)
        if how == "--kill":
            assert job.wait() == 0, job.stderr
            job = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
            job.wait_step(1)
    hold.release()
    assert job.wait(timeout=240) == 0, job.stderr
    assert results(job.stdout) == uninterrupted(case, protocol), f"seed {seed}"
