"""The wrapped operations table: shadows in, real handles out, virtual IDs and addresses translated both ways."""

# Principle 2: interpose on the provider's operations table, not on
# convenience functions -- so every Context, PD, MR, CQ, QP the program
# creates, before or after a restart, is seen here.
#
# Virtual IDs are allocated by the coordinator (allocate_global), in every
# generation, so an ID is unique across ranks and restarts and two objects can
# never share one; the real ID behind each virtual one is published in the
# key-value store (generation-scoped, so a restart never sees stale values):
#
#     ib/qpn/<vqpn>   -> real qp_num
#     ib/lid/<vlid>   -> real LID
#     ib/rkey/<vrkey> -> [real rkey, real address - virtual address]
#
# Lookups of peers' IDs are cached.  A rank recovered alone (single-rank
# recovery, _recovery.py) publishes its objects again under the same virtual
# IDs in the same generation -- the keys are overwritten -- so its peers drop
# their cached translations of its IDs (_recovery.forget_rank), and a look-up
# that raced with that drop is not cached (`cache_epoch`).
#
# Addresses are virtual too: MR.buf is the address of the first registration;
# after a restart the same buffer lives elsewhere, so local SGE addresses are
# translated by lkey and remote addresses by rkey (docs/ib.md).  Posting and
# polling through the logs -- the hot path -- is the `DataPath` mixin
# (_datapath.py).

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ckpt import verbs as v
from ckpt.verbs import AsyncEvent, PathRecord, PyverbsRDMAError, QPAttr, QPInitAttr
from ckpt_ib._datapath import PSN_MASK, DataPath
from ckpt_ib._shadows import (
    QPInit,
    Registry,
    ShadowAH,
    ShadowChannel,
    ShadowCQ,
    ShadowDevice,
    ShadowMR,
    ShadowPD,
    ShadowQP,
    ShadowSRQ,
)

log = logging.getLogger(__name__)

NS = "ib"
EINVAL, EBUSY = 22, 16
#: The real CQ holds the program's completions plus the ones it did not ask for (READs and atomics are always signaled).
REAL_CQE = 1 << 20


