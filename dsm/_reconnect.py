"""Single-rank recovery of the DSM: a failed rank's links fail, and fresh ones meet its next incarnation."""

# FT-KDSM (remote-logging-hlrc-dsm-via.txt §5), DESIGN §8 "Reconnection".
# Under `ckpt launch --on-failure recover` a failed rank R is respawned from
# its own latest image while the other ranks run on.  The DSM owns its
# connections (the link states and the locking invariant: `dsm._net`):
#
# * R fails (`ckpt_rank_failed` on the survivors, or its QPs' errors first):
#   the survivors fail their links to R and their handlers forget what they
#   owed its dead incarnation (queued lock requests, waiting page requests,
#   its barrier arrival).  A request of theirs to R stays pending; a
#   one-sided operation on R's memory waits.
# * R's next incarnation K has loaded its image (`ckpt_rank_recovered` on the
#   survivors, `ckpt_refresh` with `rt.recovered` on R): both sides create
#   fresh QPs through the ordinary verbs API -- so ckpt_ib virtualizes them
#   like any QP made after start -- and meet in the KV (namespace `dsm`,
#   generation-scoped; <tag> names the link by both ends' incarnations, so a
#   later recovery of R or of its peer never reads these keys; see below):
#
#       conn/<memory>/<from>-<to>/<tag>  -> {lid, client, server, regions}
#       ready/<memory>/<from>-<to>/<tag> -> true
#
#   `conn` is <from>'s new QPs towards <to> and its shared arrays' addresses
#   (`Region.peers` is refreshed from it: one-sided operations use the new
#   incarnation's rkeys); `ready` is published once those QPs are connected
#   with receives posted.  <memory> is a job-wide ID taken at attach.
#
# No cycle of waits: each side publishes all its `conn` keys before it waits
# for any, and its `ready` keys before it waits for the other's.  R does its
# side in REFRESH, not RESUME: the survivors' hook fires once R's RESTART
# phase is complete (R is in REFRESH then), and R's handler, started at
# RESUME, then finds every link up.  No message reaches a QP whose end is not
# ready: a side sends on a new link only after the other's `ready` key, or
# after a message on that link proved it (`dsm._net`, JOINING).
#
# R rebuilds every link, its loopback too, instead of using the QPs of its
# image (ckpt_ib left those to other ranks in ERROR).  Its request ids start
# at K << 40, so a late reply meant for its dead predecessor matches none of
# them; what it had received in the previous life is forgotten (the
# survivors re-send whatever they still wait for).
#
# R is *reconnected* here: it continues from its image with the state it had
# then.  Synchronisation that R re-executes after a real failure (a lock it
# had acquired, a barrier it had passed, diffs the homes already applied)
# needs the logs of remote logging to give the same answers as the first
# time: ckpt_remotelog starts a replay in `dsm_recovering` (below).  Without
# it, the lock home lets the rank it believes holds a lock acquire it again
# (`dsm._handler`), and the survivors' re-sent requests are served from the
# image's state.
#
# Several ranks failing and recovering at once (DESIGN §8).  A link is named
# by the incarnations at both of its ends: <tag> = "<lo>.<Klo>-<hi>.<Khi>"
# (the lower rank first), so two processes meet on one key whichever of them
# recovers: both take the incarnations from the coordinator (the recovering
# rank's own, the pushed one, or `RANKS_NS incarnation/<j>`, 0 if none in
# this generation).  A recovering rank skips the peers whose `failed/<j>` is
# at or above the incarnation it knows of: they are lost, and connect to it
# when they come back (they read its incarnation in their REFRESH; it hears
# their RankRecovered, its hooks running after its own RESUME).  Two ranks
# back at once both see each other and meet in their REFRESH.  Every wait
# for a peer's key runs in short slices and is abandoned once that peer's
# awaited incarnation is lost too: a rank that dies between its RESTART
# barrier and its keys costs the others nothing but a failed link, and the
# events queued behind the wait (its RankFailed, its next RankRecovered) run.
# A link already joined to an incarnation newer than an event's is not
# touched by that event (`_joined`): the event is stale.
#
# Recovery by replay (design of issue 13 part 5, §2.1).  R's memory must be
# R's alone while `dsm_recovering` rebuilds it from the logs: R publishes
# its `ready` keys only after that hook returned, having waited for the
# survivors' (they publish theirs without waiting for ours, so no cycle).
# Until R's `ready`, a survivor's link to R is JOINING: it sends nothing and
# its one-sided operations on R wait; R's one-sided reads of its log home
# (its links are up) produce no message there.  Each survivor's `conn`
# record carries its report for R (`survivor_report`): its vector timestamp
# and notices, the locks homed at R it holds, the pages homed at it whose
# default home is R (R's home table, from the image, may not know them).
# Two ranks recovering at once (each `conn` says "recovering") publish
# their `ready` to each other at once and exchange no reports.

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt import CoordinatorError
from ckpt.plugin import RANKS_NS

