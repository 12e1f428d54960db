"""DSM example programs: each runs under `ckpt launch` and checks its answer against plain numpy."""

from __future__ import annotations

import importlib

import ckpt


def program_class(name: str) -> type[ckpt.Program]:
    """The one ckpt.Program subclass of dsm/programs/<name>.py (for wrappers: tests, benchmarks)."""
    module = importlib.import_module(f"dsm.programs.{name}")
    found = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, ckpt.Program) and c.__module__ == module.__name__
    ]
    if len(found) != 1:
        raise LookupError(f"dsm/programs/{name}.py: expected one ckpt.Program subclass, found {found}")
    return found[0]
