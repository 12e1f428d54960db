"""The coordinator's TCP server: accepts ranks and control clients and dispatches their requests."""

# The accept loop, the handshake gate, the per-connection reader and writer
# threads, heartbeats and the graceful stop are the server base's
# (ckpt._server), shared with the subnet manager.  What is the coordinator's
# own: a rank first says who it is ("join"), each request is parsed into its
# typed form (protocol.parse_request) and handled under the coordinator's
# single lock, and a lost rank fails the job.  Requests that must wait
# (barriers, collectives, subscribe, checkpoint --wait) register a reply
# callback with the Job or the key-value store and return at once, so a rank's
# checkpoint thread and its program thread can both have requests outstanding
# on the one connection.  Replies and pushes go through the connection's
# outbox, so a client that stops reading can never block the coordinator while
# it holds its lock; a peer silent for the heartbeat timeout is lost, so a
# stopped or partitioned rank fails the job instead of hanging it (or, under
# --on-failure recover, is respawned: `set_respawn`, _recovery.py).

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt import _wire
from ckpt._errors import CkptError, CoordinatorError, ProtocolError
from ckpt._server import PeerConnection, Server
from ckpt.coordinator import protocol
from ckpt.coordinator._recovery import FallbackRecord, Respawn
from ckpt.coordinator._scheduler import Scheduler, Timer
from ckpt.coordinator.job import Job, JobSettings
from ckpt.coordinator.kvstore import Reply

log = logging.getLogger(__name__)


class _Connection(PeerConnection):
    def __init__(self, sock: socket.socket, peer: str, role: str, heartbeat: _wire.Heartbeat) -> None:
        super().__init__(sock, peer, thread_name=f"ckpt-coord-w-{peer}", heartbeat_interval=heartbeat.interval)
        self.role = role
        self.rank = -1

    def reply_to(self, rid: int | None) -> Reply:
        def reply(payload: dict[str, Any]) -> None:
            try:
                self.post({"op": "reply", "id": rid, **payload})
            except ProtocolError as exc:  # e.g. an allgather whose answer is over the frame limit
                self.post({"op": "reply", "id": rid, "error": str(exc)})

        return reply


