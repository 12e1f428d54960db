"""End-to-end: launch -> (checkpoint -> kill -> restart) x k -> the uninterrupted run's results."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import CKPT, Job, env, results, run, wait_for
from harness import EXAMPLES, PROGRAMS, heat_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: 350 steps of 12 ms (slept): ~4 s of run after the step a test checkpoints at, and no less than the 700 steps of 3 ms
#: this once was on a machine so loaded that an allgather takes 5 ms; each step's allgather is what costs CPU
HEAT = [str(EXAMPLES / "heat.py"), "350", "2000", "12", "sleep"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted run of the 4-rank heat program (which `heat_results` computes too: checked here)."""
    directory = tmp_path_factory.mktemp("plain")
    done = run("launch", "-n", "4", "--ckpt-dir", str(directory / "ckpt"), *HEAT[:3], timeout=120)  # unpaced
    assert done.returncode == 0, done.stderr
    got = results(done.stdout)
    assert got == heat_results(4, int(HEAT[1]), int(HEAT[2]))
    return got


def _manifests(directory: Path) -> list[Path]:
    return sorted(directory.glob("ckpt_heat_*.json"))


def test_checkpoint_then_resume_gives_the_same_result(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), *HEAT)
    job.wait_step(30)
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert "checkpoint 1 written" in taken.stdout
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == expected
    (manifest,) = _manifests(ckpt_dir)
    data = json.loads(manifest.read_text())
    assert data["number"] == 1 and data["size"] == 4 and len(data["ranks"]) == 4
    assert (ckpt_dir / "latest").read_text().strip() == manifest.name
    for entry in data["ranks"]:
        assert (ckpt_dir / entry["file"]).stat().st_size == entry["bytes"]


def test_kill_then_restart_gives_the_same_result(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), *HEAT)
    before = job.wait_step(40)
    taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0
    assert "killed after checkpoint 1" in job.stderr
    assert results(job.stdout) == {}, "a killed job must not print results"
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == expected
    pids_before = {r["pid"] for r in before["ranks"]}
    assert pids_before, "status listed no ranks"


@pytest.mark.parametrize("cycles", [2, pytest.param(5, marks=pytest.mark.stress)])  # CI: 2 (each ~5 s)
def test_restart_cycles_chain_from_the_previous_restart(
    cycles: int, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    steps = str(350 + 150 * cycles)  # the last kill 300 steps before the end at least
    program = [str(EXAMPLES / "heat.py"), steps, "500", "3", "sleep"]  # 3 ms a step: the kills land mid-run
    job = start_job("launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), *program)
    generations = []
    for cycle in range(cycles):
        job.wait_step(50 + 150 * cycle)
        state = job.status()
        assert state is not None
        generations.append(state["generation"])
        taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
        assert taken.returncode == 0, taken.stderr
        assert f"checkpoint {cycle + 1} written" in taken.stdout
        assert job.wait() == 0, job.stderr
        job = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == heat_results(4, int(steps), 500)  # the uninterrupted run's (checked above)
    assert generations == list(range(cycles))
    assert [json.loads(m.read_text())["number"] for m in _manifests(ckpt_dir)] == list(range(1, cycles + 1))


def test_interval_checkpoints_and_keep_prunes(
    start_job: Callable[..., Job], tmp_path: Path, expected: dict[int, str]
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), "--interval", "0.3", "--keep", "2", *HEAT)
    wait_for(lambda: (ckpt_dir / "ckpt_heat_4.json").exists(), 60, "a fourth interval checkpoint")
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == expected
    manifests = _manifests(ckpt_dir)
    assert len(manifests) == 2, manifests
    numbers = sorted(json.loads(m.read_text())["number"] for m in manifests)
    assert numbers[0] >= 3
    images = sorted(ckpt_dir.glob("ckpt_heat_*_*.ckpt"))
    assert len(images) == 2 * 4
    assert all(int(p.stem.rsplit("_", 1)[1]) in numbers for p in images)


def test_status_json_shows_ranks_states_generation_and_last_checkpoint(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), *HEAT)
    job.wait_step(10)
    state = job.status()
    assert state is not None
    assert state["generation"] == 0 and state["last_checkpoint"] is None
    assert state["state"] == "running" and state["max_state"] == "running" and state["unanimous"] is True
    assert [r["rank"] for r in state["ranks"]] == [0, 1, 2, 3]
    assert all({"rank", "state", "step", "host", "pid"} <= r.keys() for r in state["ranks"])
    assert run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    state = job.status()
    assert state is not None
    last = state["last_checkpoint"]
    assert last["number"] == 1 and last["bytes"] > 0 and last["seconds"] > 0
    assert Path(last["manifest"]).exists()
    human = run("status", "--ckpt-dir", str(ckpt_dir))
    assert "last checkpoint: 1" in human.stdout
    assert job.wait() == 0


