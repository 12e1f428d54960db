"""Starting a job: plugins' services, the embedded coordinator, one process per rank, waiting, results."""

# Under --on-failure recover a rank process that dies is not the job's end: the
# coordinator decides (it marks a joined rank failed, or fails the job), and its
# respawn callback hands (rank, incarnation, number) to this launcher's
# respawner thread, which starts a process for that rank from its image of
# checkpoint `number`, the one the coordinator names (`recovery_spec`); a
# respawn that fails in any way fails the job in one line.  A process that dies before it has joined is the job's end
# as ever: the coordinator never heard of it.
#
# A rank that cannot be recovered alone calls `rt.fall_back(reason)`: the job ends with the outcome
# "fallback"; this launcher prints the reason in one line, kills every rank process by PID and restarts
# the job from the newest coordinated checkpoint as `ckpt restart` would (same options, still under
# recover) on the same coordinator (`Coordinator.next_job`); the old job's respawns are dropped (epoch).

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ckpt import _jobdir as jobdir
from ckpt import _manifest as manifests
from ckpt import _wire as wire
from ckpt._cli_plugins import JobServices, check_single_rank_recovery, launcher_host
from ckpt._errors import CkptError, CoordinatorError, ImageError, ProtocolError
from ckpt._jobdir import read_job_file, write_job_file
from ckpt._restart_point import last_checkpoint, prepare_restart
from ckpt.coordinator.server import Coordinator
from ckpt.plugin import JobInfo
from ckpt.runtime.rank import SPEC_ENV

log = logging.getLogger(__name__)

#: Exit statuses of `ckpt launch` / `ckpt restart`.
EXIT_OK, EXIT_FAILED = 0, 1
_PROGRESS_MIN_BYTES = 8 << 20
_REAP_SECONDS = 10.0

#: Environment variables through which external launchers give each process its rank and size.
RANK_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)


@dataclass
class JobOptions:
    program: str
    argv: list[str]
    ranks: int
    ckpt_dir: Path
    transport: str  # the name of an installed transport (the CLI resolves it)
    coordinator: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    interval: float | None = None
    rank_interval: float | None = None  # --rank-interval: independent checkpoints of each rank, staggered
    keep: int = 0
    with_plugins: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    native: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    log_level: str = "WARNING"
    phase_timeout: float = 300.0
    token: str | None = None
    restart: dict[str, Any] | None = None  # the manifest to restart from
    debug: int | None = None  # restart: this rank stops in pdb before its next step (stdin is its)
    claim: jobdir.DirectoryClaim | None = None  # the CLI's claim on ckpt_dir, taken before anything else
    recorded_phase_timeout: float | None = None  # what manifests record when --debug overrides phase_timeout
    on_failure: str = "abort"  # "recover": a lost rank is respawned from its latest image (_recovery.py)


def external_rank() -> tuple[int, int | None] | None:
    """(rank, size) when an external launcher (mpiexec, srun) started this process."""
    for rank_var, size_var in RANK_VARIABLES:
        if rank_var in os.environ:
            size = os.environ.get(size_var)
            return int(os.environ[rank_var]), int(size) if size else None
    return None


def job_services(opts: JobOptions, job: str, external_rank: int | None = None) -> JobServices:
    """The services the loaded plugins start with this job and stop after it (not started yet)."""
    info = JobInfo(
        job=job,
        ckpt_dir=opts.ckpt_dir,
        transport=opts.transport,
        host=opts.host,
        options=dict(opts.options),
        restarted=opts.restart is not None,
        native=opts.native,
        owns_coordinator=opts.coordinator is None,
        external_rank=external_rank,
        size=opts.ranks,
    )
    host = launcher_host(tuple(opts.with_plugins), tuple(opts.disabled))
    if opts.on_failure == "recover":  # before anything starts: every plugin with cross-rank state must agree
        check_single_rank_recovery(host, info)
    return JobServices(host, info)


