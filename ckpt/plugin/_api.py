"""The contract's vocabulary: hook markers, the API version, the phases and the types hooks exchange."""

# One Phase enum is the only place the phase order is written: the coordinator
# walks `Phase.next`, the runtime names its barriers after the members, and the
# plugin host takes each phase hook's direction (down in registration order, up
# reversed, as DMTCP) from `Phase.down`.  Hooks that belong to no phase declare
# their direction where they are specified (`ckpt.plugin.hookspecs`).

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict, final

import pluggy

from ckpt._errors import PluginError

#: Version of the plugin contract. A plugin declares the version it was written for as a module attribute
#: ``CKPT_PLUGIN_API``; any other value is refused at load time with one line naming both.
#: 2: launcher-side hooks (ckpt_cli_commands, ckpt_transports, ckpt_job_start / ckpt_job_stop), ckpt.plugin.
CKPT_PLUGIN_API = 2

PROJECT = "ckpt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The direction a hook runs in: "down" in registration order, "up" in reverse registration order.
Direction = Literal["down", "up"]


class Phase(enum.Enum):
    """The phases of a checkpoint (REACH, PRESUSPEND, DRAIN, CHECKPOINT, RESUME) and of a restart (RESTART,
    REFRESH, RESUME); each ends at a global barrier of that name at the coordinator.

    ``state`` is what ``ckpt status`` shows for a rank in the phase, ``hook`` the hook it runs (None:
    none), ``down`` whether that hook runs in registration order, ``next`` the phase that follows.
    """

    #: The ranks agree on the step boundary to park at (the largest one any rank can still reach).
    REACH = "REACH"
    PRESUSPEND = "PRESUSPEND"
    DRAIN = "DRAIN"
    CHECKPOINT = "CHECKPOINT"
    RESUME = "RESUME"
    RESTART = "RESTART"
    REFRESH = "REFRESH"

    @property
    def state(self) -> str:
        """The rank state ``ckpt status`` shows while this phase runs (lower case)."""
        return "presuspend" if self is Phase.REACH else self.value.lower()

    @property
    def hook(self) -> str | None:
        """The hook this phase runs on every rank (``ckpt_<phase>``), None for REACH."""
        return _PHASE_HOOKS[self]

    @property
    def down(self) -> bool:
        """True when this phase's hook runs in registration order (the way down into a checkpoint)."""
        return self in (Phase.REACH, Phase.PRESUSPEND, Phase.DRAIN, Phase.CHECKPOINT)

    @property
    def next(self) -> Phase | None:
        """The phase after this one in its sequence; None after RESUME."""
        return _NEXT[self]

    def barrier(self, scope: str) -> str:
        """The name of this phase's global barrier in ``scope``: ``ckptN`` for checkpoint N, ``genG`` for the
        restart that makes generation G (``Phase.DRAIN.barrier("ckpt3") == "ckpt3:DRAIN"``).

        A scope ``rankR.<what>`` is one rank's alone (its barriers complete with that rank only):
        ``rankR.ckptN`` for an independent checkpoint N of rank R, ``rankR.incK`` for the restart of
        its incarnation K in a single-rank recovery (see :func:`rank_of_scope`)."""
        return f"{scope}:{self.value}"

    @staticmethod
    def rank_scope(rank: int, what: str) -> str:
        """The scope of rank ``rank``'s own phases: ``Phase.rank_scope(2, "ckpt7") == "rank2.ckpt7"``."""
        return f"rank{rank}.{what}"

    @classmethod
    def of_barrier(cls, name: str) -> tuple[str, Phase | None]:
        """(scope, phase) of a barrier name; the phase is None for any other barrier (a plugin's own)."""
        scope, _, rest = name.partition(":")
        try:
            return scope, cls(rest)
        except ValueError:
            return scope, None

    @staticmethod
    def rank_of_scope(scope: str) -> int | None:
        """The rank whose own phases ``scope`` (or a barrier name in it) belongs to; None for a job-wide one."""
        head = scope.partition(":")[0].partition(".")
        if head[1] and head[0].startswith("rank") and head[0][4:].isdigit():
            return int(head[0][4:])
        return None

    @classmethod
    def checkpoint_sequence(cls) -> tuple[Phase, ...]:
        return _sequence(Phase.REACH)

    @classmethod
    def restart_sequence(cls) -> tuple[Phase, ...]:
        return _sequence(Phase.RESTART)


