"""The checkpoint directory of a job: its exclusive lock, its job file (coordinator.json), its leftovers."""

# One directory holds one live job.  Whoever writes coordinator.json there (the
# launcher of `ckpt launch` / `ckpt restart`, or a standalone `ckpt coordinator`)
# first takes an exclusive flock on DIR/job.lock and keeps it until it exits,
# so the kernel releases it even after kill -9.  The lock file holds the
# owner's pid and job id.
#
# Clients (`status`, `checkpoint`, `kill`) never trust coordinator.json alone:
# a job file is the live job's only when the directory is locked by the pid the
# file names.  A locked directory whose job file is someone else's (the job
# that ran before a restart) belongs to a job that is *starting*: clients wait
# for it (or report "starting") instead of talking to the dead job.  An
# unlocked directory whose job file records no end belongs to a launcher that
# died without a word (kill -9).
#
# A client probes the lock with a shared, non-blocking flock that it drops at
# once; a launcher that happens to try its exclusive lock at that instant
# retries for a moment before it concludes the directory is taken.

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt._errors import CkptError, CoordinatorError

log = logging.getLogger(__name__)

JOB_FILE = "coordinator.json"
LOCK_FILE = "job.lock"
#: How long a launcher retries a lock that a client's probe may be holding for an instant ...
_CLAIM_RETRY_SECONDS = 1.0
#: ... and one whose job has recorded its end and is only reaping its ranks (`kill` then `restart`).
ENDING_WAIT = 60.0
_POLL = 0.02


class DirectoryBusy(CkptError):
    """The checkpoint directory belongs to a job that is still alive."""


def prepare_directory(ckpt_dir: Path) -> Path:
    """Create the directory (0700 when ckpt creates it) and check it can be written; one clear line if not."""
    try:
        ckpt_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise CkptError(f"cannot use {ckpt_dir} as the checkpoint directory: it is a file") from None
    except OSError as exc:
        raise CkptError(f"cannot create the checkpoint directory {ckpt_dir}: {exc.strerror or exc}") from None
    if not os.access(ckpt_dir, os.W_OK | os.X_OK):
        raise CkptError(f"cannot write to the checkpoint directory {ckpt_dir}: permission denied")
    return ckpt_dir


@dataclass
class DirectoryClaim:
    """An exclusive claim on a checkpoint directory, held until `release()` or the process's exit."""

    directory: Path
    fd: int
    #: names this claim in the lock file and in the job file its holder writes (a pid can be reused)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def note(self, **fields: Any) -> None:
        """Record who holds the claim (pid, job id) in the lock file, for clients and error messages."""
        data = json.dumps({"pid": os.getpid(), "claim": self.id, **fields}).encode() + b"\n"
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError as exc:  # a full disk
            raise CkptError(f"cannot write {self.directory / LOCK_FILE}: {exc.strerror or exc}") from None

    def release(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)  # a later holder's record is never mistaken for this one
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1


def claim(ckpt_dir: Path, *, job: str = "", create: bool = True) -> DirectoryClaim:
    """Take the directory for a new job (creating it unless `create` is False); DirectoryBusy if a live
    job has it.  A job that has recorded its end and is only reaping its ranks is waited for."""
    if not create and not ckpt_dir.is_dir():
        raise CkptError(f"no checkpoint in {ckpt_dir}: no such directory")
    directory = prepare_directory(ckpt_dir)
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CkptError(f"cannot create {path}: {exc.strerror or exc}") from None
    started = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise CkptError(f"cannot lock {path}: {exc.strerror or exc}") from None
            holder = _read_lock_record(fd)
            patience = ENDING_WAIT if _has_ended(directory, holder) else _CLAIM_RETRY_SECONDS
            if time.monotonic() < started + patience:
                # a client's probe holds it for microseconds, an ended job while it reaps its ranks
                time.sleep(_POLL)
                continue
            os.close(fd)
            raise DirectoryBusy(_busy_message(directory, holder)) from None
    held = DirectoryClaim(directory, fd)
    try:
        held.note(job=job)
    except CkptError:
        held.release()
        raise
    return held


def _has_ended(directory: Path, holder: dict[str, Any]) -> bool:
    """Has the holder of the directory's lock recorded its job's end (it is only reaping its ranks)?"""
    try:
        record = read_job_file(directory)
    except CoordinatorError:
        return False
    return (
        record is not None
        and "ended" in record
        and bool(holder.get("claim"))
        and (record.get("claim") == holder.get("claim"))
    )


