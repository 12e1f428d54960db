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

import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dsm_cases import CASES, RESTARTS, DsmCase, protocol_args
from dsm_util import expected_lines
from ib_cases import RANKS, Hold, Pauses, launch_args, random_seed, take

from ckpt.testing import Job, results, run, wait_for
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
    job = start_job(*launch_args(ckpt_dir, argv, *protocol_args(protocol)), ckpt_dir=ckpt_dir, extra_env=env)
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


# (SOR under cashmere too: its TSP, lock-bound, takes 5-10x HLRC's time there -- docs/benchmarks.md, "The protocol
# study" -- and this test runs the program three times; Water restarts under cashmere in CI through RESTARTS)
@pytest.mark.parametrize(("name", "protocol", "fill"), [("sor", "onesided", "copy"), ("sor", "cashmere", "line")])
def test_a_dsm_job_restarts_over_tcp_and_runs_native(
    name: str, protocol: str, fill: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    case = next(case for case in CASES if case.name == name)
    ckpt_dir, hold, pauses = tmp_path / "ckpt", Hold(tmp_path), Pauses(tmp_path, case.checkpoint_at)
    env = {PROGRAM_ENV: case.name, **hold.env, **pauses.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    chosen = ("--dsm-protocol", protocol, "--dsm-fill", fill)
    job = start_job(*launch_args(ckpt_dir, argv, *chosen), ckpt_dir=ckpt_dir, extra_env=env)
    pauses.wait(case.checkpoint_at)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    pauses.open(case.checkpoint_at)
    hold.release()
    again = start_job("restart", "--transport", "tcp", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    assert again.wait() == 0, again.stderr
    expected = uninterrupted(case, protocol)
    assert results(again.stdout) == expected
    native = run(
        "launch",
        "-n",
        str(RANKS),
        "--native",
        *chosen,
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
    assert "'twosided' is not one of 'async', 'onesided', 'cashmere'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (["--dsm-fill", "line"], "--dsm-fill line is the cashmere protocol's: async copies whole pages"),
        (["--dsm-unsafe", "2"], "--dsm-unsafe is the cashmere protocol's: async has no write notice lists"),
        (["--dsm-protocol", "cashmere", "--dsm-unsafe", "-1"], "--dsm-unsafe -1: a number of readers"),
    ],
    ids=["fill", "unsafe", "negative"],
)
def test_cashmeres_options_are_refused_in_one_line_where_they_mean_nothing(
    option: list[str], error: str, tmp_path: Path
) -> None:
    program = Path(__file__).resolve().parents[1] / "dsm" / "programs" / "sor.py"
    done = run("launch", "-n", "2", *option, "--ckpt-dir", str(tmp_path / "c"), str(program))
    assert done.returncode != 0
    assert error in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("mode", ["remote", "stable"])
def test_logging_under_cashmere_is_refused_in_one_line_before_the_job_starts(mode: str, tmp_path: Path) -> None:
    program = Path(__file__).resolve().parents[1] / "dsm" / "programs" / "sor.py"
    ckpt_dir = tmp_path / "c"
    done = run(
        "launch", "-n", "2", "--dsm-protocol", "cashmere", "--logging", mode, "--ckpt-dir", str(ckpt_dir), str(program)
    )
    assert done.returncode != 0
    assert f"--logging {mode} logs HLRC's intervals and diffs" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not list(ckpt_dir.glob("*.ckpt"))  # nothing ran


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


WAIT_LINE = re.compile(r"^rank (\d+) has waited ([\d.]+) s for (.+) \(dsm\)$", re.MULTILINE)
FACT_LINE = re.compile(r"^at rank 0: (.+) \(for [\d.]+ s, dsm\)$", re.MULTILINE)


def test_status_shows_what_each_rank_waits_for_in_the_dsm(start_job: Callable[..., Job], tmp_path: Path) -> None:
    """Rank 0 stalls outside the DSM holding a lock, then before a barrier: `ckpt status` shows the other ranks
    waiting for the lock, then for the barrier (never rank 0, and never a wait that is over), and what the
    lock's home (rank 0, lock 0) and the barrier manager (rank 0) see standing; `--json` has the same as
    `ranks[i].plugins.dsm`."""
    ckpt_dir, gate = tmp_path / "ckpt", tmp_path / "gate"
    argv = ["launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "dsm_stall.py"), str(gate)]
    job = start_job(*argv, ckpt_dir=ckpt_dir)

    seen: dict[str, list[str]] = {}

    def waiting() -> dict[int, str]:
        shown = run("status", "--ckpt-dir", str(ckpt_dir)).stdout
        seen["facts"] = [m[1] for m in FACT_LINE.finditer(shown)]
        return {int(m[1]): m[3] for m in WAIT_LINE.finditer(shown)}

    def locked() -> bool:
        return waiting() == {1: "lock 0", 2: "lock 0"} and seen["facts"] == [
            "lock 0 is held by rank 0, wanted by ranks 1, 2"
        ]

    wait_for(locked, 60, "ranks 1 and 2 shown waiting for lock 0, and its home's view", 0.3)
    state = json.loads(run("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)
    report = state["ranks"][1]["plugins"]["dsm"]
    assert [w["what"] for w in report["waits"]] == ["lock 0"] and report["incarnation"] == 0
    assert time.time() - report["waits"][0]["since"] >= 2.0  # STUCK_AFTER
    gate.with_suffix(".lock").touch()

    def in_one_barrier() -> str | None:  # ranks 1 and 2, the lock's wait over, both in the same barrier
        waits = waiting()
        same = waits.keys() == {1, 2} and waits[1] == waits[2] and waits[1].startswith("barrier ")
        manager = f"{waits[1]} waits for rank 0 (ranks 1, 2 arrived)" if same else None
        return waits[1] if same and seen["facts"] == [manager] else None

    wait_for(in_one_barrier, 60, "ranks 1 and 2 shown waiting in the barrier, and no longer for the lock", 0.3)
    gate.with_suffix(".barrier").touch()
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {r: "counter 3 lock 0" for r in range(3)}
