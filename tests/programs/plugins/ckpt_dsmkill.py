"""Test plugin: kill -9 its own rank at the Nth call of a DSM hook -- mid-lock, mid-barrier, mid-diff.

    CKPT_TEST_DSM_KILL=<hook>:<rank>:<n> CKPT_TEST_DSM_KILL_MARK=DIR ckpt launch --with-plugin ckpt_dsmkill ...

Rank <rank> sends itself SIGKILL at the <n>th call of DSM hook <hook> (one of
`HOOKS`) counted from the first checkpoint it resumed from (a rank killed
before the job's first checkpoint has nothing to recover from).  Just before,
it writes DIR/killed.<rank> (JSON: pid, hook, n, incarnation), whole and exclusively: a
rank kills itself once per job, so its next incarnation, which loads the same
plugin, and a whole-job restart, which counts again, run on.  The hooks run
before remote logging's own implementation of the same hook (plugins run in
registration order and ckpt_remotelog registers its logger when the memory
attaches), so e.g. ``dsm_lock_acquired`` dies holding a lock whose notices are
not logged, and ``dsm_diff_sent`` with some of an interval's diffs at their
homes and the others not (``dsm_diff_sent_in_lock``: the same, counting only the diffs of
intervals closed at a lock's release, whose records are not complete yet).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import ckpt

CKPT_PLUGIN_API = 2
__version__ = "1.0"

KILL_ENV, MARK_ENV = "CKPT_TEST_DSM_KILL", "CKPT_TEST_DSM_KILL_MARK"
HOOKS = (
    "dsm_interval_closing",
    "dsm_diff_sent",
    "dsm_diff_sent_in_lock",  # a dsm_diff_sent while the rank holds a lock: mid-critical-section
    "dsm_lock_acquired",
    "dsm_lock_releasing",
    "dsm_lock_released",
    "dsm_barrier_arriving",
    "dsm_barrier_passed",
)

_armed = False  # a checkpoint was committed since this process started: there is an image to come back from
_calls: dict[str, int] = {}


def _target(rank: int) -> tuple[str, int] | None:
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return None
    hook, victim, n = spec.split(":")
    if hook not in HOOKS:
        raise ValueError(f"{KILL_ENV}: unknown hook {hook!r} (one of {', '.join(HOOKS)})")
    return (hook, int(n)) if int(victim) == rank else None


@ckpt.hookimpl
def ckpt_init(rt: ckpt.Runtime) -> None:
    _target(rt.rank)  # a misspelt hook fails the job at start, not never


@ckpt.hookimpl
def ckpt_resume(rt: ckpt.Runtime, restarted: bool, aborted: bool) -> None:
    global _armed
    _armed = _armed or not aborted


def _tick(memory: Any, hook: str) -> None:
    if not _armed:
        return
    target = _target(int(memory.rank))
    if target is None or target[0] != hook:
        return
    _calls[hook] = _calls.get(hook, 0) + 1
    if _calls[hook] != target[1]:
        return
    mark = Path(os.environ[MARK_ENV]) / f"killed.{memory.rank}"
    # written whole under another name, then linked into place: the mark appears with its contents (a test
    # waits for it to exist and then reads it), and only once (link fails if it exists)
    incarnation = int(getattr(memory.rt, "incarnation", 0))
    draft = mark.with_name(f"{mark.name}.{os.getpid()}.draft")
    draft.write_text(json.dumps({"pid": os.getpid(), "hook": hook, "n": target[1], "incarnation": incarnation}))
    try:
        os.link(draft, mark)
    except FileExistsError:
        return  # this rank was killed once already in this job
    finally:
        draft.unlink()
    os.kill(os.getpid(), signal.SIGKILL)


@ckpt.hookimpl
def dsm_interval_closing(memory: Any, interval: int) -> None:
    _tick(memory, "dsm_interval_closing")


@ckpt.hookimpl
def dsm_diff_sent(memory: Any, gid: int, home: int, interval: int, nbytes: int) -> None:
    _tick(memory, "dsm_diff_sent")
    if memory.held:
        _tick(memory, "dsm_diff_sent_in_lock")


@ckpt.hookimpl
def dsm_lock_acquired(memory: Any, lock: int, seconds: float) -> None:
    _tick(memory, "dsm_lock_acquired")


@ckpt.hookimpl
def dsm_lock_releasing(memory: Any, lock: int) -> None:
    _tick(memory, "dsm_lock_releasing")


@ckpt.hookimpl
def dsm_lock_released(memory: Any, lock: int) -> None:
    _tick(memory, "dsm_lock_released")


@ckpt.hookimpl
def dsm_barrier_arriving(memory: Any, epoch: int, notices: Any) -> None:
    _tick(memory, "dsm_barrier_arriving")


@ckpt.hookimpl
def dsm_barrier_passed(memory: Any, epoch: int) -> None:
    _tick(memory, "dsm_barrier_passed")
