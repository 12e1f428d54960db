"""rt.fall_back and rt.hold_checkpoints at the coordinator (ckpt/coordinator/_recovery.py), in-process over TCP.

Ranks are coordinator clients walking the protocol by hand (test_recovery's `Rank`): a rank that asks for a
whole-job restart ends the job with the outcome "fallback" (the launcher's cue), or fails it in one line; a
rank that holds checkpoints keeps every kind of them queued until it releases them or is lost; the replay
progress a rank publishes shows in the status.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_recovery import TOKEN, WAIT, Rank, lose, status, walk_checkpoint

from ckpt.coordinator import protocol
from ckpt.coordinator._recovery import MAX_RECOVERY_ATTEMPTS
from ckpt.coordinator.client import control
from ckpt.coordinator.server import Coordinator
from ckpt.plugin import RANKS_NS

pytestmark = pytest.mark.timeout(60)

REASON = "rank 1 failed together with its log home rank 2 (its logs are gone)"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path).start()
    yield coord
    coord.stop()


@pytest.fixture
def respawned(coordinator: Coordinator) -> queue.SimpleQueue[tuple[int, int, int]]:
    """A launcher is there (respawns are only recorded)."""
    asked: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
    coordinator.set_respawn(lambda rank, incarnation, number: asked.put((rank, incarnation, number)))
    return asked


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as executor:
        yield executor


@pytest.fixture
def join(coordinator: Coordinator) -> Iterator[Callable[..., Rank]]:
    made: list[Rank] = []

    def make(rank: int, size: int = 3, **extra: Any) -> Rank:
        made.append(Rank(coordinator, rank, size, **{"on_failure": "recover", **extra}))
        return made[-1]

    yield make
    for r in made:
        r.client.close()


def started(pool: ThreadPoolExecutor, join: Callable[..., Rank], **extra: Any) -> list[Rank]:
    """Three ranks past the checkpoint taken as soon as they joined (under recover: number 1)."""
    ranks = [join(r, **extra) for r in range(3)]
    walk_checkpoint(pool, ranks, 1, 0)
    return ranks


def ask(coordinator: Coordinator, rank: int, **fields: Any) -> dict[str, Any]:
    client = control(coordinator.address, TOKEN)
    try:
        answer = client.call("checkpoint", reply_timeout=WAIT, **({"rank": rank} if rank >= 0 else {}), **fields)
        return {k: answer[k] for k in ("number", "queued")}
    finally:
        client.close()


def ended(coordinator: Coordinator) -> dict[str, Any]:
    assert coordinator.ended.wait(WAIT)
    assert coordinator.outcome is not None
    return coordinator.outcome


# ----------------------------------------------------------------- rt.fall_back
def test_a_fallback_ends_the_job_for_a_restart_from_the_newest_coordinated_checkpoint(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join)
    ranks[1].client.call("fall_back", reply_timeout=WAIT, reason=REASON)
    outcome = ended(coordinator)
    assert (outcome["status"], outcome["number"], outcome["rank"], outcome["reason"]) == ("fallback", 1, 1, REASON)
    assert outcome["message"] == f"rank 1 cannot go on alone: {REASON}; restarting the whole job from checkpoint 1"
    # a second rank asking, or a rank lost meanwhile (the launcher kills them all), changes nothing
    ranks[2].client.call("fall_back", reply_timeout=WAIT, reason="another reason")
    lose(coordinator, ranks[0])
    assert coordinator.outcome is outcome and outcome["rank"] == 1 and respawned.empty()
    assert status(coordinator)["fallbacks"] == {"count": 1, "rank": 1, "reason": REASON, "number": 1}


def restarted(coordinator: Coordinator, join: Callable[..., Rank], number: int = 1) -> list[Rank]:
    """What the launcher does after a fallback: a fresh job on the same coordinator, its ranks restarting."""
    coordinator.next_job()
    last = {"number": number, "manifest": "", "bytes": 3, "seconds": 0.0}
    restart = {"job": "", "generation": 0, "number": number, "id_counters": {}, "last_checkpoint": last}
    return [join(r, restart=restart) for r in range(3)]


def test_fallbacks_without_a_checkpoint_in_between_are_bounded_and_a_checkpoint_resets_the_bound(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join)
    for count in range(1, MAX_RECOVERY_ATTEMPTS):
        ranks[count % 3].client.call("fall_back", reply_timeout=WAIT, reason=f"reason {count}")
        assert ended(coordinator)["status"] == "fallback"
        ranks = restarted(coordinator, join)
        st = status(coordinator)
        assert st["state"] != "fallback" and st["generation"] == 1  # the restart from checkpoint 1's generation 0
        assert st["fallbacks"] == {"count": count, "rank": count % 3, "reason": f"reason {count}", "number": 1}
    ranks[0].client.call("fall_back", reply_timeout=WAIT, reason="once too often")
    outcome = ended(coordinator)
    assert outcome["status"] == "failed"
    assert outcome["message"] == (
        f"rank 0 cannot go on alone: once too often; a whole-job restart was asked for {MAX_RECOVERY_ATTEMPTS} "
        f"times with no checkpoint committed in between (limit {MAX_RECOVERY_ATTEMPTS}); the latest checkpoint is 1"
    )
    coordinator.fallback_failed("unused")  # the launcher's call applies to a "fallback" outcome only
    assert coordinator.outcome is outcome and outcome["status"] == "failed"


def test_a_checkpoint_committed_between_fallbacks_is_progress(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join)
    for number in range(1, MAX_RECOVERY_ATTEMPTS + 2):
        ranks[1].client.call("fall_back", reply_timeout=WAIT, reason="again")
        outcome = ended(coordinator)
        assert (outcome["status"], outcome["number"]) == ("fallback", number)
        ranks = restarted(coordinator, join, number)
        walk_restart(pool, ranks, coordinator.job.generation)
        assert ask(coordinator, -1)["number"] == number + 1
        walk_checkpoint(pool, ranks, number + 1, 0)
    assert status(coordinator)["fallbacks"]["count"] == MAX_RECOVERY_ATTEMPTS + 1


def walk_restart(pool: ThreadPoolExecutor, ranks: list[Rank], generation: int) -> None:
    from ckpt.plugin import Phase

    for phase in Phase.restart_sequence():
        futures = [pool.submit(rank.barrier, phase.barrier(f"gen{generation}")) for rank in ranks]
        for future in futures:
            assert "abort" not in future.result(WAIT)


def test_under_abort_a_fallback_fails_the_job_with_its_reason(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    ranks = [join(r, on_failure="abort") for r in range(3)]
    assert ask(coordinator, -1)["number"] == 1
    walk_checkpoint(pool, ranks, 1, 0)
    ranks[2].client.call("fall_back", reply_timeout=WAIT, reason=REASON)
    outcome = ended(coordinator)
    assert outcome["status"] == "failed"
    assert outcome["message"] == f"rank 2 cannot go on alone: {REASON}; the latest checkpoint is 1"
    for rank in ranks:  # every rank is told to stop
        assert rank.push("kill")["reason"] == outcome["message"]


def test_a_fallback_without_a_launcher_or_without_a_checkpoint_fails_the_job(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    ranks = started(pool, join)  # no respawn callback: a standalone coordinator
    ranks[0].client.call("fall_back", reply_timeout=WAIT, reason=REASON)
    assert ended(coordinator)["message"] == (
        f"rank 0 cannot go on alone: {REASON}; restart the whole job from checkpoint 1 (ckpt restart)"
    )


def test_a_fallback_before_any_checkpoint_fails_the_job(
    coordinator: Coordinator, join: Callable[..., Rank], respawned: queue.SimpleQueue[tuple[int, int, int]]
) -> None:
    ranks = [join(r) for r in range(3)]
    ranks[0].push("suspend")  # the post-setup checkpoint has started; it is aborted
    ranks[0].client.call("fall_back", reply_timeout=WAIT, reason=REASON)
    outcome = ended(coordinator)
    assert (outcome["status"], outcome["message"]) == (
        "failed",
        f"rank 0 cannot go on alone: {REASON}; the job has no coordinated checkpoint to restart from",
    )


# ----------------------------------------------------------------- rt.hold_checkpoints
def test_checkpoints_of_every_kind_wait_while_a_rank_holds_them(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    ranks = started(pool, join)
    ranks[1].client.call("hold_checkpoints", reply_timeout=WAIT, reason="rank 1 is replaying its logs")
    ranks[2].client.call("hold_checkpoints", reply_timeout=WAIT, reason="rank 2 too")
    assert ask(coordinator, 0) == {"number": 0, "queued": True}
    assert ask(coordinator, -1) == {"number": 0, "queued": True}
    st = status(coordinator)
    assert st["checkpoint_holds"] == [
        {"rank": 1, "reason": "rank 1 is replaying its logs"},
        {"rank": 2, "reason": "rank 2 too"},
    ]
    assert st["checkpoint_in_progress"] is None and st["independent_in_progress"] is None
    assert st["independent_queued"] == [0]
    ranks[1].client.call("release_checkpoints", reply_timeout=WAIT)
    ranks[1].client.call("release_checkpoints", reply_timeout=WAIT)  # twice: a no-op
    assert status(coordinator)["checkpoint_in_progress"] is None  # rank 2 still holds
    ranks[2].client.call("release_checkpoints", reply_timeout=WAIT)
    # the coordinated one asked for goes first, then rank 0's own
    walk_checkpoint(pool, ranks, 2, 0)
    assert protocol.parse_push(ranks[0].push("suspend")) == protocol.Suspend(number=3, independent=True)
    assert status(coordinator)["checkpoint_holds"] == []


def test_a_holder_that_is_lost_releases_its_hold(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join)
    ranks[1].client.call("hold_checkpoints", reply_timeout=WAIT, reason="replaying")
    assert ask(coordinator, 2)["queued"]
    lose(coordinator, ranks[1])
    assert status(coordinator)["checkpoint_holds"] == []
    # rank 2's checkpoint still waits: rank 1 is away; the hold is not what keeps it any more
    assert respawned.get(timeout=WAIT) == (1, 1, 1)
    assert coordinator.job.recovery.checkpoints_wait() and not coordinator.job.recovery.holds


# ----------------------------------------------------------------- replay progress
def test_the_replay_progress_a_rank_publishes_is_in_the_status_until_it_is_lost(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join)
    assert [r["replay"] for r in status(coordinator)["ranks"]] == [None, None, None]
    ranks[1].client.call("publish", reply_timeout=WAIT, ns=RANKS_NS, key="replay/1", value=[12, 40])
    ranks[2].client.call("publish", reply_timeout=WAIT, ns=RANKS_NS, key="replay/2", value="not progress")
    assert [r["replay"] for r in status(coordinator)["ranks"]] == [None, [12, 40], None]
    lose(coordinator, ranks[1])
    assert status(coordinator)["ranks"][1]["replay"] is None


# ----------------------------------------------------------------- the doubles
def test_the_runtime_doubles_record_fallbacks_and_holds() -> None:
    from ckpt.plugin import Runtime
    from ckpt.testing import FakeRuntime, ThreadGroup, ThreadRuntime

    rt = FakeRuntime()
    assert isinstance(rt, Runtime) and isinstance(ThreadRuntime(ThreadGroup(1), 0), Runtime)
    rt.hold_checkpoints("replaying")
    assert rt.held == "replaying"
    rt.release_checkpoints()
    rt.fall_back(REASON)  # returns (a real rank is stopped): the code under test returns right after
    assert (rt.holds, rt.releases, rt.held, rt.fall_backs) == (["replaying"], 1, None, [REASON])


def test_status_text_shows_holds_replay_progress_and_fallbacks(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ckpt._cli_control import _print_status

    ranks = started(pool, join)
    ranks[1].client.call("hold_checkpoints", reply_timeout=WAIT, reason="rank 1 is replaying its logs")
    ranks[1].client.call("publish", reply_timeout=WAIT, ns=RANKS_NS, key="replay/1", value=[12, 40])
    ranks[2].client.call("publish", reply_timeout=WAIT, ns=RANKS_NS, key="replay/2", value=[40, 40])
    coordinator.job.recovery.fallbacks.count = 2  # as after two whole-job restarts
    coordinator.job.recovery.fallbacks.rank, coordinator.job.recovery.fallbacks.number = 1, 1
    coordinator.job.recovery.fallbacks.reason = REASON
    _print_status(status(coordinator))
    lines = capsys.readouterr().out.splitlines()
    assert [line.endswith("replaying 12/40") for line in lines[1:4]] == [False, True, False]  # 40/40: it is done
    assert "checkpoints held by rank 1: rank 1 is replaying its logs" in lines
    assert f"whole-job fallbacks: 2, the last from checkpoint 1 (rank 1: {REASON})" in lines