def test_misaligned_collectives_abort_the_checkpoint_and_the_job_finishes(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    program = [str(PROGRAMS / "misaligned.py"), "150", "0.02"]
    plain = run("launch", "-n", "2", "--ckpt-dir", str(tmp_path / "plain"), *program)
    assert plain.returncode == 0, plain.stderr
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *program)
    job.wait_step(20)
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), timeout=30)
    assert taken.returncode == 1
    (line,) = taken.stderr.strip().splitlines()
    assert "checkpoint 1 aborted: collectives are not step-aligned" in line
    assert "rank 1 is in allgather" in line and "step" in line
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == results(plain.stdout)
    assert not list(ckpt_dir.glob("*.ckpt*")), "an aborted checkpoint must leave no image behind"


def test_checkpoints_requested_by_the_program_during_setup_and_inside_a_step(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    program = [str(PROGRAMS / "selfckpt.py"), "200"]
    native = run("launch", "--native", "-n", "3", "--ckpt-dir", str(tmp_path / "native"), *program)
    assert native.returncode == 0, native.stderr
    assert not list((tmp_path / "native").glob("ckpt_*.json")), "--native takes no checkpoints"
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *program)
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == results(native.stdout)
    first, second = (json.loads((ckpt_dir / f"ckpt_selfckpt_{n}.json").read_text()) for n in (1, 2))
    # Asked for in setup: one boundary for every rank, the first each can still reach when its checkpoint
    # thread handles the request. That is 0 or 1 on an idle machine, later when that thread waits for a core
    # while the program thread steps on (2 seen on 2 busy cores); always before the one asked for in step 50.
    assert len({r["step"] for r in first["ranks"]}) == 1
    assert first["ranks"][0]["step"] < 50 < min(r["step"] for r in second["ranks"])
    again = start_job("restart", str(ckpt_dir / "ckpt_selfckpt_1.json"))
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == results(native.stdout)


def test_restart_shows_a_progress_bar_for_large_images(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # 8 MB of float64 per rank; 20 ms a step, slept: 95 steps (2 s at least) left when the checkpoint is asked for
    program = [str(EXAMPLES / "heat.py"), "100", "1000000", "20", "sleep"]
    plain = heat_results(2, 100, 1000000)  # what the uninterrupted run prints (checked above)
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *program)
    job.wait_step(5)
    assert run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert job.wait() == 0
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == plain
    # stderr is a file here: no bar, and no carriage-return updates written into it
    assert "loading images" not in again.stderr and "\r" not in again.stderr, again.stderr
    # on a terminal the same restart (checkpoint 1 again) shows the bar to its end
    on_terminal = _stderr_on_a_terminal(["restart", str(ckpt_dir / "ckpt_heat_1.json")])
    assert on_terminal.returncode == 0 and results(on_terminal.stdout) == plain
    assert "loading images" in on_terminal.stderr and "100%" in on_terminal.stderr, on_terminal.stderr


