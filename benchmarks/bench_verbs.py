"""Benchmark a verbs provider's data path (simib, or ib2tcp's tcp) against raw TCP sockets between two processes."""

# Usage: python benchmarks/bench_verbs.py [--provider simib|tcp] [--repeat 5] [--stream-mib 256]
#                                         [--rtt-iters 2000] [--rate-msgs 20000] [--json FILE]
#
# One run, two processes: this one (the active side) and one child it starts
# (the passive side), both on one simib fabric whose subnet manager runs in
# this process -- or, with --provider tcp, on ib2tcp's tcp provider, the two
# HCAs finding each other through files in a temporary $CKPT_TCP_DIRECTORY.
# Between them: an RC queue pair (path MTU 4096, sq_sig_all=0) over 4 MiB
# registered buffers, and a plain TCP connection (TCP_NODELAY) for the
# baselines -- the targets are against it -- plus a Unix stream socket for the
# same baselines again (simib's HCAs on one machine link over Unix sockets:
# docs/verbs.md, "Same-host links"; so with simib "verbs / Unix" compares like
# with like, while the tcp provider always runs over TCP).  With simib, each
# process also opens a second HCA whose links are loopback TCP (as with
# CKPT_SIMIB_UNIX=0), measured in the same rotation: what the same-host links
# change, in the same run.  And a third HCA whose registered memory is shared
# (`ckpt.verbs.shared_array`, as `MR(pd, length)` allocates it), so its RDMA
# WRITEs are placed in the child's memory directly, with no packet (docs/verbs.md,
# "Direct placement"; its SENDs still take packets): "verbs_shm".  A second TCP connection carries the benchmark's own
# control messages and is never timed.  Each measurement is repeated --repeat
# times after one uncounted warm-up round, every kind going first in turn and
# the order reversed every other round; the medians are reported.
#
#   stream  RDMA WRITE of 4 MiB messages (up to 8 in flight, each signaled)
#           until --stream-mib MiB have been acknowledged (RC: placed in the
#           child's memory), against sendall of 4 MiB buffers that the child
#           recv_into's until it has them all and answers one byte.
#           Target: verbs / TCP bandwidth >= 0.9 (issue 15; it was 0.5).
#   rtt     8-byte ping-pong: each side posts a receive, sends 8 bytes (inline,
#           unsignaled but every 64th) and waits for its receive completion;
#           against 8-byte sendall / recv_into echoes.  Target: verbs / TCP
#           round-trip time <= 2.0.
#   rate    --rate-msgs RDMA WRITEs of 8, 16, 32, 64 bytes in turn, unsignaled
#           but every 64th, up to 512 in flight, the send CQ polled; one WR per
#           post_send, and again as 64-WR chains (one doorbell per chain);
#           against the same number of TCP sends of those sizes (one sendall
#           each) that the child reads in bulk.  Target, one WR per post:
#           verbs / TCP >= 0.5 (issue 15); the chains are context.
#
# --pin same|split puts every thread of both processes on one CPU (same), or this
# process on one CPU and the child on another (split; the first CPUs this
# process may use), after each warm-up (when
# every connection and its reader thread exists).  On a VM, waking a thread on
# another, idle vCPU costs tens of µs; on one CPU nothing waits for a wake-up,
# so `same` shows the Python cost of a round trip alone (docs/benchmarks.md).

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt import verbs as v
from ckpt.verbs import _links, _shm, fabric

BIG = 4 << 20
SMALL_SIZES = (8, 16, 32, 64)
STREAM_DEPTH = 8
SIGNAL_EVERY = 64
RATE_DEPTH = 512
SQ_DEPTH = 1024
RQ_DEPTH = 256
CASES = ("stream", "rtt", "rate", "rate_chained")
TARGETS = {"stream": (">=", 0.9), "rtt": ("<=", 2.0), "rate": (">=", 0.5)}  # issue 15's
ACCESS = v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE


class BenchError(Exception):
    """The benchmark could not run (a failed completion, a dead child)."""


