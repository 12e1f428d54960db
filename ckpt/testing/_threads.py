"""Thread-ranks: N ranks of a job as N threads of one process, with working collectives and one shared KV."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ckpt._program import Program
from ckpt.plugin import PluginCalls
from ckpt.testing._fakes import FakeKeyValue, RuntimeDouble

#: How long a collective waits for the other thread-ranks, and `run_threads` for all of them, by default.
TIMEOUT = 120.0


class ThreadGroup:
    """Stands for the coordinator of a job whose ranks are threads: the collectives, the KV, the ID counters."""

    def __init__(self, size: int, timeout: float = TIMEOUT) -> None:
        if size < 1:
            raise ValueError(f"a job has at least one rank, not {size}")
        self.size = size
        self.kv = FakeKeyValue()
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def allgather(self, rank: int, obj: Any) -> list[Any]:
        """Every rank's `obj` in rank order, once all `size` ranks have called it."""
        self._slots[rank] = obj
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has copied them all
        return values

    def allocate(self, ns: str, count: int) -> int:
        """The first of `count` IDs of namespace `ns` (from 1, as the coordinator's), unique across the ranks."""
        with self._lock:
            first = self._ids.get(ns, 0) + 1
            self._ids[ns] = first + count - 1
            return first

    def abort(self) -> None:
        """A rank failed: every rank waiting in a collective (now or later) gets BrokenBarrierError."""
        self._barrier.abort()


class ThreadRuntime(RuntimeDouble):
    """Stands for ``rt`` (`ckpt.plugin.Runtime`) of one thread-rank of a `ThreadGroup`.

    Collectives (`allgather`, `barrier`, `coordinator_barrier`) meet the group's other threads;
    `kv` and `allocate_global` are the group's.  There are no checkpoints: `checkpoint` and
    `checkpoint_rank` return 0, as under ``--native`` (`checkpoint_rank` records the rank).
    Device names are ``<device><first_device + rank>``, so each rank opens an HCA of its own.
    `at_end(fn)` runs `fn` once every rank has finished (to close what a rank must keep serving
    while the others still run, e.g. a DSM memory).
    """

    def __init__(
        self,
        group: ThreadGroup,
        rank: int,
        *,
        argv: list[str] | None = None,
        options: dict[str, Any] | None = None,
        device: str = "simib",
        first_device: int = 0,
        plugins: PluginCalls | None = None,
    ) -> None:
        super().__init__(
            rank=rank,
            size=group.size,
            job="threads",
            kv=group.kv,
            argv=argv,
            options=options,
            device=f"{device}{first_device + rank}",
            plugins=plugins,
        )
        self.group = group
        self.finalizers: list[Callable[[], Any]] = []

    def allgather(self, obj: Any) -> list[Any]:
        return self.group.allgather(self.rank, obj)

    def barrier(self) -> None:
        self.group.allgather(self.rank, None)

    def checkpoint(self) -> int:
        return 0

    def coordinator_barrier(self, name: str, value: Any = None) -> list[Any]:
        return self.group.allgather(self.rank, value)

    def allocate_global(self, ns: str, count: int = 1) -> int:
        return self.group.allocate(ns, count)

    def at_end(self, finalizer: Callable[[], Any]) -> None:
        """Run `finalizer` after every rank of the group has finished (not if one is still running)."""
        self.finalizers.append(finalizer)


def run_threads(
    size: int,
    body: Callable[[ThreadRuntime], Any],
    *,
    argv: list[str] | None = None,
    options: dict[str, Any] | None = None,
    device: str = "simib",
    first_device: int = 0,
    plugins: Callable[[int], PluginCalls | None] | None = None,
    timeout: float = TIMEOUT,
) -> list[Any]:
    """Run ``body(rt)`` on `size` thread-ranks; their return values in rank order.

    `plugins(rank)`, if given, makes each rank's ``rt.plugins``.  The first exception a rank
    raises is re-raised here (the others' collectives are broken, so they stop too);
    TimeoutError if a rank is still running after `timeout` seconds.
    """
    group = ThreadGroup(size, timeout)
    runtimes = [
        ThreadRuntime(
            group,
            rank,
            argv=argv,
            options=options,
            device=device,
            first_device=first_device,
            plugins=plugins(rank) if plugins is not None else None,
        )
        for rank in range(size)
    ]
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rt: ThreadRuntime) -> None:
        try:
            results[rt.rank] = body(rt)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
            group.abort()

    threads = [threading.Thread(target=rank_main, args=(rt,), name=f"rank-{rt.rank}", daemon=True) for rt in runtimes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"a thread-rank did not finish within {timeout:.0f} s")
    for rt in runtimes:
        for finalizer in rt.finalizers:
            finalizer()
    if errors:
        # the failure itself, not another rank's broken collective that it caused
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


def run_program(
    program: Callable[[], Program],
    size: int,
    *,
    argv: list[str] | None = None,
    options: dict[str, Any] | None = None,
    device: str = "simib",
    first_device: int = 0,
    plugins: Callable[[int], PluginCalls | None] | None = None,
    finish: Callable[[Program], Any] | None = None,
    timeout: float = TIMEOUT,
) -> list[Any]:
    """Run a `ckpt.Program` on `size` thread-ranks as ``ckpt launch --native`` would; each rank's result().

    `program` makes one rank's instance (the class itself will do).  Each rank calls ``setup(rt)``,
    then ``step(rt)`` until it returns False, then ``result()``.  `finish(program)`, if given,
    runs on every rank's instance once all ranks are done (to close what the program keeps open).
    """

    def body(rt: ThreadRuntime) -> Any:
        instance = program()
        instance.setup(rt)  # type: ignore[arg-type]  # ckpt.Program is typed for the real Runtime
        if finish is not None:
            rt.at_end(lambda: finish(instance))
        while instance.step(rt):  # type: ignore[arg-type]
            rt.steps += 1
        rt.steps += 1
        return instance.result()

    return run_threads(
        size,
        body,
        argv=argv,
        options=options,
        device=device,
        first_device=first_device,
        plugins=plugins,
        timeout=timeout,
    )
