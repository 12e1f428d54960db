"""Every hook a ckpt plugin may implement: when it fires, in which process, its parameters, its order.

A plugin is a module (or object) with functions decorated by ``@ckpt.plugin.hookimpl``
(also ``ckpt.hookimpl``) whose names are the hooks below.  It is found through the
``ckpt.plugins`` entry-point group, or named with ``ckpt launch --with-plugin MODULE``,
and it declares the contract version it was written for with a module attribute
``CKPT_PLUGIN_API = 2`` (a plugin declaring another version is refused in one line).
Optional attributes: ``CKPT_PLUGIN_ORDER`` (an int, default 100: lower registers first,
i.e. sits lower in the stack), ``__version__``, ``CKPT_PLUGIN_NAME`` (for ``--with-plugin``
modules; default: the module's last name) and ``CKPT_HOOKSPECS`` (a module of further
hookspecs the plugin brings, added to the same manager before plugins are checked: the
``dsm`` plugin adds ``dsm.hookspecs`` this way).

Processes.  *launcher*: the ``ckpt`` command (``launch``, ``restart``, the other commands);
*rank*: each rank process, where the program runs.  Plugins are loaded in both; under
``--native`` the ranks load none, the launcher still does.

Order, as in DMTCP: hooks on the way *down* run in registration order, hooks on the way
*up* in reverse registration order, so a plugin layered on top of another always sees the
lower one intact.  A phase hook takes its direction from :class:`ckpt.plugin.Phase`
(``Phase.down``); every other hook says its direction below.  ``tryfirst`` / ``trylast``
keep their pluggy meaning in both directions.  Hook wrappers are refused.

Rank-side hooks receive the rank's :class:`ckpt.plugin.Runtime` as ``rt``; it gives
``rt.kv`` (publish / subscribe), ``rt.coordinator_barrier(name)``,
``rt.allocate_global(ns)`` and ``rt.options``.  Phase hooks run on the checkpoint thread
while the program thread is parked at a step boundary (or, for ``ckpt_restart`` /
``ckpt_refresh``, before the program thread starts).

An exception raised by a hook aborts the checkpoint in progress (the previous one stays the
latest) and is reported with the plugin's name; during a restart it fails the restart; in the
launcher it is one error line.  The hot path (verbs ``post_send``, ``poll``) never goes
through pluggy: ``ckpt_wrap_verbs`` composes wrappers once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt.plugin._api import Direction, hookspec

if TYPE_CHECKING:
    import click

    from ckpt.plugin._api import ImageContents, JobInfo, PluginOption, Transport
    from ckpt.plugin._runtime import Runtime
    from ckpt.plugin._verbs import ProviderFactory, VerbsOpsTable

#: The direction of every hook that is not a phase hook (phase hooks: ``Phase.down``).
ORDER: dict[str, Direction] = {
    "ckpt_add_options": "down",
    "ckpt_cli_commands": "down",
    "ckpt_transports": "down",
    "ckpt_job_start": "down",
    "ckpt_job_stop": "up",
    "ckpt_single_rank_recovery": "up",
    "ckpt_init": "down",
    "ckpt_exit": "up",
    "ckpt_checkpointed": "up",
    "ckpt_rank_failed": "up",
    "ckpt_rank_recovered": "up",
    "ckpt_verbs_providers": "down",
    "ckpt_wrap_verbs": "down",
}


# --------------------------------------------------------------------- launcher: command line
@hookspec
def ckpt_add_options() -> list[PluginOption]:
    """Declare command-line options for ``ckpt launch`` / ``ckpt restart``.

    *launcher*, before arguments are parsed.  Return a list of :class:`ckpt.plugin.PluginOption`
    dicts ``{"name": "log-home", "help": "...", "default": None, "type": "int"}`` ("int", "float",
    "str" or "flag"; a ``"choices": [...]`` list restricts a value to those words); each becomes
    ``--NAME`` and its value reaches every rank as ``rt.options["log_home"]`` (and the launcher-side
    hooks as ``job.options``).  The values a job was launched with are recorded in its manifests,
    and a restart reuses them unless its command line gives the option again.
    ``"launch_only": True`` marks an option a restart cannot change (the choice is in the
    images): only ``ckpt launch`` offers it; ``"per_run": True`` one a restart does not take from
    the manifest (the address of a running service); ``"envvar"`` and ``"metavar"`` keep click's
    meaning.  Order: down.
    """
    raise NotImplementedError


@hookspec
def ckpt_cli_commands() -> list[click.Command]:
    """Contribute commands (or command groups) to ``ckpt``: the simib plugin adds ``ckpt fabric``.

    *launcher*, when ``ckpt`` builds its command group, so ``ckpt --help`` lists a command only
    when its plugin is installed (``--disable-plugin`` cannot drop one: it is read after the
    command is chosen).  A name that is already taken is refused in one line.  Raise
    ``ckpt.CkptError`` inside a command for a one-line error.  Order: down.
    """
    raise NotImplementedError


# --------------------------------------------------------------------- launcher: transports and services
@hookspec
def ckpt_transports() -> list[Transport]:
    """Name the transports (fabrics) this plugin provides: what ``--transport`` accepts.

    *launcher* and *rank*.  Each :class:`ckpt.plugin.Transport` is a verbs provider of the same
    name -- registered by ``ckpt.verbs`` itself (simib) or by this plugin's
    ``ckpt_verbs_providers`` in the ranks (ib2tcp's ``tcp``).  Transports are interchangeable
    under the virtualization plugin: an image taken on one restarts on another.  Exactly one
    installed transport is the ``default``.  An unknown ``--transport`` is refused in one line
    listing the installed ones.  Order: down.
    """
    raise NotImplementedError


@hookspec
def ckpt_job_start(job: JobInfo) -> dict[str, str] | None:
    """A job is starting: start the services it needs; return environment variables for its ranks.

    *launcher*, once per ``ckpt launch`` / ``ckpt restart``, after the checkpoint directory is
    claimed and before the coordinator and the ranks start (the simib plugin starts the job's
    subnet manager here and returns its address and token).  Also called under ``--native``.
    Return None when the job needs nothing from this plugin (e.g. another transport).  Raise
    ``ckpt.CkptError`` for a one-line refusal (it is shown as written); any other exception is
    reported with the plugin's name.  Either stops the launch; ``ckpt_job_stop`` is then called for
    the plugins whose ``ckpt_job_start`` had returned.  Under an external launcher it runs in each
    rank's process (``job.external_rank``).  Order: down.
    """


@hookspec
def ckpt_job_stop(job: JobInfo) -> None:
    """The job has ended (its ranks are reaped), or it failed to start: stop what ``ckpt_job_start`` started.

    *launcher*.  Must not raise for a service that is already gone.  Order: up.
    """


@hookspec
def ckpt_single_rank_recovery(job: JobInfo) -> bool | str | list[str] | None:
    """May a job with this plugin loaded run under ``ckpt launch --on-failure recover``?

    *launcher*, once, before the job starts, and only under ``--on-failure recover``.  Under
    ``recover`` a lost rank is respawned from its own latest image while the other ranks keep
    running, so every plugin that keeps state across ranks (connections, remote IDs, shared
    memory) must be able to bring that one rank back among live peers.  Return None when your
    plugin keeps no cross-rank state; True when it can recover its own; a string (one line, the
    reason) when it cannot; or a list of other plugins' names (True, and your plugin also
    answers for theirs: ``ckpt_remotelog`` is to answer ``["ib", "dsm"]`` for the connections
    and shared memory it re-creates, once its recovery by replay is built; it refuses until
    then).  Every plugin is asked: the launch is refused, with the first such plugin's line, iff
    some plugin refused and no other plugin's list names it; no answer at all accepts it.
    Order: up (the order refusals are looked at in).
    """
    raise NotImplementedError


# --------------------------------------------------------------------- rank: lifecycle
@hookspec
def ckpt_init(rt: Runtime) -> None:
    """The rank's runtime is up and connected; the program's ``setup`` has not run yet.

    *rank*, once per process.  In a restarted process it fires before the image is
    loaded (its verbs objects need the providers and wrappers registered here),
    with ``rt.restarted`` already True and ``rt.step`` the step of the image;
    ``ckpt_restart`` follows.  Use it to create per-process state.  Order: down.
    """


@hookspec
def ckpt_exit(rt: Runtime) -> None:
    """The job has ended: every rank finished, or ``checkpoint --kill`` wrote its checkpoint.

    *rank*; the process exits right after.  Not called when the coordinator kills the job
    (``ckpt kill``, a failed rank): then the process is ended at once.  Order: up.
    """


# --------------------------------------------------------------------- rank: checkpoint, down
@hookspec
def ckpt_presuspend(rt: Runtime, independent: bool) -> None:
    """``Phase.PRESUSPEND``: the program thread is parked at the checkpoint's step boundary.

    *rank*.  Quiesce what your plugin drives from other threads.  ``independent`` is True for
    an independent checkpoint of this rank alone (``ckpt checkpoint --rank R``,
    ``--rank-interval``): the other ranks keep running, so the phase barriers have this rank
    only and nothing can be exchanged with peers; the image serves this rank's single-rank
    recovery only.  The same flag reaches every hook of the checkpoint.  Order: down.
    """


@hookspec
def ckpt_drain(rt: Runtime, independent: bool) -> None:
    """``Phase.DRAIN``: empty what the network still holds (the verbs plugin drains CQs here).

    *rank*.  May exchange counts with other ranks through ``rt.kv`` and wait for them (not when
    ``independent``: the others are running).  Returns when this rank is drained.  Order: down.
    """


@hookspec
def ckpt_precheckpoint(rt: Runtime, image: ImageContents, independent: bool) -> None:
    """``Phase.CHECKPOINT``: add your plugin's state to the image with ``image.add(key, obj)``.

    *rank*.  Everything added is pickled in one object graph with the program, so references
    shared with the program (a registered numpy array) stay shared after restart.  Order: down.
    """


# --------------------------------------------------------------------- rank: checkpoint, up
@hookspec
def ckpt_checkpointed(rt: Runtime, info: dict[str, Any]) -> None:
    """The checkpoint exists: its manifest is written.

    ``info`` has ``number``, ``manifest`` (its path) and ``independent`` (True for a checkpoint of
    this rank alone, see ``ckpt_presuspend``).

    *rank*, at the end of ``Phase.CHECKPOINT``.  Order: up.
    """


@hookspec
def ckpt_resume(rt: Runtime, restarted: bool, aborted: bool, independent: bool) -> None:
    """``Phase.RESUME``: the program thread is about to continue.

    *rank*.  ``restarted`` is True after a restart (also after a single-rank recovery:
    ``rt.recovered``); ``aborted`` is True when the checkpoint was aborted after
    ``ckpt_presuspend`` ran (undo what it did); ``independent`` as in ``ckpt_presuspend``
    (False after a restart).  Order: up.
    """


# --------------------------------------------------------------------- rank: restart, up
@hookspec
def ckpt_restart(rt: Runtime, image: ImageContents) -> None:
    """``Phase.RESTART``: take your state back with ``image.get(key)``, recreate real resources and
    publish their new real IDs with ``rt.kv.publish``.

    *rank*, in a new process, after ``ckpt_init``.  A barrier follows.  In a single-rank
    recovery (``rt.recovered``) only this rank restarts: its barriers have this rank alone, the
    others keep running, and peers' IDs are their live ones (``ckpt_rank_recovered`` tells them
    this rank is back once this phase is complete).  Order: up.
    """


@hookspec
def ckpt_refresh(rt: Runtime) -> None:
    """``Phase.REFRESH``: every rank has published; subscribe to peers' new IDs and rebuild translations.

    *rank*.  A barrier follows, then ``ckpt_resume(restarted=True)``.  Order: up.
    """


# --------------------------------------------------------------------- rank: single-rank recovery
@hookspec
def ckpt_rank_failed(rt: Runtime, rank: int, incarnation: int) -> None:
    """Rank ``rank`` (its incarnation ``incarnation``) was lost, and the job runs on (``--on-failure recover``).

    *rank*, on every surviving rank, on a runtime thread (never the program thread, never the
    coordinator link's reader), in the order failures happen.  The coordinator has also published
    ``ckpt.plugin.RANKS_NS`` / ``failed/<rank>`` = ``incarnation``.  Connections to that rank
    fail from now on (as on hardware: RETRY_EXC_ERR); stop using them, keep what you would send
    it.  Do not block long: the next notification waits for this one.  Order: up.
    """


@hookspec
def ckpt_rank_recovered(rt: Runtime, rank: int, incarnation: int) -> None:
    """Rank ``rank``'s new incarnation ``incarnation`` has loaded its image and run ``ckpt_restart``.

    *rank*, on every surviving rank, on the same thread as ``ckpt_rank_failed``.  The recovered
    rank has published its new real IDs (its RESTART phase is complete) and is in ``ckpt_refresh``,
    where it may wait for what you publish now: build fresh connections to it here (and re-send
    what was pending).  ``RANKS_NS`` / ``incarnation/<rank>`` = ``incarnation`` is published
    first.  Order: up.
    """


# --------------------------------------------------------------------- rank: verbs
@hookspec
def ckpt_verbs_providers() -> dict[str, ProviderFactory]:
    """Contribute verbs providers: ``{"tcp": factory}``; a factory builds a provider's operations table.

    *rank*, once, before ``ckpt_init``.  A provider that is a fabric is also named by
    ``ckpt_transports``.  Order: down.
    """
    raise NotImplementedError


@hookspec
def ckpt_wrap_verbs(rt: Runtime, ops: VerbsOpsTable) -> None:
    """Wrap a provider's operations table once at start-up (replace entries of ``ops`` in place).

    *rank*, once per provider table, when it is first built.  The first-registered plugin's
    wrappers are innermost.  The wrapped table is what every ``Context`` dispatches through; the
    hot path never comes back through pluggy.  Order: down.
    """