# ----------------------------------------------------------- control channel
class Control:
    """JSON lines over a TCP connection: the parent's commands and the child's replies (never timed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("r")

    def send(self, **message: Any) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self) -> dict[str, Any]:
        line = self.reader.readline()
        if not line:
            raise BenchError("the other benchmark process closed the control connection")
        message: dict[str, Any] = json.loads(line)
        return message


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise BenchError("the data connection closed")
        got += n


# ----------------------------------------------------------- verbs side of one process
class Endpoint:
    """One process's HCA resources: an RC QP with separate send / receive CQs over 4 MiB of registered memory."""

    def __init__(self, provider: str, device: int = 0, same_host_links: bool = True, shared: bool = False) -> None:
        if provider == "tcp":
            import ckpt_ib2tcp

            ckpt_ib2tcp.register()
        default, _links.LOCAL_IPC = _links.LOCAL_IPC, same_host_links and _links.LOCAL_IPC  # read as the HCA opens
        try:
            self.ctx = v.Context(name=f"{provider}{device}")
        finally:
            _links.LOCAL_IPC = default
        self.pd = v.PD(self.ctx)
        self.scq = v.CQ(self.ctx, 4096)
        self.rcq = v.CQ(self.ctx, 4096)
        alloc = v.shared_array if shared else np.zeros  # shared: same-host peers place WRITEs directly
        self.big = alloc(BIG, np.uint8)
        self.small = alloc(4096, np.uint8)
        self.big_mr = v.MR(self.pd, self.big, ACCESS)
        self.small_mr = v.MR(self.pd, self.small, ACCESS)
        cap = v.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=RQ_DEPTH, max_send_sge=1, max_recv_sge=1, max_inline_data=64)
        init = v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap, sq_sig_all=0)
        self.qp = v.QP(self.pd, init)
        attr = v.QPAttr(port_num=1)
        attr.qp_access_flags = ACCESS
        self.qp.to_init(attr)
        self.psn = random.getrandbits(24)
        self.recv_wr = v.RecvWR(wr_id=0, num_sge=1, sg=[v.SGE(self.small_mr.buf, 64, self.small_mr.lkey)])
        self.pong = v.SendWR(
            wr_id=0,
            opcode=v.IBV_WR_SEND,
            num_sge=1,
            sg=[v.SGE(self.small_mr.buf + 64, 8, self.small_mr.lkey)],
            send_flags=v.IBV_SEND_INLINE,
        )
        self.sends = 0

    def address(self) -> dict[str, int]:
        return {
            "lid": self.ctx.query_port(1).lid,
            "qpn": self.qp.qp_num,
            "psn": self.psn,
            "rkey": self.big_mr.rkey,
            "addr": self.big_mr.buf,
        }

    def connect(self, peer: dict[str, int]) -> None:
        attr = v.QPAttr()
        attr.path_mtu = v.IBV_MTU_4096
        attr.dest_qp_num = peer["qpn"]
        attr.rq_psn = peer["psn"]
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 1
        attr.ah_attr = v.AHAttr(dlid=peer["lid"], port_num=1)
        self.qp.to_rtr(attr)
        attr = v.QPAttr()
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = self.psn
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)
        self.peer = peer

    def post_recvs(self, n: int) -> None:
        for _ in range(n):
            self.qp.post_recv(self.recv_wr)

    def send_small(self) -> None:
        """One 8-byte inline SEND; every 64th is signaled and the send CQ is drained then."""
        self.sends += 1
        if self.sends % SIGNAL_EVERY == 0:
            self.pong.send_flags = v.IBV_SEND_INLINE | v.IBV_SEND_SIGNALED
            self.qp.post_send(self.pong)
            self.pong.send_flags = v.IBV_SEND_INLINE
        else:
            self.qp.post_send(self.pong)
        if self.sends % SIGNAL_EVERY == SIGNAL_EVERY // 2:
            check(self.scq.poll(SIGNAL_EVERY)[1])

    def wait_recv(self) -> None:
        poll = self.rcq.poll
        while True:
            n, wcs = poll(1)
            if n:
                check(wcs)
                return


