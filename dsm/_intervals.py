"""Intervals: closing one (diffs to the homes, its write notices), and taking the notices of others."""

# Rationale (HLRC, docs/dsm.md).  An interval ends at every synchronisation: the
# diffs of the pages it wrote go to their homes, and its write notices join what
# the rank knows under its vector timestamp.  Notices from others (a lock grant,
# a barrier's reply) invalidate the pages they name, unless this rank is their
# home, and raise the version the next fetch must find there.
#
# A release leaves *with* its interval's diffs (the release request goes out
# behind them, and the releaser waits for every ack at once), not after their
# acks: a round trip less in every critical section that writes a page homed
# elsewhere.  So the lock's next grant may reach a rank before those diffs reach
# their home.  Nothing is read early for that: a requester's page fetch asks for
# the intervals its notices name and the home (async: its handler; onesided:
# the ARDMAR's version check) answers only once it holds them; and a grantee that
# *is* the home of a page the notices name waits until its own copy holds the
# interval (`_await_diffs`).  A barrier's notices never need that wait: every
# rank's diffs were applied before it arrived.  A plugin whose recovery assumes
# a logged interval's diffs are at their homes once its release is out (remote
# logging) sets ``memory.release_after_diffs``, and releases wait as before.

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import _onesided, _replay
from ._diff import Diff, make_diff, make_diffs
from ._errors import DsmError
from ._messages import Ack, DiffRequest, Notice, Request
from ._net import UP
from ._region import INVALID, VALID, Region, gid_of, split_gid
from ._requests import FETCH_TIMEOUT, RequestClient

if TYPE_CHECKING:
    from ._memory import Memory

log = logging.getLogger("dsm")
#: An interval's diffs by home, and its number: what a deferred close leaves to send (`Intervals._close_interval`).
Outgoing = tuple[dict[int, list[tuple[Region, int, Diff]]], int]


