"""The coordinator's key-value store: namespaced, generation-scoped, with blocking subscribe and atomic ops."""

# DMTCP's coordinator keeps a small key-value database (kvdb) that plugins use
# to publish what they recreated on restart and to subscribe to what their
# peers recreated.  Ours adds namespaces and generations: every restart of a
# job is a new generation and starts with an empty store, so a value published
# before a checkpoint can never be mistaken for one published after a restart.
# Globally unique IDs are different: they must stay unique across restarts, so
# their counters live outside the generation and are saved in the manifest.
#
# The store itself does no locking and no I/O: the coordinator calls it under
# its own lock and passes `reply` callables that it invokes (still under the
# lock) when a blocking subscribe is satisfied or times out.

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Reply = Callable[[dict[str, Any]], None]


@dataclass
class _Waiter:
    ns: str
    key: str
    prefix: bool
    count: int
    deadline: float
    reply: Reply
    done: bool = False


@dataclass
class KeyValueStore:
    """Values of the current generation plus the cross-generation ID counters."""

    generation: int = 0
    id_counters: dict[str, int] = field(default_factory=dict)
    _values: dict[tuple[str, str], Any] = field(default_factory=dict)
    _waiters: list[_Waiter] = field(default_factory=list)

    def new_generation(self, generation: int) -> None:
        """Forget every value (not the ID counters); pending subscribers are failed."""
        for waiter in self._waiters:
            if not waiter.done:
                waiter.done = True
                waiter.reply({"error": f"key-value generation changed to {generation}"})
        self._waiters.clear()
        self._values.clear()
        self.generation = generation

    def publish(self, ns: str, key: str, value: Any) -> None:
        self._values[(ns, key)] = value
        self._wake(ns)

    def get(self, ns: str, key: str) -> tuple[bool, Any]:
        if (ns, key) in self._values:
            return True, self._values[(ns, key)]
        return False, None

    def matching(self, ns: str, prefix: str) -> dict[str, Any]:
        """Every value of `ns` whose key starts with `prefix`, by key."""
        return self._matching(ns, prefix)

    def _matching(self, ns: str, prefix: str) -> dict[str, Any]:
        return {k: v for (n, k), v in self._values.items() if n == ns and k.startswith(prefix)}

    def subscribe(self, ns: str, key: str, *, prefix: bool, count: int, timeout: float, reply: Reply) -> None:
        """Reply now if satisfied, else when it is (or with an error at the deadline)."""
        waiter = _Waiter(ns, key, prefix, max(count, 1), time.monotonic() + timeout, reply)
        if not self._try(waiter):
            self._waiters.append(waiter)

    def _try(self, waiter: _Waiter) -> bool:
        if waiter.prefix:
            found = self._matching(waiter.ns, waiter.key)
            if len(found) < waiter.count:
                return False
            waiter.done = True
            waiter.reply({"values": found})
            return True
        if (waiter.ns, waiter.key) not in self._values:
            return False
        waiter.done = True
        waiter.reply({"value": self._values[(waiter.ns, waiter.key)]})
        return True

    def _wake(self, ns: str) -> None:
        for waiter in self._waiters:
            if waiter.ns == ns and not waiter.done:
                self._try(waiter)
        self._waiters = [w for w in self._waiters if not w.done]

    def expire(self, now: float) -> float | None:
        """Fail subscribers past their deadline; return the next deadline, if any."""
        for waiter in self._waiters:
            if not waiter.done and waiter.deadline <= now:
                waiter.done = True
                what = f"{waiter.count} keys with prefix" if waiter.prefix else "key"
                waiter.reply({"error": f"timed out waiting for {what} {waiter.ns}/{waiter.key}"})
        self._waiters = [w for w in self._waiters if not w.done]
        return min((w.deadline for w in self._waiters), default=None)

    def atomic(self, op: str, ns: str, key: str, operand: int) -> int:
        """INCRBY / MIN / MAX on an integer key (missing counts as operand for MIN/MAX, 0 for INCRBY)."""
        found, current = self.get(ns, key)
        if found and not isinstance(current, int):
            raise ValueError(f"{ns}/{key} holds a {type(current).__name__}, not an integer")
        if op == "incrby":
            value = (current if found else 0) + operand
        elif op == "min":
            value = min(current, operand) if found else operand
        elif op == "max":
            value = max(current, operand) if found else operand
        else:
            raise ValueError(f"unknown atomic op {op!r}")
        self.publish(ns, key, value)
        return value

    def allocate_ids(self, ns: str, count: int) -> int:
        """First of `count` consecutive IDs in `ns`, unique across ranks and restarts (starts at 1)."""
        first = self.id_counters.get(ns, 0) + 1
        self.id_counters[ns] = first + count - 1
        return first
