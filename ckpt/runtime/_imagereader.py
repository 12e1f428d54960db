"""Reading checkpoint images: the header alone, or the whole file checked before anything is unpickled."""

# A reader checks the whole file before it unpickles anything: unpickling runs
# code, and half-loaded state is worse than none.  Record headers carry their
# own CRC-32, so a flipped length is refused before it can drive an allocation,
# long before the checksum is known.  Each out-of-band buffer is allocated once
# and read into in place, so numpy arrays come back as views over that memory.
# The layout: _imageformat.py.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, final

import lz4.block
import numpy as np

from ckpt._errors import ImageError
from ckpt._schemas import ImageHeader, SchemaError, decode
from ckpt.runtime._imageformat import (
    CHUNK,
    FORMAT_VERSION,
    LZ4,
    MAGIC,
    PREFIX,
    RAW,
    RECORD,
    RECORD_BODY,
    SECTION_BUFFER,
    SECTION_BYTEARRAY,
    SECTION_NAMES,
    SECTION_PICKLE,
    TRAILER,
    TRAILER_MAGIC,
    WINDOW,
    WORKERS,
    ContentHash,
    ImageInfo,
    Progress,
    image_error,
    one_line,
    os_reason,
)
from ckpt.runtime._pickling import ImageUnpickler

logger = logging.getLogger(__name__)

_MAX_CHUNK_BYTES: Final = 64 << 20  # largest chunk a reader accepts
_MAX_HEADER_BYTES: Final = 16 << 20
_MAX_LZ4_RATIO: Final = 256  # lz4 cannot expand data more than this
_PROGRESS_EVERY: Final = 32 << 20


def read_header(path: str | os.PathLike[str]) -> ImageHeader:
    """Return the header of an image, reading only its prefix (no checksum).

    Raises ImageError if the file is missing, foreign, of another format, cut inside its header,
    or its header does not fit the format.
    """
    name = os.fspath(path)
    return _typed(_raw_header(name), name)


def _raw_header(name: str) -> dict[str, Any]:
    f, _ = _open(name)
    with f:
        try:
            header, _ = _read_prefix(f, name)
        except OSError as exc:
            raise image_error(name, f"unreadable ({os_reason(exc)})") from exc
    return header


def _typed(header: dict[str, Any], name: str) -> ImageHeader:
    try:
        return decode(header, ImageHeader, f"checkpoint image {name}")
    except SchemaError as exc:
        raise ImageError(str(exc)) from None


def stored_checksum(path: str | os.PathLike[str]) -> str:
    """The content checksum an image's trailer records (hex), read without hashing anything.

    Enough to tell an image from another one with the same name (the manifest records the checksum);
    `read_image` checks that the content matches it.
    """
    name = os.fspath(path)
    f, size = _open(name)
    with f:
        try:
            if size < TRAILER.size:
                raise image_error(name, "truncated (no trailer at the end of the file)")
            f.seek(size - TRAILER.size)
            magic, _, digest, _ = TRAILER.unpack(_read_exact(f, TRAILER.size, name))
        except OSError as exc:
            raise image_error(name, f"unreadable ({os_reason(exc)})") from exc
    if magic != TRAILER_MAGIC:
        raise image_error(name, "truncated (no trailer at the end of the file)")
    return bytes(digest).hex()


def read_image(
    path: str | os.PathLike[str],
    *,
    token: bytes,
    progress: Progress | None = None,
    expected_sha256: str | None = None,
) -> tuple[ImageHeader, object]:
    """Verify the whole image, then unpickle it; return (header, obj).

    ``progress(done_bytes, total_bytes)`` is called now and then while reading.
    ``expected_sha256`` is the checksum the manifest records for this image.
    Raises ImageError (one line naming the file) on any problem; nothing is
    unpickled unless the checksum and the HMAC match.
    """
    started = time.perf_counter()
    name = os.fspath(path)
    read_header(name)  # a header that does not fit is refused before gigabytes are read
    scan = _scan(name, materialise=True, progress=progress)
    _check_authentic(scan, name, token)
    header = _typed(scan.header, name)  # the header the checksum covers
    if expected_sha256 is not None and scan.digest.hex() != expected_sha256:
        raise image_error(name, "not the image the manifest names (its checksum differs from the manifest's)")
    if scan.inflate_problem is not None:
        raise image_error(name, f"damaged ({scan.inflate_problem})")
    stream = io.BytesIO(scan.slots[0])
    buffers = [slot for kind, slot in zip(scan.sections, scan.slots, strict=True) if kind == SECTION_BUFFER]
    bytearrays = [slot for kind, slot in zip(scan.sections, scan.slots, strict=True) if kind == SECTION_BYTEARRAY]
    try:
        obj = ImageUnpickler(stream, buffers, bytearrays).load()
    except Exception as exc:
        raise image_error(name, f"cannot rebuild the saved state ({one_line(exc)})") from exc
    logger.debug(
        "read %s: %d bytes (%d raw) in %.3f s",
        name,
        scan.file_bytes,
        scan.raw_bytes,
        time.perf_counter() - started,
    )
    return header, obj


