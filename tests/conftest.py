"""Shared fixtures: ckpt.testing's (every job a test starts is reaped at teardown), and the verbs providers."""

from __future__ import annotations

import os

# One OpenBLAS thread in this process and in every process a test starts (they inherit this environment), set
# before numpy is first imported.  numpy's OpenBLAS otherwise starts a thread per core when it loads, and those
# threads spin for a while before they sleep: ~0.1 s of CPU per process that imports numpy -- every rank,
# `ckpt launch`, `ckpt restart` and fabric, over 1500 of them in a run of the suite, which is CPU-bound on its
# two cores.  No program of the suite does BLAS work that a second thread would speed up, and none of their
# results depends on it (matmul's products are exact in any order).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.coordinator.server import Coordinator
from ckpt.testing import add_pythonpath
from ckpt.verbs.fabric import SubnetManager
from harness import TEST_PLUGINS

pytest_plugins = ["ckpt.testing.pytest_plugin", "pytester"]

add_pythonpath(TEST_PLUGINS)  # `--with-plugin ckpt_faults` and the other test plugins, in every ckpt command


#: The verbs providers the semantic tests run on: simib's engine found through its subnet manager,
#: and ckpt_ib2tcp's `tcp` (the same engine, peers found through a directory instead).
PROVIDERS = ["simib", "tcp"]


@pytest.fixture(autouse=True)
def _runner_scheduling_policy() -> Iterator[None]:
    """A test that runs the CLI in-process (`ckpt.cli.main`) puts this thread under --sched's policy: put back
    the runner's own, or every job a later test starts would inherit it (and tests/test_e2e_sched.py could not
    see whether ckpt applies the policy itself)."""
    before = os.sched_getscheduler(0)
    yield
    if os.sched_getscheduler(0) != before:
        os.sched_setscheduler(0, before, os.sched_param(0))


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


@pytest.fixture
def start_sm() -> Iterator[Callable[..., SubnetManager]]:
    """start_sm(**kwargs) -> a started SubnetManager, stopped after the test."""
    started: list[SubnetManager] = []

    def start(**kwargs: Any) -> SubnetManager:
        sm = SubnetManager(**kwargs).start()
        started.append(sm)
        return sm

    yield start
    for sm in started:
        sm.stop()


@pytest.fixture
def make_coordinator(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Coordinator]]:
    """In-process coordinators on a free loopback port, keyed with the test module's ``TOKEN``; all stopped after."""
    token = str(request.module.TOKEN)
    made: list[Coordinator] = []

    def make(**kwargs: Any) -> Coordinator:
        made.append(Coordinator(token=token, ckpt_dir=tmp_path, **kwargs).start())
        return made[-1]

    yield make
    for coord in made:
        coord.stop()


@pytest.fixture
def ctxs(provider: str) -> Iterator[Any]:
    """Two contexts of `provider`'s devices <provider>0 and <provider>1 (two HCAs of this process), closed after."""
    from verbs_util import contexts

    yield from contexts(f"{provider}0", f"{provider}1")


@pytest.fixture
def ib() -> Iterator[Any]:
    """The ckpt_ib tests' environment (tests/ib_util.py): an IbEnv, killed at teardown."""
    from ib_util import ib_env  # here, not at the top: only the tests that use it import ckpt_ib

    yield from ib_env()
