"""The coordinator's TCP server: accepts ranks and control clients and dispatches their requests."""

# Connections are authenticated by one handshake gate thread (_connections.py):
# until a peer has answered the challenge it has no thread and no buffer of its
# own.  An authenticated connection gets a reader thread, which parses frames
# (protocol.recv) and handles each request under the coordinator's single lock;
# requests that must wait (barriers, collectives, subscribe, checkpoint --wait)
# register a reply callback with the Job or the key-value store and return at
# once, so a rank's checkpoint thread and its program thread can both have
# requests outstanding on the one connection.  Replies and pushes go through a
# per-connection outbox drained by a writer thread, so a client that stops
# reading can never block the coordinator while it holds its lock.  The writer
# sends a heartbeat when it has been idle for the heartbeat interval, and the
# reader treats a peer silent for the heartbeat timeout as lost: a stopped or
# partitioned rank fails the job instead of hanging it.

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ckpt._errors import CkptError, CoordinatorError, ProtocolError
from ckpt.coordinator import protocol
from ckpt.coordinator._connections import HandshakeGate, PeerConnection
from ckpt.coordinator._scheduler import Scheduler, Timer
from ckpt.coordinator.job import Job, JobSettings
from ckpt.coordinator.kvstore import Reply

log = logging.getLogger(__name__)

_MAX_SUBSCRIBE_TIMEOUT = 7 * 24 * 3600.0
#: How long stop() lets the writers send what was posted (the answer to a `checkpoint --kill` ...).
_FLUSH_ON_STOP = 5.0


class _Connection(PeerConnection):
    def __init__(self, sock: socket.socket, peer: str, role: str, heartbeat: protocol.Heartbeat) -> None:
        super().__init__(sock, peer, thread_name=f"ckpt-coord-w-{peer}", heartbeat_interval=heartbeat.interval)
        self.role = role
        self.rank = -1

    def reply_to(self, rid: Any) -> Reply:
        def reply(payload: dict[str, Any]) -> None:
            try:
                self.post({"op": "reply", "id": rid, **payload})
            except ProtocolError as exc:  # e.g. an allgather whose answer is over the frame limit
                self.post({"op": "reply", "id": rid, "error": str(exc)})

        return reply


