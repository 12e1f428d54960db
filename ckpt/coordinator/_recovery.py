"""Single-rank recovery on the coordinator (``--on-failure recover``): failed ranks, rejoins, replayed collectives."""

# Why (DESIGN.md §8; FT-KDSM §5): a coordinated restart makes every rank pay for
# one rank's failure.  Under `--on-failure recover` a lost rank does not end the
# job; its slot goes
#
#   running --lost--> failed --rejoin as incarnation K = lost + 1--> recovering --its RESUME--> running
#
# and the survivors hear of both edges (RankFailed / RankRecovered pushes, and
# `RANKS_NS` failed/<R>, incarnation/<R> in the key-value store).  The new
# incarnation loads its own latest image and walks RESTART -> REFRESH -> RESUME
# alone, in its own scope `rankR.incK` (those barriers complete with it alone).
#
# Runtime collectives are what a re-executing rank cannot redo with live peers:
# the survivors have moved on.  A collective completes only once every rank has
# entered it, so the coordinator records each completed collective's values by
# sequence number and answers a re-executed one from the record at once, without
# asking anyone.  Invariant: the record holds every collective after the oldest
# `coll_seq` among the ranks' latest images (each image report carries it), which
# is exactly what a recovery may re-execute; older entries go when a checkpoint
# commits.  A lost rank's arrival in a collective that has not completed is
# dropped: its next incarnation enters it again.
#
# A rank without an image cannot be recovered, so under recover the job asks for
# a checkpoint as soon as every rank has joined (taken at the first step
# boundary, after setup: the welcome's `first_image` holds each rank there until
# it starts), and a rank lost before that fails the job in one line.
# Checkpoints are queued while a rank is failed or recovering: a checkpoint needs
# every rank.  A rank whose new incarnation is lost before its RESUME
# MAX_RECOVERY_ATTEMPTS times in a row fails the job (a crash loop, not bad luck).
#
# The coordinator alone says which image a rank restarts from: `images[R]`, the
# image of R's latest committed checkpoint in *this* run (the files on disk may
# hold newer manifests of a run a whole-job restart rolled back, or a damaged
# newest one).  The respawn callback gets its number and a rejoin bringing any
# other image is refused.  Each phase of a recovering incarnation must complete
# within the phase timeout, or that incarnation counts as lost (killed, one
# attempt used): a hung RESTART would otherwise keep every checkpoint waiting.
#
# When single-rank recovery cannot bring a rank back (its logs went with its log
# home, its replay diverged: FT-KDSM §5's limits), the rank calls `rt.fall_back`:
# under recover, with a launcher, the job ends with the outcome "fallback" and
# the launcher kills every rank and restarts the job from its newest coordinated
# checkpoint on this same coordinator (a new `Job`, generation + 1).  The
# `FallbackRecord` outlives the jobs of one launch: it bounds a loop (a rank that
# falls back MAX_RECOVERY_ATTEMPTS times with no checkpoint committed in between
# fails the job) and `ckpt status` shows it.  A rank whose state an image must
# not hold (it is replaying its logs) holds checkpoints (`rt.hold_checkpoints`):
# every request waits, queued, as while a rank is away, until it releases them
# or is lost.

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ckpt._errors import CkptError
from ckpt.coordinator import protocol
from ckpt.plugin import RANKS_NS, Phase

if TYPE_CHECKING:
    from ckpt.coordinator._membership import JobMembership, RankInfo
    from ckpt.coordinator._scheduler import Timer
    from ckpt.coordinator.kvstore import Reply

# The job's logger (see _membership.py): what users filter on.
log = logging.getLogger("ckpt.coordinator.job")

#: The job policies of ``--on-failure``: the job fails (today's), or the lost rank is respawned.
ABORT: Final = "abort"
RECOVER: Final = "recover"
POLICIES: Final = (ABORT, RECOVER)
#: How many times in a row a rank's new incarnation may be lost before its RESUME before the job fails.
MAX_RECOVERY_ATTEMPTS: Final = 3

