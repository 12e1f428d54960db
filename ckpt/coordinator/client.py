"""The coordinator client: one authenticated connection, many outstanding requests, pushed commands."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt._errors import CoordinatorError, ProtocolError
from ckpt.coordinator import protocol

JOB_FILE = "coordinator.json"


@dataclass
class _Pending:
    event: threading.Event
    answer: dict[str, Any] | None = None


class CoordinatorClient:
    """Connects, authenticates, then multiplexes requests by id; messages that are not replies
    (suspend, abort, kill, done) are handed to `on_push` on the reader thread."""

    def __init__(
        self,
        address: str,
        token: str,
        hello: dict[str, Any],
        *,
        on_push: Callable[[dict[str, Any]], None] | None = None,
        on_lost: Callable[[str], None] | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self.address = address
        host, port = _parse(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise CoordinatorError(
                f"cannot reach the coordinator at {address} ({exc.strerror or exc}); is the job running?"
            ) from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            challenge = protocol.recv(self._sock)
            nonce = challenge.get("nonce")
            if challenge["op"] != "challenge" or not isinstance(nonce, bytes):
                raise ProtocolError("the peer is not a ckpt coordinator")
            protocol.send(self._sock, {"op": "hello", "auth": protocol.auth_answer(token, nonce), **hello})
            welcome = protocol.recv(self._sock)
        except (EOFError, OSError) as exc:
            self._sock.close()
            raise CoordinatorError(
                f"the coordinator at {address} closed the connection (wrong CKPT_TOKEN?): {exc}"
            ) from None
        except ProtocolError as exc:
            self._sock.close()
            raise CoordinatorError(f"coordinator at {address}: {exc}") from None
        if welcome["op"] == "refused":
            self._sock.close()
            raise CoordinatorError(f"the coordinator refused this rank: {welcome.get('error')}")
        self._sock.settimeout(None)
        self.welcome = welcome
        self._on_push = on_push
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._lost: str | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, name="ckpt-coord-client", daemon=True)
        self._reader.start()

    # ----------------------------------------------------------- requests
    def call(self, op: str, reply_timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait (up to `reply_timeout` s) for its reply; CoordinatorError on an error
        reply or a lost link."""
        rid = next(self._ids)
        pending = _Pending(threading.Event())
        with self._lock:
            if self._lost is not None:
                raise CoordinatorError(self._lost)
            self._pending[rid] = pending
        self._send({"op": op, "id": rid, **fields})
        if not pending.event.wait(reply_timeout):
            with self._lock:
                self._pending.pop(rid, None)
            raise CoordinatorError(f"no answer from the coordinator to {op!r} within {reply_timeout} s")
        answer = pending.answer
        if answer is None:
            raise CoordinatorError(self._lost or "connection to the coordinator lost")
        if "error" in answer:
            raise CoordinatorError(str(answer["error"]))
        return answer

    def notify(self, op: str, **fields: Any) -> None:
        """Send a message that has no reply."""
        self._send({"op": op, **fields})

    def _send(self, message: dict[str, Any]) -> None:
        frame = protocol.encode(message)
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as exc:
            self._fail_all(f"connection to the coordinator at {self.address} lost: {exc}")
            raise CoordinatorError(self._lost or str(exc)) from None

    def _read_loop(self) -> None:
        reason = f"connection to the coordinator at {self.address} lost"
        try:
            while True:
                message = protocol.recv(self._sock)
                if message["op"] == "reply":
                    with self._lock:
                        pending = self._pending.pop(message.get("id", -1), None)
                    if pending is not None:
                        pending.answer = message
                        pending.event.set()
                elif self._on_push is not None:
                    self._on_push(message)
        except (EOFError, OSError):
            pass
        except ProtocolError as exc:
            reason += f": {exc}"
        self._fail_all(reason)
        if self._on_lost is not None and not self._closing:
            self._on_lost(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = reason
            pending, self._pending = self._pending, {}
        for item in pending.values():
            item.event.set()

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _parse(address: str) -> tuple[str, int]:
    try:
        return protocol.parse_address(address)
    except ProtocolError as exc:
        raise CoordinatorError(str(exc)) from None


# ----------------------------------------------------------- finding a job
def write_job_file(
    ckpt_dir: Path, *, address: str, token: str, job: str, pid: int, ended: dict[str, Any] | None = None
) -> Path:
    """Record where the job's coordinator is, so later commands find it without flags (mode 0600).

    When the job has ended, `ended` is its final status, which `ckpt status` shows from then on.
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / JOB_FILE
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        record: dict[str, Any] = {"address": address, "token": token, "job": job, "pid": pid}
        if ended is not None:
            record["ended"] = ended
        json.dump(record, f)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_job_file(ckpt_dir: Path) -> dict[str, Any] | None:
    path = ckpt_dir / JOB_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CoordinatorError(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or not {"address", "token"} <= data.keys():
        raise CoordinatorError(f"{path} is not a ckpt coordinator file")
    return data


def locate(coordinator: str | None, ckpt_dir: Path, token: str | None) -> tuple[str, str]:
    """(address, token) of the job: --coordinator / CKPT_COORDINATOR, else the ckpt dir's job file."""
    job = read_job_file(ckpt_dir)
    address = coordinator or (job or {}).get("address")
    secret = token or (job or {}).get("token")
    if not address:
        raise CoordinatorError(
            f"no coordinator given and no {JOB_FILE} in {ckpt_dir}: "
            "pass --coordinator HOST:PORT or --ckpt-dir of a running job"
        )
    if not secret:
        raise CoordinatorError(f"no token for the coordinator at {address}: set CKPT_TOKEN")
    return str(address), str(secret)


def control(address: str, token: str) -> CoordinatorClient:
    """A control connection (status, checkpoint, kill)."""
    return CoordinatorClient(address, token, {"role": "control"})
