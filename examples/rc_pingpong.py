"""Send/receive ping-pong over one RC queue pair, after rdma-core's ibv_rc_pingpong, on the simib fabric.

    python examples/rc_pingpong.py [OPTIONS]           # server: waits for one client on -p PORT
    python examples/rc_pingpong.py [OPTIONS] HOST      # client: connects to the server at HOST
    python examples/rc_pingpong.py [OPTIONS] --pair    # both in one command: forks the server as a child

Options: -p PORT (default 18515; 0 = any free port), -d DEVICE (default simib0), -i IB_PORT (1), -s SIZE
(4096 bytes), -m MTU (1024), -r RX_DEPTH (500), -n ITERS (1000), -e (sleep on CQ events instead of polling).

As with the original, the two sides trade their LID, QP number and start PSN over a TCP socket (the
message ``LLLL:QQQQQQ:PPPPPP:GGGG...`` in hex, NUL-terminated), bring their QPs to RTS, and then
bounce SIZE-byte SENDs ITERS times.  Each side prints its local and remote address and the
throughput and time per iteration it saw.

Both sides must be on the same simulated fabric.  A process uses the fabric named by $CKPT_FABRIC
(with $CKPT_FABRIC_TOKEN), e.g. one from `ckpt fabric start`.  A server with no $CKPT_FABRIC
starts a subnet manager of its own and prints the two variables the client needs; `--pair` does
all of that in one command.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ckpt import verbs as v

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so that `python -P` finds the shared module too
import _verbs_example as ex

RECV_WRID, SEND_WRID = 1, 2
#: The address message of ibv_rc_pingpong: sizeof "0000:000000:000000:" + 32 hex GID digits + NUL.
MSG_SIZE = 52
PAIR_TIMEOUT = 120.0


class PingPongError(ex.ExampleError):
    """A step of the test failed; the message says which."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ex.new_parser(__doc__)
    parser.add_argument("-s", "--size", type=ex.number, default=4096, help="size of message to exchange")
    parser.add_argument("-r", "--rx-depth", type=ex.number, default=500, help="receives to post at a time")
    parser.add_argument("-n", "--iters", type=ex.number, default=1000, help="number of exchanges")
    parser.add_argument("-e", "--events", action="store_true", help="sleep on CQ events (default poll)")
    args = ex.parse(parser, argv)
    if args.size < 1 or args.iters < 1 or args.rx_depth < 2:
        parser.error("out-of-range option (size >= 1, iters >= 1, rx-depth >= 2)")
    return args


