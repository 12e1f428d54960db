"""The image file format: its layout, the content checksum and the errors that name an image."""

# Why the format looks the way it does (the writer's choices: images.py; the reader's: _imagereader.py):
#
# * One checksum covers everything before the trailer, the header included,
#   and the trailer holds HMAC-SHA256(token, checksum), so damage and tampering
#   are both caught.  The checksum is SHA-256 over the SHA-256 digests of the
#   consecutive 8 MiB pieces of those bytes: one SHA-256 stream (1.7 GB/s
#   here) is slower than the disk, pieces let two cores hash at once.
# * Sections (a pickle stream, then out-of-band buffers) are cut into chunks,
#   each stored raw or lz4-compressed (the writer decides, chunk by chunk).
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
#
# The header is a JSON object whose schema and versioning rule are in ckpt._schemas
# (`ImageHeader`); the format version in the prefix is the header's major.

from __future__ import annotations

import hashlib
import os
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, final

from ckpt._errors import ImageError
from ckpt._schemas import IMAGE_FORMAT

FORMAT_VERSION: Final[int] = IMAGE_FORMAT
MAGIC: Final[bytes] = b"CKPTIMG\x00"
TRAILER_MAGIC: Final = b"CKPTEND\x00"

PREFIX: Final = struct.Struct("<8sHII")
RECORD_BODY: Final = struct.Struct("<BBHIQQ")  # the part of a record its CRC-32 covers
RECORD: Final = struct.Struct("<BBHIQQI")
TRAILER: Final = struct.Struct("<8sQ32s32s")

# Record kinds and chunk codecs.
SECTION_PICKLE: Final = 1  # the in-band pickle stream; always the first section
SECTION_BUFFER: Final = 2  # an out-of-band buffer, rebuilt over a numpy uint8 array
SECTION_BYTEARRAY: Final = 3  # an out-of-band bytearray, rebuilt as that very bytearray
CHUNK: Final = 4
SECTION_NAMES: Final = {
    SECTION_PICKLE: "pickle",
    SECTION_BUFFER: "buffer",
    SECTION_BYTEARRAY: "bytearray",
}
RAW: Final = 0
LZ4: Final = 1

_HASH_PIECE: Final = 8 << 20  # part of the format: the checksum hashes pieces of this size
_HASH_WINDOW: Final = 8  # pieces being hashed at once, at most
WORKERS: Final = max(1, min(2, os.cpu_count() or 1))
WINDOW: Final = 8  # chunks being compressed or decompressed ahead of the file position

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


# ---------------------------------------------------------------- hashing --


@final
class ContentHash:
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


def image_error(name: str, what: str) -> ImageError:
    return ImageError(f"checkpoint image {name}: {what}")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def os_reason(exc: OSError) -> str:
    return exc.strerror or one_line(exc)