def _stderr_on_a_terminal(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `ckpt ARGS` with its stderr on a pseudo-terminal (stdout captured as usual)."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a bar needs a width
    try:
        process = subprocess.Popen([*CKPT, *args], stdout=subprocess.PIPE, stderr=secondary, text=True, env=env())
        os.close(secondary)
        chunks = []
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout, _ = process.communicate(timeout=120)
    finally:
        os.close(main)
    return subprocess.CompletedProcess(args, process.returncode, stdout, b"".join(chunks).decode(errors="replace"))


def test_a_phase_that_takes_too_long_aborts_the_checkpoint(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job(
        "launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), "--phase-timeout", "1", str(PROGRAMS / "stuck.py"), "8"
    )

    def rank_1_at_step_10() -> bool:
        ranks = (job.poll_status() or {}).get("ranks") or []
        return len(ranks) == 2 and ranks[1]["step"] >= 10  # rank 1 may not have joined yet

    wait_for(rank_1_at_step_10, 30, "rank 1 at step 10")
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), timeout=30)
    assert taken.returncode == 1
    assert "rank 1 (near step 10)" in taken.stderr and "rank 0 (in barrier" in taken.stderr
    assert "did not park at the step boundary within 1 s" in taken.stderr
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {0: "40", 1: "40"}


def test_finished_ranks_take_part_in_checkpoints_and_restarts(start_job: Callable[..., Job], tmp_path: Path) -> None:
    program = [str(PROGRAMS / "uneven.py")]
    plain = run("launch", "-n", "3", "--ckpt-dir", str(tmp_path / "plain"), *program, timeout=120)
    assert plain.returncode == 0, plain.stderr
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "3", "--ckpt-dir", str(ckpt_dir), *program)

    def rank0_finished() -> bool:
        state = job.poll_status()
        return bool(state and state["ranks"] and state["ranks"][0]["state"] == "finished")

    wait_for(rank0_finished, 60, "rank 0 to finish while the others run")
    taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0
    manifest = json.loads((ckpt_dir / "ckpt_uneven_1.json").read_text())
    steps = [r["step"] for r in manifest["ranks"]]
    assert steps[0] == 60 and steps[2] < 180, steps
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == results(plain.stdout)


def test_ckpt_kill_ends_the_job_and_status_says_so(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    program = [str(EXAMPLES / "heat.py"), "100000", "1000", "10", "sleep"]  # until killed, 10 ms a step, slept
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *program)
    job.wait_step(5)
    killed = run("kill", "--ckpt-dir", str(ckpt_dir))
    assert killed.returncode == 0, killed.stderr
    assert job.wait() == 0
    assert "killed on request" in job.stderr and results(job.stdout) == {}
    state = job.status()
    assert state is not None and state["state"] == "killed"
    late = run("checkpoint", "--ckpt-dir", str(ckpt_dir))
    assert late.returncode == 1 and "has ended (killed)" in late.stderr


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_checkpoints_do_not_pin_the_state_rss_stays_flat(start_job: Callable[..., Job], tmp_path: Path) -> None:
    """A rank rebinding 128 MB of state every step keeps its RSS over twenty checkpoints (issue #11 item 7)."""
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "--keep", "2", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "bigstate.py"), "128")
    job.wait_step(3)
    (pid,) = job.rank_pids().values()
    # Without checkpoints: the most it holds, the old and the new array of a step included.
    baseline, until = 0, time.monotonic() + 1.0
    while time.monotonic() < until:
        baseline = max(baseline, _rss_kib(pid))
        time.sleep(0.02)  # a sampling interval, not an ordering
    assert baseline > 128 << 10, baseline  # the state is resident
    seen = []
    for _ in range(10):  # a pinned state grows by 128 MiB per checkpoint: 2x the baseline after two
        taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
        assert taken.returncode == 0, taken.stderr
        seen.append(_rss_kib(pid))
    assert max(seen) <= 2 * baseline, f"no-checkpoint RSS {baseline} KiB, after each checkpoint: {seen}"