class Virtualizer(DataPath):
    """One per process: the registry of shadows, the translations of this generation, the wrapped entries."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.registry = Registry()
        self.inner: Any = None  # the provider's table as it was before wrapping (a plain namespace of entries)
        self.provider = ""  # its name
        self.cache_epoch = 0  # bumped when peers' IDs are dropped: a look-up that spans it is used, not cached
        self.reset_translations()

    def reset_translations(self) -> None:
        """Forget every real ID: a new generation publishes new ones."""
        self.qp_by_real: dict[int, ShadowQP] = {}
        self.shadow_of: dict[int, Any] = {}  # id(real handle) -> shadow, for CQ events and async events
        self.mr_by_lkey: dict[int, ShadowMR] = {}
        self.remote_qpn: dict[int, int] = {}
        self.remote_lid: dict[int, int] = {}
        self.remote_key: dict[int, tuple[int, int]] = {}
        self.scratch: dict[int, Any] = {}  # id(shadow QP) -> staging memory for re-posting inline WRs

    # ------------------------------------------------------------------ IDs
    def _alloc(self, kind: str, count: int = 1) -> int:
        return int(self.rt.allocate_global(f"ib.{kind}", count))

    def _publish(self, kind: str, virtual: int, real: Any) -> None:
        self.rt.kv.publish(NS, f"{kind}/{virtual}", real)

    def _lookup(self, cache: dict[int, Any], kind: str, virtual: int) -> Any:
        real = cache.get(virtual)
        if real is None:
            epoch = self.cache_epoch
            real = self.rt.kv.get(NS, f"{kind}/{virtual}")
            if real is None:
                return None  # unknown: the caller passes something invalid, as hardware would see it
            real = tuple(real) if isinstance(real, list) else real
            if epoch == self.cache_epoch:  # else a peer was recovered meanwhile: the value may be its old one
                cache[virtual] = real
        return real

    # An unknown virtual ID becomes 0 (never a real qp_num or unicast LID): the connection then
    # fails as a wrong one would on hardware (RETRY_EXC_ERR), never reaches an unrelated QP.
    def real_qpn(self, vqpn: int) -> int:
        found = self._lookup(self.remote_qpn, "qpn", vqpn)
        if found is None:
            log.warning("qp_num %d was never published: the connection will fail", vqpn)
        return int(found) if found is not None else 0

    def real_lid(self, vlid: int) -> int:
        found = self._lookup(self.remote_lid, "lid", vlid) if vlid else None
        if vlid and found is None:
            log.warning("LID %d was never published: the connection will fail", vlid)
        return int(found) if found is not None else 0

    def real_key(self, vrkey: int) -> tuple[int, int]:
        found = self._lookup(self.remote_key, "rkey", vrkey)
        return (int(found[0]), int(found[1])) if found is not None else (0, 0)

    # ------------------------------------------------------------------ install
    def install(self, ops: v.VerbsOps) -> None:
        """Replace the table's entries by the virtualizing ones (ckpt_wrap_verbs)."""

        class Inner:
            pass

        inner = Inner()
        for name in v.OPERATIONS:
            setattr(inner, name, getattr(ops, name))
        self.inner = inner
        self.provider = ops.provider
        for name in v.OPERATIONS:
            setattr(ops, name, getattr(self, name))

    # ------------------------------------------------------------------ device
    def real_device_name(self, name: str) -> str:
        """The device to open for a shadow's: the same index on this process's provider.

        After `ckpt restart --transport tcp`, a device the program opened as simib0 is tcp0.
        Only a transport's device moves, and only onto a transport (as `_ops_for_image` does).
        """
        provider, index, full = v.parse_device_name(name)
        fabrics = v.transports()
        moves = provider != self.provider and provider in fabrics and self.provider in fabrics
        return f"{self.provider}{index}" if moves else full

    def attach_device(self, dev: ShadowDevice) -> None:
        dev.real = self.inner.open_device(self.real_device_name(dev.name))
        self.shadow_of[id(dev.real)] = dev
        for port, vlid in enumerate(dev.vlids, start=1):
            self._publish("lid", vlid, int(self.inner.query_port(dev.real, port).lid))

    def open_device(self, name: str) -> ShadowDevice:
        vlids = self.registry.vlids.get(name)
        if vlids is None:
            first = self._alloc("lid", 2)
            vlids = self.registry.vlids[name] = [first, first + 1]
        dev = ShadowDevice(name, vlids)
        self.attach_device(dev)
        self.registry.devices.append(dev)
        return dev

    def close_device(self, dev: ShadowDevice) -> None:
        self.inner.close_device(dev.real)
        self.registry.forget(dev)

    def query_device(self, dev: ShadowDevice) -> Any:
        return self.inner.query_device(dev.real)

    def query_port(self, dev: ShadowDevice, port: int) -> Any:
        attr = self.inner.query_port(dev.real, port)
        attr.lid = dev.vlids[port - 1]
        return attr

    def query_gid(self, dev: ShadowDevice, port: int, index: int) -> Any:
        return self.inner.query_gid(dev.real, port, index)

    def device_statistics(self, dev: ShadowDevice) -> Any:
        return self.inner.device_statistics(dev.real)

    def query_paths(self, dev: ShadowDevice, dlid: int) -> list[PathRecord]:
        """The real path records to the HCA of virtual LID `dlid`, their LIDs virtual: a device's virtual
        LIDs are consecutive (ports 1 and 2, `open_device`), so the peer's port p is dlid - dport + p."""
        records: list[PathRecord] = self.inner.query_paths(dev.real, self.real_lid(dlid))
        real = self.real_lid(dlid)
        dport = next((r.dport for r in records if r.dlid == real), None)
        if dport is None:
            return []
        return [replace(r, dlid=dlid - dport + r.dport) for r in records]

    def get_async_event(self, dev: ShadowDevice, timeout: float | None) -> AsyncEvent | None:
        event = self.inner.get_async_event(dev.real, timeout)
        if event is None:
            return None
        element = event.element
        if not isinstance(element, int):
            element = self.shadow_of.get(id(element), element)
        if isinstance(element, ShadowQP) and event.event_type == v.IBV_EVENT_PATH_MIG:
            self.track_path(element)  # the program may query or re-arm it next
        return AsyncEvent(event.event_type, element)

    # ------------------------------------------------------------------ PD, MR
    def alloc_pd(self, dev: ShadowDevice) -> ShadowPD:
        pd = ShadowPD(dev)
        pd.real = self.inner.alloc_pd(dev.real)
        self.registry.pds.append(pd)
        return pd

    def dealloc_pd(self, pd: ShadowPD) -> None:
        self.inner.dealloc_pd(pd.real)
        self.registry.forget(pd)

    def attach_mr(self, mr: ShadowMR) -> None:
        real = self.inner.reg_mr(mr.pd.real, mr.obj, mr.access)
        mr.attach(real)
        self.mr_by_lkey[mr.lkey] = mr
        self._publish("rkey", mr.rkey, [int(real.rkey), mr.delta])

    def reg_mr(self, pd: ShadowPD, obj: Any, access: int) -> ShadowMR:
        real = self.inner.reg_mr(pd.real, obj, access)
        first = self._alloc("key", 2)
        mr = ShadowMR(pd, obj, access, first, first + 1, int(real.addr), int(real.length))
        mr.attach(real)
        self.mr_by_lkey[mr.lkey] = mr
        self._publish("rkey", mr.rkey, [int(real.rkey), 0])
        self.registry.mrs.append(mr)
        return mr

    def dereg_mr(self, mr: ShadowMR) -> None:
        self.inner.dereg_mr(mr.real)
        self.mr_by_lkey.pop(mr.lkey, None)
        self.registry.forget(mr)

    # ------------------------------------------------------------------ channels, CQs
    def create_comp_channel(self, dev: ShadowDevice) -> ShadowChannel:
        ch = ShadowChannel(dev)
        ch.real = self.inner.create_comp_channel(dev.real)
        self.registry.channels.append(ch)
        return ch

    def destroy_comp_channel(self, ch: ShadowChannel) -> None:
        self.inner.destroy_comp_channel(ch.real)
        self.registry.forget(ch)

    def take_cq_event(self, ch: ShadowChannel, timeout: float | None) -> ShadowCQ | None:
        """One event from the real channel, acknowledged there at once (the shadow counts it for the program)."""
        real = self.inner.get_cq_event(ch.real, timeout)
        if real is None:
            return None
        self.inner.ack_cq_events(real, 1)
        cq: ShadowCQ = self.shadow_of[id(real)]
        cq.armed = 0
        return cq

    def get_cq_event(self, ch: ShadowChannel, timeout: float | None) -> ShadowCQ | None:
        cq = ch.pending.popleft() if ch.pending else self.take_cq_event(ch, timeout)
        if cq is not None:
            cq.unacked_events += 1
        return cq

    def attach_cq(self, cq: ShadowCQ) -> None:
        channel = cq.channel.real if cq.channel is not None else None
        cq.real = self.inner.create_cq(cq.device.real, max(cq.cqe, REAL_CQE), channel, cq.cq_context)
        self.shadow_of[id(cq.real)] = cq

    def create_cq(self, dev: ShadowDevice, cqe: int, channel: ShadowChannel | None, cq_context: Any) -> ShadowCQ:
        if not 1 <= cqe <= REAL_CQE:
            raise PyverbsRDMAError(f"CQ size {cqe} out of range 1..{REAL_CQE}", EINVAL)
        cq = ShadowCQ(dev, cqe, channel, cq_context)
        self.attach_cq(cq)
        self.registry.cqs.append(cq)
        return cq

    def destroy_cq(self, cq: ShadowCQ) -> None:
        if cq.unacked_events:
            raise PyverbsRDMAError(f"CQ has {cq.unacked_events} completion events not acknowledged", EBUSY)
        self.inner.destroy_cq(cq.real)
        self.registry.forget(cq)

    def req_notify_cq(self, cq: ShadowCQ, solicited_only: bool) -> None:
        self.inner.req_notify_cq(cq.real, solicited_only)
        cq.armed = 2 if solicited_only else 1

    def ack_cq_events(self, cq: ShadowCQ, count: int) -> None:
        if count > cq.unacked_events:
            raise PyverbsRDMAError(f"acknowledging {count} CQ events, only {cq.unacked_events} were received", EINVAL)
        cq.unacked_events -= count

    # ------------------------------------------------------------------ SRQ
    def attach_srq(self, srq: ShadowSRQ) -> None:
        srq.real = self.inner.create_srq(srq.pd.real, srq.attr, srq.srq_context)
        self.shadow_of[id(srq.real)] = srq

    def create_srq(self, pd: ShadowPD, attr: Any, srq_context: Any) -> ShadowSRQ:
        srq = ShadowSRQ(pd, attr, srq_context)
        self.attach_srq(srq)
        self.registry.srqs.append(srq)
        return srq

    def modify_srq(self, srq: ShadowSRQ, attr: Any, mask: int) -> None:
        self.inner.modify_srq(srq.real, attr, mask)
        if mask & v.IBV_SRQ_LIMIT:
            srq.limit = attr.srq_limit

    def query_srq(self, srq: ShadowSRQ) -> Any:
        return self.inner.query_srq(srq.real)

    def destroy_srq(self, srq: ShadowSRQ) -> None:
        self.inner.destroy_srq(srq.real)
        self.registry.forget(srq)

    # ------------------------------------------------------------------ QP
    def attach_qp(self, qp: ShadowQP) -> None:
        init = qp.init
        real_init = QPInitAttr(
            qp_type=init.qp_type,
            qp_context=init.qp_context,
            scq=init.scq.real,
            rcq=init.rcq.real,
            srq=init.srq.real if init.srq is not None else None,
            cap=init.cap,
            sq_sig_all=0,
        )
        qp.real = self.inner.create_qp(qp.pd.real, real_init)
        self.qp_by_real[int(qp.real.qp_num)] = qp
        self.shadow_of[id(qp.real)] = qp
        self._publish("qpn", qp.qp_num, int(qp.real.qp_num))

    def create_qp(self, pd: ShadowPD, init_attr: QPInitAttr) -> ShadowQP:
        init = QPInit(
            int(init_attr.qp_type),
            init_attr.qp_context,
            init_attr.scq,
            init_attr.rcq,
            init_attr.srq,
            init_attr.cap,
            int(init_attr.sq_sig_all),
        )
        qp = ShadowQP(pd, init, self._alloc("qpn") & PSN_MASK)
        self.attach_qp(qp)
        self.registry.qps.append(qp)
        return qp

    def destroy_qp(self, qp: ShadowQP) -> None:
        self.inner.destroy_qp(qp.real)
        self.qp_by_real.pop(int(qp.real.qp_num), None)
        self.shadow_of.pop(id(qp.real), None)
        self.registry.forget(qp)

    def real_qp_attr(self, attr: QPAttr, mask: int) -> QPAttr:
        """A copy of `attr` with the peer's virtual qp_num and LIDs replaced by this generation's real ones."""
        real = copy_attr(attr)
        if mask & v.IBV_QP_DEST_QPN:
            real.dest_qp_num = self.real_qpn(attr.dest_qp_num)
        if mask & v.IBV_QP_AV:
            real.ah_attr.dlid = self.real_lid(attr.ah_attr.dlid)
        if mask & v.IBV_QP_ALT_PATH:
            real.alt_ah_attr.dlid = self.real_lid(attr.alt_ah_attr.dlid)
        return real

    def apply_modify(self, qp: ShadowQP, attr: QPAttr, mask: int, record: bool) -> None:
        if record:
            self.track_path(qp)  # a migration since: the program's change applies to the paths as they are
        self.inner.modify_qp(qp.real, self.real_qp_attr(attr, mask), mask)
        if mask & v.IBV_QP_STATE:
            qp.state = int(attr.qp_state)
            if qp.state == int(v.IBV_QPS_RESET):
                qp.modifies.clear()
                qp.sends.clear()
                qp.recvs.clear()
                qp.ah, qp.alt_ah, qp.port_num, qp.alt_port_num, qp.mig_state = v.AHAttr(), v.AHAttr(), 0, 0, 0
                return
        if mask & v.IBV_QP_DEST_QPN:
            qp.dest_qp_num = attr.dest_qp_num
        self._note_paths(qp, attr, mask)
        if record and mask & v.IBV_QP_PATH_MIG_STATE and int(attr.path_mig_state) == int(v.IBV_MIG_MIGRATED):
            self.track_path(qp)  # a manual migration: done, or refused by the HCA (PATH_MIG_ERR, same path)
        if mask & v.IBV_QP_PATH_MTU:
            qp.mtu = 128 << int(attr.path_mtu)
        if mask & v.IBV_QP_SQ_PSN:
            qp.next_psn = attr.sq_psn & PSN_MASK
        if record:
            qp.modifies.append((copy_attr(attr), mask))

    @staticmethod
    def _note_paths(qp: ShadowQP, attr: QPAttr, mask: int) -> None:
        """The shadow's paths after a modify the real QP took."""
        if mask & v.IBV_QP_AV:
            qp.ah = copy_ah(attr.ah_attr)
        if mask & v.IBV_QP_PORT:
            qp.port_num = int(attr.port_num)
        if mask & v.IBV_QP_TIMEOUT:
            qp.timeout = int(attr.timeout)
        if mask & v.IBV_QP_PKEY_INDEX:
            qp.pkey_index = int(attr.pkey_index)
        if mask & v.IBV_QP_ALT_PATH:
            qp.alt_ah = copy_ah(attr.alt_ah_attr)
            qp.alt_port_num, qp.alt_timeout = int(attr.alt_port_num), int(attr.alt_timeout)
            qp.alt_pkey_index = int(attr.alt_pkey_index)
        if mask & v.IBV_QP_PATH_MIG_STATE and int(attr.path_mig_state) == int(v.IBV_MIG_REARM):
            qp.mig_state = int(v.IBV_MIG_REARM)  # the HCA arms it shortly (track_path sees ARMED)

    def track_path(self, qp: ShadowQP) -> bool:
        """Follow a migration the HCA made behind the program's back (a link failed while the alternate
        path was ARMED; or the peer migrated and this responder with it): swap the shadow's primary and
        alternate paths if the real QP is on the alternate one now.  Whether it was."""
        if not qp.alt_ah.dlid or qp.real is None:
            return False  # no alternate path was ever loaded: nothing to migrate to
        real, _ = self.inner.query_qp(qp.real, v.IBV_QP_PORT | v.IBV_QP_AV | v.IBV_QP_PATH_MIG_STATE)
        on = (int(real.port_num), int(real.ah_attr.dlid))
        migrated = on != (qp.port_num, self.real_lid(qp.ah.dlid)) and on == (
            qp.alt_port_num,
            self.real_lid(qp.alt_ah.dlid),
        )
        if migrated:
            _swap_paths(qp)
        qp.mig_state = int(real.path_mig_state)
        return migrated

    def track_paths(self) -> int:
        """`track_path` for every QP (at a checkpoint: the image records the paths QPs are really on)."""
        return sum(self.track_path(qp) for qp in self.registry.qps)

    def modify_qp(self, qp: ShadowQP, attr: QPAttr, mask: int) -> None:
        self.apply_modify(qp, attr, int(mask), record=True)

    def query_qp(self, qp: ShadowQP, mask: int) -> Any:
        self.track_path(qp)
        attr, init = self.inner.query_qp(qp.real, mask)
        attr.dest_qp_num = qp.dest_qp_num
        attr.ah_attr, attr.alt_ah_attr = copy_ah(qp.ah), copy_ah(qp.alt_ah)
        return attr, init

    # ------------------------------------------------------------------ AH
    def create_ah(self, pd: ShadowPD, attr: Any) -> ShadowAH:
        ah = ShadowAH(pd, attr)
        ah.real = self.inner.create_ah(pd.real, attr)
        self.registry.ahs.append(ah)
        return ah

    def destroy_ah(self, ah: ShadowAH) -> None:
        self.inner.destroy_ah(ah.real)
        self.registry.forget(ah)


def _swap_paths(qp: ShadowQP) -> None:
    """The alternate path becomes the primary one and the primary the alternate, as in the HCA's migration."""
    qp.ah, qp.alt_ah = qp.alt_ah, qp.ah
    qp.port_num, qp.alt_port_num = qp.alt_port_num, qp.port_num
    qp.timeout, qp.alt_timeout = qp.alt_timeout or qp.timeout, qp.timeout
    qp.pkey_index, qp.alt_pkey_index = qp.alt_pkey_index, qp.pkey_index


def copy_ah(ah: Any) -> Any:
    from dataclasses import replace

    return replace(ah) if ah is not None else v.AHAttr()


def copy_attr(attr: QPAttr) -> QPAttr:
    from dataclasses import replace

    return replace(attr, ah_attr=copy_ah(attr.ah_attr), alt_ah_attr=copy_ah(attr.alt_ah_attr))
