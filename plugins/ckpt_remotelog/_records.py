"""The log record: one typed header and its payload, as it lies in a log ring and in a stable log file."""

# Rationale.  A log ring is written by several ranks at once with RDMA WRITE and read by
# nobody until a recovery (FT-KDSM §4: the log home's CPU takes no part), so a record
# must say by itself what it is and whether it is complete:
#
# * the first 8 bytes are the *commit word*: the record's absolute position in its ring
#   (the ring's tail counter, which only grows) plus one.  A stale word left by an
#   earlier lap of the ring never matches (its position was smaller);
# * then the header proper -- kind, writer, interval, page gid, tag (lock or barrier
#   epoch), pointer (the home diff log's tail when an own record was made), the writer's
#   serial number of its own records, payload length, and the *check*: a CRC-32 of the
#   whole record but the check itself -- and the payload, padded to 8 bytes, so every
#   record and therefore every commit word is 8-byte aligned and never split by the
#   ring's end.
#
# A record is committed when its commit word matches its position *and* its check
# matches its bytes, so a record needs no write of its own after its body: a batch of
# records goes to a ring as one RDMA WRITE (two across the ring's end), commit words and
# all.  No order of placement *within* a WRITE is assumed (the verbs specification
# gives none): a record that is only partly placed -- its writer died, or its WRITE is
# still arriving -- fails its check and counts as not written yet.  (Before the check,
# each commit word was a WRITE of its own behind the bodies, k + 1 work requests for k
# records; the log homes' NIC executed one packet per record.)
#
# Payloads: DIFF and HOME_DIFF records carry the diffs of *every page of one interval* that go to one
# ring -- ``<u32 count> <count i64 gids> <count u32 sizes>`` then each page's diff as the DSM encodes it
# (`dsm.Diff.encode`: run count, offsets, lengths, the runs' bytes), back to back; the header's gid is
# the first page's.  `per_page` reads one back as one `Record` per page.  (Format 4 had a record per
# page: SOR's homes wrote 64 a barrier, and their headers, copies and checks were a quarter of its
# logging's CPU.)
# NOTICES, BARRIER and BARRIER_ARRIVAL carry msgpack ``[vector timestamp, notices]``
# (notices as the DSM carries them: ``[writer, interval, [gid, home, ...]]``); RELEASE none.
#
# Holes: a writer that dies between its reservation and its WRITE's arrival leaves a hole
# that no later write fills.  A plain `walk` stops there (a discard passes a hole only once
# no live rank can still write it: `_writer`, "Claims"); a recovery, which needs every record after
# it, `scan`s forward 8 bytes at a time for the next word that is its own position + 1
# followed by a plausible header (known kind, writer < N, payload within the ring) and a
# matching check.

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack

from dsm import DsmError

HEADER = struct.Struct("<QB3xiqqqqqII")
HEADER_SIZE = HEADER.size  # 64
CHECK_AT = HEADER_SIZE - 4  # the check is the header's last field
_WORD = struct.Struct("<Q")
_CHECK = struct.Struct("<I")
_U32 = struct.Struct("<I")  # a diff record's page count; the header's payload length
_LENGTH_AT = CHECK_AT - 4  # the payload length is the field before the check
_KIND_AT = _WORD.size  # the kind follows the commit word
ALIGN = 8
#: What an image's rings and writer hold (images of another are refused): 1 had no check and each commit
#: word was a WRITE of its own; 2 had no claim words (`_writer`, "Claims"); 3 encoded a diff run by run
#: (``<offset u32, length u32, bytes>`` each); 4 had one DIFF or HOME_DIFF record per page.
RECORD_FORMAT = 5


class RecordKind(IntEnum):
    """What a record logs (FT-KDSM §4.2, §4.3)."""

    DIFF = 1  # a writer's diffs of one interval for pages of one home, at that home's log home (its own too)
    HOME_DIFF = 2  # diffs a home applied (or made, of its own writes), in the home's own diff log
    NOTICES = 3  # write notices an acquirer received with a lock grant (tag lock, interval token), at its log home
    BARRIER_ARRIVAL = 4  # barrier phase 1: a rank's arrival notices (tag epoch), at its own log home
    BARRIER = 5  # barrier phase 2: the merged notices a rank received (tag epoch), at its own log home
    RELEASE = 6  # a lock release (tag lock, interval token), at the releaser's log home, before it leaves


