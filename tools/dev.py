#!/usr/bin/env python3
"""Developer entry point: `python3 tools/dev.py demo` and `python3 tools/dev.py test`.

Both create (or refresh) a virtual environment in .venv with ckpt installed in
editable mode, so they work on a fresh machine that has only Python 3.11 and
access to the package index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"

#: What `test` passes to pytest before the caller's arguments (a later -n wins: `-n 0` runs serially).
#: 4 pytest-xdist workers on CI's 2 cores: most end-to-end tests wait (for a step, a checkpoint, a held
#: job), and since their jobs stopped spinning to be slow (examples/heat.py ... sleep) 4 beat 3: 462 s
#: against 590 s for the whole suite, 2026-11-28 (3 had beaten 2 and 4 before). worksteal: an idle worker
#: takes tests queued on a busy one (with the default "load", the end-to-end tests, which are collected
#: next to each other, could end up queued on one worker). The 15 slowest tests are printed.
PYTEST_DEFAULTS = ["-n", "4", "--dist", "worksteal", "--durations=15"]


def ensure_venv() -> None:
    """Create .venv and install ckpt[test] into it, again whenever pyproject.toml changed."""
    stamp = VENV / ".ckpt-installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    if not (BIN / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(BIN / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    print("installing ckpt and its dependencies into .venv ...", flush=True)
    for command in ([*pip, "--upgrade", "pip"], [*pip, "-e", f"{ROOT}[test]"]):
        done = subprocess.run(command, text=True, capture_output=True)
        if done.returncode != 0:  # the build's chatter only matters when it failed
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"error: {' '.join(command[3:])} failed")
    stamp.write_text(digest)


def compile_bytecode() -> None:
    """Write the bytecode of the project's own modules ahead of time.

    With PYTHONDONTWRITEBYTECODE set (as on CI's machines), Python never caches it, and every process a
    job starts -- coordinator, fabric, each rank, each `ckpt` command -- compiled ckpt, its plugins and
    the DSM from source again: ~0.13 s of CPU per process, a quarter of a rank's start-up, thousands of
    times over a test run. py_compile writes the files regardless of that setting; a file edited later
    is still read from its source (the cached copy records its source's mtime and size).
    """
    dirs = [str(ROOT / name) for name in ("ckpt", "plugins", "dsm", "examples", "tests", "benchmarks")]
    subprocess.run([str(BIN / "python"), "-m", "compileall", "-q", "-j", "0", *dirs], check=True, capture_output=True)


def ckpt(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ckpt"), *args], text=True, capture_output=True, **kwargs)  # type: ignore[call-overload]


def results(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "result:" in line]


def demo() -> int:
    """launch -> checkpoint -> kill -> restart over tcp, and compare with an uninterrupted run."""
    # 2 ms a step, slept rather than spun (the result is the same): long enough to checkpoint mid-run, and
    # no CPU taken from whatever else the machine runs (tests/test_first_hour.py runs this demo in the suite)
    program = [str(ROOT / "examples" / "heat.py"), "600", "2000", "2", "sleep"]
    work = Path(tempfile.mkdtemp(prefix="ckpt-demo-"))
    print(f"ckpt demo in {work}: 4 ranks of examples/heat.py (600 steps)")
    plain = ckpt("launch", "-n", "4", "--ckpt-dir", str(work / "plain"), *program)
    if plain.returncode != 0:
        print(plain.stderr, file=sys.stderr)
        return 1
    print("uninterrupted run:\n  " + "\n  ".join(results(plain.stdout)))

    ckpt_dir = str(work / "ckpt")
    job = subprocess.Popen(
        [str(BIN / "ckpt"), "launch", "-n", "4", "--ckpt-dir", ckpt_dir, *program],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    step = 0
    while step < 100 and time.monotonic() < deadline and job.poll() is None:
        state = ckpt("status", "--json", "--ckpt-dir", ckpt_dir)
        if state.returncode == 0:
            step = min(r["step"] for r in json.loads(state.stdout)["ranks"] or [{"step": 0}])
        time.sleep(0.2)  # polling a human-facing demo, not synchronising a test
    taken = ckpt("checkpoint", "--kill", "--ckpt-dir", ckpt_dir)
    print(f"$ ckpt checkpoint --kill   (at step ~{step})\n  {taken.stdout.strip() or taken.stderr.strip()}")
    job.communicate(timeout=60)
    restarted = ckpt("restart", "--transport", "tcp", "--ckpt-dir", ckpt_dir)
    print(
        "$ ckpt restart --transport tcp   (the checkpoint was taken on simib)\n  "
        + "\n  ".join(results(restarted.stdout))
    )
    if taken.returncode or restarted.returncode or results(restarted.stdout) != results(plain.stdout):
        print("demo FAILED: the restarted run differs from the uninterrupted one", file=sys.stderr)
        print(restarted.stderr, file=sys.stderr)
        return 1
    print("demo OK: the restarted run's results equal the uninterrupted run's")
    print(f"ckpt is installed in {VENV}: `. .venv/bin/activate` puts it on PATH (README: A first hour)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def test(extra: list[str]) -> int:
    """Lint, type-check and run the whole test suite in parallel (what CI runs); `extra` goes to pytest."""
    os.chdir(ROOT)
    steps = [
        [str(BIN / "ruff"), "check", "ckpt", "plugins", "dsm", "tests", "benchmarks", "examples", "tools"],
        [str(BIN / "ruff"), "format", "--check", "ckpt", "plugins", "dsm", "tests", "benchmarks", "examples", "tools"],
        [str(BIN / "mypy")],
        [str(BIN / "lint-imports"), "--no-cache", "--no-logo"],
        [str(BIN / "python"), "-m", "pytest", "-q", *PYTEST_DEFAULTS, *extra],
    ]
    for command in steps:
        print("$", " ".join(Path(command[0]).name if i == 0 else c for i, c in enumerate(command)), flush=True)
        code = subprocess.run(command).returncode
        if code != 0:
            return code
    return 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test"):
        print("usage: python3 tools/dev.py demo | test [pytest args]", file=sys.stderr)
        return 2
    ensure_venv()
    compile_bytecode()
    return demo() if sys.argv[1] == "demo" else test(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
