"""Checkpoint image files: write, read, verify and inspect the image of one rank."""

# Why the format looks the way it does:
#
# * A rank's state is mostly a few large buffers (numpy arrays, registered
#   memory) hanging off a small object graph.  Pickle protocol 5 lets the
#   buffers go out of band: the graph is pickled (and lz4-compressed) on its
#   own and every buffer is written straight from its own memory, never copied
#   into one big stream first.  On restart each buffer is allocated once and
#   read into in place, and numpy arrays come back as views over that memory.
#   The pickling itself, and why it lets go of the state at once: _pickling.py.
# * Buffers are cut into chunks so that memory in flight stays bounded and so
#   that compression, hashing and I/O overlap on separate threads (lz4,
#   hashlib and file I/O all release the GIL).  Each chunk picks its encoding.
# * A chunk is stored compressed only if compression pays.  A 64 KiB probe
#   decides, so random data costs one tiny probe per chunk instead of a full
#   compression pass that would slow the write to the compressor's speed and
#   the restart to the decompressor's, for nothing.  Mostly-zero state, on the
#   other hand, shrinks twenty-fold and is written faster than raw bytes.
# * One checksum covers everything before the trailer, the header included,
#   and the trailer holds HMAC-SHA256(token, checksum), so damage and tampering
#   are both caught.  The checksum is SHA-256 over the SHA-256 digests of the
#   consecutive 8 MiB pieces of those bytes: one SHA-256 stream (1.7 GB/s
#   here) is slower than the disk, pieces let two cores hash at once.
# * A reader checks the whole file before it unpickles anything: unpickling
#   runs code, and half-loaded state is worse than none.  Record headers carry
#   their own CRC-32, so a flipped length is refused before it can drive an
#   allocation, long before the checksum is known.
# * The writer asks the kernel to start writeback every 32 MiB, so the disk
#   works while the CPU hashes instead of waiting for the final fsync.
#
# Layout (all integers little-endian):
#
#   prefix   MAGIC (8 bytes), format version (u16), header length (u32),
#            CRC-32 of the header (u32), header (UTF-8 JSON object)
#   records  a section record per pickle stream or out-of-band buffer, each
#            followed by its chunk records; a record is 28 bytes:
#            kind (u8), codec (u8), reserved (u16), chunk count (u32),
#            raw length (u64), stored length (u64), CRC-32 of those 24 bytes,
#            then, for a chunk, `stored length` bytes of payload
#   trailer  TRAILER_MAGIC (8 bytes), record bytes (u64), checksum of prefix
#            and records (32 bytes), HMAC-SHA256(token, checksum) (32 bytes)

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from typing import Any, Final, final

import lz4.block
import numpy as np