from ._errors import DsmError
from ._region import gid_of, split_gid

if TYPE_CHECKING:
    from ._memory import Memory

log = logging.getLogger("dsm")

KV_NS = "dsm"
#: How long one side of a reconnection waits for the other's keys: both act on the same event.
RECONNECT_TIMEOUT = 120.0
#: How often a wait for a peer's key looks whether that peer was lost meanwhile.
SLICE = 0.5

#: Per memory (never pickled): peer -> the incarnation its current link was joined to.
_joined: weakref.WeakKeyDictionary[Memory, dict[int, int]] = weakref.WeakKeyDictionary()


def conn_key(memory: int, src: int, dst: int, tag: str) -> str:
    return f"conn/{memory}/{src}-{dst}/{tag}"


def ready_key(memory: int, src: int, dst: int, tag: str) -> str:
    return f"ready/{memory}/{src}-{dst}/{tag}"


def post_key(memory: int, rank: int, incarnation: int) -> str:
    return f"post/{memory}/{rank}/{incarnation}"


def link_tag(a: int, incarnation_a: int, b: int, incarnation_b: int) -> str:
    """The name of the link between incarnation `incarnation_a` of rank `a` and `incarnation_b` of rank `b`."""
    (lo, klo), (hi, khi) = sorted([(a, incarnation_a), (b, incarnation_b)])
    return f"{lo}.{klo}-{hi}.{khi}"


def _lost(mem: Memory, rank: int, incarnation: int) -> bool:
    """Has the coordinator said that incarnation `incarnation` of `rank` (or a later one) was lost?"""
    return bool(int(mem.rt.kv.get(RANKS_NS, f"failed/{rank}", -1)) >= incarnation)


def _await_key(mem: Memory, key: str, rank: int, incarnation: int) -> Any | None:
    """Peer `rank`'s `key`, or None once its incarnation `incarnation` is lost (DsmError after RECONNECT_TIMEOUT)."""
    kv = mem.rt.kv
    deadline = time.monotonic() + RECONNECT_TIMEOUT
    while True:
        value = kv.get(KV_NS, key)
        if value is not None:
            return value
        if _lost(mem, rank, incarnation):
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DsmError(
                f"DSM: incarnation {incarnation} of rank {rank} did not publish {key} within {RECONNECT_TIMEOUT:.0f} s"
            )
        try:
            return kv.subscribe(KV_NS, key, min(SLICE, left))
        except CoordinatorError:
            continue  # a slice ran out: look again whether the peer was lost meanwhile


def peer_failed(mem: Memory, rank: int, incarnation: int) -> None:
    """A survivor: fail the links to `rank` and forget what the handler owed its dead incarnation."""
    if rank == mem.rank or not 0 <= rank < mem.size:
        return
    if _joined.setdefault(mem, {}).get(rank, -1) > incarnation:
        return  # stale: the link already joined a later incarnation
    why = f"incarnation {incarnation} of rank {rank} was lost"
    mem.client.fail(rank, why)
    mem.server.fail(rank, why)
    mem.handler.forget(rank)


def peer_recovered(mem: Memory, rank: int, incarnation: int) -> None:
    """A survivor: fresh links to `rank`'s new incarnation (pending requests go again once they are up)."""
    if rank == mem.rank or not 0 <= rank < mem.size:
        return
    if _joined.setdefault(mem, {}).get(rank, -1) >= incarnation:
        return  # joined already: both ends recovered at once and met in their REFRESH
    # this rank's incarnation as the coordinator's KV knows it (0 if never recovered in this
    # generation): what a recovering peer reads for us, so both ends name the link alike
    mine = int(mem.rt.kv.get(RANKS_NS, f"incarnation/{mem.rank}", 0))
    reconnect(mem, {rank: incarnation}, mine)