def check(wcs: list[Any]) -> None:
    for wc in wcs:
        if wc.status != v.IBV_WC_SUCCESS:
            raise BenchError(f"completion of wr_id {wc.wr_id} failed: {v.ibv_wc_status(wc.status).name}")


def drain_send_cq(ep: Endpoint, until_wr_id: int, timeout: float = 60.0) -> None:
    """Poll the send CQ until the completion of `until_wr_id` (RC: every WR before it is complete too)."""
    deadline = time.monotonic() + timeout
    while True:
        n, wcs = ep.scq.poll(64)
        check(wcs)
        if any(wc.wr_id == until_wr_id for wc in wcs):
            return
        if not n and time.monotonic() > deadline:
            raise BenchError(f"no completion for wr_id {until_wr_id} within {timeout} s")


# ----------------------------------------------------------- the active side's measurements
def verbs_stream(ep: Endpoint, total: int) -> float:
    """Seconds to RDMA WRITE `total` bytes in 4 MiB messages, STREAM_DEPTH in flight."""
    count = total // BIG
    wr = v.SendWR(opcode=v.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.SGE(ep.big_mr.buf, BIG, ep.big_mr.lkey)])
    wr.send_flags = v.IBV_SEND_SIGNALED
    wr.set_wr_rdma(ep.peer["rkey"], ep.peer["addr"])
    posted = completed = 0
    start = time.perf_counter()
    while completed < count:
        while posted < count and posted - completed < STREAM_DEPTH:
            wr.wr_id = posted
            ep.qp.post_send(wr)
            posted += 1
        n, wcs = ep.scq.poll(STREAM_DEPTH)
        check(wcs)
        completed += n
    return time.perf_counter() - start


