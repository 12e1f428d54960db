"""End-to-end bad input: every case gets one clear `error:` line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import random
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import BANNER, Job, one_error_line, results, run, wait_for
from harness import EXAMPLES, PROGRAMS, counter_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HEAT = [str(EXAMPLES / "heat.py"), "300", "500", "2", "sleep"]
# the jobs checkpointed with --kill: 10 ms a step, so the ~3 s left after the step the test waits for outlast a
# `ckpt checkpoint` started on a loaded machine (at 2 ms, CI saw the job end first: "has ended (finished)")
HEAT_KILLED = [str(EXAMPLES / "heat.py"), "300", "500", "10", "sleep"]


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory holding one checkpoint of a killed 2-rank heat job (copied per test)."""
    ckpt_dir = tmp_path_factory.mktemp("killed") / "ckpt"
    job = Job(["launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *HEAT_KILLED], ckpt_dir).start()
    try:
        job.wait_step(10)
        taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
        assert taken.returncode == 0, taken.stderr
        assert job.wait() == 0
    finally:
        job.kill()
    return ckpt_dir


@pytest.fixture
def ckpt_copy(killed_job: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(killed_job, target)
    return target


def test_the_intact_copy_restarts(ckpt_copy: Path) -> None:
    done = run("restart", "--ckpt-dir", str(ckpt_copy), timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(results(done.stdout)) == [0, 1]


def test_a_truncated_image(ckpt_copy: Path) -> None:
    image = ckpt_copy / "ckpt_heat_1_1.ckpt"
    data = image.read_bytes()
    image.write_bytes(data[: len(data) // 2])
    one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy)), "ckpt_heat_1_1.ckpt", "truncated")


def test_a_flipped_byte_in_an_image(ckpt_copy: Path) -> None:
    image = ckpt_copy / "ckpt_heat_0_1.ckpt"
    data = bytearray(image.read_bytes())
    position = random.Random(7).randrange(len(data) // 2, len(data) - 100)
    data[position] ^= 0x40
    image.write_bytes(bytes(data))
    line = one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy), timeout=60), "rank 0")
    assert "ckpt_heat_0_1.ckpt" in line and ("damaged" in line or "checksum" in line or "corrupt" in line), line


def _killed_job(directory: Path, program: list[str]) -> Path:
    """A checkpoint directory holding checkpoint 1 of a killed 2-rank job of `program`."""
    job = Job(["launch", "-n", "2", "--ckpt-dir", str(directory), *program], directory)
    try:
        job.start().wait_step(5)
        assert run("checkpoint", "--kill", "--ckpt-dir", str(directory)).returncode == 0
        job.wait()
    finally:
        job.kill()
    return directory


def test_an_image_of_another_program(ckpt_copy: Path, tmp_path: Path) -> None:
    other = _killed_job(tmp_path / "other", [str(PROGRAMS / "counter.py"), "300", "0.01"])
    shutil.copy(other / "ckpt_counter_1_1.ckpt", ckpt_copy / "ckpt_heat_1_1.ckpt")
    # identity is checked before the size: a foreign image is called foreign, not "truncated"
    one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy)), "belongs to program 'counter'")


def test_an_image_of_another_job_of_the_same_program(ckpt_copy: Path, tmp_path: Path) -> None:
    other = _killed_job(tmp_path / "other", HEAT_KILLED)
    shutil.copy(other / "ckpt_heat_1_1.ckpt", ckpt_copy / "ckpt_heat_1_1.ckpt")
    job = json.loads((ckpt_copy / "ckpt_heat_1.json").read_text())["job"]
    one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy)), "belongs to program 'heat' (job", f"(job {job})")


def test_an_image_of_another_rank(ckpt_copy: Path) -> None:
    shutil.copy(ckpt_copy / "ckpt_heat_1_1.ckpt", ckpt_copy / "ckpt_heat_0_1.ckpt")
    one_error_line(
        run("restart", "--ckpt-dir", str(ckpt_copy)), "ckpt_heat_0_1.ckpt is rank 1 of checkpoint 1", "expects rank 0"
    )


