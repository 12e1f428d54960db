"""The `simib` provider: the operations table over the simulated HCA and subnet manager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpt.plugin import DirectoryFactory
from ckpt.verbs import _enums as e
from ckpt.verbs import _handles as hh
from ckpt.verbs import _hca as hw
from ckpt.verbs._attrs import GID, DeviceAttr, PathRecord, PortAttr, QPInitAttr, SrqAttr
from ckpt.verbs._errors import PyverbsRDMAError
from ckpt.verbs._provider import VerbsOps
from ckpt.verbs._qp import QPHandle


class DeviceHandle(hh.NotCheckpointable):
    """An open device: the process's HCA for that name."""

    __slots__ = ("hca", "name")

    def __init__(self, name: str, hca: hw.Hca | None = None) -> None:
        self.name = name
        self.hca = hca or hw.hca(name)


def open_device(name: str) -> DeviceHandle:
    return DeviceHandle(name)


def close_device(dev: DeviceHandle) -> None:
    """The HCA outlives its contexts (it is the process's NIC); nothing to release."""


def query_device(dev: DeviceHandle) -> DeviceAttr:
    hca = dev.hca
    return DeviceAttr(
        fw_version=f"ckpt-{dev.hca.provider} 1",
        node_guid=hca.guid,
        sys_image_guid=hca.guid,
        max_mr_size=hh.MAX_MR_SIZE,
        page_size_cap=4096,
        vendor_id=0x15B3,
        vendor_part_id=0xC4C7,
        max_qp=1 << 20,
        max_qp_wr=hh.MAX_QP_WR,
        max_sge=hh.MAX_SGE,
        max_sge_rd=hh.MAX_SGE,
        max_cq=1 << 20,
        max_cqe=hh.MAX_CQE,
        max_mr=1 << 20,
        max_pd=1 << 20,
        max_qp_rd_atom=hh.MAX_RD_ATOMIC,
        max_res_rd_atom=hh.MAX_RD_ATOMIC << 10,
        max_qp_init_rd_atom=hh.MAX_RD_ATOMIC,
        atomic_caps=int(e.IBV_ATOMIC_HCA),
        max_srq=1 << 20,
        max_srq_wr=hh.MAX_QP_WR,
        max_srq_sge=hh.MAX_SGE,
        phys_port_cnt=2,
    )


def query_port(dev: DeviceHandle, port: int) -> PortAttr:
    hca = dev.hca
    if port not in (1, 2):
        raise PyverbsRDMAError(f"port {port} does not exist (simib HCAs have ports 1 and 2)", hh.EINVAL)
    lid = hca.lids[port - 1]
    up = hca.link_up.get(lid, True)
    return PortAttr(
        state=int(e.IBV_PORT_ACTIVE if up else e.IBV_PORT_DOWN),
        max_mtu=int(e.IBV_MTU_4096),
        active_mtu=int(e.IBV_MTU_4096),
        gid_tbl_len=1,
        max_msg_sz=hh.MAX_MSG,
        pkey_tbl_len=1,
        lid=lid,
        sm_lid=hca.sm_lid,
        max_vl_num=1,
        subnet_timeout=18,
        active_width=2,
        active_speed=32,
        phys_state=5 if up else 3,
        link_layer=1,
    )


def query_gid(dev: DeviceHandle, port: int, index: int) -> GID:
    if port not in (1, 2) or index != 0:
        raise PyverbsRDMAError(f"GID index {index} of port {port} does not exist", hh.EINVAL)
    guid = dev.hca.guid ^ (port - 1)
    return GID(bytes.fromhex("fe80000000000000") + guid.to_bytes(8, "big"))


def get_async_event(dev: DeviceHandle, timeout: float | None) -> Any:
    return dev.hca.get_event(timeout)


def alloc_pd(dev: DeviceHandle) -> hh.PDHandle:
    return hh.PDHandle(dev.hca)


def dealloc_pd(pd: hh.PDHandle) -> None:
    """PDs hold no NIC resources of their own here."""


def reg_mr(pd: hh.PDHandle, obj: Any, access: int) -> hh.MRHandle:
    mr = hh.MRHandle(pd, obj, int(access))
    pd.hca.register(mr)
    return mr


def dereg_mr(mr: hh.MRHandle) -> None:
    mr.hca.deregister(mr)


