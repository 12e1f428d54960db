"""The launcher's side of plugins: the transports they offer, the commands they add, the services of a job."""

# The core names no transport and no plugin: what `--transport` accepts, which commands
# beyond the core ones `ckpt` has, and what runs beside a job's coordinator (a fabric's
# subnet manager ...) all come from the hooks here.  Hooks are called one implementation
# at a time (in the order PluginHost.call uses) because the launcher must know which
# plugin said what: a duplicate transport or command is refused naming both, and
# `ckpt_job_stop` is called only for the plugins whose `ckpt_job_start` returned.

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ckpt._errors import CkptError, PluginError
from ckpt.plugin import JobInfo, Transport

if TYPE_CHECKING:
    import click
    import pluggy

    from ckpt.runtime.plugins import PluginHost


@functools.cache
def launcher_host(with_plugins: tuple[str, ...] = (), disabled: tuple[str, ...] = ()) -> PluginHost:
    """The plugins of this `ckpt` command, loaded once per set of --with-plugin / --disable-plugin."""
    from ckpt.runtime.plugins import PluginHost

    return PluginHost().load(list(with_plugins), list(disabled))


def _call(impl: pluggy.HookImpl, hook: str, **kwargs: Any) -> Any:
    """One plugin's implementation of `hook`. A CkptError is the plugin's own one-line message and
    passes as it is; anything else is a bug of the plugin, reported with its name."""
    try:
        return impl.function(**{name: kwargs[name] for name in impl.argnames})
    except CkptError:
        raise
    except Exception as exc:
        raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook}: {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------ transports
def offered_transports(host: PluginHost) -> dict[str, tuple[Transport, str]]:
    """{name: (transport, the plugin declaring it)} of every loaded plugin's ckpt_transports."""
    offered: dict[str, tuple[Transport, str]] = {}
    for impl in host.ordered_impls("ckpt_transports"):
        for transport in _call(impl, "ckpt_transports") or []:
            if not isinstance(transport, Transport):
                raise PluginError(
                    f"plugin {impl.plugin_name!r}: ckpt_transports returned {transport!r}, not a ckpt.plugin.Transport"
                )
            if not re.fullmatch(r"[a-z][a-z_]*", transport.name):
                raise PluginError(
                    f"plugin {impl.plugin_name!r} declares transport {transport.name!r}: a provider name is "
                    "lower-case letters and '_'"
                )
            if transport.name in offered:
                raise PluginError(
                    f"transport {transport.name!r} is declared by two plugins, "
                    f"{offered[transport.name][1]!r} and {impl.plugin_name!r}"
                )
            offered[transport.name] = (transport, impl.plugin_name)
    return offered


def resolve_transport(
    with_plugins: tuple[str, ...], disabled: tuple[str, ...], name: str | None, *, native: bool
) -> str:
    """The transport a job runs on: `name` (None: the default one) if a loaded plugin offers it and,
    under --native, if the ranks have its provider without plugins; one clear line otherwise."""
    offered = offered_transports(launcher_host(with_plugins, disabled))
    installed = ", ".join(sorted(offered)) or "none"
    if name is None:
        defaults = sorted(n for n, (transport, _) in offered.items() if transport.default)
        if len(defaults) > 1:
            raise CkptError(f"transports {', '.join(defaults)} each say they are the default: pass --transport NAME")
        if not defaults:
            raise CkptError(f"no installed transport is the default (installed: {installed}): pass --transport NAME")
        name = defaults[0]
    if name not in offered:
        _refuse_disabled(with_plugins, disabled, name)
        raise CkptError(f"unknown transport {name!r} (installed: {installed})")
    transport, plugin = offered[name]
    if native and not transport.native:
        raise CkptError(f"--transport {name} is provided by the {plugin} plugin, and --native ranks load no plugins")
    return name


def _refuse_disabled(with_plugins: tuple[str, ...], disabled: tuple[str, ...], name: str) -> None:
    """Say so when the transport is missing because --disable-plugin turned its plugin off."""
    if not disabled:
        return
    try:
        everything = offered_transports(launcher_host(with_plugins, ()))
    except CkptError:
        return  # a disabled plugin that cannot even load: the plain "unknown transport" line says enough
    if name in everything and everything[name][1] in disabled:
        raise CkptError(
            f"--transport {name} is provided by the {everything[name][1]} plugin, which --disable-plugin turns off"
        )


def contributions(host: PluginHost) -> dict[str, dict[str, list[str]]]:
    """{plugin: {"transports": [...], "default_transport": [...], "commands": [...]}} for `ckpt plugins`."""
    found: dict[str, dict[str, list[str]]] = {}

    def of(plugin: str) -> dict[str, list[str]]:
        return found.setdefault(plugin, {"transports": [], "default_transport": [], "commands": []})

    for info in host.plugins:
        of(info.name)
    for name, (transport, plugin) in sorted(offered_transports(host).items()):
        of(plugin)["transports"].append(name)
        if transport.default:
            of(plugin)["default_transport"].append(name)
    for impl in host.ordered_impls("ckpt_cli_commands"):
        for command in _call(impl, "ckpt_cli_commands") or []:
            of(impl.plugin_name)["commands"].append(str(getattr(command, "name", command)))
    return found


# ------------------------------------------------------------------ single-rank recovery
def check_single_rank_recovery(host: PluginHost, job: JobInfo) -> None:
    """``--on-failure recover`` is for jobs whose plugins can bring one rank back among live peers.

    DESIGN.md §8: accepted only when every plugin with cross-rank state agrees.  Every plugin is asked
    (none may silence another by answering first): None, no cross-rank state; True, it recovers its
    own; a list of plugin names, True and it answers for those too; a string, it refuses.  The launch
    is refused, in one line naming the first (in the hook's order) such plugin, iff a refusal is not
    covered by another plugin's list.
    """
    refusals: dict[str, str] = {}
    covered: dict[str, str] = {}  # plugin -> the plugin that answers for it
    for impl in host.ordered_impls("ckpt_single_rank_recovery"):
        answer = _call(impl, "ckpt_single_rank_recovery", job=job)
        name = impl.plugin_name
        if answer is None or answer is True:
            continue
        if isinstance(answer, str) and answer.strip():
            refusals.setdefault(name, answer.strip())
        elif isinstance(answer, list) and all(isinstance(other, str) and other for other in answer):
            covered.update({other: name for other in answer if other != name})
        else:
            raise PluginError(
                f"plugin {name!r}: ckpt_single_rank_recovery returned {answer!r}, "
                "not True, a list of plugin names, a one-line reason or None"
            )
    for name, reason in refusals.items():
        if name not in covered:
            raise CkptError(f"--on-failure recover: plugin {name!r} cannot recover a single rank: {reason}")


# ------------------------------------------------------------------ commands
def plugin_commands(taken: Collection[str]) -> dict[str, click.Command]:
    """The commands installed plugins add to `ckpt` (ckpt_cli_commands); a name already taken is refused."""
    import click

    commands: dict[str, click.Command] = {}
    for impl in launcher_host().ordered_impls("ckpt_cli_commands"):
        for command in _call(impl, "ckpt_cli_commands") or []:
            if not isinstance(command, click.Command) or not command.name:
                raise PluginError(
                    f"plugin {impl.plugin_name!r}: ckpt_cli_commands returned {command!r}, not a named click command"
                )
            if command.name in taken or command.name in commands:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} adds the command {command.name!r}, which is already taken"
                )
            commands[command.name] = command
    return commands


