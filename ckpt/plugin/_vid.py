"""Virtual-ID tables: the program keeps virtual IDs, the table maps them to whatever is real now."""

# DMTCP's plugins hand the program virtual IDs (qp_num, lkey, rkey, lid, ...)
# and translate on every call, because after a restart the real resources are
# new and their real IDs differ.  A table is picklable and goes into the image;
# after a restart the plugin calls `update(virtual, new_real)` for each object
# it recreated.  Virtual IDs are allocated either locally (unique within this
# table) or globally (unique across every rank and every restart, from the
# coordinator), which is what objects created after a restart need so that
# they cannot collide with IDs handed out before the checkpoint.

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from ckpt._errors import CkptError

R = TypeVar("R", bound=Hashable)

#: Set by the rank runtime: ``allocate(namespace, count) -> first id``.  Not pickled.
_global_allocator: Callable[[str, int], int] | None = None


def set_global_allocator(allocator: Callable[[str, int], int] | None) -> None:
    global _global_allocator
    _global_allocator = allocator


class VirtualIdTable(Generic[R]):
    """virtual -> real and real -> virtual, with local and global allocation; picklable."""

    def __init__(self, name: str, *, first: int = 1) -> None:
        self.name = name
        self._next = first
        self._to_real: dict[int, R] = {}
        self._to_virtual: dict[R, int] = {}

    def allocate(self) -> int:
        """A virtual ID unique within this table."""
        while self._next in self._to_real:
            self._next += 1
        virtual = self._next
        self._next += 1
        return virtual

    def allocate_global(self) -> int:
        """A virtual ID unique across all ranks and all restarts of the job (asks the coordinator)."""
        if _global_allocator is None:
            raise CkptError("allocate_global() needs a running ckpt rank (no coordinator in this process)")
        return _global_allocator(f"vid:{self.name}", 1)

    def add(self, real: R, *, global_id: bool = False) -> int:
        """Give `real` a new virtual ID and return it."""
        virtual = self.allocate() if not global_id else self.allocate_global()
        while virtual in self._to_real:  # a global ID may already be taken locally: take the next
            virtual = self.allocate_global()
        self.bind(virtual, real)
        return virtual

    def bind(self, virtual: int, real: R) -> None:
        """Map `virtual` to `real` (a new entry)."""
        if virtual in self._to_real:
            raise CkptError(f"{self.name}: virtual id {virtual} is already bound")
        if real in self._to_virtual:
            raise CkptError(f"{self.name}: real id {real!r} is already bound to {self._to_virtual[real]}")
        self._to_real[virtual] = real
        self._to_virtual[real] = virtual

    def update(self, virtual: int, new_real: R) -> None:
        """After a restart: `virtual` now stands for `new_real`."""
        old = self._to_real.get(virtual)
        if virtual not in self._to_real:
            raise CkptError(f"{self.name}: unknown virtual id {virtual}")
        # After a restart every real ID is stale, and a new one may equal another entry's old one
        # (LIDs swapping on a fresh fabric): that entry's reverse mapping is dropped; its own
        # update() follows.
        if self._to_virtual.get(old) == virtual:  # type: ignore[arg-type]
            del self._to_virtual[old]  # type: ignore[arg-type]
        self._to_real[virtual] = new_real
        self._to_virtual[new_real] = virtual

    def update_all(self, mapping: dict[int, R]) -> None:
        """After a restart: rebind many virtual IDs at once."""
        for virtual, new_real in mapping.items():
            self.update(virtual, new_real)

    def remove(self, virtual: int) -> None:
        if virtual not in self._to_real:
            raise CkptError(f"{self.name}: unknown virtual id {virtual}")
        real = self._to_real.pop(virtual)
        if self._to_virtual.get(real) == virtual:
            del self._to_virtual[real]

    def real(self, virtual: int) -> R:
        try:
            return self._to_real[virtual]
        except KeyError:
            raise CkptError(f"{self.name}: unknown virtual id {virtual}") from None

    def virtual(self, real: R) -> int:
        try:
            return self._to_virtual[real]
        except KeyError:
            raise CkptError(f"{self.name}: no virtual id for real {real!r}") from None

    def __contains__(self, virtual: object) -> bool:
        return virtual in self._to_real

    def __len__(self) -> int:
        return len(self._to_real)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._to_real))

    def items(self) -> list[tuple[int, R]]:
        return list(self._to_real.items())

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "next": self._next, "to_real": dict(self._to_real)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name = state["name"]
        self._next = state["next"]
        self._to_real = dict(state["to_real"])
        self._to_virtual = {real: virtual for virtual, real in self._to_real.items()}

    def __repr__(self) -> str:
        return f"VirtualIdTable({self.name!r}, {len(self)} entries)"
