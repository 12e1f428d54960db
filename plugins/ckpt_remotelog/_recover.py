"""Recovery of one rank from its log home (FT-KDSM §5): the `dsm_recovering` side of remote logging."""

# Rationale (design of issue 13 part 5, §2.2).  Rank R was respawned from its image (taken at
# T_R) while the others ran on; its links are up, and no survivor uses its memory until this
# returns.  R's log ring at L(R) holds, in ring order, every change to R's home pages since its
# image (DIFF records, its own writes too); R's own ring there holds, by serial, R's own
# synchronisation since then.
#
# a. Without that ring there is nothing to replay from: L(R) is not reachable (it failed with
#    R), or the rings are marked lost (L(R) was itself recovered since, and R has not
#    checkpointed after that).  Then only a whole-job restart is consistent: `rt.fall_back`.
# b. The log ring is read by RDMA, past holes (a writer may have died mid-record), and so
#    is R's own ring there, from R's image's own tail up to the first record not committed
#    (R alone writes it, in order: nothing committed follows a hole).
# c. The replay (`_replay.LogReplay`) is built against the image -- which diffs the image's
#    home copies hold -- and handed to the DSM, which copies every page into the program's
#    view: the program re-executes against the image's state.
# d. The *master* copies (``region.data``, the applied columns) of R's home pages are rebuilt:
#    each DIFF the image lacks is applied in ring order (= the order the home applied it) and
#    appended to the home diff log, as the lost incarnation had done.  The survivors fetch
#    from the master: it must hold everything they may already have seen.
# e. Pages whose DIFF records are here are homed at R: R's home table says so for those whose
#    default home is R (a first touch after the image claimed them).
# f. The rings R holds (of O = R - offset) came back from the image too: what O logged since is
#    gone.  They are marked lost and O is asked to checkpoint; O's discard clears the marks.
# g. While the replay runs, no checkpoint may be taken of R: its state is not one an image may
#    hold (the DSM releases the hold when the replay ends).

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt import CoordinatorError
from dsm import Diff, DsmError

from ._records import Record, RecordKind, diff_record, per_page
from ._replay import LogReplay
from ._writer import LOG, OWN

if TYPE_CHECKING:
    from ._remote import RemoteLog

log = logging.getLogger(__name__)
UP = "up"  # dsm._net's link state of a usable link


def recover(rlog: RemoteLog, incarnation: int) -> LogReplay:
    """Steps a-g above, on the recovered rank's program thread; the replay started (maybe empty)."""
    memory, rt, rank = rlog.memory, rlog.rt, rlog.rank
    home = rlog.log_home(rank)
    if memory.client.state[home] != UP:
        _fall_back(rlog, f"its log home, rank {home}, is lost too")
    if rlog.writer.read_word(home, LOG, 16) or rlog.writer.read_word(home, OWN, 16):
        _fall_back(rlog, f"its log rings at rank {home} were lost when rank {home} was recovered")
    records, _ = rlog.writer.read_ring(home, LOG, holes=True)
    own = rlog.writer.read_own(rlog.writer.own_tail)
    replay = LogReplay(rank, rlog.serial, records + own, lambda gid: _applied(memory, gid), memory.page_size)
    if not replay.done:
        memory.start_replay(replay)  # the view: the image's pages, before the master moves on
    # own diffs of intervals after its last logged operation belong to the interval it may have closed unlogged:
    # it re-executes that one live, on the master (dsm._replay._log_ended); an own record's gid field holds
    # this rank's interval count after its operation
    last = replay.ops[-1].gid if replay.ops else -1
    rebuilt = rebuild_master(rlog, [r for r in records if r.writer != rank or r.interval <= last])
    rlog.serial = replay.next_serial  # the next own record follows the last replayed one
    if replay.ops:  # ... and lies after it in the own ring (the lost incarnation's later ones were not committed)
        rlog.writer.own_tail = replay.ops[-1].position + replay.ops[-1].size
    rlog.replay = replay
    _lose_held_ring(rlog)
    done, total = replay.progress()
    log.info(
        "rank %d (incarnation %d): %d home-page diff(s) rebuilt, %d operation(s) to replay",
        rank,
        incarnation,
        rebuilt,
        total - done,
    )
    if not replay.done:
        rt.hold_checkpoints(f"rank {rank} is replaying its logs")
    return replay


