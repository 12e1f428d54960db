"""The pyverbs-style objects a program holds: Context, PD, MR, CompChannel, CQ, SRQ, QP, AH."""

# Each object keeps the handle its provider (or a wrapper of it) returned and
# the operations table of its context; every call goes through that table, so
# whatever a plugin put there sees it.  The objects themselves hold no NIC
# state, which is what lets the virtualization plugin keep them unchanged
# across a restart while it swaps the handles underneath.
#
# Like pyverbs, every object is a context manager and closing it closes its
# children first (a PD closes its QPs, SRQs, AHs and MRs; a Context everything).

from __future__ import annotations

from typing import Any

from ckpt.verbs import _enums as e
from ckpt.verbs import _shm
from ckpt.verbs._attrs import (
    GID,
    AHAttr,
    AsyncEvent,
    DeviceAttr,
    PathRecord,
    PortAttr,
    QPAttr,
    QPInitAttr,
    SrqAttr,
    SrqInitAttr,
)
from ckpt.verbs._errors import PyverbsRDMAError, PyverbsUserError
from ckpt.verbs._provider import VerbsOps, get_ops, parse_device_name
from ckpt.verbs._qpstate import required_mask

ETIMEDOUT = 110

# The step of the RESET -> INIT -> RTR -> RTS path whose required attributes `QP.to_*` send.
_STEP_FROM = {e.IBV_QPS_INIT: e.IBV_QPS_RESET, e.IBV_QPS_RTR: e.IBV_QPS_INIT, e.IBV_QPS_RTS: e.IBV_QPS_RTR}


class VerbsObject:
    """Context-manager base: `close()` closes children (newest first), then the object itself."""

    _kind = "object"

    def __init__(self, parent: VerbsObject | None) -> None:
        self._children: list[VerbsObject] = []
        self._closed = True  # until _adopted(): a creation the provider refuses leaves nothing to close
        self._parent = parent
        if parent is not None and parent._closed:
            raise PyverbsUserError(f"cannot create a {self._kind} under a closed {parent._kind}")

    def _adopted(self) -> None:
        """The provider created the object: it is open and its parent will close it."""
        self._closed = False
        if self._parent is not None:
            self._parent._children.append(self)

    def close(self) -> None:
        if self._closed:
            return
        for child in sorted(reversed(self._children), key=_close_rank):
            child.close()
        self._release()
        self._closed = True
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)

    def _release(self) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise PyverbsUserError(f"{self._kind} is closed")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_rank(obj: VerbsObject) -> int:
    """QPs before the SRQs, CQs and MRs they use; PDs and channels last (pyverbs' order)."""
    order = ("QP", "AH", "SRQ", "MR", "CQ", "PD", "CompChannel")
    return order.index(obj._kind) if obj._kind in order else len(order)


class Context(VerbsObject):
    """An open verbs device (``ibv_open_device``): ``Context(name='simib0')``."""

    _kind = "Context"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(None)
        provider, _, device = parse_device_name(name)
        self.provider = provider
        self.ops: VerbsOps = get_ops(provider)
        self.name = device
        self.handle = self.ops.open_device(device)
        self._adopted()
        self._objects: dict[Any, Any] = {}  # handle -> object, to name the element of async events

    # Keyed by the handle itself (hashed by identity), not id(handle): the map must survive
    # pickling, where a shadow handle comes back as a new object.
    def _track(self, handle: Any, obj: Any) -> None:
        self._objects[handle] = obj

    def _untrack(self, handle: Any) -> None:
        self._objects.pop(handle, None)

    def _object_of(self, handle: Any) -> Any:
        try:
            return self._objects.get(handle, handle)
        except TypeError:  # an unhashable element (a provider's own type): show it as it is
            return handle

    def _release(self) -> None:
        self.ops.close_device(self.handle)

    def query_device(self) -> DeviceAttr:
        self._check_open()
        attr: DeviceAttr = self.ops.query_device(self.handle)
        return attr

    def query_port(self, port_num: int = 1) -> PortAttr:
        self._check_open()
        attr: PortAttr = self.ops.query_port(self.handle, port_num)
        return attr

    def query_gid(self, port_num: int = 1, index: int = 0) -> GID:
        self._check_open()
        gid: GID = self.ops.query_gid(self.handle, port_num, index)
        return gid

    def statistics(self) -> Any:
        """The device's counters (an extension; simib: packets, bytes, losses, retransmissions, migrations)."""
        self._check_open()
        return self.ops.device_statistics(self.handle)

    def query_paths(self, dlid: int) -> list[PathRecord]:
        """Every path from this device's ports to the HCA owning `dlid`: `PathRecord` (port_num, dlid,
        dport, up), as a subnet administrator's path records give them (an extension; empty where the
        transport has no subnet manager, e.g. ``tcp``)."""
        self._check_open()
        paths: list[PathRecord] = self.ops.query_paths(self.handle, dlid)
        return paths

    def get_async_event(self, timeout: float | None = None) -> AsyncEvent:
        """Block until the device reports an asynchronous event (a `timeout` in seconds is an extension)."""
        self._check_open()
        event = self.ops.get_async_event(self.handle, timeout)
        if event is None:
            raise PyverbsRDMAError("no asynchronous event within the timeout", ETIMEDOUT)
        return AsyncEvent(event.event_type, self._object_of(event.element))


