"""The subnet manager of the simulated fabric: LIDs, routes, link states, fault injection (served over TCP)."""

# Why a subnet manager at all: on real InfiniBand a port has no address until
# the SM gives it a LID, and a LID is only meaningful within one subnet's
# lifetime.  ckpt's verbs virtualization exists because those real IDs change
# when processes are restarted, so the simulation must make them change too:
#
# * LIDs come from a permutation of the unicast range 1..0xBFFF that is random
#   per fabric (random start, random stride coprime with the range size), so a
#   LID is never handed out twice by one fabric and two fabrics (before and
#   after a restart) almost surely disagree on every LID;
# * except to the same *node*: an HCA may register with a node name (a rank's
#   process gets "rank<R>" from ckpt_simib), standing for the machine and the
#   cables it sits on.  Its ports keep their LIDs and their cables' state
#   across the HCA's processes, as OpenSM's guid2lid keeps a rebooted host's
#   LIDs: a link failed before a restart onto the same fabric is still down
#   when the restarted process registers, until it is restored;
# * the SM is the only central piece: it assigns LIDs, keeps the LID -> HCA
#   endpoint routing table and per-LID link state, and pushes every link change
#   to every registered HCA.  Data never passes through it: HCAs talk to each
#   other directly over TCP;
# * an HCA's registration lives as long as its connection: when the process
#   dies, its LIDs leave the routing table and the others see their links go
#   down, as they would when a host drops off a real subnet;
# * the link model (latency, bandwidth) is the fabric's, handed to each HCA at
#   registration, so every process of a job simulates the same network.
#
# The framing and the challenge/response authentication are ckpt._wire's, and
# the accept loop, handshake gate, outboxes and graceful stop are the server
# base's (ckpt._server), shared with the coordinator; each fabric has a token
# of its own.  Fabric connections carry no heartbeats: an HCA's registration
# lives exactly as long as its TCP connection.

from __future__ import annotations

import logging
import math
import random
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, final

from ckpt import _wire
from ckpt._errors import CkptError, ProtocolError
from ckpt._server import PeerConnection, Server

log = logging.getLogger(__name__)

#: Unicast LIDs are 1..0xBFFF: 0 is reserved, 0xC000 and up are multicast.
MAX_UNICAST_LID = 0xBFFF
PORTS_PER_HCA = 2


class FabricError(CkptError):
    """The fabric cannot be reached, refused a request (unknown LID ...), or was given bad input."""


# ----------------------------------------------------------- link model
@dataclass(frozen=True)
class LinkModel:
    """What every link of the fabric costs: `latency` in seconds, `bandwidth` in bytes/s (0 = unlimited)."""

    latency: float = 0.0
    bandwidth: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"link {name} must be a finite number >= 0, not {value!r}")


# ----------------------------------------------------------- statistics and LIDs
@dataclass(frozen=True)
class FabricStatistics:
    """Counters of one subnet manager since it started."""

    hcas_registered: int  # registrations accepted, ever
    hcas_present: int  # HCAs registered now
    hcas_lost: int  # HCAs whose connection closed (their process ended or died)
    resolves: int  # LID -> endpoint lookups answered
    links_failed: int  # link failures injected (fail_link that took a link down)
    links_restored: int  # restore_link that brought a link back up


