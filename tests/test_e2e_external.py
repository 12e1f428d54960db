"""End-to-end: a standalone `ckpt coordinator` and ranks started by an external launcher.

An external launcher (mpiexec, srun) starts `ckpt launch --coordinator H:P prog`
once per rank with the rank in PMI_RANK / OMPI_COMM_WORLD_RANK / SLURM_PROCID;
here the test is that launcher.  The coordinator outlives the job and serves
the restarted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from ib_cases import Pauses, expected_ring, gated_steps

from ckpt.testing import CKPT, Job, env, results, run, wait_for
from harness import EXAMPLES, heat_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HEAT = [str(EXAMPLES / "heat.py"), "1500", "500", "2", "sleep"]
RANK_VARIABLES = [("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("SLURM_PROCID", "SLURM_NTASKS")]  # fmt: skip


# suite time: CI runs PMI_*; the others are read alike (test_cli checks each pair) and run under -m stress
@pytest.mark.parametrize(
    "rank_var,size_var", [RANK_VARIABLES[0], *(pytest.param(*v, marks=pytest.mark.stress) for v in RANK_VARIABLES[1:])]
)
def test_ranks_started_by_an_external_launcher_checkpoint_and_restart(
    rank_var: str, size_var: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    token = {"CKPT_TOKEN": "external-job-token"}
    start_job("coordinator", "--port", "0", "--ckpt-dir", str(ckpt_dir), extra_env=token)
    job_file = ckpt_dir / "coordinator.json"
    wait_for(job_file.exists, 30, "the coordinator's job file")
    address = json.loads(job_file.read_text())["address"]
    ranks = [
        start_job("launch", "--coordinator", address, "--ckpt-dir", str(ckpt_dir), *HEAT,
                  extra_env={**token, rank_var: str(r), size_var: "2"})
        for r in range(2)
    ]  # fmt: skip
    ranks[0].wait_step(30)
    taken = run("checkpoint", "--kill", "--coordinator", address, "--ckpt-dir", str(ckpt_dir), extra_env=token)
    assert taken.returncode == 0, taken.stderr
    assert [r.wait() for r in ranks] == [0, 0]
    restarted = run("restart", "--coordinator", address, "--ckpt-dir", str(ckpt_dir), extra_env=token, timeout=120)
    assert restarted.returncode == 0, restarted.stderr
    assert results(restarted.stdout) == heat_results(2, int(HEAT[1]), int(HEAT[2]))  # the uninterrupted run's
    manifest = json.loads((ckpt_dir / "ckpt_heat_1.json").read_text())
    assert manifest["coordinator"] == address and manifest["size"] == 2


MPIEXEC = Path(sys.executable).parent / "mpiexec"  # from the mpich wheel of the test extras


def _mpiexec(ranks: int, *args: str, extra_env: dict[str, str]) -> subprocess.Popen[str]:
    command = [str(MPIEXEC), "-n", str(ranks), *CKPT, *args]
    return subprocess.Popen(
        command, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(**extra_env), start_new_session=True
    )


def _finish(process: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, out, err


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable} (pip install '.[test]')")
def test_mpiexec_runs_checkpoints_and_restarts_a_verbs_job_over_tcp(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    # the job idles before real step 20 until it is checkpointed there (`Pauses`): mid-run under any load
    ckpt_dir, at, pauses = tmp_path / "ckpt", 20, Pauses(tmp_path, 20)
    steps = gated_steps(at)
    token = {"CKPT_TOKEN": "mpiexec-job-token"}
    start_job("coordinator", "--port", "0", "--ckpt-dir", str(ckpt_dir), extra_env=token)
    job_file = ckpt_dir / "coordinator.json"
    wait_for(job_file.exists, 30, "the coordinator's job file")
    address = json.loads(job_file.read_text())["address"]
    program = [str(Path(__file__).parent / "programs" / "ib_ring.py"), str(steps)]
    where = ["--coordinator", address, "--ckpt-dir", str(ckpt_dir)]
    launched = _mpiexec(4, "launch", "--transport", "tcp", *where, *program, extra_env={**token, **pauses.env})
    try:
        pauses.wait(at)
        taken = run("checkpoint", "--kill", *where, extra_env=token)
        assert taken.returncode == 0, taken.stderr
    finally:
        code, out, err = _finish(launched)
    assert code == 0, err
    pauses.open(at)
    restarted = _mpiexec(4, "restart", *where, extra_env={**token, **pauses.env})
    code, out, err = _finish(restarted)
    assert code == 0, err
    assert results(out) == expected_ring(4, steps)
