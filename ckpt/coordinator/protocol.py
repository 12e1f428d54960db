"""The coordinator's operations: every request a rank or a control client may send, as one typed definition."""

# Why typed: the coordinator is reachable over TCP and a request's fields used
# to be checked one by one in each handler (and some not at all).  Here each
# operation is a msgspec.Struct whose fields say what the request carries;
# parse_request() turns a frame (already framed, versioned and authenticated
# by ckpt._wire) into that Struct or raises ProtocolError naming the op and
# the field, and the server's dispatch table is derived from Op, so an
# operation cannot be added here without a handler there (server.py checks at
# import).  The framing, the handshake and the heartbeats are not the
# coordinator's own: they live in ckpt._wire, which the subnet manager of
# ckpt.verbs speaks too.
#
# The other direction is typed the same way: the pushes the coordinator sends a
# rank unasked (suspend, abort, kill, done, rank_failed, rank_recovered) are Structs too, built by the job
# and decoded by the rank with parse_push().
#
# Unknown fields are ignored (a newer client may send more); a missing
# required field, a field of the wrong type or out of its range, an unknown op,
# or a rank's op on a control connection is a ProtocolError: the server
# answers it with an error reply and closes that one connection.

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final

import msgspec

from ckpt._errors import ProtocolError
from ckpt._wire import Message

#: The longest a `subscribe` may wait (s): a week; longer is a mistake, not a plan.
MAX_SUBSCRIBE_TIMEOUT: Final = 7 * 24 * 3600.0

ROLE_RANK: Final = "rank"
ROLE_CONTROL: Final = "control"
ROLES: Final = (ROLE_RANK, ROLE_CONTROL)


class Op(enum.StrEnum):
    """Every operation a peer may send to the coordinator (the wire's "op")."""

    # a rank's key-value store
    PUBLISH = "publish"
    GET = "get"
    SUBSCRIBE = "subscribe"
    ATOMIC = "atomic"
    ALLOC_IDS = "alloc_ids"
    # a rank's part in the job
    COLLECTIVE = "collective"
    BARRIER = "barrier"
    STEP = "step"
    FINISHED = "finished"
    FATAL = "fatal"
    ABORT_CHECKPOINT = "abort_checkpoint"
    PROGRESS = "progress"
    FALL_BACK = "fall_back"
    HOLD_CHECKPOINTS = "hold_checkpoints"
    RELEASE_CHECKPOINTS = "release_checkpoints"
    # control (`ckpt status / checkpoint / kill`); a rank may send these too
    STATUS = "status"
    CHECKPOINT = "checkpoint"
    KILL = "kill"


class Request(msgspec.Struct, tag_field="op", kw_only=True, frozen=True):
    """What every request carries: `id`, echoed in the reply (absent for a notification)."""

    #: May a control connection send it? (A rank may send every operation.)
    control: ClassVar[bool] = False
    id: int | None = None


class Publish(Request, tag=Op.PUBLISH.value, frozen=True):
    ns: str
    key: str
    value: Any = None


class Get(Request, tag=Op.GET.value, frozen=True):
    ns: str
    key: str


class Subscribe(Request, tag=Op.SUBSCRIBE.value, frozen=True):
    """Wait for `count` keys of `ns` (under the prefix `key` if `prefix`) for at most `timeout` s."""

    ns: str
    key: str
    timeout: Annotated[float, msgspec.Meta(ge=0, le=MAX_SUBSCRIBE_TIMEOUT)]
    prefix: bool = False
    count: int = 1


class Atomic(Request, tag=Op.ATOMIC.value, frozen=True):
    """An atomic read-modify-write of an integer; `kind` is checked by the store (incrby, min, max)."""

    kind: str
    ns: str
    key: str
    operand: int


class AllocIds(Request, tag=Op.ALLOC_IDS.value, frozen=True):
    ns: str
    count: Annotated[int, msgspec.Meta(ge=1)]


class Collective(Request, tag=Op.COLLECTIVE.value, frozen=True):
    seq: int
    kind: str
    step: int
    data: Any = None


class Barrier(Request, tag=Op.BARRIER.value, frozen=True):
    name: str
    value: Any = None


class Step(Request, tag=Op.STEP.value, frozen=True):
    """A notification (no reply): the rank's program reached `step`."""

    step: int


class Finished(Request, tag=Op.FINISHED.value, frozen=True):
    step: int
    result: Any = None


class Fatal(Request, tag=Op.FATAL.value, frozen=True):
    error: str = ""
    traceback: str = ""


class AbortCheckpoint(Request, tag=Op.ABORT_CHECKPOINT.value, frozen=True):
    number: int
    reason: str = ""


class Progress(Request, tag=Op.PROGRESS.value, frozen=True):
    """A notification (no reply): image bytes loaded so far by a restarting rank."""

    done: int
    total: int


class FallBack(Request, tag=Op.FALL_BACK.value, frozen=True):
    """The rank cannot be recovered alone (`reason`): restart the whole job from its last coordinated
    checkpoint (``rt.fall_back``); the rank waits to be stopped."""

    reason: str


