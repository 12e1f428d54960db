"""End-to-end: `--on-failure recover` -- ranks killed with SIGKILL come back alone while the others run on.

Every run ends with the uninterrupted run's results and exit status 0; the
ranks that were not killed keep their PIDs from start to end; a killed rank's
incarnation goes up by one per kill.  Also: what recover refuses, that the
default (abort) still fails the job, and `ckpt restart --rank R` by hand under a
standalone coordinator and external-launcher-style ranks.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt.coordinator._recovery import MAX_RECOVERY_ATTEMPTS
from ckpt.plugin import Phase
from ckpt.testing import Job, one_error_line, results, run, uninterrupted, wait_for
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS = 300
COLLSUM = [str(PROGRAMS / "collsum.py"), str(STEPS)]
#: The same computation with longer steps (the results do not depend on it): room for several kills.
COLLSUM_SLOW = [*COLLSUM, "0.02"]
RECOVER = ["--on-failure", "recover", "--disable-plugin", "ib"]
RESTART_STATES = tuple(phase.state for phase in Phase.restart_sequence())


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    return uninterrupted(tmp_path_factory.mktemp("plain") / "ckpt", 3, *COLLSUM, "0")  # the results: any delay


def _settled(job: Job, *, may_end: bool = False) -> dict[str, Any]:
    """The status once every rank is in the job, none is failed, recovering or in a restart's phases, and there
    is a checkpoint ({} if `may_end` and the job has ended well meanwhile)."""

    def settled() -> dict[str, Any] | None:
        assert job.process is not None
        if job.process.poll() == 0 and may_end:
            return {}
        if job.process.poll() is not None:
            out, err = job.read()
            raise AssertionError(f"the job ended early (exit {job.process.returncode}): {out}{err}")
        state = job.poll_status()
        if not state or len(state["ranks"]) < 3 or state["state"] in ("waiting", "finished", "failed", "killed"):
            return None
        unsettled = ("failed", "recovering", *RESTART_STATES)
        if any(r["state"] in unsettled for r in state["ranks"]) or not state["last_checkpoint"]:
            # a rank lost in a whole-job restart's phases fails the restart, by design (CI killed one there);
            # every rank has an image once the first checkpoint, right after setup, is written
            return None
        return state

    return wait_for(settled, 60, "every rank running, none failed or recovering")  # type: ignore[no-any-return]


def _kill_at_random_moments(job: Job, rng: random.Random, kills: int) -> tuple[dict[int, int], dict[int, int]]:
    """Kill a random rank `kills` times, each at a random step and once the previous one is back.

    Returns ({rank: pid} of the ranks never killed at the start, {rank: times killed}).
    """
    first = _settled(job)
    pids = {r["rank"]: r["pid"] for r in first["ranks"]}
    killed: dict[int, int] = {}
    for _ in range(kills):
        state = _settled(job, may_end=True)
        if not state:
            break  # slow machines: the job ran to its end before every kill
        target = min(r["step"] for r in state["ranks"]) + rng.randint(1, 30)
        if target >= STEPS - 80:
            break  # too near the end to be sure of a kill before it finishes
        victim = rng.randrange(3)
        now = _past_step(job, target)
        (before,) = [r for r in now["ranks"] if r["rank"] == victim]
        os.kill(before["pid"], signal.SIGKILL)
        killed[victim] = killed.get(victim, 0) + 1
        _back(job, victim, before["incarnation"] + 1)
    assert killed, "no rank was killed"
    return {r: pid for r, pid in pids.items() if r not in killed}, killed


def _past_step(job: Job, step: int) -> dict[str, Any]:
    def past() -> dict[str, Any] | None:
        now = job.poll_status()
        return now if now and min(r["step"] for r in now["ranks"]) >= step else None

    return wait_for(past, 60, f"every rank past step {step}")  # type: ignore[no-any-return]


def _back(job: Job, rank: int, incarnation: int) -> None:
    def back() -> bool:
        assert job.process is not None
        if job.process.poll() is not None:  # say why, rather than time out
            out, err = job.read()
            raise AssertionError(
                f"the job ended (exit {job.process.returncode}) before rank {rank} came back: {out}{err}"
            )
        later = job.poll_status() or {"ranks": []}
        return any(r["rank"] == rank and r["incarnation"] >= incarnation for r in later["ranks"])

    wait_for(back, 60, f"rank {rank} back as incarnation {incarnation}")


def _recovering_run(
    start_job: Callable[..., Job], ckpt_dir: Path, seed: int, kills: int, expected: dict[int, str]
) -> None:
    job = start_job(
        "launch",
        "-n",
        "3",
        "--ckpt-dir",
        str(ckpt_dir),
        "--interval",
        "0.4",
        *RECOVER,
        *COLLSUM_SLOW,
        ckpt_dir=ckpt_dir,
    )
    survivors, killed = _kill_at_random_moments(job, random.Random(seed), kills)
    final = job.status()
    assert final is not None
    now = {r["rank"]: r for r in final["ranks"]}
    for rank, pid in survivors.items():
        assert now[rank]["pid"] == pid and now[rank]["incarnation"] == 0, final
    for rank, times in killed.items():
        assert now[rank]["incarnation"] == times, final
    job.finishes_with(expected)
    assert "respawning it from checkpoint" in job.stderr


@pytest.mark.parametrize("seed", [1, 2])
def test_ranks_killed_at_random_moments_come_back_alone_and_the_job_ends_as_uninterrupted(
    seed: int, start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    _recovering_run(start_job, tmp_path / "ckpt", seed, 3, expected)


@pytest.mark.stress
@pytest.mark.timeout(3600)
def test_thirty_runs_with_random_kills(start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]) -> None:
    for seed in range(100, 130):
        _recovering_run(start_job, tmp_path / f"ckpt{seed}", seed, 4, expected)


def test_two_ranks_killed_at_once_both_come_back(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--interval", "0.3", *RECOVER, *COLLSUM_SLOW)
    state = _past_step(job, _settled(job)["ranks"][0]["step"] + 20)
    pids = {r["rank"]: r["pid"] for r in state["ranks"]}
    for rank in (0, 2):
        os.kill(pids[rank], signal.SIGKILL)
    _back(job, 0, 1)
    _back(job, 2, 1)
    final = job.status()
    assert final is not None and [(r["pid"], r["incarnation"]) for r in final["ranks"]][1] == (pids[1], 0)
    job.finishes_with(expected)


def test_the_first_checkpoint_is_taken_right_after_setup(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *RECOVER, str(PROGRAMS / "collsum.py"), "400")
    state = _settled(job)
    wait_for(lambda: (job.poll_status() or {}).get("last_checkpoint"), 30, "the first checkpoint")
    manifest = json.loads((ckpt_dir / "ckpt_collsum_1.json").read_text())
    assert [r["step"] for r in manifest["ranks"]] == [0, 0, 0]  # the first boundary, after setup
    assert manifest["settings"]["on_failure"] == "recover"
    assert state["on_failure"] == "recover"


def test_a_rank_lost_before_the_first_checkpoint_fails_the_job_in_one_line(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    slow_setup = [str(PROGRAMS / "collsum.py"), "100", "0.01", "60"]
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *RECOVER, *slow_setup)

    def joined() -> dict[str, Any] | None:
        state = job.poll_status()
        return state if state and len(state["ranks"]) == 3 else None

    pid = wait_for(joined, 60, "every rank joined")["ranks"][1]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert job.wait(60) == 1
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1 (pid") and "before the job's first checkpoint" in line, job.stderr
    assert "Traceback" not in job.stderr


def test_under_abort_a_lost_rank_still_fails_the_job(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--disable-plugin", "ib", *COLLSUM)
    pid = job.wait_step(10)["ranks"][2]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert job.wait(60) == 1
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 2 (pid") and "there is no checkpoint to restart from" in line, job.stderr


def test_recover_with_the_verbs_plugin_loaded_is_refused_naming_it(tmp_path: Path) -> None:
    done = run("launch", "-n", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--on-failure", "recover", *COLLSUM)
    one_error_line(done, "--on-failure recover", "plugin 'ib'", "cannot reconnect", "--disable-plugin ib")
    assert not (tmp_path / "ckpt" / "coordinator.json").exists()  # refused before anything started


def test_recover_under_native_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run("launch", "--native", "--ckpt-dir", str(tmp_path / "ckpt"), "--on-failure", "recover", *COLLSUM)
    one_error_line(done, "--on-failure recover", "--native")


# ----------------------------------------------------------------- ckpt restart --rank, by hand
def test_restart_rank_by_hand_under_a_standalone_coordinator(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    token = {"CKPT_TOKEN": "recover-by-hand-token"}
    start_job("coordinator", "--port", "0", "--ckpt-dir", str(ckpt_dir), extra_env=token)
    wait_for((ckpt_dir / "coordinator.json").exists, 30, "the coordinator's job file")
    address = json.loads((ckpt_dir / "coordinator.json").read_text())["address"]
    where = ["--coordinator", address, "--ckpt-dir", str(ckpt_dir)]
    ranks = [
        start_job("launch", *where, *RECOVER, *COLLSUM, ckpt_dir=ckpt_dir,
                  extra_env={**token, "PMI_RANK": str(r), "PMI_SIZE": "3"})
        for r in range(3)
    ]  # fmt: skip
    ranks[0].wait_step(20)
    wait_for(lambda: (ranks[0].poll_status() or {}).get("last_checkpoint"), 30, "the first checkpoint")
    refused = run("restart", "--rank", "1", *where, extra_env=token)
    one_error_line(refused, "rank 1 of job", "has not failed (it is running)")
    assert ranks[1].process is not None
    os.kill(ranks[1].process.pid, signal.SIGKILL)  # under an external launcher the process is the rank

    def failed() -> bool:
        state = ranks[0].poll_status() or {"ranks": []}
        return any(r["rank"] == 1 and r["state"] == "failed" for r in state["ranks"])

    wait_for(failed, 30, "rank 1 failed")
    shown = run("status", *where, extra_env=token)
    assert "on failure: recover" in shown.stdout.splitlines()[0], shown.stdout
    assert "rank 1 failed (incarnation 0 was lost)" in shown.stdout, shown.stdout
    assert "waiting for `ckpt restart --rank 1`" in shown.stdout, shown.stdout
    again = start_job("restart", "--rank", "1", *where, ckpt_dir=ckpt_dir, extra_env=token)
    assert again.wait(120) == 0, again.stderr
    assert [ranks[r].wait(120) for r in (0, 2)] == [0, 0]
    printed = {**results(ranks[0].stdout), **results(again.stdout), **results(ranks[2].stdout)}
    assert printed == expected


def test_restart_rank_is_refused_without_a_job_under_recover(start_job: Callable[..., Job], tmp_path: Path) -> None:
    nothing = run("restart", "--rank", "1", "--ckpt-dir", str(tmp_path / "none"))
    one_error_line(nothing, "no job in")
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--disable-plugin", "ib", *COLLSUM)
    job.wait_step(5)
    refused = run("restart", "--rank", "1", "--ckpt-dir", str(ckpt_dir))
    one_error_line(refused, "does not run under --on-failure recover")


# ----------------------------------------------------------------- the survivors' hooks, a restart
def _events(directory: Path, rank: int) -> list[dict[str, Any]]:
    path = directory / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_survivors_run_their_hooks_on_one_thread_in_order_and_the_recovered_rank_knows_it(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    events = tmp_path / "events"
    events.mkdir()
    ckpt_dir = tmp_path / "ckpt"
    plugin = ["--with-plugin", "ckpt_rankevents"]
    job = start_job(
        "launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *RECOVER, *plugin, *COLLSUM,
        extra_env={"CKPT_TEST_RANKEVENTS": str(events)},
    )  # fmt: skip
    state = _settled(job)
    os.kill(state["ranks"][2]["pid"], signal.SIGKILL)
    _back(job, 2, 1)
    job.finishes_with(expected)
    for survivor in (0, 1):
        seen = [(e["hook"], e["rank"], e["incarnation"], e["thread"]) for e in _events(events, survivor)]
        assert seen == [("failed", 2, 0, "ckpt-rank-events"), ("recovered", 2, 1, "ckpt-rank-events")], seen
    restarts = [e for e in _events(events, 2) if e["hook"] == "restart"]
    assert [(e["recovered"], e["incarnation"]) for e in restarts] == [(True, 1)]


def test_a_survivor_hook_that_raises_fails_the_job_naming_the_plugin(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    job = start_job(
        "launch", "-n", "3", "--ckpt-dir", str(tmp_path / "ckpt"), *RECOVER, "--with-plugin", "ckpt_rankevents",
        *COLLSUM, extra_env={"CKPT_TEST_RANKEVENTS_RAISE": "1"},
    )  # fmt: skip
    os.kill(_settled(job)["ranks"][1]["pid"], signal.SIGKILL)
    assert job.wait(60) == 1
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank ") and "plugin 'ckpt_rankevents' failed in ckpt_rank_failed" in line, line
    assert "cannot live without rank 1" in line


def test_a_crash_loop_ends_the_job_in_one_line(start_job: Callable[..., Job], tmp_path: Path) -> None:
    job = start_job(
        "launch", "-n", "3", "--ckpt-dir", str(tmp_path / "ckpt"), *RECOVER, "--with-plugin", "ckpt_rankevents",
        *COLLSUM, extra_env={"CKPT_TEST_RANKEVENTS_CRASH": "1"},
    )  # fmt: skip
    os.kill(_settled(job)["ranks"][1]["pid"], signal.SIGKILL)
    assert job.wait(120) == 1
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1 (pid") and "while recovering as incarnation 3" in line, job.stderr
    assert f"its recovery failed {MAX_RECOVERY_ATTEMPTS} times in a row" in line, line
    assert "Traceback" not in job.stderr


def test_a_restarted_job_keeps_its_policy_and_each_ranks_incarnation(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *RECOVER, *COLLSUM)
    os.kill(_settled(job)["ranks"][1]["pid"], signal.SIGKILL)
    _back(job, 1, 1)
    _settled(job)
    assert "checkpoint" in run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).stdout
    assert job.wait(60) == 0, job.stderr
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), "--disable-plugin", "ib")
    state = _settled(again)
    assert state["on_failure"] == "recover"  # recorded in the manifest, reused
    assert [r["incarnation"] for r in state["ranks"]] == [0, 1, 0]
    os.kill(state["ranks"][0]["pid"], signal.SIGKILL)
    _back(again, 0, 1)
    again.finishes_with(expected)


# ----------------------------------------------------------------- the image a rank restarts from; a job of one rank
def test_after_a_restart_from_an_older_checkpoint_a_lost_rank_comes_back_from_this_runs_image(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), "--interval", "0.3", *RECOVER, *COLLSUM_SLOW)
    _settled(job)
    wait_for(lambda: ((job.poll_status() or {}).get("last_checkpoint") or {}).get("number", 0) >= 3, 60, "3 ckpts")
    assert "checkpoint" in run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).stdout
    assert job.wait(60) == 0, job.stderr
    newest = max(int(p.stem.rpartition("_")[2]) for p in ckpt_dir.glob("ckpt_collsum_*.json"))
    # back to checkpoint 1 on purpose: the newer coordinated manifests (the rolled-back run's) stay on disk
    first = str(ckpt_dir / "ckpt_collsum_1.json")
    again = start_job("restart", first, "--disable-plugin", "ib", "--interval", "1000", "--log-level", "INFO")
    state = _settled(again)
    _past_step(again, 1)  # the restart's phases are done: a rank lost during them fails the job (not recovered)
    assert state["last_checkpoint"]["number"] == 1 and (ckpt_dir / f"ckpt_collsum_{newest}.json").exists()
    assert [r["latest_image"] for r in state["ranks"]] == [1, 1, 1]
    os.kill(state["ranks"][1]["pid"], signal.SIGKILL)
    _back(again, 1, 1)
    again.finishes_with(expected)
    assert (
        "rank 1 rejoined as incarnation 1" in again.stderr and "restarting from checkpoint 1 at step 0" in again.stderr
    )
    assert f"restarting from checkpoint {newest}" not in again.stderr


def test_a_job_of_one_rank_killed_is_recovering_and_restart_rank_brings_it_back(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    alone = uninterrupted(tmp_path / "plain", 1, *COLLSUM, "0")
    ckpt_dir = tmp_path / "ckpt"
    token = {"CKPT_TOKEN": "one-rank-recover-token"}
    start_job("coordinator", "--port", "0", "--ckpt-dir", str(ckpt_dir), extra_env=token)
    wait_for((ckpt_dir / "coordinator.json").exists, 30, "the coordinator's job file")
    address = json.loads((ckpt_dir / "coordinator.json").read_text())["address"]
    where = ["--coordinator", address, "--ckpt-dir", str(ckpt_dir)]
    rank = start_job("launch", *where, *RECOVER, *COLLSUM_SLOW, ckpt_dir=ckpt_dir,
                     extra_env={**token, "PMI_RANK": "0", "PMI_SIZE": "1"})  # fmt: skip
    rank.wait_step(5)
    wait_for(lambda: (rank.poll_status() or {}).get("last_checkpoint"), 30, "the first checkpoint")
    assert rank.process is not None
    os.kill(rank.process.pid, signal.SIGKILL)

    def recovering() -> bool:
        shown = run("status", *where, extra_env=token)
        return shown.returncode == 0 and "state recovering" in shown.stdout.splitlines()[0]

    wait_for(recovering, 30, "the job recovering (not failed) with its only rank lost")
    shown = run("status", *where, extra_env=token).stdout
    assert "rank 0 failed (incarnation 0 was lost)" in shown and "ckpt restart --rank 0" in shown, shown
    again = start_job("restart", "--rank", "0", *where, ckpt_dir=ckpt_dir, extra_env=token)
    assert again.wait(120) == 0, again.stderr
    assert results(again.stdout) == alone


def test_an_incarnation_hung_in_its_restart_is_killed_after_the_phase_timeout_and_the_next_one_recovers(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    job = start_job(
        "launch", "-n", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--phase-timeout", "5", *RECOVER,
        "--with-plugin", "ckpt_rankevents", *COLLSUM_SLOW, extra_env={"CKPT_TEST_RANKEVENTS_HANG": "1"},
    )  # fmt: skip
    os.kill(_settled(job)["ranks"][1]["pid"], signal.SIGKILL)
    _back(job, 1, 2)  # incarnation 1 hung in ckpt_restart with its connection alive
    job.finishes_with(expected)
    assert "was lost while recovering as incarnation 1 (it did not finish RESTART within 5 s)" in job.stderr
    assert "respawning it from checkpoint 1 as incarnation 2" in job.stderr
