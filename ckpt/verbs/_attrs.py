"""The attribute and work-request classes of ckpt.verbs, with pyverbs' names, parameters and defaults."""

# These mirror pyverbs' QPCap, QPInitAttr, QPAttr, AHAttr, GlobalRoute, GID, SGE,
# RecvWR, SendWR, WC, SrqAttr, SrqInitAttr, DeviceAttr and PortAttr (rdma-core
# pyverbs/{qp,addr,wr,cq,srq,device}.pyx). pyverbs wraps C structs; here they are
# slotted dataclasses, so fields are plain attributes and construction is a few
# assignments (WC is built on the completion hot path).
#
# Defaults follow pyverbs. Where pyverbs leaves a C field zeroed, it is 0 here too:
# notably QPAttr.timeout, retry_cnt, rnr_retry, max_rd_atomic, max_dest_rd_atomic
# and min_rnr_timer are 0 (pyverbs sets only qp_state, cur_qp_state, port_num and
# path_mtu), so a program must set them for RTR/RTS exactly as with pyverbs.

from __future__ import annotations

import ipaddress
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from ckpt.verbs._enums import (
    IBV_MIG_MIGRATED,
    IBV_MTU_1024,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPT_UD,
    IBV_SEND_SIGNALED,
    IBV_WR_SEND,
    ibv_event_type,
)
from ckpt.verbs._errors import PyverbsUserError

__all__ = [
    "GID",
    "SGE",
    "WC",
    "AHAttr",
    "AsyncEvent",
    "DeviceAttr",
    "GlobalRoute",
    "PortAttr",
    "QPAttr",
    "QPCap",
    "QPInitAttr",
    "RecvWR",
    "SendWR",
    "SrqAttr",
    "SrqInitAttr",
]


class GID:
    """A 16-byte InfiniBand GID; ``str()`` gives pyverbs' form ``'fe80:0000:0000:0000:0002:c903:0001:0001'``."""

    __slots__ = ("raw",)

    raw: bytes

    def __init__(self, val: str | bytes | None = None) -> None:
        if val is None:
            self.raw = bytes(16)
        elif isinstance(val, bytes | bytearray):
            if len(val) != 16:
                raise PyverbsUserError(f"a GID is 16 bytes, got {len(val)}")
            self.raw = bytes(val)
        else:
            self.raw = _parse_gid(val)

    @property
    def gid(self) -> str:
        return str(self)

    @gid.setter
    def gid(self, val: str) -> None:
        self.raw = _parse_gid(val)

    def __str__(self) -> str:
        hex_digits = self.raw.hex()
        return ":".join(hex_digits[i : i + 4] for i in range(0, 32, 4))

    def __repr__(self) -> str:
        return f"GID({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GID):
            return NotImplemented
        return self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.raw)


def _parse_gid(text: str) -> bytes:
    # pyverbs writes all eight 16-bit groups; the IPv6 parser also takes '::' forms.
    try:
        return ipaddress.IPv6Address(text).packed
    except ValueError:
        raise PyverbsUserError(f"not a GID: {text!r} (expected eight ':'-separated groups of hex digits)") from None


@dataclass(slots=True)
class QPCap:
    """``ibv_qp_cap``: the work-queue sizes asked for at QP creation."""

    max_send_wr: int = 1
    max_recv_wr: int = 10
    max_send_sge: int = 1
    max_recv_sge: int = 1
    max_inline_data: int = 0


@dataclass(slots=True)
class QPInitAttr:
    """``ibv_qp_init_attr``; ``scq``/``rcq``/``srq`` hold CQ/SRQ objects (front-end or provider handles)."""

    qp_type: int = IBV_QPT_UD
    qp_context: Any = None
    scq: Any = None
    rcq: Any = None
    srq: Any = None
    cap: QPCap = field(default_factory=QPCap)
    sq_sig_all: int = 1

    def __post_init__(self) -> None:
        # pyverbs accepts cap=None and fills in QPCap()'s defaults.
        if self.cap is None:
            self.cap = QPCap()

    @property
    def send_cq(self) -> Any:
        return self.scq

    @send_cq.setter
    def send_cq(self, val: Any) -> None:
        self.scq = val

    @property
    def recv_cq(self) -> Any:
        return self.rcq

    @recv_cq.setter
    def recv_cq(self, val: Any) -> None:
        self.rcq = val


@dataclass(slots=True)
class GlobalRoute:
    """``ibv_global_route``: the GRH fields of an address vector."""

    dgid: GID = field(default_factory=GID)
    flow_label: int = 0
    sgid_index: int = 0
    hop_limit: int = 1
    traffic_class: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dgid, GID):
            self.dgid = GID(self.dgid)


