"""Plugin discovery and the plugin manager: entry points, --with-plugin, API check, hook order."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from ckpt._errors import CheckpointAborted, PluginError
from ckpt.plugin import CKPT_PLUGIN_API, ENTRY_POINT_GROUP, PROJECT, Phase, hookspecs

log = logging.getLogger(__name__)

#: The hooks that run down (in registration order): a phase hook's direction is its Phase's, every other
#: one's is declared in the ORDER table of its hookspecs module. The rest run up.
_PHASE_DOWN = frozenset(phase.hook for phase in Phase if phase.hook and phase.down)


def _down_hooks(module: Any) -> set[str]:
    return {hook for hook, direction in getattr(module, "ORDER", {}).items() if direction == "down"}


@dataclass(frozen=True)
class PluginInfo:
    """What `ckpt plugins` shows and what a manifest records."""

    name: str
    module: str
    version: str
    api: int
    order: int
    source: str  # "entry point <dist>" or "--with-plugin"
    hooks: tuple[str, ...] = field(default=())

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "module": self.module}


def discover(with_plugins: list[str], disabled: list[str]) -> list[tuple[str, Any, str]]:
    """(name, plugin object, source) for every entry point and every --with-plugin module."""
    found: list[tuple[str, Any, str]] = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in disabled:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {exc}") from None
        dist = ep.dist.name if ep.dist else "?"
        found.append((ep.name, plugin, f"entry point of {dist}"))
    for spec in dict.fromkeys(with_plugins):  # a module named twice is loaded once
        try:
            plugin = importlib.import_module(spec)
        except Exception as exc:
            raise PluginError(f"--with-plugin {spec}: cannot import it: {exc}") from None
        name = str(getattr(plugin, "CKPT_PLUGIN_NAME", spec.rpartition(".")[2]))
        if name in disabled:
            continue
        if any(plugin is other for _, other, _ in found):
            continue  # an installed plugin named again with --with-plugin
        if any(name == other for other, _, _ in found):
            raise PluginError(f"--with-plugin {spec}: a plugin named {name!r} is already installed")
        found.append((name, plugin, "--with-plugin"))
    return found


def _info(name: str, plugin: Any, source: str) -> PluginInfo:
    api = getattr(plugin, "CKPT_PLUGIN_API", None)
    if api != CKPT_PLUGIN_API:
        raise PluginError(
            f"plugin {name!r} declares CKPT_PLUGIN_API = {api!r}; this ckpt speaks API "
            f"{CKPT_PLUGIN_API} (set the attribute, or upgrade the plugin)"
        )
    module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
    hooks = tuple(sorted(n for n in dir(plugin) if n.startswith("ckpt_") and callable(getattr(plugin, n))))
    return PluginInfo(
        name=name,
        module=module,
        version=str(getattr(plugin, "__version__", "0")),
        api=int(api),
        order=int(getattr(plugin, "CKPT_PLUGIN_ORDER", 100)),
        source=source,
        hooks=hooks,
    )


class PluginHost:
    """One pluggy PluginManager plus the DMTCP ordering: down in registration order, up reversed."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._spec_modules: list[Any] = [hookspecs]
        self._down = set(_PHASE_DOWN) | _down_hooks(hookspecs)
        self.plugins: list[PluginInfo] = []
        #: `call`'s plan per hook, (function, argument names, plugin name) in order: a DSM hook fires per page
        #: diffed and per lock operation.  Renewed (`_changed`) whenever a plugin or hookspec has come or gone;
        #: a plan made from the plugins as they were before is not kept (hooks fire on several threads).
        self._plans: dict[str, list[tuple[Any, tuple[str, ...], str]]] = {}
        self._generation = 0
        self._changing = threading.Lock()

    def _changed(self) -> None:
        with self._changing:
            self._generation += 1
            self._plans = {}

    def load(self, with_plugins: list[str], disabled: list[str]) -> PluginHost:
        try:
            return self._load(with_plugins, disabled)
        finally:
            self._changed()

    def _load(self, with_plugins: list[str], disabled: list[str]) -> PluginHost:
        entries = [(_info(name, plugin, source), plugin) for name, plugin, source in discover(with_plugins, disabled)]
        for info, plugin in sorted(entries, key=lambda e: e[0].order):  # stable: ties keep discovery order
            try:
                self.pm.register(plugin, name=info.name)
                wrappers = [
                    f"{impl.plugin_name}.{caller.name}"
                    for caller in self.pm.get_hookcallers(plugin) or []
                    for impl in caller.get_hookimpls()
                    if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper)
                ]
                if wrappers:
                    self.pm.unregister(plugin)
                    raise PluginError(
                        f"plugin {info.name!r}: hook wrappers are not supported ({', '.join(wrappers)}); "
                        "ckpt calls hooks in its own down/up order"
                    )
            except (ValueError, pluggy.PluginValidationError) as exc:
                raise PluginError(f"plugin {info.name!r} cannot be registered: {exc}") from None
            self.plugins.append(info)
        for plugin in self.pm.get_plugins():  # a plugin may bring hookspecs of its own (the DSM's)
            specs = getattr(plugin, "CKPT_HOOKSPECS", None)
            if specs is not None:
                self.add_hookspecs(specs)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{exc} (a misspelt hook name?)") from None
        return self

    def add_hookspecs(self, module: Any) -> None:
        """Extra hookspecs (e.g. the DSM's) on the same manager, with their ORDER; adding one twice is a no-op."""
        if module not in self._spec_modules:
            self._spec_modules.append(module)
            self.pm.add_hookspecs(module)
            self._down |= _down_hooks(module)
            self._changed()

    def register(self, plugin: object, name: str) -> None:
        """Register an object whose hookimpls implement hooks (a DSM memory); validated at once."""
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except (ValueError, pluggy.PluginValidationError) as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            raise PluginError(f"{name!r} cannot be registered: {exc}") from None
        finally:
            self._changed()

    def unregister(self, plugin: object) -> None:
        try:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
        finally:
            self._changed()

    def has_impl(self, hook: str) -> bool:
        """Does any loaded plugin implement `hook`?"""
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def ordered_impls(self, hook: str) -> list[pluggy.HookImpl]:
        """The implementations of `hook` in the order `call` runs them (its direction's)."""
        # each priority class in registration order, whatever order pluggy keeps them in
        impls = getattr(self.pm.hook, hook).get_hookimpls()
        first = [i for i in impls if i.tryfirst]
        last = [i for i in impls if i.trylast][::-1]  # pluggy inserts trylast ones at the front
        normal = [i for i in impls if not (i.tryfirst or i.trylast)]
        if hook in self._down:
            ordered = first + normal + last
        else:
            ordered = first[::-1] + normal[::-1] + last[::-1]
        return ordered

    def call(self, hook: str, **kwargs: Any) -> list[Any]:
        """Run `hook` on every plugin in its direction's order; a failure names the plugin."""
        results = []
        plans = self._plans
        plan = plans.get(hook)
        if plan is None:
            generation = self._generation  # before the plugins are read: a change meanwhile moves it on
            plan = [(i.function, tuple(i.argnames), _named(i)) for i in self.ordered_impls(hook)]
            with self._changing:
                if generation == self._generation:
                    plans[hook] = plan
        for function, argnames, plugin_name in plan:
            try:
                result = function(**{name: kwargs[name] for name in argnames})
            except (PluginError, CheckpointAborted):
                raise
            except Exception as exc:
                raise PluginError(f"plugin {plugin_name!r} failed in {hook}: {type(exc).__name__}: {exc}") from exc
            if result is not None:
                results.append(result)
        return results


def _named(impl: pluggy.HookImpl) -> str:
    """How a failure names the plugin: its registered name -- but for an object `register`ed under a name made
    unique with its id (a DSM memory, a remote log: ``remotelog-140477407254992``), the package it comes from."""
    if isinstance(impl.plugin, ModuleType) or not impl.plugin_name.endswith(f"-{id(impl.plugin)}"):
        return impl.plugin_name
    return type(impl.plugin).__module__.split(".")[0]