def rank_spec(opts: JobOptions, rank: int, address: str, token: str, job: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "rank": rank,
        "size": opts.ranks,
        "coordinator": address,
        "token": token,
        "job": job,
        "program": opts.program,
        "argv": opts.argv,
        "ckpt_dir": str(opts.ckpt_dir),
        "with_plugins": opts.with_plugins,
        "disabled": opts.disabled,
        "native": opts.native,
        "transport": opts.transport,
        "options": opts.options,
        "log_level": opts.log_level,
        "on_failure": opts.on_failure,
    }
    if opts.restart is not None:
        m = opts.restart
        spec["restart"] = {
            "image": str(opts.ckpt_dir / m["ranks"][rank]["file"]),
            "sha256": m["ranks"][rank].get("sha256"),
            "job": m["job"],
            "generation": m["generation"],
            "number": m["number"],
            "id_counters": m.get("id_counters", {}),
            "last_checkpoint": last_checkpoint(m, opts.ckpt_dir),
        }
        spec["debug"] = opts.debug == rank
    return spec


def recovery_spec(
    opts: JobOptions, rank: int, incarnation: int, number: int, address: str, token: str, job: str
) -> dict[str, Any]:
    """The spec of a process that replaces failed rank `rank` as `incarnation`, from its image of checkpoint
    `number`: the one the coordinator names (not the newest on disk, which may be of a rolled-back run)."""
    program = Path(opts.program).stem
    path = opts.ckpt_dir / manifests.manifest_name(program, number)
    if not path.exists():
        raise ImageError(f"rank {rank}'s latest image is checkpoint {number}, but {path} does not exist")
    manifest = manifests.read_manifest(path, token=wire.token_bytes(token))
    entry = next((e for e in manifest.ranks if e.rank == rank), None)
    if entry is None or entry.image_number(manifest.number) != number:
        raise ImageError(f"{path.name} has no image of rank {rank} from checkpoint {number}")
    spec = rank_spec(opts, rank, address, token, job)
    spec["restart"] = {
        "image": str(opts.ckpt_dir / entry.file),
        "sha256": entry.sha256 or None,
        "job": manifest.job,
        "generation": manifest.generation,
        "number": number,
        "id_counters": {},
        "last_checkpoint": None,
    }
    spec["recover"] = {"incarnation": incarnation}
    spec["debug"] = False
    return spec


