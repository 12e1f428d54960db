"""The three APM modules and the asynchronous event thread, as one wrapper of a process's verbs table."""

# After Vishnu et al., "Automatic Path Migration over InfiniBand: Early
# Experiences", §3, with the verbs table as the "communication layer":
#
# * Alternate path specification (`alternate`): for an RC QP on (port p, dlid
#   D), the path records to D's HCA (`Context.query_paths`, the subnet
#   manager's routes) give the candidates.  Preferred: the other port pair
#   (port 3-p to the peer's other port), disjoint from the primary at both
#   ends; else a healthy path sharing one end (it survives the other end's
#   link failing); else none -- reported, and tried again when a port comes
#   back (PORT_ACTIVE).
# * Path loading (`arm`): ALT_PATH + REARM (RTS -> RTS) once the program has
#   brought the QP to RTS, and again after every migration.  The HCA arms it a
#   moment later; libibverbs has no ARMED event, so nobody waits for it.
# * Path migration (`migrate`): a manual RTS -> RTS with path_mig_state
#   MIGRATED, for `--apm balance`, which moves every ARMED QP to its healthy
#   alternate path every interval.  Automatic migration is the HCA's own.
# * The event thread, one per device: takes every async event, re-specifies
#   and re-arms after PATH_MIG (so a second fault is survived too), counts
#   PATH_MIG_ERR, notes port faults and re-arms on PORT_ACTIVE -- then hands
#   the event on to the program, whose get_async_event reads from a queue, so
#   a program that watches its own events still sees every one.
#
# Programs that drive APM themselves (they load an alternate path or set a
# migration state) keep their QPs: APM leaves those alone.
#
# The plugin sits above ckpt_ib (CKPT_PLUGIN_ORDER): its handles are ckpt_ib's
# shadows, its modifies are in their histories, and ckpt_ib rebuilds every QP
# on the path it is on at a restart.  Its threads stop touching QPs from DRAIN
# to RESUME.

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckpt import verbs as v

log = logging.getLogger(__name__)
POLL = 0.2  # seconds an event thread waits for an event before it looks whether it must stop
EVENTS = 1024  # async events kept for the program per device (the oldest go first)
RETRY = 1.0  # seconds between tries of the QPs that had no healthy alternate path
FIRST_COMPLETION_WAIT = 60.0  # seconds a migrated QP's first completion is waited for (fault_to_completion)
_PATH_MASK = v.IBV_QP_STATE | v.IBV_QP_PORT | v.IBV_QP_AV | v.IBV_QP_TIMEOUT | v.IBV_QP_PKEY_INDEX
_PROGRAM_APM = v.IBV_QP_ALT_PATH | v.IBV_QP_PATH_MIG_STATE


@dataclass
class Statistics:
    """What APM did in this process (`ckpt_apm.statistics()`, and `ckpt status --json`)."""

    policy: str = "off"
    supported: bool = True  # False: the transport has no subnet manager (tcp): nothing to migrate to
    qps: int = 0  # RC QPs this plugin manages
    degraded: int = 0  # of them, those with no alternate path disjoint from their primary (or none at all)
    rearms: int = 0  # alternate paths loaded and REARMed
    failed_rearms: int = 0  # REARMs the QP refused
    no_alternate: int = 0  # times a QP had no healthy alternate path (re-tried when a port comes back)
    migrations_automatic: int = 0  # PATH_MIG nobody here asked for: on a fault, or a responder following its peer
    migrations_manual: int = 0  # PATH_MIG of a migration this plugin asked for (balance)
    migration_errors: int = 0  # PATH_MIG_ERR: the alternate path failed too
    port_faults: int = 0  # PORT_ERR events
    fault_to_migration: list[float] = field(default_factory=list)  # seconds from a port's fault to each PATH_MIG
    # seconds from a port's fault to the first completion the program polls on each QP it migrated
    fault_to_completion: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Managed:
    """One RC QP this plugin keeps an alternate path for."""

    qp: Any
    device: Any
    migrating: bool = False  # a manual migration was asked for: its PATH_MIG is not a fault's
    waiting: bool = False  # no healthy alternate path the last time: try again when a port comes back
    degraded: bool = False  # its alternate path shares an end with the primary: look for a disjoint one


