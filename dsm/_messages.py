"""The DSM's messages: their kinds (`Kind`) and one named type for each request and reply.

On the wire a message is its tuple as a msgpack array, the kind last: ``[rid, fields..., kind]``.
The request id `rid` is the requester's (`Memory._next_rid`), and the reply echoes it.
A write notice is ``[writer, interval, [gid, home, gid, home, ...]]``; a diff is its
encoding (`Diff.encode`).  Both ranks run the same code (an image restarts with the version that
wrote it), so the layout carries no version of its own.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

from ._errors import DsmError

#: A write notice as it travels: (writer rank, interval, [gid, home, gid, home, ...]).
Notice = list[Any]


class Kind(IntEnum):
    """What a message is: a request to a rank's protocol handler, or that handler's reply."""

    HOME = 1  # who is the home of a page (the first to ask claims it)
    PAGE = 2  # a page's contents, once the home's copy has every interval the requester needs
    DIFF = 3  # an interval's diffs of pages of one home, for the home to apply (one ack)
    ACQUIRE = 4  # a lock, at its home
    RELEASE = 5  # a lock given back, with the notices released through it
    BARRIER = 6  # arrival at a barrier, at rank 0
    OLD_PAGE = 7  # a page as it was at a vector timestamp (a recovering rank's replay, FT-KDSM §5)
    HOME_REPLY = 8
    PAGE_REPLY = 9
    ACK = 10  # a diff applied, a lock released
    GRANT = 11
    BARRIER_REPLY = 12
    ERROR = 15  # the request failed at the handler


class HomeRequest(NamedTuple):
    """Who is the home of page `gid`?  Sent to its default home."""

    rid: int
    gid: int
    kind: int = Kind.HOME


class PageRequest(NamedTuple):
    """Page `gid`, holding at least interval need[q] of every rank q."""

    rid: int
    gid: int
    need: list[int]
    kind: int = Kind.PAGE


class DiffRequest(NamedTuple):
    """Apply the writer's diffs of `interval` to pages `gids` (this rank is their home), one ack for all."""

    rid: int
    interval: int
    gids: list[int]
    diffs: list[bytes]  # Diff.encode() of each, in the order of `gids`
    kind: int = Kind.DIFF


class AcquireRequest(NamedTuple):
    """Grant `lock` to the requester, whose vector timestamp is `vt`."""

    rid: int
    lock: int
    vt: list[int]
    token: int  # the requester's acquire count (`Memory.acquires`): names this acquisition in its release
    kind: int = Kind.ACQUIRE


class ReleaseRequest(NamedTuple):
    """The requester gives `lock` back at vector timestamp `vt`, with the `notices` it releases."""

    rid: int
    lock: int
    vt: list[int]
    notices: list[Notice]
    token: int  # the token of the acquisition it ends: a release sent again after a recovery is told apart
    kind: int = Kind.RELEASE


class BarrierRequest(NamedTuple):
    """The requester arrived at barrier number `epoch` with vector timestamp `vt` and its `notices`."""

    rid: int
    epoch: int
    vt: list[int]
    notices: list[Notice]
    kind: int = Kind.BARRIER


class OldPageRequest(NamedTuple):
    """Page `gid` holding exactly the intervals (q, i) with i <= vt[q] (its *minimal version*, FT-KDSM §5).

    Asked by a rank replaying its logs; the home regenerates it from its base copy and its home diff
    log (``Memory.versions``), under either protocol, and answers with a PageReply.
    """

    rid: int
    gid: int
    vt: list[int]
    kind: int = Kind.OLD_PAGE


class HomeReply(NamedTuple):
    """Page's home rank."""

    rid: int
    home: int
    kind: int = Kind.HOME_REPLY


class PageReply(NamedTuple):
    """The page's bytes."""

    rid: int
    data: bytes
    kind: int = Kind.PAGE_REPLY


class Ack(NamedTuple):
    """Done: the diff is in the home's copy, or the lock is released."""

    rid: int
    kind: int = Kind.ACK


class Grant(NamedTuple):
    """The lock is the requester's: the lock's vector timestamp and the notices it has not seen.

    `pages`: copies of pages those notices name that the lock's home also homes, ``[gid, applied, bytes]``
    each (`applied`: the copy's applied columns), so that the grantee need not fetch them (`Handler._riders`).
    """

    rid: int
    vt: list[int]
    notices: list[Notice]
    pages: list[list[Any]] = []  # a NamedTuple default: never mutated
    kind: int = Kind.GRANT


class BarrierReply(NamedTuple):
    """Everyone arrived: the element-wise maximum of the vector timestamps and the union of the notices."""

    rid: int
    vt: list[int]
    notices: list[Notice]
    kind: int = Kind.BARRIER_REPLY


class ErrorReply(NamedTuple):
    """The request failed at the handler; `message` says why (and names the rank)."""

    rid: int
    message: str
    kind: int = Kind.ERROR


Request = HomeRequest | PageRequest | DiffRequest | AcquireRequest | ReleaseRequest | BarrierRequest | OldPageRequest
Reply = HomeReply | PageReply | Ack | Grant | BarrierReply | ErrorReply
Message = Request | Reply

_TYPES: dict[int, Any] = {
    Kind.HOME: HomeRequest,
    Kind.PAGE: PageRequest,
    Kind.DIFF: DiffRequest,
    Kind.ACQUIRE: AcquireRequest,
    Kind.RELEASE: ReleaseRequest,
    Kind.BARRIER: BarrierRequest,
    Kind.OLD_PAGE: OldPageRequest,
    Kind.HOME_REPLY: HomeReply,
    Kind.PAGE_REPLY: PageReply,
    Kind.ACK: Ack,
    Kind.GRANT: Grant,
    Kind.BARRIER_REPLY: BarrierReply,
    Kind.ERROR: ErrorReply,
}
_REPLIES = (HomeReply, PageReply, Ack, Grant, BarrierReply, ErrorReply)  # a tuple: isinstance is fastest with one
#: The name a message is counted under in the statistics, by kind ("home", "page", ...).
NAMES = {kind.value: kind.name.lower() for kind in Kind}


def decode(raw: Any) -> Message:
    """The typed message of a msgpack array as received; DsmError for anything else."""
    try:
        cls = _TYPES[raw[-1]]
        message: Message = cls._make(raw)
    except (KeyError, TypeError, IndexError):
        raise DsmError(f"malformed DSM message {str(raw)[:80]}") from None
    return message


def decode_reply(raw: Any) -> Reply:
    """`decode` for the requester's side: only a reply may come back."""
    message = decode(raw)
    if not isinstance(message, _REPLIES):
        raise DsmError(f"a {type(message).__name__} came back where a reply was due")
    return message
