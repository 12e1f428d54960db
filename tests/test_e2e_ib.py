"""End-to-end: verbs programs checkpointed, resumed and restarted through the ckpt_ib plugin, 4 ranks, via the CLI.

One shape (tests/harness.py): launch -> (checkpoint -> kill -> restart) x k -> the
uninterrupted run's results, which are checked against a plain-Python computation
of what each program computes.  The tests that checkpoint need the verbs
virtualization plugin (entry point `ib`); they are skipped while it is not installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import PROGRAMS, Job, results, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RANKS = 4
TRACE_ENV = "CKPT_IB_TRACE_DIR"
HOLD_ENV = "CKPT_TEST_HOLD"  # tests/programs/ib_common.py: the job does not finish before this file exists
MODULUS = (1 << 61) - 1


def plugin_installed() -> bool:
    return any(ep.name == "ib" for ep in importlib.metadata.entry_points(group="ckpt.plugins"))


needs_plugin = pytest.mark.skipif(not plugin_installed(), reason="the ckpt_ib plugin is not installed yet")


# ------------------------------------------------------------------ what each program computes, in plain Python
def expected_ring(ranks: int, steps: int) -> dict[int, str]:
    """examples/ring.py and ib_channel.py: each rank mixes in its left neighbour's value every step."""
    values = [rank + 1 for rank in range(ranks)]
    for i in range(steps):
        values = [(values[r] * 31 + values[(r - 1) % ranks] + i) % 1_000_003 for r in range(ranks)]
    return {rank: str(v) for rank, v in enumerate(values)}


def expected_pingpong(ranks: int, steps: int, rounds: int) -> dict[int, str]:
    """ib_pingpong.py: the pinger checksums the pongs, the ponger the pings (late or not)."""
    out = {}
    for pinger in range(0, ranks, 2):
        pair, ponger = pinger // 2, pinger + 1
        got_pinger = got_ponger = 0
        for message in range(steps * rounds):
            ping = bytes((j * (3 + 2 * pair) + message) % 256 for j in range(128))
            pong = bytes((b * 7 + 1 + ponger) % 256 for b in ping)
            got_ponger = (got_ponger * 1_000_003 + zlib.crc32(ping)) % MODULUS
            got_pinger = (got_pinger * 1_000_003 + zlib.crc32(pong)) % MODULUS
        out[pinger], out[ponger] = str(got_pinger), str(got_ponger)
    return out


def expected_atomics(ranks: int, steps: int) -> dict[int, str]:
    """ib_atomics.py: 16 adds of 3 per rank and step; 4 READs of 8 table entries of the right neighbour per step."""
    counter = ranks * steps * 16 * 3
    out = {}
    for rank in range(ranks):
        owner = (rank + 1) % ranks
        checksum = 0
        for step in range(steps):
            for k in range(4):
                offset = (step * 4 + k) * 13 % (512 - 8)
                chunk = sum((owner + 1) * 1_000_003 + (offset + j) * 7919 for j in range(8))
                checksum = (checksum * 31 + chunk) % MODULUS
        out[rank] = f"counter={counter} fetched=ok reads={checksum}"
    return out


def expected_srq(ranks: int, steps: int) -> dict[int, str]:
    """ib_srq.py: each rank mixes in the sum of every other rank's value every step."""
    values = [rank + 1 for rank in range(ranks)]
    for i in range(steps):
        total = sum(values)
        values = [(v * 31 + total - v + i) % 1_000_003 for v in values]
    return {rank: str(v) for rank, v in enumerate(values)}


def expected_seq(ranks: int, steps: int, per_step: int = 8) -> dict[int, str]:
    """ib_seq.py: every message from every source seen exactly once."""
    return {rank: f"{[(steps * per_step, 0, 0)] * (ranks - 1)} corrupt=0" for rank in range(ranks)}


@dataclass(frozen=True)
class Case:
    name: str
    program: Path
    options: tuple[str, ...]  # the program's arguments after STEPS
    expect: Callable[[int], dict[int, str]]  # steps -> what each rank prints
    steps: int  # an uninterrupted run steps for 2-5 s
    checkpoint_at: int  # a step every rank is past when the test checkpoints

    def argv(self, steps: int) -> tuple[str, ...]:
        return (str(self.program), str(steps), *self.options)


