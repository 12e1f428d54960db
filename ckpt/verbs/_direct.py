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
    SendEntry,
)

NEEDS = {_WRITE: _REMOTE_WRITE, _READ: _REMOTE_READ, _CAS: _REMOTE_ATOMIC, _FAA: _REMOTE_ATOMIC}


def execute(qp: Any, entries: list[SendEntry]) -> bool:
    """Run `entries` (posted together on `qp`, lock held, nothing in flight) by direct placement.

    True: done, their completions queued.  False: nothing was done; post them as packets.
    """
    hca = qp.hca
    if qp.qp_type != _RC or qp.mig_announce or hca.latency or hca.bandwidth:
        return False
    port, dlid = qp._path()
    peer = hca.direct_peer(dlid)
    if peer is None or not hca.path_ok(port, dlid) or not peer.alive():
        return False
    rq = peer.qp(qp.dest_qp_num)
    if rq is None or rq[_shm.QP_STATE] != _RTS or rq[_shm.QP_DEST] != qp.qp_num or rq[_shm.QP_TYPE] != _RC:
        return False
    plan: list[tuple[SendEntry, memoryview, Any, int, int]] = []
    for entry in entries:
        op = entry.opcode
        need = NEEDS.get(op)
        if need is None or not rq[_shm.QP_ACCESS] & need:
            return False
        atomic = op in (_CAS, _FAA)
        length = 8 if atomic else entry.length
        if atomic and entry.raddr % 8:
            return False
        mr = peer.mr(entry.rkey)
        if mr is None or mr[_shm.MR_PD] != rq[_shm.QP_PD] or not mr[_shm.MR_ACCESS] & need:
            return False
        off = entry.raddr - mr[_shm.MR_ADDR]
        if off < 0 or off + length > mr[_shm.MR_LENGTH]:
            return False
        memory = peer.memory(mr)
        if memory is None:
            return False
        start = mr[_shm.MR_OFFSET] + off
        local: Any
        if entry.inline is not None:
            local = [entry.inline]
        else:
            local = qp._local_views(entry, write=op != _WRITE)
            if isinstance(local, int):  # a local protection error: the packet path reports it
                return False
        plan.append((entry, memory[0][start : start + length], local, memory[1], start))
    for entry, remote, local, fd, start in plan:
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
            with hca.atomic_lock:
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
        if entry.signaled:
            qp.scq.push(qp._send_wc(entry, _OK))
    hca.counts["direct_ops"] += len(plan)
    return True
