"""Requests on the client endpoint: a window per destination, pending until answered, re-sent after a reconnection."""

# A request carries its id (`rid`) from construction and its reply echoes it,
# so replies are matched whatever order they come in.  A request stays in
# `pending` until its reply is taken: when the link to its destination fails
# and is rebuilt (the peer's next incarnation, dsm._reconnect), every pending
# request sent on the old link is sent again on the new one, and a reply to a
# request that was answered twice is dropped (nobody waits for it any more).

from __future__ import annotations

import logging
import math
from typing import NamedTuple, TypeVar

from ._errors import DsmError
from ._messages import NAMES, ErrorReply, Reply, Request, decode_reply
from ._net import UP, Endpoint
from ._stats import Counters

log = logging.getLogger("dsm")
_R = TypeVar("_R", bound=Reply)
WINDOW = 8  # requests in flight per destination
FETCH_TIMEOUT = 120.0


class Sent(NamedTuple):
    """Requests `RequestClient._send_many` sent: their ids in order, and what each one is (for a wait's error)."""

    rids: list[int]
    what: dict[int, str]


class RequestClient:
    """The program thread's side of request/response; `Memory` is one (it sets these attributes up)."""

    rank: int
    client: Endpoint
    counters: Counters
    rid: int
    replies: dict[int, Reply]
    pending: dict[int, tuple[int, Request, int]]
    reconnections_seen: int
    #: What the program thread waits for, while it does: ("lock", lock) in an acquire, ("barrier", epoch) in a
    #: barrier (its arrival sent, live or again after a replay), else None.  For plugins, in `dsm_waiting`.
    waiting_for: tuple[str, int] | None

    def _check(self, synchronising: str = "") -> None:
        raise NotImplementedError

    def _waiting(self, what: str) -> None:
        raise NotImplementedError

    def _next_rid(self) -> int:
        """A new request id (the reply echoes it); requests carry theirs from construction."""
        self.rid += 1
        return self.rid

    def _request(self, dst: int, msg: Request, expect: type[_R], what: str, timeout: float = FETCH_TIMEOUT) -> _R:
        return self._request_many([(dst, msg, what)], expect, timeout)[0]

    def _wait_for(self, kind: str, n: int, dst: int, request: Request, expect: type[_R]) -> _R:
        """Send `request` and wait for its reply as long as it takes (the slowest rank's computing, or a lock's
        holder), with `waiting_for` saying (kind, n) meanwhile."""
        self.waiting_for = (kind, n)
        try:
            return self._request(dst, request, expect, f"{kind} {n}", math.inf)
        finally:
            self.waiting_for = None

    def _request_many(
        self, requests: list[tuple[int, Request, str]], expect: type[_R], timeout: float = FETCH_TIMEOUT
    ) -> list[_R]:
        """Send requests (at most WINDOW in flight per destination) and return their replies, each an `expect`.

        Every reply is collected before an error reply raises, so none is left behind to
        be mistaken for a later request's.
        """
        return self._collect(self._send_many(requests, timeout), expect, timeout)

    def _send_many(self, requests: list[tuple[int, Request, str]], timeout: float = FETCH_TIMEOUT) -> Sent:
        """Send requests, at most WINDOW in flight per destination (waiting for the oldest replies beyond that);
        their replies are `_collect`ed later."""
        sent = Sent([], {})
        in_flight: dict[int, list[int]] = {}
        try:
            for dst, msg, what in requests:
                mine = in_flight.setdefault(dst, [])
                while len(mine) >= WINDOW:
                    self._await(mine[:1], sent.what[mine[0]], timeout)
                    mine[:] = [r for r in mine if r not in self.replies]
                self._send_request(dst, msg)
                sent.rids.append(msg.rid)
                sent.what[msg.rid] = what
                mine.append(msg.rid)
        except BaseException:
            self._give_up(sent.rids)
            raise
        return sent

    def _collect(self, sent: Sent, expect: type[_R], timeout: float = FETCH_TIMEOUT) -> list[_R]:
        """The replies to requests `_send_many` sent, each an `expect`, in their order (an error reply raises, once
        every reply is in)."""
        try:
            for rid in sent.rids:
                self._await([rid], sent.what[rid], timeout)
        except BaseException:
            self._give_up(sent.rids)
            raise
        replies = [self.replies.pop(rid) for rid in sent.rids]
        for reply in replies:
            if isinstance(reply, ErrorReply):
                raise DsmError(reply.message)
        checked: list[_R] = []
        for reply in replies:
            if not isinstance(reply, expect):
                raise DsmError(f"a {type(reply).__name__} answered a request that wants a {expect.__name__}")
            checked.append(reply)
        return checked

    def _give_up(self, rids: list[int]) -> None:
        """Requests nobody waits for any more: never sent again after a reconnection, nor kept if answered."""
        for rid in rids:
            self.pending.pop(rid, None)
            self.replies.pop(rid, None)

    def _send_request(self, dst: int, msg: Request) -> None:
        """Send a request and keep it pending until its reply: a link that fails under it gets it again."""
        link = self.client.link[dst]
        sent = self.client.send(dst, msg)
        self.pending[msg.rid] = (dst, msg, link if sent is not None else -1)
        if sent is not None:
            self.counters.count(NAMES[msg.kind], sent)

    def _await(self, rids: list[int], what: str, timeout: float) -> None:
        def done() -> bool:
            for _, raw, _, _ in self.client.inbox:
                msg = decode_reply(raw)
                # a reply nobody waits for answered a request that was sent again after a reconnection
                if self.pending.pop(msg.rid, None) is not None:
                    self.replies[msg.rid] = msg
            self.client.inbox.clear()
            self._check()
            if self.client.reconnections != self.reconnections_seen:
                self._resend()
            return all(rid in self.replies for rid in rids)

        try:
            self.client.wait(done, what, timeout=timeout, on_idle=lambda: self._waiting(what))
        except DsmError as exc:
            if type(exc) is not DsmError:  # a ReplayDiverged (raised by `_check`) keeps its type
                raise
            raise DsmError(f"{exc} ({self._diagnosis(rids)})") from None

    def _diagnosis(self, rids: list[int]) -> str:
        """Where the requests `rids` stand, for a wait that timed out: a request dropped on a link that was not up
        (never re-sent), or one sent on the current link whose reply never came (lost on the way, or never sent)."""
        parts = []
        for rid in rids:
            if rid in self.replies:
                continue
            dst, _, link = self.pending.get(rid, (-1, None, -2))
            if dst < 0:
                parts.append(f"request {rid}: no longer pending")
                continue
            sent = "not sent (its link was down)" if link < 0 else f"sent on link {link}"
            state = f"the link to rank {dst} is {self.client.state[dst]}, link {self.client.link[dst]}"
            parts.append(f"request {rid} {sent}; {state}")
        return "; ".join(parts) or "every reply came"

    def _resend(self) -> None:
        """Send again every pending request whose link was replaced since (now that it is up)."""
        self.reconnections_seen = self.client.reconnections
        for rid, (dst, msg, link) in list(self.pending.items()):
            if link != self.client.link[dst] and self.client.state[dst] == UP:
                self._send_request(dst, msg)
                log.info("rank %d: request %d re-sent to rank %d after its recovery", self.rank, rid, dst)