def test_an_image_of_an_older_checkpoint(ckpt_copy: Path) -> None:
    job = Job(["restart", "--ckpt-dir", str(ckpt_copy)], ckpt_copy).start()
    try:
        taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_copy))  # queued until the restart runs
        assert taken.returncode == 0 and "checkpoint 2 written" in taken.stdout, taken.stderr
        assert job.wait() == 0
    finally:
        job.kill()
    shutil.copy(ckpt_copy / "ckpt_heat_0_1.ckpt", ckpt_copy / "ckpt_heat_0_2.ckpt")
    one_error_line(
        run("restart", "--ckpt-dir", str(ckpt_copy)),
        "ckpt_heat_0_2.ckpt is rank 0 of checkpoint 1",
        "expects rank 0 of checkpoint 2",
    )


def test_a_garbage_latest_pointer(ckpt_copy: Path) -> None:
    (ckpt_copy / "latest").write_bytes(b"\xff\xfe\x00\x01garbage")
    one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy)), "latest is damaged")


def test_a_wrong_token(ckpt_copy: Path) -> None:
    done = run("restart", "--ckpt-dir", str(ckpt_copy), extra_env={"CKPT_TOKEN": "not-the-job-token"})
    one_error_line(done, "not authentic", "CKPT_TOKEN")


def test_a_tampered_manifest(ckpt_copy: Path) -> None:
    manifest = ckpt_copy / "ckpt_heat_1.json"
    data = json.loads(manifest.read_text())
    data["argv"] = ["999999"]
    manifest.write_text(json.dumps(data))
    one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy)), "not authentic")


def test_a_manifest_that_is_not_one(ckpt_copy: Path) -> None:
    (ckpt_copy / "ckpt_heat_1.json").write_text("{not json")
    one_error_line(run("restart", str(ckpt_copy / "ckpt_heat_1.json")), "ckpt_heat_1.json")


def test_a_missing_image(ckpt_copy: Path) -> None:
    (ckpt_copy / "ckpt_heat_0_1.ckpt").unlink()
    one_error_line(run("restart", "--ckpt-dir", str(ckpt_copy)), "ckpt_heat_0_1.ckpt", "missing")


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    one_error_line(run("restart", "--ckpt-dir", str(tmp_path / "empty")), "no checkpoint")


