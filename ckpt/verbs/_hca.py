"""The simulated HCA of one process: identities, memory registration, events, links, timers (handles: `_handles`)."""

# One `Hca` per device name per process stands for the NIC.  It owns a TCP
# listener (its endpoint, registered with the subnet manager next to the two
# LIDs the SM assigns to its ports) and one reader thread per incoming
# connection.  Those threads -- never the program's -- execute incoming RDMA
# WRITE / READ / atomics on registered memory and produce completions, so a
# program that is busy, asleep or parked at a checkpoint still has its memory
# served.  A simib HCA also listens on a Unix socket beside it, which simib HCAs
# on the same machine use instead (`_links`; docs/verbs.md, "Same-host links").
#
# Identities (qp_num, lkey, rkey) start from random bases drawn per HCA and
# LIDs come from the SM's randomised allocator: a new process never sees the
# IDs an old one had, exactly the situation the virtualization plugin exists
# for.  Nothing here may make them stable.

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.plugin._verbs import Directory, DirectoryFactory
from ckpt.verbs import _enums as e
from ckpt.verbs import _links, _shm
from ckpt.verbs import _wire as w
from ckpt.verbs._attrs import WC, AsyncEvent, PathRecord
from ckpt.verbs._handles import MRHandle
from ckpt.verbs._rx import ACK_LATER, ACK_NOW, DELAYED_ACK, ReceiveEngine, RxChannel, env_seconds
from ckpt.verbs._subnet import ENV_NODE

if TYPE_CHECKING:
    from ckpt.verbs._qp import QPHandle
    from ckpt.verbs._requester import Requester

log = logging.getLogger(__name__)


#: Longest an empty CQ.poll waits for a completion before returning none (seconds).
POLL_WAIT = env_seconds("CKPT_SIMIB_POLL_WAIT", 0.0005)


@dataclass(frozen=True)
class HcaStatistics:
    """Counters of one simulated HCA (``Context.statistics()``)."""

    packets_sent: int  # every packet handed to a link: requests, ACKs, NAKs, responses
    packets_received: int
    payload_bytes_sent: int
    payload_bytes_received: int
    packets_lost: int  # dropped at this HCA: link down, no route, peer gone
    retransmissions: int  # go-back-N restarts (timeouts, sequence NAKs, RNR back-offs)
    rnr_naks_received: int
    path_migrations: int
    doorbells: int  # writes to a link: a chain of WRs, or the WRs a poll flushed (`Hca.defer`), is one
    acks_sent: int  # ACK packets
    acks_carried: int  # ACKs a request carried instead (`_wire.F_ACK`)
    packets_polled: int  # packets executed on a thread that polled (poll-driven progress), not a reader thread
    direct_ops: int  # one-sided WRs executed in a same-host peer's shared memory, no packet (`_shm`)