class Intervals(RequestClient):
    """The interval machinery of `Memory` (which sets these attributes up)."""

    protocol: str
    regions: list[Region]
    vt: list[int]
    known: dict[tuple[int, int], list[int]]
    dirty: set[int]

    def hook(self, name: str, **kwargs: Any) -> None:
        raise NotImplementedError

    @property
    def memory(self) -> Memory:
        """This object as the `Memory` it is part of (what `_replay` and `_onesided` take)."""
        return cast("Memory", self)

    def _close_interval(self, release: int = -1, defer: bool = False) -> Outgoing | None:
        """End the current interval: diffs to their homes, then this interval's write notices.

        `release`: the lock whose release follows (-1: none; `dsm_interval_closing`).  While replaying, the
        diffs are made (they say which pages the interval wrote) and never sent.  `defer`: they are not sent
        here but returned, for the caller to send with the release (`_send_diffs`); None when nothing is.
        """
        if not self.dirty:
            return None
        interval = self.vt[self.rank] + 1
        replaying = _replay.replaying(self.memory)
        written: list[int] = []
        own: list[tuple[Region, int]] = []
        outgoing: dict[int, list[tuple[Region, int, Diff]]] = {}
        diffs = self._diffs()
        for gid in sorted(self.dirty):
            aid, page = split_gid(gid)
            region = self.regions[aid]
            region.state[page] = VALID
            home = int(region.home[page])
            diff = diffs.get(gid)  # None: a home page not twinned (twin_homes off)
            region.twins.pop(page, None)  # here, not in `_diffs`: a hook that fails leaves the rest twinned
            if home == self.rank:
                if diff is not None and not diff:
                    # unchanged, as its twin shows: no notice, as for a page homed elsewhere (with remote
                    # logging, a notice without a logged diff would name an interval a rebuilt copy lacks)
                    continue
                own.append((region, page))
                written += [gid, home]
                if diff:
                    self.hook("dsm_diff_created", gid=gid, home=home, interval=interval, diff=diff)
                continue
            if diff is None:
                raise DsmError(f"page {gid:#x} of home {home} was written without a twin")
            if not diff:
                continue
            written += [gid, home]
            outgoing.setdefault(home, []).append((region, page, diff))
            self.counters.diffs += 1
            self.counters.diff_bytes += diff.nbytes
            self.hook("dsm_diff_created", gid=gid, home=home, interval=interval, diff=diff)
        self.dirty.clear()
        if not written:
            return None
        links = {home: self.client.link[home] for home in outgoing}
        defer = defer and bool(outgoing) and not replaying
        if not replaying:
            self.hook("dsm_interval_closing", interval=interval, release=release)
            if not defer:
                started = time.perf_counter()
                self._send_diffs(outgoing, interval)
                self.counters.flush_seconds += time.perf_counter() - started
            for region, page in own:
                # max: a recovered rank's rebuilt master may hold this interval already (re-executed live)
                region.meta[page, self.rank] = max(int(region.meta[page, self.rank]), interval)
        # else replayed: its log shows it complete, so its diffs are in the homes' copies already (a later
        # writer's may be too: sending them again could undo it)
        self.vt[self.rank] = interval
        self.known[(self.rank, interval)] = written
        self.counters.intervals += 1
        self.hook("dsm_interval_closed", interval=interval, pages=written[::2])
        if defer:
            return outgoing, interval
        if not replaying:
            self._send_again(outgoing, links, interval)
        return None

    def _diffs(self) -> dict[int, Diff]:
        """The diff of every dirty page that has a twin, by gid: one `make_diffs` per region."""
        twinned: dict[int, list[int]] = {}
        for gid in self.dirty:
            aid, page = split_gid(gid)
            if page in self.regions[aid].twins:
                twinned.setdefault(aid, []).append(page)
        diffs: dict[int, Diff] = {}
        for aid, pages in twinned.items():
            region = self.regions[aid]
            if len(pages) == 1:  # most intervals of a lock-based program: no copies to gather them
                (page,) = pages
                diffs[gid_of(aid, page)] = make_diff(region.program_page(page), region.twins[page], region.unit)
                continue
            current = region.local.reshape(region.npages, region.page_size)[pages]
            twins = np.stack([region.twins[page] for page in pages])
            for page, diff in zip(pages, make_diffs(current, twins, region.unit), strict=True):
                diffs[gid_of(aid, page)] = diff
        return diffs

    def _send_again(
        self, outgoing: dict[int, list[tuple[Region, int, Diff]]], links: dict[int, int], interval: int
    ) -> None:
        """Send an interval's diffs again to every home that failed since they were first sent.

        Such a home may have applied (and acked) a diff while its record at the home's log home,
        completed only now (the `dsm_interval_closed` hooks), was not yet there when the home's next
        incarnation read its log to rebuild its copies -- the diff would be lost.  A survivor's link
        to a recovered rank is replaced (`Endpoint.attach`) before that rank reads its log, so an
        unchanged link here means the log is read after this interval's records.  A diff applied
        twice is harmless: it holds absolute bytes, and no later writer can have touched them.
        """
        again = {
            h: items for h, items in outgoing.items() if self.client.link[h] != links[h] or self.client.state[h] != UP
        }
        if again:
            log.info(
                "rank %d: interval %d's diffs sent again to recovered rank(s) %s", self.rank, interval, sorted(again)
            )
            self._send_diffs(again, interval)

    def _send_diffs(
        self,
        outgoing: dict[int, list[tuple[Region, int, Diff]]],
        interval: int,
        then: tuple[int, Request, str] | None = None,
    ) -> None:
        """Send an interval's diffs to their homes and wait until they are applied; with `then` (a release,
        acked like a diff), that request too, not waiting for the diffs before it leaves."""
        after = [then] if then is not None else []
        if self.protocol == "async":
            requests: list[tuple[int, Request, str]] = [  # one message per home: its pages' diffs, one ack
                (
                    home,
                    DiffRequest(
                        self._next_rid(),
                        interval,
                        [gid_of(region.aid, page) for region, page, _ in items],
                        [diff.encode() for _, _, diff in items],
                    ),
                    f"diff ack from rank {home}",
                )
                for home, items in outgoing.items()
            ]
            self._request_many(requests + after, Ack)
        else:
            sent = self._send_many(after)
            try:
                _onesided.draw(self.memory, outgoing, interval)
            except BaseException:
                self._give_up(sent.rids)  # the release is not waited for: never sent again, nor kept if answered
                raise
            self._collect(sent, Ack)
        for home, items in outgoing.items():
            for region, page, diff in items:
                self.hook(
                    "dsm_diff_sent", gid=gid_of(region.aid, page), home=home, interval=interval, nbytes=diff.nbytes
                )

    def _merge(self, vt: list[int], notices: list[Notice], source: str, overtaken: bool = False) -> None:
        """Take write notices this rank has not seen: invalidate those pages, raise what their fetch needs.

        `overtaken`: the notices may have come before the diffs they name (a live grant): those for pages homed
        here are waited for.  (A barrier's never are: each rank's diffs were applied before it arrived.)
        """
        fresh = []
        mine: list[tuple[Region, int, int, int]] = []  # pages homed here the notices name: (region, page, q, i)
        for q, i, flat in notices:
            if q == self.rank or i <= self.vt[q] or (q, i) in self.known:
                continue
            self.known[(q, i)] = flat
            fresh.append((q, i, flat))
            for k in range(0, len(flat), 2):
                aid, page = split_gid(flat[k])
                region, home = self.regions[aid], flat[k + 1]
                region.home[page] = home
                if home != self.rank:
                    region.state[page] = INVALID
                    region.need[page, q] = max(int(region.need[page, q]), i)
                elif overtaken:
                    mine.append((region, page, q, i))
        if mine:
            self._await_diffs(mine, source)
        self.vt = [max(a, b) for a, b in zip(self.vt, vt, strict=True)]
        if fresh:
            self.counters.write_notices_received += len(fresh)
            self.hook("dsm_write_notices_received", source=source, notices=fresh)

    def _take_riders(self, pages: list[list[Any]]) -> None:
        """Install the page copies a grant carried (`Grant.pages`) that this rank's notices left invalid, when the
        copy holds every interval this rank needs of the page (else the fault fetches it, as always)."""
        for gid, applied, data in pages:
            aid, page = split_gid(gid)
            region = self.regions[aid]
            if region.state[page] == INVALID and bool(np.all(np.asarray(applied) >= region.need[page])):
                region.program_page(page)[:] = np.frombuffer(data, dtype=np.uint8)
                region.state[page] = VALID
                self.counters.grant_pages += 1

    def _await_diffs(self, pages: list[tuple[Region, int, int, int]], source: str) -> None:
        """Wait until this home's copy of each page holds the interval a notice names: a release leaves with its
        diffs (`release`), so a grant can arrive before them (`_page` and `ardmar` wait alike for a requester).

        They are on their way (the writer waits for their acks before its release returns), applied by this
        rank's handler (async) or written into the page by the writer (onesided): nothing signals this thread,
        so it looks at the page's columns, backing off from 10 µs to 1 ms.
        """
        deadline, pause, counted = time.monotonic() + FETCH_TIMEOUT, 1e-5, False
        while True:
            late = [(r, p, q, i) for r, p, q, i in pages if int(r.meta[p, q]) < i]  # < 0: a DRAW in progress
            if not late:
                return
            if not counted:
                self.counters.diff_waits += 1
                counted = True
            if time.monotonic() > deadline:
                region, page, q, i = late[0]
                raise DsmError(
                    f"page {gid_of(region.aid, page):#x} (homed here): interval {i} of rank {q}, named by {source}, "
                    f"did not arrive within {FETCH_TIMEOUT:.0f} s"
                )
            self._check()
            time.sleep(pause)  # polling this rank's own memory, which a remote writer changes
            pause = min(2 * pause, 1e-3)
            pages = late
