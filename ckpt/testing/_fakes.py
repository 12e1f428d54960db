"""In-process doubles of what a rank hands its plugins: `FakeKeyValue` (``rt.kv``) and `FakeRuntime` (``rt``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ckpt._errors import CoordinatorError
from ckpt.plugin import PluginCalls


class FakeKeyValue:
    """Stands for ``rt.kv`` (the coordinator's key-value store) on a dict, for one generation.

    Thread-safe, and `subscribe` really waits: thread-ranks sharing one store see each other's
    publications as ranks do through the coordinator.  Atomic operations work on the same keys as
    `publish` (an unset key counts as 0 for `incrby`, as the operand for `min` / `max`), and a
    wait that times out raises `ckpt.CoordinatorError`, as the real store does.
    """

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], Any] = {}
        self._changed = threading.Condition()

    def publish(self, ns: str, key: str, value: Any) -> None:
        with self._changed:
            self.values[ns, key] = value
            self._changed.notify_all()

    def get(self, ns: str, key: str, default: Any = None) -> Any:
        with self._changed:
            return self.values.get((ns, key), default)

    def subscribe(self, ns: str, key: str, timeout: float = 60.0) -> Any:
        with self._changed:
            self._wait(lambda: (ns, key) in self.values, timeout, f"key {ns}/{key}")
            return self.values[ns, key]

    def subscribe_prefix(self, ns: str, prefix: str, count: int, timeout: float = 60.0) -> dict[str, Any]:
        def found() -> dict[str, Any]:
            return {k: v for (n, k), v in self.values.items() if n == ns and k.startswith(prefix)}

        with self._changed:
            self._wait(lambda: len(found()) >= count, timeout, f"{count} keys with prefix {ns}/{prefix}")
            return found()

    def incrby(self, ns: str, key: str, delta: int = 1) -> int:
        return self._atomic(ns, key, lambda current: (0 if current is None else current) + delta)

    def min(self, ns: str, key: str, value: int) -> int:
        return self._atomic(ns, key, lambda current: value if current is None else min(current, value))

    def max(self, ns: str, key: str, value: int) -> int:
        return self._atomic(ns, key, lambda current: value if current is None else max(current, value))

    def _atomic(self, ns: str, key: str, update: Any) -> int:
        with self._changed:
            current = self.values.get((ns, key))
            if current is not None and not isinstance(current, int):
                raise CoordinatorError(f"{ns}/{key} holds a {type(current).__name__}, not an integer")
            value = int(update(current))
            self.values[ns, key] = value
            self._changed.notify_all()
            return value

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinatorError(f"timed out waiting for {what}")
            self._changed.wait(left)


class RuntimeDouble:
    """What both runtime doubles share: the attributes of ``rt`` and the answers that need no coordinator."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        job: str,
        kv: FakeKeyValue,
        argv: list[str] | None,
        options: dict[str, Any] | None,
        device: str,
        plugins: PluginCalls | None,
    ) -> None:
        self.rank, self.size, self.job, self.kv = rank, size, job, kv
        self.argv = list(argv or [])
        self.device = device
        self.options = dict(options or {})
        self.restarted = False
        self.generation = 0
        self.incarnation = 0
        self.recovered = False
        self.ckpt_dir = ""
        self.native = plugins is None
        self.log = logging.getLogger(f"ckpt.testing.rank{rank}")
        self.plugins = plugins
        self.steps = 0
        #: the ranks `checkpoint_rank` was asked for, in order (nothing is taken)
        self.rank_checkpoints_requested: list[int] = []
        #: the reasons `fall_back` was called with, in order
        self.fall_backs: list[str] = []
        #: the reasons `hold_checkpoints` was called with, in order, and how often `release_checkpoints` was
        self.holds: list[str] = []
        self.releases = 0
        #: the reason of the hold in force (None: checkpoints are not held)
        self.held: str | None = None

    @property
    def step(self) -> int:
        return self.steps

    def checkpoint_rank(self, rank: int) -> int:
        """Record the request and return 0 (queued), as under ``--native``; a rank out of range is refused."""
        if not 0 <= rank < self.size:
            raise CoordinatorError(f"there is no rank {rank}: the job has ranks 0..{self.size - 1}")
        self.rank_checkpoints_requested.append(rank)
        return 0

    def fall_back(self, reason: str) -> None:
        """Record the request and return: a real rank never returns from it (it is stopped for the
        whole-job restart), so code under test should return right after calling it."""
        self.fall_backs.append(reason)

    def hold_checkpoints(self, reason: str) -> None:
        """Record the hold (`held` is its reason until `release_checkpoints`)."""
        self.holds.append(reason)
        self.held = reason

    def release_checkpoints(self) -> None:
        self.releases += 1
        self.held = None

    @property
    def coordinator(self) -> str:
        return "127.0.0.1:0"  # there is none: an address nothing listens on


class FakeRuntime(RuntimeDouble):
    """Stands for ``rt`` (`ckpt.plugin.Runtime`) of rank 0 of a one-rank job, without a coordinator.

    Enough to drive a plugin's hooks by hand: `kv` is a `FakeKeyValue` that `new_generation` (a
    restart) replaces with an empty one, while `allocate_global`'s counters go on across
    generations as the coordinator's do; `coordinator_barrier` and `allgather` return this one
    rank's value; `checkpoint` only counts the requests, `checkpoint_rank`, `fall_back`,
    `hold_checkpoints` and `release_checkpoints` record theirs.  What the
    plugin asked for is kept for assertions: `allocated` (every ID handed out, by namespace) and
    `barriers` (their names).
    """

    def __init__(
        self,
        *,
        argv: list[str] | None = None,
        options: dict[str, Any] | None = None,
        device: str = "simib0",
        first_id: int = 1,
        plugins: PluginCalls | None = None,
    ) -> None:
        super().__init__(
            rank=0, size=1, job="fake", kv=FakeKeyValue(), argv=argv, options=options, device=device, plugins=plugins
        )
        self.first_id = first_id
        self.checkpoints_requested = 0
        self.allocated: dict[str, list[int]] = {}
        self.barriers: list[str] = []
        self._next_id: dict[str, int] = {}

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None

    def checkpoint(self) -> int:
        self.checkpoints_requested += 1
        return 0  # as under --native: nothing is taken

    def coordinator_barrier(self, name: str, value: Any = None) -> list[Any]:
        self.barriers.append(name)
        return [value]

    def allocate_global(self, ns: str, count: int = 1) -> int:
        first = self._next_id.get(ns, self.first_id)
        self._next_id[ns] = first + count
        self.allocated.setdefault(ns, []).extend(range(first, first + count))
        return first

    def new_generation(self) -> None:
        """A restart: the key-value store starts empty, the ID counters go on."""
        self.generation += 1
        self.restarted = True
        self.kv = FakeKeyValue()