def _fall_back(rlog: RemoteLog, why: str) -> None:
    reason = (
        f"rank {rlog.rank} failed together with its log home, rank {rlog.log_home(rlog.rank)} ({why}): "
        "restarting the whole job from its last coordinated checkpoint"
    )
    rlog.rt.fall_back(reason)
    raise DsmError(reason)  # fall_back stops this process; should it return, nothing here may go on


def _applied(memory: Any, gid: int) -> np.ndarray | None:
    """The applied columns of page `gid` as this rank's copy holds them (None: its array is not made yet)."""
    aid, page = gid >> 32, gid & 0xFFFFFFFF
    if aid >= len(memory.regions):
        return None
    columns: np.ndarray = memory.regions[aid].meta[page]
    return columns.copy()


def rebuild_master(rlog: RemoteLog, records: list[Record]) -> int:
    """Apply to this rank's home copies every DIFF record in `records` (ring order) they do not hold, raise
    their applied columns, append each to the home diff log, and claim the pages in the home table; the
    number applied.  First a diff that was being written by RDMA when the image was taken (a negative
    column) reads as not there: its writer finished it long ago, on the lost incarnation, and logged it,
    so it is applied again from its record -- whole."""
    memory, rank = rlog.memory, rlog.rank
    for region in memory.regions:
        region.meta[:] = region.applied()
    applied, missing = 0, 0
    for record in records:
        if record.kind != RecordKind.DIFF:
            continue
        pages = []
        for one in per_page(record):  # every page decoded before any is applied: a malformed one changes nothing
            aid, page = one.gid >> 32, one.gid & 0xFFFFFFFF
            if aid >= len(memory.regions):
                missing += 1  # its array was made after the image: not built yet (see docs/remotelog.md)
                continue
            pages.append((one, memory.regions[aid], page, Diff.decode(one.payload, memory.regions[aid].page_size)))
        rebuilt: list[tuple[int, bytes]] = []
        for one, region, page, diff in pages:
            region.home[page] = rank
            if region.default_home(page) == rank and region.table[page] == 0:
                region.table[page] = rank + 1
            if one.interval <= int(region.meta[page, one.writer]):
                continue  # the image holds it
            diff.apply(region.page(page))
            region.meta[page, one.writer] = one.interval
            rebuilt.append((one.gid, one.payload))
        if rebuilt:  # nobody else appends while this runs (the survivors wait)
            rlog.log_home_diffs([diff_record(RecordKind.HOME_DIFF, record.writer, record.interval, rebuilt)])
            applied += len(rebuilt)
    if missing:
        log.warning("rank %d: %d logged diff(s) of arrays made after its image are not rebuilt", rank, missing)
    return applied


def _lose_held_ring(rlog: RemoteLog) -> None:
    """The ring this rank holds came back from its image: mark it lost and ask its owner to checkpoint."""
    owner = (rlog.rank - rlog.offset) % rlog.size
    if owner == rlog.rank:
        return
    rlog.ring.mark_lost()
    rlog.own_ring.mark_lost()
    log.info("rank %d: the log ring of rank %d it holds is lost: asking for its checkpoint", rlog.rank, owner)
    try:
        rlog.rt.checkpoint_rank(owner)
    except CoordinatorError as exc:  # the owner is lost too: its own recovery finds this ring lost and falls back
        log.info("rank %d: no checkpoint of rank %d: %s", rlog.rank, owner, exc)