def recovered(mem: Memory, incarnation: int) -> None:
    """The process that replaced a failed rank, restored from its image: fresh links to every rank, then
    `dsm_recovering` (with the survivors' reports) before any of them may use this rank's memory."""
    mem.rid = max(mem.rid, incarnation << 40)
    mem.pending.clear()
    mem.replies.clear()
    mem.client.forget_everything()
    mem.server.forget_everything()
    mem.handler.forget_queues()
    mem.handler.hold_locks(incarnation)  # until the replay is done (or at once below, if there is none)
    _joined[mem] = {}
    kv = mem.rt.kv
    peers = {mem.rank: incarnation}
    for j in range(mem.size):
        if j != mem.rank:
            known = int(kv.get(RANKS_NS, f"incarnation/{j}", 0))
            if not _lost(mem, j, known):  # else it connects to us when it comes back
                peers[j] = known
            else:  # it reports nothing: its next incarnation publishes its state after its replay
                mem.handler.awaited[j] = int(kv.get(RANKS_NS, f"failed/{j}", known)) + 1
    reconnect(mem, peers, incarnation, recovering=True)


def reconnect(mem: Memory, peers: dict[int, int], mine: int, recovering: bool = False) -> None:
    """Fresh QPs to `peers` (rank -> the incarnation met), this rank being incarnation `mine`, met through
    the KV; the links are up on return, but for peers lost meanwhile (their links are FAILED).

    `recovering`: this rank was restored from its image; it fires `dsm_recovering` once every link is
    up and publishes its `ready` keys to the survivors only after it.  Else each `conn` record carries
    this survivor's report for the peer (`survivor_report`).
    """
    kv = mem.rt.kv
    started = time.perf_counter()
    fresh = {j: (mem.client.new_qp(), mem.server.new_qp()) for j in peers}
    tags = {j: link_tag(mem.rank, mine, j, k) for j, k in peers.items()}
    lid = mem.ctx.query_port(1).lid
    regions = [region.address() for region in mem.regions]
    for j, (client, server) in fresh.items():
        record = {"lid": lid, "client": client.qp_num, "server": server.qp_num, "regions": regions}
        if recovering:
            record["recovering"] = True
        elif j != mem.rank:
            record["report"] = survivor_report(mem, j)
            if not mem.handler.published:  # replaying: its state is not yet the one to rebuild from
                record["replaying"] = mem.handler.incarnation
        kv.publish(KV_NS, conn_key(mem.mid, mem.rank, j, tags[j]), record)
    abandoned: list[int] = []
    reports: dict[int, dict[str, Any]] = {}
    later: list[int] = []  # survivors: our `ready` for them waits for dsm_recovering
    both: list[int] = []  # peers recovering at the same time as this rank
    for j, (client, server) in fresh.items():
        theirs = _await_key(mem, conn_key(mem.mid, j, mem.rank, tags[j]), j, peers[j])
        if theirs is None:
            client.close()
            server.close()
            abandoned.append(j)
            continue
        for region, address in zip(mem.regions, theirs["regions"], strict=False):
            region.peers[j] = dict(address)  # before the link is up: no operation uses the old ones after
        mem.client.attach(j, client, int(theirs["lid"]), int(theirs["server"]))
        mem.server.attach(j, server, int(theirs["lid"]), int(theirs["client"]))
        if "report" in theirs:
            reports[j] = _report(theirs["report"], mem.size)
            if recovering and "replaying" in theirs:  # its locks are its replay's, not final: its post-report
                reports[j]["held"] = {}
                mem.handler.awaited[j] = int(theirs["replaying"])
        if recovering and j != mem.rank and theirs.get("recovering", False):
            both.append(j)
        if recovering and j != mem.rank and not theirs.get("recovering", False):
            later.append(j)
        else:
            kv.publish(KV_NS, ready_key(mem.mid, mem.rank, j, tags[j]), True)

    def join(ranks: list[int]) -> None:
        """Wait for the `ready` keys of `ranks`: their links are up (or, lost meanwhile, abandoned)."""
        for j in ranks:
            if j in abandoned:
                continue
            if _await_key(mem, ready_key(mem.mid, j, mem.rank, tags[j]), j, peers[j]) is None:
                abandoned.append(j)
                continue
            mem.client.up(j)
            mem.server.up(j)
            _joined.setdefault(mem, {})[j] = peers[j]

    # a recovering rank meets other recovering ranks last: they wait for survivors that may be
    # waiting for our `ready`, published only after dsm_recovering
    join([j for j in fresh if j not in both])
    failed = len(abandoned)
    if recovering:
        _fail_abandoned(mem, peers, abandoned)
        reports = {j: report for j, report in reports.items() if j not in abandoned}
        for j in [*both, *abandoned]:  # no report from them: their state after their replays instead
            if j != mem.rank:
                mem.handler.awaited[j] = peers[j] + int(j in abandoned)
        _apply_claims(mem, reports)
        mem.handler.reports = reports  # the handler thread is not running yet (it starts at RESUME)
        if mem.rank == 0:
            mem.handler.adopt_barrier(reports)
        mem.hook("dsm_recovering", incarnation=mine, reports=reports)
        if mem.replay is None:
            mem.handler.replay_done()
        for j in later:  # only now may the survivors send here and use this rank's memory
            if j not in abandoned:
                kv.publish(KV_NS, ready_key(mem.mid, mem.rank, j, tags[j]), True)
        join(both)
        _fail_abandoned(mem, peers, abandoned[failed:])
    else:
        _fail_abandoned(mem, peers, abandoned)
    seconds = time.perf_counter() - started
    ranks = ", ".join(str(j) for j in peers if j not in abandoned) or "none"
    log.info("rank %d: reconnected to rank(s) %s (incarnation %d) in %.3f s", mem.rank, ranks, mine, seconds)


