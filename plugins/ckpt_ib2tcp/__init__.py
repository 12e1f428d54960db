"""ckpt_ib2tcp: the `tcp` verbs provider, and with it restarts from simib onto plain TCP and back.

The provider is ckpt's HCA engine -- the same code as simib, so the same verbs
semantics: every opcode, protection errors, RNR and retries, flushing,
completion channels, SRQs, one-sided operations executed by the target's NIC
thread -- with one difference: there is no subnet manager.  An HCA listens on
a TCP port and records "LID -> host:port" in a directory (_directory.py: the
coordinator's key-value store under ckpt), so ranks can be on any hosts that
reach the coordinator.  DMTCP's ib2tcp was a prototype carrying SEND/RECV
only; this one carries everything simib does.

With ckpt_ib loaded (the default), an image taken on one transport restarts on
the other (`ckpt restart --transport tcp`): the program's verbs objects are
shadows with virtual IDs, rebuilt on whichever provider is active.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ckpt
from ckpt import verbs
from ckpt.plugin import Transport
from ckpt_ib2tcp._directory import DIRECTORY_ENV, factory

__all__ = ["DIRECTORY_ENV", "HOST_ENV", "PROVIDER", "make_ops", "register"]
__version__ = "0.1.0"
CKPT_PLUGIN_API = 2
PROVIDER = "tcp"
#: The address tcp HCAs listen on; by default the one this host reaches the coordinator from.
HOST_ENV = "CKPT_TCP_HOST"

_kv: Any = None
_coordinator: str | None = None


@ckpt.hookimpl
def ckpt_init(rt: ckpt.Runtime) -> None:
    global _kv, _coordinator
    _kv, _coordinator = rt.kv, rt.coordinator


@ckpt.hookimpl
def ckpt_transports() -> list[Transport]:
    # native=False: the provider is this plugin's, and --native ranks load no plugins
    return [Transport(PROVIDER, "plain TCP between the ranks' hosts: no subnet manager", native=False)]


@ckpt.hookimpl
def ckpt_verbs_providers() -> dict[str, Any]:
    return {PROVIDER: make_ops}


def make_ops() -> verbs.VerbsOps:
    """The `tcp` operations table (the factory `register_provider` takes)."""
    return verbs.engine_ops(PROVIDER, factory(_kv), listen_host)


def register() -> None:
    """Make `Context(name="tcp0")` work in a process without a ckpt runtime (peers: $CKPT_TCP_DIRECTORY)."""
    verbs.register_provider(PROVIDER, make_ops)
    verbs.register_transport(PROVIDER)


def listen_host() -> str:
    """$CKPT_TCP_HOST, else the local address on the route to the coordinator, else 127.0.0.1."""
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    if _coordinator:
        target = _coordinator.rpartition(":")[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # no packet leaves: this only picks the route
                return str(probe.getsockname()[0])
        except OSError:
            pass
    return "127.0.0.1"
