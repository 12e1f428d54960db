"""`describe_objects`: the largest objects of a checkpoint's object graph, for headers and `ckpt inspect`."""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any, Final

import numpy as np

_DESCRIBE_DEPTH: Final = 3
_DESCRIBE_ITEMS: Final = 1000  # larger containers are summarised, not walked
_DESCRIBE_BUDGET: Final = 20_000  # objects walked into, at most

# Objects whose __dict__ is not state worth listing.
_OPAQUE: Final = (
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
)


def describe_objects(obj: object, limit: int = 20) -> list[dict[str, Any]]:
    """List the largest objects in ``obj``: ``[{"path", "type", "bytes"}, ...]``, largest first.

    Walks dicts, lists, tuples and instance ``__dict__``s to depth 3 (paths like
    ``program.grid`` or ``program.layers[2]``); whatever is not walked is a
    leaf sized by ``nbytes`` (numpy), length (bytes-like) or ``sys.getsizeof``.
    Containers of more than 1000 items, and everything met after the first
    20,000 objects, are leaves; a big container's size adds an estimate of its
    items from a sample.  Never pickles; each object is counted once, cycles included.
    """
    found: list[dict[str, Any]] = []
    seen: set[int] = set()

    def walk(value: object, path: str, depth: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        walkable = depth < _DESCRIBE_DEPTH and len(seen) < _DESCRIBE_BUDGET
        children = _children(value, path) if walkable else None
        if children is None:
            found.append({"path": path or "<root>", "type": _type_name(value), "bytes": _size_of(value)})
            return
        for child_path, child in children:
            walk(child, child_path, depth + 1)

    walk(obj, "", 0)
    found.sort(key=lambda entry: -int(entry["bytes"]))
    return found[:limit]


def _children(value: object, path: str) -> list[tuple[str, object]] | None:
    """The (path, child) pairs to walk into, or None if ``value`` is a leaf."""
    if isinstance(value, dict):
        if not value or len(value) > _DESCRIBE_ITEMS:
            return None
        return [(_key_path(path, key), child) for key, child in value.items()]
    if isinstance(value, list | tuple):
        if not value or len(value) > _DESCRIBE_ITEMS:
            return None
        return [(f"{path}[{index}]", child) for index, child in enumerate(value)]
    if isinstance(value, _OPAQUE):
        return None
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except Exception:  # no __dict__, or a property that fails: a leaf either way
        return None
    if not isinstance(attributes, dict) or not attributes or len(attributes) > _DESCRIBE_ITEMS:
        return None
    return [(_key_path(path, key), child) for key, child in attributes.items()]


def _key_path(path: str, key: object) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{repr(key)[:40]}]"


def _size_of(value: object) -> int:
    """Size of a leaf; a container too large to walk adds an estimate of its items."""
    size = _own_size(value)
    items: list[object] = []
    count = 0
    if isinstance(value, dict) and len(value) > _DESCRIBE_ITEMS:
        items = list(itertools.islice(itertools.chain.from_iterable(value.items()), 128))
        count = 2 * len(value)  # keys and values
    elif isinstance(value, list | tuple) and len(value) > _DESCRIBE_ITEMS:
        items = list(itertools.islice(value, 64))
        count = len(value)
    if items:
        size += int(count * sum(_own_size(item) for item in items) / len(items))
    return size


def _own_size(value: object) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    try:
        return sys.getsizeof(value)
    except TypeError:
        return 0


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
