"""End-to-end liveness (heartbeats): a stopped coordinator makes every rank exit, a stopped rank fails the job.

Both with short heartbeats (CKPT_HEARTBEAT_INTERVAL / CKPT_HEARTBEAT_TIMEOUT), and both leave the checkpoint
taken before restartable to the uninterrupted run's result.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import Job, run, wait_for
from harness import PROGRAMS, counter_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

#: 200 steps of 25 ms (the job must still be running when the test stops a part of it: 5 s at least, and no less than
#: the 600 steps of 4 ms this once was on a machine so loaded that an allgather takes 5 ms); restarted, no delay. The
#: results depend on neither; each step's allgather is what costs CPU, a third of them now.
COUNTER = [str(PROGRAMS / "counter.py"), "200", "0.025", "0"]
TIMEOUT = 3.0
QUICK = {"CKPT_HEARTBEAT_INTERVAL": "0.2", "CKPT_HEARTBEAT_TIMEOUT": f"{TIMEOUT:g}"}
#: Time past the heartbeat timeout allowed for noticing and exiting on a loaded machine.
SLACK = 5.0


@pytest.fixture(scope="module")
def expected() -> dict[int, str]:
    return counter_results(3, int(COUNTER[1]))  # the uninterrupted run's (checked in test_e2e_faults)


def _process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, exit status) of `pid` from /proc, or None once it is gone. A zombie keeps its status."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; exit_code is field 52 of stat
    return fields[0], int(fields[49]) >> 8


def _exited(pid: int) -> bool:
    state = _process_state(pid)
    return state is None or state[0] in "ZX"


def _launch_and_checkpoint(start_job: Callable[..., Job], ckpt_dir: Path) -> Job:
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *COUNTER, extra_env=QUICK)
    job.wait_step(20)
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), extra_env=QUICK)
    assert taken.returncode == 0, taken.stderr
    return job


def test_every_rank_exits_when_the_coordinator_stops_answering(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = _launch_and_checkpoint(start_job, ckpt_dir)
    pids = job.rank_pids()
    address = json.loads((ckpt_dir / "coordinator.json").read_text())["address"]
    assert job.process is not None
    os.kill(job.process.pid, signal.SIGSTOP)  # the launcher only: it embeds the coordinator; its ranks run on
    stopped = time.monotonic()
    try:
        wait_for(lambda: all(_exited(pid) for pid in pids.values()), TIMEOUT + SLACK, "every rank to exit")
        elapsed = time.monotonic() - stopped
        statuses = {rank: _process_state(pid) for rank, pid in pids.items()}  # zombies: the launcher is stopped
        _, stderr = job.read()
    finally:
        job.kill()
    assert elapsed <= TIMEOUT + SLACK, elapsed
    assert all(state is not None and state[1] == 1 for state in statuses.values()), statuses
    assert "Traceback" not in stderr, stderr
    for rank in pids:
        said = [line for line in stderr.splitlines() if line.startswith(f"ckpt rank {rank}:")]
        assert said == [f"ckpt rank {rank}: no word from the coordinator at {address} for {TIMEOUT:g} s; exiting"], (
            stderr
        )
    start_job("restart", "--ckpt-dir", str(ckpt_dir)).finishes_with(expected)


def test_a_stopped_rank_is_lost_within_the_heartbeat_timeout(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = _launch_and_checkpoint(start_job, ckpt_dir)
    victim = job.rank_pids()[1]
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    assert job.wait(timeout=TIMEOUT + 60) == 1
    elapsed = time.monotonic() - stopped
    assert elapsed <= TIMEOUT + SLACK, elapsed
    assert "Traceback" not in job.stderr
    (line,) = job.stderr.strip().splitlines()[-1:]
    pattern = (
        rf"error: rank 1 \(pid {victim} on \S+\) was lost at step \d+ \(no word from it for {TIMEOUT:g} s\); "
        r"the latest checkpoint is 1"
    )
    assert re.fullmatch(pattern, line), line
    assert _exited(victim)  # the launcher killed what was left of it
    state = json.loads(run("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)
    assert state["state"] == "failed" and "rank 1" in state["message"]
    start_job("restart", "--ckpt-dir", str(ckpt_dir)).finishes_with(expected)
