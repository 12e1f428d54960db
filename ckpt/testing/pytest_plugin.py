"""pytest fixtures for ckpt programs and plugins: ``pytest_plugins = ["ckpt.testing.pytest_plugin"]``.

* ``ckpt_jobs``: a `ckpt.testing.Jobs` in the test's tmp_path; every job it started is killed at teardown.
* ``start_job``: ``start_job(*ckpt_args, ckpt_dir=..., extra_env=...)`` -> a running `ckpt.testing.Job`
  (``ckpt_jobs.start``), for tests that drive the CLI step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckpt.testing._jobs import Job, Jobs


@pytest.fixture
def ckpt_jobs(tmp_path: Path) -> Iterator[Jobs]:
    """Jobs started through the CLI in tmp_path, every one killed (process group and rank PIDs) after the test."""
    jobs = Jobs(tmp_path)
    try:
        yield jobs
    finally:
        jobs.close()


@pytest.fixture
def start_job(ckpt_jobs: Jobs) -> Callable[..., Job]:
    """start_job(*ckpt_args, ckpt_dir=..., extra_env=...) -> a running Job; killed after the test whatever happens."""
    return ckpt_jobs.start
