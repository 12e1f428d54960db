"""The first hour of a new user: the README's quick start and its "A first hour" block, run literally.

The repository's tracked files are copied into a fresh directory (the layout of a fresh clone, with the
test's virtual environment as its .venv); the block runs there, from the repository root and from
another directory, and must leave nothing inside the `ckpt/` package directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt.testing
from ckpt.testing import env, results
from harness import ROOT, heat_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MARKER = "<!-- first-hour -->"
#: The block's heat job: its checkpoints all fall by step ~300 on a loaded test worker (the tcp restart is
#: killed at its first step), so the final restart runs nearly all of it; 20000 steps cost 30-40 s there.
STEPS = 5000


def _first_hour_block() -> str:
    readme = (ROOT / "README.md").read_text()
    assert MARKER in readme, "README.md lost its first-hour block"
    match = re.search(re.escape(MARKER) + r"\s*```sh\n(.*?)```", readme, re.S)
    assert match is not None
    assert f"examples/heat.py {STEPS} &" in match[1], "the block's heat job is not the one the tests expect"
    return match[1]


def _quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") : readme.index("## A first hour")]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    commands = [line.split("#")[0].strip() for line in blocks[0].splitlines() if line.strip()]
    assert commands == ["python3 tools/dev.py demo", "python3 tools/dev.py test"], commands
    activate = [line.split("#")[0].strip() for line in blocks[1].splitlines() if line.strip()]
    assert activate == [". .venv/bin/activate"], activate
    return [commands[0], activate[0]]


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked files in a new directory, with this test run's virtual environment as its .venv."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the tracked files")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    repo = tmp_path_factory.mktemp("clone") / "ckpt-repo"
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    (repo / ".venv").symlink_to(Path(sys.prefix))
    return repo


def _package_files(repo: Path) -> set[str]:
    """Everything under ckpt/ but Python's byte-code caches."""
    return {str(p.relative_to(repo)) for p in (repo / "ckpt").rglob("*") if "__pycache__" not in p.parts}


def _bash(script: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    environment = env()
    environment["PATH"] = os.pathsep.join(p for p in environment["PATH"].split(os.pathsep) if ".venv" not in p)
    environment.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        ["bash", "-c", "set -e\n" + script],
        cwd=cwd,
        env=environment,
        text=True,
        capture_output=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, str]:
    """What an uninterrupted `ckpt launch -n 4 examples/heat.py 5000` prints (`heat_results`)."""
    return heat_results(4, STEPS)


def test_the_quick_start_demo_runs_in_a_fresh_clone(fresh_clone: Path) -> None:
    demo, activate = _quick_start()
    before = _package_files(fresh_clone)
    done = _bash(f"{demo}\n{activate}\ncommand -v ckpt\n", fresh_clone)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo OK" in done.stdout and "restart --transport tcp" in done.stdout, done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith(".venv/bin/ckpt"), "activate does not put ckpt on PATH"
    assert _package_files(fresh_clone) == before


def _check_first_hour(done: subprocess.CompletedProcess[str], where: Path, expected: dict[int, str]) -> None:
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Traceback" not in out, out
    for needle in ("checkpoint 1 written", "checkpoint 2 written", "checkpoint 3 written", "; job killed"):
        assert needle in done.stdout, out
    assert "transport: tcp" in done.stdout and "authentic: yes" in done.stdout, out
    assert "state running" in done.stdout and "last checkpoint: 1" in done.stdout, out
    assert results(done.stdout) == expected, out
    assert "plugin API" in done.stdout and "ib2tcp" in done.stdout, out
    assert "1000 iters in" in done.stdout, out  # rc_pingpong --pair
    images = where / "ckpt-images"
    assert sorted(p.name for p in images.glob("ckpt_heat_*.json")) == [f"ckpt_heat_{n}.json" for n in (1, 2, 3)]


def test_the_first_hour_from_the_repository_root(fresh_clone: Path, uninterrupted: dict[int, str]) -> None:
    _, activate = _quick_start()
    before = _package_files(fresh_clone)
    done = _bash(f"{activate}\n{_first_hour_block()}", fresh_clone)
    _check_first_hour(done, fresh_clone, uninterrupted)
    assert _package_files(fresh_clone) == before, "a file landed inside the ckpt package directory"


def test_the_first_hour_from_another_directory(
    fresh_clone: Path, tmp_path: Path, uninterrupted: dict[int, str]
) -> None:
    block = _first_hour_block().replace("examples/", f"{fresh_clone}/examples/")
    before = _package_files(fresh_clone)
    done = _bash(f". {fresh_clone}/.venv/bin/activate\n{block}", tmp_path)
    _check_first_hour(done, tmp_path, uninterrupted)
    assert _package_files(fresh_clone) == before


def test_the_readme_job_that_survives_a_rank_failure(fresh_clone: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(re.escape("<!-- survive -->") + r"\s*```sh\n(.*?)```", readme, re.S)
    assert match is not None, "README.md lost its block of a job that survives a rank failure"
    _, activate = _quick_start()
    directory = tmp_path / "images"
    done = _bash(f"export CKPT_DIR={directory}\n{activate}\n{match[1]}\nckpt status --json", fresh_clone)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out
    assert "rank 2 (pid" in done.stderr and "respawning it from checkpoint 1 as incarnation 1" in done.stderr, out
    program, steps = str(fresh_clone / "examples" / "montecarlo.py"), re.search(r"montecarlo\.py (\d+) &", match[1])
    assert steps is not None, "the block's job is not examples/montecarlo.py STEPS in the background"
    assert results(done.stdout) == ckpt.testing.uninterrupted(tmp_path / "plain", 4, program, steps[1]), out
    status = json.loads(done.stdout[done.stdout.index("{") :])
    assert [r["incarnation"] for r in status["ranks"]] == [0, 0, 1, 0], status


def test_the_default_directory_is_ignored_by_git() -> None:
    assert "ckpt-images/" in (ROOT / ".gitignore").read_text().split()


def test_the_plugins_readme_lists_the_plugins_that_exist() -> None:
    text = (ROOT / "plugins" / "README.md").read_text()
    packages = sorted(p.name for p in (ROOT / "plugins").iterdir() if p.is_dir() and p.name.startswith("ckpt_"))
    assert packages, "no plugin packages found"
    for name in packages:
        assert f"| `{name}` |" in text, f"plugins/README.md does not list {name}"
    listed = re.findall(r"^\| `(ckpt_\w+)` \|", text, re.M)
    assert sorted(listed) == packages, "plugins/README.md lists a plugin that does not exist"