# ------------------------------------------------------------------ a job's services
class JobServices:
    """What plugins start with a job (ckpt_job_start, down) and stop after it (ckpt_job_stop, up)."""

    def __init__(self, host: PluginHost, job: JobInfo) -> None:
        self.host = host
        self.job = job
        self._started: list[str] = []  # the plugins whose ckpt_job_start returned
        self._complete = False  # every start returned: stop every plugin

    def start(self) -> dict[str, str]:
        """Call every plugin's ckpt_job_start; the environment they return, merged for the ranks.

        If one fails, the ones that had returned are stopped before the error goes on.
        """
        env: dict[str, str] = {}
        try:
            for impl in self.host.ordered_impls("ckpt_job_start"):
                returned = _call(impl, "ckpt_job_start", job=self.job)
                self._started.append(impl.plugin_name)
                if returned is None:
                    continue
                if not isinstance(returned, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in returned.items()
                ):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r}: ckpt_job_start returned {returned!r}, "
                        "not a dict of environment variables (str: str)"
                    )
                env.update(returned)
        except BaseException:
            with contextlib.suppress(CkptError):  # the failed start is what to report, not a stop after it
                self.stop()
            raise
        self._complete = True
        return env

    def stop(self) -> None:
        """Call ckpt_job_stop (in reverse order) for the plugins started; every one runs even if one fails,
        then the first failure is raised. Calling it again does nothing."""
        failures: list[CkptError] = []
        for impl in self.host.ordered_impls("ckpt_job_stop"):
            if not (self._complete or impl.plugin_name in self._started):
                continue
            try:
                _call(impl, "ckpt_job_stop", job=self.job)
            except CkptError as exc:
                failures.append(exc)
        self._started.clear()
        self._complete = False
        if failures:
            raise failures[0]
