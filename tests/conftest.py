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


#: The verbs providers the semantic tests run on: simib's engine found through its subnet manager,
#: and ckpt_ib2tcp's `tcp` (the same engine, peers found through a directory instead).
PROVIDERS = ["simib", "tcp"]


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    """The verbs provider a semantic test runs on (device names are <provider><index>)."""
    name = str(request.param)
    if name == "tcp":
        from ckpt import verbs

        if "tcp" not in verbs.providers():
            import ckpt_ib2tcp

            ckpt_ib2tcp.register()
    return name
