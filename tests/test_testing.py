"""ckpt.testing itself: the fakes honour the Protocols they stand for, thread-ranks are a job, CLI jobs are reaped."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import ckpt
import ckpt.plugin
from ckpt.testing import (
    FakeKeyValue,
    FakeRuntime,
    Job,
    Jobs,
    ThreadRuntime,
    run_program,
    run_threads,
    uninterrupted,
    wait_for,
)
from harness import PROGRAMS

pytestmark = pytest.mark.timeout(120)


def _counter() -> type[ckpt.Program]:
    """tests/programs/counter.py's program class (one allgather per step)."""
    spec = importlib.util.spec_from_file_location("counter_program", PROGRAMS / "counter.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Counter  # type: ignore[no-any-return]


# ------------------------------------------------------------------ fakes
def test_the_fakes_satisfy_the_plugin_protocols() -> None:
    rt: ckpt.plugin.Runtime = FakeRuntime()  # checked by mypy too: the fakes are typed against the Protocols
    kv: ckpt.plugin.KeyValue = FakeKeyValue()
    assert isinstance(rt, ckpt.plugin.Runtime) and isinstance(kv, ckpt.plugin.KeyValue)
    assert isinstance(rt.kv, ckpt.plugin.KeyValue)


def test_a_subscriber_waits_for_the_publication_of_another_thread() -> None:
    kv = FakeKeyValue()
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(kv.subscribe("ns", "k", timeout=30)))
    reader.start()
    kv.publish("ns", "other", 1)  # not the key it waits for
    kv.publish("ns", "k", {"v": 2})
    reader.join(timeout=30)
    assert got == [{"v": 2}]


def test_a_subscription_times_out_as_the_coordinators_does() -> None:
    kv = FakeKeyValue()
    with pytest.raises(ckpt.CoordinatorError, match="timed out waiting for key ns/never"):
        kv.subscribe("ns", "never", timeout=0.05)
    kv.publish("ns", "p/1", 1)
    with pytest.raises(ckpt.CoordinatorError, match="2 keys with prefix ns/p/"):
        kv.subscribe_prefix("ns", "p/", 2, timeout=0.05)
    kv.publish("ns", "p/2", 2)
    kv.publish("other", "p/3", 3)  # another namespace
    assert kv.subscribe_prefix("ns", "p/", 2) == {"p/1": 1, "p/2": 2}


def test_atomics_work_on_the_published_keys() -> None:
    kv = FakeKeyValue()
    assert kv.incrby("ns", "n") == 1 and kv.incrby("ns", "n", 4) == 5 and kv.get("ns", "n") == 5
    kv.publish("ns", "m", 10)
    assert kv.min("ns", "m", 3) == 3 and kv.min("ns", "m", 7) == 3
    assert kv.max("ns", "fresh", -2) == -2 and kv.max("ns", "fresh", 9) == 9
    assert kv.get("ns", "absent", "default") == "default"
    kv.publish("ns", "s", "text")
    with pytest.raises(ckpt.CoordinatorError, match="ns/s holds a str"):
        kv.incrby("ns", "s")


def test_a_new_generation_empties_the_kv_but_ids_go_on() -> None:
    rt = FakeRuntime(first_id=100)
    rt.kv.publish("ib", "qpn/1", 7)
    assert rt.allocate_global("qp", 3) == 100 and rt.allocate_global("lid") == 100
    assert rt.coordinator_barrier("drain", 5) == [5]
    rt.new_generation()
    assert rt.generation == 1 and rt.restarted
    assert rt.kv.get("ib", "qpn/1") is None
    assert rt.allocate_global("qp") == 103
    assert rt.allocated == {"qp": [100, 101, 102, 103], "lid": [100]}
    assert rt.barriers == ["drain"]


# ------------------------------------------------------------------ thread-ranks
def test_thread_ranks_share_collectives_kv_and_ids() -> None:
    def body(rt: ThreadRuntime) -> tuple[Any, ...]:
        gathered = rt.allgather(rt.rank * 10)
        if rt.rank == 0:
            rt.kv.publish("t", "token", "from rank 0")
        token = rt.kv.subscribe("t", "token", timeout=30)
        rt.barrier()
        ids = rt.allocate_global("ids", 2)
        return gathered, token, rt.device, ids, rt.coordinator_barrier("b", rt.rank)

    out = run_threads(3, body, first_device=7)
    assert [o[0] for o in out] == [[0, 10, 20]] * 3
    assert [o[1] for o in out] == ["from rank 0"] * 3
    assert [o[2] for o in out] == ["simib7", "simib8", "simib9"]
    assert sorted(o[3] for o in out) == [1, 3, 5]  # two IDs each, none shared
    assert [o[4] for o in out] == [[0, 1, 2]] * 3


def test_the_doubles_record_independent_checkpoint_requests_and_refuse_a_rank_out_of_range() -> None:
    rt = FakeRuntime()
    assert rt.checkpoint_rank(0) == 0 and rt.rank_checkpoints_requested == [0]
    with pytest.raises(ckpt.CoordinatorError, match="there is no rank 1"):
        rt.checkpoint_rank(1)
    out = run_threads(2, lambda t: (t.checkpoint_rank(1 - t.rank), t.rank_checkpoints_requested))
    assert out == [(0, [1]), (0, [0])]


def test_a_failing_rank_fails_the_run_with_its_own_error_and_finalizers_run_after_all() -> None:
    finished: list[int] = []
    finalized: list[list[int]] = []

    def body(rt: ThreadRuntime) -> None:
        rt.at_end(lambda: finalized.append(sorted(finished)))
        if rt.rank == 1:
            raise ValueError("rank 1 is broken")
        try:
            rt.barrier()  # never completes: rank 1 is gone
        finally:
            finished.append(rt.rank)

    with pytest.raises(ValueError, match="rank 1 is broken"):
        run_threads(3, body)
    assert finalized == [[0, 2]] * 3  # each rank's finalizer, once every rank had ended


