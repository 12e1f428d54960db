"""One job as the coordinator sees it: membership, barriers, collectives and the checkpoint phases."""

# The checkpoint protocol is DMTCP's: a sequence of named global barriers that
# every rank's checkpoint thread walks,
#
#   ckptN:reach -> ckptN:PRESUSPEND -> ckptN:DRAIN -> ckptN:CHECKPOINT -> ckptN:RESUME
#
# and on restart  genG:RESTART -> genG:REFRESH -> genG:RESUME.
#
# `reach` is ours: each rank reports the step boundary it can still reach
# without help (its current step + 1, or the boundary it is holding at), and the
# target boundary is the maximum, so no rank parks while a peer still waits for
# it inside a step.  That is only deadlock-free when collectives are
# step-aligned; when they are not, some rank sits in a collective that a parked
# rank will never enter.  The coordinator sees both (it serves collectives and
# barriers), so it aborts the checkpoint with a message naming the ranks, their
# steps and the collective, and the job goes on.
#
# Invariants: at most one checkpoint is in progress; a checkpoint exists only
# once its manifest is written (the CHECKPOINT barrier writes it before anyone
# is released); an aborted checkpoint leaves no files behind; a lost rank fails
# the job (the previous checkpoint stays the latest).

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt._errors import CkptError, ImageError
from ckpt.coordinator._scheduler import Scheduler, Timer
from ckpt.coordinator.kvstore import KeyValueStore, Reply
from ckpt.runtime import manifest as manifests

log = logging.getLogger(__name__)

#: Rank states of a live job, in the order `ckpt status` takes the minimum over.  A rank that is lost
#: is "failed"; when the job ends, ranks that had not finished are "killed" (by a request, or because
#: another rank failed).  The job's own state is also "waiting" (ranks still joining) or its end.
STATES = ("running", "presuspend", "drain", "checkpoint", "resume", "restart", "refresh", "finished")
_PHASE_STATE = {
    "reach": "presuspend",
    "PRESUSPEND": "drain",
    "DRAIN": "checkpoint",
    "CHECKPOINT": "resume",
    "RESTART": "refresh",
    "REFRESH": "resume",
}

Push = Callable[[int, dict[str, Any]], None]


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    state: str = "running"
    step: int = 0
    finished: bool = False
    result: str | None = None
    connected: bool = True
    plugins: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Arrival:
    value: Any
    reply: Reply
    kind: str = ""
    step: int = 0


@dataclass
class _Checkpoint:
    number: int
    kill: bool
    started: float
    waiters: list[Reply] = field(default_factory=list)
    stage: str = "reach"
    manifest: dict[str, Any] | None = None
    timer: Timer | None = None
    failure: str = ""


@dataclass
class JobSettings:
    token: str
    ckpt_dir: Path
    interval: float | None = None
    keep: int = 0
    phase_timeout: float = 300.0
    address: str = ""
    job_id: str = ""  # known before any rank joins when a launcher runs the coordinator
    #: the phase timeout a manifest records when it differs from the one in force (a --debug restart's)
    recorded_phase_timeout: float | None = None

    def recorded(self) -> dict[str, Any]:
        """The settings a manifest records, for a restart to reuse."""
        phase_timeout = self.phase_timeout if self.recorded_phase_timeout is None else self.recorded_phase_timeout
        return {"interval": self.interval, "keep": self.keep, "phase_timeout": phase_timeout}


