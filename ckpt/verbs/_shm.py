"""Shared-memory placement between simib HCAs of one machine: shared buffers, published tables, peers' views."""

# A one-sided operation never needs the responder's CPU (DESIGN §4).  Between
# two processes of one machine the simulation can make that literal, as MPI
# and UCX do within a node (shared-memory windows, CMA/XPMEM): the requester
# places a WRITE, fetches a READ and executes an atomic in the responder's
# registered memory itself, at post time, with no packet, no ACK and no thread
# of the responder involved (`_direct`).  What makes that possible and keeps it
# faithful:
#
# * Memory.  `shared_array` allocates zeroed memory in a memfd, mapped shared.
#   `MR(pd, length)` allocates its own buffer there, and the DSM and the
#   remote log allocate their registered arrays with it.  A checkpoint pickles
#   a `SharedArray` by value and a restore puts it into a fresh memfd, so it
#   stays shared across restarts.  Memory the program registers from its own
#   objects (a bytearray, a plain numpy array) is private: operations on it
#   take the packet path.  A registered region holds its segment, so the memfd
#   outlives every array of it while the region is registered.
# * Tables.  Every simib HCA that links over Unix sockets publishes, in a memfd
#   of its own named after its endpoint, one row per registered region in
#   shared memory (rkey, PD, access, bounds, the memfd and offset behind it)
#   and one row per QP (number, state, access flags, PD, destination QP, type,
#   its responses' path, and the PSNs requesters consumed directly).  The HCA
#   changes rows only under an exclusive record lock on the table; a requester
#   holds a shared one from its checks to the end of its copies.  So a row is
#   never read torn, and once `dereg_mr` or a `modify` has returned no direct
#   operation is still using what it changed, as `ibv_dereg_mr(3)` promises.
#   A loopback (a QP connected to another QP of its own HCA) reads its own
#   table; it holds the table's in-process lock, which every row change takes,
#   since a record lock does not exclude a thread of the same process.
# * PSNs.  A direct WR consumes its PSNs like a packet: the requester's
#   `sq_psn` moves, and it adds them to the responder QP's row, which the
#   responder takes into its expected PSN before it looks at its next packet or
#   answers `query_qp` -- so both sides agree, and ckpt_ib's drain (which
#   compares a sender's PSNs with the receiver's `rq_psn`) sees them delivered.
# * Atomicity.  An atomic on shared memory holds a process-wide lock and a
#   POSIX record lock on the 8 bytes of the memfd, whether a requester
#   executes it directly or the responder's HCA from a packet: atomics on one
#   cell exclude each other across threads, HCAs and processes.
#
# CKPT_SIMIB_DIRECT=0 (read when ckpt.verbs is imported) turns it all off.

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import select
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Final

import numpy as np

from ckpt.verbs import _links

log = logging.getLogger(__name__)

#: CKPT_SIMIB_DIRECT=0: same-host one-sided operations take the packet path too (for comparison).
ENABLED: Final = os.environ.get("CKPT_SIMIB_DIRECT", "1") != "0"
SEGMENT_NAME: Final = "ckpt-simib-mem"
TABLE_PREFIX: Final = "ckpt-simib-table:"
MAGIC: Final = 0x434B5054_53484D32  # "CKPTSHM2"
SLOTS: Final = 1024  # regions and QPs an HCA can publish; more take the packet path
RETRY: Final = 0.5  # seconds before a peer whose table could not be mapped is tried again
_TAG: Final = 1 << 40  # keys are stored as value | _TAG, so 0 means a free row
_KEEP: Final = 32  # a peer view keeps this many memfds of regions no longer published, at most

# header words
_H_MAGIC, _H_PID, _H_GEN = 0, 1, 2  # _H_GEN: bumped by every change of a row but QP_PSNS
_HEADER_WORDS: Final = 8
# a region's row
MR_KEY, MR_PD, MR_ACCESS, MR_ADDR, MR_LENGTH, MR_INO, MR_FD, MR_OFFSET = range(8)
# a QP's row (QP_PSNS: PSNs requesters consumed by direct WRs, written by them)
QP_KEY, QP_STATE, QP_ACCESS, QP_PD, QP_DEST, QP_TYPE, QP_SLID, QP_DLID, QP_PSNS = range(9)
_ROW: Final = 16

#: Held by every atomic this process executes on shared memory (with the cell's record lock, which
#: excludes other processes only: POSIX record locks belong to a process, not to a thread).
atomics = threading.Lock()


