"""A program of dsm/programs, chosen by $CKPT_BENCH_DSM_PROGRAM, that also writes each rank's DSM statistics.

    CKPT_BENCH_DSM_PROGRAM=sor CKPT_BENCH_DSM_STATS=/tmp/x ckpt launch -n 4 benchmarks/programs/dsm_stats.py [ARGS]

When the program's last step is done, each rank writes `mem.statistics()` as
JSON to $CKPT_BENCH_DSM_STATS.<rank> (the programs keep their Memory as `self.mem`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import ckpt
from dsm.programs import program_class

_base = program_class(os.environ["CKPT_BENCH_DSM_PROGRAM"])


class WithStatistics(_base):  # type: ignore[valid-type,misc]
    def step(self, rt: ckpt.Runtime) -> bool:
        more: bool = super().step(rt)
        if not more:
            stats: dict[str, Any] = self.mem.statistics().as_dict()
            with open(f"{os.environ['CKPT_BENCH_DSM_STATS']}.{rt.rank}", "w") as out:
                json.dump(stats, out)
        return more