#: The kinds a rank writes about its own synchronisation, numbered by its serial, in program order.
OWN_KINDS = frozenset({RecordKind.NOTICES, RecordKind.RELEASE, RecordKind.BARRIER_ARRIVAL, RecordKind.BARRIER})
KINDS = frozenset(int(kind) for kind in RecordKind)


class Record(NamedTuple):
    """One decoded record (the payload still encoded: `dsm.Diff.decode` / `notices_of` decode it)."""

    position: int
    kind: RecordKind
    writer: int
    interval: int
    gid: int
    tag: int
    pointer: int
    serial: int
    payload: bytes

    @property
    def size(self) -> int:
        return record_size(len(self.payload))

    @property
    def gids(self) -> tuple[int, ...]:
        """The pages a DIFF or HOME_DIFF record holds diffs of (`per_page`)."""
        return _pages_head(self.payload)[0]


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def record_size(payload: int) -> int:
    """Bytes a record with `payload` payload bytes takes in a ring."""
    return HEADER_SIZE + padded(payload)


def encode(
    kind: RecordKind,
    writer: int,
    payload: bytes,
    *,
    interval: int = 0,
    gid: int = 0,
    tag: int = 0,
    pointer: int = 0,
    serial: int = 0,
) -> bytearray:
    """The record's bytes with a zero commit word and check (`seal` fills them in once the position is known)."""
    out = bytearray(record_size(len(payload)))
    HEADER.pack_into(out, 0, 0, int(kind), writer, interval, gid, tag, pointer, serial, len(payload), 0)
    out[HEADER_SIZE : HEADER_SIZE + len(payload)] = payload
    return out


def commit_word(position: int) -> bytes:
    """The commit word of a record at absolute ring position `position`."""
    return _WORD.pack(position + 1)


def seal(record: bytearray, position: int) -> bytearray:
    """Fill in `record`'s commit word for ring position `position`, then its check; `record` itself."""
    _WORD.pack_into(record, 0, position + 1)
    _CHECK.pack_into(record, CHECK_AT, _check(record, 0, len(record)))
    return record


def sealed(records: Sequence[bytearray], position: int) -> bytes:
    """`records` sealed for consecutive positions from `position` on, back to back (one copy to place)."""
    for record in records:
        seal(record, position)
        position += len(record)
    return b"".join(records)


def _check(data: bytes | bytearray | memoryview, at: int, end: int) -> int:
    """The CRC-32 of the record at `data[at:end]`, its check field left out."""
    view = memoryview(data)
    return zlib.crc32(view[at + HEADER_SIZE : end], zlib.crc32(view[at : at + CHECK_AT]))


def notices_payload(vt: list[int], notices: list[Any]) -> bytes:
    return bytes(msgpack.packb([vt, notices], use_bin_type=True))


def notices_of(payload: bytes) -> tuple[list[int], list[Any]]:
    vt, notices = msgpack.unpackb(payload, raw=False)
    return list(vt), list(notices)


def decode_at(data: bytes | bytearray | memoryview, at: int, position: int) -> Record | None:
    """The committed record at offset `at` of `data` (whose first byte is ring position `position - at`).

    None when the bytes there are not a committed record of that position (not written yet,
    still being written, or torn: its check does not match).
    """
    if at + HEADER_SIZE > len(data):
        return None
    commit, kind, writer, interval, gid, tag, pointer, serial, length, check = HEADER.unpack_from(data, at)
    end = at + record_size(length)
    if commit != position + 1 or kind not in KINDS or end > len(data) or check != _check(data, at, end):
        return None
    payload = bytes(data[at + HEADER_SIZE : at + HEADER_SIZE + length])
    return Record(position, RecordKind(kind), writer, interval, gid, tag, pointer, serial, payload)