@dataclass(slots=True)
class AHAttr:
    """``ibv_ah_attr``: an address vector (destination LID, SL, port, optional GRH in ``gr``)."""

    dlid: int = 0
    sl: int = 0
    src_path_bits: int = 0
    static_rate: int = 0
    is_global: int = 0
    port_num: int = 1
    gr: GlobalRoute | None = None

    def __post_init__(self) -> None:
        if self.is_global and self.gr is None:
            raise PyverbsUserError("Global AH Attr is created but gr parameter is None")

    # pyverbs exposes the GRH fields on the AHAttr itself, None unless the AH is global.
    @property
    def dgid(self) -> GID | None:
        return self.gr.dgid if self.is_global and self.gr is not None else None

    @property
    def sgid_index(self) -> int | None:
        return self.gr.sgid_index if self.is_global and self.gr is not None else None

    @property
    def hop_limit(self) -> int | None:
        return self.gr.hop_limit if self.is_global and self.gr is not None else None

    @property
    def flow_label(self) -> int | None:
        return self.gr.flow_label if self.is_global and self.gr is not None else None

    @property
    def traffic_class(self) -> int | None:
        return self.gr.traffic_class if self.is_global and self.gr is not None else None


@dataclass(slots=True)
class QPAttr:
    """``ibv_qp_attr``: every field, for ``modify``/``to_init``/``to_rtr``/``to_rts`` and ``query``.

    The first four parameters are pyverbs' positional ones; the rest are keyword-only.
    """

    qp_state: int = IBV_QPS_INIT
    cur_qp_state: int = IBV_QPS_RESET
    port_num: int = 1
    path_mtu: int = IBV_MTU_1024
    _: KW_ONLY
    path_mig_state: int = IBV_MIG_MIGRATED
    qkey: int = 0
    rq_psn: int = 0
    sq_psn: int = 0
    dest_qp_num: int = 0
    qp_access_flags: int = 0
    cap: QPCap = field(default_factory=QPCap)
    ah_attr: AHAttr = field(default_factory=AHAttr)
    alt_ah_attr: AHAttr = field(default_factory=AHAttr)
    pkey_index: int = 0
    alt_pkey_index: int = 0
    en_sqd_async_notify: int = 0
    sq_draining: int = 0
    max_rd_atomic: int = 0
    max_dest_rd_atomic: int = 0
    min_rnr_timer: int = 0
    timeout: int = 0
    retry_cnt: int = 0
    rnr_retry: int = 0
    alt_port_num: int = 0
    alt_timeout: int = 0
    rate_limit: int = 0


@dataclass(slots=True)
class SGE:
    """``ibv_sge``: one scatter/gather element (address, length, lkey of the MR it lies in)."""

    addr: int
    length: int
    lkey: int


@dataclass(slots=True, eq=False)
class RecvWR:
    """``ibv_recv_wr``: a receive work request; ``next_wr`` chains several into one post."""

    wr_id: int = 0
    num_sge: int = 0
    sg: list[SGE] | None = None
    next_wr: RecvWR | None = None

    def __post_init__(self) -> None:
        if self.sg is None:
            self.sg = []
        elif not self.num_sge:
            self.num_sge = len(self.sg)


@dataclass(slots=True, eq=False)
class SendWR:
    """``ibv_send_wr``: a send work request; the remote part is set by ``set_wr_rdma/atomic/ud``."""

    wr_id: int = 0
    opcode: int = IBV_WR_SEND
    num_sge: int = 0
    imm_data: int = 0
    sg: list[SGE] | None = None
    send_flags: int = IBV_SEND_SIGNALED
    next_wr: SendWR | None = None
    rkey: int = field(default=0, init=False)
    remote_addr: int = field(default=0, init=False)
    compare_add: int = field(default=0, init=False)
    swap: int = field(default=0, init=False)
    ah: Any = field(default=None, init=False)
    remote_qpn: int = field(default=0, init=False)
    remote_qkey: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.sg is None:
            self.sg = []
        elif not self.num_sge:
            self.num_sge = len(self.sg)

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        """Target of an RDMA read or write: remote ``addr`` inside the MR of ``rkey``."""
        self.rkey = rkey
        self.remote_addr = addr

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        """Operands of an atomic: compare value (CMP_AND_SWP) or addend (FETCH_AND_ADD), and swap value."""
        self.rkey = rkey
        self.remote_addr = addr
        self.compare_add = compare_add
        self.swap = swap

    def set_wr_ud(self, ah: Any, rqpn: int, rqkey: int) -> None:
        """Destination of a UD send: address handle, remote QP number and Q_Key."""
        self.ah = ah
        self.remote_qpn = rqpn
        self.remote_qkey = rqkey


@dataclass(slots=True)
class WC:
    """``ibv_wc``: one work completion, as ``CQ.poll`` returns it."""

    wr_id: int = 0
    status: int = 0
    opcode: int = 0
    vendor_err: int = 0
    byte_len: int = 0
    qp_num: int = 0
    src_qp: int = 0
    imm_data: int = 0
    wc_flags: int = 0
    pkey_index: int = 0
    slid: int = 0
    sl: int = 0
    dlid_path_bits: int = 0


