"""The coordinator's typed operations (ckpt.coordinator.protocol) and the dispatch table derived from them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt._errors import CoordinatorError, ProtocolError
from ckpt.coordinator import protocol, server
from ckpt.coordinator.client import CoordinatorClient
from ckpt.coordinator.server import Coordinator

TOKEN = "ops-token-0123456789"
WAIT = 5.0


def test_every_op_has_a_request_type_and_a_handler() -> None:
    assert set(protocol.REQUESTS) == set(protocol.Op)
    assert protocol.OPS == {op.value for op in protocol.Op}
    assert set(server._HANDLERS) == set(protocol.REQUESTS.values())
    for op, kind in protocol.REQUESTS.items():
        assert server._HANDLERS[kind] is getattr(Coordinator, f"_op_{op.value}")


def test_an_op_without_a_handler_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(Coordinator, "_op_kill")
    with pytest.raises(AssertionError, match="without a handler: kill"):
        server._handlers()


def test_a_request_is_parsed_into_its_type() -> None:
    message = {"v": 2, "op": "subscribe", "id": 7, "ns": "n", "key": "k", "timeout": 3, "newer_field": 1}
    request = protocol.parse_request(message, protocol.ROLE_RANK)
    assert request == protocol.Subscribe(id=7, ns="n", key="k", timeout=3.0)
    assert isinstance(request.timeout, float) and request.count == 1 and request.prefix is False


def test_values_pass_through_untouched() -> None:
    value = {1: b"\x00bytes", "list": [1, 2.5, None], "nested": {"k": (1, 2)}}
    request = protocol.parse_request({"op": "publish", "ns": "n", "key": "k", "value": value}, protocol.ROLE_RANK)
    assert isinstance(request, protocol.Publish) and request.value == value


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"op": "publish", "ns": 1, "key": "k"}, r"op 'publish': Expected `str`, got `int` - at `\$\.ns`"),
        ({"op": "publish", "key": "k"}, r"op 'publish': Object missing required field `ns`"),
        ({"op": "step", "step": True}, r"op 'step': Expected `int`, got `bool`"),
        ({"op": "step", "step": 1.5}, r"op 'step': Expected `int`, got `float`"),
        ({"op": "alloc_ids", "ns": "n", "count": 0}, r"op 'alloc_ids': Expected `int` >= 1 - at `\$\.count`"),
        ({"op": "subscribe", "ns": "n", "key": "k", "timeout": -1}, r"`float` >= 0"),
        ({"op": "subscribe", "ns": "n", "key": "k", "timeout": 1e12}, r"`float` <= 604800"),
        ({"op": "checkpoint", "wait": "yes"}, r"op 'checkpoint': Expected `bool`"),
        ({"op": "status", "id": "one"}, r"op 'status': Expected `int \| null`, got `str` - at `\$\.id`"),
        ({"op": "frobnicate"}, r"unknown op 'frobnicate' for a rank connection"),
        ({"op": "reply", "id": 1}, r"unknown op 'reply'"),
    ],
)
def test_a_malformed_request_is_one_protocol_error_naming_op_and_field(message: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.parse_request(message, protocol.ROLE_RANK)


def test_a_control_connection_may_send_only_control_ops() -> None:
    for op, kind in protocol.REQUESTS.items():
        fields = {"op": op.value, "ns": "n", "key": "k"}
        if kind.control:
            assert protocol.parse_request(fields, protocol.ROLE_CONTROL)
        else:
            with pytest.raises(ProtocolError, match=f"unknown op '{op.value}' for a control connection"):
                protocol.parse_request(fields, protocol.ROLE_CONTROL)
    assert {op for op, kind in protocol.REQUESTS.items() if kind.control} == {"status", "checkpoint", "kill"}


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"op": "hello"}, "expected the rank's join, got 'hello'"),
        ({"op": "join", "rank": "0", "size": 1}, r"join: Expected `int`, got `str` - at `\$\.rank`"),
        ({"op": "join", "rank": 0}, "join: Object missing required field `size`"),
    ],
)
def test_a_bad_join_is_one_protocol_error(message: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.parse_join(message)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    coord = Coordinator(token=TOKEN, ckpt_dir=tmp_path).start()
    yield coord
    coord.stop()


def test_the_client_refuses_an_unknown_op_before_sending_and_stays_usable(coordinator: Coordinator) -> None:
    client = CoordinatorClient(coordinator.address, TOKEN, {"role": "control"})
    try:
        with pytest.raises(CoordinatorError, match=r"the coordinator has no operation 'stauts' \(it has: .*status"):
            client.call("stauts", reply_timeout=WAIT)
        with pytest.raises(CoordinatorError, match="no operation 'tick'"):
            client.notify("tick")
        assert client.call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"
    finally:
        client.close()


def test_a_mistyped_request_is_answered_and_only_that_connection_closes(coordinator: Coordinator) -> None:
    watcher = CoordinatorClient(coordinator.address, TOKEN, {"role": "control"})
    client = CoordinatorClient(coordinator.address, TOKEN, {"role": "control"})
    try:
        with pytest.raises(CoordinatorError, match=r"refused the request: op 'checkpoint': Expected `bool`"):
            client.call("checkpoint", reply_timeout=WAIT, wait="soon")
        with pytest.raises(CoordinatorError, match="lost"):
            client.call("status", reply_timeout=WAIT)
        assert watcher.call("status", reply_timeout=WAIT)["status"]["state"] == "waiting"
    finally:
        client.close()
        watcher.close()


@pytest.mark.parametrize(
    "push",
    [protocol.Suspend(number=3), protocol.Abort(number=3, reason="rank 1 lost"), protocol.KillRank(), protocol.Done()],
)
def test_every_push_round_trips_as_its_type(push: protocol.Push) -> None:
    message = protocol.push_message(push)
    assert isinstance(message["op"], str) and message["op"] in {"suspend", "abort", "kill", "done"}
    assert protocol.parse_push(message) == push


@pytest.mark.parametrize(
    "message", [{"op": "suspend"}, {"op": "suspend", "number": "3"}, {"op": "resume"}, {"number": 1}]
)
def test_a_push_that_does_not_fit_is_one_protocol_error(message: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match="push"):
        protocol.parse_push(message)