_PHASE_HOOKS: dict[Phase, str | None] = {
    Phase.REACH: None,
    Phase.PRESUSPEND: "ckpt_presuspend",
    Phase.DRAIN: "ckpt_drain",
    Phase.CHECKPOINT: "ckpt_precheckpoint",
    Phase.RESUME: "ckpt_resume",
    Phase.RESTART: "ckpt_restart",
    Phase.REFRESH: "ckpt_refresh",
}
_NEXT: dict[Phase, Phase | None] = {
    Phase.REACH: Phase.PRESUSPEND,
    Phase.PRESUSPEND: Phase.DRAIN,
    Phase.DRAIN: Phase.CHECKPOINT,
    Phase.CHECKPOINT: Phase.RESUME,
    Phase.RESUME: None,
    Phase.RESTART: Phase.REFRESH,
    Phase.REFRESH: Phase.RESUME,
}


def _sequence(first: Phase) -> tuple[Phase, ...]:
    phases: list[Phase] = []
    phase: Phase | None = first
    while phase is not None:
        phases.append(phase)
        phase = phase.next
    return tuple(phases)


class ImageContents:
    """The plugins' part of an image: ``add(key, obj)`` at checkpoint, ``get(key)`` at restart.

    Keys are strings, one per plugin by convention (its name); what is added is pickled in one
    object graph with the program, so references shared with the program stay shared.
    """

    def __init__(self, items: dict[str, Any] | None = None) -> None:
        self.items: dict[str, Any] = dict(items or {})

    def add(self, key: str, obj: Any) -> None:
        if key in self.items:
            raise PluginError(f"image key {key!r} was added twice (two plugins with one key?)")
        self.items[key] = obj

    def get(self, key: str, default: Any = None) -> Any:
        return self.items.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.items


class PluginOption(TypedDict):
    """One command-line option a plugin declares (``ckpt_add_options``)."""

    #: ``"log-home"`` becomes ``--log-home``, and its value ``rt.options["log_home"]``.
    name: str
    help: str
    default: NotRequired[Any]
    #: "int", "float", "str" (the default) or "flag".
    type: NotRequired[Literal["int", "float", "str", "flag"]]
    #: Restrict the value to these words.
    choices: NotRequired[list[str]]
    #: The choice is in the images: only ``ckpt launch`` offers the option, ``ckpt restart`` keeps it.
    launch_only: NotRequired[bool]
    #: The value's placeholder in ``--help`` (``HOST:PORT``); default: its type.
    metavar: NotRequired[str]
    #: Also read the value from this environment variable when the option is not given (``CKPT_FABRIC``).
    envvar: NotRequired[str]
    #: The value belongs to one run (the address of a running service): a restart does not take it
    #: from the manifest, only from its own command line (or ``envvar``).
    per_run: NotRequired[bool]


@final
@dataclass(frozen=True)
class Transport:
    """A fabric a job can run on (``ckpt launch/restart --transport NAME``), contributed by a plugin.

    Every transport is a verbs provider of the same name.  Transports are interchangeable under the
    virtualization plugin: an image taken on one restarts on another.
    """

    #: The word ``--transport`` takes, and the verbs provider's name (lower-case letters and '_').
    name: str
    #: One line for ``ckpt plugins`` and the ``--transport`` help.
    description: str = ""
    #: The transport ``ckpt launch`` uses when none is given (exactly one installed transport says so).
    default: bool = False
    #: Its provider is part of ``ckpt.verbs`` itself, so ``--native`` ranks (which load no plugins) have
    #: it; False for a provider that a rank-side plugin registers (``ckpt_verbs_providers``).
    native: bool = False


@final
@dataclass(frozen=True)
class JobInfo:
    """What the launcher-side hooks (``ckpt_job_start`` / ``ckpt_job_stop``) learn about a job.

    Under an external launcher (mpiexec, srun: ``external_rank`` is not None) the hooks run in every
    rank's own process, which joins a ``ckpt coordinator``: start nothing shared by the job there
    (each process would start its own), only locate what the options name.
    """

    #: The job id (12 hex digits), kept across restarts.
    job: str
    #: The checkpoint directory, which this job holds (the launcher has claimed it).
    ckpt_dir: Path
    #: The transport the ranks run on (a ``Transport.name``).
    transport: str
    #: The address the job's servers bind to (``--host``).
    host: str
    #: Every plugin option's value, as ranks see it in ``rt.options``.
    options: dict[str, Any] = field(default_factory=dict)
    #: True for ``ckpt restart``.
    restarted: bool = False
    #: True under ``--native`` (the ranks load no plugins; launcher-side hooks still run).
    native: bool = False
    #: False when the job joins a coordinator it did not start (``--coordinator``).
    owns_coordinator: bool = True
    #: The rank this process runs under an external launcher (see above); None for ``ckpt launch``'s own ranks.
    external_rank: int | None = None
    #: How many ranks the job has (``-n``; what ranks see as ``rt.size``).
    size: int = 1