class _LidAllocator:
    """Every unicast LID at most once, in an order that is different for every fabric."""

    def __init__(self, rng: random.Random) -> None:
        span = MAX_UNICAST_LID
        self._next = rng.randrange(span)
        # An odd stride far from +-1 and coprime with the span: a full-period walk that never looks sequential.
        while True:
            self._stride = rng.randrange(span // 16, span - span // 16) | 1
            if math.gcd(self._stride, span) == 1:
                break
        self._left = span

    def allocate(self) -> int:
        if self._left == 0:
            raise FabricError(f"the fabric has handed out all {MAX_UNICAST_LID} unicast LIDs; start a new fabric")
        self._left -= 1
        lid = self._next + 1
        self._next = (self._next + self._stride) % MAX_UNICAST_LID
        return lid


#: The node a process's HCAs stand for (docs/verbs.md, "Nodes"): ckpt_simib sets it to "rank<R>" in a rank.
ENV_NODE = "CKPT_SIMIB_NODE"


# ----------------------------------------------------------- the subnet manager
class _Connection(PeerConnection):
    """One authenticated peer of the SM and the HCAs it registered."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        super().__init__(sock, peer, thread_name=f"ckpt-sm-w-{peer}", heartbeat_interval=None)
        self.hcas: list[_Hca] = []


@dataclass
class _Hca:
    guid: int
    name: str
    endpoint: str
    host: str
    pid: int
    conn: _Connection
    lids: list[int] = field(default_factory=list)
    node: str | None = None


@dataclass
class _Route:
    hca: _Hca
    port: int
    up: bool = True


_Handler = Callable[["SubnetManager", _Connection, dict[str, Any]], dict[str, Any]]


@final
class SubnetManager(Server[_Connection]):
    """The fabric's SM: LID assignment, routing table, link states and fault injection, over TCP."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        link_model: LinkModel = LinkModel(),
        *,
        handshake_timeout: float = _wire.HANDSHAKE_TIMEOUT,
    ) -> None:
        super().__init__(
            token or _wire.new_token(), name="ckpt-sm", what="subnet manager", lock=threading.Lock(), heartbeat=None,
            handshake_timeout=handshake_timeout, refusal="authentication failed",
        )  # fmt: skip
        self.host = host
        self.port = port
        self.link_model = link_model
        self.fabric_id = uuid.uuid4().hex[:12]
        self._started = False
        self._lids = _LidAllocator(random.SystemRandom())
        self.sm_lid = self._lids.allocate()
        self._routes: dict[int, _Route] = {}
        self._nodes: dict[tuple[str, str], list[int]] = {}  # (node, HCA name) -> its ports' LIDs, kept
        self._node_lids: set[int] = set()
        self._cut: set[int] = set()  # node LIDs whose cable is down (kept while no HCA holds them)
        self._counts = dict.fromkeys(("registered", "lost", "resolves", "failed", "restored"), 0)

    def start(self) -> SubnetManager:
        """Bind and serve in daemon threads; FabricError with one clear line if the address is taken."""
        if self._started:
            raise FabricError(f"the subnet manager of fabric {self.fabric_id} is already started")
        try:
            self._bind(self.host, self.port)
        except OSError as exc:
            raise FabricError(
                f"cannot start a subnet manager on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        self._started = True
        self._serve_in_background()
        log.info("subnet manager of fabric %s listening on %s (SM LID %d)", self.fabric_id, self.address, self.sm_lid)
        return self

    def stop(self) -> None:
        """Close every connection and stop listening (HCAs see the SM go away; no LID changes are pushed).

        The reply to a `stop` request leaves before this returns, and before wait() does."""
        super().stop()
        log.info("subnet manager of fabric %s stopped", self.fabric_id)

    def fail_link(self, lid: int) -> None:
        """Take the link of `lid` down, as if its cable were pulled; every HCA is told."""
        with self._lock:
            self._set_link(lid, False)

    def restore_link(self, lid: int) -> None:
        with self._lock:
            self._set_link(lid, True)

    def statistics(self) -> FabricStatistics:
        with self._lock:
            return self._statistics()

    def status(self) -> dict[str, Any]:
        """The fabric, its link model, its HCAs with their ports' LIDs and states, and its statistics."""
        with self._lock:
            return self._status()

    def _status(self) -> dict[str, Any]:
        hcas = {id(r.hca): r.hca for r in self._routes.values()}.values()
        return {
            "fabric": self.fabric_id,
            "address": self.address,
            "sm_lid": self.sm_lid,
            "latency": self.link_model.latency,
            "bandwidth": self.link_model.bandwidth,
            "hcas": [
                {
                    "name": h.name,
                    "node": h.node,
                    "guid": h.guid,
                    "pid": h.pid,
                    "host": h.host,
                    "endpoint": h.endpoint,
                    "lids": list(h.lids),
                    "ports": [{"port": p, "lid": lid, "up": self._routes[lid].up} for p, lid in enumerate(h.lids, 1)],
                }
                for h in sorted(hcas, key=lambda h: (h.host, h.pid, h.name))
            ],
            "nodes": [
                {
                    "node": node,
                    "name": name,
                    "present": any(lid in self._routes for lid in lids),
                    "ports": [{"port": p, "lid": lid, "up": lid not in self._cut} for p, lid in enumerate(lids, 1)],
                }
                for (node, name), lids in sorted(self._nodes.items())
            ],
            "statistics": asdict(self._statistics()),
        }

    def _statistics(self) -> FabricStatistics:
        c = self._counts
        present = len({id(r.hca) for r in self._routes.values()})
        return FabricStatistics(c["registered"], present, c["lost"], c["resolves"], c["failed"], c["restored"])

    def _set_link(self, lid: int, up: bool) -> None:
        """A port's link (a node's cable too, while no process is on the node: it stays cut until restored)."""
        route = self._routes.get(lid)
        if route is None and lid not in self._node_lids:
            own = " (that is the subnet manager's own LID)" if lid == self.sm_lid else ""
            raise FabricError(f"no HCA port has LID {lid} on fabric {self.fabric_id}{own}")
        if (route.up if route is not None else lid not in self._cut) == up:
            return
        if lid in self._node_lids:
            (self._cut.discard if up else self._cut.add)(lid)
        self._counts["restored" if up else "failed"] += 1
        where = f"{route.hca.name} port {route.port}" if route is not None else "a node's, no HCA on it"
        log.info("fabric %s: link of LID %d (%s) %s", self.fabric_id, lid, where, "restored" if up else "failed")
        if route is not None:
            route.up = up
            self._broadcast({"op": "link", "lid": lid, "up": up})

    def _broadcast(self, message: dict[str, Any], skip: _Connection | None = None) -> None:
        for conn in self._connections:
            if conn.hcas and conn is not skip:
                conn.post(message)

    # ----------------------------------------------------------- connections (the server base's hooks)
    def _connection(self, sock: socket.socket, peer: str, hello: _wire.Message) -> _Connection:
        return _Connection(sock, peer)

    def _welcome(self, conn: _Connection, greeting: _wire.Message | None) -> None:
        conn.post({"op": "welcome", "fabric": self.fabric_id, "sm_lid": self.sm_lid})

    def _lost(self, conn: _Connection, silent: str) -> None:
        """A connection closed: its HCAs leave the fabric and everyone sees their links go down."""
        if self.stopped:
            return
        for hca in conn.hcas:
            self._counts["lost"] += 1
            log.info("fabric %s: HCA %s of pid %d left; LIDs %s removed", self.fabric_id, hca.name, hca.pid,
                     hca.lids)  # fmt: skip
            for lid in hca.lids:
                route = self._routes.pop(lid)
                if route.up:
                    self._broadcast({"op": "link", "lid": lid, "up": False})

    def _handle(self, conn: _Connection, message: _wire.Message) -> bool:
        return self._dispatch(conn, message)

    def _dispatch(self, conn: _Connection, message: dict[str, Any]) -> bool:
        """Handle one request; True when it asked the SM to stop."""
        op = message["op"]
        handler = _OPS.get(op)
        try:
            if handler is None:
                raise FabricError(f"unknown request {op!r}")
            with self._lock:
                answer = handler(self, conn, message)
        except FabricError as exc:
            answer = {"error": str(exc)}
        conn.post({"op": "reply", "id": message.get("id"), **answer})
        return op == "stop" and "error" not in answer

    # ----------------------------------------------------------- requests (under the lock)
    def _op_register(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        guid = _wire.require(message, "guid", int)
        endpoint = _wire.require(message, "endpoint", str)
        try:
            _wire.parse_address(endpoint)
        except ProtocolError:
            raise FabricError(f"bad HCA endpoint {endpoint!r}: expected HOST:PORT") from None
        for route in self._routes.values():
            if route.hca.guid == guid:
                raise FabricError(f"GUID {guid:#x} is already registered ({route.hca.name} of pid {route.hca.pid})")
        hca = _Hca(
            guid=guid,
            name=_wire.require(message, "name", str),
            endpoint=endpoint,
            host=_wire.require(message, "host", str),
            pid=_wire.require(message, "pid", int),
            conn=conn,
            node=_optional_str(message, "node"),
        )
        hca.lids = self._lids_of(hca)
        for port, lid in enumerate(hca.lids, 1):
            route = self._routes[lid] = _Route(hca, port, up=lid not in self._cut)
            self._broadcast({"op": "link", "lid": lid, "up": route.up}, skip=conn)
        conn.hcas.append(hca)
        self._counts["registered"] += 1
        log.debug("fabric %s: %s of pid %d at %s has LIDs %s", self.fabric_id, hca.name, hca.pid, endpoint, hca.lids)
        return {
            "lids": list(hca.lids),
            "sm_lid": self.sm_lid,
            "latency": self.link_model.latency,
            "bandwidth": self.link_model.bandwidth,
            "links": {lid: route.up for lid, route in self._routes.items()},
            "fabric": self.fabric_id,
        }

    def _lids_of(self, hca: _Hca) -> list[int]:
        """Its node's LIDs when it has a node whose ports no other HCA holds now; else new ones."""
        key = (hca.node, hca.name) if hca.node is not None else None
        kept = self._nodes.get(key) if key is not None else None
        if kept is not None and not any(lid in self._routes for lid in kept):
            return list(kept)
        if kept is not None:  # its previous process has not left the fabric yet (or a twin shares the name)
            log.warning("fabric %s: node %s's %s still holds LIDs %s: %s of pid %d gets new ones, with every link up",
                        self.fabric_id, hca.node, hca.name, kept, hca.name, hca.pid)  # fmt: skip
        lids = [self._lids.allocate() for _ in range(PORTS_PER_HCA)]
        if key is not None and kept is None:
            self._nodes[key] = lids
            self._node_lids.update(lids)
        return lids

    def _op_resolve(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        route = self._routes.get(_wire.require(message, "lid", int))
        self._counts["resolves"] += 1
        if route is None:
            return {"endpoint": None, "port": None, "up": False}
        return {"endpoint": route.hca.endpoint, "port": route.port, "up": route.up}

    def _op_routes(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        return {
            "routes": {
                lid: {"endpoint": r.hca.endpoint, "port": r.port, "up": r.up, "name": r.hca.name, "pid": r.hca.pid}
                for lid, r in self._routes.items()
            }
        }

    def _op_fail_link(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        self._set_link(_wire.require(message, "lid", int), False)
        return {"ok": True}

    def _op_restore_link(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        self._set_link(_wire.require(message, "lid", int), True)
        return {"ok": True}

    def _op_status(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        return {"status": self._status()}

    def _op_stop(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}


_OPS: dict[str, _Handler] = {
    "register": SubnetManager._op_register,
    "resolve": SubnetManager._op_resolve,
    "routes": SubnetManager._op_routes,
    "fail_link": SubnetManager._op_fail_link,
    "restore_link": SubnetManager._op_restore_link,
    "status": SubnetManager._op_status,
    "stop": SubnetManager._op_stop,
}


def _optional_str(message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise FabricError(f"bad {key!r} in request: expected a string")
    return value or None
