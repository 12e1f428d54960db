"""tests/programs/dsm_held.py that also writes each rank's DSM statistics once its steps are done.

    CKPT_TEST_DSM_PROGRAM=sor CKPT_TEST_DSM_STATS=PREFIX ckpt launch -n 4 tests/programs/dsm_replayed.py [ARGS]

When its last real step is done (before it idles for $CKPT_TEST_HOLD, if
set), each rank writes PREFIX.<rank> (JSON): `mem.statistics()` with its pid,
incarnation, whether the process was restarted or recovered, and the steps
done when it took over (`resumed_at`: 0, or its image's).  SIGUSR1
makes a process dump every thread's stack into PREFIX.stacks.<pid> (what a
test shows of a run that hangs).  Every
process writes its own once: a rank respawned from its image writes the
counters of the image plus what it did since (its replay among them), after
the replay, so a test that waits for it knows the recovered rank needs
nothing more from the others before they may finish.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
from typing import Any

from dsm_held import Held

import ckpt

STATS_ENV = "CKPT_TEST_DSM_STATS"

if os.environ.get(STATS_ENV):
    # open as long as the process lives: faulthandler writes into it from a signal handler
    _stacks = open(f"{os.environ[STATS_ENV]}.stacks.{os.getpid()}", "w")
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)


class Replayed(Held):  # type: ignore[misc]
    def step(self, rt: ckpt.Runtime) -> bool:
        if getattr(self, "_resumed_by", None) != os.getpid():  # the first step of this process
            self._resumed_by, self._resumed_at = os.getpid(), int(rt.step)
        more: bool = super().step(rt)
        written = getattr(self, "_written_by", None)  # pickled: an image's value is an earlier process's
        if getattr(self, "_steps_done", False) and written != os.getpid() and os.environ.get(STATS_ENV):
            self._written_by = os.getpid()
            stats: dict[str, Any] = self.mem.statistics().as_dict()
            stats.update(
                pid=os.getpid(),
                incarnation=int(getattr(rt, "incarnation", 0)),
                restarted=bool(rt.restarted),
                recovered=bool(getattr(rt, "recovered", False)),
                resumed_at=self._resumed_at,  # the steps done when this process took over: its image's
            )
            path = f"{os.environ[STATS_ENV]}.{rt.rank}"
            with open(f"{path}.tmp", "w") as out:
                json.dump(stats, out)
            os.replace(f"{path}.tmp", path)  # a test polling for it never reads half a file
        return more
