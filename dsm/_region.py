"""One shared array's pages on one rank: the local copy, its registered memory, and per-page protocol state.

Per page a rank keeps its access state (``INVALID``, ``VALID``: readable,
``DIRTY``: written in the current interval), the home it knows (-1: not known
yet), and ``need``: for every writer, the latest interval whose diff its next
fetch must contain (raised by write notices).  A home keeps, in registered
memory, the page's metadata ``applied[0..N-1]``: ``applied[w] >= 0`` is the
latest interval of writer ``w`` whose changes are in the home's copy; ``-i``
says that ``w`` is writing its diff of interval ``i`` into it by RDMA (the
one-sided protocol's per-writer seqlock, `dsm._onesided`; `Region.applied`
reads such a column as ``i - 1``).
A default home (``(array + page) mod N``) keeps the page's home-table word:
0 while unassigned, else home + 1; first touch claims it.
"""

from __future__ import annotations

import numpy as np

from ckpt import verbs

from ._net import ACCESS

INVALID, VALID, DIRTY = 0, 1, 2


def gid_of(aid: int, page: int) -> int:
    return aid << 32 | page


def split_gid(gid: int) -> tuple[int, int]:
    return gid >> 32, gid & 0xFFFFFFFF


class Region:
    """The pages of one shared array on this rank."""

    #: While this rank replays its logs (`dsm._replay`): the program's own copy of the pages, apart from
    #: `data`, which stays the master copy the handler and one-sided peers use.  A class default: images
    #: written before it existed unpickle without it.
    view: np.ndarray | None = None

    def __init__(self, pd: verbs.PD, aid: int, nbytes: int, unit: int, page_size: int, rank: int, size: int) -> None:
        self.aid, self.page_size, self.rank, self.size = aid, page_size, rank, size
        self.unit = unit  # bytes its diffs compare at a time: the element size (_diff.diff_unit)
        self.npages = max(1, -(-nbytes // page_size))
        # what peers read, write and update by RDMA: in shared memory, so that same-host peers place
        # their one-sided operations in it themselves (docs/verbs.md, "Direct placement")
        self.data = verbs.shared_array(self.npages * page_size, np.uint8)
        self.meta = verbs.shared_array((self.npages, size), np.int64)
        self.table = verbs.shared_array(self.npages, np.int64)
        self.data_mr = verbs.MR(pd, self.data, ACCESS)
        self.meta_mr = verbs.MR(pd, self.meta, ACCESS)
        self.table_mr = verbs.MR(pd, self.table, ACCESS)
        self.state = np.full(self.npages, VALID, dtype=np.int8)  # every copy starts as the same zeros
        self.home = np.full(self.npages, -1, dtype=np.int32)
        self.need = np.zeros((self.npages, size), dtype=np.int64)
        self.twins: dict[int, np.ndarray] = {}
        self.peers: list[dict[str, int]] = []

    def address(self) -> dict[str, int]:
        return {
            "data": self.data_mr.buf,
            "data_rkey": self.data_mr.rkey,
            "meta": self.meta_mr.buf,
            "meta_rkey": self.meta_mr.rkey,
            "table": self.table_mr.buf,
            "table_rkey": self.table_mr.rkey,
        }

    def default_home(self, page: int) -> int:
        return (self.aid + page) % self.size

    def page(self, page: int) -> np.ndarray:
        """The page in `data`: the master copy of a home, what the handler and peers read and write."""
        return self.data[page * self.page_size : (page + 1) * self.page_size]

    @property
    def local(self) -> np.ndarray:
        """The bytes the program reads and writes: `data`, or its replay view."""
        return self.data if self.view is None else self.view

    def program_page(self, page: int) -> np.ndarray:
        """The page as the program sees it (in `local`)."""
        return self.local[page * self.page_size : (page + 1) * self.page_size]

    def applied(self) -> np.ndarray:
        """The home's applied columns (one row per page), a diff in progress (``-i``) read as not there (``i - 1``).

        Every earlier diff of that writer to the page is in the copy (its DRAWs are sequential),
        the one in progress maybe in part -- so a copy rebuilt from logs applies interval ``i``
        again.  A copy, safe to keep.
        """
        return np.where(self.meta < 0, -self.meta - 1, self.meta)

    # remote addresses ------------------------------------------------------------
    def remote_page(self, home: int, page: int) -> tuple[int, int]:
        peer = self.peers[home]
        return peer["data_rkey"], peer["data"] + page * self.page_size

    def remote_meta(self, home: int, page: int, writer: int = 0) -> tuple[int, int]:
        """The home's metadata of `page` from `writer`'s column on."""
        peer = self.peers[home]
        return peer["meta_rkey"], peer["meta"] + (page * self.size + writer) * 8

    def remote_table(self, owner: int, page: int) -> tuple[int, int]:
        peer = self.peers[owner]
        return peer["table_rkey"], peer["table"] + page * 8

    def local_page(self, page: int, offset: int = 0, length: int | None = None) -> tuple[int, int, int]:
        length = self.page_size - offset if length is None else length
        return self.data_mr.buf + page * self.page_size + offset, length, self.data_mr.lkey