class _Job:
    """The processes of one job started on this host, and the embedded coordinator."""

    def __init__(self, opts: JobOptions) -> None:
        self.opts = opts
        self.changed = threading.Condition()
        self.processes: list[subprocess.Popen[bytes]] = []
        #: each rank's current process (a respawned rank's replaces its lost one) and its exit status
        self.current: dict[int, subprocess.Popen[bytes]] = {}
        self.exited: dict[int, int] = {}
        self._respawns: queue.SimpleQueue[tuple[int, int, int, int]] = queue.SimpleQueue()
        #: one more per whole-job restart after a fallback: a respawn the job before asked for is not done
        self.epoch = 0
        restart = opts.restart
        # One token per checkpoint directory: a new job launched into it keeps the token, so the
        # checkpoints already there stay restartable (their HMACs are keyed with it).
        existing = read_job_file(opts.ckpt_dir) or {}
        given = opts.token or os.environ.get("CKPT_TOKEN")
        if opts.coordinator is not None and not given and existing.get("address") != opts.coordinator:
            raise CoordinatorError(f"no token for the coordinator at {opts.coordinator}: set CKPT_TOKEN")
        self.token = given or existing.get("token") or wire.new_token()
        self.job_id = restart["job"] if restart else uuid.uuid4().hex[:12]
        try:  # checked here, once, rather than by every rank
            self.heartbeat = wire.Heartbeat.from_environment()
        except ProtocolError as exc:
            raise CoordinatorError(str(exc)) from None
        self.coordinator: Coordinator | None = None
        self.claim: jobdir.DirectoryClaim | None = None
        if opts.coordinator is None:
            # The directory is this job's (the CLI claims it before anything else; claim it here if not):
            # what a killed job left there can go, and nothing else writes there.
            self.claim = opts.claim or jobdir.claim(opts.ckpt_dir)
            self.claim.note(job=self.job_id)
            jobdir.remove_leftovers(opts.ckpt_dir, Path(opts.program).stem)
        # The plugins' services first (a transport's own servers ...): a job file is written only for a job that
        # can run (else a failed start would leave a job file that says its launcher died, in place of the
        # previous job's end).
        self.services = job_services(opts, self.job_id)
        self.services_env = self.services.start()
        if opts.coordinator is None:
            try:
                self.coordinator = Coordinator(
                    token=self.token,
                    ckpt_dir=opts.ckpt_dir,
                    host=opts.host,
                    port=opts.port,
                    interval=opts.interval,
                    rank_interval=opts.rank_interval,
                    keep=opts.keep,
                    phase_timeout=opts.phase_timeout,
                    job_id=self.job_id,
                    recorded_phase_timeout=opts.recorded_phase_timeout,
                    heartbeat=self.heartbeat,
                ).start()
            except BaseException:
                self.services.stop()  # no job runs on them
                raise
            self.address = self.coordinator.address
            threading.Thread(target=self._watch_coordinator, daemon=True).start()
            if opts.on_failure == "recover":
                self.coordinator.set_respawn(lambda *asked: self._respawns.put((self.epoch, *asked)))
                threading.Thread(target=self._respawner, name="ckpt-respawner", daemon=True).start()
            self._write_job_file()  # (a full disk: CkptError, and `run_job` stops the coordinator and services)
            log.info("coordinator of job %s listening on %s", self.job_id, self.address)
        else:
            self.address = opts.coordinator  # its own coordinator.json stays as `ckpt coordinator` wrote it

    def _watch_coordinator(self) -> None:  # one per job on the coordinator: a fallback's restart starts another
        assert self.coordinator is not None
        self.coordinator.ended.wait()
        with self.changed:
            self.changed.notify_all()

    def restart_after_fallback(self, outcome: dict[str, Any]) -> dict[str, Any] | None:
        """The job ended with the outcome "fallback": stop every rank process and restart the job from checkpoint
        `outcome["number"]` on the same coordinator.  None once it runs; the job's failed outcome if it cannot."""
        assert self.coordinator is not None
        print(f"ckpt: {outcome['message']}", file=sys.stderr, flush=True)
        with self.changed:
            self.epoch += 1
            self.current, self.exited = {}, {}  # what the stopped processes' exits say is no rank's
        stopping = [process for process in self.processes if process.poll() is None]
        for process in stopping:  # by PID: none of them may run on beside the restarted job
            process.kill()
        for process in stopping:
            process.wait()
        self.coordinator.remove_aborted_images()
        number = int(outcome["number"])
        try:
            path = self.opts.ckpt_dir / manifests.manifest_name(Path(self.opts.program).stem, number)
            manifest, _ = prepare_restart(path, self.opts.ckpt_dir, self.token)
        except (CkptError, OSError) as exc:
            message = f"cannot restart the job from checkpoint {number} after rank {outcome['rank']} fell back: {exc}"
            self.coordinator.fallback_failed(message)
            return {**outcome, "status": "failed", "message": message}
        # generation + 1 of the job that fell back: a restart of the same checkpoint again must not reuse one
        manifest["generation"] = max(int(manifest["generation"]), int(self.coordinator.status()["generation"]))
        self.opts.restart = manifest
        self.coordinator.next_job()
        threading.Thread(target=self._watch_coordinator, daemon=True).start()
        self.spawn()
        return None

    def spawn(self) -> None:
        for rank in range(self.opts.ranks):
            self._start_rank(rank, rank_spec(self.opts, rank, self.address, self.token, self.job_id))

    def _start_rank(self, rank: int, spec: dict[str, Any]) -> None:
        spec["print_result"] = self.coordinator is None
        # The ranks heartbeat as the coordinator expects them to (and watch it with the same timeout).
        heartbeat = {
            wire.ENV_HEARTBEAT_INTERVAL: repr(self.heartbeat.interval),
            wire.ENV_HEARTBEAT_TIMEOUT: repr(self.heartbeat.timeout),
        }
        env = dict(os.environ, **self.services_env, **heartbeat, **{SPEC_ENV: json.dumps(spec)})
        # Under --debug only the debugged rank reads the terminal; the others must not take its input.
        stdin = subprocess.DEVNULL if self.opts.debug is not None and self.opts.debug != rank else None
        process = subprocess.Popen([sys.executable, "-P", "-m", "ckpt.runtime.rank"], env=env, stdin=stdin)
        self.processes.append(process)
        self.current[rank] = process
        threading.Thread(target=self._reap, args=(rank, process), daemon=True).start()

    def _reap(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        with self.changed:
            if self.current.get(rank) is process:  # a lost incarnation's exit is not its rank's
                self.exited[rank] = code
            self.changed.notify_all()

    def _respawner(self) -> None:
        """Start the processes the coordinator asks for (its callback only queues them: it holds its lock)."""
        assert self.coordinator is not None
        while True:
            epoch, rank, incarnation, number = self._respawns.get()
            try:
                self._respawn(epoch, rank, incarnation, number)
            except Exception as exc:  # any failure (a bad image, Popen's OSError) ends the job
                self.coordinator.fail(f"cannot respawn rank {rank}: {exc}")

    def _respawn(self, epoch: int, rank: int, incarnation: int, number: int) -> None:
        spec = recovery_spec(self.opts, rank, incarnation, number, self.address, self.token, self.job_id)
        with self.changed:
            if self.outcome() is not None or epoch != self.epoch:
                return  # the job ended, or a fallback restarted it: that rank is in a whole-job restart now
            lost = self.current.get(rank)
            if lost is not None and lost.poll() is None:
                lost.kill()  # silent rather than dead: the coordinator gave up on it (its reaper reaps it)
            self.exited.pop(rank, None)
            log.info("respawning rank %d as incarnation %d from checkpoint %d", rank, incarnation, number)
            self._start_rank(rank, spec)
            self.changed.notify_all()

    def _joined_then_died(self, failed: dict[int, int]) -> bool:
        """Under recover: did every rank process that died join the job? Then the coordinator handles it."""
        assert self.coordinator is not None
        if self.opts.on_failure != "recover":
            return False
        return all(self.coordinator.rank_pid(rank) == self.current[rank].pid for rank in failed)

    def outcome(self) -> dict[str, Any] | None:
        return self.coordinator.outcome if self.coordinator else None

    def wait(self, progress: _Progress | None) -> dict[str, Any]:
        """Until the coordinator reports the job's end, or a rank process dies on its own."""
        with self.changed:
            while True:
                outcome = self.outcome()
                if outcome is not None:
                    return outcome
                failed = {r: c for r, c in self.exited.items() if c != 0}
                if failed or len(self.exited) == len(self.current):
                    if self.coordinator is None:
                        return _external_outcome(self.exited)
                    if failed and self._joined_then_died(failed):
                        # it marks them failed and its respawn replaces them, or it ends the job
                        self.changed.wait(timeout=1.0)
                        continue
                    # the coordinator hears of a lost rank over its socket; give it a moment to say so
                    self.changed.wait_for(lambda: self.outcome() is not None, timeout=2.0)
                    outcome = self.outcome()
                    if outcome is not None:
                        return outcome
                    rank, code = next(iter(sorted((failed or self.exited).items())))
                    message = f"rank {rank} exited with {_describe(code)} before joining the job"
                    self.coordinator.fail(message)
                    return {"status": "failed", "message": message, "results": {}}
                self.changed.wait(timeout=0.1 if progress else None)
                if progress:
                    progress.update()

    def stop(self, grace: float = _REAP_SECONDS) -> None:
        """Reap every rank process (killing what does not exit) and stop the coordinator."""
        for process in self.processes:
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.coordinator is not None:
            self.coordinator.stop()
            # a rank still writing when its checkpoint was aborted may have left its image behind
            self.coordinator.remove_aborted_images()
        try:
            self.services.stop()
        except CkptError as exc:  # the job itself is over: say so, and still report its results
            print(f"ckpt: warning: {exc}", file=sys.stderr)

    def _write_job_file(self, ended: dict[str, Any] | None = None) -> None:
        assert self.claim is not None
        write_job_file(
            self.opts.ckpt_dir,
            address=self.address,
            token=self.token,
            job=self.job_id,
            pid=os.getpid(),
            claim=self.claim.id,
            ended=ended,
        )

    def record_end(self) -> None:
        """Write the job's final status into coordinator.json, where `ckpt status` finds it from now on.

        A directory that cannot take it (a full disk) costs that record only: the job's ranks are still reaped
        and its outcome reported."""
        if self.coordinator is None:
            return
        try:
            self._write_job_file(ended=self.coordinator.status())
        except CkptError as exc:
            print(
                f"ckpt: warning: the job's end could not be recorded ({exc}): ckpt status cannot show it",
                file=sys.stderr,
            )

    def terminate(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()


def _external_outcome(exited: dict[int, int]) -> dict[str, Any]:
    failed = {r: c for r, c in exited.items() if c != 0}
    if failed:
        rank, code = sorted(failed.items())[0]
        return {"status": "failed", "message": f"rank {rank} exited with {_describe(code)}", "results": {}}
    return {"status": "finished", "message": "all ranks exited", "results": {}}


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class _Progress:
    """A progress bar for image loading on restart, fed by the ranks' progress reports."""

    def __init__(self, coordinator: Coordinator, total: int) -> None:
        from tqdm import tqdm

        self._coordinator = coordinator
        # disable=None: no bar (and no \r updates) when stderr is not a terminal
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading images", file=sys.stderr, disable=None)
        self._closed = False

    def update(self) -> None:
        if self._closed:
            return
        done = self._coordinator.bytes_loaded()
        self._bar.update(done - self._bar.n)
        if done >= self._bar.total:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._bar.close()


def run_job(opts: JobOptions) -> int:
    """Run a job to its end in the foreground; print results; return the exit status."""
    job = _Job(opts)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    progress = None
    try:
        _announce(job)
        job.spawn()
        if opts.restart is not None and job.coordinator is not None:
            total = sum(int(r["bytes"]) for r in opts.restart["ranks"])
            if total >= _PROGRESS_MIN_BYTES:
                progress = _Progress(job.coordinator, total)
        outcome = job.wait(progress)
        while outcome["status"] == "fallback":  # a rank could not be recovered alone: a whole-job restart
            outcome = job.restart_after_fallback(outcome) or job.wait(None)  # (a progress bar closes at the end)
    except KeyboardInterrupt:
        print("ckpt: interrupted; killing the job's ranks", file=sys.stderr)
        if job.coordinator is not None:
            job.coordinator.kill("interrupted (Ctrl-C or SIGTERM to ckpt launch)")
            job.record_end()
        job.terminate()
        job.stop()
        return 130
    except BaseException:  # whatever stops the launcher takes the job's processes and services with it
        job.terminate()
        job.stop()
        raise
    finally:
        if progress:
            progress.close()
        signal.signal(signal.SIGTERM, previous)
    if outcome["status"] == "failed":
        job.terminate()
    job.record_end()
    job.stop()
    return report(outcome, opts.ckpt_dir)


def _announce(job: _Job) -> None:
    """Say, before anything runs, which job this is, where it checkpoints and how to reach it."""
    opts = job.opts
    name = Path(opts.program).name
    if opts.restart is not None:
        m = opts.restart
        what = f"restarting checkpoint {m['number']} of {name} ({opts.ranks} ranks, generation {m['generation'] + 1})"
    else:
        what = f"{opts.ranks} rank{'s' if opts.ranks != 1 else ''} of {name}"
    if job.coordinator is None:
        print(f"ckpt: {what} on the coordinator at {job.address}", file=sys.stderr, flush=True)
        return
    print(f"ckpt: job {job.job_id}: {what}; checkpoint directory {opts.ckpt_dir}", file=sys.stderr)
    if opts.native:
        print("ckpt: --native: no plugins and no checkpoints", file=sys.stderr, flush=True)
        return
    where = f"--ckpt-dir {opts.ckpt_dir}"
    print(f"ckpt: checkpoint it with: ckpt checkpoint {where}  (and: ckpt status {where})", file=sys.stderr, flush=True)


def report(outcome: dict[str, Any], ckpt_dir: Path) -> int:
    status = outcome["status"]
    if status == "finished":
        for rank, result in sorted(outcome.get("results", {}).items()):
            print(f"[rank {rank}] result: {result}", flush=True)
        return EXIT_OK
    if status == "killed":
        last = outcome.get("last_checkpoint")
        hint = f"; restart with: ckpt restart --ckpt-dir {ckpt_dir}" if last else ""
        print(f"ckpt: {outcome['message']}{hint}", file=sys.stderr)
        return EXIT_OK
    sys.stderr.write(outcome.get("traceback", ""))  # the failing program's own frames, once
    print(f"error: {outcome['message']}", file=sys.stderr)
    return EXIT_FAILED