# ----------------------------------------------------------- verbs resources
class PingPongContext:
    """Device, PD, MR, CQ and an RC QP in INIT, as pp_init_ctx sets them up."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.size, self.rx_depth, self.ib_port = args.size, args.rx_depth, args.ib_port
        self.ctx = v.Context(name=args.ib_dev)
        self.channel = v.CompChannel(self.ctx) if args.events else None
        self.pd = v.PD(self.ctx)
        self.buf = np.full(self.size, 0x7B, dtype=np.uint8)
        self.mr = v.MR(self.pd, self.buf, v.IBV_ACCESS_LOCAL_WRITE)
        self.cq = v.CQ(self.ctx, self.rx_depth + 1, None, self.channel, 0)
        cap = v.QPCap(max_send_wr=1, max_recv_wr=self.rx_depth, max_send_sge=1, max_recv_sge=1)
        self.qp = v.QP(self.pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.send_flags = v.IBV_SEND_SIGNALED
        _, init_attr = self.qp.query(v.IBV_QP_CAP)
        if init_attr.cap.max_inline_data >= self.size:
            self.send_flags |= v.IBV_SEND_INLINE
        attr = v.QPAttr(port_num=self.ib_port)
        attr.pkey_index = 0
        attr.qp_access_flags = 0
        self.qp.to_init(attr)
        sge = [v.SGE(self.mr.buf, self.size, self.mr.lkey)]
        self.recv_wr = v.RecvWR(wr_id=RECV_WRID, num_sge=1, sg=sge)
        self.send_wr = v.SendWR(wr_id=SEND_WRID, opcode=v.IBV_WR_SEND, num_sge=1, sg=sge, send_flags=self.send_flags)

    def post_recv(self, n: int) -> int:
        for i in range(n):
            try:
                self.qp.post_recv(self.recv_wr)
            except v.PyverbsError:
                return i
        return n

    def connect(self, my_psn: int, mtu: int, dest: tuple[int, int, int]) -> None:
        """INIT -> RTR -> RTS towards `dest` (lid, qpn, psn)."""
        ex.connect_rc(self.qp, self.ib_port, mtu, my_psn, *dest)

    def close(self) -> None:
        self.ctx.close()


# ----------------------------------------------------------- out-of-band address exchange
def encode_dest(lid: int, qpn: int, psn: int) -> bytes:
    text = f"{lid:04x}:{qpn:06x}:{psn:06x}:{0:032x}"  # simib routes by LID: the GID is left zero, as with -g unset
    return text.encode() + b"\0"


def decode_dest(msg: bytes) -> tuple[int, int, int]:
    try:
        lid, qpn, psn, _gid = msg.rstrip(b"\0").decode().split(":")
        return int(lid, 16), int(qpn, 16), int(psn, 16)
    except ValueError:
        raise PingPongError(f"bad address message from the peer: {msg!r}") from None


def client_exchange(host: str, port: int, mine: bytes) -> tuple[int, int, int]:
    with ex.connect_to_server(host, port) as sock:
        sock.sendall(mine)
        dest = decode_dest(ex.recv_exactly(sock, MSG_SIZE))
        sock.sendall(b"done\0")
    return dest


def server_exchange(listener: socket.socket, pp: PingPongContext, my_psn: int, mtu: int, mine: bytes) -> Any:
    """Accept one client, read its address, connect the QP (so it is in RTR before the client can send), reply."""
    conn, _ = listener.accept()
    listener.close()
    with conn:
        conn.settimeout(30)
        dest = decode_dest(ex.recv_exactly(conn, MSG_SIZE))
        pp.connect(my_psn, mtu, dest)
        conn.sendall(mine)
        ex.recv_exactly(conn, len(b"done\0"))
    return dest


# ----------------------------------------------------------- the test
def ping_pong(pp: PingPongContext, iters: int, is_client: bool, routs: int) -> float:
    """Bounce messages until ITERS sends and ITERS receives completed; the elapsed seconds."""
    pending = RECV_WRID
    if is_client:
        pp.qp.post_send(pp.send_wr)
        pending |= SEND_WRID
    num_cq_events = 0  # (the CQ was armed before any receive was posted: `run`)
    rcnt = scnt = 0
    start = time.perf_counter()
    while rcnt < iters or scnt < iters:
        if pp.channel is not None:
            pp.channel.get_cq_event(pp.cq)
            num_cq_events += 1
            pp.cq.req_notify()
        n, wcs = pp.cq.poll(2)
        for wc in wcs[:n]:
            if wc.status != v.IBV_WC_SUCCESS:
                raise PingPongError(
                    f"Failed status {v.ibv_wc_status(wc.status).name} ({wc.status}) for wr_id {wc.wr_id}"
                )
            if wc.wr_id == SEND_WRID:
                scnt += 1
            elif wc.wr_id == RECV_WRID:
                routs -= 1
                if routs <= 1:
                    routs += pp.post_recv(pp.rx_depth - routs)
                    if routs < pp.rx_depth:
                        raise PingPongError(f"Couldn't post receive ({routs})")
                rcnt += 1
            else:
                raise PingPongError(f"Completion for unknown wr_id {wc.wr_id}")
            pending &= ~wc.wr_id
            if scnt < iters and not pending:
                pp.qp.post_send(pp.send_wr)
                pending = RECV_WRID | SEND_WRID
    elapsed = time.perf_counter() - start
    if num_cq_events:
        pp.cq.ack_events(num_cq_events)
    return elapsed


def report(size: int, iters: int, seconds: float) -> None:
    usec = seconds * 1e6
    nbytes = size * iters * 2
    print(f"{nbytes} bytes in {seconds:.2f} seconds = {nbytes * 8 / usec:.2f} Mbit/sec")
    print(f"{iters} iters in {seconds:.2f} seconds = {usec / iters:.2f} usec/iter", flush=True)


def run(args: argparse.Namespace) -> None:
    listener = None
    if args.host is None:  # bind before the QP exists, so a taken port fails first and cheaply
        listener = socket.create_server((ex.LISTEN_HOST, args.port), reuse_port=False)
    pp = PingPongContext(args)
    try:
        if pp.channel is not None:
            # armed before the first receive is posted, as ibv_rc_pingpong does: the peer may send as soon as
            # the addresses are exchanged, and a completion that lands before the CQ is armed raises no event
            # -- both sides would then wait in get_cq_event for good
            pp.cq.req_notify()
        routs = pp.post_recv(pp.rx_depth)
        if routs < pp.rx_depth:
            raise PingPongError(f"Couldn't post receive ({routs})")
        port_attr = pp.ctx.query_port(args.ib_port)
        if not port_attr.lid:
            raise PingPongError("Couldn't get local LID")
        qpn, psn = pp.qp.qp_num, random.getrandbits(24)
        print(f"  local address:  LID 0x{port_attr.lid:04x}, QPN 0x{qpn:06x}, PSN 0x{psn:06x}, GID ::")
        mine = encode_dest(port_attr.lid, qpn, psn)
        if listener is not None:
            print(f"{ex.LISTENING}{ex.LISTEN_HOST} port {listener.getsockname()[1]}", flush=True)
            dest = server_exchange(listener, pp, psn, args.mtu, mine)
        else:
            dest = client_exchange(args.host, args.port, mine)
        print(f"  remote address: LID 0x{dest[0]:04x}, QPN 0x{dest[1]:06x}, PSN 0x{dest[2]:06x}, GID ::")
        if listener is None:
            pp.connect(psn, args.mtu, dest)
        report(args.size, args.iters, ping_pong(pp, args.iters, listener is None, routs))
    finally:
        pp.close()
        if listener is not None:
            listener.close()


def main(argv: list[str] | None = None) -> int:
    return ex.main(__file__, parse_args, run, argv, pair_timeout=PAIR_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