class Coordinator(Server[_Connection]):
    """A coordinator serving one job (or, with `serve_forever`, one job after another)."""

    def __init__(
        self,
        *,
        token: str,
        ckpt_dir: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        interval: float | None = None,
        keep: int = 0,
        phase_timeout: float = 300.0,
        rank_interval: float | None = None,
        serve_forever: bool = False,
        job_id: str = "",
        recorded_phase_timeout: float | None = None,
        heartbeat: _wire.Heartbeat | None = None,
        handshake_timeout: float = _wire.HANDSHAKE_TIMEOUT,
    ) -> None:
        try:
            beat = heartbeat or _wire.Heartbeat.from_environment()
        except ProtocolError as exc:
            raise CoordinatorError(str(exc)) from None
        lock = threading.RLock()
        super().__init__(
            token, name="ckpt-coord", what="coordinator", lock=lock, heartbeat=beat,
            handshake_timeout=handshake_timeout,
        )  # fmt: skip
        self._heartbeat_of_peers = beat
        self._serve_forever = serve_forever
        self.ended = threading.Event()
        try:
            self._bind(host, port)
        except OSError as exc:
            raise CoordinatorError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._settings = JobSettings(
            token=token,
            ckpt_dir=Path(ckpt_dir).resolve(),
            interval=interval,
            keep=keep,
            phase_timeout=phase_timeout,
            rank_interval=rank_interval,
            address=self.address,
            job_id=job_id,
            recorded_phase_timeout=recorded_phase_timeout,
        )
        self._scheduler = Scheduler(lock)
        self._kv_timer: Timer | None = None
        self._ranks: dict[int, _Connection] = {}
        self._respawn: Respawn | None = None
        self._fallbacks = FallbackRecord()  # across the jobs a fallback starts (next_job)
        self.job = self._new_job()

    def _new_job(self) -> Job:
        job = Job(self._settings, self._push, self._scheduler)
        job.on_end = self._job_ended
        job.recovery.respawn = self._respawn
        job.recovery.fallbacks = self._fallbacks
        return job

    def next_job(self) -> None:
        """The job ended with the outcome "fallback" and its ranks are stopped: serve its whole-job restart as a
        fresh job (the same address, token and directory).  What is left of the old ranks' connections is
        dropped, so nothing of theirs reaches the new job."""
        with self._lock:
            for conn in self._ranks.values():
                conn.abort()
            self._ranks.clear()
            self.job = self._new_job()
            self.ended.clear()

    def fallback_failed(self, message: str) -> None:
        """The whole-job restart a fallback asked for cannot start (`message`): the job's end is a failure."""
        with self._lock:
            outcome = self.job.outcome
            if outcome is not None and outcome["status"] == "fallback":
                outcome.update(status="failed", message=message)
                self.job.message = message

    def set_respawn(self, respawn: Respawn | None) -> None:
        """Under --on-failure recover, call `respawn(rank, incarnation, number)` (under the coordinator's lock: it
        must not block) when a lost rank is to be started again from its image of checkpoint `number`; without
        one, the job waits for `ckpt restart --rank`."""
        with self._lock:
            self._respawn = self.job.recovery.respawn = respawn

    def rank_pid(self, rank: int) -> int | None:
        """The PID rank `rank`'s latest incarnation joined with (None if it has not joined)."""
        with self._lock:
            info = self.job.ranks.get(rank)
            return info.pid if info is not None else None

    def start(self) -> Coordinator:
        self._serve_in_background()
        return self

    def _stopping(self) -> None:
        self._scheduler.stop()

    @property
    def outcome(self) -> dict[str, Any] | None:
        with self._lock:
            return self.job.outcome

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self.job.status()

    def fail(self, message: str) -> None:
        """End the job as failed (the launcher saw a rank process die before it joined)."""
        with self._lock:
            self.job.fail(message)

    def kill(self, reason: str) -> None:
        """End the job as killed (the launcher was interrupted): the ranks are told to exit."""
        with self._lock:
            self.job.kill(reason)

    def remove_aborted_images(self) -> None:
        """Delete what aborted checkpoints left behind (call once no rank can write any more)."""
        with self._lock:
            self.job.remove_aborted_images()

    def bytes_loaded(self) -> int:
        """Image bytes the ranks of a restarting job have loaded so far."""
        with self._lock:
            return sum(done for done, _ in self.job.progress.values())

    def _job_ended(self) -> None:
        self.ended.set()

    def _push(self, rank: int, push: protocol.Push) -> None:
        conn = self._ranks.get(rank)
        if conn is not None:
            conn.post(protocol.push_message(push))

    # ----------------------------------------------------------- connections (the server base's hooks)
    def _connection(self, sock: socket.socket, peer: str, hello: _wire.Message) -> _Connection:
        role = _wire.require(hello, "role", str)
        if role not in protocol.ROLES:
            raise ProtocolError(f"unknown role {role!r}")
        return _Connection(sock, peer, role, self._heartbeat_of_peers)

    def _greet(self, conn: _Connection) -> _wire.Message | None:
        """A rank first says who it is in a "join" frame; a control client says nothing."""
        if conn.role != protocol.ROLE_RANK:
            return None
        join = _wire.recv(conn.sock, idle=self._heartbeat_of_peers.timeout)
        protocol.parse_join(join)
        return join

    def _welcome(self, conn: _Connection, greeting: _wire.Message | None) -> None:
        if greeting is None:
            conn.post({"op": "welcome", "job": self.job.job_id, "address": self.address})
            return
        try:
            welcome = self.job.join(greeting)
        except (CkptError, KeyError, ValueError, TypeError, AttributeError) as exc:
            conn.post({"op": "refused", "error": str(exc)})
            raise EOFError from None
        conn.rank = int(greeting["rank"])
        self._ranks[conn.rank] = conn
        conn.post({"op": "welcome", **welcome})
        self.job.joined()

    def _who(self, conn: _Connection) -> str:
        return f"{conn.peer} ({f'rank {conn.rank}' if conn.rank >= 0 else f'a {conn.role} client'})"

    def _lost(self, conn: _Connection, silent: str) -> None:
        if conn.role == protocol.ROLE_RANK and self._ranks.get(conn.rank) is conn:
            del self._ranks[conn.rank]
            self.job.rank_lost(conn.rank, silent)
            self._maybe_next_job()

    def _maybe_next_job(self) -> None:
        if self._serve_forever and self.job.outcome is not None and not self._ranks:
            log.info("job %s ended (%s); ready for the next one", self.job.job_id, self.job.outcome["status"])
            self.job = self._new_job()
            self.ended.clear()

    # ----------------------------------------------------------- requests
    def _handle(self, conn: _Connection, message: _wire.Message) -> bool:
        """Parse, then handle under the lock; a malformed request is answered with its error, then the
        connection closes (ProtocolError), and nothing else is touched."""
        try:
            request = protocol.parse_request(message, conn.role)
        except ProtocolError as exc:
            rid = message.get("id")
            if isinstance(rid, int) and not isinstance(rid, bool):
                conn.post({"op": "reply", "id": rid, "error": f"the coordinator refused the request: {exc}"})
            raise
        with self._lock:
            if conn.role == protocol.ROLE_RANK and self._ranks.get(conn.rank) is not conn:
                return False  # a rank of a job a fallback replaced (next_job): its connection is going
            _HANDLERS[type(request)](self, conn, request, conn.reply_to(request.id))
        return False

    def _op_status(self, conn: _Connection, request: protocol.Status, reply: Reply) -> None:
        reply({"status": self.job.status()})

    def _op_checkpoint(self, conn: _Connection, request: protocol.Checkpoint, reply: Reply) -> None:
        waiter = reply if request.wait else None
        if request.rank is None:
            answer = self.job.request_checkpoint(kill=request.kill, waiter=waiter)
        elif request.kill:
            answer = {"error": "--kill cannot go with --rank: only a coordinated checkpoint can end the job"}
        else:
            answer = self.job.request_rank_checkpoint(request.rank, waiter=waiter)
        if not request.wait or "error" in answer:
            reply(answer)

    def _op_kill(self, conn: _Connection, request: protocol.Kill, reply: Reply) -> None:
        self.job.kill(request.reason or "killed on request (ckpt kill)")
        reply({})

    def _op_publish(self, conn: _Connection, request: protocol.Publish, reply: Reply) -> None:
        self.job.kv.publish(request.ns, request.key, request.value)
        reply({})

    def _op_get(self, conn: _Connection, request: protocol.Get, reply: Reply) -> None:
        found, value = self.job.kv.get(request.ns, request.key)
        reply({"found": found, "value": value})

    def _op_subscribe(self, conn: _Connection, request: protocol.Subscribe, reply: Reply) -> None:
        self.job.kv.subscribe(
            request.ns, request.key, prefix=request.prefix, count=request.count, timeout=request.timeout, reply=reply
        )
        deadline = time.monotonic() + request.timeout
        if self._kv_timer is None or self._kv_timer.cancelled or deadline < self._kv_timer.when:
            if self._kv_timer:
                self._kv_timer.cancel()
            self._kv_timer = self._scheduler.call_at(deadline, self._expire_subscribers)

    def _expire_subscribers(self) -> None:
        self._kv_timer = None
        upcoming = self.job.kv.expire(time.monotonic())
        if upcoming is not None:
            self._kv_timer = self._scheduler.call_at(upcoming, self._expire_subscribers)

    def _op_atomic(self, conn: _Connection, request: protocol.Atomic, reply: Reply) -> None:
        try:
            value = self.job.kv.atomic(request.kind, request.ns, request.key, request.operand)
        except ValueError as exc:
            reply({"error": str(exc)})
            return
        reply({"value": value})

    def _op_alloc_ids(self, conn: _Connection, request: protocol.AllocIds, reply: Reply) -> None:
        reply({"first": self.job.kv.allocate_ids(request.ns, request.count)})

    def _op_collective(self, conn: _Connection, request: protocol.Collective, reply: Reply) -> None:
        self.job.collective(conn.rank, request.seq, request.kind, request.step, request.data, reply)

    def _op_barrier(self, conn: _Connection, request: protocol.Barrier, reply: Reply) -> None:
        self.job.barrier(conn.rank, request.name, request.value, reply)

    def _op_step(self, conn: _Connection, request: protocol.Step, reply: Reply) -> None:
        self.job.ranks[conn.rank].step = request.step

    def _op_finished(self, conn: _Connection, request: protocol.Finished, reply: Reply) -> None:
        result = None if request.result is None else str(request.result)
        self.job.finished(conn.rank, result, request.step)
        reply({})

    def _op_abort_checkpoint(self, conn: _Connection, request: protocol.AbortCheckpoint, reply: Reply) -> None:
        self.job.abort_checkpoint(request.number, request.reason)
        reply({})

    def _op_progress(self, conn: _Connection, request: protocol.Progress, reply: Reply) -> None:
        self.job.progress[conn.rank] = (request.done, request.total)

    def _op_fall_back(self, conn: _Connection, request: protocol.FallBack, reply: Reply) -> None:
        reply({})  # first: a fallback's end of the job may push KillRank to this very rank
        self.job.recovery.fall_back(conn.rank, request.reason)

    def _op_hold_checkpoints(self, conn: _Connection, request: protocol.HoldCheckpoints, reply: Reply) -> None:
        self.job.recovery.hold(conn.rank, request.reason)
        reply({})

    def _op_release_checkpoints(self, conn: _Connection, request: protocol.ReleaseCheckpoints, reply: Reply) -> None:
        self.job.recovery.release(conn.rank)
        reply({})

    def _op_fatal(self, conn: _Connection, request: protocol.Fatal, reply: Reply) -> None:
        if self.job.outcome is None:
            self.job.ranks[conn.rank].state = "failed"
        self.job.fail(f"rank {conn.rank} failed: {request.error}", detail=request.traceback)
        reply({})


_Handler = Callable[[Coordinator, _Connection, Any, Reply], None]


def _handlers() -> Mapping[type[protocol.Request], _Handler]:
    """The dispatch table, derived from protocol.Op: each op's handler is Coordinator._op_<op>."""
    missing = [op.value for op in protocol.Op if not hasattr(Coordinator, f"_op_{op.value}")]
    if missing:
        raise AssertionError(f"coordinator operations without a handler: {', '.join(missing)}")
    return {kind: getattr(Coordinator, f"_op_{op.value}") for op, kind in protocol.REQUESTS.items()}


_HANDLERS = _handlers()
