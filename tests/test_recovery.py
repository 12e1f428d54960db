"""Single-rank recovery at the coordinator (ckpt/coordinator/_recovery.py), in-process over loopback TCP.

Ranks are coordinator clients that walk the protocol by hand: the checkpoint
taken right after every rank joined, a rank lost (its connection closed), its
next incarnation rejoining and walking its own phases, the record of collectives.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckpt._errors import CoordinatorError
from ckpt.coordinator import protocol
from ckpt.coordinator._recovery import MAX_RECOVERY_ATTEMPTS
from ckpt.coordinator.client import CoordinatorClient, control
from ckpt.coordinator.server import Coordinator
from ckpt.plugin import RANKS_NS, Phase

pytestmark = pytest.mark.timeout(60)

TOKEN = "recovery-token-0123456789"
WAIT = 5.0
PROGRAM = {"name": "p", "path": "/p.py", "class": "P", "sha256": ""}


class Rank:
    """One rank's client and the pushes it received."""

    def __init__(self, coordinator: Coordinator, rank: int, size: int, **extra: Any) -> None:
        self.rank = rank
        self.pushes: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        hello = {"role": "rank", "rank": rank, "size": size, "pid": 1000 + rank, "host": "h", "program": PROGRAM}
        self.client = CoordinatorClient(coordinator.address, TOKEN, {**hello, **extra}, on_push=self.pushes.put)

    def push(self, op: str) -> dict[str, Any]:
        """The next push of kind `op` (others before it are skipped)."""
        while True:
            message = self.pushes.get(timeout=WAIT)
            if message["op"] == op:
                return message

    def collective(self, seq: int, data: Any, kind: str = "allgather") -> dict[str, Any]:
        return self.client.call("collective", reply_timeout=WAIT, seq=seq, kind=kind, step=seq, data=data)

    def barrier(self, name: str, value: Any = None) -> dict[str, Any]:
        return self.client.call("barrier", reply_timeout=WAIT, name=name, value=value)


@pytest.fixture
def coordinator(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    """A coordinator; parametrize it indirectly with a phase timeout (s) to shorten it."""
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path, phase_timeout=getattr(request, "param", 300.0)).start()
    yield coord
    coord.stop()


@pytest.fixture
def respawned(coordinator: Coordinator) -> queue.SimpleQueue[tuple[int, int, int]]:
    """What the coordinator asks the launcher to respawn: (rank, incarnation, checkpoint of its image)."""
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


def status(coordinator: Coordinator) -> dict[str, Any]:
    client = control(coordinator.address, TOKEN)
    try:
        return client.call("status", reply_timeout=WAIT)["status"]
    finally:
        client.close()


def walk_checkpoint(pool: ThreadPoolExecutor, ranks: list[Rank], number: int, coll_seq: int) -> None:
    """Every rank walks checkpoint `number`'s phases, reporting an image taken after collective `coll_seq`."""
    for rank in ranks:
        assert rank.push("suspend")["number"] == number
    for phase in Phase.checkpoint_sequence():
        values: dict[Phase, Any] = {
            Phase.REACH: {"reach": coll_seq, "finished": False, "step": coll_seq},
            Phase.PRESUSPEND: {"step": coll_seq},
        }
        futures = []
        for rank in ranks:
            value = values.get(phase)
            if phase is Phase.CHECKPOINT:
                value = {"file": f"ckpt_p_{rank.rank}_{number}.ckpt", "bytes": 1, "step": coll_seq}
                value |= {"coll_seq": coll_seq}
            futures.append(pool.submit(rank.barrier, phase.barrier(f"ckpt{number}"), value))
        for future in futures:
            assert "abort" not in future.result(WAIT)


def allgather(pool: ThreadPoolExecutor, ranks: list[Rank], seq: int) -> list[Any]:
    futures = [pool.submit(rank.collective, seq, f"{rank.rank}@{seq}") for rank in ranks]
    answers = [future.result(WAIT)["values"] for future in futures]
    assert all(answer == answers[0] for answer in answers)
    return answers[0]