from ckpt._errors import ImageError
from ckpt.runtime._describe import describe_objects
from ckpt.runtime._pickling import (
    ImageUnpickler,
    Unpicklable,
    UnpicklableStateError,
    find_unpicklable,
    pickle_with_buffers,
    release,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
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

FORMAT_VERSION: Final[int] = 1
MAGIC: Final[bytes] = b"CKPTIMG\x00"
_TRAILER_MAGIC: Final = b"CKPTEND\x00"

_PREFIX: Final = struct.Struct("<8sHII")
_RECORD_BODY: Final = struct.Struct("<BBHIQQ")  # the part of a record its CRC-32 covers
_RECORD: Final = struct.Struct("<BBHIQQI")
_TRAILER: Final = struct.Struct("<8sQ32s32s")

# Record kinds and chunk codecs.
_SECTION_PICKLE: Final = 1  # the in-band pickle stream; always the first section
_SECTION_BUFFER: Final = 2  # an out-of-band buffer, rebuilt over a numpy uint8 array
_SECTION_BYTEARRAY: Final = 3  # an out-of-band bytearray, rebuilt as that very bytearray
_CHUNK: Final = 4
_SECTION_NAMES: Final = {
    _SECTION_PICKLE: "pickle",
    _SECTION_BUFFER: "buffer",
    _SECTION_BYTEARRAY: "bytearray",
}
_RAW: Final = 0
_LZ4: Final = 1

_CHUNK_BYTES = 8 << 20  # chunk size the writer uses (tests shrink it)
_MAX_CHUNK_BYTES: Final = 64 << 20  # largest chunk a reader accepts
_PROBE_BYTES: Final = 64 << 10
_WORTH_IT: Final = 0.75  # keep compressed output only if at most this fraction of the raw size
_MAX_HEADER_BYTES: Final = 16 << 20
_MAX_LZ4_RATIO: Final = 256  # lz4 cannot expand data more than this
_HASH_PIECE: Final = 8 << 20  # part of the format: the checksum hashes pieces of this size
_HASH_WINDOW: Final = 8  # pieces being hashed at once, at most
_WRITEBACK_EVERY: Final = 32 << 20  # start writeback after this many bytes written
_WORKERS: Final = max(1, min(2, os.cpu_count() or 1))
_WINDOW: Final = 8  # chunks being compressed or decompressed ahead of the file position
_PROGRESS_EVERY: Final = 32 << 20

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ImageInfo:
    """What writing, reading or verifying one image found."""

    path: str
    """The final path of the image."""
    bytes: int
    """Size of the file on disk."""
    sha256: str
    """Hex content checksum: SHA-256 over the SHA-256 of each 8 MiB piece before the trailer."""
    seconds: float
    """Wall time of the write, read or verification."""
    raw_bytes: int
    """Uncompressed payload: the pickle stream plus the out-of-band buffers."""


# ---------------------------------------------------------------- writing --


def write_image(path: str | os.PathLike[str], obj: object, *, header: dict[str, Any], token: bytes) -> ImageInfo:
    """Write ``obj`` and ``header`` to ``path`` via ``path + ".tmp"``, fsync and rename.

    The stored header is ``header`` plus ``format_version``, ``created`` and
    ``objects`` (see `describe_objects`).  The caller fsyncs the directory.
    Raises ImageError if the file cannot be written, UnpicklableStateError
    (an ImageError naming the part that fails, see `find_unpicklable`) if the
    state cannot be pickled.
    """
    started = time.perf_counter()
    final_path = os.fspath(path)
    stored = {
        **header,
        "format_version": FORMAT_VERSION,
        "created": time.time(),
        "objects": describe_objects(obj),
    }
    try:
        header_json = json.dumps(stored, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ImageError(f"cannot write checkpoint image {final_path}: header is not JSON ({exc})") from exc
    sections = _pickle(obj, final_path)
    raw_bytes = sum(view.nbytes for _, view in sections)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_json), zlib.crc32(header_json)) + header_json
    tmp = final_path + ".tmp"
    try:
        digest, size = _write_file(tmp, prefix, sections, token)
        os.replace(tmp, final_path)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise ImageError(f"cannot write checkpoint image {final_path}: {_os_reason(exc)}") from exc
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
        culprit = find_unpicklable(obj) or Unpicklable("<root>", type(obj).__qualname__, _one_line(exc), exact=False)
        raise UnpicklableStateError(
            f"cannot write checkpoint image {path}: cannot pickle the state: {culprit}", culprit
        ) from exc
    kinds = {False: _SECTION_BUFFER, True: _SECTION_BYTEARRAY}
    return [(_SECTION_PICKLE, stream), *((kinds[is_bytearray], view) for is_bytearray, view in buffers)]


def _write_file(tmp: str, prefix: bytes, sections: list[tuple[int, memoryview]], token: bytes) -> tuple[bytes, int]:
    """Write prefix, records and trailer to ``tmp`` and fsync it; return (digest, size)."""
    pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="ckpt-image")
    hasher = _ContentHash(pool)
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
            _write_all(f, _TRAILER.pack(_TRAILER_MAGIC, record_bytes, digest, mac))
            os.fsync(f.fileno())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return digest, len(prefix) + record_bytes + _TRAILER.size


_Encoded = tuple[bytes, bytes | memoryview]  # record header, payload


