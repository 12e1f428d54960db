"""Stable logging, the baseline remote logging is measured against (FT-KDSM §6.2): fsync to local disk.

Rationale.  Receiver-based logging to stable storage, as the paper's baseline does it:
each rank keeps the diffs and write notices it received during the current interval in
memory and, at every release and every barrier -- before the release or the arrival
leaves, so nothing another rank can see depends on an unlogged message -- appends them
to its own log file and fsyncs it.  The file is emptied when the rank's checkpoint
exists (everything before it is in the image) and when the whole job restarts.  Records
have the remote log's format (`_records`), committed by position in the file.

Under ``onesided`` a home's CPU never sees the diffs written into its pages, so there
the writer logs the diffs it wrote (sender-based) -- the only place they are seen.
Nothing reads these files back: stable logging is the failure-free cost baseline only
(recovery by replay reads the remote logs, docs/remotelog.md).  A flush that cannot
write (a full disk) stops the rank with one line naming the file.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import ckpt
from dsm import Diff

from ._records import RecordKind, diff_record, encode, notices_payload, sealed


class StableLog:
    """One rank's stable log for one `dsm.Memory` (kept in ``memory.extensions``, pickled with it)."""

    def __init__(self, memory: Any, directory: str) -> None:
        self.memory, self.rt, self.rank = memory, memory.rt, memory.rank
        self.onesided = memory.protocol == "onesided"
        self.path = Path(directory or ".") / f"remotelog-stable-{memory.rank}.log"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")
        self.position = 0
        self.pending: list[bytearray] = []
        self.notices: list[Any] = []
        self.serial = 0
        self.mutex = threading.Lock()  # the handler thread adds received diffs under async
        self.register()

    def register(self) -> None:
        host = getattr(self.rt, "plugins", None)
        if host is not None:
            from dsm import hookspecs

            host.add_hookspecs(hookspecs)
            host.register(self, name=f"remotelog-stable-{id(self)}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["mutex"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.mutex = threading.Lock()
        self.register()

    def _keep(self, record: bytearray) -> None:
        with self.mutex:
            self.pending.append(record)

    # ------------------------------------------------------------------ what is received
    @ckpt.hookimpl
    def dsm_diffs_received(self, writer: int, interval: int, diffs: list[tuple[int, Diff]]) -> None:
        """*handler*, async: a message's diffs in one record."""
        self._keep(diff_record(RecordKind.DIFF, writer, interval, [(gid, diff.encode()) for gid, diff in diffs]))

    @ckpt.hookimpl
    def dsm_diff_created(self, gid: int, home: int, interval: int, diff: Diff) -> None:
        if self.onesided and home != self.rank:
            self._keep(diff_record(RecordKind.DIFF, self.rank, interval, [(gid, diff.encode())]))

    @ckpt.hookimpl
    def dsm_write_notices_received(self, source: str, notices: list[Any]) -> None:
        self.notices.extend(notices)

    @ckpt.hookimpl
    def dsm_lock_acquired(self, lock: int) -> None:
        payload = notices_payload(list(self.memory.vt), self.notices)
        self.notices = []
        self._keep(encode(RecordKind.NOTICES, self.rank, payload, tag=lock, serial=self._serial()))

    @ckpt.hookimpl
    def dsm_barrier_passed(self, epoch: int) -> None:
        payload = notices_payload(list(self.memory.vt), self.notices)
        self.notices = []
        self._keep(encode(RecordKind.BARRIER, self.rank, payload, tag=epoch, serial=self._serial()))

    def _serial(self) -> int:
        self.serial += 1
        return self.serial - 1

    # ------------------------------------------------------------------ flushes
    @ckpt.hookimpl
    def dsm_lock_releasing(self, lock: int) -> None:
        self.flush()

    @ckpt.hookimpl
    def dsm_barrier_arriving(self, epoch: int) -> None:
        self.flush()

    def flush(self) -> None:
        """Append what was received since the last flush to the file and fsync it."""
        with self.mutex:
            records, self.pending = self.pending, []
        if not records:
            return
        started = time.perf_counter()
        data = sealed(records, self.position)
        try:
            with open(self.path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a full disk: the release or arrival must not leave unlogged, so the rank stops
            why = exc.strerror or exc
            raise ckpt.PluginError(f"ckpt_remotelog: stable logging cannot write {self.path}: {why}") from None
        self.position += len(data)
        memory = self.memory
        memory.account("stable_records", len(records))
        memory.account("stable_bytes", len(data))
        memory.account("stable_fsyncs")
        memory.account("log_seconds", time.perf_counter() - started)

    def truncate(self) -> None:
        with self.mutex:
            self.pending.clear()
        with open(self.path, "wb") as f:
            os.fsync(f.fileno())
        self.position = 0

    @ckpt.hookimpl
    def ckpt_checkpointed(self) -> None:
        self.truncate()  # everything logged so far happened before the checkpoint: the image holds it

    @ckpt.hookimpl
    def ckpt_resume(self, restarted: bool) -> None:
        if restarted and not getattr(self.rt, "recovered", False):
            self.truncate()
