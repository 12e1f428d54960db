"""End-to-end: independent checkpoints of one rank (`ckpt checkpoint --rank R`, `--rank-interval`) through the CLI.

One rank is checkpointed at its own next step boundary while the others keep
computing; its image is recorded in a manifest of kind "rank" and `latest` stays
the last coordinated checkpoint, so a later `checkpoint --kill` and `restart`
still end with the uninterrupted result.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ib_cases import Hold, expected_ring, random_seed

from ckpt import _jobdir as jobdir
from ckpt import _manifest as manifests
from ckpt.testing import Job, one_error_line, results, run, wait_for
from harness import PROGRAMS, counter_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

COUNTER = [str(PROGRAMS / "counter.py"), "400", "0.004"]
#: Long enough (22 s at least) that a job is still running when a test is done checkpointing it; its
#: restart runs without the delay (the results do not depend on it). 1000 steps of 22 ms, not 3000 of 4 ms: each
#: step's allgather is what costs CPU, here and in the restart.
LONG_COUNTER = [str(PROGRAMS / "counter.py"), "1000", "0.022", "0"]
#: The stress test's: its restart must run long enough, without the delay, for independent checkpoints to follow.
STRESS_COUNTER = [str(PROGRAMS / "counter.py"), "3000", "0.004", "0"]


def solo_result(rank: int, steps: int) -> str:
    """tests/programs/solo.py's answer, computed plainly."""
    x = [i * (rank + 3) for i in range(512)]
    for i in range(steps):
        x = [(v * 31 + i) % 1_000_003 for v in x]
    return f"{steps}:{sum(x)}"


def manifest(ckpt_dir: Path, program: str, number: int) -> dict[str, Any]:
    return dict(json.loads((ckpt_dir / manifests.manifest_name(program, number)).read_text()))


