"""The protocol handler: what a rank's second thread does with the requests that reach it.

It serves, for the pages this rank is home (or default home) of and the locks
it is home of: home look-ups (first touch claims the page), page requests (a
page leaves only once the home's copy holds every interval the requester
needs, else the request waits for the diffs), diffs (applied, then
acknowledged: a writer's release completes only after its diffs are in the
home's copy, so a write notice never names a change the home lacks), lock
acquire / release (the lock's home keeps the vector timestamp of its last
release and the write notices released through the lock since the last
barrier, and grants in FIFO order), and, on rank 0, barriers (arrivals carry
their notices; when all have come, everyone gets the union and the
element-wise maximum of the vector timestamps).

The program thread of the same rank touches none of this state except through
`prune`, under the handler's mutex; the runtime thread that runs the recovery
hooks only through `forget` and `forget_queues`, under the same mutex.

After a peer fails (single-rank recovery, `dsm._reconnect`), nothing is owed to
its dead incarnation: `forget` drops its queued lock requests, its waiting
page requests and its barrier arrival (a reply to them would reach its next
incarnation, whose request ids mean other things).  A lock it held stays held
by that rank: its next incarnation, restored from an image, either releases
it or, re-executing, asks for it again -- which the home grants at once,
since the requester already holds it.  A rank that was itself restored from
its image clears every queue (`forget_queues`): the survivors send again
whatever they still wait for.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt import PluginError

from ._diff import apply_diff
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
from ._region import META, split_gid
from ._stats import Counters

if TYPE_CHECKING:
    from ._memory import Memory


@dataclass
class LockState:
    """A lock at its home: who holds it, who waits, and what its last release published."""

    vt: list[int]
    holder: int = -1
    queue: deque[tuple[int, int, list[int]]] = field(default_factory=deque)  # (rank, request id, its vt)
    notices: dict[tuple[int, int], list[int]] = field(default_factory=dict)


class Handler:
    """The state behind the server endpoint; `serve` runs on the handler thread only."""

    def __init__(self, memory: Memory) -> None:
        self.mem = memory
        self.locks: dict[int, LockState] = {}
        self.arrivals: list[tuple[int, int, int, list[int], list[Notice]]] = []  # rank, rid, epoch, vt, notices
        self.waiting: list[tuple[int, int, int, list[int]]] = []  # page requests: rank, rid, gid, need
        self.counters = Counters()  # the handler's own: two threads never add to one counter
        self.mutex = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["mutex"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.mutex = threading.Lock()

    # ------------------------------------------------------------------ dispatch
    def serve(self, src: int, raw: Any, link: int | None = None) -> None:
        """Serve request `raw` of rank `src`, which arrived on `src`'s link number `link` (None: the current one).

        A request of an incarnation declared lost is dropped: it arrived on a link replaced since, or
        the link is FAILED (`forget` ran or is about to).  Checked under the mutex that `forget`
        takes, so a request is either forgotten there or never queued / granted here.
        """
        try:
            msg = decode(raw)
            with self.mutex:
                server = self.mem.server
                if server.state[src] == FAILED or (link is not None and link != server.link[src]):
                    return
                match msg:
                    case HomeRequest():
                        self._home(src, msg.rid, msg.gid)
                    case PageRequest():
                        self._page(src, msg.rid, msg.gid, msg.need)
                    case DiffRequest():
                        self._diff(src, msg.rid, msg.gid, msg.interval, msg.runs)
                    case AcquireRequest():
                        self._acquire(src, msg.rid, msg.lock, msg.vt)
                    case ReleaseRequest():
                        self._release(src, msg.rid, msg.lock, msg.vt, msg.notices)
                    case OldPageRequest():
                        raise DsmError("minimal page versions are not served yet (issue 13 part 5)")
                    case BarrierRequest():
                        self._barrier(src, msg.rid, msg.epoch, msg.vt, msg.notices)
                    case _:
                        raise DsmError(f"a {type(msg).__name__} is not a request")
        except Exception as exc:  # a bad request, or a plugin hook that failed: the requester gets the error
            rid = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], int) else 0  # msgpack: a list
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

    def forget_queues(self) -> None:
        """This rank was restored from its image: forget the requests it held then (they are sent again)."""
        with self.mutex:
            for state in self.locks.values():
                state.queue.clear()
            self.waiting = []
            self.arrivals = []

    # ------------------------------------------------------------------ pages
    def _home(self, src: int, rid: int, gid: int) -> None:
        region, page = self._region(gid)
        if region.table[page] == 0:
            region.table[page] = src + 1
        self.reply(src, HomeReply(rid, int(region.table[page]) - 1), "home_reply")

    def _page(self, src: int, rid: int, gid: int, need: list[int]) -> None:
        region, page = self._region(gid)
        if not bool(np.all(region.meta[page, META:] >= need)):
            self.waiting.append((src, rid, gid, need))  # a diff it needs is still on its way
            return
        self.mem.hook("dsm_page_served", requester=src, gid=gid)  # hooks before the reply: one reply per request
        self.reply(src, PageReply(rid, region.page(page).tobytes()), "page_reply")
        self.counters.pages_served += 1

    def _diff(self, src: int, rid: int, gid: int, interval: int, runs: list[Any]) -> None:
        region, page = self._region(gid)
        diff = [(int(offset), bytes(data)) for offset, data in runs]
        self.mem.hook("dsm_diff_received", writer=src, gid=gid, interval=interval, diff=diff)
        apply_diff(region.page(page), diff)
        column = META + src
        region.meta[page, column] = max(int(region.meta[page, column]), interval)
        self.counters.diffs_applied += 1
        self.mem.hook("dsm_diff_applied", writer=src, gid=gid, interval=interval)
        self.reply(src, Ack(rid), "diff_ack")
        waiting, self.waiting = self.waiting, []
        for request in waiting:
            self._page(*request)

    def _region(self, gid: int) -> tuple[Any, int]:
        aid, page = split_gid(gid)
        if aid >= len(self.mem.regions) or page >= self.mem.regions[aid].npages:
            raise DsmError(f"no page {page} in shared array {aid}")
        return self.mem.regions[aid], page

    # ------------------------------------------------------------------ locks
    def _lock(self, lock: int) -> LockState:
        if lock not in self.locks:
            self.locks[lock] = LockState([0] * self.mem.size)
        return self.locks[lock]

    def _acquire(self, src: int, rid: int, lock: int, vt: list[int]) -> None:
        state = self._lock(lock)
        # a holder asking again is its next incarnation (a rank never re-acquires a lock it holds)
        if state.holder < 0 or state.holder == src:
            self._grant(state, src, rid, vt)
        else:
            state.queue.append((src, rid, vt))

    def _grant(self, state: LockState, src: int, rid: int, vt: list[int]) -> None:
        state.holder = src
        notices = [[q, i, flat] for (q, i), flat in state.notices.items() if i > vt[q]]
        self.reply(src, Grant(rid, state.vt, notices), "grant")

    def _release(self, src: int, rid: int, lock: int, vt: list[int], notices: list[Notice]) -> None:
        state = self._lock(lock)
        if state.holder != src:
            raise DsmError(f"rank {src} released lock {lock}, which it does not hold")
        state.vt = [max(a, b) for a, b in zip(state.vt, vt, strict=True)]
        for q, i, flat in notices:
            state.notices[(q, i)] = flat
        state.holder = -1
        self.reply(src, Ack(rid), "release_ack")
        if state.queue:
            self._grant(state, *state.queue.popleft())

    def prune(self, floor: list[int]) -> None:
        """Forget notices every rank has had since the barrier whose vector timestamp is `floor`."""
        with self.mutex:
            for state in self.locks.values():
                state.notices = {key: flat for key, flat in state.notices.items() if key[1] > floor[key[0]]}

    # ------------------------------------------------------------------ barriers (rank 0)
    def _barrier(self, src: int, rid: int, epoch: int, vt: list[int], notices: list[Notice]) -> None:
        self.arrivals.append((src, rid, epoch, vt, notices))
        if len(self.arrivals) < self.mem.size:
            return
        arrivals, self.arrivals = self.arrivals, []
        epochs = {a[2] for a in arrivals}
        if len(epochs) != 1 or len({a[0] for a in arrivals}) != self.mem.size:
            detail = ", ".join(f"rank {a[0]} at barrier {a[2]}" for a in arrivals)
            for a in arrivals:
                self.reply(a[0], ErrorReply(a[1], f"DSM barriers out of step: {detail}"), "error")
            return
        merged_vt = [max(column) for column in zip(*(a[3] for a in arrivals), strict=True)]
        merged: dict[tuple[int, int], list[int]] = {}
        for a in arrivals:
            for q, i, flat in a[4]:
                merged[(q, i)] = flat
        union = [[q, i, flat] for (q, i), flat in merged.items()]
        for a in arrivals:
            self.reply(a[0], BarrierReply(a[1], merged_vt, union), "barrier_reply")
