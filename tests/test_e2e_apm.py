"""End-to-end: `--apm auto` through the CLI -- a ring keeps running across failed links, and restarts after them.

The fault is `ckpt fabric fail-link` of a random rank's port at a random step.  With `--apm off` the same
fault fails the job with one RETRY_EXC_ERR line (tests/test_e2e_ring.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dsm_cases import CASES as DSM_CASES
from ib_cases import CASES, RANKS, Hold, Pauses, launch_args, random_seed, take
from test_e2e_dsm import PROGRAM_ENV, uninterrupted

from ckpt.testing import Job, kill_pids, results, run, wait_for
from harness import PROGRAMS, start_fabric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
RING = next(c for c in CASES if c.name == "ring")
#: The ring's steps here: every fault and checkpoint is at a gate within its first 220 steps (or, at random, its
#: first 150), and 380 steps at least come after it on the paths it left -- the traffic that must find and cross
#: them (each step costs the 4 ranks and the coordinator ~2.5 ms of CPU: RING.steps, 1500, would be 2.2 s more).
RING_STEPS = 600
RUNS, IN_CI = 10, 1  # link failures at random moments: all under -m stress, the first IN_CI in CI (suite time)
SEED = random_seed()


def _hcas(fabric_dir: Path) -> list[dict[str, Any]]:
    """The HCAs on the fabric recorded in `fabric_dir` (the job's ckpt dir, for its own), from `ckpt fabric status`."""
    shown = run("fabric", "status", "--dir", str(fabric_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    hcas: list[dict[str, Any]] = json.loads(shown.stdout)["hcas"]
    return hcas


def _lids(fabric_dir: Path, job: Job) -> dict[int, list[int]]:
    """Each rank's real LIDs (ports 1 and 2)."""
    hcas = _hcas(fabric_dir)
    return {rank: next(h["lids"] for h in hcas if h["pid"] == pid) for rank, pid in job.rank_pids().items()}


def _link(ckpt_dir: Path, lid: int, up: bool) -> None:
    done = run("fabric", "restore-link" if up else "fail-link", str(lid), "--dir", str(ckpt_dir))
    assert done.returncode == 0, done.stderr


def _apm(job: Job, rank: int) -> dict[str, Any]:
    """Rank `rank`'s APM statistics as `ckpt status --json` shows them ({} before it published any)."""
    status = job.poll_status() or {"ranks": []}
    entry = next((r for r in status["ranks"] if r["rank"] == rank), {})
    return dict((entry.get("plugins") or {}).get("apm") or {})


def _launch(
    start_job: Callable[..., Job], ckpt_dir: Path, steps: int, *options: str, env: Any = None, policy: str = "auto"
) -> Job:
    return start_job(
        *launch_args(ckpt_dir, RING.argv(steps), "--apm", policy, *options), ckpt_dir=ckpt_dir, extra_env=env
    )


@pytest.mark.parametrize(
    "index", [pytest.param(i, marks=[] if i < IN_CI else [pytest.mark.stress]) for i in range(RUNS)]
)
def test_a_ring_gives_the_uninterrupted_answer_across_a_link_failure_at_a_random_moment(
    index: int, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    rng = random.Random(SEED + index)
    ckpt_dir, steps = tmp_path / "ckpt", RING_STEPS
    victim, at = rng.randint(0, RANKS - 1), rng.randint(5, steps // 4)  # early: traffic goes on long after it
    label = f"seed {SEED + index} (CKPT_TEST_SEED={SEED}): rank {victim}'s port 1 failed after step {at}"
    # the job pauses at step `at` while the test looks up the LIDs, and the link fails as the traffic resumes
    # (one CLI call later: a moment no step boundary decides); a second gate, opened once the link is down,
    # keeps traffic to come after the fault however fast the ring ran meanwhile
    later = steps // 2
    hold, pauses = Hold(tmp_path), Pauses(tmp_path, at, later)
    job = _launch(start_job, ckpt_dir, steps, env={**hold.env, **pauses.env})
    pauses.wait(at)
    lid = _lids(ckpt_dir, job)[victim][0]
    pauses.open(at)
    _link(ckpt_dir, lid, up=False)
    failed_at = job.status()["ranks"][victim]["step"]  # type: ignore[index]
    pauses.open(later)
    label += f" (the link went down at step {failed_at})"
    wait_for(lambda: _apm(job, victim).get("migrations_automatic", 0) >= 1, 60, f"{label}: a migration")
    hold.release()
    assert job.wait() == 0, f"{label}\n{job.stderr}"
    assert results(job.stdout) == RING.expect(steps), label


def _fail_twice(ckpt_dir: Path, job: Job, victim: int, pauses: Pauses, first: int, second: int) -> None:
    """Port 1 of `victim` fails at gate `first`: its QPs and their peers' move to the port 2 end, re-armed on
    paths that share it (`degraded`).  At gate `second` port 1 comes back: every rank re-arms them on the
    disjoint port pair (the victim on its PORT_ACTIVE, the others at their periodic look, and each publishes
    it).  Then port 2 fails as the gate opens: the QPs must move back to port 1.  Without the re-arm the
    second fault would end the job.  Each fault strikes while the job is paused at a gate, so the traffic that
    finds it is still to come however fast the job ran."""
    pauses.wait(first)
    lids = _lids(ckpt_dir, job)[victim]
    _link(ckpt_dir, lids[0], up=False)
    pauses.open(first)
    wait_for(lambda: _apm(job, victim).get("migrations_automatic", 0) >= 1, 60, "the first migration")
    pauses.wait(second)
    wait_for(lambda: _apm(job, victim).get("degraded", 0) > 0, 60, "the victim's QPs re-armed through port 2")
    migrated = _apm(job, victim)["migrations_automatic"]
    _link(ckpt_dir, lids[0], up=True)

    def disjoint_again() -> bool:
        state = job.poll_status() or {"ranks": []}  # one snapshot of every rank
        return all(not ((r.get("plugins") or {}).get("apm") or {}).get("degraded", 1) for r in state["ranks"])

    wait_for(disjoint_again, 60, "every rank's QPs re-armed on a disjoint path once port 1 is back")
    _link(ckpt_dir, lids[1], up=False)
    pauses.open(second)
    wait_for(lambda: _apm(job, victim).get("migrations_automatic", 0) > migrated, 60, "the second migration")


def _second_fault_seen(ckpt_dir: Path, victim: int) -> None:
    stats = json.loads(run("status", "--ckpt-dir", str(ckpt_dir), "--json").stdout)["ranks"][victim]["plugins"]["apm"]
    assert stats["migration_errors"] == 0 and stats["port_faults"] >= 2
    assert stats["fault_to_completion"], stats  # the traffic after each fault completed on the new path


def test_a_second_link_failure_after_the_re_arm_is_survived_too(start_job: Callable[..., Job], tmp_path: Path) -> None:
    """The ring across two faults of rank 1 (`_fail_twice`)."""
    ckpt_dir, steps, hold = tmp_path / "ckpt", RING_STEPS, Hold(tmp_path)
    first, second = 20, RING_STEPS // 3  # each fault at a gate: two thirds of the ring still to run after the second
    pauses = Pauses(tmp_path, first, second)
    job = _launch(start_job, ckpt_dir, steps, env={**hold.env, **pauses.env})
    _fail_twice(ckpt_dir, job, 1, pauses, first, second)
    hold.release()
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == RING.expect(steps)
    _second_fault_seen(ckpt_dir, 1)


@pytest.mark.parametrize("protocol", ["async", pytest.param("onesided", marks=pytest.mark.stress)])
def test_a_dsm_program_survives_a_second_link_failure_after_the_re_arm(
    protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """Jacobi across two faults of one rank (`_fail_twice`): the DSM's QPs to and from it, made through ckpt_ib,
    migrate twice, and the job ends with the uninterrupted answer."""
    case = next(c for c in DSM_CASES if c.name == "jacobi")
    victim = random.Random(SEED + 200).randint(0, RANKS - 1)
    first, second = 10, 35
    ckpt_dir, hold, pauses = tmp_path / "ckpt", Hold(tmp_path), Pauses(tmp_path, first, second)
    env = {PROGRAM_ENV: case.name, **hold.env, **pauses.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    options = ("--dsm-protocol", protocol, "--apm", "auto")
    job = start_job(*launch_args(ckpt_dir, argv, *options), ckpt_dir=ckpt_dir, extra_env=env)
    label = f"seed {SEED} (CKPT_TEST_SEED={SEED}): jacobi/{protocol}, rank {victim}"
    try:
        _fail_twice(ckpt_dir, job, victim, pauses, first, second)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from None
    hold.release()
    assert job.wait() == 0, f"{label}\n{job.stderr}"
    assert results(job.stdout) == uninterrupted(case, protocol), label
    _second_fault_seen(ckpt_dir, victim)


@pytest.mark.parametrize("transport", ["simib", pytest.param("tcp", marks=pytest.mark.stress)])
@pytest.mark.parametrize("migration", ["automatic", "manual"])
def test_a_restart_after_migrations_gives_the_uninterrupted_answer(
    transport: str, migration: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """The image holds QPs moved off their first path -- by the HCA on a fault (`auto`), or by the plugin's
    manual migrations (`balance`, every 0.2 s) -- and ckpt_ib tracked where they are; the restart rebuilds them
    there, on a new fabric -- or on tcp, where APM says it is a no-op."""
    ckpt_dir, steps, hold = tmp_path / "ckpt", RING_STEPS, Hold(tmp_path)
    # the fault strikes at a gate, before the traffic that finds it; the checkpoint is taken at a second gate,
    # where every rank idles at the same step of the ring (a rank idling at a gate takes steps its neighbours do
    # not, so a checkpoint between gates could park a rank before the message its neighbour waits for)
    fault, taken = RING.checkpoint_at, RING.checkpoint_at + 200
    pauses = Pauses(tmp_path, fault, taken)
    manual = migration == "manual"
    interval = ("--apm-interval", "0.2") if manual else ()
    env = {**hold.env, **pauses.env}
    job = _launch(start_job, ckpt_dir, steps, *interval, env=env, policy="balance" if manual else "auto")
    pauses.wait(fault)
    if migration == "automatic":
        _link(ckpt_dir, _lids(ckpt_dir, job)[2][0], up=False)
    pauses.open(fault)
    counter = f"migrations_{migration}"
    wait_for(lambda: _apm(job, 2).get(counter, 0) >= 1, 60, f"an {migration} migration")
    pauses.wait(taken)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    pauses.open(taken)
    hold.release()
    again = start_job("restart", "--transport", transport, "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir)
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == RING.expect(steps)
    no_op = "APM is a no-op here: the transport has no subnet manager" in again.stderr
    assert no_op == (transport == "tcp"), again.stderr


def test_a_restart_with_a_link_still_down_gives_the_uninterrupted_answer(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """On a fabric that outlives the job (`ckpt fabric start`, `--fabric`): the checkpoint holds every QP on
    port 1 with port 2 ARMED; then rank 2's port 1 fails, the QPs migrate, and the whole job is killed -9.  The
    restart onto the same fabric gets rank 2's node back with that cable still cut (same LIDs, port 1 DOWN):
    ckpt_ib rebuilds the QPs on their recorded paths, the dead one included, with the alternate re-armed, and
    their first traffic migrates them again."""
    fabric_dir, ckpt_dir, steps, hold = tmp_path / "fabric", tmp_path / "ckpt", RING_STEPS, Hold(tmp_path)
    record, _ = start_fabric(fabric_dir)
    try:
        taken, fault = RING.checkpoint_at, RING.checkpoint_at + 200
        pauses = Pauses(tmp_path, taken, fault)
        env = {"CKPT_FABRIC": record["address"], "CKPT_FABRIC_TOKEN": record["token"], **hold.env, **pauses.env}
        job = _launch(start_job, ckpt_dir, steps, env=env)
        pauses.wait(taken)
        take(ckpt_dir, "--wait")
        pauses.open(taken)
        pauses.wait(fault)
        lids = _lids(fabric_dir, job)[2]
        _link(fabric_dir, lids[0], up=False)
        pauses.open(fault)
        wait_for(lambda: _apm(job, 2).get("migrations_automatic", 0) >= 1, 60, "the migration before the kill")
        job.kill()
        wait_for(lambda: not _hcas(fabric_dir), 30, "the killed ranks' HCAs to leave the fabric")
        again = start_job("restart", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
        wait_for(lambda: _apm(again, 2).get("migrations_automatic", 0) >= 1, 60, "the migration after the restart")
        node = next(h for h in _hcas(fabric_dir) if h["node"] == "rank2")
        assert node["lids"] == lids and [p["up"] for p in node["ports"]] == [False, True], node
        hold.release()
        assert again.wait() == 0, again.stderr
        assert results(again.stdout) == RING.expect(steps)
    finally:
        kill_pids([record["pid"]])


@pytest.mark.parametrize(
    ("index", "protocol"),
    [
        pytest.param(i, ("async", "onesided")[i % 2], marks=[] if i < IN_CI else [pytest.mark.stress])
        for i in range(RUNS)
    ],
)
def test_a_dsm_program_gives_numpys_answer_across_a_link_failure(
    index: int, protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """Jacobi paused at a random step; a random rank's port 1 fails; it goes on, its QPs (the DSM's, made
    through ckpt_ib like any program's) on their alternate paths, and ends with the uninterrupted answer.
    Ten runs, the protocols alternating (the first in CI)."""
    case = next(c for c in DSM_CASES if c.name == "jacobi")
    rng = random.Random(SEED + 100 + index)
    victim, at = rng.randint(0, RANKS - 1), rng.randint(5, 40)
    label = f"seed {SEED + 100 + index} (CKPT_TEST_SEED={SEED}): jacobi/{protocol}, rank {victim} port 1 at step {at}"
    ckpt_dir, hold, pauses = tmp_path / "ckpt", Hold(tmp_path), Pauses(tmp_path, at)
    env = {PROGRAM_ENV: case.name, **hold.env, **pauses.env}
    argv = [str(PROGRAMS / "dsm_held.py"), *case.long]
    options = ("--dsm-protocol", protocol, "--apm", "auto")
    job = start_job(*launch_args(ckpt_dir, argv, *options), ckpt_dir=ckpt_dir, extra_env=env)
    pauses.wait(at)
    _link(ckpt_dir, _lids(ckpt_dir, job)[victim][0], up=False)
    pauses.open(at)
    wait_for(lambda: _apm(job, victim).get("migrations_automatic", 0) >= 1, 60, f"{label}: a migration")
    hold.release()
    assert job.wait() == 0, f"{label}\n{job.stderr}"
    assert results(job.stdout) == uninterrupted(case, protocol), label
