"""Shared fixtures: every job a test starts is killed by process group at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness import Job


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """start_job(*ckpt_args, ckpt_dir=...) -> a running Job; reaped after the test whatever happens."""
    jobs: list[Job] = []

    def start(*args: str, ckpt_dir: Path | None = None, extra_env: dict[str, str] | None = None) -> Job:
        directory = ckpt_dir or tmp_path / "ckpt"
        job = Job([*args], directory, extra_env or {}).start()
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()
