"""Independent checkpoints of one rank while the others run on: the coordinator's side (DESIGN.md §8)."""

# FT-KDSM (remote-logging-hlrc-dsm-via.txt §4-§5) rolls back only a failed
# rank, so each rank needs an image of its own that is recent enough to replay
# from; taking it must not stop the others.  An independent checkpoint N of
# rank R walks the same phases as a coordinated one,
#
#   rankR.ckptN:REACH -> :PRESUSPEND -> :DRAIN -> :CHECKPOINT -> :RESUME
#
# in R's own scope (`Phase.rank_scope`): those barriers complete with R alone,
# beside anything the job's other barriers do.  R's target boundary is its own
# reach: nobody else parks, so there is no maximum to take.  N comes from the
# counter of coordinated checkpoints, and at the CHECKPOINT barrier the
# coordinator writes a manifest of kind "rank" naming every rank's latest image
# (R's new one; each other rank's from the checkpoint it was taken in,
# `RankEntry.number`), never moving `latest`.  A coordinated checkpoint gives
# every rank a new latest image.
#
# Invariants:
# * one checkpoint at a time, of any kind.  Coordinated ones wait for the
#   independent one in progress (queued meanwhile) and independent ones
#   requested during a coordinated one, or during another rank's, are queued
#   (FIFO, one per rank: a request for a rank already queued or in progress
#   joins it).  Serializing them is what keeps manifests in commit order by
#   number, so the newest manifest always names every rank's latest image;
#   overlapping ones would commit out of order (a later number naming an
#   earlier image of a rank).  It costs little: one rank's image is quick,
#   and periodic ones (`--rank-interval S`) are staggered anyway (rank r is
#   due at S*(k + r/N)).  It also means a rank never parks while another one
#   is parked, so a collective can never wait on two parked ranks.
# * an aborted one (its rank lost, a plugin failed, a phase timed out)
#   removes its own image only; the rank's previous latest image stays, and
#   no manifest names the aborted one.

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ckpt import _manifest as manifests
from ckpt._errors import CkptError, ImageError
from ckpt._schemas import Manifest, RankEntry
from ckpt.coordinator import protocol
from ckpt.coordinator._failures import FailureReport
from ckpt.coordinator._membership import Checkpoint, JobMembership, log
from ckpt.coordinator._scheduler import Timer
from ckpt.coordinator.kvstore import Reply
from ckpt.plugin import Phase


@dataclass(kw_only=True)
class RankCheckpoint(Checkpoint):
    """An independent checkpoint of `rank`: queued (number 0 until it starts), then in progress."""

    rank: int

    @property
    def scope(self) -> str:
        return Phase.rank_scope(self.rank, f"ckpt{self.number}")