# ---------------------------------------------------------------------------- shared buffers
class Segment:
    """One memfd, mapped shared, with its address in this process; its fd closes when nothing holds it."""

    __slots__ = ("__weakref__", "addr", "fd", "ino", "mm", "size")

    def __init__(self, nbytes: int) -> None:
        size = max(nbytes, 1)
        fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size, self.ino = fd, size, os.fstat(fd).st_ino
        self.addr = int(np.frombuffer(self.mm, dtype=np.uint8).ctypes.data)
        with _lock:
            bisect.insort(_starts, self.addr)
            _segments[self.addr] = weakref.ref(self)
        weakref.finalize(self, _forget, self.addr, fd)


_lock = threading.Lock()
_starts: list[int] = []
_segments: dict[int, weakref.ref[Segment]] = {}  # start address -> the segment


def _forget(addr: int, fd: int) -> None:
    with _lock:
        if _segments.pop(addr, None) is not None:
            del _starts[bisect.bisect_left(_starts, addr)]
    os.close(fd)


def locate(addr: int, length: int) -> tuple[Segment, int] | None:
    """(the shared segment, offset in it) of [addr, addr + length) if it lies in one, else None."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        seg = _segments[_starts[i]]() if i >= 0 else None
    if seg is None or addr + length > seg.addr + seg.size:
        return None
    return seg, addr - seg.addr


class SharedArray(np.ndarray):
    """A numpy array in shared memory (`shared_array`); pickles by value and unpickles into shared memory again.

    Only the array `shared_array` made holds its segment: a view of it holds the array (its `base`), and
    pickles as private memory, as does a copy or a ufunc's result.  No `__array_finalize__`: numpy
    skips the call when a subclass has none, so slicing costs what it costs a plain array.
    """

    _segment: Segment | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        plain = self.view(np.ndarray)
        if self._segment is None:
            return plain.__reduce_ex__(protocol)
        return _unpickle, (plain,)


def _unpickle(plain: np.ndarray) -> np.ndarray:
    out = shared_array(plain.shape, plain.dtype)
    out[...] = plain
    return out


def shared_array(shape: Any, dtype: Any = np.uint8) -> np.ndarray:
    """A zeroed array that same-host peers' one-sided operations reach directly once registered.

    An ordinary numpy array (a `SharedArray`); with CKPT_SIMIB_DIRECT=0 a plain private one.
    """
    dtype = np.dtype(dtype)
    if not ENABLED:
        return np.zeros(shape, dtype=dtype)
    count = int(np.prod(shape, dtype=np.int64))
    seg = Segment(count * dtype.itemsize)
    out = np.ndarray(shape, dtype=dtype, buffer=seg.mm).view(SharedArray)
    out._segment = seg
    return out


def cell_lock(fd: int, offset: int, lock: bool) -> None:
    """Take (or let go of) the record lock of the 8-byte cell at `offset` of memfd `fd` (hold `atomics` too)."""
    fcntl.lockf(fd, fcntl.LOCK_EX if lock else fcntl.LOCK_UN, 8, offset)


# ---------------------------------------------------------------------------- an HCA's published tables
class Table:
    """The rows an HCA publishes for its same-host peers (regions in shared memory, QPs)."""

    def __init__(self, endpoint: str) -> None:
        words = _HEADER_WORDS + 2 * SLOTS * _ROW
        # kept open for the HCA's life: peers find the table among this process's open files
        self.fd = os.memfd_create(TABLE_PREFIX + endpoint, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, words * 8)
            self._mm = mmap.mmap(self.fd, words * 8)
        except BaseException:
            os.close(self.fd)
            raise
        self.header, self.mrs, self.qps = _views(self._mm)
        self._words = memoryview(self._mm).cast("q")  # `direct_psns`, on every packet: cheaper than numpy
        self.header[_H_PID] = os.getpid()
        self.header[_H_MAGIC] = MAGIC
        self._slots: dict[tuple[str, int], int] = {}
        self._free = {"mr": list(range(SLOTS - 1, -1, -1)), "qp": list(range(SLOTS - 1, -1, -1))}
        self._lock = threading.Lock()

    def close(self) -> None:
        self.header[_H_MAGIC] = 0
        os.close(self.fd)

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Exclusive: no peer is between its checks and the end of its copies (`Peer.hold`); and the generation
        moves, so peers read the rows again instead of using what they remember of them."""
        with self._lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                self.header[_H_GEN] += 1
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def _slot(self, kind: str, key: int, rows: np.ndarray) -> int | None:
        slot = self._slots.get((kind, key))
        if slot is None and self._free[kind]:
            slot = self._slots[kind, key] = self._free[kind].pop()
            rows[slot] = 0
        return slot

    def _drop(self, kind: str, key: int, rows: np.ndarray) -> None:
        with self._changing():
            slot = self._slots.pop((kind, key), None)
            if slot is not None:
                rows[slot, 0] = 0
                self._free[kind].append(slot)

    def add_mr(self, mr: Any) -> None:
        """Publish a region whose memory is shared (`mr.shared`); nothing for private memory."""
        if mr.shared is None:
            return
        seg, offset = mr.shared
        with self._changing():
            slot = self._slot("mr", mr.rkey, self.mrs)
            if slot is not None:
                self.mrs[slot, 1:8] = (id(mr.pd), mr.access, mr.addr, mr.length, seg.ino, seg.fd, offset)
                self.mrs[slot, 0] = mr.rkey | _TAG

    def remove_mr(self, mr: Any) -> None:
        if mr.shared is not None:
            self._drop("mr", mr.rkey, self.mrs)

    def set_qp(self, qp: Any, slid: int) -> None:
        with self._changing():
            slot = self._slot("qp", qp.qp_num, self.qps)
            if slot is not None:
                self.qps[slot, 1:8] = (qp.state, qp.access, id(qp.pd), qp.dest_qp_num, qp.qp_type, slid, qp.ah.dlid)
                self.qps[slot, 0] = qp.qp_num | _TAG

    def remove_qp(self, qp: Any) -> None:
        self._drop("qp", qp.qp_num, self.qps)

    def direct_psns(self, qpn: int) -> int:
        """The PSNs requesters have consumed by direct WRs to QP `qpn` so far (0 if it is not published)."""
        slot = self._slots.get(("qp", qpn))
        return 0 if slot is None else self._words[_psns_word(slot)]


