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
from ckpt.runtime.hookspecs import CKPT_PLUGIN_API, hookimpl
from ckpt.runtime.vid import VirtualIdTable

__version__ = "0.1.0"

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
]
