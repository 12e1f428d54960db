"""The typed verbs-provider interface: the operations table every Context dispatches through, and Directory."""

# A provider (simib, ib2tcp's tcp, a test's counting wrapper) is a table of 32 operations, as an
# rdma-core provider fills `verbs_context_ops`.  Entries take and return *handles*: whatever the
# provider (or a wrapper) uses to stand for a device, PD, MR, CQ, channel, SRQ, QP or AH.  A handle
# shows the program the attributes the front end reads (`qp_num`, `lkey`, `rkey`, `addr`, ...), so a
# wrapper can hand out shadow handles with virtual values.  Handles are therefore typed `Any` here:
# each provider has its own.  `ckpt.verbs.VerbsOps` is the concrete table; this Protocol is what a
# `ckpt_wrap_verbs` wrapper and a `ckpt_verbs_providers` factory are written against.

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Handle = Any


class VerbsOpsTable(Protocol):
    """A provider's operations table (``ckpt.verbs.VerbsOps``): one attribute per operation.

    A wrapper replaces entries in place and keeps the previous one to call through; the table's
    ``provider`` names the provider it belongs to.
    """

    provider: str

    # devices
    open_device: Callable[[str], Handle]
    close_device: Callable[[Handle], None]
    query_device: Callable[[Handle], Any]  # -> DeviceAttr
    query_port: Callable[[Handle, int], Any]  # (device, port) -> PortAttr
    query_gid: Callable[[Handle, int, int], Any]  # (device, port, index) -> GID
    get_async_event: Callable[[Handle, float | None], Any]  # (device, timeout) -> AsyncEvent | None
    device_statistics: Callable[[Handle], Any]  # an extension: the provider's counters (a frozen dataclass)
    query_paths: Callable[[Handle, int], list[Any]]  # an extension: (device, dlid) -> [PathRecord] (APM)
    # protection domains and memory
    alloc_pd: Callable[[Handle], Handle]
    dealloc_pd: Callable[[Handle], None]
    reg_mr: Callable[[Handle, Any, int], Handle]  # (pd, buffer object, access flags) -> MR handle
    dereg_mr: Callable[[Handle], None]
    # completion channels and queues
    create_comp_channel: Callable[[Handle], Handle]
    destroy_comp_channel: Callable[[Handle], None]
    get_cq_event: Callable[[Handle, float | None], Handle | None]  # (channel, timeout) -> CQ handle
    create_cq: Callable[[Handle, int, Handle | None, Any], Handle]  # (device, cqe, channel, cq_context)
    destroy_cq: Callable[[Handle], None]
    poll_cq: Callable[[Handle, int], list[Any]]  # (cq, num_entries) -> [WC]   -- hot path
    req_notify_cq: Callable[[Handle, bool], None]  # (cq, solicited_only)
    ack_cq_events: Callable[[Handle, int], None]
    # shared receive queues
    create_srq: Callable[[Handle, Any, Any], Handle]  # (pd, SrqAttr, srq_context)
    modify_srq: Callable[[Handle, Any, int], None]  # (srq, SrqAttr, mask)
    query_srq: Callable[[Handle], Any]
    destroy_srq: Callable[[Handle], None]
    post_srq_recv: Callable[[Handle, Any], None]  # (srq, RecvWR chain)
    # queue pairs
    create_qp: Callable[[Handle, Any], Handle]  # (pd, QPInitAttr)
    modify_qp: Callable[[Handle, Any, int], None]  # (qp, QPAttr, mask)
    query_qp: Callable[[Handle, int], Any]  # (qp, mask) -> (QPAttr, QPInitAttr)
    destroy_qp: Callable[[Handle], None]
    post_send: Callable[[Handle, Any], None]  # (qp, SendWR chain)   -- hot path
    post_recv: Callable[[Handle, Any], None]  # (qp, RecvWR chain)   -- hot path
    # address handles
    create_ah: Callable[[Handle, Any], Handle]  # (pd, AHAttr)
    destroy_ah: Callable[[Handle], None]


#: Builds a provider's operations table (what ``ckpt_verbs_providers`` returns per provider name).
ProviderFactory = Callable[[], VerbsOpsTable]


class Directory(Protocol):
    """How an engine HCA finds its peers: the simib subnet manager, ib2tcp's key-value directory, or another.

    ``register`` gives the HCA its two port LIDs (``{"lids", "sm_lid", "latency", "bandwidth", "links"}``);
    ``node`` (passed only when the process has one, ``$CKPT_SIMIB_NODE``) names the machine the HCA stands
    for: a directory may give the same node the same LIDs and link states again.
    ``resolve(lid)`` is (endpoint "host:port", port, link up), or (None, None, False) for an unknown LID.
    """

    def register(
        self, guid: int, name: str, endpoint: str, pid: int, host: str, node: str | None = None
    ) -> dict[str, Any]: ...

    def resolve(self, lid: int) -> tuple[str | None, int | None, bool]: ...


#: Makes the Directory of a new HCA; it calls ``on_link(lid, up)`` when a link changes.
DirectoryFactory = Callable[[Callable[[int, bool], None]], Directory]
