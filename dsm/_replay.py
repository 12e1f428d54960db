"""Recovery by replay (FT-KDSM §5): what a recovering rank's DSM asks of its log, and its replay mode."""

# Rationale.  A rank respawned from its image re-executes what it did since; the other ranks ran
# on.  Everything it received then -- grants, barrier replies, page contents -- must be what it
# received the first time, or its re-execution diverges from what the survivors already saw.  The
# log (ckpt_remotelog, at the rank's log home) holds its synchronisation in program order; the
# homes hold, from their base copies and home diff logs, every page as it was at any vector
# timestamp since the last coordinated checkpoint (its *minimal version*).  The contract between
# the DSM and the plugin that keeps the logs is the two protocols below; the DSM's replay mode
# (`Memory.start_replay`) consumes them.
#
# Invariant of the log (what makes the end of the replay the end of the rank's influence): every
# operation of a rank that another rank can observe -- a release, a barrier arrival -- has its
# record committed at the log home before it leaves, and every operation that depends on what the
# rank received -- the return of an acquire, of a barrier -- has its record committed before an
# interval that depends on it completes.  So once the last logged operation is replayed, nothing
# in any home's copy happened after the rank's current point: from there on it runs live.

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ckpt.plugin import RANKS_NS

from ._diff import Diff
from ._errors import ReplayDiverged
from ._messages import Notice
from ._region import split_gid

if TYPE_CHECKING:
    from ._memory import Memory

log = logging.getLogger("dsm")
_T = TypeVar("_T")
#: How often (seconds) a replaying rank publishes its progress for ``ckpt status``.
PROGRESS_EVERY = 0.5


class Replay(Protocol):
    """A recovering rank's logged operations, consumed in program order (built by ckpt_remotelog).

    Each call names the operation the re-executing program is at; if the log's next operation
    is another one, the re-execution diverged (the program is not deterministic given its DSM
    inputs) and the call raises `dsm.ReplayDiverged`.  Once every logged operation is consumed,
    `done` is True and the calls are not made any more.
    """

    @property
    def done(self) -> bool:
        """Every logged operation has been replayed."""
        ...

    def progress(self) -> tuple[int, int]:
        """(operations replayed, operations logged)."""
        ...

    def acquire(self, lock: int, token: int) -> tuple[list[int], list[Notice]] | None:
        """The logged grant of acquisition `token` of `lock`: (the rank's vector timestamp after it,
        the write notices it received); None when it is not logged (the acquire goes live)."""
        ...

    def release(self, lock: int, token: int) -> bool:
        """True: the log shows this release done at the lock's home (nothing is sent).  False: it was
        logged last, so it may not have reached the home: send it (the home ignores a duplicate)."""
        ...

    def arrive(self, epoch: int) -> bool:
        """True: the log shows this rank's arrival at barrier `epoch` (its notices reached the manager)."""
        ...

    def barrier(self, epoch: int) -> tuple[list[int], list[Notice]] | None:
        """The logged exit of barrier `epoch`: (vector timestamp after it, the notices received); None
        when not logged (the arrival goes live; the manager answers a repeated arrival)."""
        ...

    def home_diffs(self, vt: list[int]) -> list[tuple[int, Diff]]:
        """(gid, diff) of the logged diffs to this rank's own home pages, by other writers, that `vt`
        now covers (interval <= vt[writer]) and that were not returned before, in log order: what the
        program's view of its home pages must show from here on."""
        ...


class PageVersions(Protocol):
    """A home's page history since the last coordinated checkpoint (``Memory.versions``, set by ckpt_remotelog)."""

    def page(self, gid: int, vt: list[int]) -> bytes:
        """Page `gid` (this rank is its home) holding the intervals (q, i) with i <= vt[q]: the base copy
        of the last coordinated checkpoint with the home diff log's diffs that `vt` covers, in log order."""
        ...


def as_notices(notices: list[Any]) -> list[Notice]:
    return [[int(q), int(i), list(flat)] for q, i, flat in notices]


# ---------------------------------------------------------------------- the DSM's replay mode
# `Memory` calls these while `memory.replay` is set; each returns whether the operation was
# replayed (False: the caller does it live).  Program thread only.


def start(mem: Memory, replay: Replay) -> None:
    """Enter replay mode: the program gets a view of every region apart from the master copies."""
    for region in mem.regions:
        region.view = region.data.copy()
    mem.replay = replay
    mem.replay_started = time.perf_counter()
    mem.replay_published = 0.0
    _, total = replay.progress()
    mem.counters.replay_operations += total
    log.info("rank %d: replaying %d logged operations", mem.rank, total)
    if replay.done:
        _log_ended(mem)


def replaying(mem: Memory) -> bool:
    """Are logged operations left to replay (not only the catch-up after them)?"""
    return mem.replay is not None and not mem.replay.done


