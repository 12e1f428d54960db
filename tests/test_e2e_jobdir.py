"""End-to-end: one live job per checkpoint directory, what a restart reuses, what status says at each moment."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt import _jobdir as jobdir
from ckpt.testing import Job, one_error_line, results, run, wait_for
from harness import EXAMPLES, PROGRAMS, counter_results, heat_results, small_disk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HEAT = str(EXAMPLES / "heat.py")
LONG = [HEAT, "100000", "200", "10", "sleep"]  # runs until killed, 10 ms a step: it waits for the test, not the CPU
SHORT = [HEAT, "400", "200", "1", "sleep"]


def _checkpoint_and_kill(job: Job, ckpt_dir: Path, step: int = 5) -> None:
    job.wait_step(step)
    taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0, job.stderr


def test_a_live_directory_is_refused_to_a_second_launch_and_a_restart(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    first = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *LONG)
    first.wait_step(3)
    assert run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    job_id = first.status()["job"]  # type: ignore[index]
    before = (ckpt_dir / "coordinator.json").read_text()
    for command in (
        ["launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *SHORT],
        ["restart", "--ckpt-dir", str(ckpt_dir)],
    ):
        one_error_line(run(*command), f"job {job_id} is still running in {ckpt_dir}", "ckpt kill")
    assert (ckpt_dir / "coordinator.json").read_text() == before, "the refused command touched the job file"
    assert first.status()["job"] == job_id  # type: ignore[index]  # the first job is still reachable
    assert run("kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert first.wait() == 0


def test_clients_address_a_restarted_job_from_its_first_moment(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    _checkpoint_and_kill(start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *LONG), ckpt_dir)
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    assert again.process is not None
    wait_for(lambda: jobdir.owner(ckpt_dir), 30, "the restart to claim the directory")
    # from here on the old job's coordinator.json (which says "killed") must not answer for the new job
    shown = run("status", "--json", "--ckpt-dir", str(ckpt_dir))
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)
    assert state["state"] in ("starting", "waiting", "restart", "refresh", "resume", "running"), state
    assert state["job"] == json.loads((ckpt_dir / "ckpt_heat_1.json").read_text())["job"]
    killer = run("kill", "--ckpt-dir", str(ckpt_dir))  # waits for a starting job
    assert killer.returncode == 0 and killer.stdout.strip() == "job killed", killer.stderr
    assert again.wait() == 0, again.stderr
    assert "killed on request" in again.stderr
    assert json.loads(run("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)["state"] == "killed"


def test_the_directory_and_what_is_in_it_are_private(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    _checkpoint_and_kill(start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *LONG), ckpt_dir)
    assert stat.S_IMODE(ckpt_dir.stat().st_mode) == 0o700
    files = [p for p in ckpt_dir.iterdir() if p.suffix in (".ckpt", ".json") or p.name in ("latest", "job.lock")]
    assert len(files) >= 6
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_latest_pointer_that_cannot_be_written_keeps_the_previous_checkpoint(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    counter = [str(PROGRAMS / "counter.py"), "600", "0.01"]
    job = start_job("launch", "-n", "2", "--keep", "1", "--ckpt-dir", str(ckpt_dir), *counter)
    job.wait_step(5)
    assert run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    (ckpt_dir / "latest.tmp").mkdir()  # as a full disk would, the pointer cannot be replaced
    failed = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    one_error_line(failed, "checkpoint 2", "latest")
    (ckpt_dir / "latest.tmp").rmdir()
    assert (ckpt_dir / "latest").read_text().strip() == "ckpt_counter_1.json"
    assert sorted(p.name for p in ckpt_dir.glob("ckpt_counter_*")) == [
        "ckpt_counter_0_1.ckpt",
        "ckpt_counter_1.json",
        "ckpt_counter_1_1.ckpt",
    ]
    assert run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert job.wait() == 0
    assert sorted(p.name for p in ckpt_dir.glob("ckpt_counter_*.json")) == ["ckpt_counter_3.json"]  # --keep 1
    again = run("restart", "--ckpt-dir", str(ckpt_dir), timeout=120)
    assert again.returncode == 0 and results(again.stdout) == counter_results(2, 600), again.stderr


def test_an_interrupted_launch_leaves_its_end_for_status(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # A launcher that inherits SIGINT ignored keeps it ignored, as Python does (a shell's background job,
    # nohup): this test plays a terminal's Ctrl-C on a foreground launcher, so it starts one that does not.
    # (A Python handler in this process is reset to the default by exec; SIG_IGN would be inherited.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        job = Job(["launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *LONG], ckpt_dir).start()
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    try:
        job.wait_step(3)
        assert job.process is not None
        os.kill(job.process.pid, signal.SIGINT)  # Ctrl-C on the launcher
        assert job.wait() == 130
    finally:
        job.kill()
    shown = run("status", "--ckpt-dir", str(ckpt_dir))
    assert shown.returncode == 0, shown.stderr
    assert "state killed" in shown.stdout and "interrupted" in shown.stdout, shown.stdout
    state = json.loads(run("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)
    assert [r["state"] for r in state["ranks"]] == ["killed", "killed"]


def test_status_after_a_restart_and_after_a_kill(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    first = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *LONG)
    first.wait_step(3)
    assert run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    _checkpoint_and_kill(first, ckpt_dir, step=6)
    ended = json.loads(run("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)
    assert ended["state"] == "killed" and [r["state"] for r in ended["ranks"]] == ["killed", "killed"]
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    state = again.wait_step(8)
    assert state["last_checkpoint"]["number"] == 2 and state["generation"] == 1
    assert all(r["incarnation"] == 0 for r in state["ranks"])
    assert "last checkpoint: 2" in run("status", "--ckpt-dir", str(ckpt_dir)).stdout
    assert run("kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert again.wait() == 0


def test_launch_says_what_it_runs_where_and_how_to_reach_it(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    done = run("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *SHORT[:2], timeout=120)
    assert done.returncode == 0, done.stderr
    job = json.loads((ckpt_dir / "coordinator.json").read_text())["job"]
    first, second = done.stderr.splitlines()[:2]
    assert first == f"ckpt: job {job}: 2 ranks of heat.py; checkpoint directory {ckpt_dir}"
    assert second.startswith(f"ckpt: checkpoint it with: ckpt checkpoint --ckpt-dir {ckpt_dir}")
    debug = run("launch", "-n", "2", "--log-level", "debug", "--ckpt-dir", str(ckpt_dir), *SHORT[:2], timeout=120)
    assert debug.returncode == 0, debug.stderr
    assert "[launcher] INFO ckpt._launcher: coordinator of job" in debug.stderr, debug.stderr
    assert "[launcher] INFO ckpt.coordinator.job: job" in debug.stderr


def test_a_restart_reuses_the_plugins_options_and_settings_of_the_checkpoint(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    log = tmp_path / "init.log"
    job = start_job(
        "launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_initprobe", "--keep", "1",
        "--phase-timeout", "77", *LONG, extra_env={"CKPT_TEST_INIT_LOG": str(log)},
    )  # fmt: skip
    job.wait_step(4)
    taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0
    hint = job.stderr.strip().splitlines()[-1]
    assert hint.endswith(f"restart with: ckpt restart --ckpt-dir {ckpt_dir}"), hint
    manifest = json.loads((ckpt_dir / "ckpt_heat_1.json").read_text())
    assert manifest["with_plugins"] == ["ckpt_initprobe"]
    assert manifest["settings"] == {
        "interval": None,
        "keep": 1,
        "phase_timeout": 77.0,
        "rank_interval": None,
        "on_failure": "abort",
    }
    step = manifest["ranks"][0]["step"]
    # the hint, literally: no --with-plugin, and ckpt_init sees the restarted rank at its image's step
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), extra_env={"CKPT_TEST_INIT_LOG": str(log)})
    again.wait_step(step + 2)
    assert run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert sorted(p.name for p in ckpt_dir.glob("ckpt_heat_*.json")) == ["ckpt_heat_2.json"]  # --keep 1
    assert run("kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert again.wait() == 0
    lines = sorted(log.read_text().splitlines())
    launched = ["rank=0 restarted=False step=0 tag=untagged", "rank=1 restarted=False step=0 tag=untagged"]
    restarted = [f"rank={r} restarted=True step={step} tag=untagged" for r in (0, 1)]
    assert lines == sorted([*launched, *restarted])


def test_a_launch_only_plugin_option_is_not_offered_by_restart(tmp_path: Path) -> None:
    done = run("restart", "--dsm-protocol", "onesided", "--ckpt-dir", str(tmp_path / "ckpt"))
    line = one_error_line(done, "No such option", "--dsm-protocol")
    assert done.returncode == 2, line
    assert "--dsm-protocol" in run("launch", "--help").stdout


def test_typos_and_contract_breaches_are_one_line(tmp_path: Path) -> None:
    ckpt_dir = ["--ckpt-dir", str(tmp_path / "ckpt")]
    typo = run("launch", "--chekpoint-dir", "x", *SHORT)
    assert typo.returncode == 2
    one_error_line(typo, "No such option '--chekpoint-dir'", "Did you mean '--ckpt-dir'?")
    none = tmp_path / "forgot_return.py"
    none.write_text(
        "import ckpt\nclass P(ckpt.Program):\n    def setup(self, rt):\n        self.i = 0\n"
        "    def step(self, rt):\n        self.i += 1\n"
    )
    one_error_line(run("launch", "-n", "2", *ckpt_dir, str(none)), "P.step() returned None", "True", "False")
    twice = run("launch", *ckpt_dir, "--with-plugin", "ckpt_initprobe", "--with-plugin", "ckpt_initprobe", *SHORT[:2])
    assert twice.returncode == 0, twice.stderr
    one_error_line(run("restart", str(tmp_path / "nonexistent.json")), "no checkpoint at", "nonexistent.json")


def test_an_image_from_a_copy_of_the_directory_is_refused(start_job: Callable[..., Job], tmp_path: Path) -> None:
    original = tmp_path / "a"
    first = start_job("launch", "-n", "2", "--ckpt-dir", str(original), *LONG, ckpt_dir=original)
    _checkpoint_and_kill(first, original)
    copy = tmp_path / "b"
    shutil.copytree(original, copy)
    for directory, step in ((original, 3), (copy, 9)):  # both copies take their own checkpoint 2
        again = start_job("restart", "--ckpt-dir", str(directory), ckpt_dir=directory)
        _checkpoint_and_kill(again, directory, step=step)
    shutil.copy(copy / "ckpt_heat_1_2.ckpt", original / "ckpt_heat_1_2.ckpt")
    one_error_line(run("restart", "--ckpt-dir", str(original)), "ckpt_heat_1_2.ckpt", "another checkpoint's image")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to act as nobody")
def test_a_directory_that_cannot_be_written() -> None:
    top = Path(tempfile.mkdtemp(prefix="ckpt-readonly-"))  # not under tmp_path: nobody must reach it
    try:
        top.chmod(0o755)
        locked = top / "locked"
        locked.mkdir(mode=0o755)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        done = run("launch", "--ckpt-dir", str(locked / "sub"), str(PROGRAMS / "counter.py"), prefix=as_nobody)
        one_error_line(done, f"cannot create the checkpoint directory {locked / 'sub'}", "Permission denied")
        done = run("restart", "--ckpt-dir", str(locked / "sub"), prefix=as_nobody)
        one_error_line(done, f"no checkpoint in {locked / 'sub'}: no such directory")
        for command in (["launch", str(PROGRAMS / "counter.py")], ["restart"]):
            done = run(command[0], "--ckpt-dir", str(locked), *command[1:], prefix=as_nobody)
            one_error_line(done, f"cannot write to the checkpoint directory {locked}", "permission denied")
    finally:
        shutil.rmtree(top)


def test_checkpoint_kill_returns_once_the_directory_is_free_for_a_restart(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    slow = {"CKPT_TEST_SLOW_EXIT": "2"}  # each rank's ckpt_exit takes 2 s: the launcher reaps them late
    job = start_job(
        "launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_initprobe", *LONG, extra_env=slow
    )
    job.wait_step(3)
    assert run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert jobdir.owner(ckpt_dir) is None, "checkpoint --kill returned while the launcher still held the directory"
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))  # typed right after: accepted
    again.wait_step(5)
    assert run("kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert jobdir.owner(ckpt_dir) is None
    assert again.wait() == 0 and job.wait() == 0


def test_a_plugin_first_loaded_at_a_restart_gets_its_option_defaults(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    log = tmp_path / "init.log"
    _checkpoint_and_kill(start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *LONG), ckpt_dir)
    probe = {"CKPT_TEST_INIT_LOG": str(log)}
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), "--with-plugin", "ckpt_initprobe", extra_env=probe)
    again.wait_step(6)
    assert run("kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert again.wait() == 0, again.stderr
    assert sorted(line.split()[-1] for line in log.read_text().splitlines()) == ["tag=untagged"] * 2


def test_a_launch_that_cannot_start_leaves_the_previous_jobs_end(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    done = run("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *SHORT[:2], timeout=120)
    assert done.returncode == 0, done.stderr
    one_error_line(run("launch", "--ckpt-dir", str(ckpt_dir), "--fabric", "127.0.0.1:9", *SHORT), "CKPT_FABRIC_TOKEN")
    state = json.loads(run("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)
    assert state["state"] == "finished", state


@pytest.mark.parametrize(
    ("size", "full", "refused"),
    [("256k", True, jobdir.LOCK_FILE), ("8k", False, jobdir.JOB_FILE)],  # 8k: two 4 KiB pages, lock and fabric
)
def test_a_launch_on_a_full_disk_is_refused_in_one_line_naming_the_file(
    size: str, full: bool, refused: str, tmp_path: Path
) -> None:
    """Refused before any rank starts, or (the job file) once the coordinator and the fabric run: they stop."""
    disk = tmp_path / "disk"
    done = run("launch", "-n", "2", "--ckpt-dir", str(disk / "ckpt"), *SHORT, prefix=small_disk(disk, size, full))
    assert done.returncode != 99, done.stderr  # (the tmpfs was mounted)
    one_error_line(done, f"cannot write {disk / 'ckpt' / refused}: No space left on device")
    assert not _processes_mentioning(str(disk))


def test_a_job_end_a_full_disk_cannot_record_is_still_reported_and_reaped(tmp_path: Path) -> None:
    """The job runs to its end; then its directory's disk is full (here: filled once the job has started).
    The end record is lost, and said so; the results, the exit status and the reaping are not."""
    disk = tmp_path / "disk"
    ckpt_dir = disk / "ckpt"
    prefix = small_disk(disk, "512k", fill_once=ckpt_dir / jobdir.JOB_FILE)
    done = run("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *SHORT, prefix=prefix, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert results(done.stdout) == heat_results(2, int(SHORT[1]), int(SHORT[2])), done.stdout
    assert "the job's end could not be recorded" in done.stderr and "No space left on device" in done.stderr
    assert not _processes_mentioning(str(ckpt_dir))


def test_periodic_checkpoints_on_a_disk_that_fills_fail_quietly_and_the_job_goes_on(tmp_path: Path) -> None:
    """Every checkpoint of --interval fails once the disk is full: the job still ends with its answer, and the
    failure is told once in full (the ranks that failed alike in one line) and once briefly, not at every
    interval."""
    disk = tmp_path / "disk"
    ckpt_dir = disk / "ckpt"
    prefix = small_disk(disk, "1m", fill_once=ckpt_dir / jobdir.JOB_FILE)
    program = [HEAT, "1200", "200", "1", "sleep"]  # over 1.2 s (1 ms of sleep a step): several intervals
    args = ["--ckpt-dir", str(ckpt_dir), "--interval", "0.3", *program]
    done = run("launch", "-n", "2", *args, prefix=prefix, timeout=180)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert results(done.stdout) == heat_results(2, 1200, 200), done.stdout
    told = [line for line in done.stderr.splitlines() if "could not be written" in line]
    assert len(told) == 2, done.stderr
    image = ckpt_dir / "ckpt_heat_0_"
    assert f"rank 0: cannot write checkpoint image {image}" in told[0], told
    assert told[0].endswith("No space left on device (and likewise rank 1)"), told
    assert "the same failure again" in told[1], told


def _processes_mentioning(text: str) -> list[int]:
    """The processes whose environment mentions `text` (a job's ranks carry its directory in theirs)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
