"""A program of dsm/programs that halts every rank at a gate near its end: the recovery-time benchmark's.

    CKPT_BENCH_DSM_PROGRAM=sor CKPT_BENCH_DSM_STATS=PREFIX CKPT_BENCH_GATE_STEP=27 CKPT_BENCH_RUN=LABEL \\
        ckpt launch -n 4 benchmarks/programs/dsm_recovery.py [ARGS]

Before its real step $CKPT_BENCH_GATE_STEP each process writes, once,
PREFIX.gate.<LABEL>.<rank>.<pid> (JSON: time.time(), incarnation) and idles
until the file PREFIX.open.<LABEL> exists (idle steps do no collective and
change no state: the result is the program's).  A rank respawned from its
image writes its own file when it reaches the gate again: the benchmark times
a recovery from the kill to that file, and a whole-job re-execution from the
restart to the same file.  When the last step is done each rank writes
PREFIX.stats.<LABEL>.<rank> (`mem.statistics()`, its pid, incarnation and
real steps).  LABEL is the environment's, not the image's: a restart may
change it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import ckpt
from dsm.programs import program_class

_base = program_class(os.environ["CKPT_BENCH_DSM_PROGRAM"])


def _write(path: str, data: dict[str, Any]) -> None:
    with open(f"{path}.tmp", "w") as out:
        json.dump(data, out)
    os.replace(f"{path}.tmp", path)  # the benchmark polls for it: never half a file


class Gated(_base):  # type: ignore[valid-type,misc]
    def step(self, rt: ckpt.Runtime) -> bool:
        prefix, label = os.environ["CKPT_BENCH_DSM_STATS"], os.environ.get("CKPT_BENCH_RUN", "run")
        real = int(getattr(self, "_real_steps", 0))
        if real == int(os.environ.get("CKPT_BENCH_GATE_STEP", "-1")):
            gate = f"{prefix}.gate.{label}.{rt.rank}.{os.getpid()}"
            if not os.path.exists(gate):
                _write(gate, {"time": time.time(), "incarnation": int(getattr(rt, "incarnation", 0))})
            if not Path(f"{prefix}.open.{label}").exists():
                time.sleep(0.002)  # idle at the gate until the benchmark opens it
                return True
        self._real_steps = real + 1
        more: bool = super().step(rt)
        if not more:
            stats: dict[str, Any] = self.mem.statistics().as_dict()
            stats.update(pid=os.getpid(), incarnation=int(getattr(rt, "incarnation", 0)), real_steps=real + 1)
            _write(f"{prefix}.stats.{label}.{rt.rank}", stats)
        return more
