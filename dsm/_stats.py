"""What one rank's DSM did: counters kept while it runs, and the frozen snapshot `Memory.statistics()` returns."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Statistics:
    """One rank's DSM activity since `dsm.attach` (times in seconds, wall clock).

    The breakdown: ``page_seconds`` (faults waiting for pages), ``wait_seconds``
    (barriers, and diff propagation at barriers and acquires, and at releases
    when a plugin wants them after their diffs), ``lock_seconds`` (waiting for
    grants, and releases, with the diffs a release takes along), and
    ``compute_seconds``: the rest of the rank's time.
    """

    protocol: str
    rank: int
    read_faults: int
    write_faults: int
    twins: int
    diffs: int
    diff_bytes: int
    intervals: int
    home_lookups: int
    homes_taken: int
    page_fetches: int
    page_fetch_seconds: float
    fetch_retries: int
    diff_waits: int
    grant_pages: int
    pages_served: int
    diffs_applied: int
    write_notices_received: int
    lock_acquires: int
    lock_seconds: float
    barriers: int
    barrier_seconds: float
    flush_seconds: float
    messages: dict[str, int]
    message_bytes: dict[str, int]
    total_seconds: float
    page_seconds: float
    wait_seconds: float
    compute_seconds: float
    fetch_rounds: int = 0  # rounds of page fetching: one per fault, or one for all the invalid pages of one access
    # remote / stable logging (plugins/ckpt_remotelog): 0 without it
    log_records: int = 0  # records this rank logged (remote logging: into log rings by RDMA; a home's own, by the CPU)
    log_bytes: int = 0
    log_seconds: float = 0.0  # time spent logging (remote and stable)
    log_full_waits: int = 0  # records that waited for room in a full ring
    log_full_checkpoints: int = 0  # checkpoints asked for because a ring crossed its high-water mark
    log_discard_retries: int = 0  # tries to pass the hole a discard of this rank's log ring stopped at
    stable_records: int = 0  # records appended to this rank's stable log file
    stable_bytes: int = 0
    stable_fsyncs: int = 0
    # recovery by replay (FT-KDSM §5): 0 unless this rank replayed its logs, or served a replaying rank
    replayed_acquires: int = 0  # lock acquires answered from the log (no message to the lock's home)
    replayed_releases: int = 0  # releases the log shows were done (nothing sent)
    replayed_barriers: int = 0  # barriers answered from the log (no message to the barrier manager)
    regenerated_pages: int = 0  # minimal-version pages this rank used while replaying
    versions_served: int = 0  # minimal-version pages this rank, a home, regenerated for a replaying rank
    replay_seconds: float = 0.0  # from the start of the replay to its last logged operation
    replay_operations: int = 0  # logged operations its replays started with (acquires, releases, arrivals, exits)
    # the cashmere protocol (dsm._cashmere): 0 under the others
    directory_ops: int = 0  # directory entries locked, changed and written back (joins, releases, drops)
    notices_sent: int = 0  # write notices appended to other ranks' lists
    notices_processed: int = 0  # write notices taken from this rank's own list at acquires
    self_invalidations: int = 0  # copies dropped at acquires (named by a notice, or joined while Weak)
    write_throughs: int = 0  # pages whose changes one write block forwarded to their home
    line_fills: int = 0  # lines brought from their homes by the line fill (64 bytes each)
    unsafe_pages: int = 0  # pages this rank's releases made unsafe (their writers send no more notices)
    unsafe_checks: int = 0  # directory rows of unsafe pages read at acquires
    write_through_bytes: int = 0  # the changed bytes forwarded
    atomics: int = 0  # remote atomics issued (lock queues, slots, homes, barriers)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Counters:
    """The mutable counters behind `Statistics`: one set per thread (program, handler), added up by `snapshot`."""

    read_faults: int = 0
    write_faults: int = 0
    twins: int = 0
    diffs: int = 0
    diff_bytes: int = 0
    intervals: int = 0
    home_lookups: int = 0
    homes_taken: int = 0
    page_fetches: int = 0
    page_fetch_seconds: float = 0.0
    fetch_rounds: int = 0
    fetch_retries: int = 0
    diff_waits: int = 0  # a home's waits for diffs a grant named before they arrived (`Memory._await_diffs`)
    grant_pages: int = 0  # pages that came with a lock grant, not fetched (`Memory._take_riders`)
    pages_served: int = 0
    diffs_applied: int = 0
    write_notices_received: int = 0
    lock_acquires: int = 0
    lock_seconds: float = 0.0
    barriers: int = 0
    barrier_seconds: float = 0.0
    flush_seconds: float = 0.0
    log_records: int = 0
    log_bytes: int = 0
    log_seconds: float = 0.0
    log_full_waits: int = 0
    log_full_checkpoints: int = 0
    log_discard_retries: int = 0
    stable_records: int = 0
    stable_bytes: int = 0
    stable_fsyncs: int = 0
    replayed_acquires: int = 0
    replayed_releases: int = 0
    replayed_barriers: int = 0
    regenerated_pages: int = 0
    versions_served: int = 0
    replay_seconds: float = 0.0
    replay_operations: int = 0
    directory_ops: int = 0
    notices_sent: int = 0
    notices_processed: int = 0
    self_invalidations: int = 0
    write_throughs: int = 0
    line_fills: int = 0
    unsafe_pages: int = 0
    unsafe_checks: int = 0
    write_through_bytes: int = 0
    atomics: int = 0
    messages: Counter[str] = field(default_factory=Counter)
    message_bytes: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.perf_counter)
    elapsed_before: float = 0.0  # time accumulated before a restart (perf_counter does not survive one)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["elapsed_before"] = self.elapsed()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def count(self, kind: str, nbytes: int) -> None:
        self.messages[kind] += 1
        self.message_bytes[kind] += nbytes

    def snapshot(self, protocol: str, rank: int, handler: Counters) -> Statistics:
        """The program thread's counters (self) and the handler thread's, as one frozen record."""
        total = self.elapsed()
        page = self.page_fetch_seconds
        wait = self.barrier_seconds + self.flush_seconds
        skip = {"started", "elapsed_before", "messages", "message_bytes"}
        plain = {
            f.name: getattr(self, f.name) + getattr(handler, f.name)
            for f in dataclasses.fields(self)
            if f.name not in skip
        }
        return Statistics(
            protocol=protocol,
            rank=rank,
            messages=dict(self.messages + handler.messages),
            message_bytes=dict(self.message_bytes + handler.message_bytes),
            total_seconds=total,
            page_seconds=page,
            wait_seconds=wait,
            compute_seconds=max(0.0, total - page - wait - self.lock_seconds),
            **plain,
        )
