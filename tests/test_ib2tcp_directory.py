"""ckpt_ib2tcp._directory: where a tcp HCA is -- claims that never collide, endpoints that resolve."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ckpt_ib2tcp import _directory as d

from ckpt.testing import FakeKeyValue


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
    kv = FakeKeyValue()
    draws.extend([7, 8, 7, 8, 9, 9, 10])
    first, second = d.KvDirectory(kv), d.KvDirectory(kv)
    assert _register(first) == [7, 8]
    assert _register(second, "10.0.0.2:6000") == [9, 10]  # 7, 8 and 9 (twice) were taken
    assert second.resolve(9) == ("10.0.0.2:6000", 1, True)
    assert first.resolve(10) == ("10.0.0.2:6000", 2, True)


def test_unknown_lid_resolves_to_nothing(tmp_path: Path) -> None:
    for directory in (d.KvDirectory(FakeKeyValue()), d.FileDirectory(tmp_path), d.LocalDirectory()):
        assert directory.resolve(0xBFFF + 1) == (None, None, False)


def test_register_claims_two_unicast_lids_and_reports_no_link_model(tmp_path: Path) -> None:
    for directory in (d.KvDirectory(FakeKeyValue()), d.FileDirectory(tmp_path), d.LocalDirectory()):
        reply = directory.register(guid=5, name="tcp3", endpoint="127.0.0.1:4000", pid=9, host="127.0.0.1")
        lids = reply["lids"]
        assert len(lids) == 2 and lids[0] != lids[1] and all(1 <= lid <= 0xBFFF for lid in lids)
        assert (reply["sm_lid"], reply["latency"], reply["bandwidth"]) == (0, 0.0, 0.0)
        assert (reply["links"], reply["fabric"]) == ({}, None)  # no link model, no fabric: every link is up
        assert [directory.resolve(lid) for lid in lids] == [("127.0.0.1:4000", 1, True), ("127.0.0.1:4000", 2, True)]


def test_random_lids_reach_both_ends_of_the_unicast_range(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([False, True])  # randbelow's smallest answer, then its largest, for the bound asked

    def randbelow(bound: int) -> int:
        return bound - 1 if next(answers) else 0

    monkeypatch.setattr(d, "secrets", SimpleNamespace(randbelow=randbelow))  # only the directory's draws
    assert _register(d.KvDirectory(FakeKeyValue())) == [1, 0xBFFF]


def test_kv_skips_a_lid_another_rank_claimed_first(draws: list[int]) -> None:
    kv = FakeKeyValue()
    kv.incrby(d.NS, "claim/20")  # another rank's HCA, through the same coordinator
    draws.extend([20, 21, 22])
    assert _register(d.KvDirectory(kv)) == [21, 22]
    assert kv.get(d.NS, "lid/20") is None  # the other rank's record is not overwritten


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


@pytest.mark.parametrize(
    "content", [b"", b'{"endpoint": "h:1", "po', b"\xff\xfe\x00garbage"], ids=["empty", "half", "binary"]
)
def test_file_directory_resolves_a_half_written_or_garbage_record_as_unknown(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "90.claim").touch()
    (tmp_path / "90.json").write_bytes(content)
    assert d.FileDirectory(tmp_path).resolve(90) == (None, None, False)


def test_file_directory_claim_is_the_exclusive_claim_file(draws: list[int], tmp_path: Path) -> None:
    (tmp_path / "30.claim").touch()  # another process claimed 30 and has not recorded it yet
    draws.extend([30, 31, 32])
    directory = d.FileDirectory(tmp_path)
    assert _register(directory, "10.0.0.9:9") == [31, 32]
    assert directory.resolve(30) == (None, None, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["30.claim", "31.claim", "31.json", "32.claim", "32.json"]
    assert json.loads((tmp_path / "32.json").read_text()) == {
        "endpoint": "10.0.0.9:9",
        "port": 2,
        "name": "tcp0",
        "pid": 42,
    }


def test_local_directory_claims_are_unique_in_the_process(draws: list[int]) -> None:
    class Fresh(d.LocalDirectory):  # the process-wide table, but empty: other tests' HCAs claimed theirs
        _entries: dict[int, dict[str, Any] | None] = {}

    draws.extend([11, 12, 12, 11, 13, 14])
    assert _register(Fresh()) == [11, 12]
    assert _register(Fresh(), "10.0.0.3:3") == [13, 14]
    assert Fresh().resolve(14) == ("10.0.0.3:3", 2, True)


def test_factory_picks_kv_then_files_then_the_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(d.DIRECTORY_ENV, str(tmp_path / "dir"))
    assert isinstance(d.factory(FakeKeyValue())(lambda lid, up: None), d.KvDirectory)
    made = d.factory(None)(lambda lid, up: None)
    assert isinstance(made, d.FileDirectory) and made.path == tmp_path / "dir" and made.path.is_dir()
    monkeypatch.delenv(d.DIRECTORY_ENV)
    assert isinstance(d.factory(None)(lambda lid, up: None), d.LocalDirectory)
