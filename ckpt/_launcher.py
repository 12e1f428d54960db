"""Starting a job: the embedded coordinator, one process per rank, waiting, results and exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ckpt._errors import CoordinatorError, ImageError, ProtocolError
from ckpt.coordinator import protocol
from ckpt.coordinator.client import read_job_file, write_job_file
from ckpt.coordinator.server import Coordinator
from ckpt.runtime import images
from ckpt.runtime import manifest as manifests
from ckpt.runtime.rank import SPEC_ENV
from ckpt.verbs import fabric

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
    coordinator: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    interval: float | None = None
    keep: int = 0
    with_plugins: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    native: bool = False
    transport: str = "simib"
    options: dict[str, Any] = field(default_factory=dict)
    log_level: str = "WARNING"
    phase_timeout: float = 300.0
    token: str | None = None
    restart: dict[str, Any] | None = None  # the manifest to restart from
    fabric: str | None = None  # an existing simulated fabric; None: the job starts its own (simib only)
    fabric_latency: float = 0.0  # link model of the job's own fabric (seconds, bytes/s; 0 = ideal)
    fabric_bandwidth: float = 0.0
    debug: int | None = None  # restart: this rank stops in pdb before its next step (stdin is its)


def external_rank() -> tuple[int, int | None] | None:
    """(rank, size) when an external launcher (mpiexec, srun) started this process."""
    for rank_var, size_var in RANK_VARIABLES:
        if rank_var in os.environ:
            size = os.environ.get(size_var)
            return int(os.environ[rank_var]), int(size) if size else None
    return None


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
    }
    if opts.restart is not None:
        m = opts.restart
        spec["restart"] = {
            "image": str(opts.ckpt_dir / m["ranks"][rank]["file"]),
            "job": m["job"],
            "generation": m["generation"],
            "number": m["number"],
            "id_counters": m.get("id_counters", {}),
        }
        spec["debug"] = opts.debug == rank
    return spec


def prepare_restart(target: str | None, ckpt_dir: Path, token: str | None) -> tuple[dict[str, Any], Path, str]:
    """Find, authenticate and sanity-check a checkpoint: (manifest, its directory, token).

    Every check that needs no full read happens here, before any process starts;
    the ranks verify each image's checksum and HMAC while loading it.
    """
    if target is not None and Path(target).is_dir():
        ckpt_dir, target = Path(target), None
    path = Path(target) if target is not None else manifests.latest_manifest(ckpt_dir)
    directory = path.resolve().parent
    if token is None:
        job = read_job_file(directory)
        token = job["token"] if job else None
    if token is None:
        raise ImageError(f"no token to authenticate {path}: set CKPT_TOKEN (or keep coordinator.json beside it)")
    manifest = manifests.read_manifest(path, token=protocol.token_bytes(token))
    program = manifest["program"]
    if not Path(program["path"]).is_file():
        raise ImageError(f"the checkpointed program {program['path']} no longer exists")
    if len(manifest["ranks"]) != manifest["size"]:
        raise ImageError(f"manifest {path} lists {len(manifest['ranks'])} images for {manifest['size']} ranks")
    for entry in manifest["ranks"]:
        image = directory / entry["file"]
        if not image.is_file():
            raise ImageError(f"image {image} of checkpoint {manifest['number']} is missing")
        size = image.stat().st_size
        if size != entry["bytes"]:
            raise ImageError(f"image {image} is truncated or damaged: {size} bytes, the manifest says {entry['bytes']}")
        header = images.read_header(image)
        if (header.get("program"), header.get("job")) != (program["name"], manifest["job"]):
            raise ImageError(
                f"image {image} belongs to program {header.get('program')!r} (job {header.get('job')}), "
                f"not to {program['name']!r} (job {manifest['job']}) of manifest {path.name}"
            )
        if (header.get("rank"), header.get("number")) != (entry["rank"], manifest["number"]):
            raise ImageError(
                f"image {image} is rank {header.get('rank')} of checkpoint {header.get('number')}, "
                f"the manifest expects rank {entry['rank']} of checkpoint {manifest['number']}"
            )
    return manifest, directory, token


class _Job:
    """The processes of one job started on this host, and the embedded coordinator."""

    def __init__(self, opts: JobOptions) -> None:
        self.opts = opts
        self.changed = threading.Condition()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.exited: dict[int, int] = {}
        restart = opts.restart
        # One token per checkpoint directory: a new job launched into it keeps the token, so the
        # checkpoints already there stay restartable (their HMACs are keyed with it).
        existing = read_job_file(opts.ckpt_dir) or {}
        given = opts.token or os.environ.get("CKPT_TOKEN")
        if opts.coordinator is not None and not given and existing.get("address") != opts.coordinator:
            raise CoordinatorError(f"no token for the coordinator at {opts.coordinator}: set CKPT_TOKEN")
        self.token = given or existing.get("token") or protocol.new_token()
        self.job_id = restart["job"] if restart else uuid.uuid4().hex[:12]
        try:  # checked here, once, rather than by every rank
            self.heartbeat = protocol.Heartbeat.from_environment()
        except ProtocolError as exc:
            raise CoordinatorError(str(exc)) from None
        self._refuse_standalone_fabric()
        self.coordinator: Coordinator | None = None
        if opts.coordinator is None:
            self.coordinator = Coordinator(
                token=self.token,
                ckpt_dir=opts.ckpt_dir,
                host=opts.host,
                port=opts.port,
                interval=opts.interval,
                keep=opts.keep,
                phase_timeout=opts.phase_timeout,
                heartbeat=self.heartbeat,
            ).start()
            self.address = self.coordinator.address
            threading.Thread(target=self._watch_coordinator, daemon=True).start()
            write_job_file(opts.ckpt_dir, address=self.address, token=self.token, job=self.job_id, pid=os.getpid())
        else:
            self.address = opts.coordinator  # its own coordinator.json stays as `ckpt coordinator` wrote it
        self.fabric: fabric.SubnetManager | None = None
        self.fabric_env = self._start_fabric()

    def _start_fabric(self) -> dict[str, str]:
        """The ranks' simulated fabric: --fabric, or a subnet manager of the job's own (a fresh one, with
        new LIDs, for every launch and restart), recorded in the ckpt dir for `ckpt fabric`."""
        opts = self.opts
        if opts.transport != "simib":
            return {}
        if opts.fabric is not None:
            address, token = fabric.locate(opts.fabric, opts.ckpt_dir)
        else:
            model = fabric.LinkModel(opts.fabric_latency, opts.fabric_bandwidth)
            self.fabric = fabric.SubnetManager(host=opts.host, link_model=model).start()
            fabric.write_fabric_file(opts.ckpt_dir, self.fabric, job=self.job_id)
            address, token = self.fabric.address, self.fabric.token
        return {fabric.ENV_ADDRESS: address, fabric.ENV_TOKEN: token}

    def _refuse_standalone_fabric(self) -> None:
        """The job would hide a fabric that `ckpt fabric start` recorded in its ckpt dir: say so instead."""
        opts = self.opts
        if opts.transport != "simib" or opts.fabric is not None:
            return
        standalone = fabric.running_fabric(opts.ckpt_dir)
        if standalone is not None and standalone.get("job") is None:
            raise fabric.FabricError(
                f"a fabric started by `ckpt fabric start` is running for {opts.ckpt_dir} at "
                f"{standalone['address']}: pass --fabric {standalone['address']} to run on it, "
                f"or stop it with: ckpt fabric stop --dir {opts.ckpt_dir}"
            )

    def _stop_fabric(self) -> None:
        if self.fabric is not None:
            self.fabric.stop()
            fabric.remove_fabric_file(self.opts.ckpt_dir, self.fabric.address)

    def _watch_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.ended.wait()
        with self.changed:
            self.changed.notify_all()

    def spawn(self) -> None:
        for rank in range(self.opts.ranks):
            spec = rank_spec(self.opts, rank, self.address, self.token, self.job_id)
            spec["print_result"] = self.coordinator is None
            # The ranks heartbeat as the coordinator expects them to (and watch it with the same timeout).
            heartbeat = {
                protocol.ENV_HEARTBEAT_INTERVAL: repr(self.heartbeat.interval),
                protocol.ENV_HEARTBEAT_TIMEOUT: repr(self.heartbeat.timeout),
            }
            env = dict(os.environ, **self.fabric_env, **heartbeat, **{SPEC_ENV: json.dumps(spec)})
            # Under --debug only the debugged rank reads the terminal; the others must not take its input.
            stdin = subprocess.DEVNULL if self.opts.debug is not None and self.opts.debug != rank else None
            process = subprocess.Popen([sys.executable, "-P", "-m", "ckpt.runtime.rank"], env=env, stdin=stdin)
            self.processes.append(process)
            threading.Thread(target=self._reap, args=(rank, process), daemon=True).start()

    def _reap(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        with self.changed:
            self.exited[rank] = code
            self.changed.notify_all()

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
                if failed or len(self.exited) == len(self.processes):
                    if self.coordinator is None:
                        return _external_outcome(self.exited)
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
        self._stop_fabric()

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
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading images", file=sys.stderr)
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
        job.spawn()
        if opts.restart is not None and job.coordinator is not None:
            total = sum(int(r["bytes"]) for r in opts.restart["ranks"])
            if total >= _PROGRESS_MIN_BYTES:
                progress = _Progress(job.coordinator, total)
        outcome = job.wait(progress)
    except KeyboardInterrupt:
        print("ckpt: interrupted; killing the job's ranks", file=sys.stderr)
        job.terminate()
        job.stop()
        return 130
    finally:
        if progress:
            progress.close()
        signal.signal(signal.SIGTERM, previous)
    if outcome["status"] == "failed":
        job.terminate()
    if job.coordinator is not None:
        final = job.coordinator.status()
        write_job_file(
            opts.ckpt_dir, address=job.address, token=job.token, job=job.job_id, pid=os.getpid(), ended=final
        )
    job.stop()
    return report(outcome, opts.ckpt_dir)


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
    print(f"error: {outcome['message']}", file=sys.stderr)
    return EXIT_FAILED
