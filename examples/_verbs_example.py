"""What the verbs examples share, as rdma-core's examples share pingpong.c: options, RC connection, fabric, --pair.

An example imports this module by putting its own folder on sys.path first, so that it runs the same
as `python examples/NAME.py` and as `python -P examples/NAME.py` (which leaves the script's folder out).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable

from ckpt import verbs as v
from ckpt.verbs import fabric

MTUS = {256: v.IBV_MTU_256, 512: v.IBV_MTU_512, 1024: v.IBV_MTU_1024, 2048: v.IBV_MTU_2048, 4096: v.IBV_MTU_4096}
LISTEN_HOST = "127.0.0.1"
#: What a server prints once it listens; `--pair` reads the port from the end of this line.
LISTENING = "waiting for a client on "


class ExampleError(Exception):
    """A step of an example failed; the message says which."""


def number(text: str) -> int:
    """An integer option as strtoul(..., 0) reads it: 0x.. and 0.. too."""
    return int(text, 0)


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the options every example has: HOST, -p, -d, -i, -m and --pair."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("host", nargs="?", help="server to connect to (none: be the server)")
    parser.add_argument("-p", "--port", type=number, default=18515, help="listen on / connect to PORT")
    parser.add_argument("-d", "--ib-dev", default="simib0", help="device name (default simib0)")
    parser.add_argument("-i", "--ib-port", type=number, default=1, help="port of the device (default 1)")
    parser.add_argument("-m", "--mtu", type=number, default=1024, choices=sorted(MTUS), help="path MTU")
    parser.add_argument("--pair", action="store_true", help="fork the server as a child and be its client")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`, checking the options of `new_parser` (the example checks its own)."""
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535 or args.ib_port < 1:
        parser.error("out-of-range option (port 0..65535, ib-port >= 1)")
    if args.pair and args.host:
        parser.error("--pair runs both sides on this host: give no HOST")
    return args


# ----------------------------------------------------------- the RC connection
def connect_rc(qp: v.QP, ib_port: int, mtu: int, my_psn: int, lid: int, qpn: int, psn: int) -> None:
    """INIT -> RTR -> RTS towards the QP `qpn` at `lid` starting at `psn`, with pp_connect_ctx's attributes."""
    attr = v.QPAttr()
    attr.path_mtu = MTUS[mtu]
    attr.dest_qp_num = qpn
    attr.rq_psn = psn
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.ah_attr = v.AHAttr(dlid=lid, sl=0, src_path_bits=0, port_num=ib_port, is_global=0)
    qp.to_rtr(attr)
    attr = v.QPAttr()
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.sq_psn = my_psn
    attr.max_rd_atomic = 1
    qp.to_rts(attr)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes of the out-of-band socket, or ExampleError if the peer closes it first."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ExampleError(f"the peer closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def connect_to_server(host: str, port: int) -> socket.socket:
    """The client's out-of-band socket to the server."""
    try:
        return socket.create_connection((host, port), timeout=30)
    except OSError as exc:
        raise ExampleError(f"Couldn't connect to {host}:{port}: {exc}") from None


# ----------------------------------------------------------- the fabric, and --pair
def own_fabric() -> fabric.SubnetManager:
    """Start a subnet manager in this process and point this process (and its children) at it."""
    sm = fabric.SubnetManager().start()
    os.environ[fabric.ENV_ADDRESS], os.environ[fabric.ENV_TOKEN] = sm.address, sm.token
    return sm


def run_pair(
    script: str, run: Callable[[argparse.Namespace], None], args: argparse.Namespace, argv: list[str], timeout: float
) -> int:
    """Start a fabric, fork `script` as the server on a free port, `run` the client against it, relay the
    server's output; the server gets `timeout` seconds to finish after the client."""
    sm = own_fabric()
    server_argv = [a for a in argv if a != "--pair"] + ["-p", "0"]  # the last -p wins
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(script), *server_argv], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        lines = []
        for line in server.stdout:
            lines.append(line)
            if line.startswith(LISTENING):
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
        except (ExampleError, v.PyverbsError, OSError) as exc:
            print(exc, file=sys.stderr)
            status = 1
        rest, _ = server.communicate(timeout=timeout)
        sys.stdout.write("".join(f"server: {line}" for line in [*lines, *rest.splitlines(True)]))
        return status or (1 if server.returncode else 0)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        sm.stop()


def main(
    script: str,
    parse_args: Callable[[list[str]], argparse.Namespace],
    run: Callable[[argparse.Namespace], None],
    argv: list[str] | None = None,
    *,
    pair_timeout: float,
) -> int:
    """An example's main: `run` the server (no HOST) or the client, or both with --pair; the exit status.

    Without $CKPT_FABRIC a server starts a fabric of its own and prints the variables a client needs.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.pair:
        return run_pair(script, run, args, argv, pair_timeout)
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
    except (ExampleError, v.PyverbsError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        if sm is not None:
            sm.stop()
    return 0
