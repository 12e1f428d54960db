"""Checkpoint image files: write the image of one rank; the public face of reading and inspecting them."""

# Why the writer works the way it does (the layout itself: _imageformat.py):
#
# * A rank's state is mostly a few large buffers (numpy arrays, registered
#   memory) hanging off a small object graph.  Pickle protocol 5 lets the
#   buffers go out of band: the graph is pickled (and lz4-compressed) on its
#   own and every buffer is written straight from its own memory, never copied
#   into one big stream first.  The pickling itself, and why it lets go of the
#   state at once: _pickling.py.
# * Buffers are cut into chunks so that memory in flight stays bounded and so
#   that compression, hashing and I/O overlap on separate threads (lz4,
#   hashlib and file I/O all release the GIL).
# * A chunk is stored compressed only if compression pays.  A 64 KiB probe
#   decides, so random data costs one tiny probe per chunk instead of a full
#   compression pass that would slow the write to the compressor's speed and
#   the restart to the decompressor's, for nothing.  Mostly-zero state, on the
#   other hand, shrinks twenty-fold and is written faster than raw bytes.
# * The writer asks the kernel to start writeback every 32 MiB, so the disk
#   works while the CPU hashes instead of waiting for the final fsync.

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, closing
from typing import Final

import lz4.block
import msgspec

from ckpt._errors import ImageError
from ckpt._schemas import IMAGE_MINOR, ImageHeader, to_dict
from ckpt.runtime._describe import describe_objects
from ckpt.runtime._imageformat import (
    CHUNK,
    FORMAT_VERSION,
    LZ4,
    MAGIC,
    PREFIX,
    RAW,
    RECORD_BODY,
    SECTION_BUFFER,
    SECTION_BYTEARRAY,
    SECTION_PICKLE,
    TRAILER,
    TRAILER_MAGIC,
    WINDOW,
    WORKERS,
    ContentHash,
    ImageInfo,
    one_line,
    os_reason,
)
from ckpt.runtime._imagereader import inspect_image, read_header, read_image, stored_checksum, verify_image
from ckpt.runtime._pickling import (
    Unpicklable,
    UnpicklableStateError,
    find_unpicklable,
    pickle_with_buffers,
    release,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "ImageHeader",
    "ImageInfo",
    "Unpicklable",
    "UnpicklableStateError",
    "describe_objects",
    "find_unpicklable",
    "inspect_image",
    "read_header",
    "read_image",
    "stored_checksum",
    "verify_image",
    "write_image",
]

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 << 20  # chunk size the writer uses (tests shrink it)
_PROBE_BYTES: Final = 64 << 10
_WORTH_IT: Final = 0.75  # keep compressed output only if at most this fraction of the raw size
_WRITEBACK_EVERY: Final = 32 << 20  # start writeback after this many bytes written


def write_image(path: str | os.PathLike[str], obj: object, *, header: ImageHeader, token: bytes) -> ImageInfo:
    """Write ``obj`` and ``header`` to ``path`` via ``path + ".tmp"``, fsync and rename.

    The stored header is ``header`` with this ckpt's format, ``created`` and
    ``objects`` (see `describe_objects`).  The caller fsyncs the directory.
    Raises ImageError if the file cannot be written, UnpicklableStateError
    (an ImageError naming the part that fails, see `find_unpicklable`) if the
    state cannot be pickled.
    """
    started = time.perf_counter()
    final_path = os.fspath(path)
    stored = msgspec.structs.replace(
        header,
        format_version=FORMAT_VERSION,
        format_minor=IMAGE_MINOR,
        created=time.time(),
        objects=describe_objects(obj),
    )
    try:
        header_json = json.dumps(to_dict(stored), sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ImageError(f"cannot write checkpoint image {final_path}: header is not JSON ({exc})") from exc
    sections = _pickle(obj, final_path)
    raw_bytes = sum(view.nbytes for _, view in sections)
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_json), zlib.crc32(header_json)) + header_json
    tmp = final_path + ".tmp"
    try:
        digest, size = _write_file(tmp, prefix, sections, token)
        os.replace(tmp, final_path)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise ImageError(f"cannot write checkpoint image {final_path}: {os_reason(exc)}") from exc
    except BaseException:
        _unlink_quietly(tmp)
        raise
    finally:
        release([view for _, view in sections])  # the state's memory is the program's again, now
    info = ImageInfo(final_path, size, digest.hex(), time.perf_counter() - started, raw_bytes)
    logger.debug("wrote %s: %d bytes (%d raw) in %.3f s", final_path, size, raw_bytes, info.seconds)
    return info