def tcp_stream(sock: socket.socket, total: int, buf: np.ndarray) -> float:
    """Seconds to sendall `total` bytes in 4 MiB buffers until the child has received them all."""
    view = memoryview(buf)
    ack = bytearray(1)
    start = time.perf_counter()
    for _ in range(total // BIG):
        sock.sendall(view)
    recv_exactly_into(sock, memoryview(ack))
    return time.perf_counter() - start


def verbs_rtt(ep: Endpoint, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        ep.qp.post_recv(ep.recv_wr)
        ep.send_small()
        ep.wait_recv()
    return (time.perf_counter() - start) / iters


def tcp_rtt(sock: socket.socket, iters: int) -> float:
    out = b"12345678"
    back = memoryview(bytearray(8))
    start = time.perf_counter()
    for _ in range(iters):
        sock.sendall(out)
        recv_exactly_into(sock, back)
    return (time.perf_counter() - start) / iters


def verbs_rate(ep: Endpoint, count: int, chain: int) -> float:
    """Messages/s of small RDMA WRITEs, unsignaled but every SIGNAL_EVERY-th, `chain` WRs per post_send."""
    wrs = []
    for i in range(chain):
        size = SMALL_SIZES[i % len(SMALL_SIZES)]
        wr = v.SendWR(opcode=v.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.SGE(ep.small_mr.buf, size, ep.small_mr.lkey)])
        wr.set_wr_rdma(ep.peer["rkey"], ep.peer["addr"] + 64 * (i % 64))
        if i:
            wrs[-1].next_wr = wr
        wrs.append(wr)
    head = wrs[0]
    posted = completed = 0
    start = time.perf_counter()
    while completed < count:
        while posted < count and posted - completed < RATE_DEPTH:
            for i, wr in enumerate(wrs):
                n = posted + i
                wr.wr_id = n
                wr.send_flags = v.IBV_SEND_SIGNALED if n % SIGNAL_EVERY == SIGNAL_EVERY - 1 else 0
            ep.qp.post_send(head)
            posted += chain
        _, wcs = ep.scq.poll(16)
        check(wcs)
        for wc in wcs:
            completed = wc.wr_id + 1
    return count / (time.perf_counter() - start)


def tcp_rate(sock: socket.socket, count: int) -> float:
    payloads = [bytes(size) for size in SMALL_SIZES]
    ack = bytearray(1)
    send = sock.sendall
    start = time.perf_counter()
    for i in range(count):
        send(payloads[i & 3])
    recv_exactly_into(sock, memoryview(ack))
    return count / (time.perf_counter() - start)


def small_bytes(count: int) -> int:
    return sum(SMALL_SIZES) * (count // len(SMALL_SIZES)) + sum(SMALL_SIZES[: count % len(SMALL_SIZES)])


def endpoints(provider: str) -> dict[str, Endpoint]:
    """The endpoints measured, by kind: "verbs", and for simib "verbs_tcp" (a second HCA, links over TCP) and,
    unless CKPT_SIMIB_DIRECT=0, "verbs_shm" (a third, over shared memory: direct placement)."""
    eps = {"verbs": Endpoint(provider)}
    if provider == "simib":
        eps["verbs_tcp"] = Endpoint(provider, device=1, same_host_links=False)
        if _shm.ENABLED and _links.LOCAL_IPC:
            eps["verbs_shm"] = Endpoint(provider, device=2, shared=True)
    return eps


# ----------------------------------------------------------- the passive side
def child_main(ctrl_port: int, data_port: int, unix_name: str, provider: str) -> None:
    ctrl = Control(socket.create_connection(("127.0.0.1", ctrl_port)))
    tcp = socket.create_connection(("127.0.0.1", data_port))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.connect("\0" + unix_name)
    eps = endpoints(provider)
    ctrl.send(**{kind: ep.address() for kind, ep in eps.items()})
    for kind, peer in ctrl.recv().items():
        eps[kind].connect(peer)
        eps[kind].post_recvs(1)  # before the parent may send its first ping
    ctrl.send(ok=True)
    stage = np.zeros(BIG, dtype=np.uint8)
    while True:
        cmd = ctrl.recv()
        op = cmd["op"]
        data = unix if cmd.get("via") == "unix" else tcp
        ep = eps[cmd.get("ep", "verbs")]
        if op == "quit":
            return
        if op == "tcp_stream":
            ctrl.send(ready=True)
            view = memoryview(stage)
            left = cmd["bytes"]
            while left:
                n = data.recv_into(view[: min(left, BIG)])
                if n == 0:
                    raise BenchError("data connection closed")
                left -= n
            data.sendall(b"k")
        elif op == "tcp_rtt":
            ctrl.send(ready=True)
            back = memoryview(bytearray(8))
            for _ in range(cmd["iters"]):
                recv_exactly_into(data, back)
                data.sendall(back)
        elif op == "verbs_rtt":  # one receive is always posted: each ping consumes it, the pong replaces it
            ctrl.send(ready=True)
            for _ in range(cmd["iters"]):
                ep.wait_recv()
                ep.qp.post_recv(ep.recv_wr)
                ep.send_small()
        elif op in ("verbs_stream", "verbs_rate"):  # one-sided: the child's HCA threads do the work
            ctrl.send(ready=True)
        else:
            raise BenchError(f"unknown command {op!r}")
        ctrl.send(done=True)


# ----------------------------------------------------------- the active side
def machine() -> dict[str, Any]:
    model, mhz = "?", "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "cpu MHz" and mhz == "?":
                mhz = value.strip()
    except OSError:
        pass
    return {
        "cpu": model,
        "mhz": mhz,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


class Bench:
    """The parent: starts the fabric and the child, then runs each measurement on command."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sm: fabric.SubnetManager | None = None
        self.directory: str | None = None
        if args.provider == "tcp":  # the child inherits the directory both HCAs record themselves in
            self.directory = tempfile.mkdtemp(prefix="ckpt-bench-tcp-")
            os.environ["CKPT_TCP_DIRECTORY"] = self.directory
        else:
            self.sm = fabric.SubnetManager().start()
            os.environ.update({fabric.ENV_ADDRESS: self.sm.address, fabric.ENV_TOKEN: self.sm.token})
        ctrl_listener = socket.create_server(("127.0.0.1", 0))
        data_listener = socket.create_server(("127.0.0.1", 0))
        unix_name = f"ckpt-bench-verbs/{os.getpid()}/{random.getrandbits(32):08x}"
        unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix_listener.bind("\0" + unix_name)
        unix_listener.listen()
        ports = [str(ctrl_listener.getsockname()[1]), str(data_listener.getsockname()[1]), unix_name]
        self.child = subprocess.Popen([sys.executable, __file__, "--provider", args.provider, "--child", *ports])
        for listener in (ctrl_listener, data_listener, unix_listener):
            listener.settimeout(60)
        self.ctrl = Control(ctrl_listener.accept()[0])
        self.data = data_listener.accept()[0]
        self.unix = unix_listener.accept()[0]
        for listener in (ctrl_listener, data_listener, unix_listener):
            listener.close()
        self.data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.eps = endpoints(args.provider)
        self.ep = self.eps["verbs"]
        peers = self.ctrl.recv()
        self.ctrl.send(**{kind: ep.address() for kind, ep in self.eps.items()})
        for kind, ep in self.eps.items():
            ep.connect(peers[kind])
            ep.big[:] = np.arange(BIG, dtype=np.uint64).astype(np.uint8)
        self.ctrl.recv()

    def close(self) -> None:
        try:
            self.ctrl.send(op="quit")
            self.child.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, BenchError):
            pass
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()
            for ep in self.eps.values():
                ep.ctx.close()
            if self.sm is not None:
                self.sm.stop()
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)

    def pin(self) -> None:
        """Every thread of both processes onto the CPUs --pin asks for (nothing for `none`)."""
        if self.args.pin == "none":
            return
        first, *others = sorted(os.sched_getaffinity(0))  # the first two CPUs this process may use
        placement = ({first}, {first}) if self.args.pin == "same" else ({first}, {others[0]})
        for pid, cpus in zip((os.getpid(), self.child.pid), placement, strict=True):
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(task), cpus)
                except ProcessLookupError:  # a thread that ended meanwhile
                    pass

    def run(self, op: str, fn: Callable[[], float], **params: Any) -> float:
        self.ctrl.send(op=op, **params)
        self.ctrl.recv()  # ready
        value = fn()
        self.ctrl.recv()  # done
        return value

    def raw(self, via: str) -> dict[str, Callable[[], float]]:
        """name -> the raw-socket baseline of that measurement, over the TCP or the Unix connection."""
        a, ep = self.args, self.ep
        sock, total = (self.unix if via == "unix" else self.data), a.stream_mib << 20
        small = small_bytes(a.rate_msgs)

        def stream() -> float:
            return total / self.run("tcp_stream", lambda: tcp_stream(sock, total, ep.big), bytes=total, via=via)

        return {
            "stream": stream,
            "rtt": lambda: self.run("tcp_rtt", lambda: tcp_rtt(sock, a.rtt_iters), iters=a.rtt_iters, via=via),
            "rate": lambda: self.run("tcp_stream", lambda: tcp_rate(sock, a.rate_msgs), bytes=small, via=via),
        }

    def verbs(self, kind: str) -> dict[str, Callable[[], float]]:
        """name -> that measurement on the endpoint of `kind` ("verbs", or "verbs_tcp": `endpoints`)."""
        a, ep, total = self.args, self.eps[kind], self.args.stream_mib << 20
        return {
            "stream": lambda: total / self.run("verbs_stream", lambda: verbs_stream(ep, total), ep=kind),
            "rtt": lambda: self.run("verbs_rtt", lambda: verbs_rtt(ep, a.rtt_iters), iters=a.rtt_iters, ep=kind),
            "rate": lambda: self.run("verbs_rate", lambda: verbs_rate(ep, a.rate_msgs, 1), ep=kind),
            "rate_chained": lambda: self.run("verbs_rate", lambda: verbs_rate(ep, a.rate_msgs, SIGNAL_EVERY), ep=kind),
        }

    def cases(self) -> dict[str, dict[str, Callable[[], float]]]:
        """name -> {kind: measurement}: each endpoint's ("verbs", ...), and "tcp" and "unix" for the raw baselines."""
        verbs = {kind: self.verbs(kind) for kind in self.eps}
        tcp, unix = self.raw("tcp"), self.raw("unix")
        return {
            name: {kind: verbs[kind][name] for kind in verbs}
            | ({"tcp": tcp[name], "unix": unix[name]} if name in tcp else {})
            for name in verbs["verbs"]
        }

    def measure(self) -> dict[str, dict[str, list[float]]]:
        results: dict[str, dict[str, list[float]]] = {}
        for name, fns in self.cases().items():
            if self.args.only and name not in self.args.only:
                continue
            runs: dict[str, list[float]] = {kind: [] for kind in fns}
            for fn in fns.values():  # warm-up, not counted
                fn()
            self.pin()
            order = list(fns.items())
            for i in range(self.args.repeat):
                shift = i % len(order)  # each kind goes first in turn, and every other round the order runs
                turn = order[shift:] + order[:shift]  # backwards, so no kind always follows the same one
                for kind, fn in turn if i % 2 == 0 else turn[::-1]:
                    runs[kind].append(fn())
            results[name] = runs
            print(f"  {name}: " + " | ".join(f"{kind} {fmt_runs(name, xs)}" for kind, xs in runs.items()), flush=True)
        return results


def fmt_runs(name: str, values: list[float]) -> str:
    if name == "stream":
        return " ".join(f"{x / 1e9:.2f}" for x in values) + " GB/s"
    if name == "rtt":
        return " ".join(f"{x * 1e6:.1f}" for x in values) + " us"
    return " ".join(f"{x / 1e3:.1f}" for x in values) + " k msg/s"


def summarize(results: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    med = {name: {kind: statistics.median(xs) for kind, xs in runs.items()} for name, runs in results.items()}
    summary: dict[str, Any] = {"rate_chained": med["rate_chained"]}
    for name in ("stream", "rtt", "rate"):
        m = med[name]
        summary[name] = {**m, "ratio": m["verbs"] / m["tcp"], "ratio_unix": m["verbs"] / m["unix"]}
        if "verbs_tcp" in m:
            summary[name]["ratio_tcp_links"] = m["verbs_tcp"] / m["tcp"]
        if "verbs_shm" in m:
            summary[name]["ratio_shm"] = m["verbs_shm"] / m["tcp"]
    return summary


def met(name: str, ratio: float) -> str:
    op, target = TARGETS[name]
    ok = ratio >= target if op == ">=" else ratio <= target
    return "yes" if ok else "NO"


def variant_table(kind: str, title: str, heading: str, rows: Any, chains: dict[str, float]) -> None:
    """The measurements of the endpoint of `kind`, against raw TCP and against "verbs" (packets, Unix links)."""
    print()
    print(heading)
    print(f"| measure | {title} | ÷ raw TCP | target | met | ÷ simib, Unix links |")
    print("|---|---|---|---|---|---|")
    for label, name, x, unit, scale, digits, target in rows:
        ratio = x[kind] / x["tcp"]
        value = f"{x[kind] / scale:.{digits}f} {unit}"
        print(f"| {label} | {value} | {ratio:.2f} | {target} | {met(name, ratio)} | {x[kind] / x['verbs']:.2f} |")
    rate, against = chains[kind], chains["verbs"]
    print(f"| small-message rate, 64-WR chains | {rate / 1e3:.1f} k msg/s | | | | {rate / against:.2f} |")


def report(summary: dict[str, Any], args: argparse.Namespace, command: str) -> None:
    s, r, m, c = summary["stream"], summary["rtt"], summary["rate"], summary["rate_chained"]
    print()
    print(f"median of {args.repeat}:")
    print(f"| measure | {args.provider} verbs | raw TCP | verbs / TCP | target | met | raw Unix | verbs / Unix |")
    print("|---|---|---|---|---|---|---|---|")
    rows = (  # label, measurement, its summary, unit, divisor, decimals, target
        ("bandwidth, 4 MiB messages", "stream", s, "GB/s", 1e9, 2, ">= 0.9"),
        ("8-byte round trip", "rtt", r, "us", 1e-6, 1, "<= 2.0"),
        ("small-message rate, 1 WR per post", "rate", m, "k msg/s", 1e3, 1, ">= 0.5"),
    )
    for label, name, x, unit, scale, digits, target in rows:
        verbs, tcp, unix = (f"{x[kind] / scale:.{digits}f} {unit}" for kind in ("verbs", "tcp", "unix"))
        ratios = f"{x['ratio']:.2f} | {target} | {met(name, x['ratio'])}"
        print(f"| {label} | {verbs} | {tcp} | {ratios} | {unix} | {x['ratio_unix']:.2f} |")
    print(f"| small-message rate, 64-WR chains | {c['verbs'] / 1e3:.1f} k msg/s | | | - | - | | |")
    if "verbs_tcp" in r:
        if not _links.LOCAL_IPC:
            print("\nCKPT_SIMIB_UNIX=0: both HCAs link over TCP, so the last column compares TCP with TCP")
        heading = "the same engine with links over loopback TCP (a second HCA, as with CKPT_SIMIB_UNIX=0), same run:"
        variant_table("verbs_tcp", "simib, TCP links", heading, rows, c)
    if "verbs_shm" in r:
        heading = (
            "the same engine over shared memory (a third HCA, memory from ckpt.verbs.shared_array: WRITEs placed\n"
            "directly, SENDs as packets), same run:"
        )
        variant_table("verbs_shm", "simib, shared memory", heading, rows, c)
    print()
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['mhz']} MHz), {info['cores']} cores, kernel {info['kernel']}, "
        f"Python {info['python']}, numpy {info['numpy']}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"command: {command}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--provider", choices=["simib", "tcp"], default="simib", help="the verbs provider measured")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per measurement (median reported)")
    parser.add_argument("--stream-mib", type=int, default=256, help="MiB per bandwidth round (4 MiB messages)")
    parser.add_argument("--rtt-iters", type=int, default=2000, help="round trips per latency round")
    parser.add_argument("--rate-msgs", type=int, default=20000, help="small messages per message-rate round")
    parser.add_argument("--only", nargs="+", choices=CASES, help="run only these measurements (for profiling)")
    parser.add_argument("--json", type=Path, help="also write every run and the medians here")
    parser.add_argument(
        "--pin", choices=["none", "same", "split"], default="none", help="both processes on one CPU, or one CPU each"
    )
    parser.add_argument("--child", nargs=3, metavar=("CTRL_PORT", "DATA_PORT", "UNIX_NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(int(args.child[0]), int(args.child[1]), args.child[2], args.provider)
        return 0
    if args.stream_mib < 4 or args.rate_msgs < SIGNAL_EVERY:
        parser.error(f"--stream-mib must be >= 4 and --rate-msgs >= {SIGNAL_EVERY}")
    if args.pin == "split" and len(os.sched_getaffinity(0)) < 2:
        parser.error("--pin split needs two CPUs")
    args.rate_msgs -= args.rate_msgs % SIGNAL_EVERY  # the last WR of a round is a signaled one
    command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]])
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.perf_counter()
    bench = Bench(args)
    try:
        results = bench.measure()
    finally:
        bench.close()
    if args.only:
        return 0
    summary = summarize(results)
    report(summary, args, command)
    print(f"wall time: {time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary, "machine": machine()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