class Job:
    """Everything about one job; every method is called with the coordinator's lock held."""

    def __init__(self, settings: JobSettings, push: Push, scheduler: Scheduler) -> None:
        self.settings = settings
        self._push = push
        self._scheduler = scheduler
        self.kv = KeyValueStore()
        self.job_id = settings.job_id
        self.size = 0
        self.generation = 0
        self.program: dict[str, Any] = {}
        self.argv: list[str] = []
        #: what a restart reuses unless told otherwise: --with-plugin modules, plugin option values
        self.with_plugins: list[str] = []
        self.options: dict[str, Any] = {}
        self.transport = ""  # the ranks name it in their hello
        self.native = False
        self.restarting = False
        self.ranks: dict[int, RankInfo] = {}
        self.outcome: dict[str, Any] | None = None
        self.message = ""
        self.last_checkpoint: dict[str, Any] | None = None
        self._next_number = 1
        self._barriers: dict[str, dict[int, _Arrival]] = {}
        self._collectives: dict[int, dict[int, _Arrival]] = {}
        self._ckpt: _Checkpoint | None = None
        self._queued: _Checkpoint | None = None
        self._interval_timer: Timer | None = None
        self._complete_announced = False
        self._restart_timer: Timer | None = None
        self._aborted: set[int] = set()
        self._ending = False  # fail() or kill() is ending the job
        #: rank -> (bytes loaded, bytes total) while a restart loads images
        self.progress: dict[int, tuple[int, int]] = {}
        self.on_end: Callable[[], None] = lambda: None

    # ----------------------------------------------------------- membership
    def join(self, hello: dict[str, Any]) -> dict[str, Any]:
        """Admit a rank; returns the welcome fields. Raises CkptError with the reason to refuse."""
        if self.outcome is not None:
            raise CkptError(f"job {self.job_id} has already ended ({self.outcome['status']})")
        rank, size = int(hello["rank"]), int(hello["size"])
        if not self.ranks:
            self._adopt(hello)
        if size != self.size:
            raise CkptError(f"rank {rank} says the job has {size} ranks, the coordinator has {self.size}")
        if not 0 <= rank < size:
            raise CkptError(f"rank {rank} is out of range for a job of {size} ranks")
        if rank in self.ranks:
            raise CkptError(f"rank {rank} has already joined job {self.job_id}")
        if hello.get("program", {}).get("name") != self.program.get("name"):
            raise CkptError(
                f"rank {rank} runs program {hello.get('program', {}).get('name')!r}, "
                f"the job runs {self.program.get('name')!r}"
            )
        if bool(hello.get("restart")) != self.restarting:
            raise CkptError(f"rank {rank} {'restarts' if hello.get('restart') else 'launches'} but the job does not")
        info = RankInfo(rank, int(hello.get("pid", 0)), str(hello.get("host", "")))
        info.plugins = list(hello.get("plugins", []))
        info.step = int(hello.get("step", 0))
        info.finished = bool(hello.get("finished", False))
        info.result = hello.get("result")
        info.state = "restart" if self.restarting else "finished" if info.finished else "running"
        self.ranks[rank] = info
        return {
            "job": self.job_id,
            "generation": self.generation,
            "size": self.size,
            "ckpt_dir": str(self.settings.ckpt_dir),
        }

    def joined(self) -> None:
        """Called once the new rank's connection can receive pushes (after its welcome)."""
        if self.all_joined() and not self._complete_announced:
            self._complete_announced = True
            self.message = f"all {self.size} ranks joined (generation {self.generation})"
            log.info("job %s: %s", self.job_id, self.message)
            if not self.restarting:
                self._arm_interval()
                self._start_queued()

    def _adopt(self, hello: dict[str, Any]) -> None:
        """The first rank to join defines the job (so an external coordinator needs no flags)."""
        self.size = int(hello["size"])
        self.program = dict(hello.get("program", {}))
        self.argv = list(hello.get("argv", []))
        self.with_plugins = [str(m) for m in hello.get("with_plugins", [])]
        self.options = dict(hello.get("options", {}))
        self.transport = str(hello.get("transport", ""))
        self.native = bool(hello.get("native", False))
        restart = hello.get("restart")
        if restart:
            self.restarting = True
            self._arm_restart_timer("RESTART")
            self.job_id = str(restart["job"])
            self.generation = int(restart["generation"]) + 1
            self.kv.id_counters = {str(k): int(v) for k, v in restart.get("id_counters", {}).items()}
            self._next_number = int(restart["number"]) + 1
            self.last_checkpoint = restart.get("last_checkpoint")
        else:
            self.job_id = str(hello.get("job") or self.job_id or uuid.uuid4().hex[:12])
        log.info("job %s: %d ranks of %s", self.job_id, self.size, self.program.get("name"))
        name = str(self.program.get("name", "program"))
        self._next_number = max(self._next_number, manifests.next_number(self.settings.ckpt_dir, name))
        self.kv.new_generation(self.generation)

    def _live(self) -> list[int]:
        return sorted(r for r, info in self.ranks.items() if info.connected)

    def all_joined(self) -> bool:
        return self.size > 0 and len(self.ranks) == self.size

    def rank_lost(self, rank: int, cause: str = "") -> None:
        """The rank's connection closed (or went silent: `cause` says so)."""
        info = self.ranks.get(rank)
        if info is None or not info.connected:
            return
        info.connected = False
        if self.outcome is not None:
            return  # the job already ended; ranks leaving is expected
        info.state = "failed"
        where = f"during checkpoint {self._ckpt.number} ({self._ckpt.stage})" if self._ckpt else f"at step {info.step}"
        reason = f"rank {rank} (pid {info.pid} on {info.host}) was lost {where}{f' ({cause})' if cause else ''}"
        self._end_checkpoint(reason)
        latest = self.last_checkpoint["number"] if self.last_checkpoint else None
        tail = f"; the latest checkpoint is {latest}" if latest else "; there is no checkpoint to restart from"
        self.fail(reason + tail)

    def fail(self, message: str, *, detail: str = "") -> None:
        """End the job as failed; `detail` is the failing program's traceback, shown once with `message`."""
        if self.outcome is not None:
            return  # only the first failure is the job's: the others follow from it
        self._ending = True  # the checkpoint's abort must not end the job as "finished" first
        self._end_checkpoint(message)
        self.message = message
        self._end({"status": "failed", "message": message, **({"traceback": detail} if detail else {})})
        for rank in self._live():
            self._push(rank, {"op": "kill", "reason": message})

    def kill(self, reason: str, *, push: bool = True) -> None:
        if self.outcome is not None:
            return
        self._ending = True
        self._end_checkpoint(reason)
        self.message = reason
        self._end({"status": "killed", "message": reason})
        for rank in self._live() if push else ():
            self._push(rank, {"op": "kill", "reason": reason})

    def _end_checkpoint(self, reason: str) -> None:
        """The job ends with a checkpoint in progress: abort it, unless its manifest is already written."""
        ckpt = self._ckpt
        if ckpt is None:
            return
        if ckpt.manifest is None:
            self._abort(reason)
            return
        # Committed (a rank died in RESUME, say): it is the latest checkpoint, and its waiters hear so.
        self._ckpt = None
        if ckpt.timer:
            ckpt.timer.cancel()
        for waiter in ckpt.waiters:
            waiter({"checkpoint": self.last_checkpoint})
        ckpt.waiters = []

    def _end(self, outcome: dict[str, Any]) -> None:
        outcome["results"] = {r: info.result for r, info in sorted(self.ranks.items())}
        outcome["last_checkpoint"] = self.last_checkpoint
        self.outcome = outcome
        status = outcome["status"]
        for info in self.ranks.values():
            if status == "finished" or (info.finished and info.state == "finished"):
                info.state = "finished"
            elif info.state != "failed":
                info.state = "killed"  # by a kill request, or by the coordinator because the job failed
        if self._interval_timer:
            self._interval_timer.cancel()
        for waiter in self._take_waiters():
            waiter({"error": f"job ended ({status}) before the checkpoint completed"})
        log.info("job %s ended (%s): %s", self.job_id, status, outcome["message"])
        self.on_end()

    def finished(self, rank: int, result: str | None, step: int) -> None:
        info = self.ranks[rank]
        info.finished, info.result, info.step = True, result, step
        if self._ckpt is None:
            info.state = "finished"
        self._maybe_done()
        self._check_stuck()
        self._fail_hopeless_collectives()

    def _maybe_done(self) -> None:
        if self.outcome is None and self._ckpt is None and self.all_joined() and not self.restarting:
            if all(info.finished for info in self.ranks.values()):
                self.message = "all ranks finished"
                self._end({"status": "finished", "message": self.message})
                for rank in self._live():
                    self._push(rank, {"op": "done"})

    # ----------------------------------------------------------- collectives
    def collective(self, rank: int, seq: int, kind: str, step: int, data: Any, reply: Reply) -> None:
        """A program collective (allgather / barrier): matched by per-rank sequence number."""
        arrivals = self._collectives.setdefault(seq, {})
        arrivals[rank] = _Arrival(data, reply, kind, step)
        self.ranks[rank].step = step
        kinds = {a.kind for a in arrivals.values()}
        if len(kinds) > 1:
            detail = ", ".join(f"rank {r}: {a.kind} in step {a.step}" for r, a in sorted(arrivals.items()))
            self._fail_collective(seq, f"collective #{seq} does not match across ranks ({detail})")
            return
        if len(arrivals) == self.size:
            del self._collectives[seq]
            values = [arrivals[r].value for r in range(self.size)]
            for arrival in arrivals.values():
                arrival.reply({"values": values})
            return
        self._fail_hopeless_collectives()
        self._check_stuck()
        self._fail_deadlocked_collectives()

    def _fail_deadlocked_collectives(self) -> None:
        """Every rank that could still enter a collective waits in one, and none has every rank: none ever will.

        A collective completes as soon as every rank has entered it (matched by per-rank sequence number), so
        in a sound job all waiting ranks wait in the same one.  Ranks in different ones have images of
        different moments (or a program whose ranks call collectives a different number of times).
        """
        if self._ckpt is not None or not self.all_joined():
            return  # parked ranks are _check_stuck's business
        waiting = {r: (seq, a) for seq, arrivals in self._collectives.items() for r, a in arrivals.items()}
        active = [r for r, info in self.ranks.items() if info.connected and not info.finished]
        if not active or any(r not in waiting for r in active):
            return
        detail = ", ".join(f"rank {r} in {a.kind} #{seq} (step {a.step})" for r, (seq, a) in sorted(waiting.items()))
        message = f"collectives out of step, none can complete: {detail}"
        for seq in list(self._collectives):
            self._fail_collective(seq, message)

    def _fail_collective(self, seq: int, message: str) -> None:
        for arrival in self._collectives.pop(seq, {}).values():
            arrival.reply({"error": message})

    def _fail_hopeless_collectives(self) -> None:
        for seq, arrivals in list(self._collectives.items()):
            gone = [r for r, info in self.ranks.items() if r not in arrivals and info.finished]
            if gone:
                kind = next(iter(arrivals.values())).kind
                self._fail_collective(
                    seq, f"{kind} #{seq} can never complete: rank(s) {gone} finished without entering it"
                )

    # ----------------------------------------------------------- named barriers
    def barrier(self, rank: int, name: str, value: Any, reply: Reply) -> None:
        """A named global barrier (runtime phases and plugins); a name mismatch is reported, not hung on."""
        prefix = name.partition(":")[0]
        if prefix.startswith("ckpt") and prefix[4:].isdigit() and int(prefix[4:]) in self._aborted:
            reply({"abort": f"checkpoint {prefix[4:]} was aborted"})  # a latecomer: do not wait for anyone
            return
        for other, arrivals in self._barriers.items():
            if other != name and arrivals:
                where = ", ".join(f"rank {r}" for r in sorted(arrivals))
                message = f"barrier name mismatch: rank {rank} arrived at {name!r} while {where} wait at {other!r}"
                reply({"error": message})
                for arrival in self._barriers.pop(other).values():
                    arrival.reply({"error": message})
                if self._ckpt is not None:
                    self._abort(message)
                return
        arrivals = self._barriers.setdefault(name, {})
        arrivals[rank] = _Arrival(value, reply)
        phase = name.partition(":")[2]
        if phase in _PHASE_STATE or phase == "RESUME":
            self.ranks[rank].state = {"reach": "presuspend"}.get(phase, phase.lower())
        if len(arrivals) < self.size:
            self._check_stuck()  # a rank arriving at PRESUSPEND (or a plugin barrier) may complete the picture
            return
        del self._barriers[name]
        values = [arrivals[r].value if r in arrivals else None for r in range(self.size)]
        extra = self._barrier_complete(name, values)
        for arrival in arrivals.values():
            arrival.reply({"values": values, **extra})
        self._after_barrier(name)

    def _barrier_complete(self, name: str, values: list[Any]) -> dict[str, Any]:
        """What completing a phase barrier does before anyone is released."""
        prefix, _, phase = name.partition(":")
        if phase not in _PHASE_STATE and phase != "RESUME":
            return {}  # a plugin's own barrier: no phase ends here
        for info in self.ranks.values():
            if phase in _PHASE_STATE:
                info.state = _PHASE_STATE[phase]
            else:
                info.state = "finished" if info.finished else "running"
        ckpt = self._ckpt
        if ckpt is None or prefix != f"ckpt{ckpt.number}":
            return {}
        if ckpt.timer:
            ckpt.timer.cancel()
        ckpt.stage = _PHASE_STATE.get(phase, "done")
        if phase == "CHECKPOINT":
            errors = [f"rank {r}: {v['error']}" for r, v in enumerate(values) if isinstance(v, dict) and "error" in v]
            try:
                if errors:
                    raise CkptError("; ".join(errors))
                ckpt.manifest = self._write_manifest(ckpt, values)
            except (CkptError, OSError) as exc:
                ckpt.failure = f"checkpoint {ckpt.number} could not be written: {exc}"
                return {"abort": ckpt.failure}
        if phase != "RESUME":
            ckpt.timer = self._arm_phase_timer(ckpt)
        if phase == "CHECKPOINT":
            return {"manifest": ckpt.manifest["path"] if ckpt.manifest else None, "kill": ckpt.kill}
        return {}

    def _after_barrier(self, name: str) -> None:
        prefix, _, phase = name.partition(":")
        ckpt = self._ckpt
        if prefix == f"gen{self.generation}" and self.restarting and phase in ("RESTART", "REFRESH"):
            self._arm_restart_timer({"RESTART": "REFRESH", "REFRESH": "RESUME"}[phase])
        if prefix == f"gen{self.generation}" and phase == "RESUME" and self.restarting:
            self.restarting = False
            if self._restart_timer:
                self._restart_timer.cancel()
            self.message = f"restarted as generation {self.generation}"
            self._arm_interval()
            self._maybe_done()
            self._start_queued()
            return
        if ckpt is None or prefix != f"ckpt{ckpt.number}":
            return
        if phase == "CHECKPOINT":
            if ckpt.manifest is None:
                self._abort(ckpt.failure)
            elif ckpt.kill:
                # the ranks were told in the barrier's reply: they run their checkpointed and exit
                # hooks and exit on their own, so no kill push races with those hooks
                self._complete(ckpt, kill=True, push=False)
        elif phase == "RESUME":
            # a --kill that joined after the CHECKPOINT barrier: the ranks resumed, so push it
            self._complete(ckpt, kill=ckpt.kill, push=True)

    # ----------------------------------------------------------- checkpoints
    def request_checkpoint(self, *, kill: bool, waiter: Reply | None) -> dict[str, Any]:
        """Start a checkpoint, or join the one in progress / queued.

        Returns {"number"} ({"number": 0, "queued": True} while the job is not running yet: the
        number is only taken when the checkpoint starts, once the restarted job knows its last
        one) or {"error"}.
        """
        if self.outcome is not None:
            return {"error": f"the job has ended ({self.outcome['status']})"}
        if self.native:
            return {"error": "the job runs with --native: no checkpoint thread, checkpoints are disabled"}
        target = self._ckpt or self._queued
        if target is None:
            target = _Checkpoint(0, kill, time.time())
            if self.all_joined() and not self.restarting:
                self._start(target)
            else:
                self._queued = target
        target.kill = target.kill or kill
        if waiter is not None:
            target.waiters.append(waiter)
        return {"number": target.number, "queued": target is self._queued}

    def abort_checkpoint(self, number: int, reason: str) -> None:
        """A rank cannot complete checkpoint `number` (a plugin failed): abort it for everyone."""
        if self._ckpt is not None and self._ckpt.number == number:
            self._abort(reason)

    def _start_queued(self) -> None:
        if (
            self._queued is not None
            and self._ckpt is None
            and self.outcome is None
            and self.all_joined()
            and not self.restarting
        ):
            queued, self._queued = self._queued, None
            self._start(queued)

    def _start(self, ckpt: _Checkpoint) -> None:
        ckpt.number = self._next_number
        self._next_number += 1
        self._ckpt = ckpt
        ckpt.started = time.time()
        self.message = f"checkpoint {ckpt.number} in progress"
        log.info("checkpoint %d started%s", ckpt.number, " (then the job ends)" if ckpt.kill else "")
        ckpt.timer = self._arm_phase_timer(ckpt)
        for rank in self._live():
            self._push(rank, {"op": "suspend", "number": ckpt.number})

    def _arm_phase_timer(self, ckpt: _Checkpoint) -> Timer:
        return self._scheduler.call_at(
            time.monotonic() + self.settings.phase_timeout, lambda: self._phase_timeout(ckpt)
        )

    def _phase_timeout(self, ckpt: _Checkpoint) -> None:
        if self._ckpt is not ckpt:
            return  # that checkpoint has ended
        barrier = _stage_barrier(ckpt.stage)
        waiting = self._barriers.get(f"ckpt{ckpt.number}:{barrier}", {})
        blocked = {r: (seq, a) for seq, arr in self._collectives.items() for r, a in arr.items()}
        late = []
        for rank in (r for r in self._live() if r not in waiting):
            if rank in blocked:
                seq, arrival = blocked[rank]
                late.append(f"rank {rank} (in {arrival.kind} #{seq} of step {arrival.step})")
            else:
                late.append(f"rank {rank} (near step {self.ranks[rank].step})")
        what = "park at the step boundary" if barrier == "PRESUSPEND" else f"finish {barrier}"
        self._abort(f"{', '.join(late)} did not {what} within {self.settings.phase_timeout:g} s")

    def _check_stuck(self) -> None:
        """Abort when parked ranks and ranks blocked in collectives wait for each other forever."""
        ckpt = self._ckpt
        if ckpt is None or ckpt.stage != "presuspend":
            return
        # parked: at PRESUSPEND, or inside a presuspend hook's own barrier (ckptN:plugin:...)
        parked = {
            rank
            for name, arrivals in self._barriers.items()
            if name.startswith(f"ckpt{ckpt.number}:") and name != f"ckpt{ckpt.number}:reach"
            for rank in arrivals
        }
        parked |= {r for r, info in self.ranks.items() if info.finished}
        blocked = {r: (seq, a) for seq, arr in self._collectives.items() for r, a in arr.items()}
        if not blocked or not set(self._live()) <= parked | set(blocked):
            return
        parts = []
        for rank, (seq, arrival) in sorted(blocked.items()):
            missing = sorted(set(range(self.size)) - set(self._collectives[seq]))
            parts.append(f"rank {rank} is in {arrival.kind} #{seq} (step {arrival.step}) waiting for rank(s) {missing}")
        boundary = ", ".join(f"rank {r} at step {self.ranks[r].step}" for r in sorted(parked - set(blocked)))
        self._abort("collectives are not step-aligned: " + "; ".join(parts) + f", which are parked ({boundary})")

    def _abort(self, reason: str) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is None:
            return
        if ckpt.timer:
            ckpt.timer.cancel()
        self._aborted.add(ckpt.number)  # its barriers answer latecomers at once
        committed = ckpt.manifest is not None  # a RESUME that timed out, say: the checkpoint exists
        if committed:
            message = f"checkpoint {ckpt.number} was written, but its RESUME phase failed: {reason}"
        elif reason.startswith(f"checkpoint {ckpt.number} "):
            message = reason
        else:
            message = f"checkpoint {ckpt.number} aborted: {reason}"
        log.warning("%s", message)
        self.message = message
        for name in list(self._barriers):  # phase barriers and plugins' own barriers inside hooks
            for arrival in self._barriers.pop(name).values():
                arrival.reply({"abort": message})
        for rank in self._live():
            self._push(rank, {"op": "abort", "number": ckpt.number, "reason": message})
            info = self.ranks[rank]
            info.state = "finished" if info.finished else "running"
        self._remove_images(ckpt.number)  # nothing of a committed one: its manifest protects it
        for waiter in ckpt.waiters:
            waiter({"checkpoint": self.last_checkpoint} if committed else {"error": message})
        self._arm_interval()
        if not self._ending:
            self._maybe_done()

    def _remove_images(self, number: int) -> None:
        try:
            manifests.remove_unreferenced(self.settings.ckpt_dir, self.program.get("name", ""), number)
        except (OSError, ImageError) as exc:
            log.warning("cannot clean up checkpoint %d: %s", number, exc)

    def remove_aborted_images(self) -> None:
        for number in sorted(self._aborted):
            self._remove_images(number)

    def _complete(self, ckpt: _Checkpoint, *, kill: bool = False, push: bool = False) -> None:
        self._ckpt = None
        if ckpt.timer:
            ckpt.timer.cancel()
        assert ckpt.manifest is not None
        self.message = f"checkpoint {ckpt.number} written: {ckpt.manifest['path']}"
        log.info("%s", self.message)
        waiters, ckpt.waiters = ckpt.waiters, []
        for waiter in waiters:
            waiter({"checkpoint": self.last_checkpoint})
        if kill:  # before anything could end the job as "finished" and push done
            self.kill(f"killed after checkpoint {ckpt.number}", push=push)
            return
        self._arm_interval()
        self._start_queued()
        self._maybe_done()

    def _take_waiters(self) -> list[Reply]:
        waiters: list[Reply] = []
        for ckpt in (self._ckpt, self._queued):
            if ckpt is not None:
                waiters += ckpt.waiters
                ckpt.waiters = []
        return waiters

    def _write_manifest(self, ckpt: _Checkpoint, images: list[Any]) -> dict[str, Any]:
        ranks = []
        for rank, image in enumerate(images):
            info = self.ranks[rank]
            ranks.append({"rank": rank, "host": info.host, "pid": info.pid, **image})
        seconds = time.time() - ckpt.started
        manifest = {
            "job": self.job_id,
            "program": self.program,
            "argv": self.argv,
            "size": self.size,
            "number": ckpt.number,
            "generation": self.generation,
            "created": time.time(),
            "seconds": seconds,
            "transport": self.transport,
            "plugins": self.ranks[0].plugins if self.ranks else [],
            "with_plugins": self.with_plugins,
            "options": self.options,
            "settings": self.settings.recorded(),
            "coordinator": self.settings.address,
            "id_counters": dict(self.kv.id_counters),
            "ranks": ranks,
        }
        token = self.settings.token.encode()
        path = manifests.write_manifest(self.settings.ckpt_dir, manifest, token=token)
        total = sum(int(r.get("bytes", 0)) for r in ranks)
        self.last_checkpoint = {"number": ckpt.number, "manifest": str(path), "bytes": total, "seconds": seconds}
        if self.settings.keep:
            manifests.prune(self.settings.ckpt_dir, str(self.program.get("name", "")), self.settings.keep)
        return {"path": str(path)}

    def _arm_restart_timer(self, phase: str) -> None:
        """A restart that does not reach `phase` within the phase timeout fails (it cannot be aborted)."""
        if self._restart_timer:
            self._restart_timer.cancel()

        def expired() -> None:
            if self.restarting and self.outcome is None:
                there = set(self._barriers.get(f"gen{self.generation}:{phase}", {}))
                late = sorted(set(range(self.size)) - there)
                self.fail(
                    f"restart failed: rank(s) {late} did not reach {phase} within {self.settings.phase_timeout:g} s"
                )

        self._restart_timer = self._scheduler.call_at(time.monotonic() + self.settings.phase_timeout, expired)

    def _arm_interval(self) -> None:
        if self._interval_timer:
            self._interval_timer.cancel()
            self._interval_timer = None
        if self.settings.interval and self.outcome is None and not self.native:
            self._interval_timer = self._scheduler.call_at(
                time.monotonic() + self.settings.interval, self._interval_due
            )

    def _interval_due(self) -> None:
        self._interval_timer = None
        if self._ckpt is None and self.outcome is None:
            self.request_checkpoint(kill=False, waiter=None)

    # ----------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        ranks = [
            {
                "rank": r,
                "state": info.state,
                "step": info.step,
                "host": info.host,
                "pid": info.pid,
                "incarnation": 0,
            }
            for r, info in sorted(self.ranks.items())
        ]
        states = [r["state"] for r in ranks]
        live = [s for s in states if s in STATES]
        if self.outcome is not None:
            state = max_state = str(self.outcome["status"])
        elif not self.all_joined():
            state = "waiting"
            max_state = max(live, key=STATES.index) if live else state
        else:
            state = min(live, key=STATES.index) if live else "failed"
            max_state = max(live, key=STATES.index) if live else state
        return {
            "job": self.job_id,
            "generation": self.generation,
            "size": self.size,
            "state": state,
            "max_state": max_state,
            "unanimous": len(set(states)) <= 1,
            "ranks": ranks,
            "last_checkpoint": self.last_checkpoint,
            "checkpoint_in_progress": self._ckpt.number if self._ckpt else None,
            "message": self.message,
            "coordinator": self.settings.address,
            "ckpt_dir": str(self.settings.ckpt_dir),
            "pid": os.getpid(),
        }


def _stage_barrier(stage: str) -> str:
    return {"reach": "reach", "presuspend": "PRESUSPEND", "drain": "DRAIN", "checkpoint": "CHECKPOINT"}.get(
        stage, "RESUME"
    )
