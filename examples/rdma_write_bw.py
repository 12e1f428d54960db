"""RDMA WRITE bandwidth over one RC queue pair, after perftest's ib_write_bw, on the simib fabric.

    python examples/rdma_write_bw.py [OPTIONS]           # server: exposes a buffer, waits for one client
    python examples/rdma_write_bw.py [OPTIONS] HOST      # client: writes into the server's buffer
    python examples/rdma_write_bw.py [OPTIONS] --pair    # both in one command: forks the server as a child

Options: -s SIZE (default 65536 bytes per WRITE), -n ITERS (5000), -t TX_DEPTH (128 WRs outstanding),
-Q CQ_MOD (a signaled WR every 100; capped at TX_DEPTH), -p PORT (18515; 0 = any free port),
-d DEVICE (simib0), -i IB_PORT (1), -m MTU (1024).

The two sides trade LID, QP number, start PSN, rkey and buffer address over a TCP socket and bring
their QPs to RTS.  The client then keeps up to TX_DEPTH RDMA WRITEs of SIZE bytes in flight, asks
for a completion on every CQ_MOD-th (an RC completion also retires every WR before it), and prints
perftest's summary line: bytes, iterations, average bandwidth in MB/s (MB = 2^20 bytes, as
perftest) and message rate in Mpps.  The server's CPU takes no part in the transfer: its simulated
HCA places the data.  Afterwards the server checks that its buffer holds the client's pattern.

Fabric: as examples/rc_pingpong.py -- $CKPT_FABRIC / $CKPT_FABRIC_TOKEN when set; otherwise the
server starts a subnet manager and prints them for the client; `--pair` does it all in one command.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
from pathlib import Path

import numpy as np

from ckpt import verbs as v

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so that `python -P` finds the shared module too
import _verbs_example as ex

#: "LLLL:QQQQQQ:PPPPPP:RRRRRRRR:VVVVVVVVVVVVVVVV" and a NUL.
MSG_SIZE = 4 + 1 + 6 + 1 + 6 + 1 + 8 + 1 + 16 + 1
RULE = "-" * 87
PAIR_TIMEOUT = 300.0


class WriteBwError(ex.ExampleError):
    """A step of the test failed; the message says which."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ex.new_parser(__doc__)
    parser.add_argument("-s", "--size", type=ex.number, default=65536, help="bytes per RDMA WRITE")
    parser.add_argument("-n", "--iters", type=ex.number, default=5000, help="number of WRITEs")
    parser.add_argument("-t", "--tx-depth", type=ex.number, default=128, help="WRITEs in flight")
    parser.add_argument("-Q", "--cq-mod", type=ex.number, default=100, help="a signaled WRITE every CQ_MOD")
    args = ex.parse(parser, argv)
    if min(args.size, args.iters, args.tx_depth, args.cq_mod) < 1:
        parser.error("out-of-range option (size, iters, tx-depth, cq-mod >= 1)")
    args.cq_mod = min(args.cq_mod, args.tx_depth)  # as perftest: otherwise the queue fills before a signal
    return args


