"""The simulated fabric, public side: the SM client of HCAs and the CLI, finding the default fabric, link units."""

# The subnet manager itself, and why it is built the way it is, is in _subnet.py.

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
from collections.abc import Callable
from typing import Any, final

from ckpt import _wire as wire
from ckpt._errors import ProtocolError
from ckpt.verbs._subnet import (
    ENV_NODE,
    MAX_UNICAST_LID,
    PORTS_PER_HCA,
    FabricError,
    FabricStatistics,
    LinkModel,
    SubnetManager,
)

__all__ = [
    "ENV_ADDRESS",
    "ENV_NODE",
    "ENV_TOKEN",
    "MAX_UNICAST_LID",
    "PORTS_PER_HCA",
    "FabricClient",
    "FabricError",
    "FabricStatistics",
    "LinkModel",
    "SubnetManager",
    "connect_default",
    "parse_bandwidth",
    "parse_latency",
]

log = logging.getLogger(__name__)

ENV_ADDRESS = "CKPT_FABRIC"
ENV_TOKEN = "CKPT_FABRIC_TOKEN"

_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?"
_QUANTITY = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<unit>[A-Za-zµ/]*)\s*$")
_LATENCY_DIVISORS = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # 5us is 5e-6, not 5 * 1e-6
_BANDWIDTH_PREFIXES = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2.0**10, "Mi": 2.0**20,
                       "Gi": 2.0**30, "Ti": 2.0**40}  # fmt: skip
_BANDWIDTH_UNIT = re.compile(r"^(?P<prefix>[kKMGT]i?)?(?P<kind>[Bb])(?:/s|ps)?$")


def _quantity(text: str, what: str, expected: str) -> tuple[float, str]:
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"bad {what} {text!r}: expected {expected}")
    value = float(match["number"])
    if not math.isfinite(value):
        raise ValueError(f"bad {what} {text!r}: out of range")
    return value, match["unit"]


def parse_latency(text: str) -> float:
    """'2us', '1.5ms', '10ns', '1s', '3e-6' (seconds), '0' -> seconds."""
    expected = "a number with an optional unit ns, us, ms or s (e.g. 2us)"
    value, unit = _quantity(text, "latency", expected)
    if unit not in _LATENCY_DIVISORS:
        raise ValueError(f"bad latency {text!r}: unknown unit {unit!r}, expected {expected}")
    return value / _LATENCY_DIVISORS[unit]


def parse_bandwidth(text: str) -> float:
    """'4GB/s', '100MB/s', '2GiB/s', '10Gb/s' (bits), '1e9' (bytes/s), '0' (unlimited) -> bytes/s."""
    expected = "a number of bytes/s with an optional unit such as 100MB/s, 2GiB/s or 10Gb/s (bits), 0 = unlimited"
    value, unit = _quantity(text, "bandwidth", expected)
    if not unit:
        return value
    match = _BANDWIDTH_UNIT.match(unit)
    if match is None:
        raise ValueError(f"bad bandwidth {text!r}: unknown unit {unit!r}, expected {expected}")
    scale = _BANDWIDTH_PREFIXES[match["prefix"] or ""]
    return value * scale / (8.0 if match["kind"] == "b" else 1.0)