def wait_released(ckpt_dir: Path, claim_id: str, timeout: float) -> bool:
    """Wait until the claim `claim_id` no longer holds the directory (its launcher has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        holder = owner(ckpt_dir)
        if holder is None or holder.get("claim") != claim_id:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)  # the polling interval of a bounded wait for the launcher to exit


def _busy_message(directory: Path, holder: dict[str, Any]) -> str:
    who = f"job {holder['job']}" if holder.get("job") else "a job"
    pid = f" (pid {holder['pid']})" if holder.get("pid") else ""
    return (
        f"{who} is still running in {directory}{pid}: end it first (ckpt kill --ckpt-dir {directory}) "
        "or use another --ckpt-dir"
    )


def owner(ckpt_dir: Path) -> dict[str, Any] | None:
    """Who holds the directory's lock ({"pid", "job"}), or None when no live job holds it."""
    try:
        fd = os.open(ckpt_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return _read_lock_record(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_lock_record(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ----------------------------------------------------------- the job file
def write_job_file(
    ckpt_dir: Path,
    *,
    address: str,
    token: str,
    job: str,
    pid: int,
    claim: str = "",
    ended: dict[str, Any] | None = None,
    standalone: bool = False,
) -> Path:
    """Record where the job's coordinator is, so later commands find it without flags (mode 0600).

    `claim` is the id of the holder's DirectoryClaim.  When the job has ended, `ended` is its final
    status, which `ckpt status` shows from then on.
    """
    ckpt_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    record: dict[str, Any] = {"address": address, "token": token, "job": job, "pid": pid, "claim": claim}
    if standalone:
        record["standalone"] = True  # `ckpt coordinator`: serves one job after another, holds the directory
    if ended is not None:
        record["ended"] = ended
    path = ckpt_dir / JOB_FILE
    write_private(path, (json.dumps(record) + "\n").encode())
    return path


def read_job_file(ckpt_dir: Path) -> dict[str, Any] | None:
    path = ckpt_dir / JOB_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CoordinatorError(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or not {"address", "token"} <= data.keys():
        raise CoordinatorError(f"{path} is not a ckpt coordinator file")
    return data


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically, created 0600 (the directory's files hold the job's state); CkptError
    naming it if the machine refuses."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, a directory not ours: one line naming the file
        tmp.unlink(missing_ok=True)
        raise CkptError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class JobRecord:
    """What a client knows of the job in a directory."""

    state: str  # "live", "starting", "ended", "gone" (launcher died without a word) or "none"
    record: dict[str, Any] | None
    holder: dict[str, Any] | None


def find_job(ckpt_dir: Path, *, wait: float = 0.0, wait_none: float = 0.0) -> JobRecord:
    """The job a client should address in `ckpt_dir`; with `wait`, waits that long for a starting job,
    and with `wait_none` that long for a job to appear where none is, or only an ended one
    (`ckpt launch ... &` or `ckpt restart ... &` was just typed).

    The lock decides, not the job file: while a launcher holds the directory, a job file that another
    process wrote (the job before a restart, which may have recorded its end) is not this job's.
    """
    started = time.monotonic()
    deadline = started + wait
    while True:
        holder = owner(ckpt_dir)
        record = read_job_file(ckpt_dir)
        if holder is not None and not process_exists(holder.get("pid")):
            # a new holder between its flock and its note(): the record is a dead holder's
            holder = {"pid": None, "claim": None, "job": ""}
        if holder is None:
            if time.monotonic() < started + wait_none:
                time.sleep(_POLL)  # the polling interval of a bounded wait for a launcher to claim it
                continue
            if record is None:
                return JobRecord("none", None, None)
            return JobRecord("ended" if "ended" in record else "gone", record, None)
        if record is not None and record.get("claim") and record.get("claim") == holder.get("claim"):
            return JobRecord("ended" if "ended" in record else "live", record, holder)
        if time.monotonic() >= deadline:
            return JobRecord("starting", record, holder)
        time.sleep(_POLL)  # the polling interval of a bounded wait for the starting job's file


# ----------------------------------------------------------- leftovers
#: The temporary files the core writes (images, manifests, latest, the job file): only those go. A plugin
#: cleans up after itself in its ckpt_job_start (the simib plugin: fabric.json).
_TMP = re.compile(r"(ckpt_.+|latest|coordinator\.json)\.tmp")


def remove_leftovers(ckpt_dir: Path, program: str) -> list[Path]:
    """What a crashed or killed job left behind: temp files, and `program`'s images that no manifest commits.

    Called by a new launch or restart once it holds the directory, so nothing else can be writing there.
    """
    from ckpt import _manifest as manifests

    removed: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(ckpt_dir):
            path = ckpt_dir / name
            if _TMP.fullmatch(name) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    removed += manifests.remove_uncommitted(ckpt_dir, program)
    for path in removed:
        log.info("removed %s, left behind by an earlier job", path)
    return removed


def process_exists(pid: object) -> bool:
    """Is there a process with this pid (on this host)?"""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