# The checkpointing tests hold the job (HOLD_ENV) until their last checkpoint is taken, so a fast run
# cannot end before it; they run LONGER times as many steps and checkpoint early so that the
# checkpoints fall mid-run.  ib_ring.py is examples/ring.py with its step held; the ring's option adds
# 0.5 ms of CPU work per step, which does not change its result.
LONGER = 3
CASES = [
    Case("ring", PROGRAMS / "ib_ring.py", ("500",), lambda n: expected_ring(RANKS, n), 1500, 20),
    Case("pingpong", PROGRAMS / "ib_pingpong.py", ("8",), lambda n: expected_pingpong(RANKS, n, 8), 500, 10),
    Case("atomics", PROGRAMS / "ib_atomics.py", (), lambda n: expected_atomics(RANKS, n), 500, 10),
    Case("channel", PROGRAMS / "ib_channel.py", (), lambda n: expected_ring(RANKS, n), 3000, 30),
    Case("srq", PROGRAMS / "ib_srq.py", (), lambda n: expected_srq(RANKS, n), 2000, 20),
]
BY_NAME = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


def launch_args(ckpt_dir: Path, argv: tuple[str, ...] | list[str]) -> list[str]:
    return ["launch", "-n", str(RANKS), "--ckpt-dir", str(ckpt_dir), *argv]


def take(ckpt_dir: Path, how: str) -> None:
    """`ckpt checkpoint --wait` or `--kill`; it must be written."""
    taken = run("checkpoint", how, "--ckpt-dir", str(ckpt_dir), timeout=120)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "written" in taken.stdout, taken.stdout


def traced(directory: Path, rank: int, generation: int) -> dict[str, list[int]]:
    data: dict[str, list[int]] = json.loads((directory / f"ib.{rank}.{generation}.json").read_text())
    return data