# ----------------------------------------------------------- the client
@final
class FabricClient:
    """An HCA's (or the CLI's) connection to the SM.

    Calls are thread-safe and may overlap; a daemon reader thread matches replies to callers by id
    and hands link pushes to `on_link(lid, up)` (and, if given, the loss of the SM to `on_lost(reason)`).
    """

    def __init__(
        self,
        address: str,
        token: str,
        on_link: Callable[[int, bool], None] | None = None,
        timeout: float = 10.0,
        *,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        try:
            host, port = wire.parse_address(address)
        except ProtocolError:
            raise FabricError(f"bad fabric address {address!r}: expected HOST:PORT") from None
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise FabricError(
                f"cannot reach the fabric at {address} ({exc.strerror or exc}); is its subnet manager running?"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            welcome = wire.client_handshake(sock, token, "subnet manager", timeout=timeout)
        except TimeoutError:
            sock.close()
            raise FabricError(f"the fabric at {address} did not answer within {timeout:g} s") from None
        except (EOFError, OSError) as exc:
            sock.close()
            raise FabricError(f"the fabric at {address} closed the connection (wrong {ENV_TOKEN}?): {exc}") from None
        except ProtocolError as exc:
            sock.close()
            raise FabricError(f"fabric at {address}: {exc}") from None
        if welcome["op"] != "welcome":
            sock.close()
            raise FabricError(
                f"the fabric at {address} refused the connection: {welcome.get('error')} (wrong {ENV_TOKEN}?)"
            )
        self.fabric: str = str(welcome.get("fabric"))
        self.sm_lid: int = int(welcome.get("sm_lid", 0))
        self._on_link = on_link
        self._connection = wire.ClientConnection(
            sock,
            error=FabricError,
            peer=f"fabric at {address}",
            lost=f"connection to the fabric at {address} lost",
            lost_hint=" (its subnet manager stopped?)",
            on_message=self._push,
            on_lost=on_lost,
            thread_name="ckpt-fabric-client",
        )

    def __enter__(self) -> FabricClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- requests
    def register(
        self, guid: int, name: str, endpoint: str, pid: int, host: str, node: str | None = None
    ) -> dict[str, Any]:
        """Register an HCA: {lids: [port 1, port 2], sm_lid, latency, bandwidth, links: {lid: up}, fabric}.

        An HCA of `node` gets that node's LIDs and link states again once no other HCA holds them."""
        answer = self._call("register", guid=guid, name=name, endpoint=endpoint, pid=pid, host=host, node=node)
        return {key: answer[key] for key in ("lids", "sm_lid", "latency", "bandwidth", "links", "fabric")}

    def resolve(self, lid: int) -> tuple[str | None, int | None, bool]:
        """(endpoint "host:port", port number, link up) of `lid`; (None, None, False) if no HCA has it."""
        answer = self._call("resolve", lid=lid)
        return answer["endpoint"], answer["port"], bool(answer["up"])

    def routes(self) -> dict[int, dict[str, Any]]:
        """The routing table: {lid: {endpoint, port, up, name, pid}}."""
        routes: dict[int, dict[str, Any]] = self._call("routes")["routes"]
        return routes

    def fail_link(self, lid: int) -> None:
        self._call("fail_link", lid=lid)

    def restore_link(self, lid: int) -> None:
        self._call("restore_link", lid=lid)

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self._call("status")["status"]
        return status

    def stop(self) -> None:
        """Ask the SM to stop (every HCA sees it go away)."""
        self._call("stop")

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        return self._connection.call(op, self.timeout, **fields)

    def _push(self, message: dict[str, Any]) -> None:
        if message["op"] == "link" and self._on_link is not None:
            try:
                self._on_link(int(message["lid"]), bool(message["up"]))
            except Exception:  # the HCA's bug must not silence every later push
                log.exception("on_link(%s, %s) failed", message.get("lid"), message.get("up"))

    def close(self) -> None:
        """Disconnect; the HCAs registered through this client leave the fabric."""
        self._connection.close()


# ----------------------------------------------------------- finding a fabric
_private_lock = threading.Lock()
_private: tuple[int, SubnetManager] | None = None


def connect_default(
    on_link: Callable[[int, bool], None] | None = None, *, on_lost: Callable[[str], None] | None = None
) -> FabricClient:
    """The fabric this process should use: $CKPT_FABRIC (with $CKPT_FABRIC_TOKEN) when set, otherwise a
    private subnet manager started in this process, so that ckpt.verbs works in one process on its own."""
    address = os.environ.get(ENV_ADDRESS)
    if address:
        token = os.environ.get(ENV_TOKEN)
        if not token:
            raise FabricError(f"{ENV_ADDRESS}={address} is set but {ENV_TOKEN} is not")
        return FabricClient(address, token, on_link, on_lost=on_lost)
    sm = _private_fabric()
    return FabricClient(sm.address, sm.token, on_link, on_lost=on_lost)


def _private_fabric() -> SubnetManager:
    global _private
    with _private_lock:
        if _private is None or _private[0] != os.getpid():  # a forked child has the object but not its threads
            sm = SubnetManager().start()
            _private = (os.getpid(), sm)
            log.debug("no %s set: started a private fabric %s at %s", ENV_ADDRESS, sm.fabric_id, sm.address)
        return _private[1]
