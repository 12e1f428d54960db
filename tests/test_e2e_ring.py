"""End-to-end: a verbs program under `ckpt launch` (its fabric started by the launcher), plugin verbs hooks."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import Job, results, run
from harness import EXAMPLES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

RING = str(EXAMPLES / "ring.py")


def expected_ring(ranks: int, steps: int) -> dict[int, str]:
    """What examples/ring.py computes, without verbs: each rank mixes in its left neighbour's value."""
    values = [rank + 1 for rank in range(ranks)]
    for i in range(steps):
        values = [(values[r] * 31 + values[(r - 1) % ranks] + i) % 1_000_003 for r in range(ranks)]
    return {rank: str(v) for rank, v in enumerate(values)}


@pytest.mark.parametrize("ranks", [1, 3])
def test_ring_over_the_launchers_fabric_gives_the_plain_python_answer(tmp_path: Path, ranks: int) -> None:
    launched = run("launch", "-n", str(ranks), "--ckpt-dir", str(tmp_path), RING, "150", timeout=120)
    assert launched.returncode == 0, launched.stderr
    assert results(launched.stdout) == expected_ring(ranks, 150)
    assert "cannot be pickled" not in launched.stderr  # verbs objects pickle through the ib plugin's shadows
    native = run("launch", "-n", str(ranks), "--native", "--ckpt-dir", str(tmp_path), RING, "150", timeout=120)
    assert native.returncode == 0, native.stderr
    assert results(native.stdout) == results(launched.stdout)


def test_plugin_wraps_the_ops_table_and_contributes_a_provider(tmp_path: Path) -> None:
    steps = 40
    launched = run(
        "launch", "-n", "2", "--with-plugin", "ckpt_verbscount", "--ckpt-dir", str(tmp_path), RING, str(steps)
    )
    assert launched.returncode == 0, launched.stderr
    for rank in range(2):
        posts, providers = (tmp_path / f"verbscount.{rank}").read_text().split()
        assert int(posts) == steps  # one RDMA_WRITE_WITH_IMM per step, each seen by the wrapper
        assert providers.split(",") == ["countib", "simib", "tcp"]  # tcp: the ib2tcp plugin, loaded by default


def test_checkpointing_verbs_without_the_virtualization_plugin_is_refused_clearly(
    tmp_path: Path, start_job: Callable[..., Job]
) -> None:
    job = start_job(
        "launch", "-n", "2", "--disable-plugin", "ib", "--ckpt-dir", str(tmp_path), RING, "1000000", ckpt_dir=tmp_path
    )
    job.wait_step(5)
    taken = run("checkpoint", "--wait", "--ckpt-dir", str(tmp_path))
    assert taken.returncode == 1
    assert "cannot be checkpointed" in taken.stderr and "ckpt_ib" in taken.stderr
    assert "Traceback" not in taken.stderr
    assert not list(tmp_path.glob("*.ckpt")) and not list(tmp_path.glob("ckpt_*.json"))
    step = job.status()["ranks"][0]["step"]  # type: ignore[index]
    job.wait_step(step + 5)  # the job keeps running


def test_fail_link_on_the_jobs_fabric_fails_the_ring(tmp_path: Path, start_job: Callable[..., Job]) -> None:
    """`ckpt fabric fail-link --dir <the job's ckpt dir>` reaches the fabric the launcher started."""
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(tmp_path), RING, "1000000", ckpt_dir=tmp_path)
    job.wait_step(5)
    shown = run("fabric", "status", "--dir", str(tmp_path), "--json")
    assert shown.returncode == 0, shown.stderr
    pids = job.rank_pids()
    (rank1,) = [h for h in json.loads(shown.stdout)["hcas"] if h["pid"] == pids[1]]
    failed = run("fabric", "fail-link", str(rank1["lids"][0]), "--dir", str(tmp_path))
    assert failed.returncode == 0, failed.stderr
    try:
        code = job.wait(timeout=60)  # no alternate path: the job fails
    except subprocess.TimeoutExpired:  # say what the job was doing
        state = [run("status", "--ckpt-dir", str(tmp_path)).stdout for _ in range(2)]
        links = run("fabric", "status", "--dir", str(tmp_path)).stdout
        err = "\n".join(job.read()[1].splitlines()[-40:])  # e.g. a "simib timer callback failed" traceback
        raise AssertionError(
            f"the job did not fail within 60 s of the link's failure\n{state}\n{links}\n--- stderr ---\n{err}"
        ) from None
    assert code == 1, job.stderr
    # A rank finds its WRITE failed with RETRY_EXC_ERR when it polls -- unless its neighbour's WRITE of that
    # step got through first: then it waits in the step's barrier, and the neighbour finds the path down.
    assert "IBV_WC_RETRY_EXC_ERR" in job.stderr or "the path to the left neighbour is down" in job.stderr, job.stderr
    assert not (tmp_path / "fabric.json").exists()  # the launcher stopped its fabric
