"""The Cashmere protocol (``--dsm-protocol cashmere``): a directory and write-through over one-sided verbs.

Rationale (cashmere-memory-mapped-ni-dsm.txt §2.2, with RDMA as the memory-mapped
network interface; docs/dsm.md "Cashmere").  Same `Memory` API as HLRC -- arrays,
locks, barriers, `statistics()` -- so the same programs run unchanged.  Everything a
rank does to another rank's state it does itself, by RDMA READ / WRITE and remote
atomics: no thread of a page's home, lock's home or barrier's manager runs for it.

* **Homes** are taken at first touch (read or write): CMP_AND_SWP on the page's
  word in its default home's table, as under ``onesided``.  The home's copy is the
  master copy.
* **The directory** of a page lives at its home, in registered memory: an MCS
  lock's tail (`dsm._mcs`) and three rank sets -- *readers* (ranks holding a copy),
  *writers*, and *noticed* (readers a write notice is on its way to, not yet acted
  on).  The page's global state follows from them: Uncached (no reader), Shared (no
  writer), Dirty (one user, who writes), Weak (several users, one of them writing).
  A rank changes an entry only under its lock: the entry is read with the lock (one
  chain: the swap, then the READ) or handed over with it by the predecessor, and
  written back before the lock goes on.
* **Faults**: a rank's first access to a page it has no copy of joins the readers
  and copies the page from the home (copy fill).  Joining a page that another rank
  writes (Weak) puts it on this rank's own list of pages to drop at its next
  acquire: its copy may be stale by then.
* **Write-through** instead of twins and diffs: when a ``write()`` block (or an
  ``a[i] = x``) ends, the bytes it changed in pages homed elsewhere go to the home's
  copy by RDMA WRITE, run by run (software write doubling: only changed elements,
  so writers of disjoint parts of one page never overwrite each other).  The WRITEs
  are posted, not waited for: a release waits until every one has completed.
* **Write notices**, delayed to the release (the paper's first optimisation): a
  release takes each page written since the last one and not *processed* yet, adds
  this rank to its writers and appends a notice to the circular list of each reader
  not already noticed -- a FETCH_AND_ADD reserves the slot, two WRITEs fill it (the
  page, then the reservation number, which marks it complete).  The processed bit is
  cleared when the rank drops the page, and when it copies it afresh.
* **Acquire** (a lock, a barrier's exit) self-invalidates every page its list names
  and every page it joined while Weak: (a) lock the entry, (d) leave its readers,
  writers and noticed sets, (e) the state follows, (f) unlock; (b, c) drop the copy.
  An unsafe page keeps a writer that dropped its copy in its writers until no rank
  shares the page: it stays Weak, which is what its holders' acquires look for.

Invariants:
* a release completes only after its write-throughs have landed at the homes and
  its notices are in the readers' lists (both are waited for before the lock goes on
  or the barrier is entered);
* a rank with a copy of a page that another rank writes drops it at its first
  acquire after that writer's release: it was a reader when the writer processed the
  page (a notice), or joined after (the page was Weak: its own list);
* a home never drops its copy (it is the master) and is never a reader;
* a rank's own write-throughs land before it reads any page back (`_drain`).

Locks and barriers need no manager thread either: program locks are MCS locks whose
tails are spread round robin; a barrier is a FETCH_AND_ADD on a counter at rank 0, and
its last arrival writes the barrier's number into every rank's flag.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

import ckpt
from ckpt import verbs
from ckpt.plugin import PluginCalls

from . import FILLS, hookspecs
from ._array import Lock, SharedArray
from ._diff import diff_unit, make_diff
from ._errors import DsmError, check_synchronising
from ._mcs import (
    BARRIER_COUNT,
    BARRIER_FLAG,
    DIRECTORY_NODE,
    DISCARD,
    MAX_LOCKS,
    NOTICE_SLOTS,
    NOTICE_TAIL,
    NOTICES,
    READ,
    SOURCE,
    TAILS,
    Control,
)
from ._net import ACCESS, Endpoint, atomic, rdma
from ._region import INVALID, VALID, Region, gid_of, split_gid
from ._stats import Counters, Statistics

log = logging.getLogger("dsm")
#: The DSM hooks Cashmere fires (it has no intervals, diffs or handler: docs/dsm.md).
HOOKS = ("dsm_lock_acquired", "dsm_lock_released", "dsm_barrier_passed")
#: A page's directory row at its home: its MCS lock's tail, then the *entry* -- the rank sets (bit r: rank r),
#: what is read, written back and handed over with the lock -- then the page's write-through seqlock: write-throughs
#: in progress (BUSY) and completed (DONE), which copies check (`_fill`).
TAIL, FIRST, BUSY, DONE, ROW = 0, 1, 5, 6, 7
READERS, WRITERS, NOTICED, UNSAFE = range(4)  # in an entry (UNSAFE: 1 once the page is unsafe)
ENTRY = 4
#: Unsafe pages this rank holds whose directory rows one acquire reads in one chain per home.
PROBE_BATCH = 64
#: Pages one fill chain copies from one home (each with its seqlock read before and after: 2 x 2 words).
FILL_BATCH = 8
#: A fill that overlapped a write-through is read again, up to this long (a write-through is one chain, or a few
#: for a page with hundreds of changed runs).
FILL_TIMEOUT = 60.0
#: Bits of a rank set (an int64 word); a larger job is refused at attach.
MAX_RANKS = 63
#: Receives posted on every server QP for peers' WRITE WITH IMM.  Each one takes a receive until the rank's own
#: thread reaps it (`Control.reap`, at every acquire, release and wait): between two reaps a peer owes it a few (a
#: successor's link, a predecessor's hand-over, a barrier's release).
NOTIFY_RECVS = 16
#: Work requests of write-throughs in flight towards one home before a rank waits for them (a QP's send queue
#: holds 512).
THROUGH_LIMIT = 256
# How a fault fills a page (`dsm.FILLS`, the paper's copy-versus-fill choice): ``copy`` the page from its home at
# the first access (its C.. systems), or bring only the lines an access touches, from the home, and keep them until
# the page is dropped (``line``: remote line fills, its N.. systems).
#: A line of the line fill (the paper's cache line).
LINE = 64


class CashmereRegion(Region):
    """A shared array's pages under Cashmere: `Region` plus the directory of the pages homed here."""

    def __init__(self, pd: verbs.PD, aid: int, nbytes: int, unit: int, page_size: int, rank: int, size: int) -> None:
        super().__init__(pd, aid, nbytes, unit, page_size, rank, size)
        self.directory = verbs.shared_array((self.npages, ROW), np.int64)
        self.directory_mr = verbs.MR(pd, self.directory, ACCESS)
        self.state[:] = INVALID  # no copy until the first touch: only a reader hears of others' writes
        self.processed = np.zeros(self.npages, dtype=bool)  # its notices went out since this rank last dropped it
        self.lines = np.zeros((self.npages, page_size // LINE), dtype=bool)  # line fill: the lines that are here

    def address(self) -> dict[str, int]:
        return {**super().address(), "dir": self.directory_mr.buf, "dir_rkey": self.directory_mr.rkey}

    def remote_entry(self, home: int, page: int, word: int) -> tuple[int, int]:
        peer = self.peers[home]
        return peer["dir_rkey"], peer["dir"] + (page * ROW + word) * 8


class Cashmere:
    """One rank's handle on a Cashmere shared memory; ``dsm.attach(rt, "cashmere")`` makes it (collectively)."""

    protocol = "cashmere"
    #: `SharedArray` forwards what a write block changed (`through_begin` / `through_end`).
    write_through = True

    _plugins: PluginCalls | None
    _fire: frozenset[str]

    def __init__(self, rt: Any, page_size: int, fill: str = "copy", unsafe: int = 0) -> None:
        if unsafe < 0:
            raise DsmError(f"the unsafe threshold is a number of readers (0: never unsafe), not {unsafe}")
        if fill not in FILLS:
            raise DsmError(f"unknown Cashmere fill policy {fill!r}: choose one of {', '.join(FILLS)}")
        if rt.size > MAX_RANKS:
            raise DsmError(f"the cashmere protocol keeps rank sets in 64-bit words: at most {MAX_RANKS} ranks")
        if page_size < 64 or page_size & (page_size - 1):
            raise DsmError(f"page size must be a power of two of at least 64 bytes, not {page_size}")
        logging_mode = (getattr(rt, "options", {}) or {}).get("logging") or "off"
        if logging_mode != "off":  # (ckpt_remotelog refuses it at launch; this is for other launchers)
            raise DsmError(f"--logging {logging_mode} needs an HLRC protocol (async or onesided), not cashmere")
        self.rt, self.rank, self.size = rt, rt.rank, rt.size
        self.page_size, self.fill = page_size, fill
        #: A page becomes unsafe when one release would send notices to this many readers (0: never).
        self.unsafe = unsafe
        self.unsafe_held: set[int] = set()  # unsafe pages this rank holds a copy of: their rows are read at acquires
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.client = Endpoint(self.ctx, self.pd, self.size, 64, nrecv=1, nsend=1)
        self.server = Endpoint(self.ctx, self.pd, self.size, 64, nrecv=NOTIFY_RECVS, nsend=1)
        self.control = Control(self.pd, self.rank, self.client, self.server)
        self.seqlocks = verbs.shared_array(4 * FILL_BATCH, np.int64)  # a fill's seqlock reads, before and after
        self.seqlocks_mr = verbs.MR(self.pd, self.seqlocks, ACCESS)
        self.notes = verbs.shared_array((self.size, 3), np.int64)  # per reader: its slot's number, the notice's words
        self.notes_mr = verbs.MR(self.pd, self.notes, ACCESS)
        self.probes = verbs.shared_array(PROBE_BATCH, np.int64)  # the writers of unsafe pages, read at an acquire
        self.probes_mr = verbs.MR(self.pd, self.probes, ACCESS)
        self.regions: list[CashmereRegion] = []
        self.nlocks = 0
        self.held: dict[int, float] = {}  # lock -> when it was granted
        self.writing = 0  # open `with a.write(...)` blocks
        self.epoch = 0
        self.written: set[int] = set()  # pages written since the last release (gids)
        self.stale: set[int] = set()  # pages joined while another rank wrote them: dropped at the next acquire
        self.notice_head = 0  # the first slot of the notice list not yet taken
        self.notices_ahead: set[int] = set()  # slots past it taken already (a slot filled late holds the head)
        self.through: list[int] = []  # wr_ids of the write-throughs in flight
        self.through_count = [0] * self.size  # their WRs, by home
        self.counters = Counters()
        self._live()
        me = {
            "lid": self.ctx.query_port(1).lid,
            "client": self.client.address(),
            "server": self.server.address(),
            "control": self.control.address(),
        }
        peers = rt.allgather(me)
        self.control.peers = [peer["control"] for peer in peers]
        self.client.connect(peers, self.rank, "server")
        self.server.connect(peers, self.rank, "client")
        rt.allgather(None)  # every QP is in RTS before anyone posts

    # ------------------------------------------------------------------ public API
    def array(self, shape: int | tuple[int, ...], dtype: Any = np.float64) -> SharedArray:
        """Collective: a shared array of zeros; the same handle on every rank (call in the same order everywhere)."""
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        unit = diff_unit(np.dtype(dtype))
        region = CashmereRegion(self.pd, len(self.regions), nbytes, unit, self.page_size, self.rank, self.size)
        self.regions.append(region)
        region.peers = self.rt.allgather(region.address())
        return SharedArray(self, region, shape, np.dtype(dtype))

    def lock(self) -> Lock:
        """Collective by convention (call in the same order everywhere): a new lock, its tail at id mod size."""
        if self.nlocks >= MAX_LOCKS:
            raise DsmError(f"the cashmere protocol has room for {MAX_LOCKS} locks")
        self.nlocks += 1
        return Lock(self, self.nlocks - 1)

    def barrier(self) -> None:
        """Global barrier: every rank's writes through, its notices posted; then each drops what they name."""
        check_synchronising(self.writing, "barrier()")
        self._release_writes()
        started = time.perf_counter()
        self.epoch += 1
        control, epoch = self.control, self.epoch
        arrived = control.fetch_add(0, control.remote(0, BARRIER_COUNT), 1) + 1
        self.counters.count("faa", 8)
        if arrived == epoch * self.size:  # the last one in: release everyone
            control.words[SOURCE + 6] = epoch
            for rank in range(self.size):
                control.run(rank, [control.notify_write(control.local(SOURCE + 6), rank, BARRIER_FLAG)])
        control.wait(lambda: int(control.words[BARRIER_FLAG]) >= epoch, f"barrier {epoch}")
        self._self_invalidate()
        self.counters.barriers += 1
        self.counters.barrier_seconds += time.perf_counter() - started
        self.hook("dsm_barrier_passed", epoch=epoch)

    def acquire(self, lock: int) -> None:
        check_synchronising(self.writing, "acquiring a lock")
        if lock in self.held:
            raise DsmError(f"lock {lock} is already held by this rank (DSM locks are not re-entrant)")
        started = time.perf_counter()
        home, control = lock % self.size, self.control
        control.acquire(home, control.remote(home, TAILS + lock // self.size), lock, f"lock {lock}")
        self.held[lock] = time.monotonic()
        self._self_invalidate()
        seconds = time.perf_counter() - started
        self.counters.lock_acquires += 1
        self.counters.lock_seconds += seconds
        self.hook("dsm_lock_acquired", lock=lock, seconds=seconds)

    def release(self, lock: int) -> None:
        check_synchronising(self.writing, "releasing a lock")
        if lock not in self.held:
            raise DsmError(f"lock {lock} is not held by this rank")
        self._release_writes()
        started = time.perf_counter()
        home, control = lock % self.size, self.control
        control.release(home, control.remote(home, TAILS + lock // self.size), lock, f"lock {lock}")
        del self.held[lock]
        self.counters.lock_seconds += time.perf_counter() - started
        self.hook("dsm_lock_released", lock=lock)

    def statistics(self) -> Statistics:
        """This rank's counters and time breakdown since attach (frozen)."""
        self.counters.atomics = self.control.atomics
        return self.counters.snapshot(self.protocol, self.rank, Counters())

    def close(self) -> None:
        """Leave the shared memory (not collective, final): peers that still touch this rank's memory get errors."""
        if self._plugins is not None:
            self._plugins.unregister(self)
        self._plugins, self._fire = None, frozenset()
        self.ctx.close()

    # ------------------------------------------------------------------ faults
    def read_fault(self, region: CashmereRegion, pages: np.ndarray, span: tuple[int, int] | None = None) -> None:
        """Make `pages` readable: `span` is the access's bytes in the array (None: every byte of the pages)."""
        unmapped = pages[region.state[pages] == INVALID]
        if len(unmapped):
            self.counters.read_faults += len(unmapped)
        if self.fill == "copy":
            if len(unmapped):
                self._fill(region, unmapped.tolist(), None)
        else:
            self._fill(region, pages.tolist(), span)

    def write_fault(self, region: CashmereRegion, pages: np.ndarray, span: tuple[int, int] | None = None) -> None:
        if self.fill == "copy":
            unmapped = pages[region.state[pages] == INVALID]
            if len(unmapped):
                self._fill(region, unmapped.tolist(), None)
        else:
            self._fill(region, pages.tolist(), span)
        for page in pages.tolist():
            gid = gid_of(region.aid, page)
            if gid not in self.written:
                self.written.add(gid)
                self.counters.write_faults += 1

    def _fill(self, region: CashmereRegion, pages: list[int], span: tuple[int, int] | None) -> None:
        """Join the readers of each page this rank has no copy of (under its row's lock), then bring from the homes,
        a chain per home, what the access needs: whole pages (copy fill), or the lines of `span` not here yet
        (line fill: remote line fills, kept until the page is dropped)."""
        started = time.perf_counter()
        wanted: dict[int, list[tuple[int, list[tuple[int, int]]]]] = {}  # home -> [(page, [(offset, length)])]
        for page in pages:
            if region.state[page] == INVALID:
                home = self._home(region, page)
                if home == self.rank:
                    region.state[page] = VALID  # the master copy
                    region.lines[page] = True
                    continue
                self._join(region, page, home)
                region.state[page] = VALID
            elif region.home[page] == self.rank:
                continue
            runs = self._missing(region, page, span)
            if runs:
                wanted.setdefault(int(region.home[page]), []).append((page, runs))
        if not wanted:
            return
        self._drain()  # our own write-throughs land before we read those pages back
        for home, pieces in wanted.items():
            for first in range(0, len(pieces), FILL_BATCH):
                self._read(region, home, pieces[first : first + FILL_BATCH])
        self.counters.fetch_rounds += 1
        self.counters.page_fetch_seconds += time.perf_counter() - started

    def _missing(self, region: CashmereRegion, page: int, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """The (offset, length) runs of `page` to bring: the whole page (copy fill), else the lines of `span` in it
        that are not here (consecutive ones in one run)."""
        size = self.page_size
        if self.fill == "copy":
            return [(0, size)]
        low, high = (0, size) if span is None else (max(span[0] - page * size, 0), min(span[1] - page * size, size))
        if high <= low:
            return []
        first, last = low // LINE, (high - 1) // LINE + 1
        absent = np.flatnonzero(~region.lines[page, first:last]) + first
        if not len(absent):
            return []
        breaks = np.flatnonzero(np.diff(absent) != 1)
        starts = np.concatenate(([absent[0]], absent[breaks + 1]))
        ends = np.concatenate((absent[breaks], [absent[-1]])) + 1
        return [(int(a) * LINE, int(b - a) * LINE) for a, b in zip(starts, ends, strict=True)]

    def _read(self, region: CashmereRegion, home: int, pieces: list[tuple[int, list[tuple[int, int]]]]) -> None:
        """Read each page's runs from `home` in one chain, between two reads of the page's seqlock, again until the
        reads overlapped no write-through (both seqlock reads equal, none in progress) -- so nothing read is torn."""
        base, lkey = self.seqlocks_mr.buf, self.seqlocks_mr.lkey
        deadline, retries = time.monotonic() + FILL_TIMEOUT, 0
        while pieces:
            reads = []
            for i, (page, runs) in enumerate(pieces):
                seqlock = region.remote_entry(home, page, BUSY)
                rkey, addr = region.remote_page(home, page)
                reads.append(rdma(verbs.IBV_WR_RDMA_READ, (base + 32 * i, 16, lkey), *seqlock))
                reads += [
                    rdma(verbs.IBV_WR_RDMA_READ, region.local_page(page, offset, length), rkey, addr + offset)
                    for offset, length in runs
                ]
                reads.append(rdma(verbs.IBV_WR_RDMA_READ, (base + 32 * i + 16, 16, lkey), *seqlock))
            self.control.run(home, reads)
            locks = self.seqlocks[: 4 * len(pieces)].reshape(-1, 4)
            torn = ((locks[:, 0] != 0) | (locks[:, 0] != locks[:, 2]) | (locks[:, 1] != locks[:, 3])).tolist()
            for (page, runs), again in zip(pieces, torn, strict=True):
                nbytes = sum(length for _, length in runs)
                self.counters.count("rdma_read", nbytes + 32)
                if again:
                    continue
                self.counters.page_fetches += 1  # (under the line fill, of some lines of the page)
                if self.fill == "line":
                    for offset, length in runs:
                        region.lines[page, offset // LINE : (offset + length) // LINE] = True
                    self.counters.line_fills += nbytes // LINE
            pieces = [piece for piece, again in zip(pieces, torn, strict=True) if again]
            if pieces:
                self.counters.fetch_retries += 1
                retries += 1
                # back off (10 µs doubling to 1 ms): a write-through to the page is in flight, maybe more behind it
                time.sleep(min(1e-3, 1e-5 * 2 ** min(retries, 7)))
                if time.monotonic() > deadline:
                    stuck = [page for page, _ in pieces]
                    raise DsmError(
                        f"rank {home} kept writing pages {stuck} of array {region.aid} through for {FILL_TIMEOUT:.0f} s"
                    )

    def _home(self, region: CashmereRegion, page: int) -> int:
        """The page's home, claimed by this rank at its first touch if nobody has (CMP_AND_SWP at its default home)."""
        home = int(region.home[page])
        if home >= 0:
            return home
        owner = region.default_home(page)
        old = self.control.cas(owner, region.remote_table(owner, page), 0, self.rank + 1)
        self.counters.home_lookups += 1
        self.counters.count("cas", 8)
        home = self.rank if old == 0 else old - 1
        region.home[page] = home
        if home == self.rank:
            self.counters.homes_taken += 1
        return home

    def _join(self, region: CashmereRegion, page: int, home: int) -> None:
        entry = self._lock_entry(region, page, home)
        me = 1 << self.rank
        entry[READERS] |= me
        # a fresh copy: the next release processes it, even if an earlier one did while this rank held no copy
        # (written, dropped at an acquire, then released)
        region.processed[page] = False
        if int(entry[WRITERS]) & ~me:  # Weak: another rank writes it; our copy may be stale at our next acquire
            self.stale.add(gid_of(region.aid, page))
        if entry[UNSAFE]:  # its writers send no notices: our acquires read its row
            self.unsafe_held.add(gid_of(region.aid, page))
        self._unlock_entry(region, page, home, entry)

    # ------------------------------------------------------------------ the directory
    def _lock_entry(self, region: CashmereRegion, page: int, home: int) -> np.ndarray:
        """Lock a page's directory entry at its home: its readers, writers, noticed (a copy to change)."""
        control = self.control
        read = [rdma(verbs.IBV_WR_RDMA_READ, control.local(READ, ENTRY), *region.remote_entry(home, page, FIRST))]
        tail = region.remote_entry(home, page, TAIL)
        what = f"the directory entry of page {gid_of(region.aid, page):#x}"
        free = control.acquire(home, tail, DIRECTORY_NODE, what, read)
        self.counters.directory_ops += 1
        return control.words[READ : READ + ENTRY].copy() if free else control.node_data(DIRECTORY_NODE, ENTRY)

    def _unlock_entry(self, region: CashmereRegion, page: int, home: int, entry: np.ndarray) -> None:
        """Write the entry back to its home and pass the lock on (with the entry, to a rank waiting for it)."""
        control = self.control
        control.words[SOURCE : SOURCE + ENTRY] = entry
        back = [rdma(verbs.IBV_WR_RDMA_WRITE, control.local(SOURCE, ENTRY), *region.remote_entry(home, page, FIRST))]
        what = f"the directory entry of page {gid_of(region.aid, page):#x}"
        control.release(home, region.remote_entry(home, page, TAIL), DIRECTORY_NODE, what, (SOURCE, ENTRY), back)

    # ------------------------------------------------------------------ write-through
    def through_begin(self, region: CashmereRegion, pages: np.ndarray) -> dict[int, np.ndarray] | None:
        """Before a write block: the pages it may change that are homed elsewhere, as they are (None: none)."""
        remote = pages[region.home[pages] != self.rank]
        if not len(remote):
            return None
        return {page: region.page(page).copy() for page in remote.tolist()}

    def through_end(self, region: CashmereRegion, before: dict[int, np.ndarray]) -> None:
        """After a write block: what it changed in `before`'s pages goes to their homes' copies by RDMA WRITE."""
        for page, old in before.items():
            diff = make_diff(region.page(page), old, region.unit)
            if not len(diff):
                continue
            home = int(region.home[page])
            rkey, addr = region.remote_page(home, page)
            discard = (self.control.mr.buf + DISCARD * 8, self.control.mr.lkey)
            add = verbs.IBV_WR_ATOMIC_FETCH_AND_ADD
            # the page's seqlock around the runs: in progress, the runs, one more done, no longer in progress
            writes = [
                atomic(add, discard, *region.remote_entry(home, page, BUSY), 1),
                *(
                    rdma(verbs.IBV_WR_RDMA_WRITE, region.local_page(page, offset, length), rkey, addr + offset)
                    for offset, length in zip(diff.offsets.tolist(), diff.lengths.tolist(), strict=True)
                ),
                atomic(add, discard, *region.remote_entry(home, page, DONE), 1),
                atomic(add, discard, *region.remote_entry(home, page, BUSY), -1 & 0xFFFFFFFFFFFFFFFF),
            ]
            self._post_through(home, writes)
            self.control.atomics += 3
            self.counters.write_throughs += 1
            self.counters.write_through_bytes += diff.nbytes
            self.counters.count("rdma_write", diff.nbytes)

    def _post_through(self, home: int, writes: list[verbs.SendWR]) -> None:
        """Post one page's write-through, in chains of at most THROUGH_LIMIT WRs: a QP runs them in order, so the
        seqlock's first and last operations still bracket all of it."""
        for start in range(0, len(writes), THROUGH_LIMIT):
            chunk = writes[start : start + THROUGH_LIMIT]
            if self.through_count[home] + len(chunk) > THROUGH_LIMIT:
                self._drain()
            self.through.append(self.client.post(home, chunk, self.control.seq))
            self.through_count[home] += len(chunk)

    def _drain(self) -> None:
        """Wait until every write-through posted has landed at its home."""
        if not self.through:
            return
        self._await(self.through)
        self.through = []
        self.through_count = [0] * self.size

    # ------------------------------------------------------------------ release and acquire
    def _release_writes(self) -> None:
        """A release's half: write-throughs landed, and notices for the pages written since the last release
        posted to their readers (the pages already processed have theirs out)."""
        started = time.perf_counter()
        self._drain()
        me = 1 << self.rank
        for gid in sorted(self.written):
            aid, page = split_gid(gid)
            region = self.regions[aid]
            if region.processed[page]:
                continue
            home = int(region.home[page])
            entry = self._lock_entry(region, page, home)
            entry[WRITERS] |= me
            targets = int(entry[READERS]) & ~int(entry[NOTICED]) & ~me
            if entry[UNSAFE]:
                targets = 0  # its readers read its row at their acquires
            elif self.unsafe and targets.bit_count() >= self.unsafe:
                entry[UNSAFE] = 1  # these readers still get their notices: who joins later learns it is unsafe,
                if home != self.rank and region.state[page] != INVALID:
                    self.unsafe_held.add(gid)  # and we, if we keep a copy, check its row from now on too
                self.counters.unsafe_pages += 1
            if targets:
                self._post_notices([rank for rank in range(self.size) if targets >> rank & 1], gid)
            entry[NOTICED] |= targets
            self._unlock_entry(region, page, home, entry)
            region.processed[page] = True
        self.written.clear()
        self.counters.flush_seconds += time.perf_counter() - started

    def _post_notices(self, ranks: list[int], gid: int) -> None:
        """Append a notice of `gid` to each of `ranks`' lists: reserve a slot in every list at once (FETCH_AND_ADD),
        then fill them all at once -- the page, then the slot's number + 1, which marks the slot complete."""
        notes, lkey, base = self.notes, self.notes_mr.lkey, self.notes_mr.buf
        control, client = self.control, self.client
        add = verbs.IBV_WR_ATOMIC_FETCH_AND_ADD
        reserve = [atomic(add, (base + 24 * r, lkey), *control.remote(r, NOTICE_TAIL), 1) for r in ranks]
        self._await([client.post(r, [wr], control.seq) for r, wr in zip(ranks, reserve, strict=True)])
        posted = []
        for rank in ranks:
            slot = int(notes[rank, 0])
            at = NOTICES + 2 * (slot % NOTICE_SLOTS)
            notes[rank, 1:] = (gid, slot + 1)
            writes = [
                rdma(verbs.IBV_WR_RDMA_WRITE, (base + 24 * rank + 8, 8, lkey), *control.remote(rank, at)),
                rdma(verbs.IBV_WR_RDMA_WRITE, (base + 24 * rank + 16, 8, lkey), *control.remote(rank, at + 1)),
            ]
            posted.append(client.post(rank, writes, control.seq))
        self._await(posted)
        control.atomics += len(ranks)
        self.counters.notices_sent += len(ranks)
        self.counters.count("notice", 16 * len(ranks))

    def _await(self, posted: list[int]) -> None:
        """Wait until every chain `posted` (`Endpoint.post`'s wr_ids) has completed."""
        client = self.client
        client.wait(lambda: all(wr_id in client.rdma_done for wr_id in posted), "one-sided operations to complete")
        client.rdma_done.difference_update(posted)

    def _noticed(self) -> set[int]:
        """The pages the notice list names, from its head to its tail.

        A slot counts once its number (written after the page) is its own index + 1, read before and after
        the page: a slot reserved but not written yet stops the head, and later slots are still taken.
        Writers keep appending while the list is read, so the tail is read again after: if the slots read
        could have been overwritten meanwhile (an overrun, before or during the read), every copy is dropped.
        """
        words = self.control.words
        head, tail = self.notice_head, int(words[NOTICE_TAIL])
        pages: set[int] = set()
        if tail - head <= NOTICE_SLOTS:
            for index in range(head, tail):
                at = NOTICES + 2 * (index % NOTICE_SLOTS)
                if index in self.notices_ahead or int(words[at + 1]) != index + 1:
                    continue
                gid = int(words[at])
                if int(words[at + 1]) == index + 1:  # not overwritten under us
                    pages.add(gid)
                    self.notices_ahead.add(index)
                    self.counters.notices_processed += 1
            while self.notice_head in self.notices_ahead:
                self.notices_ahead.discard(self.notice_head)
                self.notice_head += 1
        now = int(words[NOTICE_TAIL])
        if now - head > NOTICE_SLOTS:  # notices were, or may have been, overwritten before we read them
            log.info("dsm: rank %d's notice list overran; every copy is dropped", self.rank)
            for region in self.regions:
                held = np.flatnonzero((region.state != INVALID) & (region.home != self.rank))
                pages.update(gid_of(region.aid, page) for page in held.tolist())
            self.notice_head, self.notices_ahead = now, set()
        return pages

    def _self_invalidate(self) -> None:
        """An acquire's half: drop the copies the notice list names, and those joined while Weak (steps (a)-(f))."""
        self._drain()
        pages = set(self.stale)
        self.stale.clear()
        pages |= self._noticed()
        pages |= self._unsafe_written()
        me = 1 << self.rank
        for gid in sorted(pages):
            aid, page = split_gid(gid)
            region = self.regions[aid]
            home = int(region.home[page])
            if home == self.rank or region.state[page] == INVALID:
                continue
            entry = self._lock_entry(region, page, home)
            entry[READERS] &= ~me
            entry[NOTICED] &= ~me
            if not (entry[UNSAFE] and entry[READERS]):  # (e): unsafe, it stays Weak while shared (`_unsafe_written`)
                entry[WRITERS] &= entry[READERS] | 1 << home  # the writers that still share it (the home always does)
            self._unlock_entry(region, page, home, entry)
            region.state[page] = INVALID
            region.lines[page] = False
            region.processed[page] = False
            self.unsafe_held.discard(gid)
            self.counters.self_invalidations += 1

    def _unsafe_written(self) -> set[int]:
        """The unsafe pages this rank holds that another rank writes (the paper's second optimisation: their
        writers send no notices, so an acquire reads each one's writers, a chain per home).

        A writer of an unsafe page stays in its writers while anyone else shares it, even after it dropped its own
        copy (`_self_invalidate`): the paper's Weak state, which leaves only with the last sharer.  Were it to leave
        at its drop, a holder that checks after that would find no other writer and keep a copy without its
        writes."""
        by_home: dict[int, list[int]] = {}
        for gid in self.unsafe_held:
            aid, page = split_gid(gid)
            by_home.setdefault(int(self.regions[aid].home[page]), []).append(gid)
        me, written = 1 << self.rank, set[int]()
        base, lkey = self.probes_mr.buf, self.probes_mr.lkey
        for home, gids in by_home.items():
            for first in range(0, len(gids), PROBE_BATCH):
                batch = gids[first : first + PROBE_BATCH]
                reads = []
                for i, gid in enumerate(batch):
                    aid, page = split_gid(gid)
                    target = self.regions[aid].remote_entry(home, page, FIRST + WRITERS)
                    reads.append(rdma(verbs.IBV_WR_RDMA_READ, (base + 8 * i, 8, lkey), *target))
                self.control.run(home, reads)
                self.counters.unsafe_checks += len(batch)
                written.update(gid for i, gid in enumerate(batch) if int(self.probes[i]) & ~me)
        return written

    # ------------------------------------------------------------------ hooks and checkpoints
    def hook(self, name: str, **kwargs: Any) -> None:
        if name in self._fire and self._plugins is not None:
            self._plugins.call(name, memory=self, **kwargs)

    def _live(self) -> None:
        host: PluginCalls | None = getattr(self.rt, "plugins", None)
        self._plugins, self._fire = None, frozenset()
        if host is None:
            return
        host.add_hookspecs(hookspecs)
        host.register(self, name=f"dsm-memory-{id(self)}")  # for ckpt_drain
        self._plugins = host
        self._fire = frozenset(name for name in HOOKS if host.has_impl(name))

    @ckpt.hookimpl(tryfirst=True)
    def ckpt_drain(self) -> None:
        self._drain()  # every program thread is parked: the home copies hold every write-through

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_plugins", "_fire"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._live()

    def __repr__(self) -> str:
        return f"<dsm.Memory rank {self.rank}/{self.size} cashmere ({self.fill} fill) {len(self.regions)} arrays>"
