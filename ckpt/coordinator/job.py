"""The checkpoint and restart state machine of one job, as the coordinator runs it."""

# The checkpoint protocol is DMTCP's: a sequence of named global barriers that
# every rank's checkpoint thread walks,
#
#   ckptN:REACH -> ckptN:PRESUSPEND -> ckptN:DRAIN -> ckptN:CHECKPOINT -> ckptN:RESUME
#
# and on restart  genG:RESTART -> genG:REFRESH -> genG:RESUME.
#
# That order is written once, in `ckpt.plugin.Phase`: barrier names are built
# and parsed by it, a rank's state is `Phase.state`, the next barrier `Phase.next`.
#
# REACH is ours: each rank reports the step boundary it can still reach
# without help (its current step + 1, or the boundary it is holding at), and the
# target boundary is the maximum, so no rank parks while a peer still waits for
# it inside a step.  That is only deadlock-free when collectives are
# step-aligned; when they are not, some rank sits in a collective that a parked
# rank will never enter.  The coordinator sees both (it serves collectives and
# barriers), so it aborts the checkpoint with a message naming the ranks, their
# steps and the collective, and the job goes on.
#
# Invariants: at most one checkpoint (of either kind) is in progress; a
# checkpoint exists only once its manifest is written (the CHECKPOINT barrier
# writes it before anyone is released); an aborted checkpoint leaves no files
# behind; a lost rank fails the job (the previous checkpoint stays the latest)
# -- under --on-failure recover it is respawned instead, and checkpoints wait
# until it is back (_recovery.py).
#
# The membership, collectives and named barriers this runs on: _membership.py;
# independent checkpoints of one rank (scope rankR.ckptN) and each rank's
# latest image: _independent.py.

from __future__ import annotations

import time
from typing import Any

import msgspec

from ckpt import _manifest as manifests
from ckpt._errors import CkptError, ImageError
from ckpt._schemas import RankEntry
from ckpt.coordinator import protocol
from ckpt.coordinator._failures import rank_errors
from ckpt.coordinator._independent import IndependentCheckpoints, is_rank_checkpoint
from ckpt.coordinator._membership import STATES, Checkpoint, JobSettings, Push, RankInfo, log
from ckpt.coordinator._scheduler import Timer
from ckpt.coordinator.kvstore import Reply
from ckpt.plugin import Phase

__all__ = ["STATES", "Job", "JobSettings", "Push", "RankInfo"]


