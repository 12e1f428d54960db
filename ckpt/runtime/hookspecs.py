"""The ckpt plugin contract: every hook a plugin may implement, when it fires, and in which order.

A plugin is a module (or object) with functions decorated by ``ckpt.hookimpl``
whose names are the hooks below.  It is found through the ``ckpt.plugins``
entry-point group, or named with ``ckpt launch --with-plugin MODULE``, and it
declares the API it was written for with a module attribute
``CKPT_PLUGIN_API = 1``.  Optional attributes: ``CKPT_PLUGIN_ORDER`` (an int,
default 100: lower registers first, i.e. sits lower in the stack),
``__version__``, and ``CKPT_HOOKSPECS`` (a module of further hookspecs the
plugin brings, added to the same manager before plugins are checked: the
``dsm`` plugin adds ``dsm.hookspecs`` this way).

Ordering, as in DMTCP: hooks on the way *down* (``ckpt_presuspend``,
``ckpt_drain``, ``ckpt_precheckpoint``) run in registration order; hooks on the
way *up* (``ckpt_checkpointed``, ``ckpt_resume``, ``ckpt_restart``,
``ckpt_refresh``) run in reverse registration order, so a plugin layered on
top of another always sees the lower one intact.  ``tryfirst`` / ``trylast``
keep their pluggy meaning in both directions.

Every hook receives the rank's :class:`ckpt.Runtime` as ``rt``; it gives
``rt.kv`` (publish / subscribe), ``rt.coordinator_barrier(name)``,
``rt.allocate_global(ns)`` and ``rt.options``.  Hooks run on the checkpoint
thread while the program thread is parked at a step boundary (or, for
``ckpt_restart`` / ``ckpt_refresh``, before the program thread starts).

An exception raised by a hook aborts the checkpoint in progress (the previous
one stays the latest) and is reported with the plugin's name; during a
restart it fails the restart.  The hot path (verbs ``post_send``, ``poll``)
never goes through pluggy: ``ckpt_wrap_verbs`` composes wrappers once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ckpt._program import Runtime
    from ckpt.runtime.plugins import ImageContents

#: Version of this contract. A plugin declaring another value is refused at load time.
CKPT_PLUGIN_API = 1

PROJECT = "ckpt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------- lifecycle
@hookspec
def ckpt_add_options() -> list[dict[str, Any]]:
    """Declare command-line options for ``ckpt launch`` / ``ckpt restart``.

    Called in the CLI process before arguments are parsed.  Return a list of
    dicts ``{"name": "log-home", "help": "...", "default": None, "type": "int"|"float"|"str"|"flag"}``
    (a ``"choices": [...]`` list restricts a value to those words); each becomes
    ``--NAME`` and its value reaches every rank as ``rt.options["log_home"]``.
    The values a job was launched with are recorded in its manifests, and a restart
    reuses them unless its command line gives the option again.  ``"launch_only": True``
    marks an option a restart cannot change (the choice is in the images): only
    ``ckpt launch`` offers it.
    """
    raise NotImplementedError


@hookspec
def ckpt_init(rt: Runtime) -> None:
    """The rank's runtime is up and connected; the program's ``setup`` has not run yet.

    Fires once per process.  In a restarted process it fires before the image is
    loaded (its verbs objects need the providers and wrappers registered here),
    with ``rt.restarted`` already True and ``rt.step`` the step of the image;
    ``ckpt_restart`` follows.  Use it to create per-process state.  Order:
    registration order.
    """


@hookspec
def ckpt_exit(rt: Runtime) -> None:
    """The job has ended: every rank finished, or ``checkpoint --kill`` wrote its checkpoint.

    The process exits right after.  Not called when the coordinator kills the job
    (``ckpt kill``, a failed rank): then the process is ended at once.
    Reverse registration order.
    """


# --------------------------------------------------------------------- checkpoint: down
@hookspec
def ckpt_presuspend(rt: Runtime) -> None:
    """PRESUSPEND: the program thread is parked at the checkpoint's step boundary.

    Quiesce what your plugin drives from other threads.  Registration order.
    """


@hookspec
def ckpt_drain(rt: Runtime) -> None:
    """DRAIN: empty what the network still holds (the verbs plugin drains CQs here).

    May exchange counts with other ranks through ``rt.kv`` and wait for them.
    Registration order.  Returns when this rank is drained.
    """


@hookspec
def ckpt_precheckpoint(rt: Runtime, image: ImageContents) -> None:
    """CHECKPOINT: add your plugin's state to the image with ``image.add(key, obj)``.

    Everything added is pickled in one object graph with the program, so
    references shared with the program (a registered numpy array) stay shared
    after restart.  Registration order.
    """


# --------------------------------------------------------------------- checkpoint: up
@hookspec
def ckpt_checkpointed(rt: Runtime, info: dict[str, Any]) -> None:
    """The checkpoint exists: its manifest is written. ``info`` has ``number`` and ``manifest``.

    Reverse registration order.
    """


@hookspec
def ckpt_resume(rt: Runtime, restarted: bool, aborted: bool) -> None:
    """RESUME: the program thread is about to continue.

    ``restarted`` is True after a restart; ``aborted`` is True when the
    checkpoint was aborted after ``ckpt_presuspend`` ran (undo what it did).
    Reverse registration order.
    """


# --------------------------------------------------------------------- restart: up
@hookspec
def ckpt_restart(rt: Runtime, image: ImageContents) -> None:
    """RESTART: in a new process, take your state back with ``image.get(key)``, recreate real
    resources and publish their new real IDs with ``rt.kv.publish``.

    Fires after ``ckpt_init``.  Reverse registration order.  A barrier follows.
    """


@hookspec
def ckpt_refresh(rt: Runtime) -> None:
    """REFRESH: every rank has published; subscribe to peers' new IDs and rebuild translations.

    Reverse registration order.  A barrier follows, then ``ckpt_resume(restarted=True)``.
    """


# --------------------------------------------------------------------- verbs
@hookspec
def ckpt_verbs_providers() -> dict[str, Any]:
    """Contribute verbs providers: ``{"tcp": factory}``; a factory builds a provider's operations table.

    Called once when ``ckpt.verbs`` first needs a provider.
    """
    raise NotImplementedError


@hookspec
def ckpt_wrap_verbs(rt: Runtime, ops: Any) -> None:
    """Wrap a provider's operations table once at start-up (replace entries of ``ops`` in place).

    Registration order: the first-registered plugin's wrappers are innermost.
    The wrapped table is what every ``Context`` dispatches through; the hot
    path never comes back through pluggy.
    """
