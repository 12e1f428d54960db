"""Shadow objects: what the program holds instead of real verbs resources, and the logs they keep."""

# Principle 1 of the DMTCP InfiniBand plugin: the program never holds a real
# object.  Every handle the wrapped operations table hands out is a shadow
# carrying virtual IDs (qp_num, lkey, rkey, LID, MR address) and everything
# needed to build the real object again: its creation parameters, the
# modify-QP / modify-SRQ history (principle 3) and the logs of posted work
# requests that have not completed yet.  Shadows pickle with the program (one
# object graph, so a registered numpy array stays the program's array); the
# real handle does not.

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from ckpt.verbs import WC, AHAttr, QPAttr, QPCap, SrqAttr


class Shadow:
    """Base: `real` is the provider's handle in this process, never pickled (nor the other `_transient` fields)."""

    real: Any = None
    _transient: tuple[str, ...] = ("real",)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._transient:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in self._transient:
            setattr(self, name, None)


class ShadowDevice(Shadow):
    def __init__(self, name: str, vlids: list[int]) -> None:
        self.name = name
        self.vlids = vlids  # virtual LIDs of ports 1 and 2


class ShadowPD(Shadow):
    def __init__(self, device: ShadowDevice) -> None:
        self.device = device


class ShadowMR(Shadow):
    """`addr`, `lkey`, `rkey` are what the program sees: the first registration's address, virtual keys."""

    _transient = ("real", "memory")

    def __init__(self, pd: ShadowPD, obj: Any, access: int, vlkey: int, vrkey: int, vaddr: int, length: int) -> None:
        self.pd, self.obj, self.access = pd, obj, access
        self.lkey, self.rkey, self.addr, self.length = vlkey, vrkey, vaddr, length
        self.delta = 0  # real address - virtual address in this process
        self.real_lkey = 0  # this process's
        self.memory: memoryview | None = None  # the registered memory, byte by byte (for inline sends)

    def attach(self, real: Any) -> None:
        self.real = real
        self.delta = int(real.addr) - self.addr
        self.real_lkey = int(real.lkey)
        self.memory = memoryview(self.obj).cast("B")


class ShadowChannel(Shadow):
    def __init__(self, device: ShadowDevice) -> None:
        self.device = device
        self.pending: deque[ShadowCQ] = deque()  # events taken from the real channel at DRAIN, not yet given


class ShadowCQ(Shadow):
    def __init__(self, device: ShadowDevice, cqe: int, channel: ShadowChannel | None, cq_context: Any) -> None:
        self.device, self.cqe, self.channel, self.cq_context = device, cqe, channel, cq_context
        self.private: deque[WC] = deque()  # principle 5: completions drained at checkpoint come first
        self.armed = 0  # 0, 1 (any completion) or 2 (solicited only): a req_notify not yet fired
        self.unacked_events = 0


@dataclass(slots=True)
class RecvEntry:
    """A posted receive WR, until its completion is polled."""

    seq: int
    wr_id: int
    sg: list[tuple[int, int, int]]  # virtual (addr, length, lkey)


@dataclass(slots=True)
class SendEntry:
    """A posted send WR, until its real completion (or a later WR's) is polled, or DRAIN sees it landed."""

    seq: int
    wr_id: int
    opcode: int
    flags: int  # the program's send flags
    signaled: bool  # whether the program gets a completion
    sg: list[tuple[int, int, int]]
    imm: int
    rkey: int
    raddr: int
    compare_add: int
    swap: int
    inline: bytes | None
    real_signaled: bool = True  # the real WR asks for a completion (see _datapath.py)
    psn: int = 0  # first PSN, computed the way the wire assigns them
    npkts: int = 1

    @property
    def needs_recv(self) -> bool:
        from ckpt.verbs import IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM

        return self.opcode in (IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM)


class ShadowSRQ(Shadow):
    def __init__(self, pd: ShadowPD, attr: SrqAttr, srq_context: Any) -> None:
        self.pd, self.srq_context = pd, srq_context
        self.attr = SrqAttr(max_wr=attr.max_wr, max_sge=attr.max_sge, srq_limit=attr.srq_limit)
        self.limit = 0  # armed srq_limit, replayed on restart
        self.recvs: OrderedDict[int, RecvEntry] = OrderedDict()
        self.seq = 0


@dataclass
class QPInit:
    qp_type: int
    qp_context: Any
    scq: ShadowCQ
    rcq: ShadowCQ
    srq: ShadowSRQ | None
    cap: QPCap
    sq_sig_all: int


class ShadowQP(Shadow):
    """A QP, its modify history, its WR logs, and the path it is on.

    Its primary and alternate paths (``ah``, ``port_num``, ``timeout``, ``pkey_index`` and the ``alt_``
    ones, LIDs virtual) and ``mig_state`` are what the real QP has, not only what the program asked
    for: a migration swaps them behind the program's back (automatic on a link failure, or manual),
    and `Virtualizer.track_path` follows it.  A restart rebuilds the QP on these (`_rebuild`).
    Class defaults: images written before the paths were tracked unpickle without them.
    """

    port_num = 0  # 0: not set yet
    alt_port_num = 0
    timeout = alt_timeout = 0
    pkey_index = alt_pkey_index = 0
    mig_state = 0  # IBV_MIG_MIGRATED: no alternate path armed

    def __init__(self, pd: ShadowPD, init: QPInit, vqpn: int) -> None:
        self.pd, self.init, self.qp_num = pd, init, vqpn
        self.modifies: list[tuple[QPAttr, int]] = []  # principle 3: replayed on restart
        self.sends: deque[SendEntry] = deque()
        self.recvs: OrderedDict[int, RecvEntry] = OrderedDict()
        self.seq = 0
        self.state = 0  # IBV_QPS_RESET
        self.dest_qp_num = 0  # virtual
        self.ah = AHAttr()
        self.alt_ah = AHAttr()
        self.mtu = 1024
        self.next_psn = 0


class ShadowAH(Shadow):
    def __init__(self, pd: ShadowPD, attr: AHAttr) -> None:
        self.pd, self.attr = pd, attr


@dataclass
class Registry:
    """Every shadow of this process, in creation order: what a restart rebuilds (it pickles into the image)."""

    devices: list[ShadowDevice] = field(default_factory=list)
    pds: list[ShadowPD] = field(default_factory=list)
    mrs: list[ShadowMR] = field(default_factory=list)
    channels: list[ShadowChannel] = field(default_factory=list)
    cqs: list[ShadowCQ] = field(default_factory=list)
    srqs: list[ShadowSRQ] = field(default_factory=list)
    qps: list[ShadowQP] = field(default_factory=list)
    ahs: list[ShadowAH] = field(default_factory=list)
    vlids: dict[str, list[int]] = field(default_factory=dict)  # device name -> virtual LIDs of its ports

    def forget(self, shadow: Shadow) -> None:
        for group in (self.devices, self.pds, self.mrs, self.channels, self.cqs, self.srqs, self.qps, self.ahs):
            if shadow in group:
                group.remove(shadow)  # type: ignore[arg-type]
                return