class Job(IndependentCheckpoints):
    """One job: its membership (`JobMembership`), its independent checkpoints and its checkpoints and restarts."""

    # ----------------------------------------------------------- phase barriers
    def _barrier_complete(self, name: str, values: list[Any]) -> dict[str, Any]:
        """What completing a phase barrier does before anyone is released."""
        scope, phase = Phase.of_barrier(name)
        if phase is None:
            return {}  # a plugin's own barrier: no phase ends here
        for info in (self.ranks[r] for r in self.participants(name) if r in self.ranks):
            if phase.next is not None:
                info.state = phase.next.state
            else:
                info.state = "finished" if info.finished else "running"
        if is_rank_checkpoint(scope):
            return self._rank_barrier_complete(scope, phase, values)
        ckpt = self._ckpt
        if ckpt is None or scope != f"ckpt{ckpt.number}":
            return {}
        if ckpt.timer:
            ckpt.timer.cancel()
        ckpt.stage = phase.next
        if phase is Phase.CHECKPOINT:
            errors = rank_errors(values)
            try:
                if errors is not None:
                    raise CkptError(errors)
                ckpt.manifest = self._write_manifest(ckpt, values)
            except (CkptError, OSError) as exc:
                ckpt.failure = f"checkpoint {ckpt.number} could not be written: {exc}"
                return {"abort": ckpt.failure}
        if phase.next is not None:
            ckpt.timer = self._arm_phase_timer(ckpt)
        if phase is Phase.CHECKPOINT:
            return {"manifest": ckpt.manifest, "kill": ckpt.kill}
        return {}

    def _after_barrier(self, name: str) -> None:
        scope, phase = Phase.of_barrier(name)
        ckpt = self._ckpt
        if phase is not None and self.restarting and scope == f"gen{self.generation}":
            if phase.next is not None:
                self._arm_restart_timer(phase.next)
                return
            self.restarting = False
            if self._restart_timer:
                self._restart_timer.cancel()
            self.message = f"restarted as generation {self.generation}"
            self._arm_interval()
            self._arm_rank_interval()
            self._maybe_done()
            self._start_queued()
            return
        if phase is not None and is_rank_checkpoint(scope):
            self._after_rank_barrier(scope, phase)
            return
        if ckpt is None or scope != f"ckpt{ckpt.number}":
            return
        if phase is Phase.CHECKPOINT:
            if ckpt.manifest is None:
                self._abort(ckpt.failure)
            elif ckpt.kill:
                # the ranks were told in the barrier's reply: they run their checkpointed and exit
                # hooks and exit on their own, so no kill push races with those hooks
                self._complete(ckpt, kill=True, push=False)
        elif phase is Phase.RESUME:
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
            target = Checkpoint(0, kill, time.time())
            free = self._rank_ckpt is None and not self.recovery.checkpoints_wait()
            if self.all_joined() and not self.restarting and free:
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
        else:
            self.abort_rank_checkpoint(number, reason)

    def _start_queued(self) -> None:
        if (
            self._queued is not None
            and self._ckpt is None
            and self._rank_ckpt is None  # an independent checkpoint in progress ends first
            and self.outcome is None
            and self.all_joined()
            and not self.restarting
            and not self.recovery.checkpoints_wait()
        ):
            queued, self._queued = self._queued, None
            self._start(queued)
        self._start_queued_rank()

    def _start(self, ckpt: Checkpoint) -> None:
        ckpt.number = self._next_number
        self._next_number += 1
        self._ckpt = ckpt
        self._members = {n: m for n, m in self._members.items() if n > ckpt.number - 4}  # the last few suffice
        self._members[ckpt.number] = {r: info.incarnation for r, info in self.ranks.items()}
        ckpt.started = time.time()
        self.message = f"checkpoint {ckpt.number} in progress"
        log.info("checkpoint %d started%s", ckpt.number, " (then the job ends)" if ckpt.kill else "")
        ckpt.timer = self._arm_phase_timer(ckpt)
        for rank in self._live():
            self._push(rank, protocol.Suspend(number=ckpt.number))

    def _arm_phase_timer(self, ckpt: Checkpoint) -> Timer:
        return self._scheduler.call_at(
            time.monotonic() + self.settings.phase_timeout, lambda: self._phase_timeout(ckpt)
        )

    def _phase_timeout(self, ckpt: Checkpoint) -> None:
        if self._ckpt is not ckpt:
            return  # that checkpoint has ended
        phase = ckpt.stage or Phase.RESUME
        waiting = self._barriers.get(phase.barrier(f"ckpt{ckpt.number}"), {})
        blocked = {r: (seq, a) for seq, arr in self._collectives.items() for r, a in arr.items()}
        late = []
        for rank in (r for r in self._live() if r not in waiting):
            if rank in blocked:
                seq, arrival = blocked[rank]
                late.append(f"rank {rank} (in {arrival.kind} #{seq} of step {arrival.step})")
            else:
                late.append(f"rank {rank} (near step {self.ranks[rank].step})")
        what = "park at the step boundary" if phase is Phase.PRESUSPEND else f"finish {phase.value}"
        self._abort(f"{', '.join(late)} did not {what} within {self.settings.phase_timeout:g} s")

    def _check_stuck(self) -> None:
        """Abort when parked ranks and ranks blocked in collectives wait for each other forever."""
        ckpt = self._ckpt
        if ckpt is None or ckpt.stage is not Phase.PRESUSPEND:
            return
        # parked: at PRESUSPEND, or inside a presuspend hook's own barrier (ckptN:plugin:...)
        parked = {
            rank
            for name, arrivals in self._barriers.items()
            if name.startswith(f"ckpt{ckpt.number}:") and name != Phase.REACH.barrier(f"ckpt{ckpt.number}")
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
        self.failures.failed(message)
        self.message = message
        for name in list(self._barriers):  # phase barriers and plugins' own barriers inside hooks
            for arrival in self._barriers.pop(name).values():
                arrival.reply({"abort": message})
        for rank in self._live():
            self._push(rank, protocol.Abort(number=ckpt.number, reason=message))
            info = self.ranks[rank]
            info.state = "finished" if info.finished else "running"
        self._remove_images(ckpt.number)  # nothing of a committed one: its manifest protects it
        for waiter in ckpt.waiters:
            waiter({"checkpoint": self.last_checkpoint} if committed else {"error": message})
        self._arm_interval()
        if not self._ending:
            self._start_queued_rank()
            self._maybe_done()

    def _remove_images(self, number: int) -> None:
        try:
            if self.program is not None:
                manifests.remove_unreferenced(self.settings.ckpt_dir, self.program.name, number)
        except (OSError, ImageError) as exc:
            log.warning("cannot clean up checkpoint %d: %s", number, exc)

    def remove_aborted_images(self) -> None:
        for number in sorted(self._aborted):
            self._remove_images(number)

    def _complete(self, ckpt: Checkpoint, *, kill: bool = False, push: bool = False) -> None:
        self._ckpt = None
        if ckpt.timer:
            ckpt.timer.cancel()
        assert ckpt.manifest is not None
        self.message = f"checkpoint {ckpt.number} written: {ckpt.manifest}"
        log.info("%s", self.message)
        self.failures.completed()
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
        waiters: list[Reply] = self._take_rank_waiters()
        for ckpt in (self._ckpt, self._queued):
            if ckpt is not None:
                waiters += ckpt.waiters
                ckpt.waiters = []
        return waiters

    def _write_manifest(self, ckpt: Checkpoint, images: list[Any]) -> str:
        """Commit checkpoint ``ckpt``: write its manifest from what the ranks report; return its path."""
        seconds = time.time() - ckpt.started
        ranks = []
        for rank, image in enumerate(images):  # what a rank reports of its image is checked once, here
            info = self.ranks[rank]
            try:
                ranks.append(msgspec.convert({"rank": rank, "host": info.host, "pid": info.pid, **image}, RankEntry))
            except (msgspec.ValidationError, TypeError) as exc:
                raise CkptError(f"rank {rank}'s image report does not fit the manifest: {exc}") from None
        path = self._commit(self._manifest(ckpt.number, "job", ranks, seconds))
        self.recovery.committed(ckpt.number, dict(enumerate(images)))
        total = sum(entry.bytes for entry in ranks)
        self.last_checkpoint = {"number": ckpt.number, "manifest": path, "bytes": total, "seconds": seconds}
        return path

    def _arm_restart_timer(self, phase: Phase) -> None:
        """A restart that does not reach `phase` within the phase timeout fails (it cannot be aborted)."""
        if self._restart_timer:
            self._restart_timer.cancel()

        def expired() -> None:
            if self.restarting and self.outcome is None:
                there = set(self._barriers.get(phase.barrier(f"gen{self.generation}"), {}))
                late = sorted(set(range(self.size)) - there)
                self.fail(
                    f"restart failed: rank(s) {late} did not reach {phase.value} "
                    f"within {self.settings.phase_timeout:g} s"
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

    # ----------------------------------------------------------- the job ends
    def _end_checkpoint(self, reason: str) -> None:
        """The job ends with a checkpoint in progress: abort it, unless its manifest is already written."""
        self._end_rank_checkpoint(reason)
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