def test_a_program_on_thread_ranks_gives_what_ckpt_launch_gives(tmp_path: Path) -> None:
    counter = _counter()
    closed: list[int] = []
    threads = run_program(counter, 3, argv=["12", "0"], finish=lambda program: closed.append(program.i))  # type: ignore[attr-defined]
    assert closed == [12, 12, 12]
    assert {rank: str(value) for rank, value in enumerate(threads)} == uninterrupted(
        tmp_path, 3, str(PROGRAMS / "counter.py"), "12", "0"
    )


# ------------------------------------------------------------------ jobs through the CLI
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers signal 0 until its parent reaps it: look at its state
    status = Path(f"/proc/{pid}/stat")
    return not status.exists() or status.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.e2e
def test_a_job_killed_and_restarted_twice_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    # 270 steps after the last kill point: the checkpoint must land before the job ends, on a loaded machine too
    program = (str(PROGRAMS / "counter.py"), "300", "0.02")
    jobs = Jobs(tmp_path / "cycle")
    try:
        restarted = jobs.restarted_results(2, *program, kill_at=[10, 30])
    finally:
        jobs.close()
    assert len(jobs.started) == 3  # the launch and two restarts
    assert restarted == uninterrupted(tmp_path / "plain", 2, *program)


def test_a_program_that_ends_before_its_checkpoint_is_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`restarted_results`: a program that ran to its end between `wait_step` and `ckpt checkpoint --kill`
    gets a line that says so (and what to change), not the CLI's complaint about a job that is over."""
    import ckpt.testing._jobs as jobs_module

    class Ended:
        process = subprocess.Popen([sys.executable, "-c", "pass"])

        def wait_step(self, step: int, timeout: float = 60) -> dict[str, Any]:
            self.process.wait()
            return {}

    refused = subprocess.CompletedProcess(["ckpt"], 1, "", "ckpt: no job is running in that directory\n")
    monkeypatch.setattr(jobs_module, "run", lambda *args, **kwargs: refused)
    jobs = Jobs(tmp_path)
    monkeypatch.setattr(jobs, "start", lambda *args, **kwargs: Ended())
    with pytest.raises(AssertionError, match="the program ended before the checkpoint asked for after step 10"):
        jobs.restarted_results(2, "program.py", kill_at=[10])


@pytest.mark.e2e
def test_closing_jobs_kills_every_process_of_a_running_job(tmp_path: Path) -> None:
    jobs = Jobs(tmp_path)
    job = jobs.start("launch", "-n", "2", "--ckpt-dir", str(tmp_path / "ckpt"), str(PROGRAMS / "counter.py"), "100000")
    job.wait_step(2)
    pids = set(job.rank_pids().values())
    assert pids and pids <= job.seen_pids
    assert job.process is not None
    launcher = job.process.pid
    jobs.close()
    assert job.process.returncode is not None  # the launcher was reaped
    wait_for(lambda: all(_gone(pid) for pid in pids | {launcher}), 30, "the job's ranks to be gone")


PLUGIN_USER = """
from pathlib import Path

pytest_plugins = ["ckpt.testing.pytest_plugin"]


def test_starts_a_job_and_leaves_it_running(start_job, tmp_path):
    job = start_job("launch", "-n", "1", "--ckpt-dir", str(tmp_path / "ckpt"), {program!r}, "100000")
    job.wait_step(1)
    Path({record!r}).write_text(" ".join(map(str, [job.process.pid, *job.rank_pids().values()])))
"""


@pytest.mark.e2e
def test_the_pytest_plugins_start_job_fixture_reaps_what_a_test_left_running(pytester: pytest.Pytester) -> None:
    record = pytester.path / "pids"
    pytester.makepyfile(PLUGIN_USER.format(program=str(PROGRAMS / "counter.py"), record=str(record)))
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    outcome.assert_outcomes(passed=1)
    pids = [int(pid) for pid in record.read_text().split()]
    assert len(pids) == 2
    wait_for(lambda: all(_gone(pid) for pid in pids), 30, "the job the inner test left running to be gone")


def test_nothing_else_in_ckpt_imports_ckpt_testing() -> None:
    """ckpt.testing is for tests: a rank, the launcher or the coordinator never loads it (nor pytest with it)."""
    package = Path(ckpt.__file__).parent
    for source in package.rglob("*.py"):
        if package / "testing" in source.parents:
            continue
        lines = source.read_text().splitlines()
        imports = [line for line in lines if line.lstrip().startswith(("import ", "from ")) and "testing" in line]
        assert not imports, f"{source.relative_to(package.parent)} imports {imports}"


def test_wait_step_waits_for_every_rank_to_join(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A restarted rank starts at its image's step: one rank past `step` is not the job past it."""
    states = iter(
        [
            {"state": "running", "size": 2, "ranks": [{"rank": 0, "step": 10}]},  # rank 1 has not joined
            {"state": "running", "size": 2, "ranks": [{"rank": 0, "step": 10}, {"rank": 1, "step": 7}]},
        ]
    )
    seen: list[dict[str, Any]] = []

    def poll_status(self: Job) -> dict[str, Any]:
        seen.append(next(states))
        return seen[-1]

    job = Job(["launch"], tmp_path / "ckpt")
    job.process = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # runs until killed
    try:
        monkeypatch.setattr(Job, "poll_status", poll_status)
        assert len(job.wait_step(6, timeout=10)["ranks"]) == 2 and len(seen) == 2
    finally:
        job.process.kill()
        job.process.wait()