class PD(VerbsObject):
    """A protection domain (``ibv_alloc_pd``)."""

    _kind = "PD"

    def __init__(self, creator: Context) -> None:
        super().__init__(creator)
        self.ctx = creator
        self.handle = creator.ops.alloc_pd(creator.handle)
        self._adopted()

    def _release(self) -> None:
        self.ctx.ops.dealloc_pd(self.handle)


class MR(VerbsObject):
    """A memory region: ``MR(pd, length, access)`` allocates, ``MR(pd, buffer, access)`` registers caller memory.

    `buffer` may be a numpy array, bytearray, memoryview, mmap -- any writable
    (or, for read-only access, readable) C-contiguous buffer.  The program keeps
    using its object; the HCA reads and writes the same memory.
    """

    _kind = "MR"

    def __init__(self, creator: PD, length: Any, access: int, address: int | None = None) -> None:
        if address is not None:
            raise PyverbsUserError("MR(address=...) is not supported: pass the buffer object itself")
        super().__init__(creator)
        self.pd = creator
        # Memory of its own is a numpy array: zeroed like pyverbs' allocation, and picklable, so a
        # checkpoint carries it like any other program state.
        own = isinstance(length, int) and length > 0
        # (in shared memory: same-host peers place one-sided operations in it directly, `_shm`)
        memory: Any = _shm.shared_array(length) if own else length
        self.memory = memory
        if isinstance(length, int) and length <= 0:
            raise PyverbsRDMAError(f"MR length must be positive, got {length}", 22)
        self.access = int(access)
        self._view = memoryview(memory).cast("B")
        ops = creator.ctx.ops
        self.handle = ops.reg_mr(creator.handle, self.memory, self.access)
        self._adopted()

    def _release(self) -> None:
        self.pd.ctx.ops.dereg_mr(self.handle)
        self._view.release()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_view"]  # a view of `memory`, which pickles itself; made again on load
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._view = memoryview(self.memory).cast("B")

    @property
    def buf(self) -> int:
        """The registered address (an integer, as in pyverbs)."""
        return int(self.handle.addr)

    @property
    def lkey(self) -> int:
        return int(self.handle.lkey)

    @property
    def rkey(self) -> int:
        return int(self.handle.rkey)

    @property
    def length(self) -> int:
        return len(self._view)

    def write(self, data: Any, length: int, offset: int = 0) -> None:
        """Copy `length` bytes of `data` into the region at `offset`."""
        self._check_open()
        src = memoryview(data.encode() if isinstance(data, str) else data).cast("B")
        if length > len(src) or offset < 0 or offset + length > len(self._view):
            raise PyverbsUserError(f"MR.write of {length} bytes at offset {offset} exceeds the data or the region")
        self._view[offset : offset + length] = src[:length]

    def read(self, length: int, offset: int = 0) -> bytes:
        """`length` bytes of the region from `offset`."""
        self._check_open()
        if offset < 0 or offset + length > len(self._view):
            raise PyverbsUserError(f"MR.read of {length} bytes at offset {offset} exceeds the region")
        return bytes(self._view[offset : offset + length])


class CompChannel(VerbsObject):
    """A completion event channel (``ibv_create_comp_channel``)."""

    _kind = "CompChannel"

    def __init__(self, creator: Context) -> None:
        super().__init__(creator)
        self.ctx = creator
        self.handle = creator.ops.create_comp_channel(creator.handle)
        self._adopted()

    def _release(self) -> None:
        self.ctx.ops.destroy_comp_channel(self.handle)

    def get_cq_event(self, expected_cq: CQ, timeout: float | None = None) -> CQ:
        """Block until a CQ armed with `req_notify` gets a completion; returns that CQ (it must be `expected_cq`)."""
        self._check_open()
        handle = self.ctx.ops.get_cq_event(self.handle, timeout)
        if handle is None:
            raise PyverbsRDMAError("no completion event within the timeout", ETIMEDOUT)
        if handle is not expected_cq.handle:
            cq = self.ctx._object_of(handle)
            raise PyverbsRDMAError(f"received an event for {cq!r}, not the expected CQ", 22)
        return expected_cq