@dataclass(slots=True)
class SrqAttr:
    """``ibv_srq_attr``: size of a shared receive queue and its limit event threshold."""

    max_wr: int = 100
    max_sge: int = 1
    srq_limit: int = 0


@dataclass(slots=True)
class SrqInitAttr:
    """``ibv_srq_init_attr``: the attributes an SRQ is created with."""

    attr: SrqAttr = field(default_factory=SrqAttr)
    srq_context: Any = None

    def __post_init__(self) -> None:
        if self.attr is None:
            self.attr = SrqAttr()

    @property
    def max_wr(self) -> int:
        return self.attr.max_wr

    @property
    def max_sge(self) -> int:
        return self.attr.max_sge

    @property
    def srq_limit(self) -> int:
        return self.attr.srq_limit


@dataclass(slots=True, kw_only=True)
class DeviceAttr:
    """``ibv_device_attr`` with pyverbs' field names (``fw_version``, ``atomic_caps``, ``max_raw_ipv6_qps``)."""

    fw_version: str = ""
    node_guid: int = 0
    sys_image_guid: int = 0
    max_mr_size: int = 0
    page_size_cap: int = 0
    vendor_id: int = 0
    vendor_part_id: int = 0
    hw_ver: int = 0
    max_qp: int = 0
    max_qp_wr: int = 0
    device_cap_flags: int = 0
    max_sge: int = 0
    max_sge_rd: int = 0
    max_cq: int = 0
    max_cqe: int = 0
    max_mr: int = 0
    max_pd: int = 0
    max_qp_rd_atom: int = 0
    max_ee_rd_atom: int = 0
    max_res_rd_atom: int = 0
    max_qp_init_rd_atom: int = 0
    max_ee_init_rd_atom: int = 0
    atomic_caps: int = 0
    max_ee: int = 0
    max_rdd: int = 0
    max_mw: int = 0
    max_raw_ipv6_qps: int = 0
    max_raw_ethy_qp: int = 0
    max_mcast_grp: int = 0
    max_mcast_qp_attach: int = 0
    max_total_mcast_qp_attach: int = 0
    max_ah: int = 0
    max_fmr: int = 0
    max_map_per_fmr: int = 0
    max_srq: int = 0
    max_srq_wr: int = 0
    max_srq_sge: int = 0
    max_pkeys: int = 0
    local_ca_ack_delay: int = 0
    phys_port_cnt: int = 0

    # The C names of the three fields pyverbs renamed.
    @property
    def fw_ver(self) -> str:
        return self.fw_version

    @property
    def atomic_cap(self) -> int:
        return self.atomic_caps

    @property
    def max_raw_ipv6_qp(self) -> int:
        return self.max_raw_ipv6_qps


@dataclass(slots=True, kw_only=True)
class PortAttr:
    """``ibv_port_attr``: state, MTUs, LID and link properties of one HCA port."""

    state: int = 0
    max_mtu: int = 0
    active_mtu: int = 0
    gid_tbl_len: int = 0
    port_cap_flags: int = 0
    max_msg_sz: int = 0
    bad_pkey_cntr: int = 0
    qkey_viol_cntr: int = 0
    pkey_tbl_len: int = 0
    lid: int = 0
    sm_lid: int = 0
    lmc: int = 0
    max_vl_num: int = 0
    sm_sl: int = 0
    subnet_timeout: int = 0
    init_type_reply: int = 0
    active_width: int = 0
    active_speed: int = 0
    phys_state: int = 0
    link_layer: int = 0
    flags: int = 0


@dataclass(frozen=True, slots=True)
class PathRecord:
    """One path to a peer's HCA, as a subnet administrator's path record gives it (an extension).

    From this HCA's port ``port_num`` to ``dlid``, the LID of the peer HCA's port ``dport``;
    ``up``: both links are up now.  `Context.query_paths` lists every such path to the HCA
    owning a LID: the raw material of an alternate path (APM).
    """

    port_num: int
    dlid: int
    dport: int
    up: bool


class AsyncEvent:
    """``ibv_async_event``: what happened (``event_type``) and to what (``element``: QP, CQ, SRQ or port)."""

    __slots__ = ("element", "event_type")

    def __init__(self, event_type: int, element: Any = None) -> None:
        self.event_type = event_type
        self.element = element

    def ack(self) -> None:
        """Acknowledge the event (``ibv_ack_async_event``); nothing to release here, so repeat calls are fine."""

    def __repr__(self) -> str:
        try:
            name = ibv_event_type(self.event_type).name
        except ValueError:
            name = f"event type {self.event_type}"
        return f"AsyncEvent({name}, element={self.element!r})"
