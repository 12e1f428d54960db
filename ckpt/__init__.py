"""ckpt: DMTCP-style checkpoint/restart for distributed Python programs over (simulated) verbs."""

from ckpt._errors import (
    CheckpointAborted,
    CkptError,
    CollectiveError,
    CoordinatorError,
    ImageError,
    PluginError,
    ProtocolError,
)
from ckpt._program import KeyValue, Program, Runtime
from ckpt.plugin import CKPT_PLUGIN_API, VirtualIdTable, hookimpl

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `ckpt.verbs` is public but imported on first use: the CLI and the coordinator never need it.
    if name == "verbs":
        import ckpt.verbs

        return ckpt.verbs
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")


__all__ = [
    "CKPT_PLUGIN_API",
    "CheckpointAborted",
    "CkptError",
    "CollectiveError",
    "CoordinatorError",
    "ImageError",
    "KeyValue",
    "PluginError",
    "Program",
    "ProtocolError",
    "Runtime",
    "VirtualIdTable",
    "__version__",
    "hookimpl",
    "verbs",
]
