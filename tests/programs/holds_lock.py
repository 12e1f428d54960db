"""Keeps a threading.Lock in its state: ckpt warns at launch, and every checkpoint fails naming it."""

from __future__ import annotations

import threading
import time

import ckpt


class HoldsLock(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 100
        self.guard = threading.Lock()
        self.i = 0

    def step(self, rt: ckpt.Runtime) -> bool:
        with self.guard:
            self.i += 1
        time.sleep(0.02)
        return self.i < self.steps

    def result(self) -> int:
        return self.i
