"""Pickling for images (cloudpickle, protocol 5, big buffers out of band), and naming what does not pickle."""

# Two things here must not hold on to the state after a write:
#
# * The pickler's ``buffer_callback`` is a bound method of a small collector
#   object, never of the pickler itself: pickler -> bound method -> pickler
#   would be a reference cycle, and a cycle is freed only by the cyclic
#   collector, which may not run for many checkpoints.  Through the pickler's
#   memo and the collected views that cycle pinned the whole pickled state, so
#   a rank that rebinds a 128 MB array kept one more copy per checkpoint.
# * The views of the out-of-band buffers are released by the writer as soon
#   as the file is written (`release`), and the memo is cleared right after
#   the dump, so nothing here outlives the write even if a caller keeps a
#   reference to it (an exception's traceback, say).
#
# `find_unpicklable` names the part of a graph that does not pickle the way
# pickle itself sees the graph: through each object's reduce value (its
# ``__getstate__`` result, its ``__slots__``, its reduce arguments), not its
# ``__dict__``, so an attribute a ``__getstate__`` leaves out (the real handle
# behind a verbs shadow, a DSM handler's mutex) is never blamed.  It pickles
# the children of a failing object one by one, each into a sink that keeps no
# bytes and drops every buffer (nothing large is copied), and follows the
# first child that fails, until an object fails whose children all pickle.

from __future__ import annotations

import copyreg
import io
import itertools
import pickle
import types
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, final

import cloudpickle
import numpy as np

from ckpt._errors import ImageError

MIN_OUT_OF_BAND: Final = 64 << 10  # smaller buffers stay in the pickle stream

_FIND_DEPTH: Final = 32  # levels `find_unpicklable` descends, at most
_FIND_CHECKS: Final = 2000  # objects it test-pickles, at most
_FIND_ITEMS: Final = 10_000  # items of one container it looks at, at most
_PATH_BUDGET: Final = 50_000  # objects the shortest-path search looks at, at most
_RACE_TRIES: Final = 5  # pickles of one object that failed only because another thread changed it
_RACE_BUDGET: Final = 20  # such retries in one search, at most
#: What CPython says when a container changes while the pickler iterates over it.
_CHANGED_UNDER: Final = ("changed size during iteration", "mutated during iteration", "keys changed during iteration")
#: Where that is raised from: the pickler's own frames, not an object's reducer.
_PICKLER_FILES: Final = frozenset({cloudpickle.cloudpickle.__file__, pickle.__file__, __file__})

# Types whose exact instances always pickle and hold nothing (numpy arrays too, unless of dtype
# object): never walked into, never tested.
_ATOMS: Final = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None)})

# Named as a whole, never walked into: classes and modules go by reference, functions by
# cloudpickle's own reducers (a closure over a lock names the function), sets have no paths.
_LEAVES: Final = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, set, frozenset)

Section = tuple[bool, memoryview]
"""An out-of-band buffer: (it is a bytearray, a byte view of its memory)."""


@dataclass(frozen=True)
class Unpicklable:
    """The part of an object graph that does not pickle, as `find_unpicklable` found it."""

    path: str
    """Where it is: ``program.conn._sock``, ``program.items[3]``; ``<root>`` for the graph itself."""
    type_name: str
    """Its type: ``_thread.lock``, ``socket.socket``."""
    reason: str
    """Why pickling it failed, one line: ``TypeError: cannot pickle '_thread.lock' object``."""
    exact: bool = True
    """False when the search stopped (depth or budget) before the object that fails on its own."""

    @property
    def name(self) -> str:
        """``program.lock (a _thread.lock)``; ``something inside program.a.b (a Node)`` if not exact."""
        where = f"{self.path} (a {self.type_name})"
        return where if self.exact else f"something inside {where}"

    def __str__(self) -> str:
        """``attribute program.lock (a _thread.lock) cannot be pickled: TypeError: ...``"""
        where = (
            f"{self.path} (a {self.type_name})"
            if self.path == "<root>"
            else f"attribute {self.path} (a {self.type_name})"
        )
        what = where if self.exact else f"something inside {where}"
        return f"{what} cannot be pickled: {self.reason}"


class UnpicklableStateError(ImageError):
    """An image was not written because part of the state does not pickle; ``culprit`` says which."""

    def __init__(self, message: str, culprit: Unpicklable) -> None:
        super().__init__(message)
        self.culprit = culprit