def _encoded_records(pool: ThreadPoolExecutor, sections: list[tuple[int, memoryview]]) -> Generator[_Encoded]:
    """Yield every record in file order; chunks are encoded on ``pool`` a few ahead."""
    pending: deque[Future[_Encoded] | _Encoded] = deque()
    step = _CHUNK_BYTES
    for kind, view in sections:
        size = view.nbytes
        pending.append((_record(kind, _RAW, -(-size // step), size, 0), b""))
        for start in range(0, size, step):
            pending.append(pool.submit(_encode_chunk, view[start : start + step]))
            while len(pending) > _WINDOW:
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
            return _record(_CHUNK, _LZ4, 0, size, len(packed)), packed
    return _record(_CHUNK, _RAW, 0, size, size), chunk


def _record(kind: int, codec: int, chunks: int, raw_len: int, stored_len: int) -> bytes:
    body = _RECORD_BODY.pack(kind, codec, 0, chunks, raw_len, stored_len)
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


# ---------------------------------------------------------------- reading --


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the stored header of an image, reading only its prefix (no checksum).

    Raises ImageError if the file is missing, foreign, too new or cut inside its header.
    """
    name = os.fspath(path)
    f, _ = _open(name)
    with f:
        try:
            header, _ = _read_prefix(f, name)
        except OSError as exc:
            raise _error(name, f"unreadable ({_os_reason(exc)})") from exc
    return header


def stored_checksum(path: str | os.PathLike[str]) -> str:
    """The content checksum an image's trailer records (hex), read without hashing anything.

    Enough to tell an image from another one with the same name (the manifest records the checksum);
    `read_image` checks that the content matches it.
    """
    name = os.fspath(path)
    f, size = _open(name)
    with f:
        try:
            if size < _TRAILER.size:
                raise _error(name, "truncated (no trailer at the end of the file)")
            f.seek(size - _TRAILER.size)
            magic, _, digest, _ = _TRAILER.unpack(_read_exact(f, _TRAILER.size, name))
        except OSError as exc:
            raise _error(name, f"unreadable ({_os_reason(exc)})") from exc
    if magic != _TRAILER_MAGIC:
        raise _error(name, "truncated (no trailer at the end of the file)")
    return bytes(digest).hex()


def read_image(
    path: str | os.PathLike[str],
    *,
    token: bytes,
    progress: Progress | None = None,
    expected_sha256: str | None = None,
) -> tuple[dict[str, Any], object]:
    """Verify the whole image, then unpickle it; return (header, obj).

    ``progress(done_bytes, total_bytes)`` is called now and then while reading.
    ``expected_sha256`` is the checksum the manifest records for this image.
    Raises ImageError (one line naming the file) on any problem; nothing is
    unpickled unless the checksum and the HMAC match.
    """
    started = time.perf_counter()
    name = os.fspath(path)
    scan = _scan(name, materialise=True, progress=progress)
    _check_authentic(scan, name, token)
    if expected_sha256 is not None and scan.digest.hex() != expected_sha256:
        raise _error(name, "not the image the manifest names (its checksum differs from the manifest's)")
    if scan.inflate_problem is not None:
        raise _error(name, f"damaged ({scan.inflate_problem})")
    stream = io.BytesIO(scan.slots[0])
    buffers = [slot for kind, slot in zip(scan.sections, scan.slots, strict=True) if kind == _SECTION_BUFFER]
    bytearrays = [slot for kind, slot in zip(scan.sections, scan.slots, strict=True) if kind == _SECTION_BYTEARRAY]
    try:
        obj = ImageUnpickler(stream, buffers, bytearrays).load()
    except Exception as exc:
        raise _error(name, f"cannot rebuild the saved state ({_one_line(exc)})") from exc
    logger.debug(
        "read %s: %d bytes (%d raw) in %.3f s",
        name,
        scan.file_bytes,
        scan.raw_bytes,
        time.perf_counter() - started,
    )
    return scan.header, obj


def verify_image(path: str | os.PathLike[str], *, token: bytes) -> ImageInfo:
    """Check structure, checksum and HMAC of an image without unpickling it."""
    started = time.perf_counter()
    name = os.fspath(path)
    scan = _scan(name, materialise=False)
    _check_authentic(scan, name, token)
    return ImageInfo(name, scan.file_bytes, scan.digest.hex(), time.perf_counter() - started, scan.raw_bytes)


def inspect_image(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe an image for ``ckpt inspect``; checks the checksum, not the HMAC (no token).

    Keys: path, format_version, header, objects, file_bytes, raw_bytes,
    sections (count per kind), records, chunks (raw / lz4 counts),
    stored_raw_bytes, compressed_bytes (lz4 payload on disk),
    compressed_raw_bytes (what it inflates to), sha256 (checksum in the
    trailer), ok and problem.  Raises ImageError only if not even the header
    can be read; a damaged or truncated body gives ``"ok": False``, the reason
    in ``"problem"`` and None for what could not be counted.
    """
    name = os.fspath(path)
    header = read_header(name)
    report: dict[str, Any] = {
        "path": name,
        "format_version": header.get("format_version", FORMAT_VERSION),
        "header": header,
        "file_bytes": os.path.getsize(name) if os.path.isfile(name) else None,
        "objects": header.get("objects", []),
        **dict.fromkeys(
            (
                "raw_bytes",
                "sections",
                "records",
                "chunks",
                "stored_raw_bytes",
                "compressed_bytes",
                "compressed_raw_bytes",
                "sha256",
            )
        ),
        "ok": False,
        "problem": None,
    }
    try:
        scan = _scan(name, materialise=False)
    except ImageError as exc:
        report["problem"] = str(exc)
        return report
    report.update(
        file_bytes=scan.file_bytes,
        raw_bytes=scan.raw_bytes,
        sections={_SECTION_NAMES[kind]: scan.sections.count(kind) for kind in _SECTION_NAMES},
        records=len(scan.sections) + scan.raw_chunks + scan.lz4_chunks,
        chunks={"raw": scan.raw_chunks, "lz4": scan.lz4_chunks},
        stored_raw_bytes=scan.stored_raw_bytes,
        compressed_bytes=scan.lz4_stored_bytes,
        compressed_raw_bytes=scan.lz4_raw_bytes,
        sha256=scan.trailer_digest.hex(),
    )
    if not hmac.compare_digest(scan.digest, scan.trailer_digest):
        report["problem"] = str(_error(name, "damaged (checksum mismatch)"))
    else:
        report["ok"] = True
    return report


@dataclass
class _Scan:
    """What one pass over an image found."""

    header: dict[str, Any]
    file_bytes: int
    trailer_digest: bytes
    trailer_mac: bytes
    digest: bytes = b""
    raw_bytes: int = 0
    sections: list[int] = field(default_factory=list)
    slots: list[Any] = field(default_factory=list)
    raw_chunks: int = 0
    lz4_chunks: int = 0
    stored_raw_bytes: int = 0
    lz4_stored_bytes: int = 0
    lz4_raw_bytes: int = 0
    inflate_problem: str | None = None


def _check_authentic(scan: _Scan, name: str, token: bytes) -> None:
    if not hmac.compare_digest(scan.digest, scan.trailer_digest):
        raise _error(name, "damaged (checksum mismatch)")
    mac = hmac.new(token, scan.digest, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, scan.trailer_mac):
        raise _error(name, "not authentic (HMAC mismatch: wrong CKPT_TOKEN or tampered image)")


def _scan(name: str, *, materialise: bool, progress: Progress | None = None) -> _Scan:
    """Read and hash the whole image; with ``materialise`` also fill one buffer per section."""
    f, size = _open(name)
    with f:
        try:
            return _scan_open(f, name, size, materialise, progress)
        except OSError as exc:
            raise _error(name, f"unreadable ({_os_reason(exc)})") from exc


def _scan_open(f: io.FileIO, name: str, size: int, materialise: bool, progress: Progress | None) -> _Scan:
    header, prefix = _read_prefix(f, name)
    start = len(prefix)
    end = size - _TRAILER.size
    if end < start:
        raise _error(name, "truncated (no trailer at the end of the file)")
    f.seek(end)
    magic, record_bytes, trailer_digest, trailer_mac = _TRAILER.unpack(_read_exact(f, _TRAILER.size, name))
    if magic != _TRAILER_MAGIC:
        raise _error(name, "truncated (no trailer at the end of the file)")
    if record_bytes != end - start:
        raise _error(
            name,
            f"damaged (trailer counts {record_bytes} record bytes, the file holds {end - start})",
        )
    f.seek(start)
    scan = _Scan(header, size, trailer_digest, trailer_mac)
    pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="ckpt-image")
    try:
        hasher = _ContentHash(pool)
        hasher.update(prefix)
        reader = _RecordReader(f, name, start, end, hasher)
        inflating: deque[Future[str | None]] = deque()
        reported = 0
        while reader.pos < end:
            kind, chunks, raw_len = reader.section(first=not scan.sections)
            scan.sections.append(kind)
            scan.raw_bytes += raw_len
            view = _allocate(scan, kind, raw_len) if materialise else None
            filled = 0
            for _ in range(chunks):
                codec, raw, stored = reader.chunk(raw_len - filled)
                if codec == _RAW:
                    scan.raw_chunks += 1
                    scan.stored_raw_bytes += stored
                    if view is None:
                        reader.payload(stored)
                    else:
                        reader.payload_into(view[filled : filled + raw])
                else:
                    scan.lz4_chunks += 1
                    scan.lz4_stored_bytes += stored
                    scan.lz4_raw_bytes += raw
                    payload = reader.payload(stored)
                    if view is not None:
                        inflating.append(pool.submit(_inflate, payload, view[filled : filled + raw]))
                    while len(inflating) > _WINDOW:
                        scan.inflate_problem = scan.inflate_problem or inflating.popleft().result()
                filled += raw
                if progress is not None and reader.pos - reported >= _PROGRESS_EVERY:
                    reported = reader.pos
                    progress(reported, size)
            if filled != raw_len:
                raise _error(name, f"damaged (section holds {filled} of its {raw_len} bytes)")
        if not scan.sections:
            raise _error(name, "damaged (no pickle stream)")
        while inflating:
            scan.inflate_problem = scan.inflate_problem or inflating.popleft().result()
        scan.digest = hasher.digest()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if progress is not None:
        progress(size, size)
    return scan


def _allocate(scan: _Scan, kind: int, size: int) -> memoryview:
    """Allocate the one buffer a section is read into; return a byte view of it.

    numpy.empty does not touch the memory, so pages are first touched by the
    read itself; a bytearray must be one to come back as the same object.
    """
    if kind == _SECTION_BYTEARRAY:
        slot = bytearray(size)
        scan.slots.append(slot)
        return memoryview(slot)
    view = np.empty(size, np.uint8).data
    scan.slots.append(view)
    return view


@final
class _RecordReader:
    """Reads record headers and payloads in file order, feeding every byte to the hash."""

    def __init__(self, f: io.FileIO, name: str, pos: int, end: int, hasher: _ContentHash) -> None:
        self._f = f
        self._name = name
        self.pos = pos
        self._end = end
        self._hasher = hasher

    def section(self, *, first: bool) -> tuple[int, int, int]:
        """Read a section record; return (kind, chunk count, raw length)."""
        kind, codec, chunks, raw_len, stored_len = self._record()
        if kind not in _SECTION_NAMES or codec != _RAW or stored_len != 0:
            raise self._damaged("a section record was expected")
        if first != (kind == _SECTION_PICKLE):
            raise self._damaged("the pickle stream must be the first section, and the only one")
        left = self._end - self.pos
        if chunks * _RECORD.size > left or raw_len > chunks * _MAX_CHUNK_BYTES or raw_len > _MAX_LZ4_RATIO * left:
            raise self._damaged(f"section of {raw_len} bytes in {chunks} chunks does not fit the file")
        return kind, chunks, raw_len

    def chunk(self, room: int) -> tuple[int, int, int]:
        """Read a chunk record; return (codec, raw length, stored length)."""
        kind, codec, _, raw, stored = self._record()
        if kind != _CHUNK or codec not in (_RAW, _LZ4):
            raise self._damaged("a chunk record was expected")
        if raw > min(room, _MAX_CHUNK_BYTES) or stored > self._end - self.pos:
            raise self._damaged(f"chunk of {raw} bytes ({stored} stored) does not fit its section")
        if (codec == _RAW and stored != raw) or (codec == _LZ4 and raw > _MAX_LZ4_RATIO * stored):
            raise self._damaged("chunk sizes do not match its encoding")
        return codec, raw, stored

    def payload(self, size: int) -> bytes:
        data = _read_exact(self._f, size, self._name)
        self._hasher.update(data)
        self.pos += size
        return data

    def payload_into(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            got = self._f.readinto(view[done:])
            if not got:
                raise _error(self._name, "truncated (end of file inside a record)")
            done += got
        self._hasher.update(view)
        self.pos += done

    def _record(self) -> tuple[int, int, int, int, int]:
        if self._end - self.pos < _RECORD.size:
            raise self._damaged("record runs past the end of the records")
        raw = _read_exact(self._f, _RECORD.size, self._name)
        kind, codec, _, chunks, raw_len, stored_len, crc = _RECORD.unpack(raw)
        if zlib.crc32(raw[: _RECORD_BODY.size]) != crc:
            raise self._damaged("record header fails its CRC")
        self._hasher.update(raw)
        self.pos += _RECORD.size
        return kind, codec, chunks, raw_len, stored_len

    def _damaged(self, why: str) -> ImageError:
        return _error(self._name, f"damaged ({why}, at offset {self.pos})")


def _inflate(payload: bytes, into: memoryview) -> str | None:
    """Decompress one chunk into its place; return a problem or None."""
    try:
        data = lz4.block.decompress(payload, uncompressed_size=into.nbytes)
    except lz4.block.LZ4BlockError as exc:
        return f"a chunk does not decompress: {exc}"
    if len(data) != into.nbytes:
        return "a chunk decompresses to the wrong size"
    into[:] = data
    return None


def _open(name: str) -> tuple[io.FileIO, int]:
    try:
        f = io.FileIO(name, "r")
    except FileNotFoundError as exc:
        raise _error(name, "missing file") from exc
    except OSError as exc:
        raise _error(name, f"unreadable ({_os_reason(exc)})") from exc
    try:
        return f, os.fstat(f.fileno()).st_size
    except OSError as exc:
        f.close()
        raise _error(name, f"unreadable ({_os_reason(exc)})") from exc


def _read_prefix(f: io.FileIO, name: str) -> tuple[dict[str, Any], bytes]:
    """Read and check magic, version and header; return (header, prefix bytes)."""
    head = f.read(_PREFIX.size) or b""
    if not head:
        raise _error(name, "truncated (empty file)")
    if not head.startswith(MAGIC):
        if len(head) < len(MAGIC) and MAGIC.startswith(head):
            raise _error(name, "truncated (end of file inside the header)")
        raise _error(name, "not a ckpt image (bad magic)")
    if len(head) < _PREFIX.size:
        head += _read_exact(f, _PREFIX.size - len(head), name, "inside the header")
    _, version, header_len, header_crc = _PREFIX.unpack(head)
    if version != FORMAT_VERSION:
        raise _error(name, f"unsupported format version {version} (this ckpt reads {FORMAT_VERSION})")
    if header_len > _MAX_HEADER_BYTES:
        raise _error(name, f"damaged (header length {header_len} is implausible)")
    body = _read_exact(f, header_len, name, "inside the header")
    if zlib.crc32(body) != header_crc:
        raise _error(name, "damaged (header checksum mismatch)")
    try:
        header = json.loads(body)
    except ValueError as exc:
        raise _error(name, "damaged (header is not JSON)") from exc
    if not isinstance(header, dict):
        raise _error(name, "damaged (header is not a JSON object)")
    return header, head + body


def _read_exact(f: io.FileIO, size: int, name: str, where: str = "inside a record") -> bytes:
    parts: list[bytes] = []
    left = size
    while left:
        data = f.read(left)
        if not data:
            raise _error(name, f"truncated (end of file {where})")
        parts.append(data)
        left -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# ---------------------------------------------------------------- hashing --


@final
class _ContentHash:
    """The content checksum, hashed on the worker pool while the caller does the I/O.

    The bytes before the trailer are cut into fixed 8 MiB pieces (at byte
    offsets, whatever the records), each piece is hashed with SHA-256 on the
    pool, and the checksum is the SHA-256 of those piece digests in order.  One
    SHA-256 stream runs at about 1.7 GB/s here, slower than the disk; pieces
    let two cores share the work.  At most _HASH_WINDOW pieces are in flight,
    which bounds the copies (compressed chunks) they keep alive.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._top = hashlib.sha256()
        self._pending: deque[Future[bytes]] = deque()
        self._piece: list[memoryview] = []
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            take = min(_HASH_PIECE - self._filled, view.nbytes)
            self._piece.append(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == _HASH_PIECE:
                self._submit()

    def digest(self) -> bytes:
        if self._filled:
            self._submit()
        while self._pending:
            self._top.update(self._pending.popleft().result())
        return self._top.digest()

    def _submit(self) -> None:
        self._pending.append(self._pool.submit(_sha256, self._piece))
        self._piece, self._filled = [], 0
        while len(self._pending) > _HASH_WINDOW or (self._pending and self._pending[0].done()):
            self._top.update(self._pending.popleft().result())


def _sha256(parts: list[memoryview]) -> bytes:
    piece = hashlib.sha256()
    for part in parts:
        piece.update(part)
    return piece.digest()


# ----------------------------------------------------------------- errors --


def _error(name: str, what: str) -> ImageError:
    return ImageError(f"checkpoint image {name}: {what}")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _os_reason(exc: OSError) -> str:
    return exc.strerror or _one_line(exc)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
