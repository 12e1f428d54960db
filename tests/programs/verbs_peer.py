"""A verbs peer for the multi-process tests: one RC QP over registered memory, driven by JSON lines on stdin.

No ckpt runtime: the process opens `verbs.Context(name="simib0")` on the fabric named by
$CKPT_FABRIC / $CKPT_FABRIC_TOKEN, prints one `ready` line with what a remote side needs
({pid, lid1, lid2, qpn, rkey, addr, size}), then answers one command per stdin line with one
JSON line on stdout (a few commands print a `phase` line first, so the test knows when the
peer is asleep, busy or streaming).  Offsets are into the peer's registered buffer; remote
offsets are into the remote peer's (its `addr` comes with `connect`).  Timestamps are
time.monotonic(), which on Linux is one clock for every process of the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from ckpt import verbs as v

ACCESS = v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE | v.IBV_ACCESS_REMOTE_READ | v.IBV_ACCESS_REMOTE_ATOMIC
END = (1 << 64) - 1  # the sequence number that ends a stream
OPCODES = {
    "send": v.IBV_WR_SEND,
    "write": v.IBV_WR_RDMA_WRITE,
    "read": v.IBV_WR_RDMA_READ,
    "faa": v.IBV_WR_ATOMIC_FETCH_AND_ADD,
    "cas": v.IBV_WR_ATOMIC_CMP_AND_SWP,
}


class Wake(Exception):
    """SIGUSR1 ends a `sleep` or `busy` command early."""


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def wc_record(wc: Any) -> dict[str, Any]:
    return {
        "wr_id": wc.wr_id,
        "status": int(wc.status),
        "opcode": int(wc.opcode),
        "byte_len": wc.byte_len,
        "t": time.monotonic(),
    }


class Peer:
    def __init__(self, size: int, device: str) -> None:
        self.ctx = v.Context(name=device)
        self.pd = v.PD(self.ctx)
        self.scq = v.CQ(self.ctx, 8192)
        self.rcq = v.CQ(self.ctx, 8192)
        self.buf = np.zeros(size, dtype=np.uint8)
        self.mr = v.MR(self.pd, self.buf, ACCESS)
        self.qp = self._new_qp()
        self.remote: dict[str, Any] = {}
        self.keep: list[Any] = []  # objects of `ids`, kept open so their numbers stay taken

    def _new_qp(self) -> Any:
        cap = v.QPCap(max_send_wr=1024, max_recv_wr=1024, max_send_sge=1, max_recv_sge=1)
        init = v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap, sq_sig_all=0)
        return v.QP(self.pd, init)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "lid1": self.ctx.query_port(1).lid,
            "lid2": self.ctx.query_port(2).lid,
            "qpn": self.qp.qp_num,
            "rkey": self.mr.rkey,
            "lkey": self.mr.lkey,
            "addr": self.mr.buf,
            "size": len(self.buf),
        }

    # ------------------------------------------------------------------ set-up
    def cmd_connect(self, c: dict[str, Any]) -> dict[str, Any]:
        """RESET -> RTS towards c["remote"] on port 1; with c["alt"] an alternate path on port 2, REARMed."""
        remote = self.remote = c["remote"]
        attr = v.QPAttr(port_num=1)
        attr.qp_access_flags = ACCESS
        self.qp.to_init(attr)
        attr = v.QPAttr()
        attr.dest_qp_num = remote["qpn"]
        attr.ah_attr = v.AHAttr(dlid=remote["lid1"], port_num=1)
        attr.path_mtu = v.IBV_MTU_4096
        attr.rq_psn = 0
        attr.max_dest_rd_atomic = 4
        attr.min_rnr_timer = c.get("min_rnr_timer", 1)
        if c.get("alt"):
            attr.alt_ah_attr = v.AHAttr(dlid=remote["lid2"], port_num=2)
            attr.alt_port_num = 2
            attr.alt_timeout = c.get("timeout", 12)
        self.qp.to_rtr(attr)
        attr = v.QPAttr()
        attr.timeout = c.get("timeout", 12)
        attr.retry_cnt = c.get("retry_cnt", 7)
        attr.rnr_retry = c.get("rnr_retry", 7)
        attr.max_rd_atomic = 4
        attr.sq_psn = 0
        self.qp.to_rts(attr)
        if c.get("alt"):
            self.qp.modify(v.QPAttr(path_mig_state=v.IBV_MIG_REARM), v.IBV_QP_PATH_MIG_STATE)
            deadline = time.monotonic() + 5
            while self.qp.query(v.IBV_QP_PATH_MIG_STATE)[0].path_mig_state != v.IBV_MIG_ARMED:
                if time.monotonic() > deadline:
                    raise AssertionError("the alternate path was not ARMED within 5 s of REARM")
                time.sleep(0.001)  # polling interval of the ARMED wait
        return self.cmd_query(c)

    def cmd_new_qp(self, c: dict[str, Any]) -> dict[str, Any]:
        """Close the QP and create a fresh one (a new connection needs a new QP number)."""
        self.qp.close()
        self.qp = self._new_qp()
        return {"qpn": self.qp.qp_num}

    def cmd_query(self, c: dict[str, Any]) -> dict[str, Any]:
        attr, _ = self.qp.query(v.IBV_QP_STATE)
        return {
            "state": int(attr.qp_state),
            "port_num": attr.port_num,
            "dlid": attr.ah_attr.dlid,
            "alt_port_num": attr.alt_port_num,
            "alt_dlid": attr.alt_ah_attr.dlid,
            "path_mig_state": int(attr.path_mig_state),
        }

    def cmd_ids(self, c: dict[str, Any]) -> dict[str, Any]:
        """The first n QP numbers, lkeys and rkeys of this process (the main QP and MR first) and its LIDs."""
        qpns, lkeys, rkeys = [self.qp.qp_num], [self.mr.lkey], [self.mr.rkey]
        for _ in range(c["n"] - 1):
            qp = self._new_qp()
            mr = v.MR(self.pd, np.zeros(64, dtype=np.uint8), ACCESS)
            self.keep += [qp, mr]
            qpns.append(qp.qp_num)
            lkeys.append(mr.lkey)
            rkeys.append(mr.rkey)
        info = self.info()
        return {"qpns": qpns, "lkeys": lkeys, "rkeys": rkeys, "lids": [info["lid1"], info["lid2"]]}

    def cmd_links(self, c: dict[str, Any]) -> dict[str, Any]:
        """The socket family ("unix" or "tcp") of each connection this process's HCA opened, by peer endpoint."""
        import socket

        from ckpt.verbs import _hca

        conns = _hca.hca(self.ctx.name)._conns
        return {"links": {ep: "unix" if c.sock.family == socket.AF_UNIX else "tcp" for ep, c in conns.items()}}

    # ------------------------------------------------------------------ memory
    def cmd_fill(self, c: dict[str, Any]) -> dict[str, Any]:
        off, length = c["offset"], c["length"]
        self.buf[off : off + length] = np.random.default_rng(c["seed"]).integers(0, 256, length, dtype=np.uint8)
        return self.cmd_digest(c)

    def cmd_digest(self, c: dict[str, Any]) -> dict[str, Any]:
        off, length = c["offset"], c["length"]
        return {"sha256": hashlib.sha256(self.buf[off : off + length].data).hexdigest()}

    def cmd_peek(self, c: dict[str, Any]) -> dict[str, Any]:
        off, length = c["offset"], c["length"]
        return {"hex": self.buf[off : off + length].tobytes().hex()}

    def cmd_set_u64(self, c: dict[str, Any]) -> dict[str, Any]:
        for off, value in c["values"].items():
            self.buf[int(off) : int(off) + 8].view(np.uint64)[0] = value
        return {}

    def cmd_get_u64(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"values": {str(o): int(self.buf[o : o + 8].view(np.uint64)[0]) for o in c["offsets"]}}

    # ------------------------------------------------------------------ work requests
    def _send_wr(self, wr_id: int, spec: dict[str, Any]) -> Any:
        length = spec.get("len", 8)
        sge = v.SGE(self.mr.buf + spec.get("local", 0), length, self.mr.lkey)
        flags = v.IBV_SEND_SIGNALED if spec.get("signaled", True) else 0
        wr = v.SendWR(wr_id=wr_id, opcode=OPCODES[spec["op"]], num_sge=1, sg=[sge], send_flags=flags)
        raddr = self.remote.get("addr", 0) + spec.get("remote", 0)
        if spec["op"] in ("write", "read"):
            wr.set_wr_rdma(self.remote["rkey"], raddr)
        elif spec["op"] == "faa":
            wr.set_wr_atomic(self.remote["rkey"], raddr, spec["add"], 0)
        elif spec["op"] == "cas":
            wr.set_wr_atomic(self.remote["rkey"], raddr, spec["compare"], spec["swap"])
        return wr

    def _poll(self, cq: Any, want: Callable[[list[dict[str, Any]]], bool], timeout: float) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while not want(got) and time.monotonic() < deadline:
            _, wcs = cq.poll(16)
            got += [wc_record(wc) for wc in wcs]
        return got

    def cmd_post(self, c: dict[str, Any]) -> dict[str, Any]:
        """Post c["wrs"] one by one (wr_id = index); with c["wait"], poll until all expected WCs are in."""
        wrs = [self._send_wr(i, spec) for i, spec in enumerate(c["wrs"])]
        t_post = time.monotonic()
        for wr in wrs:
            self.qp.post_send(wr)
        t_posted = time.monotonic()
        wcs: list[dict[str, Any]] = []
        if c.get("wait", True):
            signaled = sum(1 for s in c["wrs"] if s.get("signaled", True))

            def complete(got: list[dict[str, Any]]) -> bool:
                failed = any(w["status"] != v.IBV_WC_SUCCESS for w in got)
                return len(got) >= (len(wrs) if failed else signaled)

            wcs = self._poll(self.scq, complete, c.get("timeout", 10))
        return {"t_post": t_post, "t_posted": t_posted, "wcs": wcs}

    def cmd_poll(self, c: dict[str, Any]) -> dict[str, Any]:
        """Poll the send CQ (c["cq"] == "recv": the receive CQ) until c["n"] completions or c["timeout"] s."""
        cq = self.rcq if c.get("cq") == "recv" else self.scq
        return {"wcs": self._poll(cq, lambda got: len(got) >= c["n"], c.get("timeout", 10))}

    def cmd_recv(self, c: dict[str, Any]) -> dict[str, Any]:
        for i in range(c["n"]):
            self._post_recv(i, c.get("base", 0) + i * c.get("len", 8), c.get("len", 8))
        return {}

    def _post_recv(self, wr_id: int, offset: int, length: int) -> None:
        sge = v.SGE(self.mr.buf + offset, length, self.mr.lkey)
        self.qp.post_recv(v.RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))

    # ------------------------------------------------------------------ the program thread away
    def cmd_sleep(self, c: dict[str, Any]) -> dict[str, Any]:
        """Block the main thread in time.sleep (SIGUSR1 ends it early)."""

        def wake(signum: int, frame: Any) -> None:
            raise Wake

        previous = signal.signal(signal.SIGUSR1, wake)
        woken = False
        start = time.monotonic()
        emit({"phase": "sleeping", "start": start})
        try:
            time.sleep(c["seconds"])
        except Wake:
            woken = True
        end = time.monotonic()
        signal.signal(signal.SIGUSR1, previous)
        return {"start": start, "end": end, "woken": woken}

    def cmd_busy(self, c: dict[str, Any]) -> dict[str, Any]:
        """Spin in a pure-Python loop (a linear congruential generator) for c["seconds"] or until SIGUSR1."""
        stop = []

        def wake(signum: int, frame: Any) -> None:
            stop.append(signum)

        previous = signal.signal(signal.SIGUSR1, wake)
        x, iterations = 1, 0
        start = time.monotonic()
        deadline = start + c["seconds"]
        emit({"phase": "busy", "start": start})
        while not stop:
            for _ in range(10_000):
                x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            iterations += 10_000
            if time.monotonic() > deadline:
                break
        end = time.monotonic()
        signal.signal(signal.SIGUSR1, previous)
        return {"start": start, "end": end, "woken": bool(stop), "iterations": iterations, "x": x}

    # ------------------------------------------------------------------ traffic
    def _events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            try:
                event = self.ctx.get_async_event(timeout=0)
            except v.PyverbsRDMAError:
                return out
            out.append({"type": int(event.event_type), "t": time.monotonic()})

    def cmd_events(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"events": self._events()}

    def cmd_echo(self, c: dict[str, Any]) -> dict[str, Any]:
        """Receive c["count"] messages of c["len"] bytes and SEND each one back."""
        length, slots = c.get("len", 8), 16
        for i in range(slots):
            self._post_recv(i, i * length, length)
        emit({"phase": "echoing"})
        deadline = time.monotonic() + c.get("timeout", 20)
        done = 0
        while done < c["count"] and time.monotonic() < deadline:
            _, wcs = self.rcq.poll(1)
            for wc in wcs:
                if wc.status != v.IBV_WC_SUCCESS:
                    return {"echoed": done, "error": int(wc.status)}
                self.qp.post_send(self._send_wr(wc.wr_id, {"op": "send", "local": wc.wr_id * length, "len": length}))
                self._poll(self.scq, lambda got: len(got) >= 1, 10)
                self._post_recv(wc.wr_id, wc.wr_id * length, length)
                done += 1
        return {"echoed": done}

    def cmd_pingpong(self, c: dict[str, Any]) -> dict[str, Any]:
        """c["count"] round trips of a c["len"]-byte SEND to an `echo` peer; the round-trip times."""
        length, base = c.get("len", 8), c.get("base", 1 << 16)
        rtts = []
        for i in range(c["count"]):
            self._post_recv(i, base, length)
            t0 = time.monotonic()
            self.qp.post_send(self._send_wr(i, {"op": "send", "local": 0, "len": length}))
            got = self._poll(self.rcq, lambda got: len(got) >= 1, c.get("timeout", 10))
            rtts.append(time.monotonic() - t0)
            if not got or got[0]["status"] != v.IBV_WC_SUCCESS:
                return {"rtts": rtts, "error": got}
            self._poll(self.scq, lambda got: len(got) >= 1, 10)
        return {"rtts": rtts}

    def cmd_stream(self, c: dict[str, Any]) -> dict[str, Any]:
        """SEND 8-byte sequence numbers, c["window"] in flight, until an error completion, or until
        c["extra"] more have completed after the first IBV_EVENT_PATH_MIG; then the END marker.

        A `streaming` phase line goes out after c["notify_after"] completions.
        """
        window, extra, notify_after = c.get("window", 16), c.get("extra", 300), c.get("notify_after", 200)
        deadline = time.monotonic() + c.get("max_seconds", 30)
        seq = completed = 0
        stop_at: int | None = c.get("max_count")
        events: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        next_event_check = 0.0
        notified = False
        while time.monotonic() < deadline:
            if stop_at is not None and completed >= stop_at:
                break
            while seq - completed < window and (stop_at is None or seq < stop_at):
                slot = seq % window
                self.buf[slot * 8 : slot * 8 + 8].view(np.uint64)[0] = seq
                self.qp.post_send(self._send_wr(seq, {"op": "send", "local": slot * 8, "len": 8}))
                seq += 1
            _, wcs = self.scq.poll(window)
            for wc in wcs:
                if wc.status != v.IBV_WC_SUCCESS:
                    errors.append(wc_record(wc))
                elif wc.wr_id == completed:
                    completed += 1
                else:
                    errors.append({**wc_record(wc), "out_of_order": completed})
            if errors:
                break
            if not notified and completed >= notify_after:
                notified = True
                emit({"phase": "streaming", "completed": completed})
            if time.monotonic() >= next_event_check:
                next_event_check = time.monotonic() + 0.005
                for event in self._events():
                    events.append(event)
                    if event["type"] == v.IBV_EVENT_PATH_MIG and stop_at is None:
                        stop_at = max(seq, completed + extra)
        if errors:  # the rest of the send queue flushes
            errors += self._poll(self.scq, lambda got: len(errors) + len(got) >= seq - completed, 10)
        else:
            self.buf[0:8].view(np.uint64)[0] = END
            self.qp.post_send(self._send_wr(END & 0xFFFF, {"op": "send", "local": 0, "len": 8}))
            errors += [w for w in self._poll(self.scq, lambda got: len(got) >= 1, 10) if w["status"]]
        events += self._events()
        return {"sent": seq, "completed": completed, "errors": errors, "events": events, "query": self.cmd_query(c)}

    def cmd_sink(self, c: dict[str, Any]) -> dict[str, Any]:
        """Receive a `stream` until its END marker (or SIGUSR1): how many arrived, whether in order without loss."""
        stop: list[int] = []
        previous = signal.signal(signal.SIGUSR1, lambda signum, frame: stop.append(signum))
        slots = c.get("slots", 64)
        base = c.get("base", 1 << 16)
        for i in range(slots):
            self._post_recv(i, base + i * 8, 8)
        emit({"phase": "sinking"})
        deadline = time.monotonic() + c.get("max_seconds", 30)
        count, ended = 0, False
        bad: list[tuple[int, int]] = []
        errors: list[dict[str, Any]] = []
        while not ended and not errors and not stop and time.monotonic() < deadline:
            _, wcs = self.rcq.poll(slots)
            for wc in wcs:
                if wc.status != v.IBV_WC_SUCCESS:
                    errors.append(wc_record(wc))
                    continue
                off = base + wc.wr_id * 8
                value = int(self.buf[off : off + 8].view(np.uint64)[0])
                self._post_recv(wc.wr_id, off, 8)
                if value == END:
                    ended = True
                elif value != count:
                    bad.append((count, value))
                    count = value + 1
                else:
                    count += 1
        signal.signal(signal.SIGUSR1, previous)
        return {
            "received": count,
            "bad": bad[:20],
            "ended": ended,
            "errors": errors,
            "events": self._events(),
            "query": self.cmd_query(c),
        }

    def cmd_quit(self, c: dict[str, Any]) -> dict[str, Any]:
        raise SystemExit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes of registered memory")
    parser.add_argument("--device", default="simib0")
    parser.add_argument("--debug", action="store_true", help="the engine's debug log on stderr")
    args = parser.parse_args()
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(relativeCreated)d %(name)s %(message)s")
    if args.device.startswith("tcp"):  # ib2tcp's provider: peers found through $CKPT_TCP_DIRECTORY
        import ckpt_ib2tcp

        ckpt_ib2tcp.register()
    peer = Peer(args.size, args.device)
    emit({"ready": True, **peer.info()})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        handler = getattr(peer, "cmd_" + command["op"], None)
        try:
            if handler is None:
                raise ValueError(f"unknown command {command['op']!r}")
            emit({"op": command["op"], **handler(command)})
        except SystemExit:
            raise
        except Exception:
            emit({"op": command["op"], "error": traceback.format_exc()})


if __name__ == "__main__":
    main()
