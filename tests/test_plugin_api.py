"""The contract package ckpt.plugin: the phase order, each hook's direction, and what it exports."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from types import FunctionType

import pytest

import ckpt
from ckpt import plugin
from ckpt.plugin import Phase, hookspecs
from ckpt.runtime.plugins import PluginHost


def _specs() -> list[str]:
    return [
        name
        for name, fn in vars(hookspecs).items()
        if isinstance(fn, FunctionType) and hasattr(fn, "ckpt_spec") and fn.__module__ == hookspecs.__name__
    ]


def test_the_checkpoint_and_restart_sequences_come_from_next() -> None:
    assert [p.name for p in Phase.checkpoint_sequence()] == ["REACH", "PRESUSPEND", "DRAIN", "CHECKPOINT", "RESUME"]
    assert [p.name for p in Phase.restart_sequence()] == ["RESTART", "REFRESH", "RESUME"]


def test_phase_states_are_the_lower_case_status_words() -> None:
    assert [p.state for p in Phase] == [
        "presuspend",  # REACH: the ranks are on their way to parking
        "presuspend",
        "drain",
        "checkpoint",
        "resume",
        "restart",
        "refresh",
    ]


def test_every_phase_hook_is_a_hookspec_and_down_ends_at_checkpoint() -> None:
    specs = set(_specs())
    for phase in Phase:
        assert phase.hook is None or phase.hook in specs, phase
    assert [p.name for p in Phase if p.down] == ["REACH", "PRESUSPEND", "DRAIN", "CHECKPOINT"]


def test_every_hook_has_exactly_one_direction() -> None:
    phase_hooks = {p.hook for p in Phase if p.hook}
    for name in _specs():
        assert (name in phase_hooks) != (name in hookspecs.ORDER), f"{name}: a Phase hook or in ORDER, not both"
    assert set(hookspecs.ORDER) <= set(_specs()), "ORDER names a hook that does not exist"
    assert set(hookspecs.ORDER.values()) <= {"down", "up"}


def test_the_host_orders_hooks_as_the_contract_says() -> None:
    host = PluginHost()
    for phase in Phase:
        if phase.hook:
            assert (phase.hook in host._down) == phase.down
    for name, direction in hookspecs.ORDER.items():
        assert (name in host._down) == (direction == "down"), name


def test_every_hookspec_documents_itself_and_its_process() -> None:
    for name in _specs():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "Order:" in doc, f"{name}: its docstring does not state its order"
        assert "*launcher*" in doc or "*rank*" in doc, f"{name}: its docstring does not name its process"


def test_the_contract_exports_what_it_lists() -> None:
    for name in plugin.__all__:
        assert hasattr(plugin, name), name
    assert ckpt.hookimpl is plugin.hookimpl and ckpt.CKPT_PLUGIN_API == plugin.CKPT_PLUGIN_API == 2
    assert ckpt.VirtualIdTable is plugin.VirtualIdTable


def test_transport_and_job_info_are_frozen() -> None:
    transport = plugin.Transport("simib", default=True, native=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        transport.name = "other"  # type: ignore[misc]
    assert not plugin.Transport("tcp").default


def test_image_contents_refuses_a_key_twice() -> None:
    image = plugin.ImageContents()
    image.add("mine", 1)
    with pytest.raises(ckpt.PluginError, match="added twice"):
        image.add("mine", 2)
    assert image.get("mine") == 1 and "mine" in image and image.get("other", 3) == 3


def test_the_runtime_class_satisfies_the_runtime_protocol() -> None:
    members = {n for n in dir(plugin.Runtime) if not n.startswith("_")} | set(plugin.Runtime.__annotations__)
    concrete = set(dir(ckpt.Runtime)) | set(inspect.signature(ckpt.Runtime.__init__).parameters)
    source = inspect.getsource(ckpt.Runtime.__init__)
    missing = [m for m in members if m not in concrete and f"self.{m} " not in source and f"self.{m}:" not in source]
    assert not missing, f"ckpt.Runtime lacks {missing}"
    kv_members = {n for n in dir(plugin.KeyValue) if not n.startswith("_")}
    assert kv_members <= set(dir(ckpt.KeyValue))


def test_a_rank_scope_names_its_rank_and_a_job_scope_none() -> None:
    scope = Phase.rank_scope(2, "ckpt7")
    assert scope == "rank2.ckpt7" and Phase.DRAIN.barrier(scope) == "rank2.ckpt7:DRAIN"
    assert Phase.rank_of_scope(scope) == 2 and Phase.rank_of_scope("rank2.ckpt7:plugin:ib") == 2
    for job_wide in ("ckpt7", "gen3:RESTART", "rank:plugin", "rankx.ckpt1", "ib:published"):
        assert Phase.rank_of_scope(job_wide) is None, job_wide


def test_lazy_exports_import_a_name_s_module_only_when_it_is_first_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from ckpt.plugin import lazy_exports\n__getattr__ = lazy_exports(__name__, {'Heavy': '._heavy'})\n"
    )
    (package / "_heavy.py").write_text("class Heavy:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazypkg", raising=False)
    monkeypatch.delitem(sys.modules, "lazypkg._heavy", raising=False)
    import lazypkg  # type: ignore[import-not-found]

    assert "lazypkg._heavy" not in sys.modules
    assert "Heavy" in dir(lazypkg) and "lazypkg._heavy" not in sys.modules  # listed, not imported
    heavy = lazypkg.Heavy
    assert "lazypkg._heavy" in sys.modules and heavy is sys.modules["lazypkg._heavy"].Heavy
    assert vars(lazypkg)["Heavy"] is heavy  # kept: the next use is a plain attribute
    with pytest.raises(AttributeError, match="has no attribute 'Light'"):
        _ = lazypkg.Light
