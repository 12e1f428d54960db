"""The simulated HCA's resource handles: protection domains, memory regions, completion channels and queues,
shared receive queues, address handles."""

# What the program holds for each verbs object of a simib HCA (`_simib` wraps them
# in the pyverbs-like classes).  They are real NIC resources: none can be pickled
# into an image (`NotCheckpointable`), which is the virtualization plugin's job.
# The HCA (`_hca`) and its engine push completions into CQs and take receive WRs
# from SRQs; the program thread polls, arms and posts.

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt.verbs import _enums as e
from ckpt.verbs import _shm
from ckpt.verbs._attrs import WC, SrqAttr
from ckpt.verbs._errors import PyverbsError, PyverbsRDMAError

if TYPE_CHECKING:
    from ckpt.verbs._hca import Hca

log = logging.getLogger(__name__)

EINVAL, ENOMEM, EACCES, EBUSY, ENOENT, EOPNOTSUPP = 22, 12, 13, 16, 2, 95

#: Limits reported by query_device and enforced by the simulator.
MAX_QP_WR, MAX_SGE, MAX_CQE, MAX_MR_SIZE, MAX_MSG = 16384, 32, 1 << 20, 1 << 40, 1 << 31
MAX_RD_ATOMIC, MAX_INLINE = 16, 1024


class NotCheckpointable:
    """Real NIC resources cannot be pickled into an image: that is the virtualization plugin's job."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        raise PyverbsError(
            f"a real simib {type(self).__name__.removesuffix('Handle')} cannot be checkpointed; "
            "checkpointing verbs programs needs the verbs virtualization plugin (ckpt_ib)"
        )


class PDHandle(NotCheckpointable):
    __slots__ = ("handle", "hca")

    def __init__(self, hca: Hca) -> None:
        self.hca = hca
        self.handle = next(hca.handles)


class MRHandle(NotCheckpointable):
    """A registered memory region: a flat writable (or read-only) view of the program's buffer."""

    __slots__ = ("access", "addr", "hca", "length", "lkey", "obj", "pd", "rkey", "shared", "valid", "view")

    def __init__(self, pd: PDHandle, obj: Any, access: int) -> None:
        try:
            view = memoryview(obj).cast("B")
        except TypeError as exc:
            raise PyverbsRDMAError(f"cannot register {type(obj).__name__}: {exc}", EINVAL) from None
        writes = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
        if view.readonly and access & writes:
            raise PyverbsRDMAError("cannot register read-only memory for local/remote write or atomic access", EACCES)
        if access & (e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC) and not access & e.IBV_ACCESS_LOCAL_WRITE:
            raise PyverbsRDMAError("REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too (ibv_reg_mr(3))", EINVAL)
        if len(view) == 0:
            raise PyverbsRDMAError("cannot register an empty buffer", EINVAL)
        hca = pd.hca
        self.hca, self.pd, self.view, self.obj, self.access = hca, pd, view, obj, access
        self.addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        self.length = len(view)
        self.lkey, self.rkey = hca.new_key(), hca.new_key()
        self.valid = True
        self.shared = _shm.locate(self.addr, self.length)  # (memfd, inode, offset) if in shared memory


class ChannelHandle(NotCheckpointable):
    """A completion channel: CQs that fired their one-shot notification."""

    __slots__ = ("cond", "events", "hca")

    def __init__(self, hca: Hca) -> None:
        self.hca = hca
        self.events: deque[CQHandle] = deque()
        self.cond = threading.Condition()

    def push(self, cq: CQHandle) -> None:
        with self.cond:
            self.events.append(cq)
            self.cond.notify()
        rx = self.hca.rx
        if rx.driving:
            rx.wake()

    def get(self, timeout: float | None) -> CQHandle | None:
        """The next CQ that fired, waiting up to `timeout` seconds (None: for ever).

        A thread blocked here does not run the receive engine (`_rx`): it is woken by whoever
        executes the packet -- a reader thread, or a thread that polls a CQ.  (Letting it drive
        too made it wrestle the role from the program's polling thread on every message.)
        """
        if self.hca.unsent:
            self.hca.flush()
        with self.cond:
            if not self.cond.wait_for(lambda: self.events, timeout):
                return None
            cq = self.events.popleft()
            cq.unacked_events += 1
            return cq