class Apm:
    """APM over one process's verbs table (`install`); `pause`/`resume` around checkpoints."""

    def __init__(self, policy: str, interval: float, publish: Any = None) -> None:
        self.policy, self.interval, self.publish = policy, interval, publish
        self.stats = Statistics(policy=policy)
        self.inner: Any = None
        self.devices: dict[int, Any] = {}  # id(device handle) -> handle
        self.pds: list[tuple[Any, Any]] = []  # (pd, its device): a QP made on one after a restart is managed too
        self.device_of: dict[int, Any] = {}  # id(pd or qp handle) -> device handle
        self.managed: dict[int, Managed] = {}  # id(qp handle) -> Managed
        self.own: set[int] = set()  # id(qp) of QPs whose program drives APM itself
        self.events: dict[int, queue.Queue[Any]] = {}  # id(device) -> events for the program
        self.threads: dict[int, threading.Thread] = {}
        self.fault_at: dict[tuple[int, int], float] = {}  # (id(device), port) -> monotonic time of its PORT_ERR
        # qp_num (as the program sees it) of a QP migrated on a fault -> that fault's time, until its first
        # completion is polled (written by an event thread, read and emptied by the polling one: single dict ops)
        self.first_due: dict[int, float] = {}
        self.ops: Any = None  # the table: its poll_cq is `poll_cq` only while a first completion is due
        self.timing = threading.Lock()  # installs and removes that wrapper (never taken by a plain poll)
        # held while a thread touches QPs; the checkpoint holds it from DRAIN to RESUME (maybe released by
        # another thread than the one that took it: a Lock, not an RLock)
        self.lock = threading.Lock()
        self.paused = False
        self.stopping = threading.Event()
        self.said_unsupported = False
        self.supported_on: dict[int, bool] = {}  # id(device) -> whether it gives path records
        self.balanced_at = time.monotonic()
        self.retried_at: dict[int, float] = {}  # id(device) -> when its QPs without a good alternate were tried
        self.changed = False  # statistics changed since the last publication

    def __getstate__(self) -> dict[str, Any]:
        """What an image keeps: the devices and QPs (ckpt_ib's shadows) and the counters; no threads."""
        return {
            "policy": self.policy,
            "interval": self.interval,
            "stats": self.stats,
            "devices": list(self.devices.values()),
            "pds": list(self.pds),
            "managed": list(self.managed.values()),
            "own": [qp for qp in (m.qp for m in self.managed.values()) if id(qp) in self.own],
        }

    # ------------------------------------------------------------------ the table
    def install(self, ops: Any) -> None:
        """Wrap `ops` in place (ckpt_wrap_verbs): the program's calls pass through here first."""

        class Inner:
            pass

        self.inner = Inner()
        for name in v.OPERATIONS:
            setattr(self.inner, name, getattr(ops, name))
        for name in ("open_device", "close_device", "alloc_pd", "dealloc_pd", "create_qp", "destroy_qp", "modify_qp"):
            setattr(ops, name, getattr(self, name))
        ops.get_async_event = self.get_async_event
        self.ops = ops

    def poll_cq(self, cq: Any, num_entries: int) -> list[Any]:
        """The table's poll_cq while a migrated QP's first completion is due (`_time_first`): the program's
        completions, unchanged, the first one on such a QP timed.  Otherwise polls do not pass through here."""
        wcs: list[Any] = self.inner.poll_cq(cq, num_entries)
        if wcs:
            now = time.monotonic()
            for wc in wcs:
                fault = self.first_due.pop(wc.qp_num, None)
                if fault is not None:
                    self.stats.fault_to_completion.append(now - fault)
                    self.changed = True  # published by an event thread
            if not self.first_due:
                self._untime()
        return wcs

    def _time_first(self, qp_num: int, fault: float) -> None:
        """Time `qp_num`'s next completion from `fault`: poll_cq passes through `poll_cq` until it comes."""
        with self.timing:
            self.first_due[qp_num] = fault
            if self.ops is not None:
                self.ops.poll_cq = self.poll_cq

    def _untime(self) -> None:
        with self.timing:
            if not self.first_due and self.ops is not None:
                self.ops.poll_cq = self.inner.poll_cq

    def open_device(self, name: str) -> Any:
        device = self.inner.open_device(name)
        self._watch(device)
        return device

    def close_device(self, device: Any) -> None:
        self.inner.close_device(device)
        with self.lock:
            self.devices.pop(id(device), None)
            self.events.pop(id(device), None)
            self.threads.pop(id(device), None)  # its thread ends at its next look (the device is gone)

    def alloc_pd(self, device: Any) -> Any:
        pd = self.inner.alloc_pd(device)
        self.device_of[id(pd)] = device
        self.pds.append((pd, device))
        return pd

    def dealloc_pd(self, pd: Any) -> None:
        self.inner.dealloc_pd(pd)
        self.device_of.pop(id(pd), None)
        self.pds = [(p, d) for p, d in self.pds if p is not pd]

    def create_qp(self, pd: Any, init_attr: Any) -> Any:
        qp = self.inner.create_qp(pd, init_attr)
        if int(init_attr.qp_type) == int(v.IBV_QPT_RC):
            self.device_of[id(qp)] = self.device_of.get(id(pd))
        return qp

    def destroy_qp(self, qp: Any) -> None:
        with self.lock:
            self.managed.pop(id(qp), None)
            self.device_of.pop(id(qp), None)
            self.own.discard(id(qp))
            self.first_due.pop(qp.qp_num, None)
        self._untime()
        self.inner.destroy_qp(qp)

    def modify_qp(self, qp: Any, attr: Any, mask: int) -> None:
        if mask & _PROGRAM_APM:
            # the program drives APM on this QP itself: hands off -- before the modify, whose PATH_MIG
            # (a manual migration) would otherwise reach the event thread while the QP is still managed
            with self.lock:
                self.own.add(id(qp))
                dropped = self.managed.pop(id(qp), None)
                if dropped is not None:
                    self.stats.qps -= 1
            try:
                self.inner.modify_qp(qp, attr, mask)
            except BaseException:  # refused: nothing changed, so neither did who drives it
                with self.lock:
                    self.own.discard(id(qp))
                    if dropped is not None:
                        self.managed[id(qp)] = dropped
                        self.stats.qps += 1
                raise
            return
        self.inner.modify_qp(qp, attr, mask)
        device = self.device_of.get(id(qp))
        to_rts = mask & v.IBV_QP_STATE and int(attr.qp_state) == int(v.IBV_QPS_RTS)
        if device is None or not to_rts or id(qp) in self.own:
            return
        with self.lock:
            if id(qp) not in self.managed:
                self.managed[id(qp)] = Managed(qp, device)
                self.stats.qps += 1
            self.arm(self.managed[id(qp)])
            self.changed = True  # published by an event thread (no coordinator round trip on the program's)

    def get_async_event(self, device: Any, timeout: float | None) -> Any:
        events = self.events.get(id(device))
        if events is None:
            return self.inner.get_async_event(device, timeout)
        try:
            return events.get(timeout=timeout)
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ the modules
    def alternate(self, managed: Managed, port: int, dlid: int) -> tuple[v.PathRecord | None, bool]:
        """The alternate path specification module: the best healthy path to the peer other than the primary,
        and whether it is disjoint from it at both ends."""
        if not self.supports(managed.device):
            return None, False
        records: list[v.PathRecord] = self.inner.query_paths(managed.device, dlid)
        if not records:
            log.warning("QP %#x: no path records for LID %d", managed.qp.qp_num, dlid)
            return None, False
        dport = next((r.dport for r in records if r.dlid == dlid), 0)
        others = [r for r in records if r.up and (r.port_num, r.dlid) != (port, dlid)]
        disjoint = [r for r in others if r.port_num != port and r.dport != dport]
        best = disjoint or others
        return (best[0] if best else None), bool(disjoint)

    def supports(self, device: Any) -> bool:
        """Does the transport give path records?  Asked once per device, about its own port 1: a transport
        without a subnet manager (tcp) gives none, and APM says once that it is a no-op."""
        known = self.supported_on.get(id(device))
        if known is None:
            own = int(self.inner.query_port(device, 1).lid)
            known = self.supported_on[id(device)] = bool(self.inner.query_paths(device, own))
            if not known:
                self.stats.supported = False
                if not self.said_unsupported:
                    self.said_unsupported = True
                    log.warning("APM is a no-op here: the transport has no subnet manager to give alternate paths")
        return known

    def arm(self, managed: Managed, only_disjoint: bool = False) -> bool:
        """The path loading module: load the alternate path and REARM (caller holds the lock).

        A QP armed on a path that shares an end with its primary (all that was healthy) is `degraded`:
        a fault at that end would leave it nothing.  `only_disjoint`: re-arm only if a disjoint path is
        healthy now (the periodic look: a peer's port that came back sends this rank no event)."""
        attr, _ = self.inner.query_qp(managed.qp, _PATH_MASK)
        if int(attr.qp_state) != int(v.IBV_QPS_RTS):
            return False
        path, disjoint = self.alternate(managed, int(attr.port_num), int(attr.ah_attr.dlid))
        if only_disjoint and not disjoint:
            return False
        if path is None:
            if self.supported_on.get(id(managed.device)):
                self.stats.no_alternate += 1
                managed.waiting = True
                log.warning("QP %#x: no healthy alternate path to LID %d", managed.qp.qp_num, attr.ah_attr.dlid)
            return False
        arm = v.QPAttr(qp_state=v.IBV_QPS_RTS, path_mig_state=v.IBV_MIG_REARM)
        arm.alt_ah_attr = replace(attr.ah_attr, dlid=path.dlid, port_num=path.port_num)
        arm.alt_port_num, arm.alt_timeout, arm.alt_pkey_index = path.port_num, attr.timeout, attr.pkey_index
        try:
            self.inner.modify_qp(managed.qp, arm, v.IBV_QP_STATE | v.IBV_QP_ALT_PATH | v.IBV_QP_PATH_MIG_STATE)
        except v.PyverbsRDMAError as exc:
            self.stats.failed_rearms += 1
            log.warning("QP %#x: REARM refused: %s", managed.qp.qp_num, exc)
            return False
        self.stats.rearms += 1
        managed.waiting, managed.degraded = False, not disjoint
        return True

    def migrate(self, managed: Managed) -> bool:
        """The path migration module: move an ARMED QP to its alternate path now (caller holds the lock)."""
        attr, _ = self.inner.query_qp(managed.qp, v.IBV_QP_PATH_MIG_STATE | v.IBV_QP_STATE)
        if int(attr.path_mig_state) != int(v.IBV_MIG_ARMED) or int(attr.qp_state) != int(v.IBV_QPS_RTS):
            return False
        managed.migrating = True
        self.inner.modify_qp(
            managed.qp, v.QPAttr(qp_state=v.IBV_QPS_RTS, path_mig_state=v.IBV_MIG_MIGRATED), v.IBV_QP_PATH_MIG_STATE
        )
        return True

    # ------------------------------------------------------------------ the event thread
    def _watch(self, device: Any) -> None:
        with self.lock:
            self.devices[id(device)] = device
            self.events[id(device)] = queue.Queue(maxsize=EVENTS)
            thread = threading.Thread(target=self._events_of, args=(device,), name="apm-events", daemon=True)
            self.threads[id(device)] = thread
        thread.start()

    def _events_of(self, device: Any) -> None:
        while not self.stopping.is_set() and id(device) in self.devices:
            try:
                event = self.inner.get_async_event(device, POLL)
            except v.PyverbsError:
                return  # the device was closed under it
            try:
                if event is None:
                    self._idle(device)
                    continue
                with self.lock:
                    try:
                        self._handle(device, event)
                    finally:
                        self._hand_on(device, event)
            except Exception:  # one event's handling failed: the thread goes on (its counters say what it did)
                log.exception("APM: handling an event of %r failed", device)

    def _hand_on(self, device: Any, event: Any) -> None:
        """To the program: a QP's event to the device it was made on, a port's to every device (contexts of one
        HCA share its event queue here, and any of their threads may have taken it)."""
        element = event.element
        if isinstance(element, int):
            targets = list(self.events.values())
        else:
            owner = self.device_of.get(id(element), device)
            targets = [self.events[id(owner)]] if id(owner) in self.events else []
        for events in targets:
            if events.full():  # nobody reads them: keep the newest, as a bounded hardware event queue would
                events.get_nowait()
            events.put_nowait(event)

    def _handle(self, device: Any, event: Any) -> None:
        kind, element = int(event.event_type), event.element
        managed = self.managed.get(id(element))
        if kind == int(v.IBV_EVENT_PORT_ERR):
            self.stats.port_faults += 1
            self.fault_at[(id(device), int(element))] = time.monotonic()
        elif kind == int(v.IBV_EVENT_PORT_ACTIVE):
            self.fault_at.pop((id(device), int(element)), None)
            # a link is back: every QP gets the best alternate path again -- one with none gets one, one armed
            # on a path sharing an end with its primary (all there was) gets the disjoint pair back, so a fault
            # on the port it still uses is survived too
            for other in list(self.managed.values()):
                self.arm(other)
        elif kind == int(v.IBV_EVENT_PATH_MIG) and managed is not None:
            if managed.migrating:
                managed.migrating = False
                self.stats.migrations_manual += 1
            else:
                self.stats.migrations_automatic += 1
                faults = [t for (dev, _), t in self.fault_at.items() if dev == id(device)]
                if faults:  # timed from the latest fault on the device: a second fault's migration from it
                    latest = max(faults)
                    self.stats.fault_to_migration.append(time.monotonic() - latest)
                    self._time_first(managed.qp.qp_num, latest)
                log.info("QP %#x migrated to its alternate path", managed.qp.qp_num)
            self.arm(managed)  # the next alternate path: a second fault is survived too
        elif kind == int(v.IBV_EVENT_PATH_MIG_ERR) and managed is not None:
            managed.migrating = False
            self.stats.migration_errors += 1
            log.warning("QP %#x: path migration failed (PATH_MIG_ERR): its alternate path is down", managed.qp.qp_num)
        else:
            return
        self._publish()

    def _idle(self, device: Any) -> None:
        """No event for a while: look again for the QPs with no alternate path or a degraded one (a peer's
        port that came back sends no event here), and under `balance` move every ARMED QP to its alternate."""
        if self.changed:
            self.changed = False
            self._publish()
        now = time.monotonic()
        for qp_num, fault in list(self.first_due.items()):  # a QP that never completes again is not timed
            if now - fault > FIRST_COMPLETION_WAIT:
                self.first_due.pop(qp_num, None)
                self._untime()
        if now - self.retried_at.get(id(device), 0.0) >= RETRY and not self.paused:
            self.retried_at[id(device)] = now
            armed = False
            with self.lock:
                for managed in [m for m in self.managed.values() if m.device is device]:
                    if managed.waiting:
                        armed |= self.arm(managed)
                    elif managed.degraded:
                        armed |= self.arm(managed, only_disjoint=True)
            if armed:  # no event follows a peer's port coming back: publish the re-arms now
                self._publish()
        if self.policy != "balance" or now - self.balanced_at < self.interval or self.paused:
            return
        self.balanced_at = now
        with self.lock:
            for managed in list(self.managed.values()):
                if managed.device is device:
                    self.migrate(managed)

    def _publish(self) -> None:
        managed = list(self.managed.values())
        self.stats.degraded = sum(1 for m in managed if m.degraded or m.waiting)
        if self.publish is not None:
            try:
                self.publish(self.stats.as_dict())
            except Exception as exc:  # statistics are best effort: never let them stop the event thread
                log.debug("APM statistics not published: %s", exc)

    # ------------------------------------------------------------------ checkpoints
    def pause(self) -> None:
        """From DRAIN on: no thread touches a QP (it holds the lock until `resume`)."""
        if not self.paused:
            self.lock.acquire()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.lock.release()

    def restored(self, state: dict[str, Any]) -> None:
        """After a restart: the image's devices and QPs (rebuilt by ckpt_ib), their threads started again, and
        every QP left MIGRATED re-armed (ckpt_ib re-armed those that were ARMED)."""
        self.stats = state["stats"]
        self.pds = list(state["pds"])
        for pd, device in self.pds:
            self.device_of[id(pd)] = device
        for managed in state["managed"]:
            self.managed[id(managed.qp)] = managed
            self.device_of[id(managed.qp)] = managed.device
            managed.migrating = False
        self.own = {id(qp) for qp in state["own"]}
        for device in state["devices"]:
            self._watch(device)
        with self.lock:
            for managed in list(self.managed.values()):
                attr, _ = self.inner.query_qp(managed.qp, v.IBV_QP_PATH_MIG_STATE)
                if int(attr.path_mig_state) == int(v.IBV_MIG_MIGRATED):
                    self.arm(managed)
        self._publish()

    def stop(self) -> None:
        """Stop the event threads and wait for them (a device's async events are the process's: a thread left
        running would take them from whoever opens the device next)."""
        self.stopping.set()
        self.resume()
        for thread in list(self.threads.values()):
            if thread is not threading.current_thread():
                thread.join(timeout=2 * POLL + 1.0)
