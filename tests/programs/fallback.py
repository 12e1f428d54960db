"""Asks for a whole-job restart from inside a rank (rt.fall_back), and holds checkpoints (rt.hold_checkpoints).

argv: STEPS AT TIMES [HOLD_FROM HOLD_TO]: rank 1 calls rt.fall_back at step AT while the job's generation is
below TIMES (so a job launched with TIMES 1 falls back once: its restart runs in generation 1).  A rank that
replaced a failed one alone (rt.recovered: killed under --on-failure recover) falls back at its first step, as
a rank whose logs went with its log home does.  With HOLD_FROM
and HOLD_TO, rank 1 holds checkpoints from step HOLD_FROM to step HOLD_TO, and rank 0 asks for rank 2's
independent checkpoint at step HOLD_FROM + 1 (queued meanwhile; its image is taken after the release).
Each step: local numpy work and an allgather of a partial sum, so the result depends on every rank's every step.
"""

from __future__ import annotations

import time

import numpy as np

import ckpt


class FallBack(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps, self.at, self.times = (int(a) for a in rt.argv[:3])
        self.hold = (int(rt.argv[3]), int(rt.argv[4])) if len(rt.argv) > 4 else None
        self.x = np.arange(256, dtype=np.int64) * (rt.rank + 3)
        self.total = 0
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        if rt.recovered:
            rt.fall_back(f"rank {rt.rank} was recovered alone as incarnation {rt.incarnation}, but cannot replay")
        if rt.rank == 1 and self.i == self.at and rt.generation < self.times:
            rt.fall_back(f"rank 1 cannot replay (test fallback at step {self.i}, generation {rt.generation})")
        if self.hold is not None:
            if rt.rank == 1 and self.i == self.hold[0]:
                rt.hold_checkpoints("rank 1 is replaying its logs (test)")
            if rt.rank == 1 and self.i == self.hold[1]:
                rt.release_checkpoints()
            if rt.rank == 0 and self.i == self.hold[0] + 1:
                rt.checkpoint_rank(2)
        self.x = (self.x * 48271 + self.i + rt.rank) % 1_000_003
        time.sleep(0.01)  # the step's work
        partials = rt.allgather(int(self.x[self.i % self.x.size]))
        self.total = (self.total * 31 + sum(p * (r + 1) for r, p in enumerate(partials))) % 1_000_000_007
        self.i += 1
        return self.i < self.steps

    def result(self) -> str:
        return f"{self.i}:{self.total}:{int(self.x.sum())}"