def test_an_unreachable_coordinator(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        done = run("status", "--coordinator", f"127.0.0.1:{port}", extra_env={"CKPT_TOKEN": "x"})
    one_error_line(done, "cannot reach the coordinator", f"127.0.0.1:{port}")
    one_error_line(run("checkpoint", "--ckpt-dir", str(tmp_path / "nojob")), "no coordinator")
    one_error_line(run("status", "--coordinator", "nonsense", extra_env={"CKPT_TOKEN": "x"}), "HOST:PORT")


def test_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = run("launch", "--port", str(port), "--ckpt-dir", str(tmp_path / "ckpt"), *HEAT)
    one_error_line(done, "cannot listen", str(port))


def test_bad_programs_and_options(tmp_path: Path) -> None:
    ckpt_dir = ["--ckpt-dir", str(tmp_path / "ckpt")]
    one_error_line(run("launch", *ckpt_dir, str(tmp_path / "missing.py")), "missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    one_error_line(run("launch", *ckpt_dir, str(empty)), "exactly one ckpt.Program subclass")
    broken = tmp_path / "broken.py"
    broken.write_text("import ckpt\nraise RuntimeError('boom')\n")
    one_error_line(run("launch", *ckpt_dir, str(broken)), "RuntimeError: boom")
    one_error_line(run("launch", "--transport", "carrier-pigeon", *ckpt_dir, *HEAT), "unknown transport")
    tcp = ["--transport", "tcp"]
    one_error_line(run("launch", *tcp, "--native", *ckpt_dir, *HEAT), "ib2tcp plugin", "--native")
    one_error_line(run("launch", *tcp, "--disable-plugin", "ib2tcp", *ckpt_dir, *HEAT), "--disable-plugin")
    one_error_line(run("launch", *tcp, "--fabric-latency", "2us", *ckpt_dir, *HEAT), "simib's links")


def test_bad_heartbeat_settings(tmp_path: Path) -> None:
    ckpt_dir = ["--ckpt-dir", str(tmp_path / "ckpt")]
    done = run("launch", *ckpt_dir, *HEAT, extra_env={"CKPT_HEARTBEAT_TIMEOUT": "soon"})
    one_error_line(done, "CKPT_HEARTBEAT_TIMEOUT='soon': expected a number of seconds")
    done = run("launch", *ckpt_dir, *HEAT, extra_env={"CKPT_HEARTBEAT_INTERVAL": "30"})
    one_error_line(done, "heartbeat timeout (15 s) must be longer than the interval (30 s)")
    done = run("status", "--coordinator", "127.0.0.1:9", extra_env={"CKPT_TOKEN": "x", "CKPT_HEARTBEAT_TIMEOUT": "0"})
    one_error_line(done, "heartbeat timeout must be a number of seconds > 0")


def test_bad_simulated_verbs_timing_settings(tmp_path: Path) -> None:
    ckpt_dir = ["--ckpt-dir", str(tmp_path / "ckpt")]
    done = run("launch", *ckpt_dir, *HEAT, extra_env={"CKPT_SIMIB_POLL_LEASE": "soon"})
    one_error_line(done, "CKPT_SIMIB_POLL_LEASE='soon': expected a number of seconds >= 0")
    done = run("launch", *ckpt_dir, *HEAT, extra_env={"CKPT_SIMIB_POLL_WAIT": "-1"})  # would block an empty poll
    one_error_line(done, "CKPT_SIMIB_POLL_WAIT='-1': expected a number of seconds >= 0")


def test_a_wrong_token_for_a_running_job(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *HEAT)
    job.wait_step(1)
    address = json.loads((ckpt_dir / "coordinator.json").read_text())["address"]
    done = run("status", "--coordinator", address, extra_env={"CKPT_TOKEN": "wrong"})
    one_error_line(done, "CKPT_TOKEN")
    assert job.wait() == 0, job.stderr


def test_garbage_connections_do_not_disturb_a_running_job(start_job: Callable[..., Job], tmp_path: Path) -> None:
    program = [str(PROGRAMS / "counter.py"), "200", "0.005"]
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *program)
    job.wait_step(1)
    host, port = json.loads((ckpt_dir / "coordinator.json").read_text())["address"].rsplit(":", 1)
    rng = random.Random(3)
    for size in (0, 1, 4, 9, 100, 5000):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.recv(4096)  # the challenge
            try:
                s.sendall(rng.randbytes(size) if size != 4 else b"\xff\xff\xff\xff")
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):  # the coordinator closes the connection
                    pass
            except OSError:  # ... possibly before we are done talking: also a close
                pass
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    assert taken.returncode == 0, taken.stderr
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == counter_results(2, 200)  # the uninterrupted run's


def test_inspect_shows_header_sizes_checksum_and_objects_and_flags_damage(ckpt_copy: Path) -> None:
    image = ckpt_copy / "ckpt_heat_0_1.ckpt"
    shown = run("inspect", str(image))
    assert shown.returncode == 0, shown.stderr
    for needle in ("program: heat", "rank: 0", "number: 1", "sha256:", "largest objects:", "program.u", "ok: True"):
        assert needle in shown.stdout, needle
    as_json = json.loads(run("inspect", "--json", str(image)).stdout)
    assert as_json["file_bytes"] == image.stat().st_size and as_json["ok"] is True
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF
    image.write_bytes(bytes(data))
    one_error_line(run("inspect", str(image)), "damaged")
    manifest = run("inspect", str(ckpt_copy / "ckpt_heat_1.json"))
    assert "manifest of checkpoint 1 of heat" in manifest.stdout and "authentic: yes" in manifest.stdout
    assert "rank   1  ckpt_heat_1_1.ckpt" in manifest.stdout and " ok" in manifest.stdout
    one_error_line(manifest, "ckpt_heat_0_1.ckpt", "damaged")
    (ckpt_copy / "notes.txt").write_text("hello")
    one_error_line(run("inspect", str(ckpt_copy / "notes.txt")), "neither a ckpt image nor a ckpt manifest")


