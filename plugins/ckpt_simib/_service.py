"""A job's fabric: its subnet manager (or the one --fabric names), and fabric.json, where a fabric is recorded."""

# A job's launcher records its fabric in the ckpt dir, as `ckpt fabric start` records a standalone
# one there, so that `ckpt fabric ...` and `ckpt launch --fabric` find it by directory.  Every launch
# and restart gets a fresh subnet manager (new LIDs): the virtualization plugin hides the change.

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckpt import CkptError
from ckpt.plugin import JobInfo
from ckpt.verbs.fabric import (
    ENV_ADDRESS,
    ENV_TOKEN,
    FabricClient,
    FabricError,
    LinkModel,
    SubnetManager,
    parse_bandwidth,
    parse_latency,
)
from ckpt_simib import FABRIC_FILE, TRANSPORT


def write_fabric_file(directory: Path | str, sm: SubnetManager, *, job: str | None = None) -> Path:
    """Record where `sm` listens in DIRECTORY/fabric.json (mode 0600: it holds the token).

    `job` is the id of the job whose launcher runs `sm`; None for a fabric of its own (`ckpt fabric start`).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FABRIC_FILE
    tmp = path.with_suffix(".json.tmp")
    record = {
        "address": sm.address,
        "token": sm.token,
        "pid": os.getpid(),
        "fabric": sm.fabric_id,
        "latency": sm.link_model.latency,
        "bandwidth": sm.link_model.bandwidth,
        "job": job,
    }
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:  # a full disk
        tmp.unlink(missing_ok=True)
        raise CkptError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def read_fabric_file(directory: Path | str) -> dict[str, Any] | None:
    """DIRECTORY/fabric.json, or None if there is none."""
    path = Path(directory) / FABRIC_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise FabricError(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or not {"address", "token"} <= data.keys():
        raise FabricError(f"{path} is not a ckpt fabric file")
    return data


def remove_fabric_file(directory: Path | str, address: str) -> None:
    """Remove DIRECTORY/fabric.json if it still names the fabric at `address`."""
    try:
        record = read_fabric_file(directory)
    except FabricError:
        return
    if record is not None and record["address"] == address:
        (Path(directory) / FABRIC_FILE).unlink(missing_ok=True)


def running_fabric(directory: Path | str) -> dict[str, Any] | None:
    """DIRECTORY/fabric.json if the fabric it names still answers, else None (no file, or a stale one)."""
    try:
        record = read_fabric_file(directory)
        if record is None:
            return None
        FabricClient(str(record["address"]), str(record["token"]), timeout=5.0).close()
    except FabricError:
        return None
    return record


def locate(address: str | None, directory: Path | None) -> tuple[str, str]:
    """(address, token) of a fabric: `address` with $CKPT_FABRIC_TOKEN, else DIRECTORY/fabric.json."""
    record = read_fabric_file(directory) if directory is not None else None
    if address:
        token = os.environ.get(ENV_TOKEN)
        if not token and record is not None and record["address"] == address:
            token = record["token"]
        if not token:
            raise FabricError(f"no token for the fabric at {address}: set {ENV_TOKEN}")
        return address, token
    if record is None:
        where = f"no {FABRIC_FILE} in {directory}" if directory is not None else "no fabric directory"
        raise FabricError(
            f"no fabric given and {where}: pass --fabric HOST:PORT, or --dir of a fabric (ckpt fabric start)"
        )
    return str(record["address"]), str(record["token"])


def link_model(latency: str | None, bandwidth: str | None) -> tuple[float, float]:
    """(seconds, bytes/s) from --fabric-latency / --fabric-bandwidth; CkptError with one line if malformed."""
    try:
        return parse_latency(latency or "0"), parse_bandwidth(bandwidth or "0")
    except ValueError as exc:
        raise CkptError(str(exc)) from None


# ----------------------------------------------------------- the fabric of a job
#: The subnet managers this launcher runs, by the ckpt dir of their job.
_running: dict[Path, SubnetManager] = {}


def job_start(job: JobInfo) -> dict[str, str] | None:
    """The ranks' fabric: --fabric, or a subnet manager of the job's own, recorded in the ckpt dir for
    `ckpt fabric`; its address and token for the ranks' environment. None for another transport."""
    remove_stale_fabric_file(job.ckpt_dir)
    latency, bandwidth = job.options.get("fabric_latency"), job.options.get("fabric_bandwidth")
    address = job.options.get("fabric")
    # A restart takes the link model from the manifest, so it is no mistake there: only a launch is told.
    if job.transport != TRANSPORT:
        if (latency or bandwidth) and not job.restarted:
            raise CkptError(
                f"--fabric-latency / --fabric-bandwidth model {TRANSPORT}'s links; --transport {job.transport} has none"
            )
        return None
    model = LinkModel(*link_model(latency, bandwidth))
    if address:
        if (latency or bandwidth) and not job.restarted:
            raise CkptError(
                "--fabric-latency / --fabric-bandwidth set the link model of a fabric the job starts itself; "
                "an existing fabric (--fabric) keeps the one it was started with"
            )
        found, token = locate(str(address), job.ckpt_dir)
        return {ENV_ADDRESS: found, ENV_TOKEN: token}
    if job.external_rank is not None:
        return None  # each rank process has a private fabric: fine for one rank, not for a job
    _refuse_standalone_fabric(job.ckpt_dir)
    sm = SubnetManager(host=job.host, link_model=model).start()
    try:
        write_fabric_file(job.ckpt_dir, sm, job=job.job)
    except BaseException:
        sm.stop()
        raise
    _running[job.ckpt_dir] = sm
    return {ENV_ADDRESS: sm.address, ENV_TOKEN: sm.token}


def remove_stale_fabric_file(ckpt_dir: Path) -> list[Path]:
    """What a job's launcher killed with -9 left: its fabric.json (the subnet manager died with it), and a
    fabric.json.tmp. A standalone fabric's file (`ckpt fabric stop` handles those) and a live one stay."""
    from ckpt.plugin.cli import process_exists

    removed = []
    tmp = ckpt_dir / (FABRIC_FILE + ".tmp")
    if tmp.is_file():
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    path = ckpt_dir / FABRIC_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return removed
    if isinstance(record, dict) and record.get("job") and not process_exists(record.get("pid")):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def job_stop(job: JobInfo) -> None:
    """Stop the job's own subnet manager, if it has one, and remove its fabric.json."""
    sm = _running.pop(job.ckpt_dir, None)
    if sm is not None:
        sm.stop()
        remove_fabric_file(job.ckpt_dir, sm.address)


def _refuse_standalone_fabric(ckpt_dir: Path) -> None:
    """The job would hide a fabric that `ckpt fabric start` recorded in its ckpt dir: say so instead."""
    standalone = running_fabric(ckpt_dir)
    if standalone is not None and standalone.get("job") is None:
        raise FabricError(
            f"a fabric started by `ckpt fabric start` is running for {ckpt_dir} at "
            f"{standalone['address']}: pass --fabric {standalone['address']} to run on it, "
            f"or stop it with: ckpt fabric stop --dir {ckpt_dir}"
        )
