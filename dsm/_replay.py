"""Recovery by replay (FT-KDSM §5): what a recovering rank's DSM asks of its log, and its replay mode."""

# Rationale.  A rank respawned from its image re-executes what it did since; the other ranks ran
# on.  Everything it received then -- grants, barrier replies, page contents -- must be what it
# received the first time, or its re-execution diverges from what the survivors already saw.  The
# log (ckpt_remotelog, at the rank's log home) holds its synchronisation in program order; the
# homes hold, from their base copies and home diff logs, every page as it was at any vector
# timestamp since the last coordinated checkpoint (its *minimal version*).  The contract between
# the DSM and the plugin that keeps the logs is the two protocols below; the DSM's replay mode
# (`Memory.start_replay`) consumes them.
#
# Invariant of the log (what makes the end of the replay the end of the rank's influence): every
# operation of a rank that another rank can observe -- a release, a barrier arrival -- has its
# record committed at the log home before it leaves, and every operation that depends on what the
# rank received -- the return of an acquire, of a barrier -- has its record committed before an
# interval that depends on it completes.  So once the last logged operation is replayed, nothing
# in any home's copy happened after the rank's current point: from there on it runs live.

from __future__ import annotations

from typing import Any, Protocol

from ._messages import Notice

Runs = list[tuple[int, bytes]]


class Replay(Protocol):
    """A recovering rank's logged operations, consumed in program order (built by ckpt_remotelog).

    Each call names the operation the re-executing program is at; if the log's next operation
    is another one, the re-execution diverged (the program is not deterministic given its DSM
    inputs) and the call raises `dsm.ReplayDiverged`.  Once every logged operation is consumed,
    `done` is True and the calls are not made any more.
    """

    @property
    def done(self) -> bool:
        """Every logged operation has been replayed."""
        ...

    def progress(self) -> tuple[int, int]:
        """(operations replayed, operations logged)."""
        ...

    def acquire(self, lock: int, token: int) -> tuple[list[int], list[Notice]] | None:
        """The logged grant of acquisition `token` of `lock`: (the rank's vector timestamp after it,
        the write notices it received); None when it is not logged (the acquire goes live)."""
        ...

    def release(self, lock: int, token: int) -> bool:
        """True: the log shows this release done at the lock's home (nothing is sent).  False: it was
        logged last, so it may not have reached the home: send it (the home ignores a duplicate)."""
        ...

    def arrive(self, epoch: int) -> bool:
        """True: the log shows this rank's arrival at barrier `epoch` (its notices reached the manager)."""
        ...

    def barrier(self, epoch: int) -> tuple[list[int], list[Notice]] | None:
        """The logged exit of barrier `epoch`: (vector timestamp after it, the notices received); None
        when not logged (the arrival goes live; the manager answers a repeated arrival)."""
        ...

    def home_diffs(self, vt: list[int]) -> list[tuple[int, Runs]]:
        """(gid, runs) of the logged diffs to this rank's own home pages, by other writers, that `vt`
        now covers (interval <= vt[writer]) and that were not returned before, in log order: what the
        program's view of its home pages must show from here on."""
        ...


class PageVersions(Protocol):
    """A home's page history since the last coordinated checkpoint (``Memory.versions``, set by ckpt_remotelog)."""

    def page(self, gid: int, vt: list[int]) -> bytes:
        """Page `gid` (this rank is its home) holding the intervals (q, i) with i <= vt[q]: the base copy
        of the last coordinated checkpoint with the home diff log's diffs that `vt` covers, in log order."""
        ...


def as_notices(notices: list[Any]) -> list[Notice]:
    return [[int(q), int(i), list(flat)] for q, i, flat in notices]
