"""Jobs through the CLI, exactly as a user runs them: `run`, `Job`, and checkpoint -> kill -> restart.

One shape for every end-to-end test (as CRIU's ZDTM): launch -> (checkpoint -> kill -> restart) x k
-> the results equal an uninterrupted run's.  Every command runs in a session of its own; a `Job`
is killed by its process group and by the rank PIDs it has seen, so nothing outlives a test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ckpt._errors import CoordinatorError
from ckpt._jobdir import find_job
from ckpt.coordinator.client import control

#: The command line of ``ckpt``: this interpreter, with the current directory kept off sys.path (-P).
CKPT = [sys.executable, "-P", "-m", "ckpt"]
#: What launch / restart say at start (job id, directory, how to checkpoint it): not error lines.
BANNER = ("ckpt: job ", "ckpt: checkpoint it with")
_RESULT = re.compile(r"^\[rank (\d+)\] result: (.*)$", re.M)
#: Directories put in front of every command's PYTHONPATH (`add_pythonpath`): a suite's own plugins.
_PYTHONPATH: list[str] = []


def add_pythonpath(directory: str | Path) -> None:
    """Put `directory` in front of the PYTHONPATH of every command started from now on (once)."""
    if str(directory) not in _PYTHONPATH:
        _PYTHONPATH.insert(0, str(directory))


def env(pythonpath: Sequence[str | Path] = (), **extra: str) -> dict[str, str]:
    """The environment a command runs in: this one without any CKPT_* variable, then `extra`.

    PYTHONPATH is `pythonpath`, then the `add_pythonpath` directories, then this process's.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    path = [str(p) for p in pythonpath] + _PYTHONPATH + [base.get("PYTHONPATH", "")]
    base["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return {**base, **extra}


def results(stdout: str) -> dict[int, str]:
    """The ``[rank R] result: VALUE`` lines a job printed, as {R: VALUE}."""
    return {int(rank): value for rank, value in _RESULT.findall(stdout)}


def run(
    *args: str,
    timeout: float = 60,
    extra_env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
    prefix: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run one ckpt command to completion (with `stdin` as its input, if given; under `prefix`, e.g. setpriv)."""
    return subprocess.run(
        [*(prefix or []), *CKPT, *args],
        input=stdin,
        text=True,
        capture_output=True,
        timeout=timeout,
        env=env(**(extra_env or {})),
        cwd=cwd,
        start_new_session=True,
    )


def one_error_line(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The one `error: ...` line a refused command printed (besides launch's banner), containing `needles`."""
    assert done.returncode != 0, f"the command succeeded: {done.stdout}"
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith(BANNER)]
    assert len(lines) == 1, done.stderr
    (line,) = lines
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, line
    return line


def uninterrupted(directory: Path, ranks: int, *program: str, timeout: float = 300) -> dict[int, str]:
    """The results of an uninterrupted `ckpt launch -n RANKS PROGRAM...` in `directory`: what every
    checkpoint -> kill -> restart of the same program must end with."""
    done = run("launch", "-n", str(ranks), "--ckpt-dir", str(directory), *program, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return results(done.stdout)


def checkpoint(ckpt_dir: Path, *flags: str, timeout: float = 120) -> str:
    """`ckpt checkpoint FLAGS --ckpt-dir CKPT_DIR` (e.g. ``--wait``, ``--kill``), which must succeed; its stdout."""
    taken = run("checkpoint", *flags, "--ckpt-dir", str(ckpt_dir), timeout=timeout)
    assert taken.returncode == 0, taken.stderr
    return taken.stdout


def kill_pids(pids: Iterable[int]) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)  # the polling interval of a condition wait, not a race-hiding sleep


def _session_of(pid: int) -> int | None:
    """The session id of process `pid` (None if it is gone or /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp, session, ...
    return int(fields[3])


@dataclass
class Job:
    """Stands for a `ckpt launch` / `ckpt restart` running in the background, in its own process group.

    Its output goes to files next to `ckpt_dir` (`read`, `wait` fill `stdout` / `stderr`).
    """

    args: list[str]
    ckpt_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    stdout: str = ""
    stderr: str = ""
    #: Every rank PID a status showed: killed with the process group, in case one left the group.
    seen_pids: set[int] = field(default_factory=set)
    _files: tuple[IO[str], IO[str]] | None = None

    def start(self) -> Job:
        self.ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.ckpt_dir.parent / f"{self.ckpt_dir.name}.{time.monotonic_ns()}.out", "w+")
        err = open(out.name + ".err", "w+")
        self._files = (out, err)
        self.process = subprocess.Popen(
            [*CKPT, *self.args], text=True, stdout=out, stderr=err, env=env(**self.extra_env), start_new_session=True
        )
        return self

    def status(self) -> dict[str, Any] | None:
        """What `ckpt status --json` prints (None if it fails)."""
        answer = run("status", "--json", "--ckpt-dir", str(self.ckpt_dir), timeout=30)
        state: dict[str, Any] | None = json.loads(answer.stdout) if answer.returncode == 0 else None
        self._note_pids(state)
        return state

    def poll_status(self) -> dict[str, Any] | None:
        """The same status asked in this process, for waits that poll it: a `ckpt status` per poll costs a
        Python start-up (~0.1 s of CPU), which a waiting test would take from the job it waits for."""
        try:
            found = find_job(self.ckpt_dir)  # as `ckpt status` decides which job the directory holds
            if found.state == "ended" and found.record is not None:
                return found.record["ended"]  # type: ignore[no-any-return]
            if found.state != "live" or found.record is None:
                return None
            job = found.record
            connection = control(job["address"], job["token"])
            try:
                state: dict[str, Any] = connection.call("status", reply_timeout=30)["status"]
            finally:
                connection.close()
        except CoordinatorError:
            return None
        self._note_pids(state)
        return state

    def _note_pids(self, state: dict[str, Any] | None) -> None:
        for rank in (state or {}).get("ranks", []):
            if rank.get("pid"):
                self.seen_pids.add(int(rank["pid"]))

    def wait_step(self, step: int, timeout: float = 60) -> dict[str, Any]:
        """Wait until every rank has completed `step` steps; the status that showed it."""

        def reached() -> dict[str, Any] | None:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"job ended early: {self.read()[1]}")
            state = self.poll_status()
            if state and state["state"] in ("finished", "killed", "failed"):
                return None  # the final status an earlier job left behind, not this one's
            if not state or not state["ranks"] or len(state["ranks"]) < state.get("size", 0):
                return None  # every rank must have joined: a restarted rank that has starts at its image's step
            if min(r["step"] for r in state["ranks"]) >= step:
                return state
            return None

        return wait_for(reached, timeout, f"every rank past step {step}")  # type: ignore[no-any-return]

    def wait(self, timeout: float = 120) -> int:
        """Wait for the job to end; its exit code (its output is then in `stdout` / `stderr`)."""
        assert self.process is not None
        code = self.process.wait(timeout=timeout)
        self.read()
        return code

    def read(self) -> tuple[str, str]:
        assert self._files is not None, "the job was not started"
        out, err = self._files
        out.seek(0)
        err.seek(0)
        self.stdout, self.stderr = out.read(), err.read()
        return self.stdout, self.stderr

    def kill(self) -> None:
        """Kill the whole process group (launcher, coordinator, ranks), then every rank PID seen that is still in
        the job's session (one that left the group; a PID since reused by another process is left alone); reap
        the launcher."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
            kill_pids(pid for pid in self.seen_pids if _session_of(pid) == self.process.pid)
        for f in self._files or ():
            f.close()

    def finishes_with(self, expected: dict[int, str], timeout: float = 120) -> None:
        """This job (a restart, typically) ends well with `expected` as its results."""
        assert self.wait(timeout) == 0, self.stderr
        assert results(self.stdout) == expected, self.stdout + self.stderr

    def rank_pids(self) -> dict[int, int]:
        """{rank: PID} of the running job."""
        state = self.status()
        assert state is not None
        return {r["rank"]: r["pid"] for r in state["ranks"]}


class Jobs:
    """Stands for a user at a shell: starts ckpt jobs in `directory`, and kills every one at `close`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Job] = []

    def start(self, *args: str, ckpt_dir: Path | None = None, extra_env: dict[str, str] | None = None) -> Job:
        """``ckpt ARGS...`` in the background; `ckpt_dir` is where its status is asked (default DIRECTORY/ckpt)."""
        job = Job([*args], ckpt_dir or self.directory / "ckpt", extra_env or {})
        self.started.append(job)
        return job.start()

    def restarted_results(
        self,
        ranks: int,
        *program: str,
        kill_at: Sequence[int],
        launch: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        timeout: float = 240,
    ) -> dict[int, str]:
        """Launch `program` on `ranks` ranks; once every rank has passed each step of `kill_at` (in
        increasing order), checkpoint it with ``--kill`` and restart it; the results of the run that finishes.

        Compare them with `uninterrupted(...)`: a checkpoint must change nothing.
        """
        ckpt_dir = self.directory / "ckpt"
        args = ["launch", "-n", str(ranks), "--ckpt-dir", str(ckpt_dir), *launch, *program]
        job = self.start(*args, ckpt_dir=ckpt_dir, extra_env=extra_env)
        for step in kill_at:
            job.wait_step(step, timeout=timeout)  # ignores the status a killed run left behind
            taken = run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir), timeout=timeout)
            if taken.returncode != 0:
                assert job.process is not None
                try:
                    ended = job.process.wait(timeout=5)  # (a launcher that is ending may not be gone yet)
                except subprocess.TimeoutExpired:
                    ended = None
                if ended == 0:  # the program ran to its end between the step and the request
                    raise AssertionError(
                        f"the program ended before the checkpoint asked for after step {step} could be taken: "
                        "give it more steps, or kill_at steps further from its end"
                    )
                job.read()
                raise AssertionError(f"{taken.stderr}{job.stderr}")
            assert job.wait(timeout) == 0, job.stderr
            job = self.start("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=extra_env)
        assert job.wait(timeout) == 0, job.stderr
        return results(job.stdout)

    def close(self) -> None:
        for job in self.started:
            job.kill()