def take(ckpt_dir: Path, *flags: str) -> str:
    done = run("checkpoint", *flags, "--ckpt-dir", str(ckpt_dir), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def assert_every_rank_recoverable(ckpt_dir: Path, program: str, size: int) -> dict[int, int]:
    """The newest manifest names an existing image of every rank; {rank: its image's number}."""
    token = jobdir.read_job_file(ckpt_dir)["token"].encode()  # type: ignore[index]
    found = {}
    for rank in range(size):
        _, number = manifests.rank_image(ckpt_dir, program, rank, token=token)
        assert (ckpt_dir / manifests.image_name(program, rank, number)).exists(), (rank, number)
        found[rank] = number
    return found


@pytest.fixture(scope="module")
def expected_counter() -> dict[int, str]:
    return counter_results(3, int(COUNTER[1]))  # the uninterrupted run's (checked in test_e2e_faults)


@pytest.fixture(scope="module")
def expected_long() -> dict[int, str]:
    return counter_results(3, int(LONG_COUNTER[1]))


def test_the_others_keep_stepping_while_one_rank_checkpoints_alone(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir, gate, hooks = tmp_path / "ckpt", tmp_path / "gate", tmp_path / "hooks"
    hooks.mkdir()
    env = {"CKPT_TEST_HOLD_RANK": "1", "CKPT_TEST_GATE": str(gate), "CKPT_TEST_HOOKLOG": str(hooks)}
    argv = ["launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_holdrank"]
    job = start_job(*argv, str(PROGRAMS / "solo.py"), "400", "0.01", extra_env=env)
    job.wait_step(5)
    waiting = start_job("checkpoint", "--rank", "1", "--wait", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir)

    def held() -> dict[str, Any] | None:
        state = job.poll_status()
        return state if state and state["ranks"][1]["state"] == "drain" else None

    state = held_at = wait_for(held, 60, "rank 1 held in the drain of its independent checkpoint")
    assert state["independent_in_progress"] == {"rank": 1, "number": 1, "stage": "drain"}
    shown = run("status", "--ckpt-dir", str(ckpt_dir)).stdout
    assert "independent checkpoint 1 of rank 1 in progress (drain)" in shown, shown
    before = {r["rank"]: r["step"] for r in held_at["ranks"]}

    def stepped() -> dict[str, Any] | None:
        state = job.poll_status()
        return state if state and all(state["ranks"][r]["step"] >= before[r] + 10 for r in (0, 2)) else None

    state = wait_for(stepped, 60, "ranks 0 and 2 to step on while rank 1 is held")
    assert state["ranks"][1]["step"] == before[1], "the held rank stepped"
    gate.touch()
    assert waiting.wait() == 0, waiting.stderr
    assert "independent checkpoint 1 of rank 1 written" in waiting.stdout
    written = manifest(ckpt_dir, "solo", 1)
    assert written["kind"] == "rank" and [e["rank"] for e in written["ranks"]] == [1]
    assert not (ckpt_dir / manifests.LATEST).exists()  # no coordinated checkpoint: no whole-job restart point
    assert job.status()["ranks"][1]["latest_image"] == 1  # type: ignore[index]
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {r: solo_result(r, 400) for r in range(3)}
    hooks_of_1 = (hooks / "hooks.1").read_text().split()
    assert hooks_of_1 == [
        w for h in ("presuspend", "drain", "precheckpoint", "checkpointed", "resume") for w in (h, "True")
    ]
    assert not (hooks / "hooks.0").exists() and not (hooks / "hooks.2").exists()  # the others saw nothing


def test_independent_then_coordinated_checkpoints_restart_to_the_uninterrupted_result(
    start_job: Callable[..., Job], tmp_path: Path, expected_long: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *LONG_COUNTER)
    job.wait_step(20)
    assert "checkpoint 1 written" in take(ckpt_dir, "--wait")
    assert "independent checkpoint 2 of rank 1 written" in take(ckpt_dir, "--rank", "1", "--wait")
    assert (ckpt_dir / manifests.LATEST).read_text().strip() == "ckpt_counter_1.json"
    rank_manifest = manifest(ckpt_dir, "counter", 2)
    assert rank_manifest["kind"] == "rank"
    assert [(e["file"], e.get("number")) for e in rank_manifest["ranks"]] == [
        ("ckpt_counter_0_1.ckpt", 1),
        ("ckpt_counter_1_2.ckpt", None),
        ("ckpt_counter_2_1.ckpt", 1),
    ]
    state = job.status()
    assert state is not None and [r["latest_image"] for r in state["ranks"]] == [1, 2, 1]
    assert state["last_checkpoint"]["number"] == 1
    shown = run("status", "--ckpt-dir", str(ckpt_dir))
    assert "latest image 2" in shown.stdout, shown.stdout
    assert "checkpoint 3 written" in take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    rank_manifest_path = str(ckpt_dir / "ckpt_counter_2.json")
    one_error_line(run("restart", rank_manifest_path), "ckpt_counter_2.json is an independent checkpoint's")
    inspected = run("inspect", rank_manifest_path)
    assert inspected.returncode == 0 and inspected.stdout.count("  ok") == 3, inspected.stdout + inspected.stderr
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    again.finishes_with(expected_long)


def test_a_verbs_ring_checkpointed_rank_by_rank_then_killed_restarts_exactly(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """ckpt_ib: an independent checkpoint drains nothing with the peers; the coordinated one after it is exact."""
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    steps = 600
    argv = ["launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "ib_ring.py"), str(steps)]
    job = start_job(*argv, ckpt_dir=ckpt_dir, extra_env=hold.env)
    job.wait_step(30)
    for rank in (1, 3):
        assert f"of rank {rank} written" in take(ckpt_dir, "--rank", str(rank), "--wait")
    job.wait_step(60)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    hold.release()
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), extra_env=hold.env)
    again.finishes_with(expected_ring(4, steps))


def _dsm_rank_by_rank(
    name: str, protocol: str, independent: int, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """DSM program `name`: `independent` checkpoints of random ranks at random moments (a coordinated one it
    resumes from after every third), then a coordinated --kill and a restart; the answer is the uninterrupted one."""
    from dsm_cases import CASES
    from test_e2e_dsm import PROGRAM_ENV
    from test_e2e_dsm import uninterrupted as dsm_uninterrupted

    seed = random_seed()
    print(f"seed {seed}")  # CKPT_TEST_SEED=<seed> replays the same moments
    rng = random.Random(seed)
    case = next(c for c in CASES if c.name == name)
    ckpt_dir, hold = tmp_path / "ckpt", Hold(tmp_path)
    env = {PROGRAM_ENV: case.name, **hold.env}
    argv = ["launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), "--dsm-protocol", protocol]
    job = start_job(*argv, str(PROGRAMS / "dsm_held.py"), *case.long, ckpt_dir=ckpt_dir, extra_env=env)
    job.wait_step(2)
    for i in range(independent):
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment, on purpose: what is in flight differs every time
        assert "written" in take(ckpt_dir, "--rank", str(rng.randrange(4)), "--wait")
        if i % 3 == 2:
            assert "written" in take(ckpt_dir, "--wait")
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    again.wait_step(1)
    hold.release()
    again.finishes_with(dsm_uninterrupted(case, protocol), timeout=240)


# CI runs async; onesided is the stress run (the DSM side of an independent checkpoint is the same code).
@pytest.mark.parametrize("protocol", ["async", pytest.param("onesided", marks=pytest.mark.stress)])
def test_a_dsm_job_checkpointed_rank_by_rank_while_it_runs(
    protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """TSP: locks and their requests reach a rank parked in its own checkpoint, which serves them after."""
    _dsm_rank_by_rank("tsp", protocol, 2, start_job, tmp_path)


@pytest.mark.stress
@pytest.mark.parametrize("name", ["tsp", "sor", "water", "isort"])
@pytest.mark.parametrize("protocol", ["async", "onesided"])
def test_many_independent_checkpoints_of_dsm_jobs(
    name: str, protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    _dsm_rank_by_rank(name, protocol, 9, start_job, tmp_path)


def test_rank_interval_runs_a_job_to_the_end_with_an_image_of_every_rank(
    start_job: Callable[..., Job], tmp_path: Path, expected_counter: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--rank-interval", "0.6", "--ckpt-dir", str(ckpt_dir), *COUNTER)
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == expected_counter
    kinds = [json.loads(p.read_text())["kind"] for p in ckpt_dir.glob("ckpt_counter_*.json")]
    assert kinds.count("rank") >= 3 and "job" not in kinds, kinds
    newest = max(int(p.stem.rsplit("_", 1)[1]) for p in ckpt_dir.glob("ckpt_counter_*.json"))
    named = manifest(ckpt_dir, "counter", newest)
    assert sorted(e["rank"] for e in named["ranks"]) == [0, 1, 2]  # staggered: each rank had its turn
    assert named["settings"]["rank_interval"] == 0.6
    assert_every_rank_recoverable(ckpt_dir, "counter", 3)


@pytest.mark.stress  # ~35 s; CI: restart reuses recorded settings by the loop test_e2e_recover checks for --on-failure
def test_a_restart_reuses_the_recorded_rank_interval(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--rank-interval", "0.4", "--ckpt-dir", str(ckpt_dir), *STRESS_COUNTER)
    job.wait_step(60)
    killed = int(take(ckpt_dir, "--kill").split()[1])  # "checkpoint N written: ..."
    assert job.wait() == 0, job.stderr
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    again.finishes_with(counter_results(3, int(STRESS_COUNTER[1])))
    later = [manifest(ckpt_dir, "counter", int(p.stem.rsplit("_", 1)[1])) for p in ckpt_dir.glob("ckpt_counter_*.json")]
    later = [m for m in later if m["number"] > killed]
    assert later and all(m["kind"] == "rank" and m["generation"] == 1 for m in later), later
    assert all(m["settings"]["rank_interval"] == 0.4 for m in later)


def test_keep_never_deletes_an_image_a_rank_still_needs(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    argv = ["launch", "-n", "3", "--interval", "1.5", "--rank-interval", "0.45", "--keep", "1"]
    job = start_job(*argv, "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "solo.py"), "500", "0.01")

    def several() -> bool:
        state = job.poll_status()
        return bool(state and state["last_checkpoint"] and state["last_checkpoint"]["number"] >= 4)

    wait_for(several, 90, "coordinated and independent checkpoints to pile up")
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {r: solo_result(r, 500) for r in range(3)}
    numbers = assert_every_rank_recoverable(ckpt_dir, "solo", 3)
    latest = manifests.latest_manifest(ckpt_dir)
    assert json.loads(latest.read_text())["kind"] == "job"
    jobs = [p for p in ckpt_dir.glob("ckpt_solo_*.json") if json.loads(p.read_text())["kind"] == "job"]
    needed = {n for n in numbers.values()}
    assert all(int(p.stem.rsplit("_", 1)[1]) in needed | {int(latest.stem.rsplit("_", 1)[1])} for p in jobs)
    # every image left is named by a manifest left: nothing of a pruned checkpoint stays behind
    named = {e["file"] for p in ckpt_dir.glob("ckpt_solo_*.json") for e in json.loads(p.read_text())["ranks"]}
    assert {p.name for p in ckpt_dir.glob("ckpt_solo_*.ckpt")} <= named
    assert len(list(ckpt_dir.glob("ckpt_solo_*.json"))) <= 1 + 3 + 1  # latest, one per rank, the newest


def test_bad_independent_checkpoint_requests_are_one_line(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "solo.py"), "100000", "0.01")
    job.wait_step(1)
    where = ["--ckpt-dir", str(ckpt_dir)]
    one_error_line(run("checkpoint", "--rank", "7", *where), "there is no rank 7", "ranks 0..2")
    one_error_line(run("checkpoint", "--rank", "1", "--kill", *where), "--kill cannot go with --rank")
    one_error_line(run("checkpoint", "--rank", "-1", *where), "--rank")
    assert job.status()["state"] == "running"  # type: ignore[index]
    job.kill()
    native_dir = tmp_path / "native"
    native = start_job(
        "launch", "--native", "-n", "2", "--ckpt-dir", str(native_dir), str(PROGRAMS / "solo.py"), "100000", "0.01",
        ckpt_dir=native_dir,
    )  # fmt: skip
    native.wait_step(1)
    one_error_line(run("checkpoint", "--rank", "0", "--ckpt-dir", str(native_dir)), "--native")
    one_error_line(
        run("launch", "--rank-interval", "0.001", "--ckpt-dir", str(tmp_path / "x"), str(PROGRAMS / "solo.py")),
        "--rank-interval 0.001: at least 0.01 s",
    )


def test_a_rank_asks_for_another_ranks_independent_checkpoint(start_job: Callable[..., Job], tmp_path: Path) -> None:
    """rt.checkpoint_rank: what a plugin calls when a log ring fills up."""
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "selfrank.py"))
    assert job.wait() == 0, job.stderr
    first = results(job.stdout)[0]
    assert "['1', 'there is no rank 3: the job has ranks 0..2']" in first, first
    written = manifest(ckpt_dir, "selfrank", 1)
    assert written["kind"] == "rank" and [e["rank"] for e in written["ranks"]] == [2]


def test_a_rank_killed_during_its_independent_checkpoint_leaves_the_previous_checkpoint(
    start_job: Callable[..., Job], tmp_path: Path, expected_long: dict[int, str]
) -> None:
    """kill -9 of rank 1 held in the drain of its own checkpoint: that checkpoint is aborted and its image removed;
    the job fails (--on-failure abort), and checkpoint 1 restarts to the uninterrupted result.  The long counter:
    the job must still run when the independent checkpoint reaches rank 1 (COUNTER's 1.6 s once ended first, under
    a heavily loaded machine)."""
    ckpt_dir, gate = tmp_path / "ckpt", tmp_path / "gate"
    env = {"CKPT_TEST_HOLD_RANK": "1", "CKPT_TEST_GATE": str(gate)}
    argv = ["launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_holdrank", *LONG_COUNTER]
    job = start_job(*argv, extra_env=env)
    job.wait_step(10)
    assert "checkpoint 1 written" in take(ckpt_dir, "--wait")
    waiting = start_job("checkpoint", "--rank", "1", "--wait", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir)

    def held() -> dict[str, Any] | None:
        state = job.poll_status()
        return state if state and state["ranks"][1]["state"] == "drain" else None

    pid = wait_for(held, 60, "rank 1 held in its independent checkpoint")["ranks"][1]["pid"]
    job.seen_pids.add(pid)
    os.kill(pid, signal.SIGKILL)
    assert waiting.wait() == 1
    assert "checkpoint 2 of rank 1 aborted" in waiting.stderr and "Traceback" not in waiting.stderr, waiting.stderr
    assert job.wait() == 1
    assert "rank 1" in job.stderr.strip().splitlines()[-1] and "the latest checkpoint is 1" in job.stderr
    assert not (ckpt_dir / "ckpt_counter_2.json").exists() and not list(ckpt_dir.glob("ckpt_counter_1_2.ckpt*"))
    assert (ckpt_dir / manifests.LATEST).read_text().strip() == "ckpt_counter_1.json"
    gate.touch()
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_holdrank")
    again.finishes_with(expected_long)
