"""Shared-memory placement between simib HCAs of one machine: shared buffers, published tables, peers' views."""

# A one-sided operation never needs the responder's CPU (DESIGN §4).  Between
# two processes of one machine the simulation can make that literal, as MPI
# and UCX do within a node (shared-memory windows, CMA/XPMEM): the requester
# places a WRITE, fetches a READ and executes an atomic in the responder's
# registered memory itself, at post time, with no packet, no ACK and no thread
# of the responder involved.  What makes that possible and keeps it faithful:
#
# * Memory.  `shared_array` allocates zeroed memory in a memfd, mapped shared.
#   `MR(pd, length)` allocates its own buffer there, and the DSM and the
#   remote log allocate their registered arrays with it.  A checkpoint pickles
#   a `SharedArray` by value and a restore puts it into a fresh memfd, so it
#   stays shared across restarts.  Memory the program registers from its own
#   objects (a bytearray, a plain numpy array) is private: operations on it
#   take the packet path, as before.
# * Tables.  Every simib HCA that links over Unix sockets publishes, in a memfd
#   of its own named after its endpoint, one row per registered region in
#   shared memory (rkey, PD, access, bounds, the memfd and offset behind it)
#   and one row per QP (number, state, access flags, PD, destination QP, type).
#   A row is written key last and cleared key first, and a reader checks the
#   key after copying the row, so it never uses a torn one.
# * Checks.  A requester takes the direct path for a chain of WRs only when
#   all of it would succeed on the packet path: an RC QP in RTS with nothing
#   in flight (so RC order holds trivially), no link model, the path's links
#   up, the responder process alive (a pidfd), the responder QP in RTS,
#   connected back to this QP, with the access the operation needs, every
#   rkey found with the QP's PD, the access and the bounds, every local SGE
#   valid.  Anything else -- a bad key, a QP in error, a dead link -- takes the
#   packet path, whose responder produces the right NAK, WC status and QP
#   transitions.  So errors are exactly what they were; only successes got
#   faster.
# * Atomicity.  An atomic holds its process's HCA atomic lock and a POSIX
#   record lock on the 8 bytes of the memfd, and so does the responder's HCA
#   when it executes an atomic on shared memory from the packet path: atomics
#   on one cell exclude each other across processes, as on one HCA.
# * What differs from the packet path, on purpose: a direct operation carries
#   no PSN (neither side's sq_psn / rq_psn moves; both sides stay consistent),
#   sends no packet (HCA statistics count it in `direct_ops`), and the
#   responder's COMM_EST cannot be its first event (it needs RTS, past RTR).
#   An operation that completes while the responder process is being killed
#   counts as done just before it died: nothing of a dead process's memory is
#   visible afterwards, so no program can tell the difference.
#
# CKPT_SIMIB_DIRECT=0 turns the direct path off (every operation takes packets).

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import select
import threading
import weakref
from typing import Any, Final

import numpy as np

log = logging.getLogger(__name__)

#: CKPT_SIMIB_DIRECT=0: same-host one-sided operations take the packet path too (for comparison).
ENABLED: Final = os.environ.get("CKPT_SIMIB_DIRECT", "1") != "0"
SEGMENT_NAME: Final = "ckpt-simib-mem"
TABLE_PREFIX: Final = "ckpt-simib-table:"
MAGIC: Final = 0x434B5054_53484D31  # "CKPTSHM1"
SLOTS: Final = 1024  # regions and QPs an HCA can publish; more take the packet path
_TAG: Final = 1 << 40  # keys are stored as value | _TAG, so 0 means a free row

# header words
_H_MAGIC, _H_PID = 0, 1
_HEADER_WORDS = 8
# a region's row
MR_KEY, MR_PD, MR_ACCESS, MR_ADDR, MR_LENGTH, MR_INO, MR_FD, MR_OFFSET = range(8)
# a QP's row
QP_KEY, QP_STATE, QP_ACCESS, QP_PD, QP_DEST, QP_TYPE = range(6)
_ROW = 8