def walk(data: bytes | bytearray | memoryview, start: int) -> list[Record]:
    """The committed records of `data`, laid out from ring position `start`, up to the first that is not."""
    records, at = [], 0
    while (record := decode_at(data, at, start + at)) is not None:
        records.append(record)
        at += record.size
    return records


def scan(data: bytes | bytearray | memoryview, start: int, size: int) -> list[Record]:
    """Like `walk`, but past holes: the committed records of `data` (ranks < `size` wrote them), from `start`.

    After a position that holds no committed record, the next candidate is the next 8-byte word equal
    to its own position + 1 whose header is plausible; a garbage word inside a hole that passes all
    that is not expected (a payload would have to hold its own ring position and a valid header).
    """
    records, at, end = [], 0, len(data)
    while at + HEADER_SIZE <= end:
        record = decode_at(data, at, start + at)
        if record is not None and 0 <= record.writer < size:
            records.append(record)
            at += record.size
        else:
            at += ALIGN
    return records


def diff_record(kind: RecordKind, writer: int, interval: int, pages: Sequence[tuple[int, bytes]]) -> bytearray:
    """A DIFF or HOME_DIFF record of `writer`'s interval `interval`: `pages` are (gid, the page's encoded diff)."""
    count = len(pages)
    sizes = [len(diff) for _, diff in pages]
    head = struct.pack(f"<I{count}q{count}I", count, *(gid for gid, _ in pages), *sizes)
    return encode(kind, writer, b"".join([head, *(diff for _, diff in pages)]), interval=interval, gid=pages[0][0])


def as_kind(record: bytearray, kind: RecordKind) -> bytearray:
    """A copy of an unsealed `record` as a record of `kind`: a home's DIFF and HOME_DIFF of its own writes
    hold the same diffs, built once."""
    out = bytearray(record)
    out[_KIND_AT] = int(kind)
    return out


def _pages_head(payload: bytes | bytearray | memoryview) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(gids, sizes, where the first diff starts) of a DIFF or HOME_DIFF payload; DsmError if it is not one."""
    if len(payload) < _U32.size:
        raise DsmError(f"malformed diff record: a payload of {len(payload)} bytes has no page count")
    count = _U32.unpack_from(payload)[0]
    start = _U32.size + 12 * count
    if count < 1 or len(payload) < start:
        raise DsmError(f"malformed diff record: {count} pages in {len(payload)} bytes")
    gids = struct.unpack_from(f"<{count}q", payload, _U32.size)
    sizes = struct.unpack_from(f"<{count}I", payload, _U32.size + 8 * count)
    if start + sum(sizes) != len(payload) or 0 in sizes:
        raise DsmError(f"malformed diff record: {count} pages of {sum(sizes)} bytes in {len(payload) - start}")
    return gids, sizes, start


def per_page(record: Record) -> list[Record]:
    """A DIFF or HOME_DIFF record as one record per page (its position and the rest of its header; the page's
    gid and encoded diff), in the order written; DsmError if its payload is not such a record's."""
    gids, sizes, at = _pages_head(record.payload)
    out = []
    for gid, size in zip(gids, sizes, strict=True):
        out.append(record._replace(gid=gid, payload=record.payload[at : at + size]))
        at += size
    return out


def gids_of(record: bytes | bytearray) -> tuple[int, ...]:
    """The page gids of an encoded DIFF or HOME_DIFF record (no diff copied, as `parse` does)."""
    length = _U32.unpack_from(record, _LENGTH_AT)[0]
    return _pages_head(memoryview(record)[HEADER_SIZE : HEADER_SIZE + length])[0]


def parse(record: bytes | bytearray) -> Record:
    """A record as `encode` made it (its commit word not filled in: position -1), e.g. one kept off the ring."""
    _, kind, writer, interval, gid, tag, pointer, serial, length, _ = HEADER.unpack_from(record, 0)
    payload = bytes(record[HEADER_SIZE : HEADER_SIZE + length])
    return Record(-1, RecordKind(kind), writer, interval, gid, tag, pointer, serial, payload)
