"""ckpt.verbs providers: the registry, the default provider, and wrappers of the operations table."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from verbs_util import connect_rc, poll_one, post_recv, send_wr

from ckpt import verbs as v
from ckpt.verbs import _provider

pytestmark = pytest.mark.timeout(60)

RECORDING = "recording"  # a provider of these tests: simib's entries under another name


def _simib_copy(provider: str) -> v.VerbsOps:
    base = _provider._factories["simib"]()
    return v.VerbsOps(provider, **{name: getattr(base, name) for name in v.OPERATIONS})


def _recording_factory() -> v.VerbsOps:
    return _simib_copy(RECORDING)


if RECORDING not in _provider._factories:
    v.register_provider(RECORDING, _recording_factory)


@pytest.fixture
def restore_tables() -> Iterator[None]:
    """Undo every wrapper a test adds: the tables are process-wide."""
    with _provider._lock:
        wrappers = list(_provider._wrappers)
        tables = dict(_provider._tables)
        entries = {name: dict(vars(ops)) for name, ops in tables.items()}
    try:
        yield
    finally:
        with _provider._lock:
            _provider._wrappers[:] = wrappers
            for name in list(_provider._tables):
                if name not in tables:
                    del _provider._tables[name]
            for name, ops in tables.items():
                vars(ops).clear()
                vars(ops).update(entries[name])
                _provider._tables[name] = ops


def _counting_wrapper(seen: list[tuple[str, int]]) -> Any:
    def wrap(ops: v.VerbsOps) -> None:
        inner = ops.post_send

        def post_send(qp: Any, wr: Any) -> None:
            seen.append((ops.provider, wr.wr_id))
            inner(qp, wr)

        ops.post_send = post_send  # type: ignore[method-assign]

    return wrap


def test_unknown_provider_names_the_available_ones() -> None:
    with pytest.raises(v.PyverbsRDMAError) as info:
        v.Context(name="nosuch0")
    assert "simib" in str(info.value) and "nosuch" in str(info.value)
    assert "simib" in v.providers() and RECORDING in v.providers()


def test_registered_provider_serves_contexts() -> None:
    with v.Context(name=f"{RECORDING}0") as ctx:
        assert ctx.provider == RECORDING
        assert ctx.ops is v.get_ops(RECORDING)
        assert ctx.query_port(1).state == v.IBV_PORT_ACTIVE


def test_provider_names_are_checked() -> None:
    with pytest.raises(ValueError):
        v.register_provider("Bad9", _recording_factory)
    v.get_ops("simib")
    with pytest.raises(v.PyverbsRDMAError):  # too late: its table is built and in use
        v.register_provider("simib", _recording_factory)


def test_env_chooses_the_default_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_VERBS_PROVIDER", RECORDING)
    with v.Context() as ctx:
        assert (ctx.provider, ctx.name) == (RECORDING, f"{RECORDING}0")
    monkeypatch.delenv("CKPT_VERBS_PROVIDER")
    with v.Context() as ctx:
        assert (ctx.provider, ctx.name) == ("simib", "simib0")


def test_get_ops_is_one_table_per_provider() -> None:
    ops = v.get_ops("simib")
    assert ops is v.get_ops("simib")
    assert all(callable(getattr(ops, name)) for name in v.OPERATIONS)
    with pytest.raises(TypeError):
        v.VerbsOps("broken", open_device=lambda name: None)


def test_wrapper_added_before_first_use_sees_every_post(restore_tables: None) -> None:
    name = "recordingfresh"
    if name not in _provider._factories:
        v.register_provider(name, lambda: _simib_copy(name))
    seen: list[tuple[str, int]] = []
    v.add_ops_wrapper(_counting_wrapper(seen))
    with v.Context(name=f"{name}0") as ca, v.Context(name=f"{name}1") as cb:
        a, b = connect_rc(ca, cb)
        post_recv(b)
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=31))
        poll_one(a.scq)
    assert (name, 31) in seen


def test_wrapper_added_late_sees_posts_of_new_qps(restore_tables: None) -> None:
    seen: list[tuple[str, int]] = []
    with v.Context(name="simib0") as ca, v.Context(name="simib1") as cb:
        v.add_ops_wrapper(_counting_wrapper(seen))
        a, b = connect_rc(ca, cb)
        post_recv(b)
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=41))
        assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert ("simib", 41) in seen


def test_wrapper_added_late_sees_posts_of_existing_qps(restore_tables: None) -> None:
    seen: list[tuple[str, int]] = []
    with v.Context(name="simib0") as ca, v.Context(name="simib1") as cb:
        a, b = connect_rc(ca, cb)
        v.add_ops_wrapper(_counting_wrapper(seen))
        post_recv(b)
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=51))
        assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert ("simib", 51) in seen


def test_restore_tables_leaves_no_wrapper_behind() -> None:
    from ckpt.verbs._qp import QPHandle

    assert v.get_ops("simib").post_send is QPHandle.post_send  # the engine's own entry, unwrapped


# ====================================================================== images across transports
def _tcp_registered() -> None:
    if "tcp" not in v.providers():
        import ckpt_ib2tcp

        ckpt_ib2tcp.register()


def test_an_images_transport_table_comes_back_as_the_active_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    _tcp_registered()
    monkeypatch.setenv(_provider.PROVIDER_ENV, "tcp")
    assert pickle.loads(pickle.dumps(v.get_ops("simib"))) is v.get_ops("tcp")
    monkeypatch.setenv(_provider.PROVIDER_ENV, "simib")
    assert pickle.loads(pickle.dumps(v.get_ops("tcp"))) is v.get_ops("simib")
    monkeypatch.delenv(_provider.PROVIDER_ENV)
    assert pickle.loads(pickle.dumps(v.get_ops("tcp"))) is v.get_ops("tcp")  # no active transport: itself


def test_other_providers_come_back_as_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    if "imageprov" not in v.providers():
        v.register_provider("imageprov", lambda: v.VerbsOps("imageprov", **_entries_of(v.get_ops("simib"))))
    monkeypatch.setenv(_provider.PROVIDER_ENV, "simib")
    assert pickle.loads(pickle.dumps(v.get_ops("imageprov"))) is v.get_ops("imageprov")


def _entries_of(ops: v.VerbsOps) -> dict[str, Any]:
    return {name: getattr(ops, name) for name in v.OPERATIONS}


def test_without_an_active_transport_each_transport_stays_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    _tcp_registered()
    monkeypatch.delenv(_provider.PROVIDER_ENV, raising=False)
    assert pickle.loads(pickle.dumps(v.get_ops("simib"))) is v.get_ops("simib")
    assert pickle.loads(pickle.dumps(v.get_ops("tcp"))) is v.get_ops("tcp")


def test_a_non_transport_active_provider_does_not_take_transport_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    _tcp_registered()
    monkeypatch.setenv(_provider.PROVIDER_ENV, RECORDING)  # Context() opens it, but it is no fabric
    assert pickle.loads(pickle.dumps(v.get_ops("simib"))) is v.get_ops("simib")
    assert pickle.loads(pickle.dumps(v.get_ops("tcp"))) is v.get_ops("tcp")


def test_a_throwaway_provider_comes_back_as_itself_whichever_transport_is_active(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pickle

    _tcp_registered()
    name = "imagethrowaway"
    if name not in v.providers():
        v.register_provider(name, lambda: v.VerbsOps(name, **_entries_of(v.get_ops("simib"))))
    for active in ("tcp", "simib"):
        monkeypatch.setenv(_provider.PROVIDER_ENV, active)
        back = pickle.loads(pickle.dumps(v.get_ops(name)))
        assert back is v.get_ops(name) and back.provider == name


def test_a_registered_transport_comes_back_as_the_active_one_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transport a plugin declares (the rank registers it) is interchangeable with simib."""
    import pickle

    monkeypatch.setattr(_provider, "_transports", set(_provider._transports))  # forgotten after the test
    name = "imagefabric"
    if name not in v.providers():
        v.register_provider(name, lambda: v.VerbsOps(name, **_entries_of(v.get_ops("simib"))))
    monkeypatch.setenv(_provider.PROVIDER_ENV, "simib")
    assert pickle.loads(pickle.dumps(v.get_ops(name))) is v.get_ops(name)  # not a transport yet: itself
    v.register_transport(name)
    assert name in v.transports() and "simib" in v.transports()
    assert pickle.loads(pickle.dumps(v.get_ops(name))) is v.get_ops("simib")
    monkeypatch.setenv(_provider.PROVIDER_ENV, name)
    assert pickle.loads(pickle.dumps(v.get_ops("simib"))) is v.get_ops(name)
    with pytest.raises(ValueError, match="lower-case letters"):
        v.register_transport("Fabric-2")
