"""The coordinator's side of independent checkpoints (`ckpt checkpoint --rank`, `--rank-interval`).

An in-process coordinator and raw rank connections (test_races.Rank), so every
message arrives in the order the test sends it: no sleeps.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_races import TOKEN, WAIT, Rank, all_at, image_value, reach, walk_to_checkpoint

from ckpt import _manifest as manifests
from ckpt._errors import CoordinatorError
from ckpt._wire import Heartbeat
from ckpt.coordinator.client import CoordinatorClient, control
from ckpt.coordinator.server import Coordinator

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coordinator(make_coordinator: Callable[..., Coordinator]) -> Coordinator:
    return make_coordinator()


@pytest.fixture
def ranks(coordinator: Coordinator) -> Iterator[list[Rank]]:
    made = [Rank(coordinator.address, r, 3) for r in range(3)]
    yield made
    for rank in made:
        rank.close()


@pytest.fixture
def ctl(coordinator: Coordinator) -> Iterator[CoordinatorClient]:
    client = control(coordinator.address, TOKEN)
    yield client
    client.close()


def scope(rank: int, number: int) -> str:
    return f"rank{rank}.ckpt{number}"


def walk_alone(r: Rank, number: int, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank `r` walks independent checkpoint `number` to its end; returns the CHECKPOINT barrier's answer."""
    push = r.push("suspend")
    assert (push["number"], push["independent"]) == (number, True), push
    for phase in ("REACH", "PRESUSPEND", "DRAIN"):
        answer = r.call("barrier", name=f"{scope(r.rank, number)}:{phase}", value=reach(r))
        assert "abort" not in answer and "error" not in answer, answer
    value = report if report is not None else image_value(r.rank, number)
    answer = r.call("barrier", name=f"{scope(r.rank, number)}:CHECKPOINT", value=value)
    if "abort" not in answer:
        assert r.call("barrier", name=f"{scope(r.rank, number)}:RESUME")["values"][r.rank] is None
    return answer


def coordinated(all_ranks: list[Rank], number: int) -> None:
    for r in all_ranks:
        push = r.push("suspend")
        assert (push["number"], push["independent"]) == (number, False), push
    walk_to_checkpoint(all_ranks, number)
    all_at(all_ranks, f"ckpt{number}:CHECKPOINT", lambda r: image_value(r.rank, number))
    all_at(all_ranks, f"ckpt{number}:RESUME")


def ask(ctl: CoordinatorClient, **fields: Any) -> tuple[int, bool]:
    answer = ctl.call("checkpoint", reply_timeout=WAIT, **fields)
    return answer["number"], answer["queued"]


def manifest(directory: Path, number: int) -> dict[str, Any]:
    return dict(json.loads((directory / manifests.manifest_name("p", number)).read_text()))


def touch_images(directory: Path, number: int, *ranks: int) -> None:
    for rank in ranks:
        (directory / manifests.image_name("p", rank, number)).write_bytes(b"image")


def test_one_rank_checkpoints_alone_and_the_manifest_names_every_ranks_latest_image(
    coordinator: Coordinator, ranks: list[Rank], ctl: CoordinatorClient, tmp_path: Path
) -> None:
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    coordinated(ranks, 1)
    touch_images(tmp_path, 1, 0, 1, 2)
    assert ask(ctl, rank=1) == (2, False)
    state = coordinator.status()
    assert state["independent_in_progress"] == {"rank": 1, "number": 2, "stage": "reach"}
    reply = walk_alone(ranks[1], 2)
    assert reply["kill"] is False and reply["manifest"].endswith("ckpt_p_2.json")
    written = manifest(tmp_path, 2)
    assert written["kind"] == "rank" and written["number"] == 2
    assert [(e["rank"], e["file"], e.get("number")) for e in written["ranks"]] == [
        (0, "ckpt_p_0_1.ckpt", 1),
        (1, "ckpt_p_1_2.ckpt", None),
        (2, "ckpt_p_2_1.ckpt", 1),
    ]
    assert manifests.latest_manifest(tmp_path).name == "ckpt_p_1.json"  # a whole-job restart still uses 1
    state = coordinator.status()
    assert [r["latest_image"] for r in state["ranks"]] == [1, 2, 1]
    assert state["independent_in_progress"] is None and state["last_checkpoint"]["number"] == 1
    assert state["last_rank_checkpoint"]["rank"] == 1 and state["last_rank_checkpoint"]["number"] == 2
    # the other ranks were told nothing
    assert ranks[0].drain_pushes(0.2) == [] and ranks[2].drain_pushes(0.2) == []


def test_a_rank_without_an_earlier_image_gets_a_manifest_of_its_own_image_only(
    coordinator: Coordinator, ranks: list[Rank], ctl: CoordinatorClient, tmp_path: Path
) -> None:
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=2)["number"] == 1
    walk_alone(ranks[2], 1)
    assert [e["rank"] for e in manifest(tmp_path, 1)["ranks"]] == [2]
    assert not (tmp_path / manifests.LATEST).exists()
    assert [r["latest_image"] for r in coordinator.status()["ranks"]] == [None, None, 1]


