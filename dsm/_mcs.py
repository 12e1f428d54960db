"""Distributed queue (MCS) locks on remote atomics, and the registered control words of a Cashmere rank.

Rationale (cashmere-memory-mapped-ni-dsm.txt §2.2; Mellor-Crummey and Scott).  A
lock is one word, its *tail*, in some rank's registered memory: 0 when free, else
``rank + 1`` of the last rank in line.  Every rank has a *queue node* per lock it
may wait for -- ``next`` (``rank + 1`` of its successor, 0: none yet), ``flag``
(set when the lock is handed to it) and a few words of data that travel with the
hand-over -- in its own registered memory, at an offset every rank can compute.

* Acquire: swap ourselves in as the tail.  InfiniBand has no atomic swap, so it
  is a CMP_AND_SWP from what we last saw to us, repeated with what it returned
  until it succeeds.  The old tail 0 means the lock was free; else we write our
  number into the predecessor's ``next`` and wait on our own ``flag``.
* Release: with no successor yet, CMP_AND_SWP the tail from us back to 0; if that
  fails, one is linking itself in: wait for our ``next``.  Then write the data and
  the ``flag`` into the successor's node -- one message latency passes ownership
  and data.

Waiting on a word of one's own memory is a spin on real hardware.  Here the
writes that end a wait (``next``, ``flag``, a barrier's release) are RDMA WRITE
WITH IMM: the data lands like any WRITE, and the receive completion it makes on
the waiter's endpoint wakes a wait blocked on that endpoint's completion channel.
No thread of the lock's home does anything for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ckpt import verbs

from ._errors import DsmError
from ._net import ACCESS, atomic, rdma

if TYPE_CHECKING:
    from ._net import Endpoint

#: Program locks a memory can make (their queue nodes are preallocated on every rank).
MAX_LOCKS = 1024
#: Words of one queue node: next, flag, then up to NODE_DATA words handed over with the lock.
NODE_WORDS = 8
NODE_DATA = NODE_WORDS - 2
NEXT, FLAG = 0, 1
#: Slots of a rank's write-notice list (a circular array; an overrun is detected and handled by its owner).
NOTICE_SLOTS = 4096

# the control words of a rank, in one registered int64 array
NOTICE_TAIL = 0  # slots of the notice list reserved so far (FETCH_AND_ADD by the writers of notices)
BARRIER_COUNT = 1  # at rank 0: arrivals at barriers so far (FETCH_AND_ADD)
BARRIER_FLAG = 2  # the last barrier released (written by its last arrival)
LAND = 3  # where an atomic's old value lands
ONE = 4  # the constant 1 (source of a flag write)
ME = 5  # rank + 1 (source of a link write)
DISCARD = 6  # where the old values of atomics posted without waiting land (nobody reads them)
SOURCE = 8  # 8 words: sources of small writes (an entry, a notice, an epoch)
READ = 16  # 8 words: destinations of small reads (a directory entry)
TAILS = 24  # MAX_LOCKS words: the tails of the program locks homed here (lock L at rank L % size, word L // size)
NODES = TAILS + MAX_LOCKS  # MAX_LOCKS + 1 queue nodes: program lock L's, then the directory's
NOTICES = NODES + (MAX_LOCKS + 1) * NODE_WORDS  # NOTICE_SLOTS pairs (page id, reservation number + 1)
WORDS = NOTICES + 2 * NOTICE_SLOTS
DIRECTORY_NODE = MAX_LOCKS  # the node a rank waits on for a directory entry (it holds one at a time)


class Control:
    """A rank's control words (`WORDS` int64, registered) and the one-sided operations on peers' words.

    `client` issues one-sided operations (to every rank, itself included: loopback); `server` is the
    endpoint peers' WRITE WITH IMM arrive on, which the waits block on.
    """

    def __init__(self, pd: verbs.PD, rank: int, client: Endpoint, server: Endpoint) -> None:
        self.rank, self.client, self.server = rank, client, server
        self.words = verbs.shared_array(WORDS, np.int64)
        self.words[ONE] = 1
        self.words[ME] = rank + 1
        self.mr = verbs.MR(pd, self.words, ACCESS)
        self.peers: list[dict[str, int]] = []
        self.seq = [0]
        self.atomics = 0  # remote atomics issued (statistics)

    def address(self) -> dict[str, int]:
        return {"words": self.mr.buf, "rkey": self.mr.rkey}

    def local(self, word: int, count: int = 1) -> tuple[int, int, int]:
        """(address, length, lkey) of `count` of our own words from `word`."""
        return self.mr.buf + word * 8, count * 8, self.mr.lkey

    def remote(self, peer: int, word: int) -> tuple[int, int]:
        """(rkey, address) of `peer`'s control word `word`."""
        return self.peers[peer]["rkey"], self.peers[peer]["words"] + word * 8

    # ------------------------------------------------------------ one-sided operations
    def run(self, peer: int, wrs: Sequence[verbs.SendWR]) -> None:
        self.client.run(peer, list(wrs), self.seq)

    def cas(
        self,
        peer: int,
        target: tuple[int, int],
        expected: int,
        new: int,
        before: Sequence[verbs.SendWR] = (),
        after: Sequence[verbs.SendWR] = (),
    ) -> int:
        """CMP_AND_SWP at `peer`'s (rkey, address): its old value.  `before` and `after` (one-sided operations
        at `peer`) go in the same chain, ahead of it and behind it."""
        land = (self.mr.buf + LAND * 8, self.mr.lkey)
        self.run(peer, [*before, atomic(verbs.IBV_WR_ATOMIC_CMP_AND_SWP, land, *target, expected, new), *after])
        self.atomics += 1
        return int(self.words[LAND])

    def fetch_add(self, peer: int, target: tuple[int, int], add: int) -> int:
        land = (self.mr.buf + LAND * 8, self.mr.lkey)
        self.run(peer, [atomic(verbs.IBV_WR_ATOMIC_FETCH_AND_ADD, land, *target, add)])
        self.atomics += 1
        return int(self.words[LAND])

    def notify_write(self, local: tuple[int, int, int], peer: int, word: int) -> verbs.SendWR:
        """An RDMA WRITE WITH IMM of `local` into `peer`'s control word `word`: it wakes `peer`'s waits."""
        wr = verbs.SendWR(opcode=verbs.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[verbs.SGE(*local)], imm_data=word)
        wr.set_wr_rdma(*self.remote(peer, word))
        return wr

    def wait(self, done: Callable[[], bool], what: str) -> None:
        """Until `done()` (it looks at our own words): woken by peers' WRITE WITH IMM.  No timeout of its own
        beyond the endpoint's: a lock may be held, or a barrier awaited, as long as a peer computes.

        It reaps every notification first (`reap`), even when `done()` already holds.
        """
        self.reap()
        self.server.wait(done, what, timeout=float("inf"))

    def reap(self) -> None:
        """Take every notification that arrived: each took a posted receive, which only a poll gives back.  Done at
        every acquire, release and wait, so a rank is never owed more than the few of one operation per peer (a
        successor's link, a predecessor's flag, a barrier's release) -- never enough to leave a writer without a
        receive, in RNR retries bounded by its endpoint's wait.  It looks at the completion channel first and
        polls only if something came (`Endpoint.take_signalled`): most looks find nothing, and an empty poll of a
        simulated CQ waits up to 0.5 ms for a completion -- at two looks per lock operation, that was half of a
        Cashmere run's time (docs/benchmarks.md, "The protocol study")."""
        self.server.take_signalled()

    # ------------------------------------------------------------ MCS
    def acquire(
        self, home: int, tail: tuple[int, int], node: int, what: str, read: Sequence[verbs.SendWR] = ()
    ) -> bool:
        """Join the queue of the lock whose tail is `tail` at `home`, waiting on our node `node`.

        `read` (one-sided READs at `home`) is posted right behind the first swap attempt: if the
        lock was free its data is there at once.  True: the lock was free (`read` holds); False:
        it was handed over, with the node's data.
        """
        self.reap()
        base = NODES + node * NODE_WORDS
        self.words[base : base + NODE_WORDS] = 0
        me, expected = self.rank + 1, 0
        old = self.cas(home, tail, 0, me, after=read)
        swaps = 1
        while old != expected:  # someone is in line: swap from what we saw, until we win
            expected = old
            old = self.cas(home, tail, expected, me)
            swaps += 1
        if expected == 0:
            if swaps > 1 and read:  # free only by the time a later swap won: what `read` brought is older
                self.run(home, read)
            return True
        predecessor = expected - 1
        self.run(predecessor, [self.notify_write(self.local(ME), predecessor, base + NEXT)])
        self.wait(lambda: bool(self.words[base + FLAG]), what)
        return False

    def release(
        self,
        home: int,
        tail: tuple[int, int],
        node: int,
        what: str,
        data: tuple[int, int] | None = None,
        before: Sequence[verbs.SendWR] = (),
    ) -> None:
        """Leave the lock: to nobody (the tail back to 0) or to the successor, with `data` = (first source
        word, count) of our control words written into its node's data first.  `before` (one-sided
        WRITEs at `home`) is posted ahead of the tail's swap, in the same chain."""
        self.reap()
        base = NODES + node * NODE_WORDS
        me = self.rank + 1
        if not self.words[base + NEXT]:
            old = self.cas(home, tail, me, 0, before=before)
            if old == me:
                return
            if old == 0:
                raise DsmError(f"{what}: released by rank {self.rank}, which did not hold it")
            self.wait(lambda: bool(self.words[base + NEXT]), f"the next rank in line for {what}")
        elif before:
            self.run(home, before)
        successor = int(self.words[base + NEXT]) - 1
        wrs = []
        if data is not None:
            first, count = data
            if count > NODE_DATA:
                raise DsmError(f"{what}: {count} words do not fit a queue node")
            wrs.append(rdma(verbs.IBV_WR_RDMA_WRITE, self.local(first, count), *self.remote(successor, base + 2)))
        wrs.append(self.notify_write(self.local(ONE), successor, base + FLAG))
        self.run(successor, wrs)

    def node_data(self, node: int, count: int) -> np.ndarray:
        """The data a hand-over wrote into our node `node` (a copy)."""
        base = NODES + node * NODE_WORDS + 2
        return self.words[base : base + count].copy()
