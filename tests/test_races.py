"""Races between the rank runtime and the coordinator's checkpoint wire.

Most tests drive an in-process coordinator with raw rank connections, so the
order in which messages arrive is exactly the order the test sends them: no
sleeps. Two tests build a bare `RankEngine` (a fake coordinator client) and force
one thread interleaving by holding the engine's condition variable. One is
end-to-end through the CLI.

Each test pins down one interleaving; most were found as bugs in review (a
finished rank checkpointed before its result existed, a stale `_parked` across
back-to-back checkpoints, a --kill joining after the commit point, ...).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt import _wire as wire
from ckpt.coordinator.client import CoordinatorClient, control
from ckpt.coordinator.server import Coordinator
from ckpt.runtime import images
from ckpt.runtime.rank import RankEngine
from ckpt.testing import Job, results, wait_for

pytestmark = pytest.mark.timeout(60)

TOKEN = "race-token-0123456789"
WAIT = 5.0
#: The program a fake rank says it runs: what a rank sends, and a manifest records, of it.
PROGRAM = {"name": "p", "path": "/p.py", "class": "P", "sha256": ""}


# ----------------------------------------------------------------- raw ranks
class Rank:
    """One rank connection spoken to frame by frame; pushes and replies are kept apart."""

    def __init__(self, address: str, rank: int, size: int, **extra: Any) -> None:
        host, port = wire.parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=WAIT)
        challenge = wire.recv(self.sock)
        wire.send(self.sock, {"op": "hello", "auth": wire.auth_answer(TOKEN, challenge["nonce"]), "role": "rank"})
        join = {"op": "join", "rank": rank, "size": size, "pid": 1000 + rank, "host": "h", "program": PROGRAM}
        wire.send(self.sock, {**join, **extra})
        self.welcome = self._next_message()
        assert self.welcome["op"] == "welcome", self.welcome
        self.rank = rank
        self.pushes: list[dict[str, Any]] = []
        self._replies: dict[int, dict[str, Any]] = {}
        self._ids = iter(range(1, 1_000_000))

    def send(self, op: str, **fields: Any) -> int:
        rid = next(self._ids)
        wire.send(self.sock, {"op": op, "id": rid, **fields})
        return rid

    def _next_message(self) -> dict[str, Any]:
        while (message := wire.recv(self.sock))["op"] == "heartbeat":
            pass
        return message

    def _read_one(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        message = self._next_message()
        if message["op"] == "reply":
            self._replies[message["id"]] = message
        else:
            self.pushes.append(message)

    def reply(self, rid: int, timeout: float = WAIT) -> dict[str, Any]:
        while rid not in self._replies:
            self._read_one(timeout)
        return self._replies.pop(rid)

    def push(self, op: str, timeout: float = WAIT) -> dict[str, Any]:
        """The first not yet consumed push `op` (read from the socket if needed)."""
        while True:
            for i, message in enumerate(self.pushes):
                if message["op"] == op:
                    return self.pushes.pop(i)
            self._read_one(timeout)

    def drain_pushes(self, timeout: float = 0.3) -> list[str]:
        """Every push not yet consumed and every one that arrives within the next `timeout` s; their ops (consumed).

        A window, not a wait for silence: the coordinator's heartbeats never let a connection fall silent (a
        wait for silence lasted until the coordinator dropped this heartbeat-less rank, 15 s later).
        """
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                message = wire.recv(self.sock)
                if message["op"] == "reply":
                    self._replies[message["id"]] = message
                elif message["op"] != "heartbeat":
                    self.pushes.append(message)
        except (TimeoutError, EOFError, OSError):
            pass
        ops = [m["op"] for m in self.pushes]
        self.pushes.clear()
        return ops

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.reply(self.send(op, **fields))

    def barrier(self, name: str, value: Any = None) -> int:
        return self.send("barrier", name=name, value=value)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coordinator(make_coordinator: Callable[..., Coordinator]) -> Coordinator:
    return make_coordinator()


@pytest.fixture
def join() -> Iterator[Callable[..., Rank]]:
    made: list[Rank] = []

    def make(coord: Coordinator, rank: int, size: int, **extra: Any) -> Rank:
        made.append(Rank(coord.address, rank, size, **extra))
        return made[-1]

    yield make
    for rank in made:
        rank.close()


@pytest.fixture
def ctl(coordinator: Coordinator) -> Iterator[CoordinatorClient]:
    client = control(coordinator.address, TOKEN)
    yield client
    client.close()


def image_value(rank: int, number: int) -> dict[str, Any]:
    return {"file": f"ckpt_p_{rank}_{number}.ckpt", "bytes": 0, "sha256": "", "seconds": 0.0, "step": 0}


def all_at(ranks: list[Rank], name: str, values: Callable[[Rank], Any] | None = None) -> list[dict[str, Any]]:
    """Every rank arrives at barrier `name` (in rank order); returns the replies."""
    ids = [r.barrier(name, values(r) if values else None) for r in ranks]
    return [r.reply(rid) for r, rid in zip(ranks, ids, strict=True)]


def reach(r: Rank, *, finished: bool = False) -> dict[str, Any]:
    return {"reach": 0, "finished": finished, "step": 0}


def walk_to_checkpoint(ranks: list[Rank], number: int, finished: Callable[[Rank], bool] = lambda r: False) -> None:
    """reach, PRESUSPEND, DRAIN for everyone (no aborts expected)."""
    for answer in all_at(ranks, f"ckpt{number}:REACH", lambda r: reach(r, finished=finished(r))):
        assert "abort" not in answer and "error" not in answer, answer
    for phase in ("PRESUSPEND", "DRAIN"):
        for answer in all_at(ranks, f"ckpt{number}:{phase}", lambda r: {"step": 0}):
            assert "abort" not in answer and "error" not in answer, answer


# ----------------------------------------------------------------- coordinator: bugs
def test_a_checkpoint_queued_during_a_restart_does_not_start_on_an_ended_job(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    restart = {"job": "j1", "generation": 0, "number": 1, "id_counters": {}}
    ranks = [join(coordinator, r, 2, restart=restart, step=5, finished=True, result=f"r{r}") for r in range(2)]
    answer = ctl.call("checkpoint", reply_timeout=WAIT)  # queued: the job is restarting
    assert answer["queued"] is True
    for phase in ("RESTART", "REFRESH", "RESUME"):
        all_at(ranks, f"gen1:{phase}")
    assert coordinator.outcome is not None and coordinator.outcome["status"] == "finished"
    pushed = [ranks[0].push("done")["op"], *ranks[0].drain_pushes()]
    # a job that has ended must not have a checkpoint in progress, nor tell its ranks to suspend after "done"
    assert coordinator.status()["checkpoint_in_progress"] is None
    assert "suspend" not in pushed


def test_an_image_report_that_does_not_fit_the_manifest_aborts_the_checkpoint(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    ranks = [join(coordinator, r, 2) for r in range(2)]
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    walk_to_checkpoint(ranks, 1)
    bad = {**image_value(1, 1), "bytes": "ten"}
    answers = all_at(ranks, "ckpt1:CHECKPOINT", lambda r: bad if r.rank == 1 else image_value(0, 1))
    for answer in answers:
        assert "rank 1's image report does not fit the manifest" in answer["abort"], answer
        assert "$.bytes" in answer["abort"], answer
        assert "\n" not in answer["abort"]
    assert coordinator.status()["last_checkpoint"] is None and coordinator.outcome is None  # the job goes on
    assert not list(coordinator.job.settings.ckpt_dir.glob("*.json"))


def test_checkpoint_kill_joining_a_checkpoint_past_its_commit_point_kills_the_job(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    ranks = [join(coordinator, r, 2) for r in range(2)]
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    walk_to_checkpoint(ranks, 1)
    answers = all_at(ranks, "ckpt1:CHECKPOINT", lambda r: image_value(r.rank, 1))
    assert all(a["kill"] is False and a["manifest"] for a in answers), answers
    # `ckpt checkpoint --kill` now: it joins checkpoint 1 and is told so
    assert ctl.call("checkpoint", reply_timeout=WAIT, kill=True)["number"] == 1
    all_at(ranks, "ckpt1:RESUME")
    outcome = coordinator.outcome
    assert outcome is not None and outcome["status"] == "killed", (outcome, coordinator.status()["message"])


def test_kill_during_a_checkpoint_aborts_it_and_removes_its_images(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient, tmp_path: Path
) -> None:
    ranks = [join(coordinator, r, 2) for r in range(2)]
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    walk_to_checkpoint(ranks, 1)
    (tmp_path / "ckpt_p_0_1.ckpt").write_bytes(b"half an image")  # rank 0 wrote its image ...
    ranks[0].barrier("ckpt1:CHECKPOINT", image_value(0, 1))  # ... and waits for rank 1
    ctl.call("kill", reply_timeout=WAIT)
    assert ranks[0].push("kill")
    coordinator.remove_aborted_images()  # what the launcher does once the ranks are reaped
    assert coordinator.status()["checkpoint_in_progress"] is None
    assert not (tmp_path / "ckpt_p_0_1.ckpt").exists(), "the killed checkpoint left its image behind"


def test_a_killed_checkpoint_does_not_push_aborts_into_the_next_job(
    make_coordinator: Callable[..., Coordinator], join: Callable[..., Rank]
) -> None:
    """The phase timer of a checkpoint killed with its job (see the bug above) outlives the job under
    `ckpt coordinator`; when it fires into the next job it pushes nothing there: the old Job's _live()
    is empty once its ranks have disconnected."""
    coord = make_coordinator(phase_timeout=1.0, serve_forever=True)
    ranks = [join(coord, r, 2) for r in range(2)]
    ctl = control(coord.address, TOKEN)
    try:
        assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
        all_at(ranks, "ckpt1:REACH", reach)
        ctl.call("kill", reply_timeout=WAIT)
    finally:
        ctl.close()
    for r in ranks:
        r.push("kill")
        r.close()
    wait_until(lambda: coord.outcome is None, "the coordinator to start the next job")
    fresh = [join(coord, r, 2) for r in range(2)]
    pushed = fresh[0].drain_pushes(timeout=2.5)  # well past the old checkpoint's 1 s phase timeout
    assert "abort" not in pushed, f"the next job's rank got {pushed}"


@pytest.mark.timeout(30)
def test_stuck_check_sees_ranks_parked_in_a_presuspend_plugin_barrier(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    ranks = [join(coordinator, r, 2) for r in range(2)]
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    all_at(ranks, "ckpt1:REACH", reach)
    # rank 0 parked, runs ckpt_presuspend, whose plugin waits for its peers
    plugin = ranks[0].barrier("ckpt1:plugin:sync")
    # rank 1 is still catching up and blocks in a collective rank 0 enters only in a later step
    ranks[1].send("collective", seq=1, kind="allgather", step=0, data=b"x")
    answer = ranks[0].reply(plugin, timeout=WAIT)
    assert "abort" in answer and "not step-aligned" in answer["abort"], answer


@pytest.mark.timeout(30)
def test_a_plugin_barrier_does_not_confuse_the_phase_timeout_message(
    make_coordinator: Callable[..., Coordinator], join: Callable[..., Rank]
) -> None:
    coord = make_coordinator(phase_timeout=0.5)
    ranks = [join(coord, r, 2) for r in range(2)]
    ctl = control(coord.address, TOKEN)
    try:
        assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    finally:
        ctl.close()
    all_at(ranks, "ckpt1:REACH", reach)
    all_at(ranks, "ckpt1:PRESUSPEND", lambda r: {"step": 0})
    all_at(ranks, "ckpt1:plugin:counts")  # a plugin's barrier inside ckpt_drain, on every rank
    answer = ranks[0].reply(ranks[0].barrier("ckpt1:DRAIN"), timeout=WAIT)  # rank 1 never finishes DRAIN
    message = answer["abort"]
    assert "rank 1" in message and "rank 0" not in message and "finish DRAIN" in message, message


def test_a_kill_checkpoint_of_finished_ranks_does_not_also_push_done(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    ranks = [join(coordinator, r, 2) for r in range(2)]
    ranks[0].call("finished", result="r0", step=3)
    assert ctl.call("checkpoint", reply_timeout=WAIT, kill=True)["number"] == 1
    all_at(ranks, "ckpt1:REACH", lambda r: reach(r, finished=r.rank == 0))
    ranks[1].call("finished", result="r1", step=3)  # rank 1 finishes its last step while parking
    for phase in ("PRESUSPEND", "DRAIN"):
        all_at(ranks, f"ckpt1:{phase}", lambda r: {"step": 3})
    answers = all_at(ranks, "ckpt1:CHECKPOINT", lambda r: image_value(r.rank, 1))
    assert all(a["kill"] for a in answers), answers  # the ranks exit on their own after ckpt_checkpointed
    assert "done" not in ranks[0].drain_pushes(), "'done' races the ranks' checkpointed and exit hooks"
    outcome = coordinator.outcome
    assert outcome is not None and outcome["status"] == "killed", outcome


# ----------------------------------------------------------------- coordinator: interleavings that work
def test_a_latecomer_at_an_aborted_checkpoint_does_not_disturb_the_next_one(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    """Rank 1 is still in a hook of aborted checkpoint 1 while rank 0 already waits at checkpoint 2's
    reach barrier: its DRAIN arrival is answered at once, is no name mismatch, and abort 1 is pushed
    before suspend 2 on the one connection."""
    ranks = [join(coordinator, r, 2) for r in range(2)]
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    all_at(ranks, "ckpt1:REACH", reach)
    all_at(ranks, "ckpt1:PRESUSPEND", lambda r: {"step": 0})
    ranks[0].call("abort_checkpoint", number=1, reason="rank 0: plugin x failed in ckpt_drain")
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 2
    waiting = ranks[0].barrier("ckpt2:REACH", reach(ranks[0]))
    late = ranks[1].reply(ranks[1].barrier("ckpt1:DRAIN"))  # rank 1 leaves its slow ckpt_drain hook
    assert "checkpoint 1 was aborted" in late["abort"]
    assert [m["op"] for m in ranks[1].pushes[:3]] == ["suspend", "abort", "suspend"]
    assert [m["number"] for m in ranks[1].pushes[:3]] == [1, 1, 2]
    # a late `abort_checkpoint` for checkpoint 1 (from rank 1's error path) must not touch checkpoint 2
    ranks[1].call("abort_checkpoint", number=1, reason="rank 1: late")
    done = ranks[1].reply(ranks[1].barrier("ckpt2:REACH", reach(ranks[1])))
    assert "abort" not in done and "error" not in done, done
    assert "abort" not in ranks[0].reply(waiting)
    assert coordinator.status()["checkpoint_in_progress"] == 2


def test_a_checkpoint_requested_during_a_restart_starts_after_its_resume(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    restart = {"job": "j1", "generation": 0, "number": 1, "id_counters": {}}
    ranks = [join(coordinator, r, 2, restart=restart, step=5) for r in range(2)]
    answer = ctl.call("checkpoint", reply_timeout=WAIT)
    assert answer["number"] == 0 and answer["queued"] is True  # numbered when it starts
    for phase in ("RESTART", "REFRESH"):
        all_at(ranks, f"gen1:{phase}")
        assert coordinator.status()["checkpoint_in_progress"] is None
    assert ranks[0].drain_pushes(timeout=0.1) == []
    all_at(ranks, "gen1:RESUME")
    assert ranks[0].push("suspend")["number"] == 2
    assert coordinator.status()["checkpoint_in_progress"] == 2


def test_a_checkpoint_requested_before_a_restarted_job_joins_does_not_reuse_an_old_number(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    """Before the first rank joins, the coordinator does not know the restarted job's last
    checkpoint (5 here): a request then must not be numbered 1 and overwrite checkpoint 1."""
    answer = ctl.call("checkpoint", reply_timeout=WAIT)
    assert answer["queued"] is True
    restart = {"job": "j1", "generation": 2, "number": 5, "id_counters": {}}
    ranks = [join(coordinator, r, 2, restart=restart, step=5) for r in range(2)]
    for phase in ("RESTART", "REFRESH", "RESUME"):
        all_at(ranks, f"gen3:{phase}")
    assert ranks[0].push("suspend")["number"] == 6


def _until(condition: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the coordinator never got there"
        threading.Event().wait(0.005)


def test_a_rank_finishing_while_others_wait_at_presuspend_triggers_the_stuck_check(
    coordinator: Coordinator, join: Callable[..., Rank], ctl: CoordinatorClient
) -> None:
    """Rank 2 is blocked in a collective that rank 1 will enter no more: rank 1 finishes after
    rank 0 parked. The finish completes the picture, and the coordinator aborts instead of hanging."""
    ranks = [join(coordinator, r, 3) for r in range(3)]
    assert ctl.call("checkpoint", reply_timeout=WAIT)["number"] == 1
    all_at(ranks, "ckpt1:REACH", reach)
    parked = ranks[0].barrier("ckpt1:PRESUSPEND", {"step": 1})
    _until(lambda: 0 in coordinator.job._barriers.get("ckpt1:PRESUSPEND", {}))  # three connections:
    coll = ranks[2].send("collective", seq=1, kind="allgather", step=0, data=b"x")  # force the order
    _until(lambda: 2 in coordinator.job._collectives.get(1, {}))
    ranks[1].call("finished", result="r1", step=1)
    assert "abort" in ranks[0].reply(parked)
    assert "error" in ranks[2].reply(coll)  # rank 1 finished without entering it: it can never complete


# ----------------------------------------------------------------- rank engine: forced interleavings
class _FakeClient:
    """Answers the engine's barrier calls: the other rank reports `peer_reach`."""

    def __init__(self) -> None:
        self.peer_reach = 0
        self.finished: list[dict[str, Any]] = []

    def call(self, op: str, reply_timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        if op == "finished":
            self.finished.append(fields)
            return {}
        assert op == "barrier", op
        if fields["name"].endswith(":REACH"):
            peer = {"reach": self.peer_reach, "finished": False, "step": self.peer_reach}
            return {"values": [fields["value"], peer]}
        return {"values": [fields["value"], None]}

    def notify(self, op: str, **fields: Any) -> None:
        pass


class _Steps:
    """A program of `n` steps; `result()` can be made slow."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0
        self.in_result = threading.Event()
        self.let_result_return = threading.Event()
        self.let_result_return.set()

    def step(self, rt: Any) -> bool:
        self.i += 1
        return self.i < self.n

    def result(self) -> str:
        self.in_result.set()
        assert self.let_result_return.wait(WAIT)
        return f"i={self.i}"


def bare_engine(program: _Steps) -> RankEngine:
    """A RankEngine with only what the program loop and the checkpoint handshake use."""
    engine = RankEngine.__new__(RankEngine)
    engine.rank, engine.size, engine.native = 0, 2, False
    engine.step, engine.finished, engine.result = 0, False, None
    engine._cv = threading.Condition()
    engine._hold, engine._target, engine._parked = False, None, False
    engine._in_step = engine._in_setup = False
    engine._aborted = set()
    engine._last_step_report = 0.0
    engine.client = _FakeClient()  # type: ignore[assignment]
    engine.program = program  # type: ignore[assignment]
    engine.rt = None  # type: ignore[assignment]
    return engine


def start_program_thread(engine: RankEngine) -> threading.Thread:
    thread = threading.Thread(target=engine._loop, name="program", daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_back_to_back_checkpoints_park_at_the_new_target() -> None:
    program = _Steps(50)
    engine = bare_engine(program)
    client: _FakeClient = engine.client  # type: ignore[assignment]
    with engine._cv:  # hold the program thread at boundary 0 until the target is known
        engine._hold = True
    thread = start_program_thread(engine)
    try:
        client.peer_reach = 2
        with engine._cv:
            engine._hold = False
        engine._park(1)  # checkpoint 1: the peer is in step 1, the target is boundary 2
        assert engine._parked and engine.step == engine._target == 2
        # checkpoint 1 ends and checkpoint 2 is already queued (an interval or rt.checkpoint() racing the
        # end of checkpoint 1). The checkpoint thread wins _cv back before the program thread wakes up:
        with engine._cv:
            engine._release()
            client.peer_reach = 3  # the peer's program thread did get going: it is in step 2
            engine._park(2)
            assert engine.step == engine._target, (
                f"checkpoint 2 goes on with the program at step {engine.step}, its target is {engine._target}"
            )
    finally:
        engine._release()
        thread.join(WAIT)


def test_park_waits_for_a_rank_that_must_run_to_the_target() -> None:
    """The plain case: a rank between steps, target above it, runs on and parks exactly there."""
    program = _Steps(50)
    engine = bare_engine(program)
    client: _FakeClient = engine.client  # type: ignore[assignment]
    with engine._cv:
        engine._hold = True
    thread = start_program_thread(engine)
    try:
        client.peer_reach = 7
        engine._park(1)
        assert engine._parked and engine.step == 7 and program.i == 7
    finally:
        engine._release()
        thread.join(WAIT)
    assert client.finished and client.finished[0]["step"] == 50


def test_a_welcome_asking_for_the_first_image_holds_the_program_at_boundary_0() -> None:
    """Under recover the job's first checkpoint must be at step 0 however late its request reaches this rank
    (a loaded machine): with the welcome's `first_image` the program waits at boundary 0 for the target."""
    stepped = threading.Event()

    class Watched(_Steps):
        def step(self, rt: Any) -> bool:
            stepped.set()
            return super().step(rt)

    program = Watched(50)
    engine = bare_engine(program)
    engine.image_header = None
    engine._hold_for_first_image({"first_image": True})
    client: _FakeClient = engine.client  # type: ignore[assignment]
    thread = start_program_thread(engine)
    try:
        # the program thread stays at boundary 0 while no target is known: the late request finds it there
        assert not stepped.wait(0.3), "step 0 ran before the first checkpoint's target was known"
        client.peer_reach = 0
        engine._park(1)
        assert engine._parked and engine.step == engine._target == 0 and program.i == 0
    finally:
        engine._release()
        thread.join(WAIT)
    assert client.finished and client.finished[0]["step"] == 50


def test_a_welcome_without_the_first_image_lets_the_program_run() -> None:
    program = _Steps(5)
    engine = bare_engine(program)
    engine.image_header = None
    engine._hold_for_first_image({"first_image": False})
    start_program_thread(engine).join(WAIT)
    assert program.i == 5


@pytest.mark.timeout(30)
def test_a_finished_rank_is_not_checkpointed_before_its_result_is_known() -> None:
    program = _Steps(3)
    program.let_result_return.clear()  # a result() that takes a while
    engine = bare_engine(program)
    thread = start_program_thread(engine)
    try:
        assert program.in_result.wait(WAIT)
        parked = threading.Thread(target=engine._park, args=(1,), daemon=True)
        parked.start()
        parked.join(0.5)
        # _park must not consider the rank parked while its program thread still runs result()
        assert parked.is_alive(), (
            f"the checkpoint would now pickle the program: finished={engine.finished} result={engine.result!r}"
        )
    finally:
        program.let_result_return.set()
        engine._release()
        thread.join(WAIT)


# ----------------------------------------------------------------- end to end
SLOW_RESULT = '''
"""One rank, three steps; result() takes a while (it waits for a file the test writes)."""

import time
from pathlib import Path

import ckpt


class SlowResult(ckpt.Program):
    def setup(self, rt):
        self.marks = Path(rt.argv[0])
        self.i = 0

    def step(self, rt):
        self.i += 1
        return self.i < 3

    def result(self):
        (self.marks / "in_result").touch()
        deadline = time.monotonic() + 30
        while not (self.marks / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"i={self.i}"
'''


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_checkpoint_during_result_keeps_the_result(start_job: Callable[..., Job], tmp_path: Path) -> None:
    program = tmp_path / "slowresult.py"
    program.write_text(SLOW_RESULT)
    marks = tmp_path / "marks"
    marks.mkdir()
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "1", "--ckpt-dir", str(ckpt_dir), str(program), str(marks))
    wait_for(lambda: (marks / "in_result").exists(), 60, "the rank to be in result()")
    taken = start_job("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir)

    def requested() -> bool:
        state = job.poll_status() or {}
        return state.get("checkpoint_in_progress") is not None or bool(state.get("last_checkpoint"))

    wait_for(requested, 60, "the coordinator to start the checkpoint")
    (marks / "go").touch()  # only now may result() return: the checkpoint was asked for while it ran
    assert taken.wait(timeout=60) == 0, taken.stderr
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == {0: "i=3"}
    header = images.read_header(ckpt_dir / "ckpt_slowresult_0_1.ckpt")
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir))
    assert again.wait() == 0, again.stderr
    assert (header.finished, header.result, results(again.stdout)) == (True, "i=3", {0: "i=3"})


# ----------------------------------------------------------------- helpers
def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        tick.wait(0.01)


@pytest.mark.timeout(30)
def test_a_restart_phase_that_takes_too_long_fails_the_job(
    make_coordinator: Callable[..., Coordinator], join: Callable[..., Rank]
) -> None:
    coord = make_coordinator(phase_timeout=0.5)
    restart = {"job": "j1", "generation": 0, "number": 1, "id_counters": {}}
    ranks = [join(coord, r, 2, restart=restart, step=5) for r in range(2)]
    ranks[0].barrier("gen1:RESTART")  # rank 1 never gets there (stuck loading its image, say)
    assert coord.ended.wait(10), "the restart hung"
    outcome = coord.outcome
    assert outcome is not None and outcome["status"] == "failed"
    assert "rank(s) [1] did not reach RESTART within 0.5 s" in outcome["message"]