class Coordinator:
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
        serve_forever: bool = False,
        job_id: str = "",
        recorded_phase_timeout: float | None = None,
        heartbeat: protocol.Heartbeat | None = None,
        handshake_timeout: float = protocol.HANDSHAKE_TIMEOUT,
    ) -> None:
        self._lock = threading.RLock()
        self._token = token
        self._serve_forever = serve_forever
        try:
            self._heartbeat = heartbeat or protocol.Heartbeat.from_environment()
        except ProtocolError as exc:
            raise CoordinatorError(str(exc)) from None
        self.ended = threading.Event()
        sock = _listen(host, port)
        bound_host, bound_port = sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        self._gate = HandshakeGate(sock, token, self._admit, name="ckpt-coord-gate", timeout=handshake_timeout)
        self._settings = JobSettings(
            token=token,
            ckpt_dir=Path(ckpt_dir).resolve(),
            interval=interval,
            keep=keep,
            phase_timeout=phase_timeout,
            address=self.address,
            job_id=job_id,
            recorded_phase_timeout=recorded_phase_timeout,
        )
        self._scheduler = Scheduler(self._lock)
        self._kv_timer: Timer | None = None
        self._connections: set[_Connection] = set()
        self._ranks: dict[int, _Connection] = {}
        self.job = self._new_job()
        self._stopped = False

    def _new_job(self) -> Job:
        job = Job(self._settings, self._push, self._scheduler)
        job.on_end = self._job_ended
        return job

    def start(self) -> Coordinator:
        self._gate.start()
        return self

    def stop(self) -> None:
        """Stop accepting, let each connection send what was posted to it (at most a few seconds), close."""
        self._gate.stop()
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
            for conn in connections:
                conn.close()
        self._scheduler.stop()
        deadline = time.monotonic() + _FLUSH_ON_STOP
        for conn in connections:
            conn.flushed(max(0.0, deadline - time.monotonic()))
            conn.abort()

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

    def _push(self, rank: int, message: dict[str, Any]) -> None:
        conn = self._ranks.get(rank)
        if conn is not None:
            conn.post(message)

    # ----------------------------------------------------------- connections
    def _admit(self, sock: socket.socket, peer: str, hello: dict[str, Any]) -> None:
        """On the gate's thread: `hello` verified; give the connection its writer and reader threads."""
        role = protocol.require(hello, "role", str)
        if role not in ("control", "rank"):
            raise ProtocolError(f"unknown role {role!r}")
        conn = _Connection(sock, peer, role, self._heartbeat)
        threading.Thread(target=self._serve, args=(conn,), name=f"ckpt-coord-r-{peer}", daemon=True).start()

    def _serve(self, conn: _Connection) -> None:
        silent = ""
        timeout = self._heartbeat.timeout
        try:
            self._welcome(conn)
            while True:
                message = protocol.recv(conn.sock, idle=timeout)
                if message["op"] == "heartbeat":
                    continue
                with self._lock:
                    self._dispatch(conn, message)
        except TimeoutError:
            silent = f"no word from it for {timeout:g} s"
            log.warning("closing connection from %s (%s): %s", conn.peer, self._who(conn), silent)
        except (EOFError, OSError):
            pass
        except ProtocolError as exc:
            log.warning("closing connection from %s: %s", conn.peer, exc)
        except Exception:  # a bug must cost one connection, never the coordinator
            log.exception("closing connection from %s after an internal error", conn.peer)
        finally:
            with self._lock:
                self._connections.discard(conn)
                if conn.role == "rank" and self._ranks.get(conn.rank) is conn:
                    del self._ranks[conn.rank]
                    self.job.rank_lost(conn.rank, silent)
                    self._maybe_next_job()
            # What was posted (a refusal, a last reply) still goes out, unless the peer does not read it.
            conn.close()
            conn.flushed(0.0 if silent else timeout)
            conn.abort()

    def _who(self, conn: _Connection) -> str:
        return f"rank {conn.rank}" if conn.rank >= 0 else f"a {conn.role} client"

    def _welcome(self, conn: _Connection) -> None:
        """A control client is welcome at once; a rank first says who it is in a "join" frame."""
        join: dict[str, Any] = {}
        if conn.role == "rank":
            join = protocol.recv(conn.sock, idle=self._heartbeat.timeout)
            if join["op"] != "join":
                raise ProtocolError(f"expected the rank's join, got {join['op']!r}")
            protocol.require(join, "rank", int)
            protocol.require(join, "size", int)
        with self._lock:
            if self._stopped:
                raise EOFError
            self._connections.add(conn)
            if conn.role == "control":
                conn.post({"op": "welcome", "job": self.job.job_id, "address": self.address})
                return
            try:
                welcome = self.job.join(join)
            except (CkptError, KeyError, ValueError, TypeError, AttributeError) as exc:
                conn.post({"op": "refused", "error": str(exc)})
                raise EOFError from None
            conn.rank = int(join["rank"])
            self._ranks[conn.rank] = conn
            conn.post({"op": "welcome", **welcome})
            self.job.joined()

    def _maybe_next_job(self) -> None:
        if self._serve_forever and self.job.outcome is not None and not self._ranks:
            log.info("job %s ended (%s); ready for the next one", self.job.job_id, self.job.outcome["status"])
            self.job = self._new_job()
            self.ended.clear()

    # ----------------------------------------------------------- requests
    def _dispatch(self, conn: _Connection, message: dict[str, Any]) -> None:
        op = message["op"]
        reply = conn.reply_to(message.get("id"))
        handler = _CONTROL_OPS.get(op) if conn.role == "control" else _RANK_OPS.get(op) or _CONTROL_OPS.get(op)
        if handler is None:
            raise ProtocolError(f"unknown op {op!r} for a {conn.role} connection")
        handler(self, conn, message, reply)

    def _op_status(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        reply({"status": self.job.status()})

    def _op_checkpoint(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        wait = bool(message.get("wait"))
        answer = self.job.request_checkpoint(kill=bool(message.get("kill")), waiter=reply if wait else None)
        if not wait or "error" in answer:
            reply(answer)

    def _op_kill(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        self.job.kill(str(message.get("reason") or "killed on request (ckpt kill)"))
        reply({})

    def _op_publish(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        ns, key = protocol.require(message, "ns", str), protocol.require(message, "key", str)
        self.job.kv.publish(ns, key, message.get("value"))
        reply({})

    def _op_get(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        found, value = self.job.kv.get(protocol.require(message, "ns", str), protocol.require(message, "key", str))
        reply({"found": found, "value": value})

    def _op_subscribe(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        timeout = float(protocol.require(message, "timeout", (int, float)))
        if not 0 <= timeout <= _MAX_SUBSCRIBE_TIMEOUT:
            raise ProtocolError(f"subscribe timeout {timeout} outside 0..{_MAX_SUBSCRIBE_TIMEOUT} s")
        self.job.kv.subscribe(
            protocol.require(message, "ns", str),
            protocol.require(message, "key", str),
            prefix=bool(message.get("prefix")),
            count=protocol.require(message, "count", int) if "count" in message else 1,
            timeout=timeout,
            reply=reply,
        )
        deadline = time.monotonic() + timeout
        if self._kv_timer is None or self._kv_timer.cancelled or deadline < self._kv_timer.when:
            if self._kv_timer:
                self._kv_timer.cancel()
            self._kv_timer = self._scheduler.call_at(deadline, self._expire_subscribers)

    def _expire_subscribers(self) -> None:
        self._kv_timer = None
        upcoming = self.job.kv.expire(time.monotonic())
        if upcoming is not None:
            self._kv_timer = self._scheduler.call_at(upcoming, self._expire_subscribers)

    def _op_atomic(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        try:
            value = self.job.kv.atomic(
                protocol.require(message, "kind", str),
                protocol.require(message, "ns", str),
                protocol.require(message, "key", str),
                protocol.require(message, "operand", int),
            )
        except ValueError as exc:
            reply({"error": str(exc)})
            return
        reply({"value": value})

    def _op_alloc_ids(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        count = protocol.require(message, "count", int)
        if count < 1:
            raise ProtocolError("alloc_ids: count must be positive")
        reply({"first": self.job.kv.allocate_ids(protocol.require(message, "ns", str), count)})

    def _op_collective(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        self.job.collective(
            conn.rank,
            protocol.require(message, "seq", int),
            protocol.require(message, "kind", str),
            protocol.require(message, "step", int),
            message.get("data"),
            reply,
        )

    def _op_barrier(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        self.job.barrier(conn.rank, protocol.require(message, "name", str), message.get("value"), reply)

    def _op_step(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        self.job.ranks[conn.rank].step = protocol.require(message, "step", int)

    def _op_finished(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        result = message.get("result")
        self.job.finished(conn.rank, None if result is None else str(result), protocol.require(message, "step", int))
        reply({})

    def _op_abort_checkpoint(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        self.job.abort_checkpoint(protocol.require(message, "number", int), str(message.get("reason")))
        reply({})

    def _op_progress(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        done, total = protocol.require(message, "done", int), protocol.require(message, "total", int)
        self.job.progress[conn.rank] = (done, total)

    def _op_fatal(self, conn: _Connection, message: dict[str, Any], reply: Reply) -> None:
        if self.job.outcome is None:
            self.job.ranks[conn.rank].state = "failed"
        self.job.fail(f"rank {conn.rank} failed: {message.get('error')}", detail=str(message.get("traceback") or ""))
        reply({})


_RANK_OPS = {
    "publish": Coordinator._op_publish,
    "get": Coordinator._op_get,
    "subscribe": Coordinator._op_subscribe,
    "atomic": Coordinator._op_atomic,
    "alloc_ids": Coordinator._op_alloc_ids,
    "collective": Coordinator._op_collective,
    "barrier": Coordinator._op_barrier,
    "step": Coordinator._op_step,
    "finished": Coordinator._op_finished,
    "fatal": Coordinator._op_fatal,
    "abort_checkpoint": Coordinator._op_abort_checkpoint,
    "progress": Coordinator._op_progress,
}
_CONTROL_OPS = {
    "status": Coordinator._op_status,
    "checkpoint": Coordinator._op_checkpoint,
    "kill": Coordinator._op_kill,
}


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        raise CoordinatorError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
