"""The protocol handler: what a rank's second thread does with the requests that reach it.

It serves, for the pages this rank is home (or default home) of and the locks
it is home of: home look-ups (first touch claims the page), page requests (a
page leaves only once the home's copy holds every interval the requester
needs, else the request waits for the diffs), diffs (applied, then
acknowledged: a writer's release completes only after its diffs are in the
home's copy, though its request may come first: `dsm._intervals`), lock
acquire / release (the lock's home keeps the vector timestamp of its last
release and the write notices released through the lock since the last
barrier, and grants in FIFO order, with copies of a few pages it homes that
the grantee's notices name), and, on rank 0, barriers (arrivals carry
their notices; when all have come, everyone gets the union and the
element-wise maximum of the vector timestamps).

The program thread of the same rank touches none of this state except through
`prune` and `replay_done`, under the handler's mutex; the runtime thread that
runs the recovery hooks only through `forget`, `forget_queues` and
`hold_locks`, under the same mutex (and `reports` and `awaited`, set before
this rank's handler thread starts; `published` it only reads); the thread
that waits for other ranks' post-replay reports only through `_rebuild`,
under the mutex.

After a peer fails (single-rank recovery, `dsm._reconnect`), nothing is owed to
its dead incarnation: `forget` drops its queued lock requests, its waiting
page requests and its barrier arrival (a reply to them would reach its next
incarnation, whose request ids mean other things).  A lock it held stays held
by that rank: its next incarnation, restored from an image, either releases
it or, re-executing, asks for it again -- which the home grants at once,
since the requester already holds it.  A rank that was itself restored from
its image clears every queue (`forget_queues`): the survivors send again
whatever they still wait for.

Recovery by replay (FT-KDSM §5, issue 13 part 5).  A rank restored from its
image replays its logs (`dsm._replay`) before it runs live; meanwhile:

* lock requests to it wait (`hold_locks` .. `replay_done`): the lock states
  of its image are older than what the survivors did since.  When the replay
  ends, each lock homed here is rebuilt from the survivors' reports (taken by
  `dsm._reconnect.survivor_report` after the failure) and this rank's own
  state -- holder and token from whoever holds it, vector timestamp the
  element-wise maximum of everyone's, notices the union of everyone's since
  the last barrier.  That over-approximates what the lock's last release
  published: a grant then invalidates more than needed, never less (a rank
  knows the notice of every interval its vector timestamp covers, and nobody
  can pass a barrier a lock acquirer has not reached).  Ranks that gave no
  report (recovering at the same time, or lost then) are waited for: their
  state after their own replays (`dsm._reconnect` "post-replay reports").  A
  lock two of them say they hold is the live one's, or the later grantee's:
  the other's release, logged last and sent again, was served by this home's
  previous incarnation and is recorded as done.  Then the held-back
  requests are served, in arrival order, before any later one;
* a release may reach a home twice (sent again after the replay, since its
  log record cannot say whether it left): the home keeps each lock's holder
  token and, per rank, the last token it released; a release that is not the
  holder's current one and is not newer than that rank's last is acked and
  changes nothing;
* the barrier manager keeps its last completed barrier's reply: an arrival for
  that barrier (sent again by a rank whose reply was lost with the manager's
  previous incarnation, or by a replaying rank gone live there) gets it at once.
  A recovered manager takes the newest reply any survivor, or any rank that
  recovered at the same time (its post-replay report), received: its
  predecessor may have completed a barrier and died before logging it.  It
  holds barrier arrivals back with the lock requests until it knows;
* minimal page versions (`OldPageRequest`) are served from `Memory.versions`,
  by the home's CPU under both protocols (recovery only, so off the hot path).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt import PluginError

from . import _reconnect
from ._diff import Diff
from ._errors import DsmError
from ._messages import (
    Ack,
    AcquireRequest,
    BarrierReply,
    BarrierRequest,
    DiffRequest,
    ErrorReply,
    Grant,
    HomeReply,
    HomeRequest,
    Message,
    Notice,
    OldPageRequest,
    PageReply,
    PageRequest,
    ReleaseRequest,
    decode,
)
from ._net import FAILED
from ._region import split_gid
from ._stats import Counters

if TYPE_CHECKING:
    from ._memory import Memory

log = logging.getLogger("dsm")
#: Put in the server's inbox by `replay_done` (never sent): wakes the handler thread to serve what waited.
WAKE = "dsm-replay-done"
#: Pages a lock grant carries at most (`Handler._riders`): a grantee's critical section reads a few.
RIDERS = 4
#: A rank's claim to hold a lock, in a lock home's rebuild: (rank, token, live, its vector timestamp, releasing).
Claim = tuple[int, int, bool, list[int], bool]


@dataclass
class LockState:
    """A lock at its home: who holds it, who waits, and what its last release published."""

    vt: list[int]
    holder: int = -1
    queue: deque[tuple[int, int, list[int], int]] = field(default_factory=deque)  # rank, request id, vt, token
    notices: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    token: int = 0  # the holder's acquisition token (`AcquireRequest.token`)
    released: dict[int, int] = field(default_factory=dict)  # rank -> the last token it released


class Handler:
    """The state behind the server endpoint; `serve` runs on the handler thread only."""

    def __init__(self, memory: Memory) -> None:
        self.mem = memory
        self.locks: dict[int, LockState] = {}
        self.arrivals: list[tuple[int, int, int, list[int], list[Notice]]] = []  # rank, rid, epoch, vt, notices
        self.waiting: list[tuple[int, int, int, list[int]]] = []  # page requests: rank, rid, gid, need
        self.counters = Counters()  # the handler's own: two threads never add to one counter
        self.mutex = threading.Lock()
        #: Rank 0: the last completed barrier's reply (epoch, vt, notices), for an arrival sent again.
        self.last_barrier: tuple[int, list[int], list[Notice]] | None = None
        #: While this rank, restored from its image, replays its logs: lock requests wait (`replay_done`).
        self.holding = False
        self.held_back: list[tuple[int, Any, int]] = []  # lock requests that wait: rank, request, link
        #: The survivors' reports of this rank's recovery (`dsm._reconnect`), until `replay_done` uses them.
        self.reports: dict[int, dict[str, Any]] = {}
        #: After a recovery: the rebuilt state a lock homed here starts from when it was never seen here.
        self.template: LockState | None = None
        #: This rank's incarnation, and whether its post-replay report is out (`dsm._reconnect.post_report`).
        self.incarnation = 0
        self.published = True
        #: Ranks that sent no report of this rank's recovery -> the incarnation whose post-replay report is awaited.
        self.awaited: dict[int, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["mutex"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"incarnation": 0, "published": True, "awaited": {}, **state})
        self.mutex = threading.Lock()

    # ------------------------------------------------------------------ dispatch
    def serve(self, src: int, raw: Any, link: int | None = None) -> None:
        """Serve request `raw` of rank `src`, which arrived on `src`'s link number `link` (None: the current one).

        A request of an incarnation declared lost is dropped: it arrived on a link replaced since, or
        the link is FAILED (`forget` ran or is about to).  Checked under the mutex that `forget`
        takes, so a request is either forgotten there or never queued / granted here.  Lock requests
        and barrier arrivals held back during a replay are served first, once it is done and the locks
        are rebuilt (`replay_done` wakes this thread with `WAKE`).
        """
        with self.mutex:
            if self.held_back and not self.holding:
                backlog, self.held_back = self.held_back, []
                for entry in backlog:
                    self._serve(*entry)
            if not (isinstance(raw, str) and raw == WAKE):
                self._serve(src, raw, link)

    def _serve(self, src: int, raw: Any, link: int | None) -> None:
        try:
            msg = decode(raw)
            server = self.mem.server
            if server.state[src] == FAILED or (link is not None and link != server.link[src]):
                return
            match msg:
                case HomeRequest():
                    self._home(src, msg.rid, msg.gid)
                case PageRequest():
                    self._page(src, msg.rid, msg.gid, msg.need)
                case DiffRequest():
                    self._diffs(src, msg.rid, msg.interval, msg.gids, msg.diffs)
                case AcquireRequest() | ReleaseRequest() | BarrierRequest() if self.holding:
                    self.held_back.append((src, raw, server.link[src] if link is None else link))
                case AcquireRequest():
                    self._acquire(src, msg.rid, msg.lock, msg.vt, msg.token)
                case ReleaseRequest():
                    self._release(src, msg.rid, msg.lock, msg.vt, msg.notices, msg.token)
                case OldPageRequest():
                    self._old_page(src, msg.rid, msg.gid, msg.vt)
                case BarrierRequest():
                    self._barrier(src, msg.rid, msg.epoch, msg.vt, msg.notices)
                case _:
                    raise DsmError(f"a {type(msg).__name__} is not a request")
        except Exception as exc:  # a bad request, or a plugin hook that failed: the requester gets the error
            rid = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], int) else 0  # msgpack: a list
            self._refuse(src, rid, exc)

    def _refuse(self, src: int, rid: int, exc: Exception) -> None:
        """Answer request `rid` of `src` with the error it failed with."""
        # DsmError and PluginError (which names the failing plugin and hook) say enough as they are
        what = str(exc) if isinstance(exc, DsmError | PluginError) else f"{type(exc).__name__}: {exc}"
        self.reply(src, ErrorReply(rid, f"rank {self.mem.rank}: {what}"), "error")

    def reply(self, dst: int, msg: Message, name: str) -> None:
        sent = self.mem.server.send(dst, msg)
        if sent is not None:  # else `dst` failed: the reply was owed to its dead incarnation
            self.counters.count(name, sent)

    # ------------------------------------------------------------------ recovery
    def forget(self, rank: int) -> None:
        """`rank` failed: drop every request of its dead incarnation that waits here."""
        with self.mutex:
            for state in self.locks.values():
                state.queue = deque(entry for entry in state.queue if entry[0] != rank)
            self.waiting = [entry for entry in self.waiting if entry[0] != rank]
            self.arrivals = [entry for entry in self.arrivals if entry[0] != rank]
            self.held_back = [entry for entry in self.held_back if entry[0] != rank]

    def forget_queues(self) -> None:
        """This rank was restored from its image: forget the requests it held then (they are sent again)."""
        with self.mutex:
            for state in self.locks.values():
                state.queue.clear()
            self.waiting = []
            self.arrivals = []
            self.held_back = []

    def hold_locks(self, incarnation: int) -> None:
        """This rank was restored from its image as `incarnation`: lock requests wait until `replay_done`
        rebuilt the locks."""
        with self.mutex:
            self.holding = True
            self.incarnation, self.published, self.awaited = incarnation, False, {}

    def replay_done(self) -> None:
        """This rank's replay ended (or there was none): publish its state, rebuild the locks homed here,
        serve what waited.

        Called on the program thread (by the DSM when the replay's last logged operation is done), or
        by `dsm._reconnect` right after `dsm_recovering` when no replay started (on the runtime
        thread, in REFRESH).  This rank's state is taken here, before the program goes on live.
        When the reports of ranks that recovered at the same time are awaited, a thread of its own
        waits for them and rebuilds (`dsm._reconnect` "post-replay reports"); meanwhile lock
        requests stay held back.  The requests held back are served by the handler thread, which
        the rebuild wakes: only it sends on the server endpoint.
        """
        if self.published:
            return
        own = _reconnect.post_report(self.mem)  # before waiting for anyone's: no cycle of waits
        self.published = True
        awaited, self.awaited = self.awaited, {}
        if not awaited:
            try:
                self._rebuild(own, {})
            except DsmError as exc:
                self._fall_back(exc)
                raise
            return
        log.info("rank %d: awaiting the post-replay state of rank(s) %s", self.mem.rank, sorted(awaited))
        threading.Thread(
            target=self._await_and_rebuild, args=(own, awaited), name="dsm-lock-rebuild", daemon=True
        ).start()

    def _await_and_rebuild(self, own: dict[str, Any], awaited: dict[int, int]) -> None:
        try:
            self._rebuild(own, _reconnect.await_posts(self.mem, awaited))
        except DsmError as exc:
            self._fall_back(exc)

    def _fall_back(self, exc: DsmError) -> None:
        """The locks homed here cannot be rebuilt: a whole-job restart from the coordinated checkpoint can."""
        reason = f"rank {self.mem.rank}: {exc}"
        log.error("%s", reason)
        fall_back = getattr(self.mem.rt, "fall_back", None)  # thread-ranks' runtimes have none
        if fall_back is not None:
            fall_back(reason)

    def _rebuild(self, own: dict[str, Any], posts: dict[int, dict[str, Any]]) -> None:
        with self.mutex:
            if not self.holding:
                return
            self._rebuild_locks(own, posts)
            self._adopt_barrier(posts)  # (what ranks recovered at once passed: they are no survivors)
            self.holding = False
            if self.held_back:
                server = self.mem.server
                with server.lock:  # `poll` appends to the inbox under it
                    server.inbox.insert(0, (self.mem.rank, WAKE, 0, server.link[self.mem.rank]))

    def adopt_barrier(self, reports: dict[int, dict[str, Any]]) -> None:
        """A recovered manager: the newest barrier reply the survivors received, for this rank's arrival sent
        again -- its predecessor may have completed that barrier and died before its own log record of it."""
        with self.mutex:
            self._adopt_barrier(reports)

    def _adopt_barrier(self, reports: dict[int, dict[str, Any]]) -> None:
        """`adopt_barrier` with the mutex held; also from the post-replay reports of ranks recovered at once
        (`_rebuild`): one of them may be the only rank that received the reply.  Barrier arrivals wait while
        the locks are held back (`serve`), so none is judged out of step before this is known."""
        passed = [r["barrier"] for r in reports.values() if r.get("barrier") is not None]
        if passed:
            epoch, vt, notices = max(passed, key=lambda b: b[0])
            self._keep_barrier(epoch, vt, notices)

    def replayed_barrier(self, epoch: int, vt: list[int], notices: list[Notice]) -> None:
        """Rank 0 replayed barrier `epoch` from its log (program thread): keep its reply for an arrival
        sent again, whose reply may have been lost with this rank's previous incarnation.

        `notices` must hold every notice of the barrier's union; a superset (this rank's notices since
        the previous barrier) does no harm: a rank merges only what it lacks.
        """
        with self.mutex:
            self._keep_barrier(epoch, vt, notices)

    def _keep_barrier(self, epoch: int, vt: list[int], notices: list[Notice]) -> None:
        if self.last_barrier is None or epoch > self.last_barrier[0]:
            self.last_barrier = (epoch, list(vt), [[q, i, list(flat)] for q, i, flat in notices])

    def _rebuild_locks(self, own: dict[str, Any], posts: dict[int, dict[str, Any]]) -> None:
        """The locks homed here from this rank's state after its replay (`own`), the survivors' reports
        of its recovery and the post-replay reports (`posts`) of ranks that recovered meanwhile.

        A lock two ranks say they hold: the live one (a survivor) holds it, or else the recovered one
        whose state covers the other's.  The other's last logged operation was its release, which this
        home's previous incarnation served before it failed: the loser's release token is recorded as
        released, so the release its replay sends again is acked as a duplicate.
        """
        mem, reports, self.reports = self.mem, self.reports, {}
        rank = mem.rank
        states = {rank: own, **posts}
        vt = list(own["vt"])
        notices: dict[tuple[int, int], list[int]] = {}
        claims: dict[int, list[Claim]] = {}  # lock -> (rank, token, live, rank's vt, releasing)
        for peer, report in [*sorted(reports.items()), *sorted(states.items())]:
            vt = [max(a, b) for a, b in zip(vt, report["vt"], strict=True)]
            for q, i, flat in report["known"]:
                notices[(q, i)] = flat
            for lock, (token, _) in report["held"].items():
                if lock % mem.size == rank:
                    releasing = lock in report.get("releasing", [])
                    claims.setdefault(lock, []).append((peer, token, peer not in states, report["vt"], releasing))
        losers: list[tuple[int, int, int]] = []  # lock, rank, token
        holders: dict[int, tuple[int, int]] = {}
        for lock, claimants in claims.items():
            winner = _holder(lock, claimants)
            holders[lock] = (winner[0], winner[1])
            losers += [(lock, c[0], c[1]) for c in claimants if c[0] != winner[0]]
        for state in self.locks.values():
            notices.update(state.notices)  # what the image knew released through its locks: still true
        self.template = LockState(vt, notices=notices)
        for lock in set(self.locks) | set(holders):
            old = self.locks.get(lock)
            holder, token = holders.get(lock, (-1, 0))
            released = dict(old.released) if old is not None else {}
            self.locks[lock] = LockState(list(vt), holder, deque(), dict(notices), token, released)
        for lock, peer, token in losers:
            released = self.locks[lock].released
            released[peer] = max(released.get(peer, 0), token)

    # ------------------------------------------------------------------ pages
    def _home(self, src: int, rid: int, gid: int) -> None:
        region, page = self._region(gid)
        if region.table[page] == 0:
            region.table[page] = src + 1
        self.reply(src, HomeReply(rid, int(region.table[page]) - 1), "home_reply")

    def _page(self, src: int, rid: int, gid: int, need: list[int]) -> None:
        if not (isinstance(need, list) and len(need) == self.mem.size and all(type(i) is int for i in need)):
            raise DsmError(
                f"malformed page request from rank {src}: {_count(need)} version(s) for {self.mem.size} ranks"
            )
        region, page = self._region(gid)
        if not bool(np.all(region.meta[page] >= need)):
            self.waiting.append((src, rid, gid, need))  # a diff it needs is still on its way
            return
        self._served(src, gid)  # hooks before the reply: one reply per request
        self.reply(src, PageReply(rid, region.page(page).tobytes()), "page_reply")

    def _served(self, src: int, gid: int) -> None:
        """Page `gid` leaves for `src`: by a page request, or with a lock grant (`_riders`)."""
        self.mem.hook("dsm_page_served", requester=src, gid=gid)
        self.counters.pages_served += 1

    def _diffs(self, src: int, rid: int, interval: int, gids: list[int], encoded: list[bytes]) -> None:
        """Apply a writer's diffs of one interval to pages homed here, in the order sent; one ack.

        Everything that can refuse the message -- its shape, a page not homed here, a damaged diff, a plugin
        in `dsm_diffs_received` or `dsm_diff_received` -- does so before any page changes: then the writer
        gets one error and no page holds part of the interval."""
        if not (
            isinstance(interval, int)
            and interval > 0
            and isinstance(gids, list)
            and isinstance(encoded, list)
            and 0 < len(gids) == len(encoded)
        ):
            shape = f"interval {interval!r}, {_count(gids)} page(s), {_count(encoded)} diff(s)"
            raise DsmError(f"malformed diff message from rank {src}: {shape}")
        pages = []
        for gid, data in zip(gids, encoded, strict=True):
            region, page = self._region(gid)
            pages.append((gid, region, page, Diff.decode(data, region.page_size)))
        if self.mem.fires("dsm_diffs_received"):  # (the list only for an implementation: this is every diff's path)
            self.mem.hook("dsm_diffs_received", writer=src, interval=interval, diffs=[(g, d) for g, _, _, d in pages])
        for gid, _, _, diff in pages:
            self.mem.hook("dsm_diff_received", writer=src, gid=gid, interval=interval, diff=diff)
        try:
            for _, region, page, diff in pages:
                diff.apply(region.page(page))
                region.meta[page, src] = max(int(region.meta[page, src]), interval)
                self.counters.diffs_applied += 1
            for gid, _, _, _ in pages:
                self.mem.hook("dsm_diff_applied", writer=src, gid=gid, interval=interval)
            self.reply(src, Ack(rid), "diff_ack")
        finally:  # the pages are applied even if a hook after that failed: what waited for them may go on
            self._serve_waiting()

    def _serve_waiting(self) -> None:
        """Serve again the page requests that waited for a diff; one that fails gets its own error reply."""
        waiting, self.waiting = self.waiting, []
        for src, rid, gid, need in waiting:
            try:
                self._page(src, rid, gid, need)
            except Exception as exc:  # not the diff's writer's error: this requester's
                self._refuse(src, rid, exc)

    def _old_page(self, src: int, rid: int, gid: int, vt: list[int]) -> None:
        """The minimal version of page `gid` at `vt`, for a rank replaying its logs (FT-KDSM §5)."""
        region, page = self._region(gid)
        versions = self.mem.versions
        if versions is None:
            raise DsmError(f"no page versions are kept here for page {gid:#x} (remote logging is not loaded)")
        if int(region.home[page]) != self.mem.rank:
            raise DsmError(f"page {gid:#x} is not homed here: no versions of it are kept")
        data = versions.page(gid, [int(x) for x in vt])
        if len(data) != region.page_size:
            raise DsmError(f"page {gid:#x}: a version of {len(data)} bytes, not {region.page_size}")
        self.reply(src, PageReply(rid, data), "page_reply")
        self.counters.versions_served += 1

    def _region(self, gid: int) -> tuple[Any, int]:
        if not isinstance(gid, int) or gid < 0:  # a negative one would split into a negative array index
            raise DsmError(f"no page {gid!r}")
        aid, page = split_gid(gid)
        if aid >= len(self.mem.regions) or page >= self.mem.regions[aid].npages:
            raise DsmError(f"no page {page} in shared array {aid}")
        return self.mem.regions[aid], page

    # ------------------------------------------------------------------ locks
    def _lock(self, lock: int) -> LockState:
        if lock not in self.locks:
            template = self.template  # a lock first seen here after a recovery: its release may predate the image
            if template is None:
                self.locks[lock] = LockState([0] * self.mem.size)
            else:
                self.locks[lock] = LockState(list(template.vt), notices=dict(template.notices))
        return self.locks[lock]

    def _acquire(self, src: int, rid: int, lock: int, vt: list[int], token: int) -> None:
        state = self._lock(lock)
        # a holder asking again is its next incarnation (a rank never re-acquires a lock it holds)
        if state.holder < 0 or state.holder == src:
            self._grant(state, src, rid, vt, token)
        else:
            state.queue.append((src, rid, vt, token))

    def _grant(self, state: LockState, src: int, rid: int, vt: list[int], token: int) -> None:
        state.holder, state.token = src, token
        notices = [[q, i, flat] for (q, i), flat in state.notices.items() if i > vt[q]]
        self.reply(src, Grant(rid, state.vt, notices, self._riders(src, notices)), "grant")

    def _riders(self, src: int, notices: list[Notice]) -> list[list[Any]]:
        """Copies of the pages `notices` name that this rank homes, newest notices first, at most RIDERS: the
        grantee would fetch them from here in its critical section (docs/dsm.md, "Pages ride with the grant";
        it takes one only if it holds what the grantee needs: `Memory._take_riders`).  A copy a DRAW is
        writing (a negative or changing column) is left out: the grantee fetches it.  Each is a page served
        (`dsm_page_served`, ``pages_served``)."""
        mem = self.mem
        if src == mem.rank:
            return []
        riders: list[list[Any]] = []
        seen: set[int] = set()
        for _, _, flat in reversed(notices):
            for k in range(0, len(flat), 2):
                gid = flat[k]
                if flat[k + 1] != mem.rank or gid in seen:
                    continue
                seen.add(gid)
                region, page = self._region(gid)
                before = region.meta[page].tolist()
                data = region.page(page).tobytes()
                if min(before) >= 0 and region.meta[page].tolist() == before:
                    self._served(src, gid)
                    riders.append([gid, before, data])
                    if len(riders) == RIDERS:
                        return riders
        return riders

    def _release(self, src: int, rid: int, lock: int, vt: list[int], notices: list[Notice], token: int) -> None:
        state = self._lock(lock)
        current = state.holder == src and state.token == token
        if token > 0 and not current and token <= state.released.get(src, 0):
            self.reply(src, Ack(rid), "release_ack")  # done before: sent again after a recovery
            return
        if state.holder != src:
            raise DsmError(f"rank {src} released lock {lock}, which it does not hold")
        state.vt = [max(a, b) for a, b in zip(state.vt, vt, strict=True)]
        for q, i, flat in notices:
            state.notices[(q, i)] = flat
        state.holder, state.token = -1, 0
        state.released[src] = max(state.released.get(src, 0), token)
        self.reply(src, Ack(rid), "release_ack")
        if state.queue:
            self._grant(state, *state.queue.popleft())

    def standing(self) -> dict[Any, str]:
        """What waits here now, for `ckpt status` (`dsm._waits.Standing`): each lock with ranks queued for it,
        and, on rank 0, a barrier some ranks have arrived at.  Keyed by what stands: a lock by its holder and
        acquisition too, so a contended lock that keeps changing hands never looks stuck."""
        facts: dict[Any, str] = {}
        with self.mutex:
            for lock, state in self.locks.items():
                if state.queue:
                    holder = f"held by rank {state.holder}" if state.holder >= 0 else "not held"
                    key = ("lock", lock, state.holder, state.token)
                    facts[key] = f"lock {lock} is {holder}, wanted by {_ranks(sorted(e[0] for e in state.queue))}"
            for src, rid, gid, need in self.waiting:  # async: page requests waiting here for a diff
                region, page = self._region(gid)
                have = region.meta[page].tolist()
                diffs = ", ".join(f"rank {q}'s interval {i}" for q, i in enumerate(need) if i > have[q])
                wanted = f"page {gid:#x}, wanted by rank {src},"
                facts[("page", gid, src, rid)] = f"{wanted} waits for diffs: {diffs or 'none missing now'}"
            if self.held_back:  # this rank's replay, or the rebuild of its locks after it, is not done
                waiting = _ranks(sorted({entry[0] for entry in self.held_back}))
                facts[("held back", self.incarnation)] = (
                    f"requests of {waiting} wait for this rank's replay and the rebuild of its locks"
                )
            for epoch in sorted({a[2] for a in self.arrivals}):  # one epoch, unless ranks are out of step
                arrived = sorted({a[0] for a in self.arrivals if a[2] == epoch})
                missing = [r for r in range(self.mem.size) if r not in arrived]
                facts[("barrier", epoch)] = f"barrier {epoch} waits for {_ranks(missing)} ({_ranks(arrived)} arrived)"
        return facts

    def prune(self, floor: list[int]) -> None:
        """Forget notices every rank has had since the barrier whose vector timestamp is `floor`."""
        with self.mutex:
            for state in [*self.locks.values(), *([self.template] if self.template is not None else [])]:
                state.notices = {key: flat for key, flat in state.notices.items() if key[1] > floor[key[0]]}

    # ------------------------------------------------------------------ barriers (rank 0)
    def _barrier(self, src: int, rid: int, epoch: int, vt: list[int], notices: list[Notice]) -> None:
        last = self.last_barrier
        if last is not None and epoch == last[0]:  # arrived again: its reply was lost in a recovery
            self.reply(src, BarrierReply(rid, last[1], last[2]), "barrier_reply")
            return
        self.arrivals.append((src, rid, epoch, vt, notices))
        if len(self.arrivals) < self.mem.size:
            return
        arrivals, self.arrivals = self.arrivals, []
        epochs = {a[2] for a in arrivals}
        if len(epochs) != 1 or len({a[0] for a in arrivals}) != self.mem.size:
            detail = ", ".join(f"rank {a[0]} at barrier {a[2]}" for a in arrivals)
            if self.incarnation > 0 and len(epochs) == 2 and max(epochs) == min(epochs) + 1:
                # this manager's previous incarnation completed barrier min(epochs) and died before its
                # own log record of it (design §3): its reply is lost, a whole-job restart is the way on
                self._fall_back(
                    DsmError(f"barrier {min(epochs)} completed before the manager failed, its reply is lost ({detail})")
                )
            for a in arrivals:
                self.reply(a[0], ErrorReply(a[1], f"DSM barriers out of step: {detail}"), "error")
            return
        merged_vt = [max(column) for column in zip(*(a[3] for a in arrivals), strict=True)]
        merged: dict[tuple[int, int], list[int]] = {}
        for a in arrivals:
            for q, i, flat in a[4]:
                merged[(q, i)] = flat
        union = [[q, i, flat] for (q, i), flat in merged.items()]
        self.last_barrier = (arrivals[0][2], merged_vt, union)
        for a in arrivals:
            self.reply(a[0], BarrierReply(a[1], merged_vt, union), "barrier_reply")


def _count(items: Any) -> str:
    """How many items a field of a received message holds, for an error line ("?" if it is not a list)."""
    return str(len(items)) if isinstance(items, list) else "?"


def _holder(lock: int, claimants: list[Claim]) -> Claim:
    """Who of the ranks that say they hold `lock` (rank, token, live, its vector timestamp, releasing) holds it.

    A live rank (a survivor) does: the home granted it after the others' releases.  Among recovered
    ranks, one whose log ends in the acquisition (not releasing) does: it never released, so every
    other claimant's logged release was served before its grant (their timestamps may be equal: the
    lock carried the releaser's).  Among releasing ones only, the last grantee: its timestamp covers
    the releases of the others (each one's state is that at its release, logged last).  Equal
    timestamps cannot tell which was granted last, and need not: the last grantee's grant carried the
    earlier one's release, so a timestamp no greater than that one's means its critical section
    closed no interval.  Whichever is named holder frees the lock with the release its replay sends
    again, the other's is acked as done, and the lock's timestamp and notices are the same either
    way: the lowest rank is named.  Timestamps neither of which covers the other cannot come from one
    lock's grants (DsmError).
    """
    live = [c for c in claimants if c[2]]
    if len(live) > 1:
        ranks = " and ".join(f"rank {c[0]}" for c in live)
        raise DsmError(f"lock {lock} is held by both {ranks}")
    if live:
        return live[0]
    holding = [c for c in claimants if not c[4]]
    if len(holding) > 1:
        ranks = " and ".join(f"rank {c[0]}" for c in holding)
        raise DsmError(f"lock {lock} is held by both {ranks}, neither releasing it")
    if holding:
        return holding[0]
    last = [c for c in claimants if all(all(a >= b for a, b in zip(c[3], o[3], strict=True)) for o in claimants)]
    if not last:
        ranks = " and ".join(f"rank {c[0]}" for c in claimants)
        raise DsmError(f"lock {lock} is held by both {ranks}, recovered at once: which released it cannot be told")
    return min(last, key=lambda c: c[0])  # (several: equal timestamps, see above)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"
