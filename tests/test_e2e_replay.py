"""End-to-end: DSM ranks killed -9 under `--on-failure recover --logging remote` recover alone, by replay.

Through the CLI with ckpt_ib loaded, on both DSM protocols: a rank of SOR, TSP,
Water or IS is killed at a random moment, or mid-lock, mid-barrier or mid-diff
(tests/programs/plugins/ckpt_dsmkill.py kills it from inside at the Nth call of a
DSM hook).  Every run ends with the uninterrupted answer, the other ranks keep
their processes, and the recovered rank's statistics show that it replayed:
acquires and barriers answered from its log (no message to a lock home or the
barrier manager for them) and minimal-version pages where it faulted.  Two
concurrent failures of ranks that are not each other's log home recover the
same way; a rank killed with its log home makes the job restart whole from the
coordinated checkpoint, in one line.  A kill mid-diff with rings small enough to
fill many times afterwards shows their owners' discards pass the dead space it
leaves.  CI runs five kills (every program, both protocols, the three targeted
moments, a random one and the tiny rings), the same job without
one (the control) and a check of the kill plugin; the campaign of the issue
(32 + 10 runs, the fallback) is marked stress.  The seed of a random run
is in its failure message: CKPT_TEST_SEED=<seed> replays the campaign.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from dsm_cases import PROTOCOLS
from dsm_util import run_ranks
from ib_cases import random_seed
from replay_util import (
    CASES,
    MARK_ENV,
    PROGRAM,
    PROGRAM_ENV,
    RANKS,
    STATS_ENV,
    Kill,
    ReplayRun,
    non_adjacent_pair,
    random_kills,
    run_falling_back,
    run_recovering,
)

import dsm
from ckpt.testing import Job, ThreadRuntime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SEED = random_seed()
NAMES = sorted(CASES)


def _label(seed: int, what: str) -> str:
    return f"seed {seed} (CKPT_TEST_SEED={SEED} replays this campaign): {what}"


# ----------------------------------------------------------------- CI: four runs, a few seconds each
def test_a_rank_killed_at_a_random_moment_recovers_by_replay(start_job: Callable[..., Job], tmp_path: Path) -> None:
    rng = random.Random(SEED)
    case, victim = CASES["sor"], rng.randrange(RANKS)
    kills = [Kill(victim, step=rng.randint(6, case.steps * 3 // 4))]  # >= 10 barriers to replay: it must fault
    run_recovering(start_job, tmp_path, case, "async", kills, _label(SEED, f"sor/async, kill {kills[0]}"))


@pytest.mark.parametrize(
    ("name", "protocol", "kill"),
    [
        ("tsp", "onesided", Kill(2, hook="dsm_lock_acquired", n=5)),  # holding the lock, its notices not logged
        ("water", "onesided", Kill(1, hook="dsm_barrier_arriving", n=7)),  # its arrival neither logged nor sent
        ("isort", "async", Kill(3, hook="dsm_diff_sent", n=12)),  # some diffs of an interval home, others not
        # a critical section's `+=` at its home, its acquire's record not: applied twice if that were possible
        ("water", "async", Kill(2, hook="dsm_diff_sent_in_lock", n=9)),
    ],
    ids=["mid-lock", "mid-barrier", "mid-diff", "mid-critical-section"],
)
def test_a_rank_killed_mid_operation_recovers_by_replay(
    name: str, protocol: str, kill: Kill, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    run_recovering(start_job, tmp_path, CASES[name], protocol, [kill], f"{name}/{protocol}, kill {kill}")


def test_a_dead_writers_hole_does_not_keep_a_log_ring_from_emptying(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """Rank 3 killed mid-diff: reservations of its interval in other ranks' log rings are never written.  With
    rings so small that each fills many times in the rest of the run, their owners' discards must pass that
    dead space (docs/remotelog.md, "Dead holes"); a discard that stops at it leaves the ring full for good, and
    its writers fail after 60 s (which this run did before the claim words: "the log ring of rank 0 at rank 1
    is full and rank 0 did not checkpoint within 60 s").  Rings of 256 KiB hold about two steps of IS: smaller
    ones fill within one step, and a writer waiting for room can block its ring's owner at a barrier."""
    stats = run_recovering(
        start_job,
        tmp_path,
        CASES["isort"],
        "async",
        [Kill(3, hook="dsm_diff_sent", n=12)],
        "isort/async, tiny rings, kill rank 3 mid-diff",
        options=("--log-ring-bytes", "262144"),
    )
    assert sum(s["log_full_checkpoints"] for s in stats.values()) > 0  # the rings did fill and were emptied


@pytest.mark.stress  # suite time: the CI runs check numpy's answer and the replay counters themselves
def test_without_a_fault_nobody_replays_and_the_answer_is_the_uninterrupted_one(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """The control of the campaign: the same job, nobody killed."""
    run = ReplayRun(start_job, tmp_path, CASES["isort"], "onesided", "isort/onesided, no kill")
    run.launch([])
    first = {r["rank"]: r["pid"] for r in run.settled()["ranks"]}
    stats = run.wait_recovered([])
    run.finish()
    for rank, s in stats.items():
        assert (s["pid"], s["incarnation"], s["recovered"]) == (first[rank], 0, False), s
        assert s["replayed_acquires"] == s["replayed_barriers"] == s["regenerated_pages"] == s["versions_served"] == 0
        assert s["log_records"] > 0, s  # remote logging was on


# ----------------------------------------------------------------- the harness's dump of a hung run
def test_a_hung_runs_dump_shows_each_ranks_links_requests_and_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `ReplayRun.stacks` shows besides the stacks (SIGUSR2 in tests/programs/dsm_replayed.py), read from
    live memories: a request still waiting for its reply, where it stands, and the handler's queues."""
    monkeypatch.setenv(PROGRAM_ENV, "sor")  # dsm_held picks its program at import
    monkeypatch.syspath_prepend(str(PROGRAM.parent))
    replayed = importlib.import_module("dsm_replayed")

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> list[str]:
        if rt.rank == 0:
            mem.pending[99] = (1, None, mem.client.link[1])  # as `_send_request` files one
            try:
                return list(replayed._dsm_state(mem))
            finally:
                mem.pending.pop(99)
        return []

    lines = "\n".join(run_ranks(2, body, "async")[0])
    assert "client: state ['up', 'up'] link [0, 0]" in lines, lines
    assert "request 99 sent on link 0; the link to rank 1 is up, link 0" in lines, lines
    assert "waiting page requests (rank, rid, gid, need) []" in lines, lines
    assert "replay: none" in lines, lines


# ----------------------------------------------------------------- the harness's own plugin, under abort
@pytest.mark.stress  # the mid-operation tests use the same plugin in CI
def test_the_kill_plugin_kills_its_rank_at_the_nth_hook_after_the_first_checkpoint(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """ckpt_dsmkill, as the campaign uses it, in a job that does not recover: the rank dies there, once."""
    run = ReplayRun(start_job, tmp_path, CASES["sor"], "async", "kill plugin")
    env = {PROGRAM_ENV: "sor", STATS_ENV: str(run.stats_prefix), MARK_ENV: str(run.marks)}
    job = start_job(
        "launch", "-n", str(RANKS), "--ckpt-dir", str(run.ckpt_dir), "--logging", "remote", "--interval", "0.3",
        "--with-plugin", "ckpt_dsmkill", str(PROGRAM), *CASES["sor"].args,
        ckpt_dir=run.ckpt_dir, extra_env={**env, "CKPT_TEST_DSM_KILL": "dsm_barrier_arriving:2:5"},
    )  # fmt: skip
    assert job.wait(120) == 1
    mark = (run.marks / "killed.2").read_text()
    assert '"hook": "dsm_barrier_arriving", "n": 5' in mark, mark
    pid = mark.split('"pid": ')[1].split(",")[0]
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: rank 2 (pid {pid} on ") and "was lost" in line, job.stderr
    assert [p.name for p in run.marks.iterdir()] == ["killed.2"]


# ----------------------------------------------------------------- the campaign (stress)
@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(32))
def test_campaign_one_rank_killed_at_a_random_moment(index: int, start_job: Callable[..., Job], tmp_path: Path) -> None:
    seed = SEED + index
    rng = random.Random(seed)
    case, protocol = CASES[NAMES[index % len(NAMES)]], PROTOCOLS[(index // len(NAMES)) % len(PROTOCOLS)]
    kills = random_kills(rng, case, [rng.randrange(RANKS)])
    run_recovering(start_job, tmp_path, case, protocol, kills, _label(seed, f"{case}/{protocol}, kill {kills[0]}"))


@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(10))
def test_campaign_two_non_adjacent_ranks_killed_at_once(
    index: int, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    seed = SEED + 1000 + index
    rng = random.Random(seed)
    case, protocol = CASES[NAMES[index % len(NAMES)]], PROTOCOLS[index % len(PROTOCOLS)]
    kills = random_kills(rng, case, non_adjacent_pair(rng))
    what = f"{case}/{protocol}, kill {' and '.join(map(str, kills))}"
    run_recovering(start_job, tmp_path, case, protocol, kills, _label(seed, what))


@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "protocol"), [("sor", "async"), ("water", "onesided"), ("isort", "onesided")])
def test_a_rank_killed_with_its_log_home_restarts_the_whole_job_in_one_line(
    name: str, protocol: str, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    seed = SEED + 2000 + NAMES.index(name)
    rng = random.Random(seed)
    case = CASES[name]
    rank, step = rng.randrange(RANKS), rng.randint(2, case.steps // 2)
    line = run_falling_back(start_job, tmp_path, case, protocol, rank, step, _label(seed, f"{name}/{protocol}"))
    assert "restarting the whole job from checkpoint" in line, line