def started(pool: ThreadPoolExecutor, join: Callable[..., Rank], coordinator: Coordinator) -> list[Rank]:
    """Three ranks under recover, past the checkpoint taken as soon as they joined (at collective 0)."""
    ranks = [join(r) for r in range(3)]
    walk_checkpoint(pool, ranks, 1, 0)
    assert status(coordinator)["last_checkpoint"]["number"] == 1
    return ranks


def rejoin(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    rank: int,
    incarnation: int,
    size: int = 3,
    job: str = "",
    number: int = 1,
) -> Rank:
    """Rank `rank` rejoins as `incarnation` with its image of checkpoint `number` (of `job`: the running one's)."""
    restart = {"number": number, "job": job or coordinator.job.job_id}
    return join(rank, size, recover={"incarnation": incarnation}, restart=restart)


def lose(coordinator: Coordinator, rank: Rank) -> None:
    """Close the rank's connection (as a killed process's closes) and wait until the coordinator notices."""
    rank.client.close()
    deadline = time.monotonic() + WAIT
    tick = threading.Event()
    while not (coordinator.outcome is not None or status(coordinator)["ranks"][rank.rank]["state"] == "failed"):
        assert time.monotonic() < deadline, f"rank {rank.rank} was not marked failed"
        tick.wait(0.01)


