"""The two faces every protocol's memory shows, as `typing.Protocol`s.

`dsm.attach` hands a program either an HLRC `dsm.Memory` or a `dsm._cashmere.Cashmere`.
Neither derives from the other (they share no state), so what a program may rely on is
written down here once: `SharedMemory`, the programs' API, which `attach` returns.
`Faults` is the narrower face `SharedArray` and `Lock` use to ask their memory for pages,
write blocks and locks.  A class that does not fit either is caught by mypy where it is
handed over (`attach`, `SharedArray(...)`, `Lock(...)`), not by a program at run time; both are
runtime-checkable too, so `isinstance(mem, dsm.SharedMemory)` checks that the members are there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from ._array import Lock, SharedArray
    from ._stats import Statistics


@runtime_checkable
class SharedMemory(Protocol):
    """One rank's handle on a shared memory, whatever its protocol: what programs use."""

    @property
    def protocol(self) -> str:
        """``"async"``, ``"onesided"`` or ``"cashmere"``."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def array(self, shape: int | tuple[int, ...], dtype: Any = ...) -> SharedArray:
        """Collective: a shared array of zeros (call in the same order on every rank)."""

    def lock(self) -> Lock:
        """A new lock (call in the same order on every rank)."""

    def barrier(self) -> None:
        """Global barrier: every rank's writes before it are seen by every rank after it."""

    def statistics(self) -> Statistics:
        """This rank's counters and time breakdown since attach."""

    def close(self) -> None:
        """Leave the shared memory (not collective, final)."""


@runtime_checkable
class Faults(Protocol):
    """What a `SharedArray` and a `Lock` ask of their memory.

    A region argument is the memory's own region type (`dsm._region.Region` or its
    Cashmere subclass): each memory only ever sees the regions it made, so it is
    typed `Any` here rather than narrowed at every fault.
    """

    #: Whether a write block's changes go to the home as they are made (`through_begin` / `through_end`).
    write_through: bool
    #: Open ``with a.write(...)`` blocks: no synchronisation may start inside one.
    writing: int

    @property
    def size(self) -> int: ...

    @property
    def held(self) -> dict[int, Any]:
        """The locks this rank holds, by id."""

    def read_fault(self, region: Any, pages: np.ndarray, span: tuple[int, int] | None = None) -> None: ...

    def write_fault(self, region: Any, pages: np.ndarray, span: tuple[int, int] | None = None) -> None: ...

    def through_begin(self, region: Any, pages: np.ndarray) -> dict[int, np.ndarray] | None: ...

    def through_end(self, region: Any, before: dict[int, np.ndarray]) -> None: ...

    def acquire(self, lock: int) -> None: ...

    def release(self, lock: int) -> None: ...
