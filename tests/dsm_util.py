"""In-process DSM ranks for the dsm unit tests: each rank is a thread with its own HCA (simib<rank+N>)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import dsm

_hcas = itertools.count(10)  # HCA indexes no other test uses: every group of ranks gets fresh ones


class Group:
    """What `dsm.attach` needs from `rt` for `size` thread-ranks: rank, size, device and allgather."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size
        self.first = next(_hcas)
        for _ in range(size - 1):
            next(_hcas)

    def allgather(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class ThreadRuntime:
    """`rt` for one thread-rank (no plugins, no coordinator)."""

    plugins = None
    options: dict[str, Any] = {}

    def __init__(self, group: Group, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.device = f"simib{group.first + rank}"

    def allgather(self, obj: Any) -> list[Any]:
        return self.group.allgather(self.rank, obj)

    def barrier(self) -> None:
        self.group.allgather(self.rank, None)


def run_ranks(size: int, body: Callable[[dsm.Memory, ThreadRuntime], Any], protocol: str, **attach: Any) -> list[Any]:
    """Run body(mem, rt) on `size` thread-ranks attached to one DSM; their return values, by rank."""
    group = Group(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        rt = ThreadRuntime(group, rank)
        try:
            mem = dsm.attach(rt, protocol, **attach)
            results[rank] = body(mem, rt)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a DSM rank did not finish within 120 s")
    return results