# ----------------------------------------------------------------- losing a rank
def test_a_lost_rank_is_failed_announced_and_respawned_while_the_job_runs_on(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    r0, r1, r2 = started(pool, join, coordinator)
    lose(coordinator, r1)
    assert respawned.get(timeout=WAIT) == (1, 1, 1)
    for survivor in (r0, r2):
        assert protocol.parse_push(survivor.push("rank_failed")) == protocol.RankFailed(rank=1, incarnation=0)
    assert r0.client.call("get", reply_timeout=WAIT, ns=RANKS_NS, key="failed/1")["value"] == 0
    st = status(coordinator)
    assert st["state"] == "running" and coordinator.outcome is None  # the job is alive
    assert [(r["state"], r["incarnation"]) for r in st["ranks"]] == [("running", 0), ("failed", 0), ("running", 0)]
    assert (
        "rank 1 (pid 1001 on h) was lost at step 0; respawning it from checkpoint 1 as incarnation 1" in (st["message"])
    )


def test_every_welcome_before_the_first_checkpoint_asks_to_hold_at_the_first_boundary(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    """The first image is taken at step 0 however late its request reaches a rank: each welcome says to hold
    there (`first_image`), until that checkpoint is taken -- not for a rejoin, which has an image."""
    ranks = started(pool, join, coordinator)
    assert [r.client.welcome["first_image"] for r in ranks] == [True, True, True]
    lose(coordinator, ranks[1])
    assert rejoin(coordinator, join, 1, 1).client.welcome["first_image"] is False


def test_under_abort_no_welcome_asks_to_hold(coordinator: Coordinator, join: Callable[..., Rank]) -> None:
    assert join(0, size=2, on_failure="abort").client.welcome["first_image"] is False


def test_a_rank_lost_before_the_first_checkpoint_fails_the_job(
    coordinator: Coordinator, join: Callable[..., Rank], respawned: queue.SimpleQueue[tuple[int, int, int]]
) -> None:
    ranks = [join(r) for r in range(3)]
    ranks[2].client.close()
    assert coordinator.ended.wait(WAIT)
    assert coordinator.outcome is not None and coordinator.outcome["status"] == "failed"
    assert "before the job's first checkpoint: it has no image to recover from" in coordinator.outcome["message"]
    assert respawned.empty()


def test_without_a_launcher_the_coordinator_waits_for_restart_rank(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    ranks = started(pool, join, coordinator)
    lose(coordinator, ranks[2])
    assert "waiting for `ckpt restart --rank 2`" in status(coordinator)["message"]


# ----------------------------------------------------------------- rejoining
def test_only_the_next_incarnation_of_a_failed_rank_may_rejoin(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    _, r1, _ = started(pool, join, coordinator)
    with pytest.raises(CoordinatorError, match=r"rank 0 of job \w+ has not failed"):
        rejoin(coordinator, join, 0, 1)
    lose(coordinator, r1)
    with pytest.raises(CoordinatorError, match="rank 1 rejoins as incarnation 2; its next incarnation is 1"):
        rejoin(coordinator, join, 1, 2)
    with pytest.raises(CoordinatorError, match="with an image of job 0123456789ab"):
        rejoin(coordinator, join, 1, 1, job="0123456789ab")
    with pytest.raises(CoordinatorError, match="has already joined"):
        join(1)  # a launch, not a recovery
    back = rejoin(coordinator, join, 1, 1)
    st = status(coordinator)
    assert [(r["state"], r["incarnation"]) for r in st["ranks"]][1] == ("recovering", 1)
    assert back.client.welcome["generation"] == 0


def test_a_job_not_under_recover_refuses_a_rejoin(coordinator: Coordinator, join: Callable[..., Rank]) -> None:
    join(0, size=2, on_failure="abort")
    with pytest.raises(CoordinatorError, match="does not run under --on-failure recover"):
        rejoin(coordinator, join, 1, 1, size=2)


def test_a_recovered_rank_walks_its_own_phases_alone_and_the_survivors_hear_of_it(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    r0, r1, r2 = started(pool, join, coordinator)
    lose(coordinator, r1)
    back = rejoin(coordinator, join, 1, respawned.get(timeout=WAIT)[1])
    # a checkpoint asked for meanwhile waits until the rank is back
    asked = control(coordinator.address, TOKEN)
    try:
        assert asked.call("checkpoint", reply_timeout=WAIT)["queued"] is True
    finally:
        asked.close()
    scope = Phase.rank_scope(1, "inc1")
    back.barrier(Phase.RESTART.barrier(scope))  # completes with rank 1 alone
    for survivor in (r0, r2):
        assert protocol.parse_push(survivor.push("rank_recovered")) == protocol.RankRecovered(rank=1, incarnation=1)
    assert r0.client.call("get", reply_timeout=WAIT, ns=RANKS_NS, key="incarnation/1")["value"] == 1
    back.barrier(Phase.REFRESH.barrier(scope))
    assert status(coordinator)["ranks"][1]["state"] == "recovering"
    back.barrier(Phase.RESUME.barrier(scope))
    st = status(coordinator)
    assert [r["state"] for r in st["ranks"]] == ["running"] * 3 and st["message"].startswith("checkpoint 2")
    walk_checkpoint(pool, [r0, back, r2], 2, 0)  # the queued checkpoint, now that every rank is back
    manifest = (Path(st["ckpt_dir"]) / "ckpt_p_2.json").read_text()
    assert '"on_failure":"recover"' in manifest.replace(" ", "")


def test_a_crash_loop_fails_the_job(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join, coordinator)
    lose(coordinator, ranks[0])
    for attempt in range(1, MAX_RECOVERY_ATTEMPTS + 1):
        rank, incarnation, number = respawned.get(timeout=WAIT)
        assert (rank, incarnation, number) == (0, attempt, 1)
        again = rejoin(coordinator, join, 0, incarnation)
        again.barrier(Phase.RESTART.barrier(Phase.rank_scope(0, f"inc{incarnation}")))
        again.client.close()  # lost again before its RESUME
    assert coordinator.ended.wait(WAIT)
    message = coordinator.outcome["message"]  # type: ignore[index]
    assert f"its recovery failed {MAX_RECOVERY_ATTEMPTS} times in a row" in message, message


# ----------------------------------------------------------------- collectives: record and replay
def test_collectives_a_recovered_rank_re_executes_are_answered_from_the_record(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    r0, r1, r2 = started(pool, join, coordinator)
    first = [allgather(pool, [r0, r1, r2], seq) for seq in (1, 2, 3)]
    pending: list[Future[dict[str, Any]]] = [pool.submit(r.collective, 4, f"{r.rank}@4") for r in (r0, r1, r2)[::2]]
    lose(coordinator, r1)
    back = rejoin(coordinator, join, 1, 1)
    # its image was taken at collective 0: 1..3 come from the record at once, without the survivors
    assert [back.collective(seq, "ignored")["values"] for seq in (1, 2, 3)] == first
    with pytest.raises(CoordinatorError, match="re-executes collective #2 as barrier; it was allgather"):
        back.collective(2, None, kind="barrier")
    assert not any(f.done() for f in pending)  # collective 4 waits for rank 1's next incarnation
    answer = back.collective(4, "1@4 again")["values"]
    assert answer == ["0@4", "1@4 again", "2@4"]
    assert [f.result(WAIT)["values"] for f in pending] == [answer, answer]


def test_the_record_keeps_only_what_a_latest_image_may_re_execute(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    ranks = started(pool, join, coordinator)
    for seq in (1, 2, 3):
        allgather(pool, ranks, seq)
    assert coordinator.job.recovery.recorded() == 3
    control_client = control(coordinator.address, TOKEN)
    try:
        control_client.call("checkpoint", reply_timeout=WAIT)
    finally:
        control_client.close()
    walk_checkpoint(pool, ranks, 2, 2)  # every image is past collective 2
    assert coordinator.job.recovery.recorded() == 1
    lose(coordinator, ranks[1])
    back = rejoin(coordinator, join, 1, 1, number=2)  # its latest image
    with pytest.raises(CoordinatorError, match="re-executes allgather #2, older than every rank's latest image"):
        back.collective(2, "x")
    assert back.collective(3, "x")["values"] == ["0@3", "1@3", "2@3"]


# ----------------------------------------------------------------- defects found in review
def checkpoint_again(coordinator: Coordinator, pool: ThreadPoolExecutor, ranks: list[Rank], number: int) -> None:
    """A coordinated checkpoint `number` asked for by hand, every image after collective 0."""
    asked = control(coordinator.address, TOKEN)
    try:
        asked.call("checkpoint", reply_timeout=WAIT)
    finally:
        asked.close()
    walk_checkpoint(pool, ranks, number, 0)


def test_the_image_a_rank_restarts_from_is_the_coordinators_and_no_other_is_admitted(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join, coordinator)
    checkpoint_again(coordinator, pool, ranks, 2)
    lose(coordinator, ranks[1])
    assert respawned.get(timeout=WAIT) == (1, 1, 2)  # the launcher is told which image: not left to guess
    assert status(coordinator)["ranks"][1]["latest_image"] == 2  # what `ckpt restart --rank 1` reads
    with pytest.raises(
        CoordinatorError, match="rank 1 rejoins from checkpoint 1; its latest image in this run is checkpoint 2"
    ):
        rejoin(coordinator, join, 1, 1, number=1)
    rejoin(coordinator, join, 1, 1, number=2)
    assert status(coordinator)["ranks"][1]["state"] == "recovering"


def test_a_job_whose_every_rank_is_failed_is_recovering_not_failed(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    only = join(0, size=1)
    walk_checkpoint(pool, [only], 1, 0)
    lose(coordinator, only)
    st = status(coordinator)
    assert (st["state"], st["ranks"][0]["state"]) == ("recovering", "failed") and coordinator.outcome is None
    back = rejoin(coordinator, join, 0, 1, size=1)
    assert status(coordinator)["state"] == "recovering"
    back.barrier(Phase.RESTART.barrier(Phase.rank_scope(0, "inc1")))


@pytest.mark.parametrize("coordinator", [0.5], indirect=True)
def test_an_incarnation_hung_in_its_own_phases_is_killed_and_counts_as_lost(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    ranks = started(pool, join, coordinator)
    lose(coordinator, ranks[1])
    assert respawned.get(timeout=WAIT) == (1, 1, 1)
    back = rejoin(coordinator, join, 1, 1)
    back.barrier(Phase.RESTART.barrier(Phase.rank_scope(1, "inc1")))
    # it hangs in REFRESH with its connection alive: the phase timeout gives up on it
    assert "rank 1 incarnation 1: it did not finish REFRESH within 0.5 s" in back.push("kill")["reason"]
    assert respawned.get(timeout=WAIT) == (1, 2, 1)  # one attempt used: the next incarnation
    st = status(coordinator)
    assert st["ranks"][1]["state"] == "failed" and coordinator.outcome is None
    assert "was lost while recovering as incarnation 1 (it did not finish REFRESH within 0.5 s)" in st["message"]
    again = rejoin(coordinator, join, 1, 2)  # a timely one recovers
    for phase in Phase.restart_sequence():
        again.barrier(phase.barrier(Phase.rank_scope(1, "inc2")))
    assert [r["state"] for r in status(coordinator)["ranks"]] == ["running"] * 3


def test_a_queued_independent_checkpoint_of_a_lost_rank_is_answered_not_carried_over(
    coordinator: Coordinator, join: Callable[..., Rank], pool: ThreadPoolExecutor
) -> None:
    ranks = started(pool, join, coordinator)
    asked = control(coordinator.address, TOKEN)
    waiting = control(coordinator.address, TOKEN)
    try:
        asked.call("checkpoint", reply_timeout=WAIT)  # a coordinated one in progress: rank 1's waits behind it
        for rank in ranks:
            rank.push("suspend")
        queued = pool.submit(waiting.call, "checkpoint", WAIT, wait=True, rank=1)
        deadline = time.monotonic() + WAIT
        while status(coordinator).get("independent_queued") != [1]:
            assert time.monotonic() < deadline, "rank 1's checkpoint was not queued"
            threading.Event().wait(0.01)
        lose(coordinator, ranks[1])
        with pytest.raises(CoordinatorError, match=r"rank 1 \(pid 1001 on h\) was lost .*checkpoint is dropped"):
            queued.result(WAIT)
        assert status(coordinator)["independent_queued"] == []
    finally:
        asked.close()
        waiting.close()


def test_survivors_reaching_a_committed_checkpoints_resume_after_the_lost_rank_recovered_are_released(
    coordinator: Coordinator,
    join: Callable[..., Rank],
    pool: ThreadPoolExecutor,
    respawned: queue.SimpleQueue[tuple[int, int, int]],
) -> None:
    """Rank 1 dies in checkpoint 2 after its manifest is written; its next incarnation recovers (its own phases)
    before the survivors reach checkpoint 2's RESUME barrier -- slow survivors: their RESUME hooks waited for
    it (the DSM reconnecting).  That barrier must not wait for rank 1 (CI hung there: once the recovery was over,
    the barrier counted every rank again)."""
    r0, r1, r2 = started(pool, join, coordinator)
    asked = control(coordinator.address, TOKEN)
    try:
        asked.call("checkpoint", reply_timeout=WAIT)
    finally:
        asked.close()
    for rank in (r0, r1, r2):
        assert rank.push("suspend")["number"] == 2
    for phase in Phase.checkpoint_sequence()[:-1]:  # every phase but RESUME: the checkpoint is committed
        values: dict[Phase, Any] = {Phase.REACH: {"reach": 0, "finished": False, "step": 0}, Phase.PRESUSPEND: {}}
        futures = []
        for rank in (r0, r1, r2):
            value = values.get(phase)
            if phase is Phase.CHECKPOINT:
                value = {"file": f"ckpt_p_{rank.rank}_2.ckpt", "bytes": 1, "step": 0, "coll_seq": 0}
            futures.append(pool.submit(rank.barrier, phase.barrier("ckpt2"), value))
        assert all("abort" not in future.result(WAIT) for future in futures)
    assert status(coordinator)["last_checkpoint"]["number"] == 2
    lose(coordinator, r1)
    _, incarnation, number = respawned.get(timeout=WAIT)
    assert number == 2
    back = rejoin(coordinator, join, 1, incarnation, number=2)
    scope = Phase.rank_scope(1, f"inc{incarnation}")
    for phase in Phase.restart_sequence():
        back.barrier(phase.barrier(scope))
    assert status(coordinator)["ranks"][1]["state"] == "running"  # recovered: no longer absent
    resumed = [pool.submit(rank.barrier, Phase.RESUME.barrier("ckpt2")) for rank in (r0, r2)]
    assert all("abort" not in future.result(WAIT) for future in resumed)
    assert [r["state"] for r in status(coordinator)["ranks"]] == ["running"] * 3
