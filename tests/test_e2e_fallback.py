"""End-to-end: rt.fall_back (a whole-job restart asked for by a rank) and rt.hold_checkpoints, through the CLI.

A rank of tests/programs/fallback.py calls rt.fall_back at a given step while the job's generation is below a
bound: under --on-failure recover the launcher prints the reason in one line, stops every rank and restarts
the job from its last coordinated checkpoint, and the job ends with the uninterrupted run's results; a job that
keeps falling back fails in one line; under abort the job fails with the reason.  A rank that holds
checkpoints keeps an independent checkpoint asked for meanwhile queued until it releases them.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt.coordinator._recovery import MAX_RECOVERY_ATTEMPTS
from ckpt.testing import Job, one_error_line, results, run, uninterrupted, wait_for
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROGRAM = str(PROGRAMS / "fallback.py")
STEPS, AT = "60", "20"
FLAGS = ["-n", "3", "--disable-plugin", "ib"]
RECOVER = [*FLAGS, "--on-failure", "recover"]
#: what rank 1 says when it falls back in generation G
REASON = "rank 1 cannot replay (test fallback at step 20, generation {})"


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Never falling back (TIMES 0): the results every run below must end with."""
    directory = tmp_path_factory.mktemp("plain") / "ckpt"
    return uninterrupted(directory, 3, "--disable-plugin", "ib", PROGRAM, STEPS, AT, "0")


def status(ckpt_dir: Path) -> dict[str, object]:
    done = run("status", "--json", "--ckpt-dir", str(ckpt_dir))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_fallback_restarts_the_whole_job_from_its_coordinated_checkpoint(
    tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    done = run("launch", "--ckpt-dir", str(ckpt_dir), *RECOVER, PROGRAM, STEPS, AT, "1", timeout=120)
    assert done.returncode == 0, done.stderr
    assert results(done.stdout) == expected
    reason = REASON.format(0)
    lines = [line for line in done.stderr.splitlines() if reason in line]
    assert lines == [f"ckpt: rank 1 cannot go on alone: {reason}; restarting the whole job from checkpoint 1"]
    assert "Traceback" not in done.stderr
    final = status(ckpt_dir)  # the ended job's status, as coordinator.json recorded it
    assert final["generation"] == 1
    assert final["fallbacks"] == {"count": 1, "rank": 1, "reason": reason, "number": 1}
    shown = run("status", "--ckpt-dir", str(ckpt_dir)).stdout
    assert f"whole-job fallbacks: 1, the last from checkpoint 1 (rank 1: {reason})" in shown


def test_a_rank_killed_whose_recovered_incarnation_falls_back_ends_as_uninterrupted(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "--ckpt-dir", str(ckpt_dir), *RECOVER, PROGRAM, STEPS, AT, "0", ckpt_dir=ckpt_dir)

    def settled() -> dict[str, Any] | None:
        state = job.poll_status()
        ready = state and len(state["ranks"]) == 3 and state["last_checkpoint"] and state["state"] == "running"
        return state if ready and min(r["step"] for r in state["ranks"]) >= 5 else None  # type: ignore[index]

    state = wait_for(settled, 60, "every rank past step 5, after the first checkpoint")
    os.kill(state["ranks"][2]["pid"], signal.SIGKILL)  # its next incarnation replays nothing: it falls back
    job.finishes_with(expected)
    reason = "rank 2 was recovered alone as incarnation 1, but cannot replay"
    assert job.stderr.count(reason) == 1, job.stderr
    assert "respawning it from checkpoint 1 as incarnation 1" in job.stderr  # recovered alone first
    final = job.status()
    assert final is not None and final["fallbacks"] == {"count": 1, "rank": 2, "reason": reason, "number": 1}
    assert final["generation"] == 1 and all(r["incarnation"] == 0 for r in final["ranks"])
    assert not {r["pid"] for r in state["ranks"]} & {r["pid"] for r in final["ranks"]}  # every rank is new


@pytest.mark.stress  # three whole-job restarts; the bound is also tested at the coordinator (test_fallback)
def test_a_job_that_keeps_falling_back_fails_in_one_line(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    done = run("launch", "--ckpt-dir", str(ckpt_dir), *RECOVER, PROGRAM, STEPS, AT, "9", timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: rank 1 cannot go on alone: {REASON.format(MAX_RECOVERY_ATTEMPTS - 1)}; a whole-job restart was "
        f"asked for {MAX_RECOVERY_ATTEMPTS} times with no checkpoint committed in between "
        f"(limit {MAX_RECOVERY_ATTEMPTS}); the latest checkpoint is 1"
    ]
    for generation in range(MAX_RECOVERY_ATTEMPTS - 1):  # each restart in a generation of its own
        assert done.stderr.count(REASON.format(generation)) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert status(ckpt_dir)["state"] == "failed"


def test_under_abort_a_fallback_fails_the_job_with_its_reason(tmp_path: Path) -> None:
    done = run("launch", "--ckpt-dir", str(tmp_path / "ckpt"), *FLAGS, PROGRAM, STEPS, AT, "1", timeout=120)
    one_error_line(done, f"error: rank 1 cannot go on alone: {REASON.format(0)}", "no checkpoint to restart from")


def test_an_independent_checkpoint_asked_for_while_a_rank_holds_checkpoints_waits_for_the_release(
    tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # rank 1 holds from step 10 to step 40; rank 0 asks for rank 2's checkpoint at step 11
    done = run("launch", "--ckpt-dir", str(ckpt_dir), *RECOVER, PROGRAM, STEPS, AT, "0", "10", "40", timeout=120)
    assert done.returncode == 0, done.stderr
    assert results(done.stdout) == expected
    manifest = json.loads((ckpt_dir / "ckpt_fallback_2.json").read_text())
    assert manifest["kind"] == "rank"
    (entry,) = [e for e in manifest["ranks"] if e["file"] == "ckpt_fallback_2_2.ckpt"]  # rank 2's new image
    # the allgather of every step keeps the ranks within a step: when rank 1 released at step 40, rank 2 had
    # completed 39 steps at least, and its image is taken at its next boundary
    assert entry["step"] >= 40, manifest["ranks"]
