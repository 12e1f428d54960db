"""A responder in its own process for tests/test_verbs_direct.py, driven by JSON lines on stdin.

It opens a simib HCA on the fabric of $CKPT_FABRIC, makes an RC QP over 64 KiB
of memory of its own (`MR(pd, length)`: shared memory) and 4 KiB of private
memory (a bytearray), prints where they are, connects to the QP it is given,
then answers commands: ``dump`` (the first 64 bytes of each region, hex),
``psn`` (its QP's rq_psn), ``error`` (its QP to ERR), ``dereg`` (deregisters
the shared region), ``add N`` (N FETCH_AND_ADDs of 1 on its own shared cell at
offset 0, through a QP connected to itself: the packet path), ``connect QPN
LID`` (brings up a second QP on the same PD towards QPN), ``exit``.  The first
QP's destination LID is the one it is given (``dlid``), not necessarily the
requester's own.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from verbs_util import ACCESS_ALL, atomic_wr, bring_up, connect_self, poll_one

from ckpt import verbs as v


def main() -> None:
    ctx = v.Context(name="simib0")
    pd = v.PD(ctx)
    cq = v.CQ(ctx, 256)
    cap = v.QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=4, max_recv_sge=4)
    qp = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    second = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    shared = v.MR(pd, 1 << 16, ACCESS_ALL)
    private = bytearray(4096)
    private_mr = v.MR(pd, private, ACCESS_ALL)
    here = {
        "lid": int(ctx.query_port(1).lid),
        "qpn": qp.qp_num,
        "qpn2": second.qp_num,
        "addr": shared.buf,
        "rkey": shared.rkey,
        "private_addr": private_mr.buf,
        "private_rkey": private_mr.rkey,
        "pid": os.getpid(),
    }
    print(json.dumps(here), flush=True)
    peer = json.loads(sys.stdin.readline())
    bring_up(qp, peer["qpn"], peer["dlid"], timeout=8, retry_cnt=2)
    print("ready", flush=True)
    loop = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "dump":
            print(json.dumps([shared.read(64, 0).hex(), bytes(private[:64]).hex()]), flush=True)
        elif words[0] == "psn":
            print(qp.query(v.IBV_QP_RQ_PSN)[0].rq_psn, flush=True)
        elif words[0] == "dereg":
            shared.close()
            print("done", flush=True)
        elif words[0] == "connect":
            bring_up(second, int(words[1]), int(words[2]), timeout=8, retry_cnt=2)
            print("done", flush=True)
        elif words[0] == "error":
            attr = v.QPAttr()
            attr.qp_state = v.IBV_QPS_ERR
            qp.modify(attr, v.IBV_QP_STATE)
            print("done", flush=True)
        elif words[0] == "add":
            if loop is None:  # the shared region's own QP to itself, on its PD
                loop = connect_self(ctx, pd=pd, size=64)
            for _ in range(int(words[1])):
                loop.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, loop.sge(0, 8), shared.rkey, shared.buf, 1))
                wc = poll_one(loop.scq)
                assert wc.status == v.IBV_WC_SUCCESS, wc
            print("done", flush=True)
        elif words[0] == "exit":
            return


if __name__ == "__main__":
    main()
