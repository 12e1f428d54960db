"""Unit tests of plugin discovery, the API check and the DMTCP hook order of PluginHost."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt import plugin as hookspecs
from ckpt._errors import CkptError, PluginError
from ckpt.plugin import ENTRY_POINT_GROUP, ImageContents, hookimpl
from ckpt.runtime.plugins import PluginHost, discover

DOWN = ("ckpt_presuspend", "ckpt_drain", "ckpt_precheckpoint", "ckpt_init")
UP = ("ckpt_resume", "ckpt_restart", "ckpt_refresh", "ckpt_checkpointed")

RT = object()


def hook_kwargs(hook: str) -> dict[str, Any]:
    """The keyword arguments the runtime passes to `hook`."""
    extra: dict[str, dict[str, Any]] = {
        "ckpt_precheckpoint": {"image": ImageContents()},
        "ckpt_restart": {"image": ImageContents()},
        "ckpt_resume": {"restarted": False, "aborted": False},
        "ckpt_checkpointed": {"info": {"number": 1, "manifest": "m.json"}},
    }
    return {"rt": RT, **extra.get(hook, {})}


def installed() -> list[str]:
    """Names of the entry-point plugins really installed: disabled so that tests see only their own."""
    return [ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]


@pytest.fixture
def new_modules(tmp_path: Path) -> Iterator[None]:
    """Forget the modules a test imported from its tmp_path (entry-point and file plugins)."""
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def log() -> list[tuple[str, str]]:
    return []


@pytest.fixture
def make_plugin(monkeypatch: pytest.MonkeyPatch, log: list[tuple[str, str]]) -> Callable[..., types.ModuleType]:
    """make_plugin(name, hooks=..., tryfirst=False, trylast=False, **attrs) -> a module in sys.modules.

    Each hook appends (plugin name, hook name) to `log`.
    """

    def make(
        name: str,
        hooks: tuple[str, ...] = DOWN + UP,
        *,
        tryfirst: bool = False,
        trylast: bool = False,
        api: object = hookspecs.CKPT_PLUGIN_API,
        **attrs: Any,
    ) -> types.ModuleType:
        module = types.ModuleType(name)
        if api is not None:
            module.CKPT_PLUGIN_API = api  # type: ignore[attr-defined]
        for key, value in attrs.items():
            setattr(module, key, value)
        for hook in hooks:
            setattr(module, hook, hookimpl(tryfirst=tryfirst, trylast=trylast)(_recorder(log, name, hook)))
        monkeypatch.setitem(sys.modules, name, module)
        return module

    return make


def _recorder(log: list[tuple[str, str]], plugin: str, hook: str) -> Callable[..., str]:
    def impl(rt: object) -> str:
        assert rt is RT
        log.append((plugin, hook))
        return plugin

    return impl


def load(*names: str) -> PluginHost:
    return PluginHost().load(list(names), installed())


def order(log: list[tuple[str, str]], hook: str) -> list[str]:
    return [plugin for plugin, h in log if h == hook]


# ----------------------------------------------------------------- no plugins
def test_the_framework_works_with_no_plugin() -> None:
    host = load()
    assert host.plugins == []
    for hook in DOWN + UP:
        assert host.call(hook, **hook_kwargs(hook)) == []


# ----------------------------------------------------------------- API version
def test_a_plugin_without_an_api_version_is_refused(make_plugin: Callable[..., Any]) -> None:
    make_plugin("noapi", api=None)
    with pytest.raises(PluginError, match=r"plugin 'noapi' declares CKPT_PLUGIN_API = None; this ckpt speaks API 2"):
        load("noapi")


@pytest.mark.parametrize("api", [0, 1, 3, "2"])
def test_a_plugin_with_another_api_version_is_refused(make_plugin: Callable[..., Any], api: object) -> None:
    make_plugin("oldapi", api=api)
    with pytest.raises(PluginError, match=rf"declares CKPT_PLUGIN_API = {api!r}"):
        load("oldapi")


def test_plugin_error_is_a_ckpt_error() -> None:
    assert issubclass(PluginError, CkptError)


# ----------------------------------------------------------------- --with-plugin
def test_with_plugin_that_cannot_be_imported() -> None:
    with pytest.raises(PluginError, match=r"--with-plugin ckpt_no_such_plugin_xyz: cannot import it: No module named"):
        load("ckpt_no_such_plugin_xyz")


def test_with_plugin_whose_import_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_modules: None) -> None:
    (tmp_path / "ckpt_raising_plugin.py").write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"--with-plugin ckpt_raising_plugin: cannot import it: half-installed"):
        load("ckpt_raising_plugin")


def test_with_plugin_records_its_info(make_plugin: Callable[..., Any]) -> None:
    make_plugin("pkg_for_test.sub.myplug", hooks=("ckpt_drain", "ckpt_resume"), __version__="2.5")
    host = load("pkg_for_test.sub.myplug")
    (info,) = host.plugins
    assert info.name == "myplug"  # the last dotted component
    assert info.module == "pkg_for_test.sub.myplug"
    assert info.version == "2.5"
    assert info.api == 2
    assert info.order == 100
    assert info.source == "--with-plugin"
    assert info.hooks == ("ckpt_drain", "ckpt_resume")
    assert info.record() == {"name": "myplug", "version": "2.5", "module": "pkg_for_test.sub.myplug"}


def test_with_plugin_name_from_ckpt_plugin_name(make_plugin: Callable[..., Any]) -> None:
    make_plugin("mod_a", CKPT_PLUGIN_NAME="fancy")
    assert [p.name for p in load("mod_a").plugins] == ["fancy"]


def test_two_plugins_with_one_name_are_refused(make_plugin: Callable[..., Any]) -> None:
    make_plugin("mod_a", CKPT_PLUGIN_NAME="same")
    make_plugin("mod_b", CKPT_PLUGIN_NAME="same")
    with pytest.raises(PluginError, match=r"--with-plugin mod_b: a plugin named 'same' is already installed"):
        load("mod_a", "mod_b")


def test_a_disabled_with_plugin_is_skipped(make_plugin: Callable[..., Any], log: list[tuple[str, str]]) -> None:
    make_plugin("keep")
    make_plugin("drop")
    host = PluginHost().load(["keep", "drop"], [*installed(), "drop"])
    assert [p.name for p in host.plugins] == ["keep"]
    host.call("ckpt_drain", rt=RT)
    assert order(log, "ckpt_drain") == ["keep"]


def test_an_implementation_with_unknown_arguments_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("badargs")
    module.CKPT_PLUGIN_API = 2  # type: ignore[attr-defined]

    @hookimpl
    def ckpt_drain(rt: object, bogus: int) -> None:
        raise AssertionError("never called")

    module.ckpt_drain = ckpt_drain  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "badargs", module)
    with pytest.raises(PluginError, match="plugin 'badargs' cannot be registered"):
        load("badargs")


# ----------------------------------------------------------------- hook order
@pytest.mark.parametrize("hook", DOWN)
def test_down_hooks_run_in_registration_order(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]], hook: str
) -> None:
    for name in ("lower", "middle", "upper"):
        make_plugin(name)
    host = load("lower", "middle", "upper")
    assert [p.name for p in host.plugins] == ["lower", "middle", "upper"]
    assert host.call(hook, **hook_kwargs(hook)) == ["lower", "middle", "upper"]
    assert order(log, hook) == ["lower", "middle", "upper"]


@pytest.mark.parametrize("hook", UP)
def test_up_hooks_run_in_reverse_registration_order(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]], hook: str
) -> None:
    for name in ("lower", "middle", "upper"):
        make_plugin(name)
    host = load("lower", "middle", "upper")
    assert host.call(hook, **hook_kwargs(hook)) == ["upper", "middle", "lower"]
    assert order(log, hook) == ["upper", "middle", "lower"]


def test_a_plugin_without_a_hook_is_skipped(make_plugin: Callable[..., Any], log: list[tuple[str, str]]) -> None:
    make_plugin("a")
    make_plugin("b", hooks=("ckpt_resume",))
    make_plugin("c")
    host = load("a", "b", "c")
    host.call("ckpt_drain", rt=RT)
    host.call("ckpt_resume", **hook_kwargs("ckpt_resume"))
    assert order(log, "ckpt_drain") == ["a", "c"]
    assert order(log, "ckpt_resume") == ["c", "b", "a"]


def test_hooks_receive_the_arguments_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    module = types.ModuleType("argplug")
    module.CKPT_PLUGIN_API = 2  # type: ignore[attr-defined]

    @hookimpl
    def ckpt_precheckpoint(image: ImageContents, rt: object) -> None:
        image.add("argplug", {"rt": rt is RT})

    @hookimpl
    def ckpt_resume(aborted: bool) -> None:
        seen["aborted"] = aborted

    module.ckpt_precheckpoint = ckpt_precheckpoint  # type: ignore[attr-defined]
    module.ckpt_resume = ckpt_resume  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "argplug", module)
    host = load("argplug")
    image = ImageContents()
    host.call("ckpt_precheckpoint", rt=RT, image=image)
    host.call("ckpt_resume", rt=RT, restarted=False, aborted=True)
    assert image.get("argplug") == {"rt": True}
    assert seen == {"aborted": True}


@pytest.mark.parametrize(
    ("hook", "expected"), [*[(h, ["B", "A", "C", "D"]) for h in DOWN], *[(h, ["B", "C", "A", "D"]) for h in UP]]
)
def test_tryfirst_and_trylast_hold_in_both_directions(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]], hook: str, expected: list[str]
) -> None:
    make_plugin("A")
    make_plugin("B", tryfirst=True)
    make_plugin("C")
    make_plugin("D", trylast=True)
    host = load("A", "B", "C", "D")
    host.call(hook, **hook_kwargs(hook))
    assert order(log, hook) == expected


def test_several_tryfirst_plugins_keep_the_direction_order(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]]
) -> None:
    make_plugin("A")
    make_plugin("F1", tryfirst=True)
    make_plugin("F2", tryfirst=True)
    host = load("A", "F1", "F2")
    host.call("ckpt_drain", rt=RT)
    host.call("ckpt_refresh", rt=RT)
    assert order(log, "ckpt_drain") == ["F1", "F2", "A"]
    assert order(log, "ckpt_refresh") == ["F2", "F1", "A"]


def test_several_trylast_plugins_run_in_registration_order_on_the_way_down(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]]
) -> None:
    make_plugin("A")
    make_plugin("L1", trylast=True)
    make_plugin("L2", trylast=True)
    host = load("A", "L1", "L2")
    host.call("ckpt_drain", rt=RT)
    assert order(log, "ckpt_drain") == ["A", "L1", "L2"]


def test_several_trylast_plugins_run_in_reverse_order_on_the_way_up(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]]
) -> None:
    make_plugin("A")
    make_plugin("L1", trylast=True)
    make_plugin("L2", trylast=True)
    host = load("A", "L1", "L2")
    host.call("ckpt_refresh", rt=RT)
    assert order(log, "ckpt_refresh") == ["A", "L2", "L1"]


def test_ckpt_plugin_order_sorts_registration(make_plugin: Callable[..., Any], log: list[tuple[str, str]]) -> None:
    make_plugin("top", CKPT_PLUGIN_ORDER=300)
    make_plugin("bottom", CKPT_PLUGIN_ORDER=10)
    make_plugin("mid1")  # default 100
    make_plugin("mid2", CKPT_PLUGIN_ORDER=100)
    host = load("top", "mid1", "bottom", "mid2")
    assert [(p.name, p.order) for p in host.plugins] == [("bottom", 10), ("mid1", 100), ("mid2", 100), ("top", 300)]
    host.call("ckpt_presuspend", rt=RT)
    host.call("ckpt_resume", **hook_kwargs("ckpt_resume"))
    assert order(log, "ckpt_presuspend") == ["bottom", "mid1", "mid2", "top"]
    assert order(log, "ckpt_resume") == ["top", "mid2", "mid1", "bottom"]


# ----------------------------------------------------------------- failures inside hooks
@pytest.mark.parametrize("hook", ["ckpt_drain", "ckpt_refresh"])
def test_a_failing_hook_raises_plugin_error_naming_the_plugin(
    make_plugin: Callable[..., Any], log: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    make_plugin("first")
    bad = make_plugin("bad")
    make_plugin("last")

    @hookimpl
    def failing(rt: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(bad, hook, failing)
    host = load("first", "bad", "last")
    with pytest.raises(PluginError, match=rf"plugin 'bad' failed in {hook}: RuntimeError: boom") as info:
        host.call(hook, rt=RT)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "bad" not in order(log, hook)
    # the failure stops the chain: plugins after it (in this direction) are not called
    assert order(log, hook) == (["first"] if hook in DOWN else ["last"])


def test_a_plugin_error_from_a_hook_passes_through(
    make_plugin: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = make_plugin("bad")

    @hookimpl
    def failing(rt: object) -> None:
        raise PluginError("bad: its own clear message")

    monkeypatch.setattr(bad, "ckpt_presuspend", failing)
    host = load("bad")
    with pytest.raises(PluginError, match=r"^bad: its own clear message$"):
        host.call("ckpt_presuspend", rt=RT)


class _Registered:
    """An object a library registers at run time (as the DSM and ckpt_remotelog register theirs)."""

    @hookimpl
    def ckpt_presuspend(self, rt: object) -> None:
        raise RuntimeError("boom")


def test_an_object_registered_under_a_name_made_unique_by_its_id_is_named_by_its_package() -> None:
    """`remotelog-140477407254992` means nothing to a user: the failure names the package (here this test
    module's); a name chosen without the id is kept as it is."""
    for name, shown in [("{id}", "test_plugins"), ("recorder", "recorder")]:
        host, thing = PluginHost(), _Registered()
        host.register(thing, name.format(id=f"library-{id(thing)}"))
        with pytest.raises(PluginError, match=rf"^plugin '{shown}' failed in ckpt_presuspend: RuntimeError: boom$"):
            host.call("ckpt_presuspend", rt=RT)


def test_a_wrapper_hookimpl_is_run_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    module = types.ModuleType("wrapplug")
    module.CKPT_PLUGIN_API = 2  # type: ignore[attr-defined]

    @hookimpl(wrapper=True)
    def ckpt_drain(rt: object) -> Iterator[None]:
        calls.append("before")
        result = yield
        calls.append("after")
        return result

    module.ckpt_drain = ckpt_drain  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wrapplug", module)
    try:
        host = load("wrapplug")
    except PluginError:
        return  # refusing wrappers at load time is fine too
    host.call("ckpt_drain", rt=RT)
    assert calls == ["before", "after"]


# ----------------------------------------------------------------- extra hookspecs
def test_extra_hookspecs_join_the_same_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = types.ModuleType("dsm_specs_for_test")

    @hookspecs.hookspec
    def dsm_barrier_passed(rt: object, number: int) -> None:
        """A DSM barrier completed."""

    specs.dsm_barrier_passed = dsm_barrier_passed  # type: ignore[attr-defined]
    plugin = types.ModuleType("dsmplug")
    plugin.CKPT_PLUGIN_API = 2  # type: ignore[attr-defined]

    @hookimpl
    def dsm_barrier_passed_impl(number: int) -> int:
        return number * 2

    plugin.dsm_barrier_passed = dsm_barrier_passed_impl  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsmplug", plugin)
    host = PluginHost()
    host.add_hookspecs(specs)
    host.load(["dsmplug"], installed())
    assert host.call("dsm_barrier_passed", rt=RT, number=21) == [42]


class Resumed:
    """A registered object (as a DSM memory is) whose ckpt_resume says who was called."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    @hookimpl
    def ckpt_resume(self) -> None:
        self.seen.append(self.name)


def _resumed(host: PluginHost, seen: list[str]) -> list[str]:
    """Who a ckpt_resume call reaches, in name order."""
    seen.clear()
    host.call("ckpt_resume", rt=RT)
    return sorted(seen)


def test_an_object_registered_or_unregistered_after_a_hook_fired_is_seen_by_the_next_call() -> None:
    """`call` keeps each hook's plan (order, argument names) between calls: a registration must renew it."""
    host, seen = PluginHost(), list[str]()
    first, second = Resumed("first", seen), Resumed("second", seen)
    host.register(first, "first")
    assert _resumed(host, seen) == ["first"]
    host.register(second, "second")
    assert _resumed(host, seen) == ["first", "second"]
    host.unregister(first)
    assert _resumed(host, seen) == ["second"]


def test_a_plan_made_while_a_plugin_comes_or_goes_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks fire on several threads (the DSM's handler): one may make a plan from the plugins as they were while
    another registers or unregisters one.  That plan must not outlive the change."""
    host, seen = PluginHost(), list[str]()

    def during(change: Any) -> Any:
        def changing(*args: Any, **kwargs: Any) -> Any:
            host.call("ckpt_resume", rt=RT)  # another thread's hook, in the middle of the change
            return change(*args, **kwargs)

        return changing

    first, second = Resumed("first", seen), Resumed("second", seen)
    host.register(first, "first")
    monkeypatch.setattr(host.pm, "register", during(host.pm.register))
    monkeypatch.setattr(host.pm, "unregister", during(host.pm.unregister))
    host.register(second, "second")
    assert _resumed(host, seen) == ["first", "second"]
    host.unregister(first)
    assert _resumed(host, seen) == ["second"]


# ----------------------------------------------------------------- image contents
def test_image_contents_add_and_get() -> None:
    image = ImageContents()
    image.add("ib", {"qps": [1, 2]})
    assert image.get("ib") == {"qps": [1, 2]}
    assert "ib" in image and "apm" not in image
    assert image.get("apm") is None
    assert image.get("apm", "default") == "default"
    assert image.items == {"ib": {"qps": [1, 2]}}


def test_image_contents_refuses_a_duplicate_key() -> None:
    image = ImageContents()
    image.add("ib", 1)
    with pytest.raises(PluginError, match="image key 'ib' was added twice"):
        image.add("ib", 2)
    assert image.get("ib") == 1


def test_image_contents_from_items_copies_them() -> None:
    items = {"ib": 1}
    image = ImageContents(items)
    image.add("apm", 2)
    assert items == {"ib": 1}
    assert image.get("ib") == 1


# ----------------------------------------------------------------- entry points
class ObjectPlugin:
    """A plugin that is an object, not a module."""

    CKPT_PLUGIN_API = 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def ckpt_drain(self, rt: object) -> str:
        self.calls.append("drain")
        return "object"


def fake_distribution(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Write what `pip install` would leave in site-packages for distribution `dist`."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


PLUGIN_SOURCE = """\
from ckpt.plugin import hookimpl

CKPT_PLUGIN_API = 2
__version__ = "0.1"
CALLS = []


@hookimpl
def ckpt_drain(rt):
    CALLS.append("drain")
    return "myplug"
"""


@pytest.fixture
def myplug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_modules: None) -> Path:
    fake_distribution(tmp_path, "myplug", {"myplug": "myplugmod"}, {"myplugmod": PLUGIN_SOURCE})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_discover_finds_an_installed_entry_point(myplug: Path) -> None:
    found = {name: (plugin, source) for name, plugin, source in discover([], [])}
    plugin, source = found["myplug"]
    assert isinstance(plugin, types.ModuleType) and plugin.__name__ == "myplugmod"
    assert source == "entry point of myplug"


def test_plugin_host_loads_and_calls_an_entry_point_plugin(myplug: Path) -> None:
    others = [name for name in installed() if name != "myplug"]
    host = PluginHost().load([], others)
    (info,) = host.plugins
    assert (info.name, info.module, info.version, info.source) == (
        "myplug",
        "myplugmod",
        "0.1",
        "entry point of myplug",
    )
    assert info.hooks == ("ckpt_drain",)
    assert host.call("ckpt_drain", rt=RT) == ["myplug"]
    assert sys.modules["myplugmod"].CALLS == ["drain"]


def test_a_disabled_entry_point_is_not_even_imported(myplug: Path) -> None:
    assert "myplug" not in [name for name, _, _ in discover([], ["myplug"])]
    assert "myplugmod" not in sys.modules


def test_with_plugin_may_not_shadow_an_entry_point(myplug: Path, make_plugin: Callable[..., Any]) -> None:
    make_plugin("other_module", CKPT_PLUGIN_NAME="myplug")
    others = [name for name in installed() if name != "myplug"]
    with pytest.raises(PluginError, match="a plugin named 'myplug' is already installed"):
        PluginHost().load(["other_module"], others)


def test_entry_points_and_with_plugins_are_ordered_together(
    myplug: Path, make_plugin: Callable[..., Any], log: list[tuple[str, str]]
) -> None:
    make_plugin("below", hooks=("ckpt_drain",), CKPT_PLUGIN_ORDER=50)
    make_plugin("above", hooks=("ckpt_drain",))
    others = [name for name in installed() if name != "myplug"]
    host = PluginHost().load(["above", "below"], others)
    # below (50), then myplug (100, discovered first), then above (100)
    assert [p.name for p in host.plugins] == ["below", "myplug", "above"]
    assert host.call("ckpt_drain", rt=RT) == ["below", "myplug", "above"]


def test_an_entry_point_that_fails_to_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_modules: None
) -> None:
    fake_distribution(tmp_path, "brokenplug", {"broken": "brokenmod"}, {"brokenmod": "import ckpt_not_there_xyz\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"plugin 'broken' \(brokenmod\) failed to import: No module named"):
        discover([], [])
    assert "broken" not in [name for name, _, _ in discover([], ["broken"])]


def test_an_entry_point_with_the_wrong_api_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_modules: None
) -> None:
    source = PLUGIN_SOURCE.replace("CKPT_PLUGIN_API = 2", "CKPT_PLUGIN_API = 7")
    fake_distribution(tmp_path, "oldplug", {"oldplug": "oldplugmod"}, {"oldplugmod": source})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="plugin 'oldplug' declares CKPT_PLUGIN_API = 7"):
        PluginHost().load([], [n for n in installed() if n != "oldplug"])


def test_an_entry_point_may_name_a_plugin_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_modules: None
) -> None:
    source = "from tests_objplug_support import make\nPLUGIN = make()\n"
    support = types.ModuleType("tests_objplug_support")
    support.make = ObjectPlugin  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests_objplug_support", support)
    fake_distribution(tmp_path, "objplug", {"objplug": "objplugmod:PLUGIN"}, {"objplugmod": source})
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost().load([], [n for n in installed() if n != "objplug"])
    (info,) = host.plugins
    assert info.name == "objplug"
    assert info.module == __name__  # the object's class module
    assert info.hooks == ("ckpt_drain",)
    assert host.call("ckpt_drain", rt=RT) == ["object"]
    assert sys.modules["objplugmod"].PLUGIN.calls == ["drain"]


def test_a_misspelt_hook_is_refused(make_plugin: Callable[..., types.ModuleType]) -> None:
    make_plugin("typo", hooks=())
    sys.modules["typo"].ckpt_presupend = hookimpl(lambda rt: None)  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match=r"ckpt_presupend.*misspelt"):
        load("typo")
