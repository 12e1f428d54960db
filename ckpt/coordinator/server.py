"""The coordinator's TCP server: accepts ranks and control clients and dispatches their requests."""

# One reader thread per connection parses frames (protocol.recv) and handles
# each request under the coordinator's single lock; requests that must wait
# (barriers, collectives, subscribe, checkpoint --wait) register a reply
# callback with the Job or the key-value store and return at once, so a rank's
# checkpoint thread and its program thread can both have requests outstanding
# on the one connection.  Replies and pushes go through a per-connection outbox
# drained by a writer thread, so a client that stops reading can never block
# the coordinator while it holds its lock.

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ckpt._errors import CkptError, CoordinatorError, ProtocolError
from ckpt.coordinator import protocol
from ckpt.coordinator._scheduler import Scheduler, Timer
from ckpt.coordinator.job import Job, JobSettings
from ckpt.coordinator.kvstore import Reply

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT = 10.0
_MAX_SUBSCRIBE_TIMEOUT = 7 * 24 * 3600.0


class _Connection:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.role = ""
        self.rank = -1
        self.closed = False
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name=f"ckpt-coord-w-{peer}", daemon=True)
        self._writer.start()

    def post(self, message: dict[str, Any]) -> None:
        if not self.closed:
            self._outbox.put(protocol.encode(message))

    def reply_to(self, rid: Any) -> Reply:
        def reply(payload: dict[str, Any]) -> None:
            try:
                self.post({"op": "reply", "id": rid, **payload})
            except ProtocolError as exc:  # e.g. an allgather whose answer is over the frame limit
                self.post({"op": "reply", "id": rid, "error": str(exc)})

        return reply

    def _write_loop(self) -> None:
        while True:
            frame = self._outbox.get()
            if frame is None:
                return
            try:
                self.sock.sendall(frame)
            except OSError:
                self.close()
                return

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._outbox.put(None)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


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
    ) -> None:
        self._lock = threading.RLock()
        self._token = token
        self._serve_forever = serve_forever
        self.ended = threading.Event()
        self._sock = _listen(host, port)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
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
        self._acceptor = threading.Thread(target=self._accept_loop, name="ckpt-coord-accept", daemon=True)

    def _new_job(self) -> Job:
        job = Job(self._settings, self._push, self._scheduler)
        job.on_end = self._job_ended
        return job

    def start(self) -> Coordinator:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for conn in list(self._connections):
                conn.close()
        self._scheduler.stop()
        try:
            self._sock.close()
        except OSError:
            pass

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
    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, f"{peer[0]}:{peer[1]}")
            threading.Thread(target=self._serve, args=(conn,), name=f"ckpt-coord-r-{conn.peer}", daemon=True).start()

    def _serve(self, conn: _Connection) -> None:
        try:
            self._handshake(conn)
            while True:
                message = protocol.recv(conn.sock)
                with self._lock:
                    self._dispatch(conn, message)
        except (EOFError, OSError):
            pass
        except ProtocolError as exc:
            log.warning("closing connection from %s: %s", conn.peer, exc)
        except Exception:  # a bug must cost one connection, never the coordinator
            log.exception("closing connection from %s after an internal error", conn.peer)
        finally:
            conn.close()
            with self._lock:
                self._connections.discard(conn)
                if conn.role == "rank" and self._ranks.get(conn.rank) is conn:
                    del self._ranks[conn.rank]
                    self.job.rank_lost(conn.rank)
                    self._maybe_next_job()

    def _handshake(self, conn: _Connection) -> None:
        nonce = protocol.new_nonce()
        conn.sock.settimeout(_HANDSHAKE_TIMEOUT)
        protocol.send(conn.sock, {"op": "challenge", "nonce": nonce})
        hello = protocol.recv(conn.sock)
        if hello["op"] != "hello" or not protocol.check_answer(self._token, nonce, hello.get("auth")):
            raise ProtocolError("authentication failed (wrong CKPT_TOKEN?)")
        conn.sock.settimeout(None)
        role = protocol.require(hello, "role", str)
        with self._lock:
            if self._stopped:
                raise EOFError
            self._connections.add(conn)
            conn.role = role
            if role == "control":
                conn.post({"op": "welcome", "job": self.job.job_id, "address": self.address})
                return
            if role != "rank":
                raise ProtocolError(f"unknown role {role!r}")
            protocol.require(hello, "rank", int)
            protocol.require(hello, "size", int)
            try:
                welcome = self.job.join(hello)
            except (CkptError, KeyError, ValueError, TypeError, AttributeError) as exc:
                protocol.send(conn.sock, {"op": "refused", "error": str(exc)})
                raise EOFError from None
            conn.rank = int(hello["rank"])
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
