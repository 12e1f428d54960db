"""Where a `tcp` HCA is: port "LIDs" and endpoints, without a subnet manager."""

# simib's HCAs find each other through the subnet manager.  The tcp provider
# has none: each HCA claims two random numbers in the unicast LID range as its
# ports' LIDs (they only name endpoints: under ckpt_ib the program sees
# virtual LIDs anyway) and records "LID -> host:port, port" in a directory:
#
# * under a ckpt runtime, the coordinator's key-value store (namespace
#   "ib2tcp", scoped to the generation, so a restart starts empty): ranks on
#   any host reach it, and a claim is an atomic increment, so two HCAs never
#   get the same LID;
# * otherwise, with $CKPT_TCP_DIRECTORY set, files in that directory (one per
#   LID, created exclusively): processes on one host, or on a shared file
#   system, without ckpt;
# * otherwise, a table in this process (one-process programs and tests).
#
# There is no link model and no fault injection (`ckpt fabric fail-link` is
# simib's); every link is up.  A peer that is gone is found out as on simib:
# its connection breaks, and the QPs' retries run out (RETRY_EXC_ERR).

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

NS = "ib2tcp"
DIRECTORY_ENV = "CKPT_TCP_DIRECTORY"
MAX_LID = 0xBFFF  # unicast LIDs are 1..0xBFFF


def _random_lid() -> int:
    return secrets.randbelow(MAX_LID) + 1


class _Directory:
    """Claims and records LIDs; subclasses say where."""

    def register(
        self, guid: int, name: str, endpoint: str, pid: int, host: str, node: str | None = None
    ) -> dict[str, Any]:
        """Two fresh LIDs (`node` is not kept: TCP has no links to fail)."""
        lids = []
        for port in (1, 2):
            lid = self._claim()
            self._record(lid, {"endpoint": endpoint, "port": port, "name": name, "pid": pid})
            lids.append(lid)
        return {"lids": lids, "sm_lid": 0, "latency": 0.0, "bandwidth": 0.0, "links": {}, "fabric": None}

    def resolve(self, lid: int) -> tuple[str | None, int | None, bool]:
        found = self._lookup(lid)
        if found is None:
            return None, None, False
        return str(found["endpoint"]), int(found["port"]), True

    def _claim(self) -> int:
        while True:
            lid = _random_lid()
            if self._take(lid):
                return lid

    def _take(self, lid: int) -> bool:
        raise NotImplementedError

    def _record(self, lid: int, entry: dict[str, Any]) -> None:
        raise NotImplementedError

    def _lookup(self, lid: int) -> dict[str, Any] | None:
        raise NotImplementedError


class KvDirectory(_Directory):
    """The coordinator's key-value store (a ckpt job's ranks, on any host)."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    def _take(self, lid: int) -> bool:
        return int(self.kv.incrby(NS, f"claim/{lid}")) == 1

    def _record(self, lid: int, entry: dict[str, Any]) -> None:
        self.kv.publish(NS, f"lid/{lid}", entry)

    def _lookup(self, lid: int) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.kv.get(NS, f"lid/{lid}")
        return found


class FileDirectory(_Directory):
    """One JSON file per LID in a directory ($CKPT_TCP_DIRECTORY)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    def _take(self, lid: int) -> bool:
        try:
            os.close(os.open(self.path / f"{lid}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        return True

    def _record(self, lid: int, entry: dict[str, Any]) -> None:
        tmp = self.path / f".{lid}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entry))
        tmp.replace(self.path / f"{lid}.json")  # readers never see half a file

    def _lookup(self, lid: int) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = json.loads((self.path / f"{lid}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return found


class LocalDirectory(_Directory):
    """A table in this process."""

    _entries: dict[int, dict[str, Any] | None] = {}
    _lock = threading.Lock()

    def _take(self, lid: int) -> bool:
        with self._lock:
            if lid in self._entries:
                return False
            self._entries[lid] = None
            return True

    def _record(self, lid: int, entry: dict[str, Any]) -> None:
        with self._lock:
            self._entries[lid] = entry

    def _lookup(self, lid: int) -> dict[str, Any] | None:
        with self._lock:
            return self._entries.get(lid)


def factory(kv: Any | None) -> Callable[[Callable[[int, bool], None]], _Directory]:
    """The directory new tcp HCAs of this process use (the engine's DirectoryFactory)."""

    def make(on_link: Callable[[int, bool], None]) -> _Directory:  # every link is up: on_link is never called
        if kv is not None:
            return KvDirectory(kv)
        path = os.environ.get(DIRECTORY_ENV)
        return FileDirectory(Path(path)) if path else LocalDirectory()

    return make