class HoldCheckpoints(Request, tag=Op.HOLD_CHECKPOINTS.value, frozen=True):
    """Checkpoints of any kind wait until this rank sends `release_checkpoints` (``rt.hold_checkpoints``)."""

    reason: str


class ReleaseCheckpoints(Request, tag=Op.RELEASE_CHECKPOINTS.value, frozen=True):
    """End this rank's hold (``rt.release_checkpoints``): queued checkpoints go ahead."""


class Status(Request, tag=Op.STATUS.value, frozen=True):
    control: ClassVar[bool] = True


class Checkpoint(Request, tag=Op.CHECKPOINT.value, frozen=True):
    """Checkpoint now; with `wait`, reply once it is written; with `kill`, end the job after it.

    With `rank`, an independent checkpoint of that rank alone (the others keep running); `kill`
    cannot go with it (the job's coordinated checkpoints are the only whole-job restart points).
    """

    control: ClassVar[bool] = True
    wait: bool = False
    kill: bool = False
    rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Kill(Request, tag=Op.KILL.value, frozen=True):
    control: ClassVar[bool] = True
    reason: str = ""


#: The one definition of the operations: each op and the Struct of its request.
REQUESTS: Final[Mapping[Op, type[Request]]] = {
    Op.PUBLISH: Publish,
    Op.GET: Get,
    Op.SUBSCRIBE: Subscribe,
    Op.ATOMIC: Atomic,
    Op.ALLOC_IDS: AllocIds,
    Op.COLLECTIVE: Collective,
    Op.BARRIER: Barrier,
    Op.STEP: Step,
    Op.FINISHED: Finished,
    Op.FATAL: Fatal,
    Op.ABORT_CHECKPOINT: AbortCheckpoint,
    Op.PROGRESS: Progress,
    Op.FALL_BACK: FallBack,
    Op.HOLD_CHECKPOINTS: HoldCheckpoints,
    Op.RELEASE_CHECKPOINTS: ReleaseCheckpoints,
    Op.STATUS: Status,
    Op.CHECKPOINT: Checkpoint,
    Op.KILL: Kill,
}
_BY_NAME: Final[Mapping[str, type[Request]]] = {op.value: kind for op, kind in REQUESTS.items()}
#: The op names, as a client checks them before sending.
OPS: Final = frozenset(_BY_NAME)


def parse_request(message: Message, role: str) -> Request:
    """The typed request in `message` from a `role` connection; ProtocolError naming the op otherwise."""
    op = message["op"]
    kind = _BY_NAME.get(op)
    if kind is None or (role == ROLE_CONTROL and not kind.control):
        raise ProtocolError(f"unknown op {op!r} for a {role} connection")
    try:
        return msgspec.convert(message, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"op {op!r}: {exc}") from None


class Join(msgspec.Struct, frozen=True):
    """What a rank says about itself in its first frame after the hello; the job checks the rest."""

    rank: int
    size: int


def parse_join(message: Message) -> Join:
    """The checked fields of a rank's `join`; ProtocolError if it is not one."""
    if message["op"] != "join":
        raise ProtocolError(f"expected the rank's join, got {message['op']!r}")
    try:
        return msgspec.convert(message, Join, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"join: {exc}") from None


# ----------------------------------------------------------- pushes: coordinator -> rank, unasked
class Push(msgspec.Struct, tag_field="op", kw_only=True, frozen=True):
    """What the coordinator tells a rank without being asked (no id, no reply)."""


class Suspend(Push, tag="suspend", frozen=True):
    """Checkpoint `number` has started: the rank's checkpoint thread walks its phases.

    `independent`: checkpoint `number` is this rank's alone (its barriers are in the scope
    ``Phase.rank_scope(rank, f"ckpt{number}")``, its target boundary its own reach).
    """

    number: int
    independent: bool = False


class Abort(Push, tag="abort", frozen=True):
    """Checkpoint `number` is aborted (`reason`): the rank resumes with ckpt_resume(aborted=True)."""

    number: int
    reason: str = ""


class KillRank(Push, tag="kill", frozen=True):
    """The job is killed (`ckpt kill`, a failed rank): the rank exits at once."""

    reason: str = ""


class Done(Push, tag="done", frozen=True):
    """Every rank has finished: the rank runs ckpt_exit and exits."""


class RankFailed(Push, tag="rank_failed", frozen=True):
    """Rank `rank` (its incarnation `incarnation`) was lost and the job runs on (``--on-failure recover``):
    the survivor runs ckpt_rank_failed."""

    rank: int
    incarnation: int


class RankRecovered(Push, tag="rank_recovered", frozen=True):
    """Rank `rank`'s new incarnation `incarnation` completed its RESTART phase: the survivor runs
    ckpt_rank_recovered."""

    rank: int
    incarnation: int


def push_message(push: Push) -> Message:
    """The frame of `push` (its "op" is the Struct's tag)."""
    return msgspec.to_builtins(push)  # type: ignore[no-any-return]


def parse_push(message: Message) -> Push:
    """The typed push in `message`; ProtocolError naming the op if it is none or does not fit."""
    try:
        return msgspec.convert(message, Suspend | Abort | KillRank | Done | RankFailed | RankRecovered, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"push {message.get('op')!r}: {exc}") from None