def _pickle(obj: object, path: str) -> list[tuple[int, memoryview]]:
    """Pickle ``obj``; return (kind, bytes view) of every section, the pickle stream first."""
    try:
        stream, buffers = pickle_with_buffers(obj)
    except Exception as exc:
        # None: it failed once only, so no part can be blamed; name the whole state, unsure
        culprit = find_unpicklable(obj) or Unpicklable("<root>", type(obj).__qualname__, one_line(exc), exact=False)
        raise UnpicklableStateError(
            f"cannot write checkpoint image {path}: cannot pickle the state: {culprit}", culprit
        ) from exc
    kinds = {False: SECTION_BUFFER, True: SECTION_BYTEARRAY}
    return [(SECTION_PICKLE, stream), *((kinds[is_bytearray], view) for is_bytearray, view in buffers)]


def _write_file(tmp: str, prefix: bytes, sections: list[tuple[int, memoryview]], token: bytes) -> tuple[bytes, int]:
    """Write prefix, records and trailer to ``tmp`` and fsync it; return (digest, size)."""
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckpt-image")
    hasher = ContentHash(pool)
    # A failed write closes the generator at once: its chunks in flight are views of the state.
    try:
        # 0600: an image is the program's whole state, and it is code (pickle)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with ExitStack() as stack, open(fd, "wb", buffering=0) as f:
            hasher.update(prefix)
            _write_all(f, prefix)
            record_bytes = flushed = 0
            records = stack.enter_context(closing(_encoded_records(pool, sections)))
            for record, payload in records:
                hasher.update(record)
                hasher.update(payload)
                _write_all(f, record)
                _write_all(f, payload)
                record_bytes += len(record) + len(payload)
                if record_bytes - flushed >= _WRITEBACK_EVERY:
                    _start_writeback(f, len(prefix) + flushed, record_bytes - flushed)
                    flushed = record_bytes
            getattr(os, "fdatasync", os.fsync)(f.fileno())  # the bulk, while the hashing finishes
            digest = hasher.digest()
            mac = hmac.new(token, digest, hashlib.sha256).digest()
            _write_all(f, TRAILER.pack(TRAILER_MAGIC, record_bytes, digest, mac))
            os.fsync(f.fileno())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return digest, len(prefix) + record_bytes + TRAILER.size


_Encoded = tuple[bytes, bytes | memoryview]  # record header, payload


def _encoded_records(pool: ThreadPoolExecutor, sections: list[tuple[int, memoryview]]) -> Generator[_Encoded]:
    """Yield every record in file order; chunks are encoded on ``pool`` a few ahead."""
    pending: deque[Future[_Encoded] | _Encoded] = deque()
    step = _CHUNK_BYTES
    for kind, view in sections:
        size = view.nbytes
        pending.append((_record(kind, RAW, -(-size // step), size, 0), b""))
        for start in range(0, size, step):
            pending.append(pool.submit(_encode_chunk, view[start : start + step]))
            while len(pending) > WINDOW:
                yield _resolved(pending.popleft())
    while pending:
        yield _resolved(pending.popleft())


def _resolved(item: Future[_Encoded] | _Encoded) -> _Encoded:
    return item.result() if isinstance(item, Future) else item


def _encode_chunk(chunk: memoryview) -> _Encoded:
    """Compress ``chunk`` if a probe of its start says it pays, else keep the view as is."""
    size = chunk.nbytes
    sample = chunk[:_PROBE_BYTES]
    probe = lz4.block.compress(sample, mode="fast", store_size=False)
    if len(probe) <= _WORTH_IT * sample.nbytes:
        packed = probe if size == sample.nbytes else lz4.block.compress(chunk, mode="fast", store_size=False)
        if len(packed) <= _WORTH_IT * size:
            return _record(CHUNK, LZ4, 0, size, len(packed)), packed
    return _record(CHUNK, RAW, 0, size, size), chunk


def _record(kind: int, codec: int, chunks: int, raw_len: int, stored_len: int) -> bytes:
    body = RECORD_BODY.pack(kind, codec, 0, chunks, raw_len, stored_len)
    return body + zlib.crc32(body).to_bytes(4, "little")


def _start_writeback(f: io.FileIO, offset: int, size: int) -> None:
    """Have the kernel start writing a range out now, without waiting for it.

    Otherwise dirty pages sit in the page cache until the final fsync and the
    disk idles while the CPU hashes.  On Linux, POSIX_FADV_DONTNEED starts
    asynchronous writeback of dirty pages in the range (and drops only pages
    that are already clean, which these are not).
    """
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        fadvise(f.fileno(), offset, size, os.POSIX_FADV_DONTNEED)


def _write_all(f: io.FileIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = f.write(view)
        if not written:
            raise OSError(0, "the file accepts no more bytes")
        view = view[written:]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
