"""One job's membership as the coordinator sees it: ranks joining and ending, collectives and named barriers."""

# This is what the coordinator serves whether or not a checkpoint runs; the
# checkpoint and restart state machine on top of it is `Job` (job.py), which
# implements the abstract methods below.  A barrier or a collective is matched
# by name (barriers) or per-rank sequence number (collectives); a mismatch is
# reported to everyone waiting, never hung on.

from __future__ import annotations

import abc
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ckpt import _manifest as manifests
from ckpt._errors import CkptError
from ckpt._schemas import JobRecord, ProgramInfo
from ckpt.coordinator import protocol
from ckpt.coordinator._failures import FailureReport
from ckpt.coordinator._recovery import RankRecovery
from ckpt.coordinator._scheduler import Scheduler, Timer
from ckpt.coordinator.kvstore import KeyValueStore, Reply
from ckpt.plugin import STATS_NS, Phase

# One logger for the whole job (its membership here, its checkpoints in job.py): what users filter on.
log = logging.getLogger("ckpt.coordinator.job")

#: Rank states of a live job, in the order `ckpt status` takes the minimum over: running, then each
#: phase's state in the order of a checkpoint and of a restart, then finished.  A rank that is lost is
#: "failed" (under --on-failure recover: until its next incarnation rejoins, "recovering" until that
#: one's RESUME; neither counts in the job's state, which stays the live ranks'); when the job
#: ends, ranks that had not finished are "killed" (by a request, or because
#: another rank failed).  The job's own state is also "waiting" (ranks still joining), "recovering"
#: (no rank live but the job not over: every one failed or recovering) or its end ("finished", "failed",
#: "killed", or "fallback": a rank asked for a whole-job restart, which its launcher runs as a new job).
STATES = (
    "running",
    *dict.fromkeys(phase.state for phase in (*Phase.checkpoint_sequence(), *Phase.restart_sequence())),
    "finished",
)

#: Sends a push to a rank (if it is still connected).
Push = Callable[[int, protocol.Push], None]


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
    #: 0 at launch, one more per single-rank recovery; a whole-job restart keeps it
    incarnation: int = 0


@dataclass
class _Arrival:
    value: Any
    reply: Reply
    kind: str = ""
    step: int = 0


@dataclass
class Checkpoint:
    """A checkpoint asked for: queued (number 0 until it starts), then in progress."""

    number: int
    kill: bool = False
    started: float = 0.0
    waiters: list[Reply] = field(default_factory=list)
    #: The phase whose barrier it waits at; None once RESUME is complete.
    stage: Phase | None = Phase.REACH
    #: Its manifest's path, once written: from then on the checkpoint exists.
    manifest: str | None = None
    timer: Timer | None = None
    failure: str = ""

    @property
    def stage_name(self) -> str:
        """The stage for messages: the phase it is in (lower case), or "done"."""
        return self.stage.value.lower() if self.stage is not None else "done"


@dataclass
class JobSettings:
    token: str
    ckpt_dir: Path
    interval: float | None = None
    keep: int = 0
    phase_timeout: float = 300.0
    #: independent checkpoints of each rank every so many seconds, staggered (--rank-interval)
    rank_interval: float | None = None
    address: str = ""
    job_id: str = ""  # known before any rank joins when a launcher runs the coordinator
    #: the phase timeout a manifest records when it differs from the one in force (a --debug restart's)
    recorded_phase_timeout: float | None = None

    def recorded(self) -> JobRecord:
        """The settings a manifest records, for a restart to reuse."""
        phase_timeout = self.phase_timeout if self.recorded_phase_timeout is None else self.recorded_phase_timeout
        return JobRecord(
            interval=self.interval, keep=self.keep, phase_timeout=phase_timeout, rank_interval=self.rank_interval
        )