def test_a_coordinated_checkpoint_waits_for_the_independent_one_and_counts_for_every_rank(
    coordinator: Coordinator, ranks: list[Rank], ctl: CoordinatorClient
) -> None:
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=0)["number"] == 1
    assert ask(ctl) == (0, True)
    assert ranks[1].drain_pushes(0.2) == []  # not while rank 0 is inside its own
    walk_alone(ranks[0], 1)
    coordinated(ranks, 2)
    assert [r["latest_image"] for r in coordinator.status()["ranks"]] == [2, 2, 2]


def test_independent_ones_asked_for_during_a_coordinated_one_are_queued_and_run_one_at_a_time(
    coordinator: Coordinator, ranks: list[Rank], ctl: CoordinatorClient
) -> None:
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    assert ask(ctl, rank=2) == (0, True)
    assert ask(ctl, rank=0) == (0, True)
    assert ask(ctl, rank=2) == (0, True)  # joins it
    assert coordinator.status()["independent_queued"] == [2, 0]
    coordinated(ranks, 1)
    walk_alone(ranks[2], 2)
    assert ranks[2].drain_pushes(0.2) == []  # asked for twice, taken once
    walk_alone(ranks[0], 3)
    # a request for the rank in progress joins it
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=1)["number"] == 4
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=1)["number"] == 4
    walk_alone(ranks[1], 4)
    assert ranks[1].drain_pushes(0.2) == []


def test_wait_replies_once_written(coordinator: Coordinator, ranks: list[Rank], tmp_path: Path) -> None:
    client = control(coordinator.address, TOKEN)
    try:
        replies: list[dict[str, Any]] = []
        thread = threading.Thread(
            target=lambda: replies.append(client.call("checkpoint", reply_timeout=WAIT * 4, rank=1, wait=True))
        )
        thread.start()
        walk_alone(ranks[1], 1)
        thread.join(WAIT * 4)
        last = replies[0]["checkpoint"]
        assert last["rank"] == 1 and last["number"] == 1 and last["manifest"] == str(tmp_path / "ckpt_p_1.json")
    finally:
        client.close()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rank": 7}, r"there is no rank 7: the job has ranks 0\.\.2"),
        ({"rank": 1, "kill": True}, "--kill cannot go with --rank"),
    ],
)
def test_bad_requests_are_one_line(
    ranks: list[Rank], ctl: CoordinatorClient, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(CoordinatorError, match=match):
        ctl.call("checkpoint", reply_timeout=WAIT, **fields)


def test_a_native_job_refuses_independent_checkpoints(coordinator: Coordinator) -> None:
    r = Rank(coordinator.address, 0, 1, native=True)
    client = control(coordinator.address, TOKEN)
    try:
        with pytest.raises(CoordinatorError, match="--native"):
            client.call("checkpoint", reply_timeout=WAIT, rank=0)
    finally:
        client.close()
        r.close()


def test_a_failed_image_aborts_that_checkpoint_only_and_keeps_the_previous_image(
    coordinator: Coordinator, ranks: list[Rank], ctl: CoordinatorClient, tmp_path: Path
) -> None:
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=1)["number"] == 1
    walk_alone(ranks[1], 1)
    touch_images(tmp_path, 1, 1)
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=1)["number"] == 2
    touch_images(tmp_path, 2, 1)  # written, then the report says it failed
    answer = walk_alone(ranks[1], 2, report={"error": "cannot pickle the program state: x"})
    assert "independent checkpoint 2 of rank 1 could not be written" in answer["abort"]
    assert ranks[1].push("abort")["number"] == 2
    assert not (tmp_path / "ckpt_p_1_2.ckpt").exists() and not (tmp_path / "ckpt_p_2.json").exists()
    assert (tmp_path / "ckpt_p_1_1.ckpt").exists()
    state = coordinator.status()
    assert state["ranks"][1]["latest_image"] == 1 and state["ranks"][1]["state"] == "running"
    assert coordinator.outcome is None
    assert manifests.rank_image(tmp_path, "p", 1, token=TOKEN.encode())[1] == 1


def test_a_plugin_failure_on_the_rank_aborts_it_and_a_latecomer_is_released(
    coordinator: Coordinator, ranks: list[Rank], ctl: CoordinatorClient
) -> None:
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=0)["number"] == 1
    ranks[0].push("suspend")
    assert "abort" not in ranks[0].call("barrier", name=f"{scope(0, 1)}:REACH", value=reach(ranks[0]))
    ranks[0].call("abort_checkpoint", number=1, reason="rank 0: a plugin failed")
    assert "a plugin failed" in ranks[0].push("abort")["reason"]
    late = ranks[0].call("barrier", name=f"{scope(0, 1)}:PRESUSPEND", value={"step": 0})
    assert "aborted" in late["abort"]
    # the next one runs
    assert ctl.call("checkpoint", reply_timeout=WAIT, rank=0)["number"] == 2
    walk_alone(ranks[0], 2)


