"""ckpt.verbs: a simulated libibverbs with pyverbs' names, its providers and the simib fabric."""

from ckpt.verbs._attrs import (
    GID,
    SGE,
    WC,
    AHAttr,
    AsyncEvent,
    DeviceAttr,
    GlobalRoute,
    PortAttr,
    QPAttr,
    QPCap,
    QPInitAttr,
    RecvWR,
    SendWR,
    SrqAttr,
    SrqInitAttr,
)
from ckpt.verbs._enums import *  # noqa: F403  (the libibverbs enums and their IBV_* aliases)
from ckpt.verbs._enums import ENUMS as _ENUMS
from ckpt.verbs._errors import PyverbsError, PyverbsRDMAError, PyverbsUserError
from ckpt.verbs._objects import AH, CQ, MR, PD, QP, SRQ, CompChannel, Context, VerbsObject, connect_rc
from ckpt.verbs._provider import OPERATIONS, VerbsOps, add_ops_wrapper, get_ops, providers, register_provider

__all__ = [
    "AH",
    "CQ",
    "GID",
    "MR",
    "OPERATIONS",
    "PD",
    "QP",
    "SGE",
    "SRQ",
    "WC",
    "AHAttr",
    "AsyncEvent",
    "CompChannel",
    "Context",
    "DeviceAttr",
    "GlobalRoute",
    "PortAttr",
    "PyverbsError",
    "PyverbsRDMAError",
    "PyverbsUserError",
    "QPAttr",
    "QPCap",
    "QPInitAttr",
    "RecvWR",
    "SendWR",
    "SrqAttr",
    "SrqInitAttr",
    "VerbsObject",
    "VerbsOps",
    "add_ops_wrapper",
    "connect_rc",
    "get_ops",
    "providers",
    "register_provider",
    *(cls.__name__ for cls in _ENUMS),
    *(name for cls in _ENUMS for name in cls.__members__),
]
