"""The CPU scheduling policy of a job's processes (`ckpt launch --sched`, $CKPT_SCHED).

Rationale.  A rank is several threads: the program's, the simulated NIC's (receive
engine, writers, timers), the DSM's handler, the checkpoint thread.  Nearly every
message one of them sends wakes a thread of another process, and on a machine with
fewer cores than busy threads Linux's default policy (SCHED_OTHER) lets the woken
thread preempt the sender: the sender, which usually has more to do right away (its
next post, its poll for the reply), loses its core in the middle of a burst, and a
send that costs ~45 µs of CPU took ~140 µs of wall time on the 2-core VM of
docs/benchmarks.md.  SCHED_BATCH is the same fair scheduler without wake-up
preemption (sched(7)): a woken thread waits for the end of the current slice or for
an idle core.  Under it each DSM program of the remote-logging benchmark ran 5-34 %
faster, with or without logging (16 % on the geometric mean: `benchmarks/bench_sched.py`);
a round trip between two processes on two idle cores does not change.  `other` keeps
the default.  Needs no privilege (sched(7): any thread may switch between SCHED_OTHER
and SCHED_BATCH at nice 0).

The policy is a thread's, inherited by the threads and processes it starts, so
``ckpt launch`` and ``ckpt restart`` apply it to themselves before they start any:
the launcher, the coordinator it embeds, every rank it spawns or respawns, and the
rank an external launcher or ``ckpt restart --rank`` runs in the command's own
process all have it.  A standalone ``ckpt coordinator`` keeps the default.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "CKPT_SCHED"
POLICIES = ("batch", "other")
DEFAULT = "batch"


def apply(policy: str) -> None:
    """Run the calling thread, and what it starts from now on, under `policy` (one of `POLICIES`).

    Where the platform has no such policies (not Linux), or refuses (a container that forbids it),
    nothing changes: the policy is a matter of speed only.  Nor does it under a policy other than
    these two (SCHED_IDLE, a real-time one), which someone chose from outside.
    """
    if policy not in POLICIES:
        raise ValueError(f"scheduling policy {policy!r}: one of {', '.join(POLICIES)}")
    setter = getattr(os, "sched_setscheduler", None)
    if setter is None:
        return
    number = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
    try:
        current = os.sched_getscheduler(0)
        if current not in (os.SCHED_OTHER, os.SCHED_BATCH):
            # SCHED_IDLE, a real-time policy: chosen from outside (chrt) on purpose, which --sched does not overrule
            log.debug("scheduling policy %s not applied: the process runs under policy %d", policy, current)
        elif current != number:
            setter(0, number, os.sched_param(0))
    except OSError as exc:  # EPERM: a seccomp profile that forbids the call
        log.debug("scheduling policy %s not applied: %s", policy, exc)
