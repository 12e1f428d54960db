"""Verbs providers: the operations table every Context dispatches through, the registry, and wrapping."""

# Why a table and not methods: rdma-core's providers fill a `verbs_context_ops`
# table and libibverbs calls through it.  ckpt does the same so that a plugin
# (the virtualization plugin, ib2tcp) can interpose on *every* call of *every*
# object by replacing entries of the table once, at start-up
# (`ckpt_wrap_verbs`), instead of patching classes.  The front-end objects
# (`Context`, `QP`, ...) bind the entries they need when they are created, so
# the hot path (`post_send`, `poll`) is one Python call into the table and
# never goes through pluggy.
#
# Entries take and return *handles*: whatever the provider (or a wrapper)
# uses to stand for a device, PD, MR, CQ, channel, SRQ, QP or AH.  Handles
# expose the few attributes the front end shows to the program (`qp_num`,
# `lkey`, `rkey`, `addr`, ...), so a wrapper can hand out shadow handles with
# virtual values and the program never sees a real one.

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from ckpt.verbs._errors import PyverbsRDMAError

log = logging.getLogger(__name__)

#: Environment variable naming the default provider (``Context()`` with no name).
PROVIDER_ENV = "CKPT_VERBS_PROVIDER"
DEFAULT_PROVIDER = "simib"

#: Every entry of an operations table, in the order rdma-core's verbs_context_ops lists them (roughly).
OPERATIONS = (
    "open_device",
    "close_device",
    "query_device",
    "query_port",
    "query_gid",
    "get_async_event",
    "alloc_pd",
    "dealloc_pd",
    "reg_mr",
    "dereg_mr",
    "create_comp_channel",
    "destroy_comp_channel",
    "get_cq_event",
    "create_cq",
    "destroy_cq",
    "poll_cq",
    "req_notify_cq",
    "ack_cq_events",
    "create_srq",
    "modify_srq",
    "query_srq",
    "destroy_srq",
    "post_srq_recv",
    "create_qp",
    "modify_qp",
    "query_qp",
    "destroy_qp",
    "post_send",
    "post_recv",
    "create_ah",
    "destroy_ah",
    "device_statistics",  # an extension: the provider's counters for a device (a frozen dataclass)
    "query_paths",  # an extension: the subnet administrator's path records to a LID's HCA (APM)
)


class VerbsOps:
    """A provider's operations table: one attribute per entry of `OPERATIONS`.

    A wrapper replaces entries in place, keeping the previous entry to call
    through::

        inner = ops.post_send
        def post_send(qp, wr):
            log_it(wr)
            return inner(qp, wr)
        ops.post_send = post_send

    The table pickles by provider name (the process that loads an image finds
    its own, already wrapped, table).
    """

    def __init__(self, provider: str, **entries: Callable[..., Any]) -> None:
        missing = [name for name in OPERATIONS if name not in entries]
        unknown = [name for name in entries if name not in OPERATIONS]
        if missing or unknown:
            raise TypeError(f"provider {provider!r}: missing entries {missing}, unknown entries {unknown}")
        self.provider = provider
        for name, fn in entries.items():
            setattr(self, name, fn)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _ops_for_image, (self.provider,)

    def __repr__(self) -> str:
        return f"<VerbsOps {self.provider}>"

    def __getattr__(self, name: str) -> Any:  # only reached for entries that were never set
        raise AttributeError(f"verbs provider {self.__dict__.get('provider')!r} has no operation {name!r}")


ProviderFactory = Callable[[], VerbsOps]
OpsWrapper = Callable[[VerbsOps], None]

_lock = threading.RLock()
_factories: dict[str, ProviderFactory] = {}
_tables: dict[str, VerbsOps] = {}
_wrappers: list[OpsWrapper] = []
#: Providers that are fabrics (`ckpt launch/restart --transport`), interchangeable under ckpt_ib:
#: the built-in simib, and what plugins declare (`ckpt_transports`, registered by the rank).
_transports: set[str] = {DEFAULT_PROVIDER}


