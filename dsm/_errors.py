"""The DSM's exceptions: DsmError, and ReplayDiverged for a recovery whose re-execution left its log."""

from __future__ import annotations


class DsmError(RuntimeError):
    """A DSM call could not complete: a peer stopped answering, a bad argument, a protocol violation."""


class ReplayDiverged(DsmError):
    """A recovering rank's re-execution asked for another operation than its log holds next."""


def check_synchronising(writing: int, synchronising: str) -> None:
    """Refuse a synchronisation (`synchronising`: what it is) inside `writing` open ``with a.write(...)`` blocks."""
    if synchronising and writing:
        raise DsmError(
            f"{synchronising} inside a `with a.write(...)` block: the interval it closes would miss the "
            "block's later writes; leave the block first"
        )