class IndependentCheckpoints(JobMembership):
    """The job's independent checkpoints, and each rank's latest image; `Job` builds on this."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rank_ckpt: RankCheckpoint | None = None
        self._rank_queue: list[RankCheckpoint] = []
        #: rank -> (the checkpoint its latest image belongs to, its entry as a manifest records it)
        self.latest_images: dict[int, tuple[int, RankEntry]] = {}
        self.last_rank_checkpoint: dict[str, Any] | None = None
        self._rank_interval_timer: Timer | None = None
        self._rank_slot = 0
        self._rank_epoch = 0.0
        #: warns of failed independent checkpoints without repeating itself (a full disk under --rank-interval)
        self.rank_failures = FailureReport()

    # ----------------------------------------------------------- requests
    def request_rank_checkpoint(self, rank: int, *, waiter: Reply | None) -> dict[str, Any]:
        """Start an independent checkpoint of `rank`, or join the one of that rank in progress / queued.

        Returns {"number"} (0 and "queued": True while it waits for another checkpoint or for the
        job to run) or {"error"}.
        """
        if self.outcome is not None:
            return {"error": f"the job has ended ({self.outcome['status']})"}
        if self.native:
            return {"error": "the job runs with --native: no checkpoint thread, checkpoints are disabled"}
        if self.size == 0:
            return {"error": "no rank has joined the job yet: ask again once it runs"}
        if not 0 <= rank < self.size:
            return {"error": f"there is no rank {rank}: the job has ranks 0..{self.size - 1}"}
        info = self.ranks.get(rank)
        if info is not None and not info.connected:
            return {"error": f"rank {rank} is not running ({info.state}): it cannot be checkpointed"}
        target = next((c for c in (self._rank_ckpt, *self._rank_queue) if c is not None and c.rank == rank), None)
        if target is None:
            target = RankCheckpoint(0, rank=rank)
            self._rank_queue.append(target)
        if waiter is not None:
            target.waiters.append(waiter)
        self._start_queued_rank()
        return {"number": target.number, "queued": target.number == 0}

    def joined(self) -> None:
        announced = self._complete_announced
        super().joined()
        if not announced and self._complete_announced and not self.restarting:
            self._arm_rank_interval()  # a restart arms it once its RESUME is complete (Job)

    def _may_start_rank_checkpoint(self) -> bool:
        return (
            self._rank_ckpt is None
            and self._ckpt is None
            and self._queued is None  # a coordinated one asked for first goes first
            and self.outcome is None
            and self.all_joined()
            and all(info.connected for info in self.ranks.values())  # not while a lost rank is dealt with
            and not self.restarting
            and not self.recovery.checkpoints_wait()  # nor while a failed rank is away, or a rank holds them
        )

    def _start_queued_rank(self) -> None:
        while self._rank_queue and self._may_start_rank_checkpoint():
            ckpt = self._rank_queue.pop(0)
            info = self.ranks.get(ckpt.rank)
            if info is None or not info.connected:  # lost while it waited
                for waiter in ckpt.waiters:
                    waiter({"error": f"rank {ckpt.rank} was lost before its checkpoint could start"})
                continue
            self._start_rank(ckpt)

    def _start_rank(self, ckpt: RankCheckpoint) -> None:
        ckpt.number = self._next_number
        self._next_number += 1
        ckpt.started = time.time()
        self._rank_ckpt = ckpt
        self.message = f"independent checkpoint {ckpt.number} of rank {ckpt.rank} in progress"
        log.info("%s", self.message)
        ckpt.timer = self._arm_rank_timer(ckpt)
        self._push(ckpt.rank, protocol.Suspend(number=ckpt.number, independent=True))

    # ----------------------------------------------------------- its barriers
    def _rank_barrier_complete(self, scope: str, phase: Phase, values: list[Any]) -> dict[str, Any]:
        """Barrier `phase` of an independent checkpoint is complete (its rank has arrived)."""
        ckpt = self._rank_ckpt
        if ckpt is None or scope != ckpt.scope:
            return {}
        if ckpt.timer:
            ckpt.timer.cancel()
        ckpt.stage = phase.next
        if phase is Phase.CHECKPOINT:
            report = values[ckpt.rank]
            try:
                if isinstance(report, dict) and "error" in report:
                    raise CkptError(f"rank {ckpt.rank}: {report['error']}")  # (its own image: nothing to group)
                ckpt.manifest = self._write_rank_manifest(ckpt, report)
            except (CkptError, OSError) as exc:
                ckpt.failure = f"independent checkpoint {ckpt.number} of rank {ckpt.rank} could not be written: {exc}"
                return {"abort": ckpt.failure}
        if phase.next is not None:
            ckpt.timer = self._arm_rank_timer(ckpt)
        if phase is Phase.CHECKPOINT:
            return {"manifest": ckpt.manifest, "kill": False}
        return {}

    def _after_rank_barrier(self, scope: str, phase: Phase) -> None:
        ckpt = self._rank_ckpt
        if ckpt is None or scope != ckpt.scope:
            return
        if phase is Phase.CHECKPOINT and ckpt.manifest is None:
            self._abort_rank(ckpt.failure)
        elif phase is Phase.RESUME:
            self._complete_rank(ckpt)

    def _write_rank_manifest(self, ckpt: RankCheckpoint, report: Any) -> str:
        """Commit `ckpt`: a "rank" manifest naming its new image and every other rank's latest one."""
        info = self.ranks[ckpt.rank]
        try:
            entry = msgspec.convert({"rank": ckpt.rank, "host": info.host, "pid": info.pid, **report}, RankEntry)
        except (msgspec.ValidationError, TypeError) as exc:
            raise CkptError(f"rank {ckpt.rank}'s image report does not fit the manifest: {exc}") from None
        others = {r: msgspec.structs.replace(e, number=n) for r, (n, e) in self.latest_images.items() if r != ckpt.rank}
        entries = sorted([entry, *others.values()], key=lambda e: e.rank)
        seconds = time.time() - ckpt.started
        path = self._commit(self._manifest(ckpt.number, "rank", entries, seconds))
        self.latest_images[ckpt.rank] = (ckpt.number, entry)
        self.recovery.committed(ckpt.number, {ckpt.rank: report})
        self.last_rank_checkpoint = {
            "rank": ckpt.rank,
            "number": ckpt.number,
            "manifest": path,
            "bytes": entry.bytes,
            "seconds": seconds,
        }
        return path

    # ----------------------------------------------------------- manifests of either kind
    def _manifest(self, number: int, kind: str, ranks: list[RankEntry], seconds: float) -> Manifest:
        assert self.program is not None  # a rank has joined
        return Manifest(
            job=self.job_id,
            program=self.program,
            argv=self.argv,
            size=self.size,
            number=number,
            kind=kind,
            generation=self.generation,
            created=time.time(),
            seconds=seconds,
            transport=self.transport,
            plugins=self.ranks[0].plugins if self.ranks else [],
            with_plugins=self.with_plugins,
            options=self.options,
            settings=msgspec.structs.replace(self.settings.recorded(), on_failure=self.recovery.policy),
            coordinator=self.settings.address,
            id_counters=dict(self.kv.id_counters),
            ranks=ranks,
        )

    def _commit(self, manifest: Manifest) -> str:
        """Write `manifest`, then prune (--keep); its path.  A "job" manifest gives every rank a latest image."""
        path = manifests.write_manifest(self.settings.ckpt_dir, manifest, token=self.settings.token.encode())
        self.recovery.committed_any()  # progress: a later fallback is not part of a loop
        if manifest.kind == "job":
            self.latest_images = {entry.rank: (manifest.number, entry) for entry in manifest.ranks}
        if self.settings.keep:
            manifests.prune(self.settings.ckpt_dir, manifest.program.name, self.settings.keep)
        return str(path)

    def _adopt(self, hello: dict[str, Any]) -> None:
        """A restarted job starts from the images of the checkpoint it restarts from."""
        super()._adopt(hello)
        restart = hello.get("restart")
        if not restart or self.program is None:
            return
        number = int(restart["number"])
        try:
            path = self.settings.ckpt_dir / manifests.manifest_name(self.program.name, number)
            manifest = manifests.read_manifest(path, token=self.settings.token.encode())
            self.latest_images = {entry.rank: (number, entry) for entry in manifest.ranks}
            # The rolled-back run's "rank" manifests go; its coordinated ones stay (a user may go back to
            # them on purpose), so the directory's newest manifest may be of that run until this one
            # commits: no recovery reads it, the coordinator names each rank's image (_recovery.py).
            manifests.abandon_after(self.settings.ckpt_dir, self.program.name, number)
        except (ImageError, OSError) as exc:  # the ranks load their images themselves: they say what is wrong
            log.warning("cannot read the manifest of checkpoint %d: %s", number, exc)

    # ----------------------------------------------------------- endings
    def _arm_rank_timer(self, ckpt: RankCheckpoint) -> Timer:
        def expired() -> None:
            if self._rank_ckpt is not ckpt:
                return
            phase = ckpt.stage or Phase.RESUME
            what = "park at its step boundary" if phase in (Phase.REACH, Phase.PRESUSPEND) else f"finish {phase.value}"
            step = self.ranks[ckpt.rank].step
            self._abort_rank(
                f"rank {ckpt.rank} (near step {step}) did not {what} within {self.settings.phase_timeout:g} s"
            )

        return self._scheduler.call_at(time.monotonic() + self.settings.phase_timeout, expired)

    def abort_rank_checkpoint(self, number: int, reason: str) -> bool:
        """The rank cannot complete independent checkpoint `number`: abort it. False if it is not in progress."""
        if self._rank_ckpt is None or self._rank_ckpt.number != number:
            return False
        self._abort_rank(reason)
        return True

    def rank_checkpoint_lost(self, rank: int, reason: str) -> None:
        """Rank `rank` is gone: abort its checkpoint in progress and drop its queued one."""
        if self._rank_ckpt is not None and self._rank_ckpt.rank == rank:
            self._end_rank_checkpoint(reason)
        for ckpt in [c for c in self._rank_queue if c.rank == rank]:
            self._rank_queue.remove(ckpt)
            for waiter in ckpt.waiters:
                waiter({"error": reason})

    def _end_rank_checkpoint(self, reason: str) -> None:
        """The checkpoint in progress cannot go on: abort it, unless its manifest is already written."""
        ckpt = self._rank_ckpt
        if ckpt is None:
            return
        if ckpt.manifest is None:
            self._abort_rank(reason)
            return
        self._rank_ckpt = None  # committed: it is the rank's latest image, its waiters hear so
        if ckpt.timer:
            ckpt.timer.cancel()
        for waiter in ckpt.waiters:
            waiter({"checkpoint": self.last_rank_checkpoint})
        ckpt.waiters = []

    def _abort_rank(self, reason: str) -> None:
        ckpt, self._rank_ckpt = self._rank_ckpt, None
        if ckpt is None:
            return
        if ckpt.timer:
            ckpt.timer.cancel()
        self._aborted.add(ckpt.number)  # its barriers answer latecomers at once
        committed = ckpt.manifest is not None
        what = f"independent checkpoint {ckpt.number} of rank {ckpt.rank}"
        if committed:
            message = f"{what} was written, but its RESUME phase failed: {reason}"
        elif reason.startswith(what):
            message = reason
        else:
            message = f"{what} aborted: {reason}"
        self.rank_failures.failed(message)
        self.message = message
        for name in [n for n in self._barriers if n.startswith(ckpt.scope + ":")]:
            for arrival in self._barriers.pop(name).values():
                arrival.reply({"abort": message})
        if not committed:
            self._remove_rank_image(ckpt.number)
        info = self.ranks.get(ckpt.rank)
        if info is not None and info.connected:
            self._push(ckpt.rank, protocol.Abort(number=ckpt.number, reason=message))
            info.state = "finished" if info.finished else "running"
        for waiter in ckpt.waiters:
            waiter({"checkpoint": self.last_rank_checkpoint} if committed else {"error": message})
        self._after_rank_checkpoint()

    def _remove_rank_image(self, number: int) -> None:
        try:
            if self.program is not None:
                manifests.remove_unreferenced(self.settings.ckpt_dir, self.program.name, number)
        except (OSError, ImageError) as exc:
            log.warning("cannot clean up checkpoint %d: %s", number, exc)

    def _complete_rank(self, ckpt: RankCheckpoint) -> None:
        self._rank_ckpt = None
        if ckpt.timer:
            ckpt.timer.cancel()
        self.message = f"independent checkpoint {ckpt.number} of rank {ckpt.rank} written: {ckpt.manifest}"
        log.info("%s", self.message)
        self.rank_failures.completed()
        waiters, ckpt.waiters = ckpt.waiters, []
        for waiter in waiters:
            waiter({"checkpoint": self.last_rank_checkpoint})
        self._after_rank_checkpoint()

    def _after_rank_checkpoint(self) -> None:
        """One ended: a coordinated checkpoint queued meanwhile goes first, then the next rank's."""
        if self._ending or not all(info.connected for info in self.ranks.values()):
            return  # a rank is lost: nothing starts before the job (or that rank) is dealt with
        self._start_queued()
        self._start_queued_rank()
        self._maybe_done()

    def _take_rank_waiters(self) -> list[Reply]:
        waiters: list[Reply] = []
        for ckpt in (self._rank_ckpt, *self._rank_queue):
            if ckpt is not None:
                waiters += ckpt.waiters
                ckpt.waiters = []
        self._rank_queue = []
        return waiters

    def _maybe_done(self) -> None:
        if self._rank_ckpt is None:  # the job ends once no rank is inside a checkpoint of its own
            super()._maybe_done()

    # ----------------------------------------------------------- --rank-interval
    def _arm_rank_interval(self) -> None:
        """(Re)start periodic independent checkpoints: rank r is due at S*(k + r/N) after now, k >= 1 (r = 0)."""
        self._cancel_rank_interval()
        if self.settings.rank_interval and self.outcome is None and not self.native and self.size:
            self._rank_epoch, self._rank_slot = time.monotonic(), 0
            self._next_rank_slot()

    def _next_rank_slot(self) -> None:
        interval = self.settings.rank_interval
        assert interval is not None
        self._rank_slot += 1
        when = self._rank_epoch + self._rank_slot * interval / self.size
        self._rank_interval_timer = self._scheduler.call_at(when, self._rank_due)

    def _rank_due(self) -> None:
        self._rank_interval_timer = None
        if self.outcome is not None:
            return
        rank = self._rank_slot % self.size
        info = self.ranks.get(rank)
        if info is not None and info.connected and not info.finished:  # a finished rank's image no longer changes
            self.request_rank_checkpoint(rank, waiter=None)
        self._next_rank_slot()

    def _cancel_rank_interval(self) -> None:
        if self._rank_interval_timer:
            self._rank_interval_timer.cancel()
            self._rank_interval_timer = None

    # ----------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        state = super().status()
        for entry in state["ranks"]:
            # what a recovery of the rank loads (`ckpt restart --rank` asks here, never the directory)
            known = self.recovery.images.get(entry["rank"]) or self.latest_images.get(entry["rank"])
            entry["latest_image"] = known[0] if known else None
        ckpt = self._rank_ckpt
        state["independent_in_progress"] = (
            None if ckpt is None else {"rank": ckpt.rank, "number": ckpt.number, "stage": _stage(ckpt)}
        )
        state["independent_queued"] = [c.rank for c in self._rank_queue]
        state["last_rank_checkpoint"] = self.last_rank_checkpoint
        return state


def is_rank_checkpoint(scope: str) -> bool:
    """Is `scope` an independent checkpoint's (``rankR.ckptN``, not a single-rank restart's ``rankR.incK``)?"""
    return Phase.rank_of_scope(scope) is not None and scope.partition(".")[2].startswith("ckpt")


def _stage(ckpt: RankCheckpoint) -> str:
    return ckpt.stage.value.lower() if ckpt.stage is not None else "done"
