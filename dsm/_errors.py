"""The DSM's one exception type."""

from __future__ import annotations


class DsmError(RuntimeError):
    """A DSM call could not complete: a peer stopped answering, a bad argument, a protocol violation."""
