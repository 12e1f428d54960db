"""Executing a chain of one-sided WRs in a same-host responder's shared memory (docs/verbs.md, "Direct placement")."""

# The rules are `_shm`'s: a chain goes direct only if every WR of it would
# succeed on the packet path, and then completes before post_send returns;
# otherwise all of it takes the packet path.

from __future__ import annotations

from typing import Any

import numpy as np

from ckpt.verbs import _shm
from ckpt.verbs._qpbase import (
    _CAS,
    _FAA,
    _OK,
    _RC,
    _READ,
    _REMOTE_ATOMIC,
    _REMOTE_READ,
    _REMOTE_WRITE,
    _RTS,
    _U64,
    _WRITE,
    PSN_MASK,
    SendEntry,
)

NEEDS = {_WRITE: _REMOTE_WRITE, _READ: _REMOTE_READ, _CAS: _REMOTE_ATOMIC, _FAA: _REMOTE_ATOMIC}


def execute(qp: Any, entries: list[SendEntry]) -> bool:
    """Run `entries` (posted together on `qp`, lock held, nothing in flight) by direct placement.

    True: done, their PSNs consumed, their completions queued.  False: nothing was done; post them as packets.
    """
    hca = qp.hca
    if qp.qp_type != _RC or qp.mig_announce or hca.latency or hca.bandwidth:
        return False
    port, dlid = qp.port_num, qp.ah.dlid
    peer = hca.direct_peer(dlid, entries)  # (alive: checked there)
    if peer is None or not hca.path_ok(port, dlid):
        return False
    peer.hold()  # the peer changes no row (no dereg, no modify) until the copies are done
    try:
        plan = _plan(qp, peer, entries)
        if plan is None:
            return False
        slot, todo = plan
        psns = 0
        for entry, remote, local, fd, start in todo:
            _run(entry, remote, local, fd, start)
            psns += entry.npkts
        peer.consumed(slot, psns)
    finally:
        peer.release()
    qp.sq_psn = (qp.sq_psn + psns) & PSN_MASK
    push, wc = qp.scq.push, qp._send_wc
    for entry, *_ in todo:
        if entry.signaled:
            push(wc(entry, _OK))
    hca.counts["direct_ops"] += len(todo)
    return True


_Step = tuple[SendEntry, memoryview, Any, int, int]


def _plan(qp: Any, peer: _shm.Peer, entries: list[SendEntry]) -> tuple[int, list[_Step]] | None:
    """(the responder QP's slot, per WR: the remote bytes, the local views, the memfd, the offset in it) if
    every WR would succeed on the packet path; None otherwise."""
    found = peer.qp(qp.dest_qp_num)
    if found is None:
        return None
    slot, rq = found
    link_up = qp.hca.link_up
    if rq[_shm.QP_STATE] != _RTS or rq[_shm.QP_DEST] != qp.qp_num or rq[_shm.QP_TYPE] != _RC:
        return None
    if not link_up.get(rq[_shm.QP_SLID], True) or not link_up.get(rq[_shm.QP_DLID], True):
        return None  # its responses could not come back
    todo: list[_Step] = []
    for entry in entries:
        op = entry.opcode
        need = NEEDS.get(op)
        if need is None or not rq[_shm.QP_ACCESS] & need:
            return None
        atomic = op in (_CAS, _FAA)
        length = 8 if atomic else entry.length
        if atomic and entry.raddr % 8:
            return None
        mr = peer.mr(entry.rkey)
        if mr is None or mr[_shm.MR_PD] != rq[_shm.QP_PD] or not mr[_shm.MR_ACCESS] & need:
            return None
        off = entry.raddr - mr[_shm.MR_ADDR]
        if off < 0 or off + length > mr[_shm.MR_LENGTH]:
            return None
        memory = peer.memory(mr)
        if memory is None:
            return None
        start = mr[_shm.MR_OFFSET] + off
        local: Any
        if entry.inline is not None:
            local = [entry.inline]
        else:
            local = qp._local_views(entry, write=op != _WRITE)
            if isinstance(local, int):  # a local protection error: the packet path reports it
                return None
        todo.append((entry, memory[0][start : start + length], local, memory[1], start))
    return slot, todo


def _run(entry: SendEntry, remote: memoryview, local: Any, fd: int, start: int) -> None:
    op = entry.opcode
    if op == _WRITE:
        pos = 0
        for view in local:
            n = len(view)
            remote[pos : pos + n] = view
            pos += n
    elif op == _READ:
        pos = 0
        for view in local:
            n = len(view)
            view[:] = remote[pos : pos + n]
            pos += n
    else:
        cell = np.frombuffer(remote, dtype=np.uint64)
        with _shm.atomics:
            _shm.cell_lock(fd, start, True)
            try:
                orig = int(cell[0])
                if op == _CAS:
                    if orig == entry.compare_add:
                        cell[0] = entry.swap
                else:
                    cell[0] = (orig + entry.compare_add) & _U64
            finally:
                _shm.cell_lock(fd, start, False)
        np.frombuffer(local[0], dtype=np.uint64)[0] = orig
