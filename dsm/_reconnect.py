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
#   generation-scoped; <tag> = "R.K" names the recovery, so a later recovery
#   of R or of its peer never reads these keys):
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
# R is *reconnected* here, not *replayed*: it continues from its image with
# the state it had then, and the survivors' re-sent requests are served from
# that state.  Synchronisation that R re-executes after a real failure (a
# lock it had acquired, a barrier it had passed, diffs the homes already
# applied) needs the logs of remote logging (ckpt_remotelog) to give the same
# answers as the first time; until then the lock home lets the rank it
# believes holds a lock acquire it again (`dsm._handler`).  Two ranks failing
# at the same time are not handled yet: a recovering rank waits for every
# peer's keys, a failed one's included.

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._memory import Memory

log = logging.getLogger("dsm")

KV_NS = "dsm"
#: How long one side of a reconnection waits for the other's keys: both act on the same event.
RECONNECT_TIMEOUT = 120.0


def conn_key(memory: int, src: int, dst: int, tag: str) -> str:
    return f"conn/{memory}/{src}-{dst}/{tag}"


def ready_key(memory: int, src: int, dst: int, tag: str) -> str:
    return f"ready/{memory}/{src}-{dst}/{tag}"


def peer_failed(mem: Memory, rank: int, incarnation: int) -> None:
    """A survivor: fail the links to `rank` and forget what the handler owed its dead incarnation."""
    if rank == mem.rank or not 0 <= rank < mem.size:
        return
    why = f"incarnation {incarnation} of rank {rank} was lost"
    mem.client.fail(rank, why)
    mem.server.fail(rank, why)
    mem.handler.forget(rank)


def peer_recovered(mem: Memory, rank: int, incarnation: int) -> None:
    """A survivor: fresh links to `rank`'s new incarnation (pending requests go again once they are up)."""
    if rank == mem.rank or not 0 <= rank < mem.size:
        return
    reconnect(mem, [rank], f"{rank}.{incarnation}")


def recovered(mem: Memory, incarnation: int) -> None:
    """The process that replaced a failed rank, restored from its image: fresh links to every rank."""
    mem.rid = max(mem.rid, incarnation << 40)
    mem.pending.clear()
    mem.replies.clear()
    mem.client.forget_everything()
    mem.server.forget_everything()
    mem.handler.forget_queues()
    reconnect(mem, list(range(mem.size)), f"{mem.rank}.{incarnation}")


def reconnect(mem: Memory, peers: list[int], tag: str) -> None:
    """Fresh QPs to `peers`, met through the KV keys of recovery `tag`; the links are up on return."""
    kv = mem.rt.kv
    started = time.perf_counter()
    fresh = {j: (mem.client.new_qp(), mem.server.new_qp()) for j in peers}
    lid = mem.ctx.query_port(1).lid
    regions = [region.address() for region in mem.regions]
    for j, (client, server) in fresh.items():
        record = {"lid": lid, "client": client.qp_num, "server": server.qp_num, "regions": regions}
        kv.publish(KV_NS, conn_key(mem.mid, mem.rank, j, tag), record)
    for j, (client, server) in fresh.items():
        theirs = kv.subscribe(KV_NS, conn_key(mem.mid, j, mem.rank, tag), RECONNECT_TIMEOUT)
        for region, address in zip(mem.regions, theirs["regions"], strict=False):
            region.peers[j] = dict(address)  # before the link is up: no operation uses the old ones after
        mem.client.attach(j, client, int(theirs["lid"]), int(theirs["server"]))
        mem.server.attach(j, server, int(theirs["lid"]), int(theirs["client"]))
        kv.publish(KV_NS, ready_key(mem.mid, mem.rank, j, tag), True)
    for j in fresh:
        kv.subscribe(KV_NS, ready_key(mem.mid, j, mem.rank, tag), RECONNECT_TIMEOUT)
        mem.client.up(j)
        mem.server.up(j)
    seconds = time.perf_counter() - started
    ranks = ", ".join(map(str, peers))
    log.info("rank %d: reconnected to rank(s) %s (recovery %s) in %.3f s", mem.rank, ranks, tag, seconds)
