"""tests/programs/dsm_held.py that also writes each rank's DSM statistics once its steps are done.

    CKPT_TEST_DSM_PROGRAM=sor CKPT_TEST_DSM_STATS=PREFIX ckpt launch -n 4 tests/programs/dsm_replayed.py [ARGS]

When its last real step is done (before it idles for $CKPT_TEST_HOLD, if
set), each rank writes PREFIX.<rank> (JSON): `mem.statistics()` with its pid,
incarnation, whether the process was restarted or recovered, and the steps
done when it took over (`resumed_at`: 0, or its image's).  SIGUSR1
makes a process dump every thread's stack into PREFIX.stacks.<pid>, and
SIGUSR2 its DSM state (links, pending requests and where they stand, the
handler's queues, the replay) into PREFIX.dsm.<pid>: what a test shows of a
run that hangs.  Every
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

_live: list[Any] = []  # the program object of this process, once it ran a step


def _dsm_state(mem: Any) -> list[str]:
    """What the DSM of this process waits for, read without a lock (a signal handler must not block)."""
    lines = []
    for name in ("client", "server"):
        ep = getattr(mem, name)
        free = [len(f) for f in ep.free]
        lines.append(
            f"{name}: state {ep.state} link {ep.link} reconnections {ep.reconnections} free slots {free}"
            f" inbox {len(ep.inbox)}"
        )
    lines.append(f"pending requests: {mem._diagnosis(list(mem.pending)) if mem.pending else 'none'}")
    lines.append(f"replies not collected: {sorted(mem.replies)}")
    handler = mem.handler
    lines.append(f"handler: holding {handler.holding}, held back {[e[:2] for e in handler.held_back]}")
    lines.append(f"handler: waiting page requests (rank, rid, gid, need) {handler.waiting}")
    lines.append(f"handler: barrier arrivals {[e[:2] for e in handler.arrivals]}")
    replay = mem.replay
    lines.append("replay: none" if replay is None else f"replay: {replay.progress()} (done {replay.done})")
    return lines


def _dump_dsm(signum: int, frame: Any) -> None:
    try:
        lines = _dsm_state(_live[0].mem) if _live else ["no step ran yet"]
    except Exception as exc:  # a diagnosis of a hung run: show what broke it, never raise into the program
        lines = [f"the DSM state could not be read: {type(exc).__name__}: {exc}"]
    with open(f"{os.environ[STATS_ENV]}.dsm.{os.getpid()}", "w") as out:
        out.write("\n".join(lines) + "\n")


if os.environ.get(STATS_ENV):
    # open as long as the process lives: faulthandler writes into it from a signal handler
    _stacks = open(f"{os.environ[STATS_ENV]}.stacks.{os.getpid()}", "w")
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    signal.signal(signal.SIGUSR2, _dump_dsm)  # runs on the main thread between bytecodes: its waits wake often


class Replayed(Held):  # type: ignore[misc]
    def step(self, rt: ckpt.Runtime) -> bool:
        if getattr(self, "_resumed_by", None) != os.getpid():  # the first step of this process
            self._resumed_by, self._resumed_at = os.getpid(), int(rt.step)
            _live[:] = [self]
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
