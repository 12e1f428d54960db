"""What hooks are handed: the `Runtime` a rank gives every hook, its key-value store and its plugin host."""

# These are Protocols, not the classes: a plugin is written (and type-checked) against what it may
# use, and `ckpt.testing` hands it doubles that satisfy the same Protocols.  `ckpt.Runtime` (the
# class programs receive) satisfies `Runtime`.

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class KeyValue(Protocol):
    """``rt.kv``: the coordinator's namespaced key-value store, scoped to the current generation.

    Values are small msgpack-able data (numbers, strings, bytes, lists, dicts).  A restart is a new
    generation: nothing published before it is visible after it.
    """

    def publish(self, ns: str, key: str, value: Any) -> None:
        """Set `key` in namespace `ns`, waking every subscriber."""

    def get(self, ns: str, key: str, default: Any = None) -> Any:
        """The value of `key`, or `default` when it was never published (does not wait)."""

    def subscribe(self, ns: str, key: str, timeout: float = 60.0) -> Any:
        """Block until `key` is published and return its value (CoordinatorError after `timeout` seconds)."""

    def subscribe_prefix(self, ns: str, prefix: str, count: int, timeout: float = 60.0) -> dict[str, Any]:
        """Block until at least `count` keys start with `prefix`; return them all."""

    def incrby(self, ns: str, key: str, delta: int = 1) -> int:
        """Add `delta` to the integer at `key` (0 if unset) atomically; return the new value."""

    def min(self, ns: str, key: str, value: int) -> int:
        """Set `key` to min(its value, `value`) atomically; return the result."""

    def max(self, ns: str, key: str, value: int) -> int:
        """Set `key` to max(its value, `value`) atomically; return the result."""


@runtime_checkable
class PluginCalls(Protocol):
    """``rt.plugins``: the rank's plugin host, for a library that brings hooks of its own (the DSM).

    Calls go through the host, so the contract's order (down / up) and its error naming the failing
    plugin apply to them too.  None under ``--native``.
    """

    def add_hookspecs(self, module: Any) -> None:
        """Add a module of further ``@ckpt.plugin.hookspec`` functions; adding one twice is a no-op."""

    def has_impl(self, hook: str) -> bool:
        """Does any registered plugin implement `hook`? (Check once; skip the call on the hot path.)"""

    def call(self, hook: str, **kwargs: Any) -> list[Any]:
        """Run `hook` on every implementation in its order; the non-None results, in call order."""

    def register(self, plugin: object, name: str) -> None:
        """Register an object whose ``@ckpt.hookimpl`` methods implement hooks (a DSM memory does)."""

    def unregister(self, plugin: object) -> None:
        """Undo `register` (no-op for an object that is not registered)."""


@runtime_checkable
class Runtime(Protocol):
    """What a program and every rank-side hook get as ``rt``.

    A program needs only ``rank``, ``size``, ``argv``, ``device``, ``step``, ``allgather``,
    ``barrier``, ``kv``, ``restarted``, ``checkpoint`` and ``log``; the rest is for plugins.
    """

    rank: int
    size: int
    argv: list[str]
    #: The verbs device the ranks open by default (``Context(name=rt.device)``).
    device: str
    #: The plugin options' values (``ckpt_add_options``), keyed by name with '_' for '-'.
    options: dict[str, Any]
    #: True in a process that was started from an image.
    restarted: bool
    #: How many times the job was restarted; it scopes the key-value store.
    generation: int
    #: How many times this rank alone was recovered (single-rank recovery, ``--on-failure recover``):
    #: 0 at launch, +1 per recovery; a whole-job restart keeps it.  KV keys that name this rank's
    #: verbs IDs are scoped by it.
    incarnation: int
    #: True in a process that replaced a failed rank while the others ran on (single-rank recovery).
    recovered: bool
    job: str
    ckpt_dir: str
    #: True under ``ckpt launch --native``: no plugins, no checkpoints.
    native: bool
    log: logging.Logger
    kv: KeyValue
    plugins: PluginCalls | None

    @property
    def step(self) -> int:
        """Completed steps."""
        ...

    @property
    def coordinator(self) -> str:
        """The coordinator's address, "host:port", as this rank reached it."""
        ...

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` in rank order (collective: the same step on every rank)."""
        ...

    def barrier(self) -> None:
        """Wait for every rank (collective: the same step on every rank)."""

    def checkpoint(self) -> int:
        """Ask for a checkpoint at the next boundary every rank can reach; its number (0: queued / native)."""
        ...

    def checkpoint_rank(self, rank: int) -> int:
        """Ask for an independent checkpoint of rank ``rank`` alone, at its next step boundary, while the
        others keep running (``ckpt checkpoint --rank``): what a plugin calls when, say, a log ring it
        fills is full.  Its hooks get ``independent=True``.  Returns its number, or 0 when it is queued
        (one checkpoint runs at a time: behind the one in progress, or until every rank has joined;
        also under ``--native``).  CoordinatorError if there is no rank ``rank``."""
        ...

    def fall_back(self, reason: str) -> None:
        """Single-rank recovery cannot recover this rank (its logs are gone with its log home, its replay
        diverged): ask for a whole-job restart from the last coordinated checkpoint, the fallback of
        ``--on-failure recover``.  The coordinator prints `reason` as one line, the launcher stops every
        rank and restarts the job; this call does not return (the process is stopped).  Under
        ``--on-failure abort`` the job fails with `reason`."""
        ...

    def hold_checkpoints(self, reason: str) -> None:
        """Checkpoints of any kind wait (queued, as while a rank is away) until `release_checkpoints`:
        this rank's state is not one an image may hold (it is replaying its logs).  Not nested."""
        ...

    def release_checkpoints(self) -> None:
        """End `hold_checkpoints`: queued checkpoints go ahead."""
        ...

    def coordinator_barrier(self, name: str, value: Any = None) -> list[Any]:
        """A named global barrier for hooks; every rank's `value` in rank order (CheckpointAborted if aborted)."""
        ...

    def allocate_global(self, ns: str, count: int = 1) -> int:
        """The first of `count` IDs unique across all ranks and restarts of the job."""
        ...