# ---------------------------------------------------------------------------- shared buffers
class _Segment:
    """One memfd, mapped shared, with its address in this process."""

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
            _segments[self.addr] = (self.addr + size, fd, self.ino)
        weakref.finalize(self, _forget, self.addr, fd)


_lock = threading.Lock()
_starts: list[int] = []
_segments: dict[int, tuple[int, int, int]] = {}  # start address -> (end, fd, inode)


def _forget(addr: int, fd: int) -> None:
    with _lock:
        if _segments.pop(addr, None) is not None:
            del _starts[bisect.bisect_left(_starts, addr)]
    os.close(fd)


def locate(addr: int, length: int) -> tuple[int, int, int] | None:
    """(memfd, inode, offset in it) of [addr, addr + length) if it lies in one shared segment, else None."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i < 0:
            return None
        start = _starts[i]
        end, fd, ino = _segments[start]
    return (fd, ino, addr - start) if addr + length <= end else None


class SharedArray(np.ndarray):
    """A numpy array in shared memory (`shared_array`); pickles by value and unpickles into shared memory again."""

    _segment: _Segment | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._segment = getattr(obj, "_segment", None)  # views keep the segment alive

    def __reduce_ex__(self, protocol: Any) -> Any:
        plain = self.view(np.ndarray)
        seg = self._segment
        start = int(plain.__array_interface__["data"][0]) if plain.size else 0
        if seg is None or not seg.addr <= start < seg.addr + seg.size or not plain.flags.c_contiguous:
            return plain.__reduce_ex__(protocol)  # (a ufunc's result, say: it only looks shared)
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
    seg = _Segment(count * dtype.itemsize)
    out = np.ndarray(shape, dtype=dtype, buffer=seg.mm).view(SharedArray)
    out._segment = seg
    return out


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
        self.header[_H_PID] = os.getpid()
        self.header[_H_MAGIC] = MAGIC
        self._slots: dict[tuple[str, int], int] = {}
        self._free = {"mr": list(range(SLOTS - 1, -1, -1)), "qp": list(range(SLOTS - 1, -1, -1))}
        self._lock = threading.Lock()

    def _slot(self, kind: str, key: int) -> int | None:
        slot = self._slots.get((kind, key))
        if slot is None and self._free[kind]:
            slot = self._slots[kind, key] = self._free[kind].pop()
        return slot

    def _drop(self, kind: str, key: int, rows: np.ndarray) -> None:
        slot = self._slots.pop((kind, key), None)
        if slot is not None:
            rows[slot, 0] = 0
            self._free[kind].append(slot)

    def add_mr(self, mr: Any) -> None:
        """Publish a region whose memory is shared (`mr.shared`); nothing for private memory."""
        if mr.shared is None:
            return
        fd, ino, offset = mr.shared
        with self._lock:
            slot = self._slot("mr", mr.rkey)
            if slot is None:
                return
            row = self.mrs[slot]
            row[0] = 0
            row[1:] = (id(mr.pd), mr.access, mr.addr, mr.length, ino, fd, offset)
            row[0] = mr.rkey | _TAG

    def remove_mr(self, mr: Any) -> None:
        with self._lock:
            self._drop("mr", mr.rkey, self.mrs)

    def set_qp(self, qp: Any) -> None:
        with self._lock:
            slot = self._slot("qp", qp.qp_num)
            if slot is None:
                return
            row = self.qps[slot]
            row[0] = 0
            row[1:6] = (qp.state, qp.access, id(qp.pd), qp.dest_qp_num, qp.qp_type)
            row[0] = qp.qp_num | _TAG

    def remove_qp(self, qp: Any) -> None:
        with self._lock:
            self._drop("qp", qp.qp_num, self.qps)


def _views(mm: mmap.mmap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    words = np.frombuffer(mm, dtype=np.int64)
    header = words[:_HEADER_WORDS]
    mrs = words[_HEADER_WORDS : _HEADER_WORDS + SLOTS * _ROW].reshape(SLOTS, _ROW)
    qps = words[_HEADER_WORDS + SLOTS * _ROW :].reshape(SLOTS, _ROW)
    return header, mrs, qps


# ---------------------------------------------------------------------------- a peer's tables, seen from here
class Peer:
    """A same-host HCA in another process, as this process sees it: its tables and its shared memory."""

    def __init__(self, pid: int, pidfd: int, mm: mmap.mmap) -> None:
        self.pid, self._pidfd, self._mm = pid, pidfd, mm
        self._header, self._mrs, self._qps = _views(mm)
        self._exited = select.poll()
        self._exited.register(pidfd, select.POLLIN)
        self._mr_slots: dict[int, int] = {}
        self._qp_slots: dict[int, int] = {}
        self._segments: dict[int, tuple[memoryview, int]] = {}  # inode -> (its bytes, our fd of it)
        self._fds = [pidfd]  # closed when nothing uses this view any more (a post may be in the middle of it)
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    @classmethod
    def attach(cls, pid: int, endpoint: str) -> Peer | None:
        """The HCA at `endpoint`, held by process `pid` (its Unix link's peer); None if it publishes no table."""
        if not ENABLED or pid == os.getpid():
            return None
        try:
            pidfd = os.pidfd_open(pid)  # first: a table found after it belongs to this very process
        except OSError:
            return None
        wanted = f"/memfd:{TABLE_PREFIX}{endpoint} (deleted)"
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                path = f"/proc/{pid}/fd/{fd}"
                if os.readlink(path) != wanted:
                    continue
                with open(path, "r+b", buffering=0) as f:
                    mm = mmap.mmap(f.fileno(), 0)
                header = np.frombuffer(mm, dtype=np.int64, count=_HEADER_WORDS)
                if header[_H_MAGIC] == MAGIC and header[_H_PID] == pid:
                    return cls(pid, pidfd, mm)
        except (OSError, ValueError) as exc:
            log.debug("no shared-memory placement to HCA %s (pid %d): %s", endpoint, pid, exc)
        os.close(pidfd)
        return None

    def alive(self) -> bool:
        return not self._exited.poll(0)

    def mr(self, rkey: int) -> list[int] | None:
        """The published row of region `rkey` (MR_* fields), or None."""
        return _find(self._mrs, self._mr_slots, rkey)

    def qp(self, qpn: int) -> list[int] | None:
        """The published row of QP `qpn` (QP_* fields), or None."""
        return _find(self._qps, self._qp_slots, qpn)

    def memory(self, row: list[int]) -> tuple[memoryview, int] | None:
        """(the bytes of the memfd behind region `row`, this process's fd of it), or None."""
        ino = row[MR_INO]
        found = self._segments.get(ino)
        if found is not None:
            return found
        with self._lock:
            found = self._segments.get(ino)
            if found is not None:
                return found
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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _find(rows: np.ndarray, slots: dict[int, int], key: int) -> list[int] | None:
    tagged = key | _TAG
    slot = slots.get(key)
    if slot is None or rows[slot, 0] != tagged:
        hits = np.flatnonzero(rows[:, 0] == tagged)
        if not len(hits):
            slots.pop(key, None)
            return None
        slot = slots[key] = int(hits[0])
    row: list[int] = rows[slot].tolist()
    if row[0] != tagged or rows[slot, 0] != tagged:  # rewritten while we copied it
        return None
    return row


def cell_lock(fd: int, offset: int, lock: bool) -> None:
    """Take (or let go of) the record lock of the 8-byte cell at `offset` of memfd `fd`: atomics across processes."""
    fcntl.lockf(fd, fcntl.LOCK_EX if lock else fcntl.LOCK_UN, 8, offset)