def _fail_abandoned(mem: Memory, peers: dict[int, int], abandoned: list[int]) -> None:
    """Peers lost again before they met us: their links wait for their next incarnations."""
    for j in abandoned:
        why = f"incarnation {peers[j]} of rank {j} was lost while reconnecting"
        mem.client.fail(j, why)
        mem.server.fail(j, why)
        mem.handler.forget(j)


# ---------------------------------------------------------------------- the survivors' reports


def survivor_report(mem: Memory, rank: int | None) -> dict[str, Any]:
    """What this survivor tells recovering `rank` (msgpack-able): see `dsm_recovering`.  `rank` None: the
    post-replay report of this recovered rank (`post_report`), its `held` over every lock.

    Runs on the runtime thread while this rank's program thread runs on.  Safe without a lock:
    every container is copied by one C-level call (list(), dict.copy()), which the GIL makes
    atomic, so each copy is some state it had; a page's home is one word, read once.  (A claim
    answered by `rank`'s dead incarnation but not yet recorded here is missed: a window of a few
    instructions in `Memory._lookup_home`.  A claim asked later goes to the next incarnation.)  The vector timestamp is
    copied before the notices, and raised only after them (`Memory._merge`) -- except this rank's
    own entry, raised just before its interval's notice is recorded: that interval is left out
    (its diffs went to their homes, but nothing was released through `rank`'s locks yet).  The
    locks homed at `rank` cannot change meanwhile: their requests wait for `rank`'s next incarnation.
    """
    vt = list(mem.vt)
    floor = list(mem.floor)
    known = mem.known.copy()
    held, tokens = mem.held.copy(), mem.tokens.copy()
    releasing = set(getattr(mem, "releasing", ()))  # an image older than the field has none
    # for a recovered barrier manager: from a survivor, or from a rank recovered at the same time (`rank` None)
    barrier = getattr(mem, "last_reply", None) if rank in (0, None) else None
    me = mem.rank
    if vt[me] > floor[me] and (me, vt[me]) not in known:
        vt[me] -= 1  # caught between `vt[me] = interval` and its notice (`Memory._close_interval`)
    claims: list[int] = []
    for region in list(mem.regions):
        pages = np.flatnonzero(region.home == me)
        owners = (region.aid + pages) % mem.size  # `Region.default_home`
        if rank is None:
            break
        claims += [gid_of(region.aid, int(page)) for page in pages[owners == rank]]
    return {
        "vt": vt,
        "known": [[q, i, flat] for (q, i), flat in known.items() if i > floor[q]],
        "held": {
            lock: [tokens.get(lock, 0), list(at)]
            for lock, at in held.items()
            if rank is None or lock % mem.size == rank
        },
        "claims": claims,
        "releasing": sorted(lock for lock in releasing if lock in held and (rank is None or lock % mem.size == rank)),
        "barrier": None
        if barrier is None
        else [barrier[0], list(barrier[1]), [[q, i, list(f)] for q, i, f in barrier[2]]],
    }