def _log_ended(mem: Memory) -> None:
    """The last logged operation is replayed: the view ends, the catch-up starts.

    The failed incarnation may have closed one more interval before it failed -- its diffs at their
    homes -- without reaching the record of the synchronisation that closed it.  This rank
    re-executes that interval live, but a page it fetched live could hold its own diff of it, and
    a read-modify-write would apply it twice.  So faults stay minimal versions (`Memory._fetch`)
    until the next synchronisation has closed that interval (`Memory._caught_up`).  Its diffs
    are sent again, which is harmless: they hold absolute bytes, and no later writer can have
    touched them, since nothing it did after them was made visible.  Its own home pages need no
    such care: the master copies were rebuilt without that interval's own-home diffs (ckpt_remotelog
    rebuilds only those logged before its last logged operation), so it re-executes them on the
    master like any write.  The view's pages this rank is not home of become the program's pages in
    `data`.  Lock requests held back at this rank's handler are served from here on: the log says
    which locks it holds.
    """
    replay = mem.replay
    assert replay is not None
    for region in mem.regions:
        view, region.view = region.view, None
        if view is None:
            continue
        size = region.page_size
        for page in np.flatnonzero(region.home != mem.rank):
            region.data[page * size : (page + 1) * size] = view[page * size : (page + 1) * size]
    done, total = replay.progress()
    _publish(mem, done, total)
    log.info("rank %d: replayed %d logged operations: catching up to the next synchronisation", mem.rank, done)
    mem.handler.replay_done()


def finish(mem: Memory) -> None:
    """Leave replay mode after the catch-up: the synchronisation after the log closed its interval."""
    replay = mem.replay
    if replay is None:
        return
    mem.replay = None
    seconds = time.perf_counter() - mem.replay_started
    mem.counters.replay_seconds += seconds
    done, total = replay.progress()
    log.info("rank %d: replayed %d of %d logged operations in %.3f s: live", mem.rank, done, total, seconds)
    if total:
        mem.rt.release_checkpoints()


def _call(mem: Memory, what: Callable[[Replay], _T]) -> _T:
    replay = mem.replay
    assert replay is not None
    try:
        return what(replay)
    except ReplayDiverged as exc:
        reason = f"rank {mem.rank}: its re-execution left its log ({exc}): it cannot be replayed"
        log.error("%s", reason)
        mem.rt.fall_back(reason)
        raise


def _stepped(mem: Memory) -> None:
    """After a replayed operation: show the home pages' logged changes it covers, publish progress, maybe end."""
    replay = mem.replay
    assert replay is not None
    for gid, diff in replay.home_diffs(list(mem.vt)):
        aid, page = split_gid(gid)
        diff.apply(mem.regions[aid].program_page(page))
    done, total = replay.progress()
    now = time.perf_counter()
    if now - mem.replay_published > PROGRESS_EVERY:
        mem.replay_published = now
        _publish(mem, done, total)
    if replay.done:
        _log_ended(mem)


def _publish(mem: Memory, done: int, total: int) -> None:
    kv = getattr(mem.rt, "kv", None)
    if kv is not None:
        kv.publish(RANKS_NS, f"replay/{mem.rank}", [done, total])


def acquire(mem: Memory, lock: int) -> bool:
    """Acquisition `mem.acquires` of `lock` from the log: its notices merged, no message to the lock's home."""
    logged = _call(mem, lambda r: r.acquire(lock, mem.acquires))
    if logged is None:  # not logged: the log has ended
        _log_ended(mem)
        return False
    vt, notices = logged
    mem._merge(vt, as_notices(notices), f"lock {lock} (replayed)")
    # what the lock's own vector timestamp was at the grant is not logged: the barrier's floor is below it,
    # so a release sent live later publishes every notice this rank knows since (more is safe, never fewer)
    mem.held[lock] = list(mem.floor)
    mem.tokens[lock] = mem.acquires
    mem.counters.replayed_acquires += 1
    mem.counters.lock_acquires += 1
    _stepped(mem)
    return True


def release(mem: Memory, lock: int) -> bool:
    """A release the log shows done: nothing is sent.  False: the caller sends it (the home drops a duplicate)."""
    if not _call(mem, lambda r: r.release(lock, mem.tokens.get(lock, 0))):
        mem.releasing.add(lock)  # the post-replay report says so: a lock home rebuilding its holder needs it
        _log_ended(mem)
        return False
    mem.tokens.pop(lock, None)
    del mem.held[lock]
    mem.counters.replayed_releases += 1
    _stepped(mem)
    return True


def barrier(mem: Memory, epoch: int) -> str:
    """Barrier `epoch` from the log, arrival and exit both logged: "replayed", no message to the manager.
    "rearrive": its arrival is logged but not its exit (sent again; the manager answers a repeated
    arrival of its last barrier); "live": neither."""
    if not _call(mem, lambda r: r.arrive(epoch)):
        _log_ended(mem)
        return "live"
    logged = _call(mem, lambda r: r.barrier(epoch))
    if logged is None:
        _log_ended(mem)
        return "rearrive"
    vt, notices = logged
    mem._merge(vt, as_notices(notices), "barrier (replayed)")
    # its reply, or a superset of it (the log holds only the notices this rank lacked; a rank merges only what
    # it lacks): for a rank that arrives again at this barrier, at this manager or at a recovered one
    union = [[q, i, flat] for (q, i), flat in mem.known.items() if i > mem.floor[q]]
    mem.last_reply = (epoch, list(mem.vt), union)
    if mem.rank == 0:
        mem.handler.replayed_barrier(epoch, list(mem.vt), union)
    mem.passed_barrier()
    mem.counters.replayed_barriers += 1
    mem.counters.barriers += 1
    _stepped(mem)
    return "replayed"
