"""In-process DSM ranks for the dsm unit tests: each rank is a thread with its own HCA (simib<10 + rank>)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import dsm
from dsm.programs import program_class

FIRST_HCA = 10  # rank r opens simib<10 + r>: HCAs no other test uses, shared by the DSM tests (each closes its own)


class Group:
    """What `dsm.attach` needs from `rt` for `size` thread-ranks: rank, size, device and allgather."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size
        self.first = FIRST_HCA

    def allgather(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class ThreadRuntime:
    """`rt` for one thread-rank (no plugins, no coordinator): rank, size, device, argv, options, collectives."""

    plugins: Any = None

    def __init__(self, group: Group, rank: int, argv: list[str] | None = None, protocol: str | None = None) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.device = f"simib{group.first + rank}"
        self.argv = list(argv or [])
        self.options: dict[str, Any] = {"dsm_protocol": protocol}
        self.restarted = False
        self.log = logging.getLogger(f"dsm.test.rank{rank}")
        self.memory: dsm.Memory | None = None  # closed when all the group's ranks are done

    def allgather(self, obj: Any) -> list[Any]:
        return self.group.allgather(self.rank, obj)

    def barrier(self) -> None:
        self.group.allgather(self.rank, None)


def run_ranks(
    size: int,
    body: Callable[[dsm.Memory, ThreadRuntime], Any],
    protocol: str,
    plugins: Callable[[int], Any] | None = None,
    **attach: Any,
) -> list[Any]:
    """Run body(mem, rt) on `size` thread-ranks attached to one DSM; their return values, by rank.

    `plugins(rank)`, if given, makes each rank's `rt.plugins` (a ckpt PluginHost).
    """

    def rank_body(rt: ThreadRuntime) -> Any:
        if plugins is not None:
            rt.plugins = plugins(rt.rank)
        rt.memory = dsm.attach(rt, protocol, **attach)
        return body(rt.memory, rt)

    return _threads(size, rank_body, protocol, [])


def run_program(name: str, argv: list[str], size: int, protocol: str) -> list[Any]:
    """Run dsm/programs/<name>.py on `size` thread-ranks as `ckpt launch` would (setup, steps); its results."""
    cls = program_class(name)

    def rank_body(rt: ThreadRuntime) -> Any:
        program = cls()
        program.setup(rt)  # type: ignore[arg-type]
        rt.memory = program.mem  # type: ignore[attr-defined]  (the programs keep theirs as `mem`)
        while program.step(rt):  # type: ignore[arg-type]
            pass
        return program.result()

    return _threads(size, rank_body, protocol, argv)


def _threads(size: int, body: Callable[[ThreadRuntime], Any], protocol: str, argv: list[str]) -> list[Any]:
    group = Group(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []
    runtimes = [ThreadRuntime(group, rank, argv, protocol) for rank in range(size)]

    def rank_main(rank: int) -> None:
        rt = runtimes[rank]
        try:
            results[rank] = body(rt)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if not any(t.is_alive() for t in threads):
        for rt in runtimes:  # stop the handler threads, free the QPs: the HCAs serve the next test
            if rt.memory is not None:
                rt.memory.close()
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a DSM rank did not finish within 120 s")
    return results