def _report(raw: Any, size: int) -> dict[str, Any]:
    """A survivor's report as it came through the KV, in the types `survivor_report` made (a fresh copy)."""
    try:
        vt = [int(x) for x in raw["vt"]]
        if len(vt) != size:
            raise ValueError(f"a vector timestamp of {len(vt)} entries, not {size}")
        return {
            "vt": vt,
            "known": [[int(q), int(i), [int(x) for x in flat]] for q, i, flat in raw["known"]],
            "held": {int(lock): [int(token), [int(x) for x in at]] for lock, (token, at) in raw["held"].items()},
            "claims": [int(gid) for gid in raw["claims"]],
            "releasing": [int(lock) for lock in raw.get("releasing", [])],
            "barrier": _barrier_of(raw.get("barrier")),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise DsmError(f"DSM: a survivor's recovery report is malformed ({exc})") from None


def _barrier_of(raw: Any) -> list[Any] | None:
    """A report's last barrier reply, [epoch, vt, notices], in plain ints (None: none)."""
    if raw is None:
        return None
    epoch, vt, notices = raw
    return [int(epoch), [int(x) for x in vt], [[int(q), int(i), [int(x) for x in flat]] for q, i, flat in notices]]


def _apply_claims(mem: Memory, reports: dict[int, dict[str, Any]]) -> None:
    """The pages the survivors claimed (first touch) at this rank since its image: into its home table."""
    for peer, report in reports.items():
        for gid in report["claims"]:
            aid, page = split_gid(gid)
            if aid >= len(mem.regions) or page >= mem.regions[aid].npages:
                continue  # an array made after the image: its table starts empty when the replay makes it
            region = mem.regions[aid]
            region.table[page] = peer + 1
            if int(region.home[page]) < 0:
                region.home[page] = peer


# ---------------------------------------------------------------------- post-replay reports
# Concurrent recoveries (FT-KDSM §5; design of issue 13 part 5, §2.4).  A
# recovered lock home rebuilds its locks from the survivors' reports, but a
# rank recovering at the same time (or lost at this rank's reconnection and
# not yet back, or still replaying an earlier recovery) sends none, and what
# it holds is known only once *its* replay is done.  So every recovered
# rank, when its replay ends (or at once without one), publishes its own
# report -- `held` over all locks, the home keeps its own -- under
#
#     post/<memory>/<rank>/<incarnation>  -> survivor_report(mem, None)
#
# before it waits for anything, and a recovered home waits for the
# post-reports of those ranks (`await_posts`) before it rebuilds.  No cycle:
# each publishes before it waits, a replay needs no lock grant (only page
# service, which the waiting home's handler thread keeps giving), and the
# wait is on a thread of its own, so a rank whose replay was empty (its
# `replay_done` runs in REFRESH, before its handler thread starts) is not
# blocked there.  A rank whose awaited incarnation is lost meanwhile is
# awaited in its next one (it replays again from its image); the deadline
# restarts whenever that rank shows replay progress.


def post_report(mem: Memory) -> dict[str, Any]:
    """This recovered rank's state after its replay, published for the recovered lock homes (`await_posts`)."""
    report = survivor_report(mem, None)
    kv = getattr(mem.rt, "kv", None)
    if kv is not None:
        kv.publish(KV_NS, post_key(mem.mid, mem.rank, mem.handler.incarnation), report)
    return _report(report, mem.size)


def await_posts(mem: Memory, awaited: dict[int, int], timeout: float = RECONNECT_TIMEOUT) -> dict[int, dict[str, Any]]:
    """The post-replay reports of `awaited` (rank -> the incarnation expected), each of that incarnation
    or, once it is lost, of a later one; DsmError if a rank shows no progress for `timeout` seconds."""
    kv = mem.rt.kv
    posts: dict[int, dict[str, Any]] = {}
    for rank, incarnation in sorted(awaited.items()):
        deadline, progress = time.monotonic() + timeout, None
        while rank not in posts:
            value = kv.get(KV_NS, post_key(mem.mid, rank, incarnation))
            if value is not None:
                posts[rank] = _report(value, mem.size)
                break
            if _lost(mem, rank, incarnation):
                incarnation += 1  # it replays again from its image: wait for its next incarnation's
                deadline = time.monotonic() + timeout
                continue
            now = kv.get(RANKS_NS, f"replay/{rank}")
            if now != progress:
                progress, deadline = now, time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0:
                raise DsmError(
                    f"DSM: rank {rank} (incarnation {incarnation}) published no state after its replay "
                    f"within {timeout:.0f} s: the locks homed at rank {mem.rank} cannot be rebuilt"
                )
            try:
                kv.subscribe(KV_NS, post_key(mem.mid, rank, incarnation), min(SLICE, left))
            except CoordinatorError:
                continue  # a slice ran out: look again whether the rank was lost meanwhile
    return posts