def test_a_phase_timeout_aborts_it_and_the_queued_coordinated_one_starts(
    make_coordinator: Callable[..., Coordinator],
) -> None:
    coord = make_coordinator(phase_timeout=0.5)
    ranks = [Rank(coord.address, r, 2) for r in range(2)]
    client = control(coord.address, TOKEN)
    try:
        assert client.call("checkpoint", reply_timeout=WAIT, rank=1)["number"] == 1
        assert client.call("checkpoint", reply_timeout=WAIT)["queued"] is True
        ranks[1].push("suspend")  # ... and never parks
        abort = ranks[1].push("abort", timeout=WAIT)
        assert "rank 1 (near step 0) did not park at its step boundary within 0.5 s" in abort["reason"]
        coordinated(ranks, 2)
        assert coord.outcome is None
    finally:
        client.close()
        for r in ranks:
            r.close()


def test_a_rank_lost_during_its_checkpoint_fails_the_job_and_the_waiter_hears(
    coordinator: Coordinator, ranks: list[Rank], tmp_path: Path
) -> None:
    client = control(coordinator.address, TOKEN)
    errors: list[str] = []

    def ask() -> None:
        try:
            client.call("checkpoint", reply_timeout=WAIT * 4, rank=2, wait=True)
        except CoordinatorError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=ask)
    thread.start()
    try:
        ranks[2].push("suspend")
        ranks[2].call("barrier", name=f"{scope(2, 1)}:REACH", value=reach(ranks[2]))
        touch_images(tmp_path, 1, 2)
        ranks[2].close()  # lost
        thread.join(WAIT * 4)
        assert len(errors) == 1 and "checkpoint 1 of rank 2 aborted: rank 2 (pid 1002 on h) was lost" in errors[0]
        outcome = coordinator.outcome
        assert outcome is not None and outcome["status"] == "failed"
        assert "rank 2" in outcome["message"]
        coordinator.remove_aborted_images()
        assert not (tmp_path / "ckpt_p_2_1.ckpt").exists()
    finally:
        client.close()


def test_rank_interval_checkpoints_each_rank_in_turn(make_coordinator: Callable[..., Coordinator]) -> None:
    # its ranks are the test's, which send no heartbeats: idle while the other walks, on a loaded machine
    # (pytest -n 5) one was declared lost after the default 15 s of silence
    coord = make_coordinator(rank_interval=0.4, heartbeat=Heartbeat(interval=1.0, timeout=300.0))
    ranks = [Rank(coord.address, r, 2) for r in range(2)]
    try:
        started = time.monotonic()
        walk_alone(ranks[1], 1)  # due at S/2
        walk_alone(ranks[0], 2)  # due at S
        walk_alone(ranks[1], 3)  # due at 3S/2
        assert time.monotonic() - started >= 0.6
        assert [r["latest_image"] for r in coord.status()["ranks"]] == [2, 3]
        recorded = manifest(coord.job.settings.ckpt_dir, 3)["settings"]
        assert recorded["rank_interval"] == 0.4
    finally:
        for r in ranks:
            r.close()


def test_a_restarted_job_starts_from_its_checkpoints_images_and_drops_later_rank_manifests(
    make_coordinator: Callable[..., Coordinator], tmp_path: Path
) -> None:
    first = make_coordinator()
    ranks = [Rank(first.address, r, 2) for r in range(2)]
    client = control(first.address, TOKEN)
    try:
        assert ask(client) == (1, False)
        coordinated(ranks, 1)
        touch_images(tmp_path, 1, 0, 1)
        assert ask(client, rank=0) == (2, False)
        walk_alone(ranks[0], 2)
        touch_images(tmp_path, 2, 0)
        job = first.job.job_id
    finally:
        client.close()
        for r in ranks:
            r.close()
    first.stop()
    assert (tmp_path / "ckpt_p_2.json").exists()
    again = make_coordinator()
    restart = {"job": job, "generation": 0, "number": 1, "id_counters": {}}
    ranks = [Rank(again.address, r, 2, restart=restart) for r in range(2)]
    try:
        for phase in ("RESTART", "REFRESH", "RESUME"):
            all_at(ranks, f"gen1:{phase}")
        # checkpoint 2 was of the rolled-back run: rank 0's latest image is checkpoint 1's again
        assert not (tmp_path / "ckpt_p_2.json").exists() and not (tmp_path / "ckpt_p_0_2.ckpt").exists()
        assert [r["latest_image"] for r in again.status()["ranks"]] == [1, 1]
        client = control(again.address, TOKEN)
        try:
            assert ask(client, rank=1) == (3, False)  # numbers go on past the abandoned one
        finally:
            client.close()
        walk_alone(ranks[1], 3)
        assert [(e["file"], e.get("number")) for e in manifest(tmp_path, 3)["ranks"]] == [
            ("ckpt_p_0_1.ckpt", 1),
            ("ckpt_p_1_3.ckpt", None),
        ]
    finally:
        for r in ranks:
            r.close()