class Timers:
    """One thread running callbacks at deadlines (retransmission, RNR back-off, path arming)."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name=f"{name}-timers", daemon=True).start()

    def at(self, deadline: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), fn))
            if self._heap[0][2] is fn:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # a timer must never kill the NIC
                log.exception("simib timer callback failed")


class Hca:
    """The NIC of one device in this process."""

    def __init__(self, name: str, directory: DirectoryFactory | None = None, host: str | None = None) -> None:
        self.name = name
        self.provider = name.rstrip("0123456789")  # devices are named <provider><index>
        self.guid = secrets.randbits(63) | 1
        self.handles = itertools.count(1)
        self._qpn = itertools.count(secrets.randbelow(0xE00000) + 0x100)
        self._key = itertools.count(secrets.randbits(31) + 0x1000, secrets.randbelow(64) * 2 + 3)
        self.qps: dict[int, QPHandle] = {}
        self.mrs_by_lkey: dict[int, MRHandle] = {}
        self.mrs_by_rkey: dict[int, MRHandle] = {}
        self._last_inline: MRHandle | None = None
        self.unsent: dict[Requester, None] = {}  # QPs with posted WRs that wait for a flush (`defer`)
        self.atomic_lock = threading.Lock()
        self.timers = Timers(name)
        self._doorbell = threading.Lock()
        self._doorbell.acquire()  # rung (released) by a completion while a poller waits on it
        self.poll_waiters = 0
        self._events: deque[AsyncEvent] = deque()
        self._events_cond = threading.Condition()
        self._conns: dict[str, w.Connection] = {}
        self._conns_lock = threading.Lock()
        self._routes: dict[int, tuple[str, int]] = {}
        self._busy_until = [0.0, 0.0, 0.0]
        self.counts = dict.fromkeys(HcaStatistics.__dataclass_fields__, 0)

        host = host or os.environ.get("CKPT_SIMIB_HOST", "127.0.0.1")
        # simib's own HCAs (found through the SM) are one machine's processes, mostly; a provider
        # with a directory of its own (ib2tcp's `tcp`) is TCP by definition
        self.same_host = directory is None and _links.LOCAL_IPC
        self.listeners, self.endpoint = _links.listen(host, self.same_host)
        self.table: _shm.Table | None = None  # what same-host peers read to place one-sided operations (`_shm`)
        self._peers: dict[str, _shm.Peer | float | None] = {}  # float: when to try to map its tables again
        self.link_up: dict[int, bool] = {}
        self.lids: list[int] = []  # the SM may push link states before register() returns
        try:
            if self.same_host and _shm.ENABLED:
                self.table = _shm.Table(self.endpoint)
            self.sm: Directory = (directory or _subnet_manager)(self._on_link)
            node = os.environ.get(ENV_NODE)  # the machine it stands for: docs/verbs.md, "Nodes"
            extra = {"node": node} if node else {}  # a directory written before nodes takes no `node`
            reply = self.sm.register(
                guid=self.guid, name=name, endpoint=self.endpoint, pid=os.getpid(), host=host, **extra
            )
            self.lids = list(reply["lids"])
            self.sm_lid = int(reply["sm_lid"])
            self.latency = float(reply.get("latency") or 0.0)
            self.bandwidth = float(reply.get("bandwidth") or 0.0)
            for lid, up in dict(reply.get("links") or {}).items():
                self.link_up.setdefault(int(lid), bool(up))
            self.rx = ReceiveEngine(self, self.listeners)
        except BaseException:  # no HCA: nothing may keep listening for it, or publish for it
            for sock in self.listeners:
                sock.close()
            if self.table is not None:
                self.table.close()
            raise
        log.debug("HCA %s: LIDs %s, endpoint %s", name, self.lids, self.endpoint)

    # ------------------------------------------------------------------ identities
    def new_qpn(self) -> int:
        return next(self._qpn) & 0xFFFFFF

    def new_key(self) -> int:
        return next(self._key) & 0xFFFFFFFF

    def port_of_lid(self, lid: int) -> int:
        return self.lids.index(lid) + 1 if lid in self.lids else 0

    def statistics(self) -> HcaStatistics:
        """What this HCA has sent and received since the process opened it."""
        return HcaStatistics(**self.counts)

    # ------------------------------------------------------------------ polling
    def wait_for_completion(self, entries: deque[WC]) -> None:
        """An empty poll: come back as soon as a completion lands, or after at most POLL_WAIT.

        The polling thread runs the receive engine itself if nobody else does (poll-driven
        progress, `_rx`): a reply it waits for then completes on this thread, with no hand-over
        from a NIC thread.  Otherwise it blocks on the doorbell, releasing the GIL and the core
        (a program spinning on an empty CQ would hold the GIL for a whole switch interval while
        the thread with its completion waits), and any completion on this HCA rings it.  The
        doorbell is a bare lock, the cheapest thing a thread can block on and be woken from.
        """
        if self.rx.drive(entries.__len__, POLL_WAIT, entries) or entries:
            return
        self.poll_waiters += 1
        try:
            if not entries:
                self._doorbell.acquire(timeout=POLL_WAIT)
        finally:
            self.poll_waiters -= 1

    def wake_pollers(self) -> None:
        """A completion was queued: ring the doorbell for the threads waiting on it (`poll_waiters`)."""
        try:
            self._doorbell.release()
        except RuntimeError:  # already rung and not yet answered
            pass

    # ------------------------------------------------------------------ doorbell batching
    def defer(self, qp: Requester) -> None:
        """`qp` has WRs posted behind others still in flight: send them with the next flush (QP lock held).

        A post to an idle QP leaves at once, on the caller's thread (the latency path).  A post
        behind WRs in flight waits for the first of: the next poll of a CQ of this HCA (by any
        thread: `flush`), or the progress of those WRs -- their ACK or response, or their
        retransmission, which pumps the QP (`Requester._progress`, `_on_timer`).  So posting in a
        loop costs one socket write per poll, not one per WR, as a NIC fetches WQEs in bursts;
        and a program that never polls is not kept waiting longer than its peer's coalesced ACK.
        """
        self.unsent[qp] = None

    def flush(self) -> None:
        """Send what `defer` held back (a polling thread, in blocking writes, before it waits)."""
        unsent = self.unsent
        while unsent:
            try:
                qp = next(iter(unsent))
                del unsent[qp]
            except (StopIteration, KeyError, RuntimeError):  # another thread took it meanwhile
                continue
            with qp.lock:
                qp._pump(blocking=True)

    # ------------------------------------------------------------------ events
    def event(self, event_type: int, element: Any) -> None:
        with self._events_cond:
            self._events.append(AsyncEvent(event_type, element))
            self._events_cond.notify_all()

    def get_event(self, timeout: float | None) -> AsyncEvent | None:
        with self._events_cond:
            if not self._events_cond.wait_for(lambda: self._events, timeout):
                return None
            return self._events.popleft()

    def _on_link(self, lid: int, up: bool) -> None:
        self.link_up[lid] = up
        if lid in self.lids:
            self.event(e.IBV_EVENT_PORT_ACTIVE if up else e.IBV_EVENT_PORT_ERR, self.port_of_lid(lid))
        if not up:
            self._routes.pop(lid, None)

    def paths_to(self, dlid: int) -> list[PathRecord]:
        """Every path from this HCA's two ports to the HCA owning `dlid`, from the subnet manager's routes
        (`PathRecord`); empty if no HCA has `dlid` or the directory has no routes (a transport without a
        subnet manager)."""
        routes = getattr(self.sm, "routes", None)
        if routes is None:
            return []
        table = {int(lid): route for lid, route in routes().items()}
        target = table.get(dlid)
        if target is None:
            return []
        ports = sorted(
            (int(r["port"]), lid, bool(r["up"])) for lid, r in table.items() if r["endpoint"] == target["endpoint"]
        )
        return [
            PathRecord(sport, lid, dport, up and self.link_up.get(slid, True))
            for sport, slid in enumerate(self.lids, start=1)
            for dport, lid, up in ports
        ]

    # ------------------------------------------------------------------ sending
    def path_ok(self, port: int, dlid: int) -> bool:
        """Can a packet leave `port` for `dlid` right now (links up, peer reachable)?"""
        slid = self.lids[port - 1]
        if not self.link_up.get(slid, True) or not self.link_up.get(dlid, True):
            return False
        route = self._resolve(dlid)
        if route is None:
            return False
        conn = self._conns.get(route[0])
        return conn is None or conn.alive

    def transmit(self, port: int, dlid: int, header: tuple[Any, ...], payload: list[Any], blocking: bool) -> bool:
        """Send one packet on the path (port, dlid); False if it is lost (link down, no route, peer gone).

        `header` is every field of `_wire.HEADER` in order, with 0.0 for arrival (the link model's).
        """
        return self.transmit_many(port, dlid, [(header, payload)], blocking)

    def transmit_many(
        self, port: int, dlid: int, packets: list[tuple[tuple[Any, ...], list[Any]]], blocking: bool
    ) -> bool:
        """Send packets on one path with one write (a doorbell for a chain of WRs); False if they are lost."""
        slid = self.lids[port - 1]
        links_up = self.link_up.get(slid, True) and self.link_up.get(dlid, True)
        route = self._resolve(dlid) if links_up else None
        conn = self._connection(route[0]) if route is not None else None
        if conn is None:
            why = "no route or peer gone" if links_up else "link down"
            log.debug("%s: %d packet(s) to LID %d lost: %s", self.name, len(packets), dlid, why)
            self.counts["packets_lost"] += len(packets)
            return False
        counts = self.counts
        counts["packets_sent"] += len(packets)
        counts["doorbells"] += 1
        buffers: list[Any] = []
        pack = w.HEADER.pack
        modelled = self.latency or self.bandwidth
        for header, payload in packets:
            counts["payload_bytes_sent"] += header[8]
            if modelled:
                header = (*header[:16], self._arrival(port, w.HEADER_SIZE + header[8]), header[17])
            buffers.append(pack(*header))
            buffers.extend(payload)
        return conn.send(buffers) if blocking else conn.post(buffers)

    def _arrival(self, port: int, size: int) -> float:
        """When a packet of `size` bytes leaving `port` now arrives under the link model."""
        now = time.monotonic()
        done = now
        if self.bandwidth:
            done = max(now, self._busy_until[port]) + size / self.bandwidth
            self._busy_until[port] = done
        return done + self.latency

    def _resolve(self, lid: int) -> tuple[str, int] | None:
        route = self._routes.get(lid)
        if route is None:
            try:
                endpoint, port, up = self.sm.resolve(lid)
            except Exception as exc:  # the SM went away: nothing new can be resolved
                log.debug("resolve LID %d failed: %s", lid, exc)
                return None
            if endpoint is None or port is None:
                return None
            self.link_up.setdefault(lid, up)
            route = self._routes[lid] = (endpoint, port)
        return route

    def _connection(self, endpoint: str) -> w.Connection | None:
        conn = self._conns.get(endpoint)
        if conn is not None:
            return conn if conn.alive else None
        with self._conns_lock:
            conn = self._conns.get(endpoint)
            if conn is None:
                try:
                    sock = _links.connect(endpoint, self.same_host)
                except OSError as exc:
                    log.debug("cannot reach HCA at %s: %s", endpoint, exc)
                    return None
                conn = w.Connection(sock, endpoint, self._connection_broken)
                self._conns[endpoint] = conn
        return conn if conn.alive else None

    def direct_peer(self, dlid: int, entries: Sequence[Any] = ()) -> _shm.Peer | None:
        """The same-host HCA owning `dlid` if one-sided operations (`entries`) can be placed in its memory
        directly (`_shm`); None at once, with no system call, if one of them targets a region it is known not
        to publish."""
        route = self._routes.get(dlid) or self._resolve(dlid)
        if route is None or self.table is None:
            return None
        endpoint = route[0]
        known = self._peers.get(endpoint, 0.0)
        if endpoint == self.endpoint and known == 0.0:  # a loopback: this very HCA
            known = self._peers[endpoint] = _shm.Loopback(self.table)
        if not isinstance(known, float):  # a peer, or None: it publishes nothing, or is over TCP
            if known is None or known.refuses(entries):
                return None
            if known.alive():
                return known
            self._peers[endpoint] = None  # that process is gone (a restarted peer has another endpoint)
            return None
        if time.monotonic() < known:
            return None
        conn = self._connection(endpoint)
        if conn is None:
            self._peers[endpoint] = time.monotonic() + _shm.RETRY
            return None
        pid = _links.local_peer(conn.sock)
        try:
            found = self._peers[endpoint] = _shm.Peer.attach(pid, endpoint) if pid is not None else None
        except OSError as exc:
            log.debug("HCA %s: the tables of HCA %s not mapped (%s); trying again later", self.name, endpoint, exc)
            self._peers[endpoint] = time.monotonic() + _shm.RETRY
            return None
        return found

    def _connection_broken(self, conn: w.Connection) -> None:
        # Nothing to do at once: the QPs' retransmission timers find the path dead (path_ok) and
        # count their retries, so a dead peer gives RETRY_EXC_ERR after timeout * (retry_cnt + 1).
        log.debug("HCA %s: the connection to %s broke", self.name, conn.endpoint)

    # ------------------------------------------------------------------ receiving
    def dispatch(self, fields: tuple[Any, ...], reader: w.PacketReader, chan: RxChannel) -> None:
        """Execute one incoming packet (the receive engine's, on whichever thread runs it: `_rx`).

        A QP that owes an ACK goes to the channel's `acks` (sent at the end of the burst) or, for a
        coalesced one, to its `owed` (sent once DELAYED_ACK has passed, unless a request carried it).
        """
        counts = self.counts
        counts["packets_received"] += 1
        counts["payload_bytes_received"] += fields[8]
        arrival = fields[16]
        if arrival:
            delay = arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        dlid = fields[12]
        qp: QPHandle | None = self.qps.get(fields[4])
        if qp is None or not self.link_up.get(dlid, True) or not self.link_up.get(fields[11], True):
            reader.skip(fields[8])
            if qp is None and fields[0] == w.REQ:
                self.report_lost(fields)
            return
        if fields[0] == w.REQ:
            if fields[2] & w.F_ACK:
                qp.on_piggybacked_ack(fields[17])
            due = qp.on_request(fields, reader)
            if due == ACK_NOW:
                chan.acks[qp] = None
            elif due == ACK_LATER and qp not in chan.owed:
                chan.owe(qp, time.monotonic() + DELAYED_ACK)
        else:
            qp.on_response(fields, reader)

    def report_lost(self, fields: tuple[Any, ...]) -> None:
        """Tell a requester its packet vanished (a simulation aid: it then counts a retry on timeout)."""
        slid, dlid = fields[11], fields[12]
        port = self.port_of_lid(dlid) or 1
        lost = (
            w.LOST,
            0,
            0,
            0,
            fields[5],
            fields[4],
            fields[6],
            0,
            0,
            0,
            0,
            self.lids[port - 1],
            slid,
            0,
            0,
            0,
            0.0,
            0,
        )
        self.transmit(port, slid, lost, [], False)

    # ------------------------------------------------------------------ memory
    def register(self, mr: MRHandle) -> None:
        self.mrs_by_lkey[mr.lkey] = mr
        self.mrs_by_rkey[mr.rkey] = mr
        if self.table is not None:
            self.table.add_mr(mr)

    def mr_containing(self, addr: int, length: int) -> MRHandle | None:
        """The registered region holding [addr, addr + length) (inline data is found by address, not lkey)."""
        mr = self._last_inline  # a program posts inline data from the same buffer, mostly
        if mr is not None and mr.valid and mr.addr <= addr and addr + length <= mr.addr + mr.length:
            return mr
        for mr in self.mrs_by_lkey.values():
            if mr.addr <= addr and addr + length <= mr.addr + mr.length:
                self._last_inline = mr
                return mr
        return None

    def deregister(self, mr: MRHandle) -> None:
        mr.valid = False
        if self.table is not None:
            self.table.remove_mr(mr)
        self.mrs_by_lkey.pop(mr.lkey, None)
        self.mrs_by_rkey.pop(mr.rkey, None)


_hcas: dict[str, Hca] = {}
_hcas_lock = threading.Lock()


def hca(name: str, directory: DirectoryFactory | None = None, host: str | None = None) -> Hca:
    """The process's HCA for device `name`, created (and registered with its directory) on first use."""
    with _hcas_lock:
        found = _hcas.get(name)
        if found is None:
            found = _hcas[name] = Hca(name, directory, host)
        return found


def _subnet_manager(on_link: Callable[[int, bool], None]) -> Directory:
    from ckpt.verbs import fabric

    return fabric.connect_default(on_link=on_link)
