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
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ckpt import verbs as v
from ckpt.verbs import fabric

RECV_WRID, SEND_WRID = 1, 2
MTUS = {256: v.IBV_MTU_256, 512: v.IBV_MTU_512, 1024: v.IBV_MTU_1024, 2048: v.IBV_MTU_2048, 4096: v.IBV_MTU_4096}
#: The address message of ibv_rc_pingpong: sizeof "0000:000000:000000:" + 32 hex GID digits + NUL.
MSG_SIZE = 52
LISTEN_HOST = "127.0.0.1"
PAIR_TIMEOUT = 120.0


class PingPongError(Exception):
    """A step of the test failed; the message says which."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    number = lambda text: int(text, 0)  # noqa: E731  (strtoul(..., 0): 0x.. and 0.. too)
    parser.add_argument("host", nargs="?", help="server to connect to (none: be the server)")
    parser.add_argument("-p", "--port", type=number, default=18515, help="listen on / connect to PORT")
    parser.add_argument("-d", "--ib-dev", default="simib0", help="device name (default simib0)")
    parser.add_argument("-i", "--ib-port", type=number, default=1, help="port of the device (default 1)")
    parser.add_argument("-s", "--size", type=number, default=4096, help="size of message to exchange")
    parser.add_argument("-m", "--mtu", type=number, default=1024, choices=sorted(MTUS), help="path MTU")
    parser.add_argument("-r", "--rx-depth", type=number, default=500, help="receives to post at a time")
    parser.add_argument("-n", "--iters", type=number, default=1000, help="number of exchanges")
    parser.add_argument("-e", "--events", action="store_true", help="sleep on CQ events (default poll)")
    parser.add_argument("--pair", action="store_true", help="fork the server as a child and be its client")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535 or args.ib_port < 1 or args.size < 1 or args.iters < 1 or args.rx_depth < 2:
        parser.error("out-of-range option (port 0..65535, ib-port >= 1, size >= 1, iters >= 1, rx-depth >= 2)")
    if args.pair and args.host:
        parser.error("--pair runs both sides on this host: give no HOST")
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
        """INIT -> RTR -> RTS towards `dest` (lid, qpn, psn), with pp_connect_ctx's attributes."""
        lid, qpn, psn = dest
        attr = v.QPAttr()
        attr.path_mtu = MTUS[mtu]
        attr.dest_qp_num = qpn
        attr.rq_psn = psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.ah_attr = v.AHAttr(dlid=lid, sl=0, src_path_bits=0, port_num=self.ib_port, is_global=0)
        self.qp.to_rtr(attr)
        attr = v.QPAttr()
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = my_psn
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)

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


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise PingPongError(f"the peer closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def client_exchange(host: str, port: int, mine: bytes) -> tuple[int, int, int]:
    try:
        sock = socket.create_connection((host, port), timeout=30)
    except OSError as exc:
        raise PingPongError(f"Couldn't connect to {host}:{port}: {exc}") from None
    with sock:
        sock.sendall(mine)
        dest = decode_dest(recv_exactly(sock, MSG_SIZE))
        sock.sendall(b"done\0")
    return dest


def server_exchange(listener: socket.socket, pp: PingPongContext, my_psn: int, mtu: int, mine: bytes) -> Any:
    """Accept one client, read its address, connect the QP (so it is in RTR before the client can send), reply."""
    conn, _ = listener.accept()
    listener.close()
    with conn:
        conn.settimeout(30)
        dest = decode_dest(recv_exactly(conn, MSG_SIZE))
        pp.connect(my_psn, mtu, dest)
        conn.sendall(mine)
        recv_exactly(conn, len(b"done\0"))
    return dest


# ----------------------------------------------------------- the test
def ping_pong(pp: PingPongContext, iters: int, is_client: bool, routs: int) -> float:
    """Bounce messages until ITERS sends and ITERS receives completed; the elapsed seconds."""
    pending = RECV_WRID
    if is_client:
        pp.qp.post_send(pp.send_wr)
        pending |= SEND_WRID
    num_cq_events = 0
    if pp.channel is not None:
        pp.cq.req_notify()
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
        listener = socket.create_server((LISTEN_HOST, args.port), reuse_port=False)
    pp = PingPongContext(args)
    try:
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
            print(f"waiting for a client on {LISTEN_HOST} port {listener.getsockname()[1]}", flush=True)
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


# ----------------------------------------------------------- the fabric, and --pair
def own_fabric() -> fabric.SubnetManager:
    """Start a subnet manager in this process and point this process (and its children) at it."""
    sm = fabric.SubnetManager().start()
    os.environ[fabric.ENV_ADDRESS], os.environ[fabric.ENV_TOKEN] = sm.address, sm.token
    return sm


def run_pair(args: argparse.Namespace, argv: list[str]) -> int:
    """Start a fabric, fork the server on a free port, run the client against it, relay the server's output."""
    sm = own_fabric()
    server_argv = [a for a in argv if a != "--pair"] + ["-p", "0"]  # the last -p wins
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *server_argv], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        lines = []
        for line in server.stdout:
            lines.append(line)
            if line.startswith("waiting for a client on "):
                args.port = int(line.split()[-1])
                break
        else:
            server.wait(timeout=10)
            sys.stdout.write("".join(f"server: {line}" for line in lines))
            print(f"the server exited ({server.returncode}) before listening", file=sys.stderr)
            return 1
        args.host = LISTEN_HOST
        status = 0
        try:
            run(args)
        except (PingPongError, v.PyverbsError, OSError) as exc:
            print(exc, file=sys.stderr)
            status = 1
        rest, _ = server.communicate(timeout=PAIR_TIMEOUT)
        sys.stdout.write("".join(f"server: {line}" for line in [*lines, *rest.splitlines(True)]))
        return status or (1 if server.returncode else 0)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        sm.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.pair:
        return run_pair(args, argv)
    sm = None
    if not os.environ.get(fabric.ENV_ADDRESS):
        if args.host is not None:
            print(
                f"no fabric: set {fabric.ENV_ADDRESS} and {fabric.ENV_TOKEN} to the server's fabric "
                "(the server prints them), or use --pair",
                file=sys.stderr,
            )
            return 1
        sm = own_fabric()
        print(f"fabric: {fabric.ENV_ADDRESS}={sm.address} {fabric.ENV_TOKEN}={sm.token}")
    try:
        run(args)
    except (PingPongError, v.PyverbsError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        if sm is not None:
            sm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