# ----------------------------------------------------------- verbs resources
class WriteBwContext:
    """Device, PD, one SIZE-byte MR, a CQ and an RC QP in INIT."""

    def __init__(self, args: argparse.Namespace, server: bool) -> None:
        self.args = args
        self.ctx = v.Context(name=args.ib_dev)
        self.pd = v.PD(self.ctx)
        if server:
            self.buf = np.zeros(args.size, dtype=np.uint8)
            access = v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE
        else:
            self.buf = pattern(args.size)
            access = v.IBV_ACCESS_LOCAL_WRITE
        self.mr = v.MR(self.pd, self.buf, access)
        self.cq = v.CQ(self.ctx, args.tx_depth + 1)
        cap = v.QPCap(max_send_wr=args.tx_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = v.QP(self.pd, init)
        attr = v.QPAttr(port_num=args.ib_port)
        attr.pkey_index = 0
        attr.qp_access_flags = access
        self.qp.to_init(attr)

    def connect(self, my_psn: int, dest: tuple[int, ...]) -> None:
        """INIT -> RTR -> RTS towards `dest` (lid, qpn, psn, rkey, vaddr)."""
        ex.connect_rc(self.qp, self.args.ib_port, self.args.mtu, my_psn, *dest[:3])

    def close(self) -> None:
        self.ctx.close()


def pattern(size: int) -> np.ndarray:
    """What the client writes and the server checks for."""
    return (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)


# ----------------------------------------------------------- out-of-band exchange
def encode_dest(lid: int, qpn: int, psn: int, rkey: int, vaddr: int) -> bytes:
    return f"{lid:04x}:{qpn:06x}:{psn:06x}:{rkey:08x}:{vaddr:016x}".encode() + b"\0"


def decode_dest(msg: bytes) -> tuple[int, ...]:
    try:
        fields = tuple(int(x, 16) for x in msg.rstrip(b"\0").decode().split(":"))
    except ValueError:
        fields = ()
    if len(fields) != 5:
        raise WriteBwError(f"bad address message from the peer: {msg!r}")
    return fields


def print_header(args: argparse.Namespace) -> None:
    print(RULE)
    print("                    RDMA_Write BW Test")
    print(f" Device         : {args.ib_dev:<12} Number of qps   : 1")
    print(f" Mtu            : {str(args.mtu) + '[B]':<12} Link type       : IB (simib)")
    print(f" TX depth       : {args.tx_depth:<12} CQ Moderation   : {args.cq_mod}")
    print(RULE)


def print_dest(which: str, dest: tuple[int, ...]) -> None:
    lid, qpn, psn, rkey, vaddr = dest
    print(f" {which} address: LID {lid:#06x} QPN {qpn:#08x} PSN {psn:#08x} RKey {rkey:#010x} VAddr {vaddr:#018x}")


# ----------------------------------------------------------- the two sides
def write_bw(wb: WriteBwContext, rkey: int, raddr: int) -> float:
    """Post ITERS writes, at most TX_DEPTH outstanding, a signaled one every CQ_MOD; the elapsed seconds."""
    args = wb.args
    iters, depth, cq_mod = args.iters, args.tx_depth, args.cq_mod
    wr = v.SendWR(opcode=v.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.SGE(wb.mr.buf, args.size, wb.mr.lkey)])
    wr.set_wr_rdma(rkey, raddr)
    post, poll = wb.qp.post_send, wb.cq.poll
    posted = completed = 0
    start = time.perf_counter()
    while completed < iters:
        while posted < iters and posted - completed < depth:
            wr.wr_id = posted
            last = posted % cq_mod == cq_mod - 1 or posted == iters - 1
            wr.send_flags = v.IBV_SEND_SIGNALED if last else 0
            post(wr)
            posted += 1
        _, wcs = poll(16)
        for wc in wcs:
            if wc.status != v.IBV_WC_SUCCESS:
                raise WriteBwError(
                    f"Failed status {v.ibv_wc_status(wc.status).name} ({wc.status}) for wr_id {wc.wr_id}"
                )
            completed = wc.wr_id + 1  # RC: a completion retires every WR posted before it
    return time.perf_counter() - start


def run_client(args: argparse.Namespace) -> None:
    wb = WriteBwContext(args, server=False)
    try:
        lid, psn = wb.ctx.query_port(args.ib_port).lid, random.getrandbits(24)
        mine = (lid, wb.qp.qp_num, psn, wb.mr.rkey, wb.mr.buf)
        print_header(args)
        print_dest("local", mine)
        with ex.connect_to_server(args.host, args.port) as sock:
            sock.sendall(encode_dest(*mine))
            dest = decode_dest(ex.recv_exactly(sock, MSG_SIZE))
            print_dest("remote", dest)
            print(RULE)
            wb.connect(psn, dest)
            seconds = write_bw(wb, rkey=dest[3], raddr=dest[4])
            sock.sendall(b"done\0")
            ex.recv_exactly(sock, len(b"done\0"))  # the server has checked its buffer
        print(" #bytes     #iterations    BW average[MB/sec]   MsgRate[Mpps]")
        mbs = args.size * args.iters / seconds / 2**20
        print(f" {args.size:<10} {args.iters:<14} {mbs:<20.2f} {args.iters / seconds / 1e6:.6f}")
        print(RULE, flush=True)
    finally:
        wb.close()


def run_server(args: argparse.Namespace) -> None:
    listener = socket.create_server((ex.LISTEN_HOST, args.port))
    wb = WriteBwContext(args, server=True)
    try:
        lid, psn = wb.ctx.query_port(args.ib_port).lid, random.getrandbits(24)
        mine = (lid, wb.qp.qp_num, psn, wb.mr.rkey, wb.mr.buf)
        print_header(args)
        print_dest("local", mine)
        print(f"{ex.LISTENING}{ex.LISTEN_HOST} port {listener.getsockname()[1]}", flush=True)
        conn, _ = listener.accept()
        listener.close()
        with conn:
            conn.settimeout(30)
            dest = decode_dest(ex.recv_exactly(conn, MSG_SIZE))
            wb.connect(psn, dest)
            conn.sendall(encode_dest(*mine))
            print_dest("remote", dest)
            print(RULE, flush=True)
            conn.settimeout(None)  # the client writes for as long as ITERS takes
            ex.recv_exactly(conn, len(b"done\0"))
            intact = np.array_equal(wb.buf, pattern(args.size))
            conn.sendall(b"done\0")
        if not intact:
            raise WriteBwError(f"data check failed: the buffer does not hold the client's {args.size}-byte pattern")
        print(f" data check     : the {args.size} bytes the client wrote arrived intact", flush=True)
    finally:
        wb.close()
        listener.close()


def run(args: argparse.Namespace) -> None:
    if args.host is None:
        run_server(args)
    else:
        run_client(args)


def main(argv: list[str] | None = None) -> int:
    return ex.main(__file__, parse_args, run, argv, pair_timeout=PAIR_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
