"""ckpt_ib2tcp._directory: where a tcp HCA is -- claims that never collide, endpoints that resolve."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_ib2tcp import _directory as d


class CountingKV:
    """The part of rt.kv a KvDirectory uses: publish / get / incrby."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], Any] = {}
        self.counters: dict[tuple[str, str], int] = {}

    def publish(self, ns: str, key: str, value: Any) -> None:
        self.values[ns, key] = value

    def get(self, ns: str, key: str, default: Any = None) -> Any:
        return self.values.get((ns, key), default)

    def incrby(self, ns: str, key: str, delta: int = 1) -> int:
        self.counters[ns, key] = self.counters.get((ns, key), 0) + delta
        return self.counters[ns, key]


@pytest.fixture
def draws(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Force the random LIDs: the test appends the draws, repeats included."""
    sequence: list[int] = []
    counter = itertools.count()
    monkeypatch.setattr(d, "_random_lid", lambda: sequence[next(counter)])
    yield sequence


def _register(directory: d._Directory, endpoint: str = "10.0.0.1:5000") -> list[int]:
    reply = directory.register(guid=1, name="tcp0", endpoint=endpoint, pid=42, host="10.0.0.1")
    assert (reply["sm_lid"], reply["latency"], reply["bandwidth"], reply["links"]) == (0, 0.0, 0.0, {})
    lids: list[int] = reply["lids"]
    return lids


def test_kv_claims_never_collide_even_when_the_draw_repeats(draws: list[int]) -> None:
    kv = CountingKV()
    draws.extend([7, 8, 7, 8, 9, 9, 10])
    first, second = d.KvDirectory(kv), d.KvDirectory(kv)
    assert _register(first) == [7, 8]
    assert _register(second, "10.0.0.2:6000") == [9, 10]  # 7, 8 and 9 (twice) were taken
    assert second.resolve(9) == ("10.0.0.2:6000", 1, True)
    assert first.resolve(10) == ("10.0.0.2:6000", 2, True)


def test_unknown_lid_resolves_to_nothing() -> None:
    for directory in (d.KvDirectory(CountingKV()), d.LocalDirectory()):
        assert directory.resolve(0xBFFF + 1) == (None, None, False)


def test_random_lids_are_unicast() -> None:
    assert all(1 <= d._random_lid() <= d.MAX_LID for _ in range(2000))


def test_file_directory_claims_are_exclusive_between_instances(draws: list[int], tmp_path: Path) -> None:
    draws.extend([3, 4, 3, 4, 5, 6])
    a, b = d.FileDirectory(tmp_path), d.FileDirectory(tmp_path)
    assert _register(a, "10.0.0.1:1") == [3, 4]
    assert _register(b, "10.0.0.2:2") == [5, 6]
    assert b.resolve(3) == ("10.0.0.1:1", 1, True)  # what one process recorded, another resolves
    assert a.resolve(6) == ("10.0.0.2:2", 2, True)


def test_file_directory_ignores_a_damaged_record(tmp_path: Path) -> None:
    (tmp_path / "77.json").write_text('{"endpoint": "10.0.0')
    assert d.FileDirectory(tmp_path).resolve(77) == (None, None, False)
    (tmp_path / "78.json").write_text(json.dumps({"endpoint": "h:1", "port": 2}))
    assert d.FileDirectory(tmp_path).resolve(78) == ("h:1", 2, True)


def test_local_directory_claims_are_unique_in_the_process(draws: list[int]) -> None:
    class Fresh(d.LocalDirectory):  # the process-wide table, but empty: other tests' HCAs claimed theirs
        _entries: dict[int, dict[str, Any] | None] = {}

    draws.extend([11, 12, 12, 11, 13, 14])
    assert _register(Fresh()) == [11, 12]
    assert _register(Fresh(), "10.0.0.3:3") == [13, 14]
    assert Fresh().resolve(14) == ("10.0.0.3:3", 2, True)


def test_factory_picks_kv_then_files_then_the_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(d.DIRECTORY_ENV, str(tmp_path / "dir"))
    assert isinstance(d.factory(CountingKV())(lambda lid, up: None), d.KvDirectory)
    made = d.factory(None)(lambda lid, up: None)
    assert isinstance(made, d.FileDirectory) and made.path == tmp_path / "dir" and made.path.is_dir()
    monkeypatch.delenv(d.DIRECTORY_ENV)
    assert isinstance(d.factory(None)(lambda lid, up: None), d.LocalDirectory)
