"""A tcp verbs peer for tests/test_ib2tcp.py: one RC QP and 64 registered bytes, driven by JSON lines on stdin.

Prints {lid, qpn, rkey, addr}; reads the other side's {lid, qpn} and connects
(printing {"connected": true}); on "read", prints the 64 bytes.  Peers are
found through $CKPT_TCP_DIRECTORY.
"""

from __future__ import annotations

import json
import sys

import ckpt_ib2tcp
import numpy as np

from ckpt import verbs as v

ACCESS = v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE | v.IBV_ACCESS_REMOTE_READ


def say(message: dict[str, object]) -> None:
    print(json.dumps(message), flush=True)


def main() -> None:
    ckpt_ib2tcp.register()
    ctx = v.Context(name="tcp0")
    pd = v.PD(ctx)
    cq = v.CQ(ctx, 16)
    buf = np.zeros(64, dtype=np.uint8)
    mr = v.MR(pd, buf, ACCESS)
    qp = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq))
    say({"lid": ctx.query_port(1).lid, "qpn": qp.qp_num, "rkey": mr.rkey, "addr": mr.buf})
    other = json.loads(sys.stdin.readline())
    v.connect_rc(qp, other["lid"], other["qpn"], ACCESS)
    say({"connected": True})
    for line in sys.stdin:
        if line.strip() == "read":
            say({"bytes": [int(b) for b in buf]})


if __name__ == "__main__":
    main()
