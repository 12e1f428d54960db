"""The program contract: `Program` (what a user writes), `load_program` (finds it), `Runtime` (what it gets)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ckpt._errors import CheckpointAborted, CkptError

if TYPE_CHECKING:
    from ckpt.coordinator.client import CoordinatorClient
    from ckpt.runtime.plugins import PluginHost
    from ckpt.runtime.rank import RankEngine


class Program:
    """A checkpointable program: its instance attributes are its state.

    ``setup`` runs once (never again after a restart), ``step`` runs until it
    returns False, ``result`` is what ``ckpt launch`` prints.  Collectives
    (``rt.allgather``, ``rt.barrier``) must be called in the same step on every
    rank; point-to-point traffic need not be.
    """

    def setup(self, rt: Runtime) -> None:
        """Build state; runs once."""

    def step(self, rt: Runtime) -> bool:
        """One unit of work; return False when this rank is done."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(rt)")

    def result(self) -> Any:
        """What `ckpt launch` prints for this rank as ``result: <str(value)>``."""
        return None


def load_program(path: str) -> tuple[type[Program], dict[str, Any]]:
    """Import the program file and find its one `ckpt.Program` subclass."""
    file = Path(path).resolve()
    if not file.is_file():
        raise CkptError(f"program file {path} does not exist")
    name = "ckpt_program_" + "".join(c if c.isalnum() else "_" for c in file.stem)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise CkptError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's module: any error at import is theirs to see, in one line
        raise CkptError(f"cannot import {path}: {type(exc).__name__}: {exc}") from None
    classes = _program_classes(module)
    if len(classes) != 1:
        found = ", ".join(c.__name__ for c in classes) or "none"
        raise CkptError(f"{path} must define exactly one ckpt.Program subclass (found: {found})")
    info = {
        "path": str(file),
        "name": file.stem,
        "class": classes[0].__name__,
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
    }
    return classes[0], info


def _program_classes(module: ModuleType) -> list[type[Program]]:
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, Program)
        and obj is not Program
        and obj.__module__ == module.__name__
    ]


class KeyValue:
    """``rt.kv``: the coordinator's namespaced key-value store, scoped to the current generation.

    Values are small msgpack-able data (numbers, strings, bytes, lists, dicts).
    """

    def __init__(self, client: CoordinatorClient) -> None:
        self._client = client

    def publish(self, ns: str, key: str, value: Any) -> None:
        self._client.call("publish", ns=ns, key=key, value=value)

    def get(self, ns: str, key: str, default: Any = None) -> Any:
        answer = self._client.call("get", ns=ns, key=key)
        return answer["value"] if answer["found"] else default

    def subscribe(self, ns: str, key: str, timeout: float = 60.0) -> Any:
        """Block until `key` is published (CoordinatorError after `timeout` seconds)."""
        return self._client.call("subscribe", ns=ns, key=key, timeout=timeout)["value"]

    def subscribe_prefix(self, ns: str, prefix: str, count: int, timeout: float = 60.0) -> dict[str, Any]:
        """Block until at least `count` keys starting with `prefix` exist; returns them all."""
        answer = self._client.call("subscribe", ns=ns, key=prefix, prefix=True, count=count, timeout=timeout)
        return dict(answer["values"])

    def incrby(self, ns: str, key: str, delta: int = 1) -> int:
        return int(self._client.call("atomic", kind="incrby", ns=ns, key=key, operand=delta)["value"])

    def min(self, ns: str, key: str, value: int) -> int:
        return int(self._client.call("atomic", kind="min", ns=ns, key=key, operand=value)["value"])

    def max(self, ns: str, key: str, value: int) -> int:
        return int(self._client.call("atomic", kind="max", ns=ns, key=key, operand=value)["value"])


