"""The DSM's plugin contract: hooks fired by the HLRC protocol, for plugins such as remote logging.

They are added to the rank's plugin host (``rt.plugins``, the one ``ckpt.hookimpl``
plugins live in) through ``rt.plugins.add_hookspecs`` by the ``dsm`` plugin
(``CKPT_HOOKSPECS``), or by ``dsm.attach`` when that plugin is not loaded, and
fired through ``rt.plugins.call``: the contract's order (`ORDER`: every DSM hook
runs down, in registration order) and its error naming the failing plugin apply.
Implement them with ``@ckpt.hookimpl`` like any ckpt hook.  Whether a hook has
implementations is decided once, when the memory attaches (or is restored): a
plugin registered later is not called, except an object registered by a
`dsm_attached` implementation (remote logging registers one per memory, so a
job without logging pays nothing for the hooks it implements).

Threads: hooks marked *handler* run on the rank's protocol-handler thread, the
others on the program thread.  ``memory`` is the rank's :class:`dsm.Memory`;
pages are named by their global page id ``gid = (array_id << 32) | page_index``.
A hook must not block and must not call back into the DSM.  An exception
raised by a *handler* hook fails that one request: the requester gets a
DsmError carrying the host's ``plugin 'NAME' failed in HOOK: ...``, and the
handler serves on.  One raised on the program thread reaches the program as
that ``ckpt.PluginError``.  Under the ``onesided`` protocol the home's CPU
takes no part in page service or diff application, so ``dsm_diffs_received``,
``dsm_diff_received`` and ``dsm_diff_applied`` fire only under ``async``, and ``dsm_page_served``
only for the pages a lock grant carries (`Grant.pages`; under ``async``
also for every page request).
"""

from __future__ import annotations

from typing import Any

from ckpt.plugin import Direction, hookspec

from ._diff import Diff

Notices = list[tuple[int, int, list[int]]]  # (writer rank, interval, [gid, home, gid, home, ...])

#: Each hook's direction (read by the plugin host): all are notifications, in registration order.
ORDER: dict[str, Direction] = {
    "dsm_attached": "down",
    "dsm_interval_closing": "down",
    "dsm_barrier_arriving": "down",
    "dsm_lock_releasing": "down",
    "dsm_interval_closed": "down",
    "dsm_diff_created": "down",
    "dsm_diff_sent": "down",
    "dsm_diffs_received": "down",
    "dsm_diff_received": "down",
    "dsm_diff_applied": "down",
    "dsm_write_notices_received": "down",
    "dsm_page_served": "down",
    "dsm_lock_acquired": "down",
    "dsm_lock_released": "down",
    "dsm_barrier_passed": "down",
    "dsm_recovering": "down",
    "dsm_waiting": "down",
}


@hookspec
def dsm_attached(memory: Any) -> None:
    """`dsm.attach` is complete on this rank: every queue pair is connected, the handler runs.

    Collective (every rank fires it at the same point of ``dsm.attach``), so an implementation may
    call ``memory.rt.allgather`` -- e.g. to exchange the addresses of memory it registers with
    ``memory.pd`` -- and may set ``memory.twin_homes`` (diffs of this rank's own writes to pages it
    is home of: see `dsm_diff_created`) and ``memory.release_after_diffs`` (a release leaves only once
    its interval's diffs are applied at their homes, instead of with them), and keep state in
    ``memory.extensions[name]`` (pickled with the memory).  Not fired when a memory is restored from
    an image.
    """


@hookspec
def dsm_interval_closing(memory: Any, interval: int, release: int) -> None:
    """Interval `interval` is closing: its diffs are made (`dsm_diff_created`), none has left yet.

    The last moment before the interval's writes can reach any other rank: a plugin that must
    record them first (remote logging) does it here, on the program thread; it may use the
    memory's client endpoint (``memory.client.run``) for one-sided operations.  `release` is the
    lock whose release follows once the interval is closed (`dsm_lock_releasing` comes next), -1
    when the interval closes at an acquire or a barrier: a plugin may do the release's work here,
    together with the interval's.
    """


@hookspec
def dsm_barrier_arriving(memory: Any, epoch: int, notices: Notices) -> None:
    """This rank is about to send its arrival at barrier `epoch` with `notices` to the barrier manager (rank 0)."""


@hookspec
def dsm_lock_releasing(memory: Any, lock: int) -> None:
    """This rank is about to release `lock`: its interval is closed, the release is not sent yet."""


