"""What the verbs test programs share: RC QPs connected between ranks with one allgather, and CQ polling.

A program names the links it wants as (peer, label) pairs; the QP for (peer, label)
on this rank is connected to the QP for (this rank, label) on the peer, so one RC
QP serves a pair of ranks in both directions.  A rank may link to itself (a QP
connected to itself, loopback, as on hardware).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import ckpt
from ckpt import verbs

ACCESS = (
    verbs.IBV_ACCESS_LOCAL_WRITE
    | verbs.IBV_ACCESS_REMOTE_WRITE
    | verbs.IBV_ACCESS_REMOTE_READ
    | verbs.IBV_ACCESS_REMOTE_ATOMIC
)
WAIT_LIMIT = 60.0  # seconds without progress before a program gives up (a test fails rather than hangs)
#: When set, a program wrapped with `held` does not finish before this file exists (see `held`).
HOLD_ENV = "CKPT_TEST_HOLD"
#: With PAUSE_AT_ENV="10,20", a program wrapped with `pausable` idles before its 10th (then 20th) real step
#: until the file PAUSE_ENV.10 exists (see `pausable`).
PAUSE_ENV, PAUSE_AT_ENV = "CKPT_TEST_PAUSE", "CKPT_TEST_PAUSE_AT"

Link = tuple[int, str]


def connect_links(
    rt: ckpt.Runtime,
    ctx: verbs.Context,
    pd: verbs.PD,
    cq: verbs.CQ,
    links: Iterable[Link],
    *,
    recv_cq: verbs.CQ | None = None,
    srq: verbs.SRQ | None = None,
    send_wr: int = 64,
    recv_wr: int = 64,
    rd_atomic: int = 1,
    publish: dict[str, Any] | None = None,
) -> tuple[dict[Link, verbs.QP], list[dict[str, Any]]]:
    """Create and connect one RC QP per link (one allgather: call it in the same step on every rank).

    Returns the QPs by link and what every rank published (`publish`, plus "lid" and "qpns").
    """
    wanted = sorted(set(links))
    cap = verbs.QPCap(max_send_wr=send_wr, max_recv_wr=0 if srq else recv_wr)
    init = verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=cq, rcq=recv_cq or cq, srq=srq, cap=cap, sq_sig_all=0)
    qps = {link: verbs.QP(pd, init) for link in wanted}
    me = dict(publish or {})
    me["lid"] = ctx.query_port(1).lid
    me["qpns"] = {link: qp.qp_num for link, qp in qps.items()}
    everyone = rt.allgather(me)
    for (peer, label), qp in qps.items():
        remote = everyone[peer]
        connect(qp, remote["lid"], remote["qpns"][(rt.rank, label)], rd_atomic)
    return qps, everyone


def connect(qp: verbs.QP, dlid: int, dest_qpn: int, rd_atomic: int = 1) -> None:
    """RESET -> INIT -> RTR -> RTS towards (dlid, dest_qpn), retrying RNR forever."""
    verbs.connect_rc(qp, dlid, dest_qpn, ACCESS, rd_atomic=rd_atomic)


def poll(cq: verbs.CQ, num_entries: int = 16) -> list[Any]:
    """One poll; any completion that is not a success is an error of the program's run."""
    _, wcs = cq.poll(num_entries)
    for wc in wcs:
        if wc.status != verbs.IBV_WC_SUCCESS:
            status = verbs.ibv_wc_status(wc.status).name
            raise RuntimeError(f"work completion {wc.wr_id} failed: {status} (opcode {wc.opcode})")
    return wcs


class Deadline:
    """Raises when WAIT_LIMIT seconds pass without `progress()`: a lost message fails the run, it does not hang it."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.progress()

    def progress(self) -> None:
        self.limit = time.monotonic() + WAIT_LIMIT

    def check(self) -> None:
        if time.monotonic() > self.limit:
            raise RuntimeError(f"nothing for {WAIT_LIMIT:.0f} s while waiting for {self.what}")


Step = Callable[[Any, ckpt.Runtime], bool]


def _paused(real_steps: int, rank: int) -> bool:
    prefix, at = os.environ.get(PAUSE_ENV), os.environ.get(PAUSE_AT_ENV, "")
    if not prefix or str(real_steps) not in at.split(","):
        return False
    gate = f"{prefix}.{real_steps}"
    if os.path.exists(gate):
        return False
    if rank == 0:
        open(f"{gate}.reached", "a").close()
    time.sleep(0.005)  # idle: nothing to do until the test opens the gate
    return True


def pausable(step: Step) -> Step:
    """Wrap a program's `step` so that it idles before chosen real steps until the test opens a gate.

    $CKPT_TEST_PAUSE_AT="10,20" with $CKPT_TEST_PAUSE=PREFIX: before its 10th (then 20th)
    real step each rank idles until the file PREFIX.10 exists; rank 0 first creates
    PREFIX.10.reached.  A test checkpoints or injects a fault there, so it happens mid-run
    however fast the program is, and the traffic resumes after it.  Idle steps do no
    collective and change no state, so the result is the program's.
    """

    @functools.wraps(step)
    def run(self: Any, rt: ckpt.Runtime) -> bool:
        real = int(getattr(self, "_real_steps", 0))
        if _paused(real, rt.rank):
            return True
        self._real_steps = real + 1
        return step(self, rt)

    return run


def held(step: Step) -> Step:
    """Wrap a program's `step` so that, once it is done, the rank idles until the file $CKPT_TEST_HOLD exists.

    A test that checkpoints a running job then never races the job's end: it
    creates the file after its last checkpoint.  The idle steps are ordinary
    steps (a checkpoint parks between them) that do no collective and change
    no state, so the result is the same; without the variable nothing changes.
    """

    @functools.wraps(step)
    def run(self: Any, rt: ckpt.Runtime) -> bool:
        if not getattr(self, "_steps_done", False):
            if step(self, rt):
                return True
            self._steps_done = True
        gate = os.environ.get(HOLD_ENV)
        if not gate or os.path.exists(gate):
            return False
        time.sleep(0.005)  # idle: nothing to do until the test releases the job
        return True

    return run
