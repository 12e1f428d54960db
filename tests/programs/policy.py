"""Reports the CPU scheduling policy of every thread of its rank process (`ckpt launch --sched`), as it is at its
last step: after a restart, the restarted process's."""

from __future__ import annotations

import os
import time

import ckpt

NAMES = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch"}


def policies() -> str:
    """The policies of this process's threads, each once, sorted (a thread that ended meanwhile is skipped)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            found.add(NAMES.get(os.sched_getscheduler(int(tid)), "other-policy"))
        except OSError:
            continue
    return ",".join(sorted(found))


class Policy(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.i = 0
        self.seen = ""

    def step(self, rt: ckpt.Runtime) -> bool:
        self.seen = policies()
        time.sleep(0.02)  # the step's work
        self.i += 1
        return self.i < int(rt.argv[0]) if rt.argv else self.i < 40

    def result(self) -> str:
        return self.seen