@hookspec
def dsm_interval_closed(memory: Any, interval: int, pages: list[int]) -> None:
    """This rank closed interval `interval` (at a release, an acquire or a barrier) having written `pages` (gids).

    At a release its diffs may still be on their way: they leave with the release request, after this hook,
    unless a plugin set ``memory.release_after_diffs`` (then they are applied at their homes already)."""


@hookspec
def dsm_diff_created(memory: Any, gid: int, home: int, interval: int, diff: Diff) -> None:
    """A diff of page `gid` against its twin, for its `home`: a `dsm.Diff`, whose iteration gives (offset, bytes)
    runs, `nbytes` their payload and `encode()` one bytes string (`dsm.Diff.decode` reverses it).

    With ``memory.twin_homes`` on, also for this rank's own writes to pages it is home of
    (``home == memory.rank``): those diffs are only reported, never sent.
    """


@hookspec
def dsm_diff_sent(memory: Any, gid: int, home: int, interval: int, nbytes: int) -> None:
    """The diff of page `gid` reached its home (acknowledged, or its RDMA WRITEs completed)."""


@hookspec
def dsm_diffs_received(memory: Any, writer: int, interval: int, diffs: list[tuple[int, Diff]]) -> None:
    """*handler*, async only: this rank received `writer`'s diffs for `interval` of pages it is the home of,
    ``(gid, diff)`` in the order they will be applied -- one message, before any of them is applied (then
    `dsm_diff_received` and `dsm_diff_applied` fire for each).  For work done once per message, such as one
    log record for all of them."""


@hookspec
def dsm_diff_received(memory: Any, writer: int, gid: int, interval: int, diff: Diff) -> None:
    """*handler*, async only: this rank, the home of `gid`, received `writer`'s diff for `interval`."""


@hookspec
def dsm_diff_applied(memory: Any, writer: int, gid: int, interval: int) -> None:
    """*handler*, async only: that diff is now in the home's copy of the page."""


@hookspec
def dsm_write_notices_received(memory: Any, source: str, notices: Notices) -> None:
    """New write notices (ones this rank did not know) arrived with a lock grant or a barrier (`source`)."""


@hookspec
def dsm_page_served(memory: Any, requester: int, gid: int) -> None:
    """*handler*: this rank, the page's home, serves page `gid` to `requester` (the reply leaves next): a page
    request (async), or a copy that rides with a lock grant this rank's handler sends (both protocols)."""


@hookspec
def dsm_lock_acquired(memory: Any, lock: int, seconds: float) -> None:
    """This rank holds lock `lock` (after waiting `seconds`); the grant's notices are already applied."""


@hookspec
def dsm_lock_released(memory: Any, lock: int) -> None:
    """This rank released lock `lock`; its diffs reached their homes first."""


@hookspec
def dsm_barrier_passed(memory: Any, epoch: int) -> None:
    """Every rank arrived at barrier number `epoch`; its write notices are applied here."""


@hookspec
def dsm_recovering(memory: Any, incarnation: int, reports: dict[int, dict[str, Any]]) -> None:
    """This process replaced a failed rank (incarnation `incarnation`, restored from its image): its
    links to every live rank are connected, and none of them may use this rank's memory yet.

    Fired once, on the recovered rank, in REFRESH (`dsm._reconnect`), before it publishes its
    ``ready`` keys: the survivors send nothing and write nothing here until every implementation
    returned, and this rank's handler has not started.  The place to rebuild what the image lacks
    (the master copies of this rank's home pages from the logs) and to start a replay
    (``memory.start_replay``).  ``reports``: each live peer's account, taken after the failure
    (``dsm._reconnect.survivor_report``): ``vt``, ``known`` (its write notices since the last
    barrier), ``held`` (locks homed here it holds: lock -> [token, vt at its grant]) and ``claims``
    (gids of pages it is home of whose default home is this rank).  Program thread of the
    recovered rank (parked); may use ``memory.client`` for one-sided operations and ``memory.rt``.
    """


@hookspec
def dsm_waiting(memory: Any, what: str) -> None:
    """The program thread has waited `WAKE` seconds (50 ms) with nothing arriving for a request of the DSM
    (`what`: a barrier, a lock acquire, an async page fetch, a diff's acknowledgment), and fires this again
    about every 50 ms while it waits.

    For work a plugin can do while the program is blocked -- remote logging passes a hole its last
    discard stopped at, which may be what the rank this one waits for is itself waiting for.  It may use
    ``memory.client`` for one-sided operations, as `dsm_interval_closing` may, but must not wait for the
    rank the DSM waits for.  Not fired while the memory replays, nor again from inside an implementation.
    An exception it raises ends the wait: the DSM call that waited raises it (a ``ckpt.PluginError``).
    """
