"""The coordinator client: one authenticated connection, many outstanding requests, pushed commands."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt import _wire
from ckpt._errors import CoordinatorError, ProtocolError
from ckpt._jobdir import JOB_FILE, read_job_file
from ckpt.coordinator import protocol


class CoordinatorClient:
    """Connects, authenticates, then multiplexes requests by id; messages that are not replies
    (suspend, abort, kill, done) are handed to `on_push` on the reader thread.

    `hello` is {"role": "control"}, or {"role": "rank", ...} with what the rank tells the coordinator
    about itself (sent as the "join" right behind the authentication). `connect_timeout` bounds
    connecting and authenticating together. Heartbeats both ways follow `heartbeat`
    ($CKPT_HEARTBEAT_INTERVAL / $CKPT_HEARTBEAT_TIMEOUT by default): a coordinator silent for its
    timeout is lost (`on_lost`, then every waiting call fails).
    """

    def __init__(
        self,
        address: str,
        token: str,
        hello: dict[str, Any],
        *,
        on_push: Callable[[dict[str, Any]], None] | None = None,
        on_lost: Callable[[str], None] | None = None,
        connect_timeout: float = 10.0,
        heartbeat: _wire.Heartbeat | None = None,
    ) -> None:
        self.address = address
        host, port = _parse(address)
        heartbeat = _heartbeat(heartbeat)
        role = hello.get("role")
        join = {"op": "join", **{k: v for k, v in hello.items() if k != "role"}} if role == "rank" else None
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise CoordinatorError(
                f"cannot reach the coordinator at {address} ({exc.strerror or exc}); is the job running?"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            welcome = _wire.client_handshake(
                sock, token, "coordinator", role=None if role is None else str(role), then=join, timeout=connect_timeout
            )
        except TimeoutError:
            sock.close()
            raise CoordinatorError(
                f"the coordinator at {address} did not answer within {connect_timeout:g} s"
            ) from None
        except (EOFError, OSError) as exc:
            sock.close()
            raise CoordinatorError(
                f"the coordinator at {address} closed the connection (wrong CKPT_TOKEN?): {exc}"
            ) from None
        except ProtocolError as exc:
            sock.close()
            raise CoordinatorError(f"coordinator at {address}: {exc}") from None
        if welcome["op"] == "refused":
            sock.close()
            raise CoordinatorError(f"the coordinator refused this rank: {welcome.get('error')}")
        self.welcome = welcome
        self._on_push = on_push
        self._connection = _wire.ClientConnection(
            sock,
            error=CoordinatorError,
            peer="coordinator",
            lost=f"connection to the coordinator at {address} lost",
            on_message=self._push,
            on_lost=on_lost,
            thread_name="ckpt-coord-client",
            heartbeat=heartbeat,
            silent=f"no word from the coordinator at {address}",
        )

    # ----------------------------------------------------------- requests
    def call(self, op: str, reply_timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait (up to `reply_timeout` s) for its reply; CoordinatorError on an error
        reply or a lost link (an op the coordinator does not have is one at once: the coordinator would
        close a connection that sends it)."""
        return self._connection.call(_known(op), reply_timeout, **fields)

    def notify(self, op: str, **fields: Any) -> None:
        """Send a message that has no reply."""
        self._connection.send({"op": _known(op), **fields})

    def _push(self, message: dict[str, Any]) -> None:
        if self._on_push is not None:
            self._on_push(message)

    def close(self) -> None:
        self._connection.close()


def _known(op: str) -> str:
    if op not in protocol.OPS:
        raise CoordinatorError(f"the coordinator has no operation {op!r} (it has: {', '.join(sorted(protocol.OPS))})")
    return op


def _heartbeat(given: _wire.Heartbeat | None) -> _wire.Heartbeat:
    if given is not None:
        return given
    try:
        return _wire.Heartbeat.from_environment()
    except ProtocolError as exc:
        raise CoordinatorError(str(exc)) from None


def _parse(address: str) -> tuple[str, int]:
    try:
        return _wire.parse_address(address, "coordinator address")
    except ProtocolError as exc:
        raise CoordinatorError(str(exc)) from None


# ----------------------------------------------------------- finding a job
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
