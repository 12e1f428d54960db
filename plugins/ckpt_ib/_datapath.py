"""The data path of the wrapped table: work requests logged and posted under the plugin's IDs, completions
translated back (`Virtualizer` inherits it)."""

# Every real send WR is posted with the plugin's own wr_id (a sequence
# number).  It is SIGNALED when the program asked for a completion, and always
# for RDMA READs and atomics (their result lands at this end: only their
# completion says it has).  An unsignaled WR leaves the log when a later
# WR's completion is polled (RC completes in order, as on hardware), or at
# DRAIN when the peer's rq_psn shows it landed.  Signaling everything would
# make the log trivially exact, but costs an ACK per message and a hidden
# completion that wakes the program's poll: 1.17-1.6 x the native round trip.
#
# Receive WRs are logged the same way, under a sequence number per QP or SRQ,
# and local addresses are translated by lkey (docs/ib.md: after a restart the
# same buffer lives elsewhere).  This is the hot path: every post and poll of
# the program goes through it (docs/benchmarks.md, "Verbs virtualization").

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from ckpt import verbs as v
from ckpt.verbs import SGE, WC, RecvWR, SendWR
from ckpt_ib._shadows import RecvEntry, Registry, SendEntry, ShadowCQ, ShadowMR, ShadowQP, ShadowSRQ

PSN_MASK = 0xFFFFFF
_SIGNALED = int(v.IBV_SEND_SIGNALED)
_INLINE = int(v.IBV_SEND_INLINE)
_RECV = int(v.IBV_WC_RECV)
_OK = int(v.IBV_WC_SUCCESS)
_ATOMICS = (int(v.IBV_WR_ATOMIC_CMP_AND_SWP), int(v.IBV_WR_ATOMIC_FETCH_AND_ADD))
_RD_ATOMIC = (int(v.IBV_WR_RDMA_READ), *_ATOMICS)
_UC = int(v.IBV_QPT_UC)