def create_comp_channel(dev: DeviceHandle) -> hh.ChannelHandle:
    return hh.ChannelHandle(dev.hca)


def destroy_comp_channel(channel: hh.ChannelHandle) -> None:
    """Nothing to release."""


def get_cq_event(channel: hh.ChannelHandle, timeout: float | None) -> hh.CQHandle | None:
    return channel.get(timeout)


def create_cq(dev: DeviceHandle, cqe: int, channel: hh.ChannelHandle | None, cq_context: Any) -> hh.CQHandle:
    return hh.CQHandle(dev.hca, int(cqe), channel, cq_context)


def destroy_cq(cq: hh.CQHandle) -> None:
    if cq.unacked_events:
        raise PyverbsRDMAError(f"CQ has {cq.unacked_events} completion events not acknowledged", hh.EBUSY)


def poll_cq(cq: hh.CQHandle, num_entries: int) -> list[Any]:
    return cq.poll(num_entries)


def req_notify_cq(cq: hh.CQHandle, solicited_only: bool) -> None:
    cq.req_notify(solicited_only)


def ack_cq_events(cq: hh.CQHandle, count: int) -> None:
    if count > cq.unacked_events:
        raise PyverbsRDMAError(f"acknowledging {count} CQ events, only {cq.unacked_events} were received", hh.EINVAL)
    cq.unacked_events -= count


def create_srq(pd: hh.PDHandle, attr: SrqAttr, srq_context: Any) -> hh.SRQHandle:
    return hh.SRQHandle(pd, attr, srq_context)


def modify_srq(srq: hh.SRQHandle, attr: SrqAttr, mask: int) -> None:
    srq.modify(attr, int(mask))


def query_srq(srq: hh.SRQHandle) -> SrqAttr:
    return srq.query()


def destroy_srq(srq: hh.SRQHandle) -> None:
    srq.queue.clear()


def post_srq_recv(srq: hh.SRQHandle, wr: Any) -> None:
    wrs = []
    while wr is not None:
        wrs.append(wr)
        wr = wr.next_wr
    srq.post(wrs)


def create_qp(pd: hh.PDHandle, init_attr: QPInitAttr) -> QPHandle:
    return QPHandle(pd, init_attr)


def modify_qp(qp: QPHandle, attr: Any, mask: int) -> None:
    qp.modify(attr, int(mask))


def query_qp(qp: QPHandle, mask: int) -> Any:
    return qp.query()


def destroy_qp(qp: QPHandle) -> None:
    qp.destroy()


def post_send(qp: QPHandle, wr: Any) -> None:
    qp.post_send(wr)


def post_recv(qp: QPHandle, wr: Any) -> None:
    qp.post_recv(wr)


def create_ah(pd: hh.PDHandle, attr: Any) -> hh.AHHandle:
    return hh.AHHandle(pd, attr)


def destroy_ah(ah: hh.AHHandle) -> None:
    """Nothing to release."""


def device_statistics(dev: DeviceHandle) -> hw.HcaStatistics:
    return dev.hca.statistics()


def query_paths(dev: DeviceHandle, dlid: int) -> list[PathRecord]:
    return dev.hca.paths_to(dlid)


def make_ops(
    provider: str = "simib", directory: DirectoryFactory | None = None, host: Callable[[], str] | None = None
) -> VerbsOps:
    """An operations table over the HCA engine (a fresh one: wrappers modify it in place).

    simib's own finds peers through the subnet manager.  Another provider (ib2tcp's
    `tcp`) passes its own `directory` and listening `host`: the same engine, the same
    semantics, peers found another way.  Its devices are HCAs of their own, named
    after the provider (`tcp0`), so they never share one with simib.
    """
    names = [n for n in globals() if not n.startswith("_")]
    from ckpt.verbs._provider import OPERATIONS

    entries = {n: globals()[n] for n in OPERATIONS if n in names}
    if directory is not None:
        entries["open_device"] = lambda name: DeviceHandle(name, hw.hca(name, directory, host() if host else None))
    # The hot path calls the engine's methods directly: no extra Python frame per post or poll.
    entries.update(post_send=QPHandle.post_send, post_recv=QPHandle.post_recv, poll_cq=hh.CQHandle.poll)
    return VerbsOps(provider, **entries)
