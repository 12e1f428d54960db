"""DSM messages: every kind round-trips the wire as its named type; anything else is one clear DsmError."""

from __future__ import annotations

from typing import Any

import pytest

from dsm import Diff, DsmError
from dsm._messages import (
    NAMES,
    Ack,
    AcquireRequest,
    BarrierReply,
    BarrierRequest,
    DiffRequest,
    ErrorReply,
    Grant,
    HomeReply,
    HomeRequest,
    Kind,
    Message,
    OldPageRequest,
    PageReply,
    PageRequest,
    ReleaseRequest,
    decode,
    decode_reply,
)
from dsm._net import pack, unpack

NOTICES = [[1, 3, [0x100000002, 1]]]
MESSAGES: list[Message] = [
    HomeRequest(7, 0x100000002),
    PageRequest(7, 2, [0, 3, 1]),
    DiffRequest(7, 4, [2, 0x100000003], [Diff.of_runs([(0, b"\x01\x02"), (64, b"\xff")]).encode(), b""]),
    AcquireRequest(7, 1, [0, 3, 1], 2),
    OldPageRequest(7, 0x100000002, [0, 3, 1]),
    ReleaseRequest(7, 1, [0, 3, 1], NOTICES, 2),
    BarrierRequest(7, 2, [0, 3, 1], NOTICES),
    HomeReply(7, 1),
    PageReply(7, bytes(range(256)) * 16),
    Ack(7),
    Grant(7, [0, 3, 1], NOTICES),
    BarrierReply(7, [0, 3, 1], NOTICES),
    ErrorReply(7, "rank 1: no page 9 in shared array 0"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_as_its_own_type(message: Message) -> None:
    back = decode(unpack(pack(message)))
    assert type(back) is type(message) and back == message
    assert back.kind == message.kind and back.rid == 7


def test_every_kind_has_one_message_type() -> None:
    assert sorted(m.kind for m in MESSAGES) == sorted(Kind)
    # the statistics count requests under these names (docs/dsm.md, Statistics.messages)
    assert [NAMES[k] for k in (Kind.HOME, Kind.PAGE, Kind.DIFF, Kind.ACQUIRE, Kind.RELEASE, Kind.BARRIER)] == [
        "home",
        "page",
        "diff",
        "acquire",
        "release",
        "barrier",
    ]


@pytest.mark.parametrize(
    "raw",
    [[], [7, 2], [7, 2, 99], [7, 1, 2, [3], Kind.HOME], "text", [7, [1]], None],
    ids=["empty", "too-short", "unknown-kind", "too-long", "not-a-list", "unhashable-kind", "none"],
)
def test_a_malformed_message_is_one_dsm_error(raw: Any) -> None:
    with pytest.raises(DsmError, match="malformed DSM message"):
        decode(raw)


def test_a_request_where_a_reply_is_due_is_refused() -> None:
    with pytest.raises(DsmError, match="a PageRequest came back where a reply was due"):
        decode_reply(unpack(pack(PageRequest(7, 2, [0]))))
    assert decode_reply(unpack(pack(Ack(7)))) == Ack(7)
