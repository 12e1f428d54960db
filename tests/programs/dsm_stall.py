"""A DSM program whose rank 0 stalls outside the DSM while the other ranks wait inside it (`ckpt status`).

    ckpt launch -n 3 tests/programs/dsm_stall.py GATE

Rank 0 takes the lock before the others can ask for it (in setup, before a barrier).
Step 1: rank 0 waits (in plain Python, outside the DSM) until the
file GATE.lock exists, adds one to the shared counter and releases; every other rank
asks for the lock meanwhile, then adds its own one.  Step 2: rank 0 waits for
GATE.barrier before the barrier every other rank is already in.  Each rank's result is
the counter after the barrier (the number of ranks) and the lock's number.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import ckpt
import dsm

GATE_TIMEOUT = 120.0


def gate(path: Path) -> None:
    """Wait until the test creates `path` (polling a file: the stall this program exists to show)."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.02)


class Stall(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.gate = Path(rt.argv[0])
        self.mem = dsm.attach(rt)
        self.counter = self.mem.array(1, np.int64)
        self.lock = self.mem.lock()
        if rt.rank == 0:
            self.lock.acquire()
        self.mem.barrier()
        self.steps = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        self.steps += 1
        if self.steps == 1:
            if rt.rank == 0:
                gate(self.gate.with_suffix(".lock"))
            else:
                self.lock.acquire()
            self.counter[0] = int(self.counter[0]) + 1
            self.lock.release()
            return True
        if rt.rank == 0:
            gate(self.gate.with_suffix(".barrier"))
        self.mem.barrier()
        return False

    def result(self) -> str:
        return f"counter {int(self.counter[0])} lock {self.lock.id}"