class Hold:
    """The file a held job waits for before it finishes: `env` for launch and restart, `release()` at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "release"
        self.env = {HOLD_ENV: str(self.path)}

    def release(self) -> None:
        self.path.touch()


# ------------------------------------------------------------------ runs that need no checkpoint
@BY_NAME
def test_uninterrupted_and_native_runs_give_the_plain_python_answer(case: Case, tmp_path: Path) -> None:
    argv, expected = case.argv(case.steps), case.expect(case.steps)
    launched = run(*launch_args(tmp_path / "ckpt", argv), timeout=120)
    assert launched.returncode == 0, launched.stderr
    assert results(launched.stdout) == expected
    native = run("launch", "-n", str(RANKS), "--native", "--ckpt-dir", str(tmp_path / "native"), *argv)
    assert native.returncode == 0, native.stderr
    assert results(native.stdout) == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((str(PROGRAMS / "ib_seq.py"), "300"), expected_seq(RANKS, 300)),
        ((str(PROGRAMS / "ib_pingpong.py"), "60", "4", "late"), expected_pingpong(RANKS, 60, 4)),
        ((str(PROGRAMS / "ib_atomics.py"), "200", "inflight"), expected_atomics(RANKS, 200)),
    ],
    ids=["seq", "pingpong-late", "atomics-inflight"],
)
def test_variants_run_uninterrupted_and_native(argv: tuple[str, ...], expected: dict[int, str], tmp_path: Path) -> None:
    for native in ([], ["--native"]):
        done = run("launch", "-n", str(RANKS), *native, "--ckpt-dir", str(tmp_path / "ckpt"), *argv, timeout=120)
        assert done.returncode == 0, done.stderr
        assert results(done.stdout) == expected, native


# ------------------------------------------------------------------ checkpoint -> resume, kill -> restart
@needs_plugin
@BY_NAME
def test_checkpoint_then_resume_gives_the_uninterrupted_result(
    case: Case, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir, steps, hold = tmp_path / "ckpt", case.steps * LONGER, Hold(tmp_path)
    job = start_job(*launch_args(ckpt_dir, case.argv(steps)), ckpt_dir=ckpt_dir, extra_env=hold.env)
    job.wait_step(case.checkpoint_at)
    take(ckpt_dir, "--wait")
    take(ckpt_dir, "--wait")  # a second one, from the resumed state
    hold.release()
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == case.expect(steps)


@needs_plugin
@BY_NAME
def test_kill_then_restart_gives_the_uninterrupted_result_with_new_real_ids(
    case: Case, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir, trace, steps = tmp_path / "ckpt", tmp_path / "trace", case.steps * LONGER
    trace.mkdir()
    hold = Hold(tmp_path)
    env = {TRACE_ENV: str(trace), **hold.env}
    job = start_job(*launch_args(ckpt_dir, case.argv(steps)), ckpt_dir=ckpt_dir, extra_env=env)
    job.wait_step(case.checkpoint_at)
    shown = run("fabric", "status", "--dir", str(ckpt_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    pids = job.rank_pids()
    lids_shown = {
        rank: h["lids"] for h in json.loads(shown.stdout)["hcas"] for rank, pid in pids.items() if h["pid"] == pid
    }
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    hold.release()
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == case.expect(steps)
    for rank in range(RANKS):
        before, after = traced(trace, rank, 0), traced(trace, rank, 1)
        assert sorted(before["lid"]) == sorted(lids_shown[rank]), "fabric status shows the job's real LIDs"
        for key in ("qp_num", "lkey", "rkey", "lid"):
            assert before[key] and len(after[key]) == len(before[key]), (rank, key, before, after)
            assert not set(before[key]) & set(after[key]), f"rank {rank}: real {key} the same after restart"


# ------------------------------------------------------------------ exactly once
def checkpoint_storm(
    start_job: Callable[..., Job], tmp_path: Path, steps: int, resumes: int, restarts: int, seed: int
) -> None:
    """ib_seq through `resumes` checkpoints and `restarts` kill/restart cycles, in a random order at random moments."""
    print(f"seed {seed}")  # shown by pytest when the test fails: CKPT_TEST_SEED=<seed> replays the same schedule
    rng = random.Random(seed)
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    argv = [str(PROGRAMS / "ib_seq.py"), str(steps)]
    plan = ["--wait"] * resumes + ["--kill"] * restarts
    rng.shuffle(plan)
    job = start_job(*launch_args(ckpt_dir, argv), ckpt_dir=ckpt_dir, extra_env=hold.env)
    job.wait_step(5)
    for number, how in enumerate(plan, 1):
        time.sleep(rng.uniform(0.05, 0.5))  # a random moment, on purpose: what is in flight differs every time
        take(ckpt_dir, how)
        if how == "--kill":
            assert job.wait() == 0, job.stderr
            assert f"killed after checkpoint {number}" in job.stderr, job.stderr
            job = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=hold.env)
            job.wait_step(1)
    hold.release()
    assert job.wait(timeout=240) == 0, job.stderr
    assert results(job.stdout) == expected_seq(RANKS, steps), f"seed {seed}"


def _seed() -> int:
    return int(os.environ.get("CKPT_TEST_SEED") or random.SystemRandom().randrange(1 << 32))


@needs_plugin
def test_exactly_once_across_checkpoints_and_restarts(start_job: Callable[..., Job], tmp_path: Path) -> None:
    checkpoint_storm(start_job, tmp_path, steps=2500, resumes=6, restarts=2, seed=_seed())


@needs_plugin
@pytest.mark.stress
@pytest.mark.timeout(900)
def test_exactly_once_across_20_checkpoints_and_5_restarts(start_job: Callable[..., Job], tmp_path: Path) -> None:
    checkpoint_storm(start_job, tmp_path, steps=8000, resumes=20, restarts=5, seed=_seed())


# ------------------------------------------------------------------ what is in flight at the checkpoint
@needs_plugin
@pytest.mark.parametrize(
    ("argv", "expected", "at"),
    [
        ((str(PROGRAMS / "ib_atomics.py"), "600", "inflight"), expected_atomics(RANKS, 600), 10),
        ((str(PROGRAMS / "ib_pingpong.py"), "150", "4", "late"), expected_pingpong(RANKS, 150, 4), 10),
    ],
    ids=["reads-and-atomics", "rnr-retrying-sends"],
)
def test_checkpoint_with_operations_in_flight_resumes_and_restarts(
    argv: tuple[str, ...], expected: dict[int, str], at: int, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    job = start_job(*launch_args(ckpt_dir, argv), ckpt_dir=ckpt_dir, extra_env=hold.env)
    job.wait_step(at)
    take(ckpt_dir, "--wait")
    job.wait_step(at + 5)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=hold.env)
    again.wait_step(at + 10)
    take(ckpt_dir, "--kill")
    assert again.wait() == 0, again.stderr
    hold.release()
    third = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=hold.env)
    assert third.wait() == 0, third.stderr
    assert results(third.stdout) == expected
