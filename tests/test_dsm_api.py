"""Unit tests of dsm._api: every protocol's memory is a `dsm.SharedMemory` and a `Faults`, and hands out the
arrays and locks the API names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime
from dsm._api import Faults

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("protocol", dsm.PROTOCOLS)
def test_every_protocols_memory_shows_the_programs_api_and_the_arrays_face(protocol: str) -> None:
    def body(mem: Any, rt: ThreadRuntime) -> tuple[bool, ...]:
        array, lock = mem.array((2, 3), "int32"), mem.lock()
        return (
            isinstance(mem, dsm.SharedMemory),
            isinstance(mem, Faults),
            mem.protocol == protocol,
            (mem.rank, mem.size) == (rt.rank, rt.size),
            isinstance(array, dsm.SharedArray) and array.shape == (2, 3),
            isinstance(lock, dsm.Lock),
            isinstance(mem.statistics(), dsm.Statistics),
        )

    assert run_ranks(2, body, protocol) == [(True,) * 7] * 2


def test_an_object_without_a_member_of_the_api_is_not_a_shared_memory() -> None:
    """The check has teeth: drop one call and the object no longer passes."""
    members = {name: lambda *args: None for name in ("array", "lock", "barrier", "statistics", "close")}
    whole = SimpleNamespace(protocol="async", rank=0, size=1, **members)
    assert isinstance(whole, dsm.SharedMemory)
    del members["barrier"]
    assert not isinstance(SimpleNamespace(protocol="async", rank=0, size=1, **members), dsm.SharedMemory)
    assert not isinstance(whole, Faults)  # no faults, no locks by id