class DataPath:
    """Posting and polling through the logs (a mixin of `Virtualizer`, whose state it uses)."""

    inner: Any  # the provider's table as it was before wrapping
    registry: Registry
    qp_by_real: dict[int, ShadowQP]
    mr_by_lkey: dict[int, ShadowMR]
    scratch: dict[int, Any]  # id(shadow QP) -> staging memory for re-posting inline WRs

    if TYPE_CHECKING:

        def real_key(self, vrkey: int) -> tuple[int, int]: ...

    def local_sge(self, sge: tuple[int, int, int], inline: bool = False) -> SGE:
        addr, length, lkey = sge
        mr = self.mr_by_lkey.get(lkey)
        if mr is None and inline:
            mr = self.mr_holding(addr, length)  # inline data is found by address; its lkey is not checked
        if mr is None:
            return SGE(addr, length, 0)  # an unknown lkey stays invalid: LOC_PROT_ERR, as on hardware
        return SGE(addr + mr.delta, length, mr.real_lkey)

    def mr_holding(self, addr: int, length: int) -> ShadowMR | None:
        """The region whose virtual range holds [addr, addr + length)."""
        return next((m for m in self.registry.mrs if m.addr <= addr and addr + length <= m.addr + m.length), None)

    def poll_cq(self, cq: ShadowCQ, num_entries: int) -> list[WC]:
        """Principle 5: drained completions first, then the real CQ's, without the ones nobody asked for."""
        out: list[WC] = []
        private = cq.private
        while private and len(out) < num_entries:
            out.append(private.popleft())
        if len(out) < num_entries:
            for wc in self.inner.poll_cq(cq.real, max(num_entries - len(out), 16)):
                seen = self.translate(wc)
                if seen is not None:
                    (out if len(out) < num_entries else private).append(seen)
        return out

    def translate(self, wc: WC) -> WC | None:
        """A real completion as the program sees it, or None for a WR it posted unsignaled."""
        qp = self.qp_by_real.get(wc.qp_num)
        if qp is None:
            return wc
        if wc.opcode & _RECV:
            srq = qp.init.srq
            recvs = srq.recvs if srq is not None else qp.recvs
            recv = recvs.pop(wc.wr_id, None)
            if recv is None:
                return None
            wc.wr_id, wc.qp_num, wc.src_qp, wc.slid = recv.wr_id, qp.qp_num, qp.dest_qp_num, qp.ah.dlid
            return wc
        sends, seq = qp.sends, wc.wr_id
        if not sends or not sends[0].seq <= seq <= sends[-1].seq:
            return None  # a stray (no WR of this QP's log)
        while sends[0].seq < seq:  # unsignaled WRs before it: RC completes in order, so they completed
            sends.popleft()
        if sends[0].seq != seq:
            return None
        send = sends.popleft()
        if not send.signaled and wc.status == _OK:
            return None
        wc.wr_id, wc.qp_num, wc.src_qp = send.wr_id, qp.qp_num, 0
        return wc

    def post_srq_recv(self, srq: ShadowSRQ, wr: Any) -> None:
        self.post_recvs(srq, wr, self.inner.post_srq_recv)

    def post_recvs(self, owner: ShadowQP | ShadowSRQ, wr: Any, post: Any) -> None:
        """Log a chain of receive WRs on a QP or SRQ and post it on the real one, under the plugin's wr_ids."""
        recvs = owner.recvs
        first_seq = owner.seq + 1
        reals = []
        while wr is not None:
            owner.seq += 1
            seq = owner.seq
            sg, real_sg = self.local_sges(wr, False)
            recvs[seq] = RecvEntry(seq, wr.wr_id, sg)
            reals.append(RecvWR(seq, len(real_sg), real_sg))
            wr = wr.next_wr
        try:
            post(owner.real, _linked(reals))
        except BaseException:
            for seq in range(first_seq, owner.seq + 1):
                recvs.pop(seq, None)
            raise

    def real_recv_chain(self, entries: list[RecvEntry]) -> RecvWR | None:
        first = None
        for entry in reversed(entries):
            sg = [self.local_sge(s) for s in entry.sg]
            first = RecvWR(wr_id=entry.seq, num_sge=len(sg), sg=sg, next_wr=first)
        return first

    def post_recv(self, qp: ShadowQP, wr: Any) -> None:
        self.post_recvs(qp, wr, self.inner.post_recv)

    def local_sges(self, wr: Any, inline: bool) -> tuple[list[tuple[int, int, int]], list[SGE]]:
        """A WR's SGEs as logged (virtual) and as the real WR takes them (`local_sge`)."""
        sg = _sges(wr)
        if len(sg) == 1:  # the common case, without a loop: this is on every post
            return sg, [self.local_sge(sg[0], inline)]
        return sg, [self.local_sge(s, inline) for s in sg]

    def post_send(self, qp: ShadowQP, wr: Any) -> None:
        """Log a chain of send WRs and post it on the real QP, each WR's log entry and real WR made in one pass.

        They are logged first: their completions may be polled (by another thread) before
        the real post returns.
        """
        init, mtu = qp.init, qp.mtu
        sig_all, uc = init.sq_sig_all, init.qp_type == _UC  # UC: no ACKs, only a completion says a WR has left
        entries, reals = [], []
        while wr is not None:
            qp.seq += 1
            flags, opcode = int(wr.send_flags), int(wr.opcode)
            inline = bool(flags & _INLINE)
            sg, real_sg = self.local_sges(wr, inline)
            signaled = bool(sig_all or flags & _SIGNALED)
            entry = SendEntry(
                qp.seq,
                wr.wr_id,
                opcode,
                flags,
                signaled,
                sg,
                int(wr.imm_data or 0),
                int(wr.rkey or 0),
                int(wr.remote_addr or 0),
                int(wr.compare_add or 0),
                int(wr.swap or 0),
                self.inline_bytes(sg) if inline else None,
                signaled or uc or opcode in _RD_ATOMIC,
            )
            entries.append(entry)
            reals.append(self.real_wr(entry, real_sg))
            wr = wr.next_wr
        self.post_real(qp, entries, _linked(reals), mtu)

    def post_entries(self, qp: ShadowQP, entries: list[SendEntry]) -> None:
        """Post send entries already logged (re-posted after a restart) on the real QP, with the plugin's wr_id."""
        scratch = self.scratch.get(id(qp))
        self.post_real(qp, entries, _linked([self.real_send_wr(entry, scratch) for entry in entries]), qp.mtu)

    def post_real(self, qp: ShadowQP, entries: list[SendEntry], first: SendWR | None, mtu: int) -> None:
        """Number `entries`' packets as the wire will, log them, then post their real chain `first`."""
        psn = qp.next_psn
        for entry in entries:
            if entry.opcode in _ATOMICS:
                entry.npkts = 1
            else:
                sg = entry.sg
                length = sg[0][1] if len(sg) == 1 else sum(s[1] for s in sg)
                entry.npkts = max(1, -(-length // mtu))
            entry.psn, psn = psn, (psn + entry.npkts) & PSN_MASK
        qp.sends.extend(entries)
        try:
            self.inner.post_send(qp.real, first)
        except BaseException:
            for _ in entries:  # refused as a whole (the provider checks a chain before queueing it)
                qp.sends.pop()
            raise
        qp.next_psn = psn

    def real_send_wr(self, entry: SendEntry, scratch: Any) -> SendWR:
        if entry.inline is not None and scratch is not None:
            sg = [scratch.stage(entry.inline)]  # a re-post after restart: the bytes captured at post time
        else:
            inline = bool(entry.flags & _INLINE)
            sg = [self.local_sge(s, inline) for s in entry.sg]
        return self.real_wr(entry, sg)

    def real_wr(self, entry: SendEntry, sg: list[SGE]) -> SendWR:
        """The real WR of a logged one, on the real SGEs `sg`."""
        flags = (entry.flags & ~_SIGNALED) | (_SIGNALED if entry.real_signaled else 0)
        real = SendWR(entry.seq, entry.opcode, len(sg), entry.imm, sg, flags)
        if entry.rkey or entry.raddr:
            rkey, delta = self.real_key(entry.rkey)
            real.rkey, real.remote_addr = rkey, entry.raddr + delta
            real.compare_add, real.swap = entry.compare_add, entry.swap
        return real

    def inline_bytes(self, sg: list[tuple[int, int, int]]) -> bytes:
        parts = []
        for addr, length, lkey in sg:
            mr = self.mr_by_lkey.get(lkey) or self.mr_holding(addr, length)
            if mr is not None and mr.memory is not None:
                off = addr - mr.addr
                parts.append(bytes(mr.memory[off : off + length]))
        return parts[0] if len(parts) == 1 else b"".join(parts)


def _linked(wrs: list[Any]) -> Any:
    """Chain `wrs` through ``next_wr`` (one post, one doorbell); the first, or None for none."""
    for wr, following in itertools.pairwise(wrs):
        wr.next_wr = following
    return wrs[0] if wrs else None


def _sges(wr: Any) -> list[tuple[int, int, int]]:
    """A WR's SGEs as (addr, length, lkey) tuples (no more than it has, whatever its num_sge says)."""
    given = wr.sg
    n = wr.num_sge or len(given)
    if n == 1 and given:
        s = given[0]
        return [(int(s.addr), int(s.length), int(s.lkey))]
    return [(int(s.addr), int(s.length), int(s.lkey)) for s in given[:n]]