@final
class _OutOfBand:
    """Collects the buffers a pickling leaves out of the stream; ``keep=False`` drops them (a probe).

    Pickle hands PickleBuffers (numpy arrays and the like) to ``buffer_callback``
    but always copies a bytearray into the stream, and the C pickler checks for
    bytearray before any override; so large bytearrays leave through
    ``persistent_id`` instead, numbered in order of first appearance.
    """

    def __init__(self, *, keep: bool) -> None:
        self.keep = keep
        self.sections: list[Section] = []
        self._bytearrays: dict[int, int] = {}  # id -> persistent id; pickle does not memoize these

    def buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """The pickler's ``buffer_callback``: True keeps a buffer in band."""
        if not self.keep:
            return False  # out of band, and then forgotten: a probe copies no buffer
        view = buffer.raw()
        if view.nbytes < MIN_OUT_OF_BAND:
            view.release()
            return True  # small: cheaper in the pickle stream than as a section of its own
        self.sections.append((False, view))
        return False

    def bytearray_id(self, obj: object) -> int | None:
        if type(obj) is not bytearray or len(obj) < MIN_OUT_OF_BAND:
            return None
        pid = self._bytearrays.get(id(obj))
        if pid is None:
            pid = self._bytearrays[id(obj)] = len(self._bytearrays)
            if self.keep:
                self.sections.append((True, memoryview(obj)))
        return pid


@final
class _ImagePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, protocol 5, with large buffers and bytearrays handed to an `_OutOfBand`."""

    def __init__(self, file: Any, out_of_band: _OutOfBand) -> None:
        # The callback is bound to the collector, not to self: no pickler -> method -> pickler cycle.
        super().__init__(file, protocol=5, buffer_callback=out_of_band.buffer)
        self._out_of_band = out_of_band

    def persistent_id(self, obj: object) -> int | None:
        return self._out_of_band.bytearray_id(obj)


@final
class ImageUnpickler(pickle.Unpickler):
    """Unpickler that hands back the bytearrays the reader filled for the pickler's persistent ids."""

    def __init__(self, file: io.BytesIO, buffers: list[Any], bytearrays: list[bytearray]) -> None:
        super().__init__(file, buffers=buffers)
        self._bytearrays = bytearrays

    def persistent_load(self, pid: Any) -> bytearray:
        if type(pid) is not int or not 0 <= pid < len(self._bytearrays):
            raise pickle.UnpicklingError(f"unknown out-of-band bytearray {pid!r}")
        return self._bytearrays[pid]


def pickle_with_buffers(obj: object) -> tuple[memoryview, list[Section]]:
    """Pickle ``obj``; return (the pickle stream, the out-of-band buffers in order).

    The caller `release`s every view once written.  Raises what pickling raises.
    """
    stream = io.BytesIO()
    out_of_band = _OutOfBand(keep=True)
    pickler = _ImagePickler(stream, out_of_band)
    try:
        pickler.dump(obj)
    except BaseException:
        release([view for _, view in out_of_band.sections])
        raise
    finally:
        pickler.clear_memo()  # the memo holds every object pickled: let go of them now
    return stream.getbuffer(), out_of_band.sections


def release(views: list[memoryview]) -> None:
    """Release views of the state's memory, so they pin nothing even if a reference to them lingers."""
    for view in views:
        try:
            view.release()
        except BufferError:  # still exported by a user of it: freed when that user lets go
            pass