def _psns_word(slot: int) -> int:
    """The index, in 8-byte words of a table, of QP_PSNS in the QP row `slot`."""
    return _HEADER_WORDS + (SLOTS + slot) * _ROW + QP_PSNS


def _views(mm: mmap.mmap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    words = np.frombuffer(mm, dtype=np.int64)
    header = words[:_HEADER_WORDS]
    mrs = words[_HEADER_WORDS : _HEADER_WORDS + SLOTS * _ROW].reshape(SLOTS, _ROW)
    qps = words[_HEADER_WORDS + SLOTS * _ROW :].reshape(SLOTS, _ROW)
    return header, mrs, qps


# ---------------------------------------------------------------------------- a peer's tables, seen from here
class Peer:
    """A same-host HCA in another process, as this process sees it: its tables and its shared memory.

    Between `hold` and `release` the peer changes no row; what was read of the rows is remembered for as
    long as the table's generation stays the same.
    """

    def __init__(self, pid: int, mm: mmap.mmap, pidfd: int = -1, table_fd: int = -1) -> None:
        """`pidfd` (readable once `pid` has exited) and `table_fd` are owned: closed when this view goes."""
        self.pid, self._table_fd, self._mm = pid, table_fd, mm
        self._header, self._mrs, self._qps = _views(mm)
        self._words = memoryview(mm).cast("q")  # plain indexing: cheaper than numpy's for one word
        self._exited = select.poll()  # nothing registered (this process itself): never exited
        if pidfd >= 0:
            self._exited.register(pidfd, select.POLLIN)
        self._mr_slots: dict[int, int] = {}
        self._qp_slots: dict[int, int] = {}
        self._gen = -1
        self._mr_rows: dict[int, list[int] | None] = {}
        self._qp_rows: dict[int, tuple[int, list[int]] | None] = {}
        self._segments: dict[int, tuple[memoryview, int]] = {}  # inode -> (its bytes, our fd of it)
        self._fds = [fd for fd in (pidfd, table_fd) if fd >= 0]  # closed when nothing uses this view any more
        self._lock = threading.Lock()  # one chain at a time: record locks belong to the process
        weakref.finalize(self, _close_all, self._fds)

    @classmethod
    def attach(cls, pid: int, endpoint: str) -> Peer | None:
        """The HCA at `endpoint`, held by process `pid` (its Unix link's peer); None if it publishes no table.

        OSError if its table could not be mapped (try again later).
        """
        if not ENABLED or pid == os.getpid():
            return None
        pidfd = os.pidfd_open(pid)  # first: a table found after it belongs to this very process
        try:
            path = _links.open_file(pid, f"/memfd:{TABLE_PREFIX}{endpoint} (deleted)")
            if path is not None:
                table_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    mm = mmap.mmap(table_fd, 0)
                    header = np.frombuffer(mm, dtype=np.int64, count=_HEADER_WORDS)
                    if header[_H_MAGIC] == MAGIC and header[_H_PID] == pid:
                        return cls(pid, mm, pidfd, table_fd)
                except BaseException:
                    os.close(table_fd)
                    raise
                os.close(table_fd)
        except BaseException:
            os.close(pidfd)
            raise
        os.close(pidfd)
        return None

    def alive(self) -> bool:
        return not self._exited.poll(0)

    def refuses(self, entries: Iterable[Any]) -> bool:
        """Does a WR of `entries` target a region this peer does not publish (private memory), as its rows were
        when last read and its generation still is?  Known without holding the peer (no system call): such a
        chain takes the packet path.  A change under way is missed at worst, and the packet path is always
        right."""
        if self._words[_H_GEN] != self._gen:
            return False
        rows = self._mr_rows
        return any(rows.get(entry.rkey, 0) is None for entry in entries)

    def hold(self) -> None:
        """Keep the peer from changing any row (a shared record lock on its table) until `release`."""
        self._lock.acquire()
        try:
            self._share()
        except BaseException:
            self._lock.release()
            raise
        gen = self._words[_H_GEN]
        if gen != self._gen:  # something changed: read rows afresh
            self._mr_rows.clear()  # before the generation: `refuses` must not pair the new one with old rows
            self._qp_rows.clear()
            self._gen = gen

    def release(self) -> None:
        self._unshare()
        self._lock.release()

    def _share(self) -> None:
        fcntl.lockf(self._table_fd, fcntl.LOCK_SH)

    def _unshare(self) -> None:
        fcntl.lockf(self._table_fd, fcntl.LOCK_UN)

    def mr(self, rkey: int) -> list[int] | None:
        """The published row of region `rkey` (MR_* fields), or None (hold the peer)."""
        try:
            return self._mr_rows[rkey]
        except KeyError:
            found = _find(self._mrs, self._mr_slots, rkey)
            row = self._mr_rows[rkey] = None if found is None else found[1]
            return row

    def qp(self, qpn: int) -> tuple[int, list[int]] | None:
        """(slot, published row) of QP `qpn` (QP_* fields, QP_PSNS as it was then), or None (hold the peer)."""
        try:
            return self._qp_rows[qpn]
        except KeyError:
            found = self._qp_rows[qpn] = _find(self._qps, self._qp_slots, qpn)
            return found

    def consumed(self, slot: int, psns: int) -> None:
        """Add `psns` direct PSNs to the QP row in `slot` (this QP's requester is its only writer)."""
        self._words[_psns_word(slot)] += psns

    def memory(self, row: list[int]) -> tuple[memoryview, int] | None:
        """(the bytes of the memfd behind region `row`, this process's fd of it), or None (hold the peer)."""
        ino = row[MR_INO]
        found = self._segments.get(ino)
        if found is not None:
            return found
        if len(self._segments) >= _KEEP:  # let go of memfds the peer no longer publishes
            live = set(self._mrs[self._mrs[:, MR_KEY] != 0, MR_INO].tolist())
            for old in [i for i in self._segments if i not in live]:
                fd = self._segments.pop(old)[1]
                self._fds.remove(fd)
                os.close(fd)
        fd = -1
        try:
            fd = os.open(f"/proc/{self.pid}/fd/{row[MR_FD]}", os.O_RDWR | os.O_CLOEXEC)
            if os.fstat(fd).st_ino != ino:  # that descriptor is another file by now
                os.close(fd)
                return None
            found = self._segments[ino] = (memoryview(mmap.mmap(fd, 0)), fd)
        except (OSError, ValueError):
            if fd >= 0:
                os.close(fd)
            return None
        self._fds.append(fd)
        return found


class Loopback(Peer):
    """This process's own HCA as a peer: a QP connected to another QP of the same HCA places its one-sided
    operations directly too (the DSM's link to its own rank: a rank is the log home of its neighbour's pages).

    It reads the table through the HCA's own mapping.  A record lock does not exclude another thread of the
    same process, so `hold` takes the lock every change of the table's rows takes in this process
    (`Table._changing`) instead.
    """

    def __init__(self, table: Table) -> None:
        super().__init__(os.getpid(), table._mm)
        self._table = table

    def _share(self) -> None:
        self._table._lock.acquire()

    def _unshare(self) -> None:
        self._table._lock.release()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _find(rows: np.ndarray, slots: dict[int, int], key: int) -> tuple[int, list[int]] | None:
    tagged = key | _TAG
    slot = slots.get(key)
    if slot is None or rows[slot, 0] != tagged:
        hits = np.flatnonzero(rows[:, 0] == tagged)
        if not len(hits):
            slots.pop(key, None)
            return None
        slot = slots[key] = int(hits[0])
    return slot, rows[slot].tolist()
