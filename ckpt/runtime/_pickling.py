"""Pickling for images: cloudpickle, protocol 5, big buffers out of band, nothing kept after the write."""

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

from __future__ import annotations

import io
import pickle
from typing import Any, Final, final

import cloudpickle

MIN_OUT_OF_BAND: Final = 64 << 10  # smaller buffers stay in the pickle stream

Section = tuple[bool, memoryview]
"""An out-of-band buffer: (it is a bytearray, a byte view of its memory)."""


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