class Runtime:
    """What a program (and every plugin hook) gets as ``rt``."""

    def __init__(
        self,
        engine: RankEngine,
        *,
        rank: int,
        size: int,
        argv: list[str],
        device: str,
        options: dict[str, Any],
        plugins: PluginHost | None,
    ) -> None:
        self._engine = engine
        self.rank = rank
        self.size = size
        self.argv = list(argv)
        self.device = device
        self.options = dict(options)
        self.plugins = plugins
        self.restarted = False
        self.generation = 0
        self.incarnation = 0
        self.recovered = False
        self.job = ""
        self.ckpt_dir = ""
        self.native = plugins is None
        self.log = logging.getLogger(f"ckpt.program.rank{rank}")
        self.kv = KeyValue(engine.client)

    @property
    def step(self) -> int:
        """Completed steps."""
        return self._engine.step

    @property
    def coordinator(self) -> str:
        """The coordinator's address, "host:port", as this rank reached it."""
        return str(self._engine.client.address)

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (collective: same step on every rank)."""
        return self._engine.collective("allgather", obj)

    def barrier(self) -> None:
        """Wait for every rank (collective: same step on every rank)."""
        self._engine.collective("barrier", None)

    def checkpoint(self) -> int:
        """Ask for a checkpoint; it is taken at the next boundary every rank can reach.

        Returns its number, or 0 when it is queued until every rank has joined (or, under
        ``--native``, when checkpoints are disabled).
        """
        return self._engine.request_checkpoint()

    def checkpoint_rank(self, rank: int) -> int:
        """Ask for an independent checkpoint of rank `rank` alone, taken at its next step boundary while
        the other ranks keep running (a plugin's way to ask for one, e.g. when a log fills up).

        Returns its number, or 0 when it is queued (behind another checkpoint, or until every rank
        has joined; also under ``--native``).  CoordinatorError if there is no such rank.
        """
        return self._engine.request_checkpoint(rank)

    def fall_back(self, reason: str) -> None:
        """This rank cannot be recovered alone (`reason`, one line): ask for a whole-job restart from the last
        coordinated checkpoint (``--on-failure recover``; under ``abort`` the job fails with `reason`).
        Does not return: the launcher stops every rank (this process exits if nobody has stopped it within
        ``FALLBACK_WAIT`` seconds)."""
        self._engine.fall_back(reason)

    def hold_checkpoints(self, reason: str) -> None:
        """Checkpoints of any kind wait (queued) until `release_checkpoints` or until this rank is lost:
        its state is not one an image may hold (`reason` is what ``ckpt status`` shows).  Not nested."""
        self._engine.hold_checkpoints(reason)

    def release_checkpoints(self) -> None:
        """End `hold_checkpoints`: queued checkpoints go ahead (a no-op without a hold)."""
        self._engine.release_checkpoints()

    def coordinator_barrier(self, name: str, value: Any = None) -> list[Any]:
        """A named global barrier for plugin hooks; returns every rank's `value` in rank order.

        Raises CheckpointAborted when the checkpoint in progress is aborted meanwhile.
        """
        scope = self._engine.barrier_scope  # "ckptN" or "genG": an aborted checkpoint releases it
        answer = self._engine.client.call("barrier", name=f"{scope}:plugin:{name}", value=value)
        if "abort" in answer:
            raise CheckpointAborted(answer["abort"])
        return list(answer["values"])

    def allocate_global(self, ns: str, count: int = 1) -> int:
        """First of `count` IDs unique across all ranks and restarts of this job."""
        return int(self._engine.client.call("alloc_ids", ns=ns, count=count)["first"])

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A program may keep `rt` in an attribute: it pickles as "this process's runtime".
        return (_current_runtime, ())

    def __repr__(self) -> str:
        return f"<ckpt.Runtime rank {self.rank}/{self.size} step {self.step}>"


_current: Runtime | None = None


def _set_current_runtime(rt: Runtime | None) -> None:
    global _current
    _current = rt


def _current_runtime() -> Runtime:
    if _current is None:
        raise CkptError("a pickled ckpt.Runtime can only be loaded inside a ckpt rank")
    return _current
