"""The end-to-end harness: run `ckpt` exactly as a user would, and always reap what it started.

One shape for every end-to-end test (as CRIU's ZDTM): launch -> (checkpoint ->
kill -> restart) x k -> compare the results with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt import CoordinatorError
from ckpt._jobdir import find_job
from ckpt.coordinator.client import control
from ckpt_simib import FABRIC_FILE

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PROGRAMS = Path(__file__).resolve().parent / "programs"
CKPT = [sys.executable, "-P", "-m", "ckpt"]
_RESULT = re.compile(r"^\[rank (\d+)\] result: (.*)$", re.M)


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    base["PYTHONPATH"] = os.pathsep.join([str(PROGRAMS / "plugins"), base.get("PYTHONPATH", "")])
    return {**base, **extra}


def results(stdout: str) -> dict[int, str]:
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


#: What launch / restart say at start (job id, directory, how to checkpoint it): not error lines.
BANNER = ("ckpt: job ", "ckpt: checkpoint it with")


def one_error_line(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The one `error: ...` line a refused command printed (besides launch's banner), containing `needles`."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith(BANNER)]
    assert len(lines) == 1, done.stderr
    (line,) = lines
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, line
    return line


def uninterrupted(directory: Path, ranks: int, *program: str) -> dict[int, str]:
    """The results of an uninterrupted `ckpt launch -n RANKS PROGRAM...` in `directory`: what every
    checkpoint -> kill -> restart of the same program must end with."""
    done = run("launch", "-n", str(ranks), "--ckpt-dir", str(directory), *program, timeout=300)
    assert done.returncode == 0, done.stderr
    return results(done.stdout)


def start_fabric(directory: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`ckpt fabric start --dir DIRECTORY ARGS`: (its fabric.json, its stdout). The fabric outlives the
    command: kill its record["pid"] (kill_pids) when done."""
    done = run("fabric", "start", "--dir", str(directory), *args, timeout=60)
    assert done.returncode == 0, done.stderr
    record: dict[str, Any] = json.loads((directory / FABRIC_FILE).read_text())
    return record, done.stdout


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


@dataclass
class Job:
    """A `ckpt launch` / `ckpt restart` running in the background, in its own process group."""

    args: list[str]
    ckpt_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    stdout: str = ""
    stderr: str = ""

    def start(self) -> Job:
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
        return json.loads(answer.stdout) if answer.returncode == 0 else None

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
                return connection.call("status", reply_timeout=30)["status"]  # type: ignore[no-any-return]
            finally:
                connection.close()
        except CoordinatorError:
            return None

    def wait_step(self, step: int, timeout: float = 60) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"job ended early: {self.read()[1]}")
            state = self.poll_status()
            if state and state["state"] in ("finished", "killed", "failed"):
                return None  # the final status an earlier job left behind, not this one's
            if state and len(state["ranks"]) and min(r["step"] for r in state["ranks"]) >= step:
                return state
            return None

        return wait_for(reached, timeout, f"every rank past step {step}")

    def wait(self, timeout: float = 120) -> int:
        assert self.process is not None
        code = self.process.wait(timeout=timeout)
        self.read()
        return code

    def read(self) -> tuple[str, str]:
        out, err = self._files
        out.seek(0)
        err.seek(0)
        self.stdout, self.stderr = out.read(), err.read()
        return self.stdout, self.stderr

    def kill(self) -> None:
        """Kill the whole process group (launcher, coordinator, ranks)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        for f in getattr(self, "_files", ()):
            f.close()

    def finishes_with(self, expected: dict[int, str]) -> None:
        """This job (a restart, typically) ends well with `expected` as its results."""
        assert self.wait() == 0, self.stderr
        assert results(self.stdout) == expected, self.stdout + self.stderr

    def rank_pids(self) -> dict[int, int]:
        state = self.status()
        assert state is not None
        return {r["rank"]: r["pid"] for r in state["ranks"]}


# ----------------------------------------------------------------- hostile peers of a server
def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the peer has closed `sock` (EOF or reset), False if it is still open after `timeout` s.

    What the peer sends meanwhile (a challenge, heartbeats) is read and dropped.
    """
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        try:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                return True
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return True
    return False


def trickle_until_closed(sock: socket.socket, data: bytes, pace: float) -> tuple[float, int]:
    """Send `data` one byte every `pace` s until the server closes `sock`: (seconds until then, bytes sent).

    A server with a timeout per read never closes such a peer; one with a deadline for the whole
    handshake does.  Fails the test if all of `data` but its last byte went out first.
    """
    start = time.monotonic()
    sent = 0
    while not closed_by_peer(sock, pace):
        if sent >= len(data) - 1:
            raise AssertionError(f"the server still had the connection open after {sent} bytes in {sent * pace:.1f} s")
        try:
            sock.sendall(data[sent : sent + 1])
        except OSError:
            break
        sent += 1
    return time.monotonic() - start, sent
