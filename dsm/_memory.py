"""Home-based lazy release consistency (HLRC) over ckpt.verbs: one rank's side of the shared memory.

Rationale.  Pages (4 KiB by default) of collectively allocated arrays are
cached on every rank; each page has a *home* (whoever touched it first) whose
copy is the master.  A rank works in *intervals* delimited by synchronisation
(lock acquire and release, barriers).  The first write to a non-home page in
an interval saves a *twin*; when the interval closes, the run-length *diff*
against the twin goes to the home, and the interval's *write notices* (which
pages it wrote, and their homes) are recorded under the rank's *vector
timestamp*.  Notices travel lazily: with a lock grant (the notices released
through that lock that the acquirer has not seen) and at barriers (all of
them).  Receiving a notice invalidates the page (unless this rank is its
home) and raises the version its next fetch must have; a fault on an invalid
page fetches it from the home.

Invariants:
* a rank knows the notice of every interval (q, i) with i <= vt[q] (notices
  and vector timestamps only travel together);
* a release completes only after its diffs are in the homes' copies (its
  message may arrive before them: `dsm._intervals`), and a home serves a version
  a notice asks for only once it holds it;
* every synchronisation point closes the current interval first, so no dirty
  page is ever invalidated (a rank's own writes are never lost).

Protocols (`dsm.PROTOCOLS`): ``async`` is HLRC over VIA with an asynchronous
protocol handler (request/response: home look-up, page fetch, diff + ACK);
``onesided`` is NEWGENDSM (Noronha and Panda): first-touch home assignment by
CMP_AND_SWP on the default home's home table, pages fetched by RDMA READ of
``meta, page, meta`` retried until both metadata reads agree, show no diff in
progress and hold every needed interval (ARDMAR), and diffs written run by run
into the home's page by RDMA WRITE between two RDMA WRITEs of the writer's own
metadata column, ``-interval`` then ``interval`` (DRAW: the paper sends the
timestamps in a message; writing them is fully one-sided).  Locks and barriers
use the handler under both.

Checkpoints: the DSM is ordinary program state (numpy arrays, verbs objects)
pickled with the program; the handler thread stops at DRAIN (every program
thread is parked at a step boundary, so no request is unanswered) and starts
again at RESUME, after the verbs plugin has rebuilt the queue pairs.  In an
independent checkpoint of one rank the others run on: their requests to it
wait (in its receive queues or its inbox) until it resumes.

Single-rank recovery (FT-KDSM §5): a failed rank's links fail instead of
the rank, its requests stay pending and are re-sent once its next incarnation
is connected (`dsm._reconnect`, `dsm._net`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import numpy as np

import ckpt
from ckpt import verbs
from ckpt.plugin import PluginCalls, Runtime

from . import HLRC, PROTOCOLS, _fetch, _onesided, _reconnect, _replay, _waits, hookspecs
from ._array import Lock, SharedArray
from ._diff import diff_unit
from ._errors import DsmError, check_synchronising
from ._handler import Handler
from ._intervals import Intervals
from ._messages import (
    Ack,
    AcquireRequest,
    BarrierReply,
    BarrierRequest,
    Grant,
    HomeReply,
    HomeRequest,
    Notice,
    ReleaseRequest,
    Reply,
    Request,
)
from ._net import ACCESS, Endpoint, atomic
from ._region import DIRTY, INVALID, Region, gid_of
from ._replay import PageVersions, Replay
from ._requests import WINDOW
from ._stats import Counters, Statistics
from ._waits import Standing, WaitReport

log = logging.getLogger("dsm")
HOOKS = [name for name in dir(hookspecs) if name.startswith("dsm_")]
#: The hooks the handler thread fires: they go on while this rank replays (it serves the others meanwhile).
HANDLER_HOOKS = frozenset({"dsm_diffs_received", "dsm_diff_received", "dsm_diff_applied", "dsm_page_served"})


#: `Memory`'s attributes `_live` makes, never pickled.
PER_PROCESS = (
    "_thread",
    "_stop",
    "_failure",
    "_plugins",
    "_fire",
    "_in_waiting",
    "waiting_for",
    "_wait_report",
    "_standing",
)


class Memory(Intervals):
    """One rank's handle on the shared memory; `dsm.attach(rt)` makes it (collectively)."""

    # per-process parts, made by _live() (at attach and after unpickling), never pickled
    _thread: threading.Thread | None
    _stop: threading.Event
    _failure: BaseException | None
    _plugins: PluginCalls | None
    _wait_report: WaitReport | None
    _standing: Standing | None
    _fire: frozenset[str]
    _in_waiting: bool

    def __init__(self, rt: Any, protocol: str, page_size: int) -> None:
        if protocol not in HLRC:  # (attach makes a Cashmere for "cashmere")
            raise DsmError(f"unknown DSM protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if page_size < 64 or page_size & (page_size - 1):
            raise DsmError(f"page size must be a power of two of at least 64 bytes, not {page_size}")
        self.rt, self.rank, self.size = rt, rt.rank, rt.size
        self.protocol, self.page_size = protocol, page_size
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        slot = page_size + 1024
        self.client = Endpoint(self.ctx, self.pd, self.size, slot, nrecv=WINDOW * 2, nsend=WINDOW * 2)
        self.server = Endpoint(self.ctx, self.pd, self.size, slot, nrecv=WINDOW * 2, nsend=WINDOW * 2)
        # metadata read twice (ARDMAR) for FETCH_BATCH pages at once (the first pair is a single fetch's), then
        # an atomic's landing word, DRAW's -interval and interval sources
        self.scratch = np.zeros(2 * self.size * _onesided.FETCH_BATCH + 3, dtype=np.int64)
        self.scratch_mr = verbs.MR(self.pd, self.scratch, ACCESS)
        self.regions: list[Region] = []
        self.vt = [0] * self.size
        self.floor = [0] * self.size  # vector timestamp of the last barrier: older notices are forgotten
        self.known: dict[tuple[int, int], list[int]] = {}  # (writer, interval) -> [gid, home, ...]
        self.dirty: set[int] = set()
        self.held: dict[int, list[int]] = {}  # lock -> the lock's vector timestamp at the grant
        #: Held locks whose release a replay found logged last: sent again live, they are being released.
        self.releasing: set[int] = set()
        #: The last barrier passed: (epoch, its reply's vector timestamp, its notices), for a recovered manager.
        self.last_reply: tuple[int, list[int], list[Notice]] | None = None
        self.tokens: dict[int, int] = {}  # lock held -> the token of its acquisition
        self.nlocks = 0
        self.acquires = 0  # acquisitions so far: each one's token (a replay re-counts them alike)
        self.writing = 0  # open `with a.write(...)` blocks: no synchronisation may close their interval
        self.epoch = 0
        self.rid = 0
        self.seq = [0]
        self.replies: dict[int, Reply] = {}
        # requests sent and not answered: rid -> (destination, request, link it went out on; -1: not sent)
        self.pending: dict[int, tuple[int, Request, int]] = {}
        self.reconnections_seen = 0
        self.counters = Counters()
        self.handler = Handler(self)
        #: Twin pages this rank is home of too, so its own writes also make diffs (`dsm_diff_created` with
        #: home == this rank, never sent): set by a plugin in `dsm_attached` (remote logging keeps them).
        self.twin_homes = False
        #: A release leaves only once its interval's diffs are at their homes, instead of with them
        #: (`release`): set by a plugin whose recovery relies on it, in `dsm_attached` (remote logging).
        self.release_after_diffs = False
        #: State plugins keep with this memory, by plugin name: pickled with it, so it checkpoints with it.
        self.extensions: dict[str, Any] = {}
        #: A home's page history for replaying ranks (`dsm._replay.PageVersions`), set by a plugin (remote logging).
        self.versions: PageVersions | None = None
        #: While this rank replays its logs after a recovery (`start_replay`): its log; else None.
        self.replay: Replay | None = None
        self.replay_started = self.replay_published = 0.0
        self._live()
        me = {"lid": self.ctx.query_port(1).lid, "client": self.client.address(), "server": self.server.address()}
        if self.rank == 0:  # names this memory in the job's KV keys (a job may attach several)
            me["memory"] = rt.allocate_global("dsm.memory")
        peers = rt.allgather(me)
        self.mid = int(peers[0]["memory"])
        self.client.connect(peers, self.rank, "server")
        self.server.connect(peers, self.rank, "client")
        self._start()
        rt.allgather(None)  # every QP is in RTS before anyone sends
        self.hook("dsm_attached")  # collective: its implementations may call rt.allgather
        self._decide_hooks()  # again: an implementation may have registered hook objects for this memory

    # ------------------------------------------------------------------ public API
    def array(self, shape: int | tuple[int, ...], dtype: Any = np.float64) -> SharedArray:
        """Collective: a shared array of zeros; the same handle on every rank (call in the same order everywhere)."""
        self._check()
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        unit = diff_unit(np.dtype(dtype))
        region = Region(self.pd, len(self.regions), nbytes, unit, self.page_size, self.rank, self.size)
        self.regions.append(region)  # before the allgather: peers may ask for its pages right after it
        region.peers = self.rt.allgather(region.address())
        return SharedArray(self, region, shape, np.dtype(dtype))

    def lock(self) -> Lock:
        """Collective by convention (call in the same order everywhere): a new lock, homed at id mod size."""
        self.nlocks += 1
        return Lock(self, self.nlocks - 1)

    def barrier(self) -> None:
        """Global barrier: diffs go home, every rank's write notices reach every rank."""
        self._check("barrier()")
        self._close_interval()  # its diffs count as flush time, not barrier time
        self._caught_up()
        started = time.perf_counter()
        self.epoch += 1
        notices: list[Notice] = [[q, i, flat] for (q, i), flat in self.known.items() if i > self.floor[q]]
        replayed = _replay.barrier(self, self.epoch) if _replay.replaying(self) else "live"
        if replayed == "replayed":
            return
        if replayed == "live":  # else its arrival is logged: sent again, not logged again
            self.hook("dsm_barrier_arriving", epoch=self.epoch, notices=notices)
        # a barrier waits for the slowest rank, however long it computes: no timeout (a dead peer is a QP error)
        request = BarrierRequest(self._next_rid(), self.epoch, self.vt, notices)
        reply = self._wait_for("barrier", self.epoch, 0, request, BarrierReply)
        self.last_reply = (self.epoch, list(reply.vt), reply.notices)
        self._merge(reply.vt, reply.notices, "barrier")
        self.passed_barrier()
        self.counters.barriers += 1
        self.counters.barrier_seconds += time.perf_counter() - started
        self.hook("dsm_barrier_passed", epoch=self.epoch)

    def passed_barrier(self) -> None:
        """Every rank's notices up to this barrier are known everywhere: forget them."""
        self.floor = list(self.vt)
        self.known = {key: flat for key, flat in self.known.items() if key[1] > self.floor[key[0]]}
        self.handler.prune(self.floor)

    def _caught_up(self) -> None:
        """After a synchronisation's interval closed: a catch-up that follows a replay ends here (`dsm._replay`)."""
        if self.replay is not None and self.replay.done:
            _replay.finish(self)

    def start_replay(self, replay: Replay) -> None:
        """Replay `replay` (this process replaced a failed rank; `dsm._replay`): called by the plugin that keeps
        the logs in `dsm_recovering`, before it rebuilds the master copies of this rank's home pages."""
        _replay.start(self, replay)

    def close(self) -> None:
        """Leave the shared memory: stop the handler, destroy this rank's verbs objects.

        Not collective, and final: peers that still ask this rank for pages or
        locks get errors.  A program normally never calls it (its memory lives as
        long as the job); tests and long-lived processes that attach many times do.
        """
        self._halt()
        if self._standing is not None:
            try:
                self._standing.clear()  # nothing stands here any more: the handler is gone
            except Exception as exc:
                log.debug("dsm: rank %d's home report was not taken back: %s", self.rank, exc)
        if self._wait_report is not None:
            self._wait_report.close()
        if self._plugins is not None:
            self._plugins.unregister(self)
        self._plugins = None
        self._fire = frozenset()
        self.ctx.close()

    def statistics(self) -> Statistics:
        """This rank's counters and time breakdown since attach (frozen)."""
        with self.handler.mutex:  # the handler counts under it
            return self.counters.snapshot(self.protocol, self.rank, self.handler.counters)

    def account(self, name: str, amount: float = 1) -> None:
        """Add `amount` to statistics counter `name` (a `dsm.Statistics` field), for plugins (remote logging).

        Counted on the calling thread's own counters (the handler's or the program's), like the DSM's own.
        """
        counters = self.handler.counters if threading.current_thread() is self._thread else self.counters
        setattr(counters, name, getattr(counters, name) + amount)

    # ------------------------------------------------------------------ locks
    def acquire(self, lock: int) -> None:
        self._check("acquiring a lock")
        if lock in self.held:
            raise DsmError(f"lock {lock} is already held by this rank (DSM locks are not re-entrant)")
        self._close_interval()
        self._caught_up()
        started = time.perf_counter()
        self.acquires += 1
        if _replay.replaying(self) and _replay.acquire(self, lock):
            return
        acquire = AcquireRequest(self._next_rid(), lock, self.vt, self.acquires)
        reply = self._wait_for("lock", lock, lock % self.size, acquire, Grant)
        # a release leaves with its diffs: the grant may have overtaken those its notices name (`_await_diffs`)
        self._merge(reply.vt, reply.notices, f"lock {lock}", overtaken=not self.release_after_diffs)
        if reply.pages:
            self._take_riders(reply.pages)
        self.held[lock] = list(reply.vt)
        self.tokens[lock] = self.acquires
        seconds = time.perf_counter() - started
        self.counters.lock_acquires += 1
        self.counters.lock_seconds += seconds
        self.hook("dsm_lock_acquired", lock=lock, seconds=seconds)

    def release(self, lock: int) -> None:
        self._check("releasing a lock")
        if lock not in self.held:
            raise DsmError(f"lock {lock} is not held by this rank")
        at_grant = self.held[lock]
        # the release leaves with the interval's diffs, not after their acks: a rank that the lock's next grant
        # tells of them waits for them where they go (`_merge`, the homes' page service), not the releaser
        closed = self._close_interval(release=lock, defer=not self.release_after_diffs)
        self._caught_up()
        if _replay.replaying(self):
            if _replay.release(self, lock):
                return
            # logged last: it may have reached the home or not; sent again, not logged again
        else:
            self.hook("dsm_lock_releasing", lock=lock)
        started = time.perf_counter()
        notices = [[q, i, flat] for (q, i), flat in self.known.items() if i > max(at_grant[q], self.floor[q])]
        release = ReleaseRequest(self._next_rid(), lock, self.vt, notices, self.tokens.get(lock, 0))
        if closed is None:
            self._request(lock % self.size, release, Ack, f"release of lock {lock}")
        else:
            self._send_diffs(*closed, then=(lock % self.size, release, f"release of lock {lock}"))
        self.tokens.pop(lock, None)
        del self.held[lock]  # only now: a release that failed can be retried
        self.releasing.discard(lock)
        self.counters.lock_seconds += time.perf_counter() - started
        self.hook("dsm_lock_released", lock=lock)

    # ------------------------------------------------------------------ faults
    def read_fault(self, region: Region, pages: np.ndarray, span: tuple[int, int] | None = None) -> None:
        """Make `pages` readable (HLRC fetches whole pages: the access's bytes, `span`, do not matter)."""
        invalid = [int(page) for page in pages[region.state[pages] == INVALID]]
        self.counters.read_faults += len(invalid)
        if invalid:
            self._fetch_many(region, invalid)

    def write_fault(self, region: Region, pages: np.ndarray, span: tuple[int, int] | None = None) -> None:
        """Make `pages` writable: fetched if invalid, twinned if not written since the last interval closed."""
        todo = [int(page) for page in pages[region.state[pages] != DIRTY]]
        invalid = [page for page in todo if region.state[page] == INVALID]
        if invalid:
            self._fetch_many(region, invalid)
        for page in todo:
            self.counters.write_faults += 1
            if region.home[page] < 0:
                self._lookup_home(region, page)
            if region.home[page] != self.rank or self.twin_homes:
                region.twins[page] = region.program_page(page).copy()
                self.counters.twins += 1
            region.state[page] = DIRTY
            self.dirty.add(gid_of(region.aid, page))

    #: HLRC sends what a write block changed as diffs at the release, not when the block ends (`dsm._cashmere`
    #: writes through): `SharedArray` never calls `through_begin` / `through_end` on it.
    write_through = False

    def through_begin(self, region: Region, pages: np.ndarray) -> dict[int, np.ndarray] | None:
        raise DsmError("HLRC does not write through")

    def through_end(self, region: Region, before: dict[int, np.ndarray]) -> None:
        raise DsmError("HLRC does not write through")

    def _lookup_home(self, region: Region, page: int) -> None:
        """First touch: claim the page at its default home, or learn who did."""
        self._check()
        owner, gid = region.default_home(page), gid_of(region.aid, page)
        self.counters.home_lookups += 1
        if self.protocol == "async":
            lookup = HomeRequest(self._next_rid(), gid)
            home = int(self._request(owner, lookup, HomeReply, f"the home of page {gid:#x}").home)
        else:
            land = self.scratch_mr.buf + (len(self.scratch) - 2) * 8

            def claim() -> list[verbs.SendWR]:
                cas = verbs.IBV_WR_ATOMIC_CMP_AND_SWP
                return [atomic(cas, (land, self.scratch_mr.lkey), *region.remote_table(owner, page), 0, self.rank + 1)]

            self.client.run(owner, claim, self.seq)
            self.counters.count("cas", 8)
            old = int(self.scratch[-2])
            home = self.rank if old == 0 else old - 1
        region.home[page] = home
        if home == self.rank:
            self.counters.homes_taken += 1

    def _fetch_many(self, region: Region, pages: list[int]) -> None:
        _fetch.fetch_many(self, region, pages)

    def _fetch(self, region: Region, page: int) -> None:
        _fetch.fetch(self, region, page)

    # ------------------------------------------------------------------ hooks and the handler thread
    def fires(self, name: str) -> bool:
        """Whether DSM hook `name` has an implementation: a caller may skip building its arguments."""
        return name in self._fire and self._plugins is not None

    def hook(self, name: str, **kwargs: Any) -> None:
        """Fire DSM hook `name` through the rank's plugin host (its order; a failure is a PluginError naming the
        plugin), if any plugin implements it: a set look-up is all the hot path pays otherwise."""
        if name in self._fire and self._plugins is not None:
            if _replay.replaying(self) and name not in HANDLER_HOOKS:
                return  # replaying: what the program thread does was logged the first time
            self._plugins.call(name, memory=self, **kwargs)

    def _waiting(self, what: str) -> None:
        """A request has had no answer for WAKE seconds: `dsm_waiting`, on the program thread only, and never
        from inside itself (an implementation's own one-sided waits may come back here)."""
        if self._in_waiting or threading.current_thread() is self._thread:
            return
        self._in_waiting = True
        try:
            self.hook("dsm_waiting", what=what)
        finally:
            self._in_waiting = False

    def _look(self) -> None:
        """The handler thread, idle or between requests: what stands still at this home, for `ckpt status`
        (`dsm._waits.Standing`), at most every LOOK_EVERY seconds.  A report that fails is not the handler's
        failure: it is logged, and tried again at the next look."""
        standing = self._standing
        now = time.monotonic()
        if standing is None or now - standing.looked < _waits.LOOK_EVERY:
            return
        try:
            standing.look(self.handler.standing(), now)
        except Exception as exc:  # e.g. no thread to publish it with
            log.debug("dsm: what stands at rank %d was not reported: %s", self.rank, exc)

    def _live(self) -> None:
        """Per-process parts (thread, plugin host registration): at attach, and again after unpickling."""
        self._thread = None
        self._stop = threading.Event()
        self._failure = None
        self._in_waiting = False
        self.waiting_for = None
        self._wait_report = _waits.report(self.rt, self.rank)
        self.client.on_stuck = None if self._wait_report is None else self._wait_report.begin
        self._standing = None if self._wait_report is None else _waits.Standing(self._wait_report)
        host: PluginCalls | None = getattr(self.rt, "plugins", None)
        self._plugins = None
        self._fire = frozenset()
        if host is None:
            return
        host.add_hookspecs(hookspecs)  # when the dsm plugin is not loaded
        host.register(self, name=f"dsm-memory-{id(self)}")  # for ckpt_drain / ckpt_resume
        self._plugins = host
        self._decide_hooks()

    def _decide_hooks(self) -> None:
        """Which hooks have implementations: decided at attach (plugins are all loaded before a program
        attaches, and objects registered in `dsm_attached` count) and when restored, never on the hot path."""
        if self._plugins is not None:
            self._fire = frozenset(name for name in HOOKS if self._plugins.has_impl(name))

    def _start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name=f"dsm-handler-{self.rank}", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise DsmError("the DSM protocol handler did not stop within 30 s")
        self._thread = None

    def _serve(self) -> None:
        server = self.server
        try:
            # idle, it waits on no peer: a failed peer's RECOVERY_TIMEOUT bounds the waits of calls, not this
            while not self._stop.is_set() and server.wait(
                lambda: bool(server.inbox),
                "requests",
                math.inf,
                self._stop.is_set,
                recovery_bound=False,
                on_idle=self._look,
            ):
                # stop between requests: in an independent checkpoint the peers run on and may keep
                # the inbox full; what is left waits there (it is pickled) until RESUME
                while server.inbox and not self._stop.is_set():
                    peer, msg, _, link = server.inbox.pop(0)
                    self.handler.serve(peer, msg, link)  # dropped there if its incarnation died since
                self._look()
        except BaseException as exc:  # reported on the program thread at its next DSM call
            self._failure = exc
            log.error("rank %d: the DSM protocol handler failed: %s", self.rank, exc)

    def _check(self, synchronising: str = "") -> None:
        if self._failure is not None:
            raise DsmError(f"the DSM protocol handler of rank {self.rank} failed: {self._failure}")
        check_synchronising(self.writing, synchronising)

    @ckpt.hookimpl(tryfirst=True)
    def ckpt_drain(self) -> None:
        self._halt()  # every program thread is parked: nothing is waiting for this handler

    @ckpt.hookimpl(trylast=True)
    def ckpt_resume(self) -> None:
        self._start()  # after the verbs plugin refilled / rebuilt the queues

    # ------------------------------------------------------------------ single-rank recovery (dsm._reconnect)
    @ckpt.hookimpl
    def ckpt_rank_failed(self, rank: int, incarnation: int) -> None:
        """A survivor: stop using the links to `rank`; what the handler owed it is dropped."""
        _reconnect.peer_failed(self, rank, incarnation)

    # trylast: after ckpt_ib (below it) has dropped its translations of the recovered rank's IDs
    @ckpt.hookimpl(trylast=True)
    def ckpt_rank_recovered(self, rank: int, incarnation: int) -> None:
        """A survivor: connect to `rank`'s new incarnation; pending requests go again once it is up."""
        _reconnect.peer_recovered(self, rank, incarnation)

    # trylast: after ckpt_ib rebuilt this process's verbs objects (why REFRESH: dsm._reconnect)
    @ckpt.hookimpl(trylast=True)
    def ckpt_refresh(self, rt: Runtime) -> None:
        """The process that replaced a failed rank: rebuild every link, to every rank, on fresh QPs."""
        if getattr(rt, "recovered", False):
            _reconnect.recovered(self, int(rt.incarnation))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in PER_PROCESS:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # an image from before pipelined releases: `dsm_attached` does not fire again, so a plugin that kept
        # state here (remote or stable logging) cannot say it wants releases after their diffs -- assume it does
        state.setdefault("release_after_diffs", bool(state.get("extensions")))
        self.__dict__.update(state)
        self._live()
        if self._plugins is None:  # unpickled outside a ckpt rank: nothing will call ckpt_resume
            self._start()

    def __repr__(self) -> str:
        return f"<dsm.Memory rank {self.rank}/{self.size} {self.protocol} {len(self.regions)} arrays>"