@final
class _Sink:
    """A file that keeps no bytes and counts them."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.bytes += size
        return size


def pickling_error(obj: object) -> Exception | None:
    """Pickle ``obj`` as an image would, keeping no bytes and copying no buffer; return the failure or None."""
    try:
        _ImagePickler(_Sink(), _OutOfBand(keep=False)).dump(obj)
    except Exception as exc:  # any failure of any reducer is what we are looking for
        return exc
    return None


def _changed_under(error: Exception) -> bool:
    """Did pickling fail only because another thread changed a container under the pickler?  The C
    pickler's own iteration raised it (the innermost Python frame is the pickler's), not an object's
    ``__reduce__`` / ``__getstate__`` that happens to say the same."""
    if not isinstance(error, RuntimeError) or not any(words in str(error) for words in _CHANGED_UNDER):
        return False
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_code.co_filename in _PICKLER_FILES


def _settled_error(obj: object, retries: list[int]) -> Exception | None:
    """`pickling_error`, tried again while it fails only because another thread changes ``obj`` under the
    pickler (a DSM's handler serving requests), at most `_RACE_TRIES` times and while ``retries[0]`` (the
    search's budget) lasts; a failure that is still such a race is returned: `find_unpicklable` blames it
    on nobody."""
    error = pickling_error(obj)
    for _ in range(_RACE_TRIES - 1):
        if error is None or not _changed_under(error) or retries[0] <= 0:
            break
        retries[0] -= 1
        error = pickling_error(obj)
    return error


def find_unpicklable(obj: object, root: str = "") -> Unpicklable | None:
    """Name the part of ``obj`` that does not pickle; None if ``obj`` pickles.

    ``root`` names ``obj`` in paths (``"program"`` gives ``program.lock``); a
    root dict's string keys are names of their own (``{"program": p}`` gives
    ``program.lock`` too).  Follows the first failing child down to 32 levels
    and test-pickles 2000 objects at most; past either, the result is not
    exact.  An object that fails once but pickles when tried again, or fails
    only because another thread keeps changing a dict, list or deque under the
    pickler (a DSM handler serving requests right after setup), is not blamed:
    the search passes it by and goes on with the others, and if nothing else
    fails the result is None.
    """
    retries = [_RACE_BUDGET]
    error = _settled_error(obj, retries)
    if error is None:
        return None
    path, node = root, obj
    seen = {id(obj)}
    alive: list[object] = [obj]  # ids in `seen` must not be reused by objects freed meanwhile
    checks = 0
    for _ in range(_FIND_DEPTH):
        for child_path, child in _listed_children(node, path):
            if id(child) in seen or _plain(child):
                continue  # an ancestor (a cycle), a child already found to pickle, or a plain value
            seen.add(id(child))
            alive.append(child)
            checks += 1
            if checks > _FIND_CHECKS:
                return None if _changed_under(error) else _found(path, node, error, exact=False)
            child_error = _settled_error(child, retries)
            if child_error is not None and not _changed_under(child_error):
                path, node, error = child_path, child, child_error
                break
        else:  # no child fails on its own: `node` is the culprit, if it still fails for itself
            again = _settled_error(node, retries)
            if again is None or _changed_under(again):
                return None  # a race with another thread, or only one: nothing unpicklable
            return _found(_shortest_path(obj, root, node) or path, node, again, exact=True)
    return None if _changed_under(error) else _found(path, node, error, exact=False)


def _shortest_path(obj: object, root: str, target: object) -> str | None:
    """The shortest path from ``obj`` to ``target`` (``program.mr.handle``, not the way through
    ``program.ctx``'s children the search happened to take); None past a budget of objects."""
    if target is obj:
        return root
    queue = deque([(root, obj)])
    seen = {id(obj)}
    alive: list[object] = [obj]  # as in find_unpicklable: no reused ids
    while queue and len(seen) < _PATH_BUDGET:
        path, node = queue.popleft()
        for child_path, child in _listed_children(node, path):
            if child is target:
                return child_path
            if id(child) not in seen and not _plain(child):
                seen.add(id(child))
                alive.append(child)
                queue.append((child_path, child))
    return None


def _plain(value: object) -> bool:
    return type(value) in _ATOMS or (isinstance(value, np.ndarray) and not value.dtype.hasobject)


def _found(path: str, node: object, error: Exception, *, exact: bool) -> Unpicklable:
    kind = type(node)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    text = " ".join(str(error).split())
    reason = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return Unpicklable(path or "<root>", name, reason, exact)


def _listed_children(node: object, path: str) -> list[tuple[str, object]]:
    try:
        return list(_children(node, path))
    except Exception:  # a reducer, an iterator or a repr that fails: nothing below `node` can be named
        return []


def _children(node: object, path: str) -> Iterator[tuple[str, object]]:
    """The (path, child) pairs pickle would save for ``node``, as far as they can be named."""
    if isinstance(node, dict):
        for key, value in itertools.islice(node.items(), _FIND_ITEMS):
            yield _item_path(path, key), value
        return
    if isinstance(node, list | tuple):
        for index, value in enumerate(itertools.islice(node, _FIND_ITEMS)):
            yield f"{path}[{index}]", value
        return
    if isinstance(node, _LEAVES):
        return  # by reference, or by cloudpickle's own reducers: named as a whole
    reduced = _reduce(node)
    if not isinstance(reduced, tuple) or len(reduced) < 2:
        return
    args, state = reduced[1], reduced[2] if len(reduced) > 2 else None
    if isinstance(args, tuple):
        if reduced[0] in (copyreg.__newobj__, copyreg.__newobj_ex__):  # type: ignore[attr-defined]
            args = args[1:]  # the class
        for index, value in enumerate(args):
            yield f"{path}<argument {index}>", value
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (__dict__ or None, __slots__ values)
    if isinstance(state, dict):
        for key, value in itertools.islice(state.items(), _FIND_ITEMS):
            yield (f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else _item_path(path, key)), value
    elif state is not None:
        yield f"{path}<state>", state
    if len(reduced) > 3 and reduced[3] is not None:  # list items of a list-like object
        for index, value in enumerate(itertools.islice(reduced[3], _FIND_ITEMS)):
            yield f"{path}[{index}]", value
    if len(reduced) > 4 and reduced[4] is not None:  # (key, value) items of a dict-like object
        for key, value in itertools.islice(reduced[4], _FIND_ITEMS):
            yield f"{path}[{repr(key)[:40]}]", value


def _reduce(node: object) -> object:
    """What pickle reduces ``node`` to, or None if that fails (then ``node`` itself is the culprit)."""
    try:
        reducer = copyreg.dispatch_table.get(type(node))
        return reducer(node) if reducer is not None else node.__reduce_ex__(5)
    except Exception:
        return None


def _item_path(path: str, key: object) -> str:
    if not path and isinstance(key, str) and key.isidentifier():
        return key  # a root dict's keys name its parts: {"program": ...} -> "program"
    return f"{path}[{repr(key)[:40]}]"