#: Called (under the coordinator's lock: it must not block) with (rank, incarnation, number) when a rank must be
#: respawned as that incarnation from its image of checkpoint `number`: the launcher's part.  None: wait for
#: ``ckpt restart --rank R``.
Respawn = Callable[[int, int, int], None]


@dataclass
class FallbackRecord:
    """The whole-job fallbacks of one launch (it outlives each restarted `Job`)."""

    count: int = 0
    #: the last one: the asking rank, its reason and the checkpoint the job restarted from
    rank: int | None = None
    reason: str = ""
    number: int | None = None
    #: fallbacks since a checkpoint (of either kind) was last committed
    in_a_row: int = 0

    def status(self) -> dict[str, Any] | None:
        if not self.count:
            return None
        return {"count": self.count, "rank": self.rank, "reason": self.reason, "number": self.number}


@dataclass(frozen=True)
class _Recorded:
    kind: str
    values: list[Any]


class RankRecovery:
    """The recovery state of one job; every method is called with the coordinator's lock held."""

    def __init__(self, job: JobMembership) -> None:
        self.job = job
        self.policy = ABORT
        self.respawn: Respawn | None = None
        #: rank -> the incarnation that was lost, until the next one rejoins
        self.failed: dict[int, int] = {}
        #: rank -> the incarnation restarting, from its rejoin until its RESUME
        self.recovering: dict[int, int] = {}
        #: rank -> how many of its incarnations in a row were lost before their RESUME
        self._attempts: dict[int, int] = {}
        #: rank -> (checkpoint of its latest image, that image's coll_seq; None when not known)
        self.images: dict[int, tuple[int, int | None]] = {}
        self._record: dict[int, _Recorded] = {}
        #: every collective up to this sequence number has left the record
        self._trimmed = 0
        #: rank -> the phase timer of its recovering incarnation
        self._timers: dict[int, Timer] = {}
        #: rank -> why it holds checkpoints (rt.hold_checkpoints)
        self.holds: dict[int, str] = {}
        #: shared with the launch's later jobs by the coordinator (Coordinator._new_job)
        self.fallbacks = FallbackRecord()

    @property
    def on(self) -> bool:
        return self.policy == RECOVER

    def busy(self) -> bool:
        """Is a rank failed or recovering? (No checkpoint can start, no collective can be called stuck.)"""
        return bool(self.failed or self.recovering)

    def checkpoints_wait(self) -> bool:
        """Must a checkpoint (of either kind) wait: a rank is failed or recovering, or one holds them?"""
        return self.busy() or bool(self.holds)

    def absent(self) -> set[int]:
        """Ranks whose live incarnation cannot take part in the job's own barriers."""
        return set(self.failed) | set(self.recovering)

    # ----------------------------------------------------------- joining
    def adopt(self, hello: dict[str, Any]) -> None:
        """The first rank's hello sets the policy (a standalone coordinator learns it there)."""
        policy = str(hello.get("on_failure") or ABORT)
        if policy not in POLICIES:
            raise CkptError(
                f"rank {hello['rank']} asks for --on-failure {policy!r}; it is one of {', '.join(POLICIES)}"
            )
        if policy == RECOVER and hello.get("native"):
            raise CkptError("--on-failure recover needs the checkpoint thread, and --native ranks run without one")
        self.policy = policy

    def joined(self, rank: int, hello: dict[str, Any]) -> None:
        """A rank of a whole-job restart has the image it restarts from (its coll_seq is not known yet)."""
        restart = hello.get("restart")
        if restart:
            self.images[rank] = (int(restart["number"]), None)

    def rejoin(self, hello: dict[str, Any], info: RankInfo) -> None:
        """Admit `info` as the next incarnation of a failed rank; CkptError (one line) if it is not that."""
        job = self.job
        rank, wanted = info.rank, hello["recover"].get("incarnation")
        if not self.on:
            raise CkptError(
                f"rank {rank} asks to rejoin job {job.job_id} alone, but the job does not run under "
                "--on-failure recover"
            )
        if rank not in self.failed:
            state = (
                "recovering" if rank in self.recovering else job.ranks[rank].state if rank in job.ranks else "absent"
            )
            raise CkptError(
                f"rank {rank} of job {job.job_id} has not failed (it is {state}): there is nothing to recover"
            )
        following = self.failed[rank] + 1
        if wanted != following:
            raise CkptError(f"rank {rank} rejoins as incarnation {wanted!r}; its next incarnation is {following}")
        restart = hello.get("restart") or {}
        if not restart:
            raise CkptError(f"rank {rank} rejoins without an image to restart from")
        if restart.get("job") != job.job_id:
            raise CkptError(f"rank {rank} rejoins job {job.job_id} with an image of job {restart.get('job')}")
        number, image = int(restart["number"]), self.images[rank][0]
        if number != image:
            raise CkptError(
                f"rank {rank} rejoins from checkpoint {number}; its latest image in this run is checkpoint {image}"
            )
        del self.failed[rank]
        self.recovering[rank] = following
        info.incarnation, info.state = following, "restart"
        job.ranks[rank] = info
        self._arm_timer(rank, following, Phase.RESTART)
        job.message = (
            f"rank {rank} rejoined as incarnation {following} (pid {info.pid} on {info.host}), "
            f"restarting from checkpoint {number} at step {info.step}"
        )
        log.info("job %s: %s", job.job_id, job.message)

    def state_of(self, rank: int, info: RankInfo) -> str:
        """The state `ckpt status` shows: "recovering" from a rejoin until the rank's RESUME."""
        return "recovering" if rank in self.recovering and self.job.outcome is None else info.state

    # ----------------------------------------------------------- losing a rank
    def lost(self, rank: int, info: RankInfo, cause: str) -> bool:
        """Rank `rank` was lost (its connection closed or went silent); False when the job is to fail as ever."""
        job = self.job
        if self.holds.pop(rank, None) is not None:
            log.info("job %s: rank %d was lost: its hold on checkpoints ends", job.job_id, rank)
        job.kv.publish(RANKS_NS, f"replay/{rank}", None)  # a lost incarnation's replay progress is no one's
        if not self.on or job.restarting:
            return False  # a whole-job restart waits for every rank in its own phases: it fails as ever
        why = f" ({cause})" if cause else ""
        where = f"at step {info.step}" if info.step >= 0 else "during setup"
        if job._ckpt is not None:
            where = f"during checkpoint {job._ckpt.number} ({job._ckpt.stage_name})"
        if rank in self.recovering:
            where = f"while recovering as incarnation {info.incarnation}"
        lost = f"rank {rank} (pid {info.pid} on {info.host}) was lost {where}{why}"
        if rank not in self.images:
            job.fail(f"{lost}, before the job's first checkpoint: it has no image to recover from")
            return True
        self._cancel_timer(rank)
        if self.recovering.pop(rank, None) is not None:
            attempts = self._attempts[rank] = self._attempts.get(rank, 0) + 1
            if attempts >= MAX_RECOVERY_ATTEMPTS:
                job.fail(
                    f"{lost}: its recovery failed {attempts} times in a row "
                    f"(limit {MAX_RECOVERY_ATTEMPTS}); the latest checkpoint stays restartable"
                )
                return True
        info.state, info.finished = "failed", False  # it runs to its end again
        self.failed[rank] = info.incarnation
        job._end_checkpoint(lost)  # a checkpoint in progress is aborted (its files removed) as ever
        job.rank_checkpoint_lost(rank, f"{lost}: its independent checkpoint is dropped (ask again once it is back)")
        self._drop_arrivals(rank)
        job.kv.publish(RANKS_NS, f"failed/{rank}", info.incarnation)
        for other in job._live():
            job._push(other, protocol.RankFailed(rank=rank, incarnation=info.incarnation))
        following, number = info.incarnation + 1, self.images[rank][0]
        if self.respawn is not None:
            job.message = f"{lost}; respawning it from checkpoint {number} as incarnation {following}"
            self.respawn(rank, following, number)
        else:
            job.message = (
                f"{lost}; waiting for `ckpt restart --rank {rank}` (checkpoint {number}, incarnation {following})"
            )
        log.warning("job %s: %s", job.job_id, job.message)
        return True

    def _drop_arrivals(self, rank: int) -> None:
        """Forget what the lost incarnation waited in: its next one arrives again.  Barriers of a committed
        checkpoint's RESUME are the exception: that checkpoint is over, and they complete without it."""
        job = self.job
        for seq, arrivals in list(job._collectives.items()):
            arrivals.pop(rank, None)
            if not arrivals:
                del job._collectives[seq]
        for name, arrivals in list(job._barriers.items()):
            arrivals.pop(rank, None)
            if not arrivals:
                del job._barriers[name]
        for name in list(job._barriers):
            if name in job._barriers and job.participants(name) <= set(job._barriers[name]):
                job._release_barrier(name)

    # ----------------------------------------------------------- holds and the whole-job fallback
    def hold(self, rank: int, reason: str) -> None:
        """Rank `rank` holds checkpoints (`reason`) until it releases them or is lost (not nested)."""
        self.holds[rank] = reason
        log.info("job %s: rank %d holds checkpoints: %s", self.job.job_id, rank, reason)

    def release(self, rank: int) -> None:
        """Rank `rank` no longer holds checkpoints: what was queued meanwhile starts (if nothing else waits)."""
        if self.holds.pop(rank, None) is None:
            return
        log.info("job %s: rank %d released checkpoints", self.job.job_id, rank)
        self.job._start_queued()  # the queued coordinated one first, then independent ones

    def fall_back(self, rank: int, reason: str) -> None:
        """Rank `rank` cannot be recovered alone: end the job for a whole-job restart from its newest coordinated
        checkpoint (outcome "fallback", the launcher's part), or fail it with `reason` in one line."""
        job = self.job
        if job.outcome is not None:
            return  # another rank asked first, or the job ended: this rank is stopped with the others
        asked = f"rank {rank} cannot go on alone: {reason}"
        if not self.on:
            latest = job.last_checkpoint["number"] if job.last_checkpoint else None
            tail = f"; the latest checkpoint is {latest}" if latest else "; there is no checkpoint to restart from"
            job.fail(asked + tail)
            return
        job._ending = True  # the checkpoint's abort must not start anything
        job._end_checkpoint(asked)  # one in progress is aborted, unless it is already committed (then it is C)
        job._ending = False
        last = job.last_checkpoint
        if last is None:
            job.fail(f"{asked}; the job has no coordinated checkpoint to restart from")
            return
        number, record = int(last["number"]), self.fallbacks
        if self.respawn is None:  # a standalone coordinator: nobody here can start the ranks again
            job.fail(f"{asked}; restart the whole job from checkpoint {number} (ckpt restart)")
            return
        if record.in_a_row + 1 >= MAX_RECOVERY_ATTEMPTS:
            job.fail(
                f"{asked}; a whole-job restart was asked for {record.in_a_row + 1} times with no checkpoint "
                f"committed in between (limit {MAX_RECOVERY_ATTEMPTS}); the latest checkpoint is {number}"
            )
            return
        record.count += 1
        record.in_a_row += 1
        record.rank, record.reason, record.number = rank, reason, number
        message = f"{asked}; restarting the whole job from checkpoint {number}"
        job.message = message
        log.info("job %s: %s", job.job_id, message)
        job._ending = True
        job._end({"status": "fallback", "message": message, "number": number, "rank": rank, "reason": reason})

    def committed_any(self) -> None:
        """A checkpoint (of either kind) was committed: the job made progress since its last fallback."""
        self.fallbacks.in_a_row = 0

    def replay_progress(self, rank: int) -> list[int] | None:
        """[done, total] of rank `rank`'s replay while it runs (`RANKS_NS` replay/<rank>), else None."""
        found, value = self.job.kv.get(RANKS_NS, f"replay/{rank}")
        if not found or not isinstance(value, list) or len(value) != 2:
            return None
        done, total = value
        return [int(done), int(total)] if isinstance(done, int) and isinstance(total, int) else None

    # ----------------------------------------------------------- a recovering rank's own phases
    def barrier_released(self, name: str) -> None:
        """Barrier `name` completed: a recovering rank's RESTART or RESUME moves its recovery on."""
        rank = Phase.rank_of_scope(name)
        if rank is None or rank not in self.recovering:
            return
        job, incarnation = self.job, self.recovering[rank]
        scope, phase = Phase.of_barrier(name)
        if scope != Phase.rank_scope(rank, f"inc{incarnation}"):
            return
        if phase is not None and phase.next is not None:
            self._arm_timer(rank, incarnation, phase.next)
        if phase is Phase.RESTART:  # its new IDs are published: the survivors may reconnect to it
            job.kv.publish(RANKS_NS, f"incarnation/{rank}", incarnation)
            for other in job._live():
                if other != rank:
                    job._push(other, protocol.RankRecovered(rank=rank, incarnation=incarnation))
        elif phase is Phase.RESUME:
            self._cancel_timer(rank)
            del self.recovering[rank]
            self._attempts.pop(rank, None)
            job.message = f"rank {rank} recovered as incarnation {incarnation}"
            log.info("job %s: %s", job.job_id, job.message)
            job._arm_interval()
            job._start_queued()
            job._maybe_done()

    def _arm_timer(self, rank: int, incarnation: int, phase: Phase) -> None:
        """Incarnation `incarnation` of `rank` must complete `phase` within the phase timeout, or it is lost."""
        job, timeout = self.job, self.job.settings.phase_timeout
        self._cancel_timer(rank)

        def expired() -> None:
            if self._timers.get(rank) is not timer or self.recovering.get(rank) != incarnation:
                return  # it moved on (or was lost) meanwhile
            del self._timers[rank]
            if job.outcome is not None:
                return
            reason = f"it did not finish {phase.value} within {timeout:g} s"
            if job.ranks[rank].connected:  # hung, not dead: it must not run on beside its next incarnation
                job._push(rank, protocol.KillRank(reason=f"rank {rank} incarnation {incarnation}: {reason}"))
            job.rank_lost(rank, reason)

        timer = self._timers[rank] = job._scheduler.call_at(time.monotonic() + timeout, expired)

    def _cancel_timer(self, rank: int) -> None:
        timer = self._timers.pop(rank, None)
        if timer is not None:
            timer.cancel()

    # ----------------------------------------------------------- collectives
    def replay(self, rank: int, seq: int, kind: str, reply: Reply) -> bool:
        """Answer a re-executed collective from the record; False when it is not a completed one."""
        if not self.on:
            return False
        recorded = self._record.get(seq)
        if recorded is None:
            if 0 < seq <= self._trimmed:
                reply({"error": f"rank {rank} re-executes {kind} #{seq}, older than every rank's latest image"})
                return True
            return False
        if recorded.kind != kind:
            reply({"error": f"rank {rank} re-executes collective #{seq} as {kind}; it was {recorded.kind}"})
        else:
            reply({"values": recorded.values})
        return True

    def completed(self, seq: int, kind: str, values: list[Any]) -> None:
        if self.on:
            self._record[seq] = _Recorded(kind, values)

    def committed(self, number: int, reports: dict[int, Any]) -> None:
        """Checkpoint `number` holds the images `reports` describe ({rank: report}): trim the record."""
        for rank, report in reports.items():
            coll_seq = report.get("coll_seq") if isinstance(report, dict) else None
            self.images[rank] = (number, None if coll_seq is None else int(coll_seq))
        known = [seq for _, seq in self.images.values()]
        if len(self.images) < self.job.size or any(seq is None for seq in known):
            return  # some rank's image's position is unknown: keep everything
        floor = min(seq for seq in known if seq is not None)
        for seq in [s for s in self._record if s <= floor]:
            del self._record[seq]
        self._trimmed = max(self._trimmed, floor)

    def recorded(self) -> int:
        """How many collectives the record holds (for tests and status)."""
        return len(self._record)