def register_provider(name: str, factory: ProviderFactory) -> None:
    """Make provider `name` available to ``Context(name=...)``; its table is built on first use."""
    if not re.fullmatch(r"[a-z][a-z_]*", name):
        raise ValueError(f"provider name {name!r}: lower-case letters and '_' only (device names append a digit)")
    with _lock:
        if name in _tables:
            raise PyverbsRDMAError(f"provider {name!r} is already in use; register providers before opening devices")
        _factories[name] = factory


def register_transport(name: str) -> None:
    """Mark provider `name` as a fabric: an image's table of one transport comes back as the active one's."""
    if not re.fullmatch(r"[a-z][a-z_]*", name):
        raise ValueError(f"transport name {name!r}: lower-case letters and '_' only (it names a provider)")
    with _lock:
        _transports.add(name)


def transports() -> frozenset[str]:
    """Names of the providers that are transports (a name is enough: its provider may come later)."""
    with _lock:
        return frozenset(_transports)


def providers() -> list[str]:
    """Names of the registered providers."""
    _ensure_builtin()
    with _lock:
        return sorted(_factories)


def add_ops_wrapper(wrapper: OpsWrapper) -> None:
    """Wrap every provider's table with `wrapper(ops)` (in place), once, before the table is first used.

    Wrappers run in the order they were added: the first one is innermost.
    Adding a wrapper after a table was built applies it to that table too, so a
    plugin loaded late still sees every later call.
    """
    with _lock:
        _wrappers.append(wrapper)
        for ops in _tables.values():
            wrapper(ops)


def get_ops(provider: str) -> VerbsOps:
    """The (wrapped) operations table of `provider`, built on first use."""
    _ensure_builtin()
    with _lock:
        ops = _tables.get(provider)
        if ops is None:
            factory = _factories.get(provider)
            if factory is None:
                known = ", ".join(sorted(_factories)) or "none"
                raise PyverbsRDMAError(f"no verbs provider {provider!r} (available: {known})", 19)  # ENODEV
            ops = factory()
            for wrapper in _wrappers:
                wrapper(ops)
            _tables[provider] = ops
            log.debug("verbs provider %s ready (%d wrappers)", provider, len(_wrappers))
        return ops


def _ops_for_image(provider: str) -> VerbsOps:
    """The table an unpickled VerbsOps stands for: a transport's becomes the active transport's.

    An image taken on one fabric restarts on another (`ckpt restart --transport`):
    the process's active transport is $CKPT_VERBS_PROVIDER, which the rank sets.
    Transports are simib and those registered (`register_transport`: the rank
    registers what its plugins declare); other providers stay themselves.
    """
    active = os.environ.get(PROVIDER_ENV)
    fabrics = transports()
    if provider in fabrics and active in fabrics:
        provider = str(active)
    return get_ops(provider)


def parse_device_name(name: str | None) -> tuple[str, int, str]:
    """'simib1' -> ('simib', 1, 'simib1'); 'simib' -> ('simib', 0, 'simib0'); None -> the default provider's 0."""
    if not name:
        name = os.environ.get(PROVIDER_ENV) or DEFAULT_PROVIDER
    m = re.fullmatch(r"([a-z][a-z_]*?)(\d*)", name)
    if m is None:
        raise PyverbsRDMAError(f"bad device name {name!r}: expected a provider name and an index, e.g. 'simib0'", 19)
    provider, index = m.group(1), int(m.group(2) or 0)
    return provider, index, f"{provider}{index}"


def _reset_for_tests() -> None:
    """Forget wrappers and built tables (tests only)."""
    with _lock:
        _wrappers.clear()
        _tables.clear()


def _ensure_builtin() -> None:
    with _lock:
        if DEFAULT_PROVIDER not in _factories:
            from ckpt.verbs import _simib  # type: ignore[attr-defined,unused-ignore]

            _factories[DEFAULT_PROVIDER] = _simib.make_ops
