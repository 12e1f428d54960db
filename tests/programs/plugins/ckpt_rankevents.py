"""Test plugin: records the survivors' single-rank recovery hooks, and what a recovered rank sees.

Each rank appends one JSON line per hook to $CKPT_TEST_RANKEVENTS/rank<R>.jsonl: the hook, the rank and
incarnation it names, the thread it ran on.  A recovered rank's ckpt_restart records rt.recovered and
rt.incarnation.  CKPT_TEST_RANKEVENTS_RAISE=1 makes ckpt_rank_failed raise (a plugin that cannot cope);
CKPT_TEST_RANKEVENTS_CRASH=1 kills every recovered rank in its ckpt_restart (a crash loop);
CKPT_TEST_RANKEVENTS_HANG=1 makes a rank's first recovered incarnation hang in its ckpt_restart, alive.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import ckpt

CKPT_PLUGIN_API = 2
__version__ = "1.0"


def _note(rt: ckpt.Runtime, **fields: Any) -> None:
    directory = os.environ.get("CKPT_TEST_RANKEVENTS")
    if directory:
        line = json.dumps({"at": rt.rank, "thread": threading.current_thread().name, **fields})
        with open(Path(directory) / f"rank{rt.rank}.jsonl", "a") as f:
            f.write(line + "\n")


@ckpt.hookimpl
def ckpt_rank_failed(rt: ckpt.Runtime, rank: int, incarnation: int) -> None:
    if os.environ.get("CKPT_TEST_RANKEVENTS_RAISE"):
        raise RuntimeError(f"cannot live without rank {rank}")
    _note(rt, hook="failed", rank=rank, incarnation=incarnation)


@ckpt.hookimpl
def ckpt_rank_recovered(rt: ckpt.Runtime, rank: int, incarnation: int) -> None:
    _note(rt, hook="recovered", rank=rank, incarnation=incarnation)


@ckpt.hookimpl
def ckpt_restart(rt: ckpt.Runtime, image: Any) -> None:
    _note(rt, hook="restart", recovered=rt.recovered, incarnation=rt.incarnation)
    if rt.recovered and os.environ.get("CKPT_TEST_RANKEVENTS_CRASH"):
        os.kill(os.getpid(), signal.SIGKILL)
    if rt.recovered and rt.incarnation == 1 and os.environ.get("CKPT_TEST_RANKEVENTS_HANG"):
        threading.Event().wait()  # for ever: only the coordinator's phase timeout ends this incarnation