class CQHandle(NotCheckpointable):
    """A completion queue.  HCA threads push, the program polls; `req_notify` arms a one-shot event."""

    __slots__ = ("armed", "channel", "cq_context", "cqe", "entries", "hca", "lock", "overrun", "unacked_events")

    ARM_ALL, ARM_SOLICITED = 1, 2

    def __init__(self, hca: Hca, cqe: int, channel: ChannelHandle | None, cq_context: Any) -> None:
        if not 1 <= cqe <= MAX_CQE:
            raise PyverbsRDMAError(f"CQ size {cqe} out of range 1..{MAX_CQE}", EINVAL)
        self.hca, self.cqe, self.channel, self.cq_context = hca, cqe, channel, cq_context
        self.entries: deque[WC] = deque()
        self.lock = threading.Lock()
        self.armed = 0
        self.unacked_events = 0
        self.overrun = False

    def push(self, wc: WC, solicited: bool = False) -> None:
        with self.lock:
            if len(self.entries) >= self.cqe:
                if not self.overrun:
                    self.overrun = True
                    log.warning("CQ overrun (%d entries): completion of wr_id %s lost", self.cqe, wc.wr_id)
                    self.hca.event(e.IBV_EVENT_CQ_ERR, self)
                return
            self.entries.append(wc)
            hca = self.hca
            if hca.poll_waiters:
                hca.wake_pollers()
            rx = hca.rx
            # (never the driver itself: it is not in epoll while it executes packets)
            if rx.driving and (rx.awaited is None or rx.awaited is self.entries):
                rx.wake()
            armed = self.armed
            if armed and (armed == self.ARM_ALL or solicited or wc.status != e.IBV_WC_SUCCESS):
                self.armed = 0
                if self.channel is not None:
                    self.channel.push(self)

    def poll(self, n: int) -> list[WC]:
        entries = self.entries
        if self.hca.unsent:
            self.hca.flush()
        if not entries:
            self.hca.wait_for_completion(entries)
            if not entries:
                return []
        if n == 1:
            return [entries.popleft()]
        out: list[WC] = []
        while entries and len(out) < n:
            out.append(entries.popleft())
        return out

    def req_notify(self, solicited_only: bool) -> None:
        if self.channel is None:
            raise PyverbsRDMAError("req_notify on a CQ without a completion channel", EINVAL)
        with self.lock:
            self.armed = self.ARM_SOLICITED if solicited_only else self.ARM_ALL


class SRQHandle(NotCheckpointable):
    """A shared receive queue with its limit event."""

    __slots__ = ("hca", "limit", "lock", "max_sge", "max_wr", "pd", "queue", "srq_context")

    def __init__(self, pd: PDHandle, attr: SrqAttr, srq_context: Any) -> None:
        if not 1 <= attr.max_wr <= MAX_QP_WR or not 1 <= attr.max_sge <= MAX_SGE:
            raise PyverbsRDMAError(f"SRQ max_wr {attr.max_wr} / max_sge {attr.max_sge} out of range", EINVAL)
        self.hca, self.pd, self.srq_context = pd.hca, pd, srq_context
        self.max_wr, self.max_sge, self.limit = attr.max_wr, attr.max_sge, 0
        self.queue: deque[Any] = deque()
        self.lock = threading.Lock()

    def post(self, wrs: list[Any]) -> None:
        with self.lock:
            for wr in wrs:
                if len(wr.sg) > self.max_sge:
                    raise PyverbsRDMAError(f"receive WR with {len(wr.sg)} SGEs, SRQ max_sge is {self.max_sge}", EINVAL)
                if len(self.queue) >= self.max_wr:
                    raise PyverbsRDMAError(f"SRQ full ({self.max_wr} WRs)", ENOMEM)
                self.queue.append(wr)

    def take(self) -> Any | None:
        with self.lock:
            if not self.queue:
                return None
            wr = self.queue.popleft()
            if self.limit and len(self.queue) < self.limit:
                self.limit = 0  # one-shot: software re-arms with modify_srq(IBV_SRQ_LIMIT)
                fire = True
            else:
                fire = False
        if fire:
            self.hca.event(e.IBV_EVENT_SRQ_LIMIT_REACHED, self)
        return wr

    def modify(self, attr: SrqAttr, mask: int) -> None:
        with self.lock:
            if mask & e.IBV_SRQ_MAX_WR:
                raise PyverbsRDMAError("resizing an SRQ is not supported by simib", EOPNOTSUPP)
            if mask & e.IBV_SRQ_LIMIT:
                if attr.srq_limit > self.max_wr:
                    raise PyverbsRDMAError(f"srq_limit {attr.srq_limit} above max_wr {self.max_wr}", EINVAL)
                self.limit = attr.srq_limit

    def query(self) -> SrqAttr:
        with self.lock:
            return SrqAttr(max_wr=self.max_wr, max_sge=self.max_sge, srq_limit=self.limit)


class AHHandle(NotCheckpointable):
    __slots__ = ("attr", "pd")

    def __init__(self, pd: PDHandle, attr: Any) -> None:
        self.pd, self.attr = pd, attr