def verify_image(path: str | os.PathLike[str], *, token: bytes) -> ImageInfo:
    """Check structure, checksum and HMAC of an image without unpickling it."""
    started = time.perf_counter()
    name = os.fspath(path)
    scan = _scan(name, materialise=False)
    _check_authentic(scan, name, token)
    return ImageInfo(name, scan.file_bytes, scan.digest.hex(), time.perf_counter() - started, scan.raw_bytes)


def inspect_image(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe an image for ``ckpt inspect``; checks the checksum, not the HMAC (no token).

    Keys: path, format_version, header (as stored, fields this ckpt does not know included),
    objects, file_bytes, raw_bytes, sections (count per kind), records, chunks (raw / lz4 counts),
    stored_raw_bytes, compressed_bytes (lz4 payload on disk),
    compressed_raw_bytes (what it inflates to), sha256 (checksum in the
    trailer), ok and problem.  Raises ImageError only if not even the header
    can be read; a damaged or truncated body gives ``"ok": False``, the reason
    in ``"problem"`` and None for what could not be counted.
    """
    name = os.fspath(path)
    header = _raw_header(name)
    _typed(header, name)
    report: dict[str, Any] = {
        "path": name,
        "format_version": header["format_version"],
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
        sections={SECTION_NAMES[kind]: scan.sections.count(kind) for kind in SECTION_NAMES},
        records=len(scan.sections) + scan.raw_chunks + scan.lz4_chunks,
        chunks={"raw": scan.raw_chunks, "lz4": scan.lz4_chunks},
        stored_raw_bytes=scan.stored_raw_bytes,
        compressed_bytes=scan.lz4_stored_bytes,
        compressed_raw_bytes=scan.lz4_raw_bytes,
        sha256=scan.trailer_digest.hex(),
    )
    if not hmac.compare_digest(scan.digest, scan.trailer_digest):
        report["problem"] = str(image_error(name, "damaged (checksum mismatch)"))
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
        raise image_error(name, "damaged (checksum mismatch)")
    mac = hmac.new(token, scan.digest, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, scan.trailer_mac):
        raise image_error(name, "not authentic (HMAC mismatch: wrong CKPT_TOKEN or tampered image)")


def _scan(name: str, *, materialise: bool, progress: Progress | None = None) -> _Scan:
    """Read and hash the whole image; with ``materialise`` also fill one buffer per section."""
    f, size = _open(name)
    with f:
        try:
            return _scan_open(f, name, size, materialise, progress)
        except OSError as exc:
            raise image_error(name, f"unreadable ({os_reason(exc)})") from exc


def _scan_open(f: io.FileIO, name: str, size: int, materialise: bool, progress: Progress | None) -> _Scan:
    header, prefix = _read_prefix(f, name)
    start = len(prefix)
    end = size - TRAILER.size
    if end < start:
        raise image_error(name, "truncated (no trailer at the end of the file)")
    f.seek(end)
    magic, record_bytes, trailer_digest, trailer_mac = TRAILER.unpack(_read_exact(f, TRAILER.size, name))
    if magic != TRAILER_MAGIC:
        raise image_error(name, "truncated (no trailer at the end of the file)")
    if record_bytes != end - start:
        raise image_error(
            name,
            f"damaged (trailer counts {record_bytes} record bytes, the file holds {end - start})",
        )
    f.seek(start)
    scan = _Scan(header, size, trailer_digest, trailer_mac)
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckpt-image")
    try:
        hasher = ContentHash(pool)
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
                if codec == RAW:
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
                    while len(inflating) > WINDOW:
                        scan.inflate_problem = scan.inflate_problem or inflating.popleft().result()
                filled += raw
                if progress is not None and reader.pos - reported >= _PROGRESS_EVERY:
                    reported = reader.pos
                    progress(reported, size)
            if filled != raw_len:
                raise image_error(name, f"damaged (section holds {filled} of its {raw_len} bytes)")
        if not scan.sections:
            raise image_error(name, "damaged (no pickle stream)")
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
    if kind == SECTION_BYTEARRAY:
        slot = bytearray(size)
        scan.slots.append(slot)
        return memoryview(slot)
    view = np.empty(size, np.uint8).data
    scan.slots.append(view)
    return view


@final
class _RecordReader:
    """Reads record headers and payloads in file order, feeding every byte to the hash."""

    def __init__(self, f: io.FileIO, name: str, pos: int, end: int, hasher: ContentHash) -> None:
        self._f = f
        self._name = name
        self.pos = pos
        self._end = end
        self._hasher = hasher

    def section(self, *, first: bool) -> tuple[int, int, int]:
        """Read a section record; return (kind, chunk count, raw length)."""
        kind, codec, chunks, raw_len, stored_len = self._record()
        if kind not in SECTION_NAMES or codec != RAW or stored_len != 0:
            raise self._damaged("a section record was expected")
        if first != (kind == SECTION_PICKLE):
            raise self._damaged("the pickle stream must be the first section, and the only one")
        left = self._end - self.pos
        if chunks * RECORD.size > left or raw_len > chunks * _MAX_CHUNK_BYTES or raw_len > _MAX_LZ4_RATIO * left:
            raise self._damaged(f"section of {raw_len} bytes in {chunks} chunks does not fit the file")
        return kind, chunks, raw_len

    def chunk(self, room: int) -> tuple[int, int, int]:
        """Read a chunk record; return (codec, raw length, stored length)."""
        kind, codec, _, raw, stored = self._record()
        if kind != CHUNK or codec not in (RAW, LZ4):
            raise self._damaged("a chunk record was expected")
        if raw > min(room, _MAX_CHUNK_BYTES) or stored > self._end - self.pos:
            raise self._damaged(f"chunk of {raw} bytes ({stored} stored) does not fit its section")
        if (codec == RAW and stored != raw) or (codec == LZ4 and raw > _MAX_LZ4_RATIO * stored):
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
                raise image_error(self._name, "truncated (end of file inside a record)")
            done += got
        self._hasher.update(view)
        self.pos += done

    def _record(self) -> tuple[int, int, int, int, int]:
        if self._end - self.pos < RECORD.size:
            raise self._damaged("record runs past the end of the records")
        raw = _read_exact(self._f, RECORD.size, self._name)
        kind, codec, _, chunks, raw_len, stored_len, crc = RECORD.unpack(raw)
        if zlib.crc32(raw[: RECORD_BODY.size]) != crc:
            raise self._damaged("record header fails its CRC")
        self._hasher.update(raw)
        self.pos += RECORD.size
        return kind, codec, chunks, raw_len, stored_len

    def _damaged(self, why: str) -> ImageError:
        return image_error(self._name, f"damaged ({why}, at offset {self.pos})")


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
        raise image_error(name, "missing file") from exc
    except OSError as exc:
        raise image_error(name, f"unreadable ({os_reason(exc)})") from exc
    try:
        return f, os.fstat(f.fileno()).st_size
    except OSError as exc:
        f.close()
        raise image_error(name, f"unreadable ({os_reason(exc)})") from exc


def _read_prefix(f: io.FileIO, name: str) -> tuple[dict[str, Any], bytes]:
    """Read and check magic, version and header; return (header, prefix bytes)."""
    head = f.read(PREFIX.size) or b""
    if not head:
        raise image_error(name, "truncated (empty file)")
    if not head.startswith(MAGIC):
        if len(head) < len(MAGIC) and MAGIC.startswith(head):
            raise image_error(name, "truncated (end of file inside the header)")
        raise image_error(name, "not a ckpt image (bad magic)")
    if len(head) < PREFIX.size:
        head += _read_exact(f, PREFIX.size - len(head), name, "inside the header")
    _, version, header_len, header_crc = PREFIX.unpack(head)
    if version != FORMAT_VERSION:
        raise ImageError(f"checkpoint image {name} has format {version}; this ckpt reads format {FORMAT_VERSION}")
    if header_len > _MAX_HEADER_BYTES:
        raise image_error(name, f"damaged (header length {header_len} is implausible)")
    body = _read_exact(f, header_len, name, "inside the header")
    if zlib.crc32(body) != header_crc:
        raise image_error(name, "damaged (header checksum mismatch)")
    try:
        header = json.loads(body)
    except ValueError as exc:
        raise image_error(name, "damaged (header is not JSON)") from exc
    if not isinstance(header, dict):
        raise image_error(name, "damaged (header is not a JSON object)")
    return header, head + body


def _read_exact(f: io.FileIO, size: int, name: str, where: str = "inside a record") -> bytes:
    parts: list[bytes] = []
    left = size
    while left:
        data = f.read(left)
        if not data:
            raise image_error(name, f"truncated (end of file {where})")
        parts.append(data)
        left -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)