class JobMembership(abc.ABC):
    """Everything about one job but its checkpoints; every method is called with the coordinator's lock held."""

    def __init__(self, settings: JobSettings, push: Push, scheduler: Scheduler) -> None:
        self.settings = settings
        self._push = push
        self._scheduler = scheduler
        self.kv = KeyValueStore()
        self.job_id = settings.job_id
        self.size = 0
        self.generation = 0
        #: the program the first rank to join runs (None until one has)
        self.program: ProgramInfo | None = None
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
        self._ckpt: Checkpoint | None = None
        self._queued: Checkpoint | None = None
        self._interval_timer: Timer | None = None
        self._complete_announced = False
        self._restart_timer: Timer | None = None
        self._aborted: set[int] = set()
        #: warns of failed coordinated checkpoints without repeating itself (a full disk under --interval)
        self.failures = FailureReport()
        #: coordinated checkpoint number -> {rank: incarnation} when it started: its phase barriers wait only for
        #: the incarnations that took part (one lost and respawned meanwhile never comes back into them)
        self._members: dict[int, dict[int, int]] = {}
        self._ending = False  # fail() or kill() is ending the job
        #: rank -> (bytes loaded, bytes total) while a restart loads images
        self.progress: dict[int, tuple[int, int]] = {}
        self.on_end: Callable[[], None] = lambda: None
        #: --on-failure recover: failed ranks, their rejoins, the record of collectives (_recovery.py)
        self.recovery = RankRecovery(self)

    # ----------------------------------------------------------- membership
    def join(self, hello: dict[str, Any]) -> dict[str, Any]:
        """Admit a rank; returns the welcome fields. Raises CkptError with the reason to refuse."""
        if self.outcome is not None:
            raise CkptError(f"job {self.job_id} has already ended ({self.outcome['status']})")
        rank, size = int(hello["rank"]), int(hello["size"])
        if not self.ranks:
            if hello.get("recover") is not None:
                raise CkptError(f"rank {rank} asks to rejoin a job that has no failed rank (no rank has joined it)")
            self._adopt(hello)
        if size != self.size:
            raise CkptError(f"rank {rank} says the job has {size} ranks, the coordinator has {self.size}")
        if not 0 <= rank < size:
            raise CkptError(f"rank {rank} is out of range for a job of {size} ranks")
        assert self.program is not None
        if hello.get("program", {}).get("name") != self.program.name:
            raise CkptError(
                f"rank {rank} runs program {hello.get('program', {}).get('name')!r}, the job runs {self.program.name!r}"
            )
        if hello.get("recover") is not None:  # the next incarnation of a failed rank (_recovery.py)
            self.recovery.rejoin(hello, self._rank_info(hello))
            return self._welcome_fields()
        if rank in self.ranks:
            raise CkptError(f"rank {rank} has already joined job {self.job_id}")
        if bool(hello.get("restart")) != self.restarting:
            raise CkptError(f"rank {rank} {'restarts' if hello.get('restart') else 'launches'} but the job does not")
        info = self._rank_info(hello)
        info.state = "restart" if self.restarting else "finished" if info.finished else "running"
        self.ranks[rank] = info
        self.recovery.joined(rank, hello)
        return self._welcome_fields()

    def _rank_info(self, hello: dict[str, Any]) -> RankInfo:
        info = RankInfo(int(hello["rank"]), int(hello.get("pid", 0)), str(hello.get("host", "")))
        info.plugins = list(hello.get("plugins", []))
        info.step = int(hello.get("step", 0))
        info.finished = bool(hello.get("finished", False))
        info.result = hello.get("result")
        info.incarnation = int(hello.get("incarnation", 0))
        return info

    def _welcome_fields(self) -> dict[str, Any]:
        return {
            "job": self.job_id,
            "generation": self.generation,
            "size": self.size,
            "ckpt_dir": str(self.settings.ckpt_dir),
            # under recover, the job's first checkpoint is taken at the first step boundary (`joined`): a rank
            # holds there until it starts, however late its request reaches the rank (a rank past that boundary
            # would move the checkpoint to step 1, and a rank lost meanwhile would fail the job)
            "first_image": bool(self.recovery.on and self.last_checkpoint is None and not self.restarting),
        }

    def joined(self) -> None:
        """Called once the new rank's connection can receive pushes (after its welcome)."""
        if self.all_joined() and not self._complete_announced:
            self._complete_announced = True
            self.message = f"all {self.size} ranks joined (generation {self.generation})"
            log.info("job %s: %s", self.job_id, self.message)
            if not self.restarting:
                if self.recovery.on and self.last_checkpoint is None:
                    # every rank needs an image to be recovered from: one at the first step boundary
                    self.request_checkpoint(kill=False, waiter=None)
                self._arm_interval()
                self._start_queued()

    def _adopt(self, hello: dict[str, Any]) -> None:
        """The first rank to join defines the job (so an external coordinator needs no flags)."""
        try:  # checked once, here: every manifest of the job records it
            program = msgspec.convert(hello.get("program"), ProgramInfo)
        except msgspec.ValidationError as exc:
            raise CkptError(f"rank {hello['rank']} sent a program entry that does not fit: {exc}") from None
        self.size = int(hello["size"])
        self.program = program
        self.argv = list(hello.get("argv", []))
        self.with_plugins = [str(m) for m in hello.get("with_plugins", [])]
        self.options = dict(hello.get("options", {}))
        self.transport = str(hello.get("transport", ""))
        self.native = bool(hello.get("native", False))
        self.recovery.adopt(hello)
        restart = hello.get("restart")
        if restart:
            self.restarting = True
            self._arm_restart_timer(Phase.RESTART)
            self.job_id = str(restart["job"])
            self.generation = int(restart["generation"]) + 1
            self.kv.id_counters = {str(k): int(v) for k, v in restart.get("id_counters", {}).items()}
            self._next_number = int(restart["number"]) + 1
            self.last_checkpoint = restart.get("last_checkpoint")
        else:
            self.job_id = str(hello.get("job") or self.job_id or uuid.uuid4().hex[:12])
        log.info("job %s: %d ranks of %s", self.job_id, self.size, program.name)
        self._next_number = max(self._next_number, manifests.next_number(self.settings.ckpt_dir, program.name))
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
        if self.recovery.lost(rank, info, cause):
            return  # --on-failure recover: the job runs on without it until its next incarnation
        info.state = "failed"
        where = (
            f"during checkpoint {self._ckpt.number} ({self._ckpt.stage_name})" if self._ckpt else f"at step {info.step}"
        )
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
            self._push(rank, protocol.KillRank(reason=message))

    def kill(self, reason: str, *, push: bool = True) -> None:
        if self.outcome is not None:
            return
        self._ending = True
        self._end_checkpoint(reason)
        self.message = reason
        self._end({"status": "killed", "message": reason})
        for rank in self._live() if push else ():
            self._push(rank, protocol.KillRank(reason=reason))

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
                    self._push(rank, protocol.Done())

    # ----------------------------------------------------------- collectives
    def collective(self, rank: int, seq: int, kind: str, step: int, data: Any, reply: Reply) -> None:
        """A program collective (allgather / barrier): matched by per-rank sequence number."""
        if self.recovery.replay(rank, seq, kind, reply):  # a recovering rank re-executes a completed one
            self.ranks[rank].step = step
            return
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
            self.recovery.completed(seq, kind, values)
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
        if self._ckpt is not None or not self.all_joined() or self.recovery.busy():
            return  # parked ranks are _check_stuck's business; a failed rank's next incarnation will come
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
    def participants(self, name: str) -> set[int]:
        """Who barrier ``name`` waits for: one rank in that rank's own scope (``rankR.``), else every rank."""
        rank = Phase.rank_of_scope(name)
        if rank is not None:
            return {rank}
        scope = name.partition(":")[0]
        if scope.startswith("ckpt") and scope[4:].isdigit():
            # a failed rank never comes back into a checkpoint's phases (only a committed one's RESUME is left),
            # nor does its next incarnation once recovered: the survivors may reach RESUME after that
            members = self._members.get(int(scope[4:]), {})
            ranks = {r for r, was in members.items() if r in self.ranks and self.ranks[r].incarnation == was}
            if not members:  # a checkpoint this coordinator did not start (none: they all are)
                ranks = set(range(self.size))
            return ranks - self.recovery.absent()
        return set(range(self.size))

    def barrier(self, rank: int, name: str, value: Any, reply: Reply) -> None:
        """A named global barrier (runtime phases and plugins); a name mismatch is reported, not hung on."""
        prefix = name.partition(":")[0].rpartition(".")[2]  # "ckptN" of a job's or of one rank's checkpoint
        if prefix.startswith("ckpt") and prefix[4:].isdigit() and int(prefix[4:]) in self._aborted:
            reply({"abort": f"checkpoint {prefix[4:]} was aborted"})  # a latecomer: do not wait for anyone
            return
        participants = self.participants(name)
        if rank not in participants:
            reply({"error": f"rank {rank} arrived at {name!r}, a barrier of rank(s) {sorted(participants)} only"})
            return
        for other, arrivals in self._barriers.items():
            # only barriers of the same ranks can mismatch: one rank's own phases run beside the job's
            if other != name and arrivals and self.participants(other) == participants:
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
        phase = Phase.of_barrier(name)[1]
        if phase is not None:
            self.ranks[rank].state = phase.state
        if not participants <= set(arrivals):
            self._check_stuck()  # a rank arriving at PRESUSPEND (or a plugin barrier) may complete the picture
            return
        self._release_barrier(name)

    def _release_barrier(self, name: str) -> None:
        """Barrier `name` has every participant: complete it and release them."""
        arrivals = self._barriers.pop(name)
        values = [arrivals[r].value if r in arrivals else None for r in range(self.size)]
        extra = self._barrier_complete(name, values)
        for arrival in arrivals.values():
            arrival.reply({"values": values, **extra})
        self._after_barrier(name)
        self.recovery.barrier_released(name)

    # ----------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        ranks = [
            {
                "rank": r,
                "state": self.recovery.state_of(r, info),
                "step": info.step,
                "host": info.host,
                "pid": info.pid,
                "incarnation": info.incarnation,
                "replay": self.recovery.replay_progress(r),  # [done, total] (RANKS_NS replay/<r>) or None
                "plugins": {  # STATS_NS <r>/<plugin>: what the rank's plugins publish
                    key.partition("/")[2]: value for key, value in self.kv.matching(STATS_NS, f"{r}/").items()
                },
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
        else:  # no live rank but no outcome: every rank is failed or recovering (a 1-rank job, say)
            state = min(live, key=STATES.index) if live else "recovering"
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
            "on_failure": self.recovery.policy,
            "fallbacks": self.recovery.fallbacks.status(),
            "checkpoint_holds": [{"rank": r, "reason": why} for r, why in sorted(self.recovery.holds.items())],
            "program": self.program.name if self.program is not None else None,
            "coordinator": self.settings.address,
            "ckpt_dir": str(self.settings.ckpt_dir),
            "pid": os.getpid(),
        }

    # ----------------------------------------------------------- the checkpoint state machine (job.py)
    @abc.abstractmethod
    def _barrier_complete(self, name: str, values: list[Any]) -> dict[str, Any]:
        """Barrier `name` is complete: what to do before anyone is released; returns fields for the reply."""

    @abc.abstractmethod
    def _after_barrier(self, name: str) -> None:
        """Barrier `name` is complete and everyone released."""

    @abc.abstractmethod
    def _check_stuck(self) -> None:
        """Abort the checkpoint in progress if parked ranks and ranks in collectives wait for each other."""

    @abc.abstractmethod
    def _abort(self, reason: str) -> None:
        """Abort the checkpoint in progress, if any."""

    @abc.abstractmethod
    def _end_checkpoint(self, reason: str) -> None:
        """The job ends: abort the checkpoint in progress unless it is already written."""

    @abc.abstractmethod
    def rank_checkpoint_lost(self, rank: int, reason: str) -> None:
        """Rank `rank` is gone: abort its independent checkpoint in progress and answer its queued one."""

    @abc.abstractmethod
    def _take_waiters(self) -> list[Reply]:
        """Take the replies of everyone waiting for a checkpoint in progress or queued."""

    @abc.abstractmethod
    def _arm_restart_timer(self, phase: Phase) -> None:
        """A restart must reach `phase` within the phase timeout."""

    @abc.abstractmethod
    def _arm_interval(self) -> None:
        """(Re)start the timer of periodic checkpoints."""

    @abc.abstractmethod
    def request_checkpoint(self, *, kill: bool, waiter: Reply | None) -> dict[str, Any]:
        """Start a checkpoint, or join the one in progress / queued."""

    @abc.abstractmethod
    def _start_queued(self) -> None:
        """Start the checkpoint asked for while the job could not take one, if it now can."""
