"""The exception hierarchy of ckpt: every error a user can act on derives from CkptError."""

from __future__ import annotations


class CkptError(Exception):
    """Base class of every error ckpt raises on purpose; its message is one line a user can act on."""


class ImageError(CkptError):
    """A checkpoint image or manifest is missing, damaged, truncated, foreign or not authentic."""


class ProtocolError(CkptError):
    """A peer broke the coordinator wire protocol (bad frame, wrong version, failed authentication)."""


class CoordinatorError(CkptError):
    """The coordinator cannot be reached, refused a request, or the job it runs failed."""


class CheckpointAborted(CkptError):
    """A checkpoint was aborted; the previous checkpoint stays the latest."""


class CollectiveError(CkptError):
    """A collective (allgather, barrier) could not complete: mismatched kinds, or a peer is gone."""


class PluginError(CkptError):
    """A plugin could not be loaded, declares another plugin API, or failed inside a hook."""