class CQ(VerbsObject):
    """A completion queue (``ibv_create_cq``)."""

    _kind = "CQ"

    def __init__(
        self,
        creator: Context,
        cqe: int,
        cq_context: Any = None,
        channel: CompChannel | None = None,
        comp_vector: int = 0,
    ) -> None:
        super().__init__(creator)
        self.ctx = creator
        self.channel = channel
        self.cq_context = cq_context
        self.comp_vector = comp_vector
        self.cqe = cqe
        ops = creator.ops
        self.handle = ops.create_cq(creator.handle, cqe, channel.handle if channel else None, cq_context)
        creator._track(self.handle, self)
        self._adopted()

    def _release(self) -> None:
        self.ctx._untrack(self.handle)
        self.ctx.ops.destroy_cq(self.handle)

    def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
        """Up to `num_entries` completions: ``(count, [WC, ...])``; never blocks."""
        if self._closed:
            raise PyverbsUserError("CQ is closed")
        wcs = self.ctx.ops.poll_cq(self.handle, num_entries)
        return len(wcs), wcs

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm a one-shot event on the channel for the next (solicited) completion."""
        self._check_open()
        self.ctx.ops.req_notify_cq(self.handle, solicited_only)

    def ack_events(self, num_events: int) -> None:
        self._check_open()
        self.ctx.ops.ack_cq_events(self.handle, num_events)


class SRQ(VerbsObject):
    """A shared receive queue (``ibv_create_srq``)."""

    _kind = "SRQ"

    def __init__(self, creator: PD, attr: SrqInitAttr) -> None:
        super().__init__(creator)
        self.pd = creator
        ctx = creator.ctx
        self.handle = ctx.ops.create_srq(creator.handle, attr.attr, attr.srq_context)
        ctx._track(self.handle, self)
        self._adopted()

    def _release(self) -> None:
        self.pd.ctx._untrack(self.handle)
        self.pd.ctx.ops.destroy_srq(self.handle)

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        self._check_open()
        self.pd.ctx.ops.post_srq_recv(self.handle, wr)

    def modify(self, attr: SrqAttr, attr_mask: int) -> None:
        self._check_open()
        self.pd.ctx.ops.modify_srq(self.handle, attr, attr_mask)

    def arm(self, srq_limit: int) -> None:
        """Ask for IBV_EVENT_SRQ_LIMIT_REACHED when fewer than `srq_limit` WRs remain."""
        self.modify(SrqAttr(srq_limit=srq_limit), e.IBV_SRQ_LIMIT)

    def query(self) -> SrqAttr:
        self._check_open()
        attr: SrqAttr = self.pd.ctx.ops.query_srq(self.handle)
        return attr


class AH(VerbsObject):
    """An address handle (``ibv_create_ah``)."""

    _kind = "AH"

    def __init__(self, creator: PD, attr: AHAttr) -> None:
        super().__init__(creator)
        self.pd = creator
        self.handle = creator.ctx.ops.create_ah(creator.handle, attr)
        self._adopted()

    def _release(self) -> None:
        self.pd.ctx.ops.destroy_ah(self.handle)


class QP(VerbsObject):
    """A queue pair (``ibv_create_qp``); RC and UC on simib."""

    _kind = "QP"

    def __init__(self, creator: PD, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        if not isinstance(creator, PD):
            raise PyverbsUserError("QP(creator, ...): the creator must be a PD")
        if init_attr.scq is None or init_attr.rcq is None:
            raise PyverbsUserError("QPInitAttr needs scq and rcq")
        super().__init__(creator)
        self.pd = creator
        ctx = creator.ctx
        self.init_attr = init_attr
        provider_attr = QPInitAttr(
            qp_type=init_attr.qp_type,
            qp_context=init_attr.qp_context,
            scq=init_attr.scq.handle,
            rcq=init_attr.rcq.handle,
            srq=init_attr.srq.handle if init_attr.srq is not None else None,
            cap=init_attr.cap,
            sq_sig_all=init_attr.sq_sig_all,
        )
        ops = ctx.ops
        self.handle = ops.create_qp(creator.handle, provider_attr)
        self._ops = ops
        ctx._track(self.handle, self)
        self._adopted()
        self.qp_type = int(init_attr.qp_type)
        if qp_attr is not None:
            self.to_init(qp_attr)

    def _release(self) -> None:
        self.pd.ctx._untrack(self.handle)
        self.pd.ctx.ops.destroy_qp(self.handle)

    @property
    def qp_num(self) -> int:
        return int(self.handle.qp_num)

    @property
    def qp_state(self) -> int:
        return int(self.query(e.IBV_QP_STATE)[0].qp_state)

    def modify(self, qp_attr: QPAttr, attr_mask: int) -> None:
        """``ibv_modify_qp``: apply the attributes named by `attr_mask` (an invalid modify changes nothing)."""
        self._check_open()
        self._ops.modify_qp(self.handle, qp_attr, attr_mask)

    # As pyverbs' qp.pyx: each `to_*` sends one mask per QP type and target -- the required
    # attributes of RESET->INIT, INIT->RTR or RTR->RTS, plus IBV_QP_STATE -- whatever state the QP
    # is in, and the later ones first walk the earlier steps with the same QPAttr: `to_rts` calls
    # `to_rtr` unless the QP is in RTR, `to_rtr` calls `to_init` unless it is in INIT.  `to_init`
    # from INIT is the INIT->INIT modify (port, pkey index and access flags are applied again);
    # `to_rtr` from RTR and `to_rts` from RTS fail in their `to_init`, as they do in pyverbs.
    def _to(self, qp_attr: QPAttr, target: e.ibv_qp_state, extra: int = 0) -> None:
        qp_attr.qp_state = target
        mask = required_mask(self.qp_type, _STEP_FROM[target], target)
        self.modify(qp_attr, mask | e.IBV_QP_STATE | extra)

    def to_init(self, qp_attr: QPAttr) -> None:
        """To INIT with port, pkey index and access flags: RESET -> INIT, or INIT -> INIT."""
        self._to(qp_attr, e.IBV_QPS_INIT)

    def to_rtr(self, qp_attr: QPAttr) -> None:
        """To RTR, through `to_init` first unless the QP is in INIT.

        Sends the AV, path MTU, dest QPN and RQ PSN (RC: also responder resources and
        RNR timer), plus IBV_QP_ALT_PATH when ``alt_ah_attr.dlid`` is set (an extension).
        """
        if self.qp_state != e.IBV_QPS_INIT:
            self.to_init(qp_attr)
        self._to(qp_attr, e.IBV_QPS_RTR, e.IBV_QP_ALT_PATH if qp_attr.alt_ah_attr.dlid else 0)

    def to_rts(self, qp_attr: QPAttr) -> None:
        """To RTS, through `to_rtr` first unless the QP is in RTR.

        Sends the SQ PSN (RC: also timeout, retry counts and initiator depth).
        """
        if self.qp_state != e.IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        self._to(qp_attr, e.IBV_QPS_RTS)

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPInitAttr]:
        """``ibv_query_qp``: the current attributes (every field is filled whatever `attr_mask` says)."""
        self._check_open()
        attr, init = self.pd.ctx.ops.query_qp(self.handle, attr_mask)
        init.scq, init.rcq, init.srq = self.init_attr.scq, self.init_attr.rcq, self.init_attr.srq
        return attr, init

    # The table is looked up on every call (not bound at creation) so that a wrapper added later
    # -- a plugin loaded after the program built its QPs -- still sees every post.
    def post_send(self, send_wr: Any, bad_wr: Any = None) -> None:
        if self._closed:
            raise PyverbsUserError("QP is closed")
        self._ops.post_send(self.handle, send_wr)

    def post_recv(self, recv_wr: Any, bad_wr: Any = None) -> None:
        if self._closed:
            raise PyverbsUserError("QP is closed")
        self._ops.post_recv(self.handle, recv_wr)


def connect_rc(
    qp: QP,
    dlid: int,
    dest_qp_num: int,
    access: int,
    *,
    port_num: int = 1,
    path_mtu: int = e.IBV_MTU_1024,
    rd_atomic: int = 1,
    min_rnr_timer: int = 12,
    timeout: int = 14,
    retry_cnt: int = 7,
    rnr_retry: int = 7,
    sq_psn: int = 0,
    rq_psn: int = 0,
) -> None:
    """RESET -> INIT -> RTR -> RTS towards (dlid, dest_qp_num): the set-up every RC program repeats.

    An extension (pyverbs has no such helper); the defaults retry RNR forever
    (rnr_retry 7) and time out after about 67 ms x 8 on a dead peer.
    """
    attr = QPAttr(port_num=port_num)
    attr.qp_access_flags = access
    qp.to_init(attr)
    attr = QPAttr(path_mtu=path_mtu)
    attr.dest_qp_num, attr.rq_psn = dest_qp_num, rq_psn
    attr.ah_attr = AHAttr(dlid=dlid, port_num=port_num)
    attr.max_dest_rd_atomic, attr.min_rnr_timer = rd_atomic, min_rnr_timer
    qp.to_rtr(attr)
    attr = QPAttr()
    attr.timeout, attr.retry_cnt, attr.rnr_retry = timeout, retry_cnt, rnr_retry
    attr.sq_psn, attr.max_rd_atomic = sq_psn, rd_atomic
    qp.to_rts(attr)