def test_a_changed_program_restarts_with_a_warning(start_job: Callable[..., Job], tmp_path: Path) -> None:
    program = tmp_path / "heat.py"
    shutil.copy(EXAMPLES / "heat.py", program)
    ckpt_dir = tmp_path / "ckpt"
    # 10 ms steps: the job is still running when the checkpoint comes, however loaded the machine (at 2 ms, 300
    # steps ended first once under load)
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), str(program), *HEAT_KILLED[1:])
    job.wait_step(5)
    assert run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert job.wait() == 0
    program.write_text(program.read_text() + "\n# edited after the checkpoint\n")
    again = run("restart", "--ckpt-dir", str(ckpt_dir), timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"warning: {program} changed since checkpoint 1" in again.stderr


def test_a_program_that_raises_on_every_rank_is_reported_once(tmp_path: Path) -> None:
    program = tmp_path / "raises.py"
    program.write_text(
        "import ckpt\n"
        "class Raises(ckpt.Program):\n"
        "    def setup(self, rt):\n"
        "        self.i = 0\n"
        "    def step(self, rt):\n"
        "        self.i += 1\n"
        "        if self.i == 3:\n"
        "            raise ValueError(f'bad value on rank {rt.rank}')\n"
        "        return True\n"
    )
    done = run("launch", "-n", "4", "--ckpt-dir", str(tmp_path / "ckpt"), str(program))
    assert done.returncode == 1
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith(BANNER)]
    # the program's own traceback once (its frames only, not ckpt's), then one error line
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert lines[1] == f'  File "{program}", line 8, in step', done.stderr
    assert "ckpt/runtime" not in done.stderr
    assert lines[-1].startswith("error: rank ") and "raised ValueError in step 2: bad value on rank" in lines[-1]
    state = json.loads(run("status", "--json", "--ckpt-dir", str(tmp_path / "ckpt")).stdout)
    states = [r["state"] for r in state["ranks"]]  # the ranks that had joined when the first one failed
    assert states.count("failed") == 1 and set(states) <= {"failed", "killed"}, states


def test_state_that_does_not_pickle_is_named_at_launch_and_at_each_checkpoint(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), str(PROGRAMS / "holds_lock.py"), "100000")
    warning = "warning: program.guard (a _thread.lock) cannot be pickled; checkpoints of this job will fail"
    wait_for(lambda: job.read()[1].count(warning) == 2, 60, "a warning from each rank")
    lines = sorted(line for line in job.stderr.splitlines() if not line.startswith(BANNER))
    assert lines == [f"ckpt rank {r}: {warning}" for r in (0, 1)]
    job.wait_step(1)
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
    reason = (
        "cannot pickle the program state: attribute program.guard (a _thread.lock) cannot be pickled: "
        "TypeError: cannot pickle '_thread.lock' object"
    )
    line = one_error_line(taken, "checkpoint 1 could not be written", f"rank 0: {reason} (and likewise rank 1)")
    assert str(ckpt_dir) not in line  # no image path: nothing about the file was wrong
    step = min(r["step"] for r in job.wait_step(1)["ranks"])
    job.wait_step(step + 5)  # the job runs on
    assert run("kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert job.wait() == 0, job.stderr
    assert "Traceback" not in job.stderr, job.stderr
