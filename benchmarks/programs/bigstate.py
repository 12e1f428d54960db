"""One rank holding a large numpy array that steps slowly: the subject of the end-to-end checkpoint benchmark.

    ckpt launch benchmarks/programs/bigstate.py [MIB] [KIND] [STEP_MS] [STAMP_FILE]

MIB (default 1024) MiB of uint8 state, KIND `incompressible` (random bytes,
the default) or `mostly-zero` (zeros with about 1% random bytes), generated as
`benchmarks/bench_image.py` does.  Each step sleeps STEP_MS milliseconds
(default 10) and runs until the job is killed.

With STAMP_FILE, the first step after a restart writes a JSON object there
(atomically): `imported`, the `time.time()` at which the rank imported this
file (early in the rank's start-up, before it loads its image), `first_step`,
the `time.time()` at which the program continued, and `intact`, whether a
sample of the state survived the round trip.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

import ckpt

IMPORTED = time.time()
_SAMPLE_EVERY = 4099


def make_state(kind: str, size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "incompressible":
        return rng.integers(0, 256, size, dtype=np.uint8)
    if kind != "mostly-zero":
        raise ValueError(f"KIND must be incompressible or mostly-zero, not {kind!r}")
    state = np.zeros(size, dtype=np.uint8)
    where = rng.integers(0, size, size // 100)
    state[where] = rng.integers(1, 256, where.size, dtype=np.uint8)
    return state


def sample_digest(state: np.ndarray) -> str:
    return hashlib.sha256(state[::_SAMPLE_EVERY].tobytes()).hexdigest()


class BigState(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        mib = int(rt.argv[0]) if rt.argv else 1024
        kind = rt.argv[1] if len(rt.argv) > 1 else "incompressible"
        self.delay = (float(rt.argv[2]) if len(rt.argv) > 2 else 10.0) / 1000
        self.stamp = rt.argv[3] if len(rt.argv) > 3 else ""
        self.state = make_state(kind, mib << 20)
        self.digest = sample_digest(self.state)
        self.i = 0
        self.stamped = False

    def step(self, rt: ckpt.Runtime) -> bool:
        if rt.restarted and self.stamp and not self.stamped:
            first_step = time.time()
            self.stamped = True
            intact = sample_digest(self.state) == self.digest
            record = {"imported": IMPORTED, "first_step": first_step, "intact": intact}
            tmp = self.stamp + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.stamp)
        time.sleep(self.delay)
        self.i += 1
        return True

    def result(self) -> int:
        return self.i
