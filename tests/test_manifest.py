"""Tests of checkpoint manifests: names, atomic writes, the latest pointer, HMAC and pruning."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from ckpt._errors import ImageError
from ckpt._manifest import (
    LATEST,
    MANIFEST_VERSION,
    image_name,
    latest_manifest,
    manifest_name,
    next_number,
    prune,
    rank_image,
    read_manifest,
    remove_unreferenced,
    write_manifest,
)
from ckpt._schemas import Manifest, ProgramInfo, RankEntry

TOKEN = b"test-token"


def make_manifest(number: int, program: str = "heat", size: int = 2) -> Manifest:
    return Manifest(
        job="j1",
        program=ProgramInfo(path="/x/heat.py", name=program, class_="Heat", sha256="ab" * 32),
        argv=["300"],
        size=size,
        number=number,
        generation=1,
        created=1700000000.25,
        seconds=0.5,
        transport="tcp",
        plugins=[{"name": "verbs", "version": "1"}],
        coordinator="127.0.0.1:7779",
        id_counters={"qp": 12},
        ranks=[RankEntry(rank=r, file=image_name(program, r, number), bytes=10, sha256="cd" * 32) for r in range(size)],
    )


def checkpoint(directory: Path, number: int, program: str = "heat", size: int = 2) -> Path:
    """Write the images (any bytes) and then the manifest of one checkpoint."""
    for rank in range(size):
        (directory / image_name(program, rank, number)).write_bytes(b"image")
    return write_manifest(directory, make_manifest(number, program, size), token=TOKEN)


def test_names() -> None:
    assert image_name("heat", 3, 12) == "ckpt_heat_3_12.ckpt"
    assert manifest_name("heat", 12) == "ckpt_heat_12.json"
    with pytest.raises(ValueError):
        image_name("../etc", 0, 1)


def test_write_then_read(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, make_manifest(4), token=TOKEN)
    assert path == tmp_path / "ckpt_heat_4.json"
    assert (tmp_path / LATEST).read_text().strip() == "ckpt_heat_4.json"
    manifest = read_manifest(path, token=TOKEN)
    assert manifest.manifest_version == MANIFEST_VERSION
    assert len(manifest.hmac) == 64
    assert msgspec.structs.replace(manifest, hmac="") == make_manifest(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_heat_4.json", LATEST]  # no temp files


def test_rewriting_does_not_double_sign(tmp_path: Path) -> None:
    first = read_manifest(write_manifest(tmp_path, make_manifest(1), token=TOKEN), token=TOKEN)
    again = read_manifest(write_manifest(tmp_path, first, token=TOKEN), token=TOKEN)
    assert again == first


def test_manifest_that_is_not_json_cannot_be_written(tmp_path: Path) -> None:
    manifest = msgspec.structs.replace(make_manifest(1), options={"bad": object()})
    with pytest.raises(ImageError, match="cannot write manifest"):
        write_manifest(tmp_path, manifest, token=TOKEN)
    assert not list(tmp_path.iterdir())


def test_read_without_token_skips_the_hmac(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, make_manifest(1), token=TOKEN)
    assert read_manifest(path, token=None).number == 1


def assert_refused(path: Path, pattern: str, token: bytes | None = TOKEN) -> None:
    with pytest.raises(ImageError, match=pattern) as caught:
        read_manifest(path, token=token)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_missing(tmp_path: Path) -> None:
    assert_refused(tmp_path / "ckpt_heat_1.json", "missing file")


def test_not_json(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("{not json")
    assert_refused(path, "not JSON")


@pytest.mark.parametrize("content", [[1, 2], {"program": "x", "number": 1, "ranks": []}, "text"])
def test_not_a_manifest(tmp_path: Path, content: object) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(content))
    assert_refused(path, "not a ckpt manifest", token=None)


def test_unsupported_version(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, make_manifest(1), token=TOKEN)
    data = json.loads(path.read_text())
    data["manifest_version"] = 2
    path.write_text(json.dumps(data))
    assert_refused(path, r"^manifest \S+ has format 2; this ckpt reads format 1$", token=None)


def test_hmac_mismatch(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, make_manifest(1), token=TOKEN)
    assert_refused(path, r"not authentic \(HMAC mismatch", token=b"other")
    data = json.loads(path.read_text())
    data["ranks"][0]["file"] = "evil.ckpt"
    path.write_text(json.dumps(data))
    assert_refused(path, "not authentic")
    del data["hmac"]
    path.write_text(json.dumps(data))
    assert_refused(path, "not authentic")


def test_latest_manifest(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=f"no checkpoint in {tmp_path}"):
        latest_manifest(tmp_path)
    with pytest.raises(ImageError, match="no checkpoint in"):
        latest_manifest(tmp_path / "missing-dir")
    checkpoint(tmp_path, 1)
    second = checkpoint(tmp_path, 2)
    assert latest_manifest(tmp_path) == second
    second.unlink()
    with pytest.raises(ImageError, match="which does not exist"):
        latest_manifest(tmp_path)
    (tmp_path / LATEST).write_text("../../etc/passwd\n")
    with pytest.raises(ImageError, match="damaged"):
        latest_manifest(tmp_path)


def test_next_number(tmp_path: Path) -> None:
    assert next_number(tmp_path, "heat") == 1
    assert next_number(tmp_path / "missing-dir", "heat") == 1
    checkpoint(tmp_path, 3)
    checkpoint(tmp_path, 9, program="heat_2")  # another program whose name extends this one
    (tmp_path / image_name("heat", 0, 17)).write_bytes(b"")  # images alone are no checkpoint
    assert next_number(tmp_path, "heat") == 4
    assert next_number(tmp_path, "heat_2") == 10


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for number in range(1, 6):
        checkpoint(tmp_path, number)
    checkpoint(tmp_path, 1, program="other")
    deleted = prune(tmp_path, "heat", keep=2)
    assert sorted(p.name for p in deleted) == sorted(
        [manifest_name("heat", n) for n in (1, 2, 3)] + [image_name("heat", r, n) for n in (1, 2, 3) for r in (0, 1)]
    )
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "ckpt_heat_4.json" in left and "ckpt_heat_5.json" in left and "ckpt_heat_3.json" not in left
    assert "ckpt_other_1.json" in left and image_name("other", 0, 1) in left
    assert prune(tmp_path, "heat", keep=2) == []


def test_prune_zero_keeps_everything(tmp_path: Path) -> None:
    for number in range(1, 4):
        checkpoint(tmp_path, number)
    assert prune(tmp_path, "heat", keep=0) == []
    with pytest.raises(ValueError):
        prune(tmp_path, "heat", keep=-1)


def test_prune_never_deletes_what_latest_points_to(tmp_path: Path) -> None:
    for number in range(1, 4):
        checkpoint(tmp_path, number)
    (tmp_path / LATEST).write_text("ckpt_heat_1.json\n")
    deleted = {p.name for p in prune(tmp_path, "heat", keep=1)}
    assert "ckpt_heat_2.json" in deleted and "ckpt_heat_1.json" not in deleted
    assert (tmp_path / image_name("heat", 0, 1)).exists()
    assert latest_manifest(tmp_path).name == "ckpt_heat_1.json"


def test_remove_unreferenced(tmp_path: Path) -> None:
    checkpoint(tmp_path, 1)
    leftovers = [image_name("heat", 0, 2), image_name("heat", 1, 2) + ".tmp", manifest_name("heat", 2) + ".tmp"]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / image_name("heat", 0, 12)).write_bytes(b"not ours")
    assert remove_unreferenced(tmp_path, "heat", 1) == []  # it has a manifest
    deleted = remove_unreferenced(tmp_path, "heat", 2)
    assert sorted(p.name for p in deleted) == sorted(leftovers)
    assert (tmp_path / image_name("heat", 0, 12)).exists()
    assert (tmp_path / image_name("heat", 0, 1)).exists()


def test_a_latest_pointer_that_cannot_be_written_takes_the_manifest_back(tmp_path: Path) -> None:
    checkpoint(tmp_path, 1)
    (tmp_path / "latest.tmp").mkdir()  # what a full disk does to the pointer, reproducibly
    with pytest.raises(ImageError, match=r"cannot update .*latest"):
        checkpoint(tmp_path, 2)
    assert not (tmp_path / manifest_name("heat", 2)).exists(), "a manifest latest does not name was left behind"
    assert latest_manifest(tmp_path).name == manifest_name("heat", 1)
    # --keep counts only committed checkpoints: checkpoint 1 survives the next one's prune
    (tmp_path / "latest.tmp").rmdir()
    checkpoint(tmp_path, 3)
    prune(tmp_path, "heat", 2)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [manifest_name("heat", 1), manifest_name("heat", 3)]


def test_prune_does_not_count_a_manifest_whose_images_are_gone(tmp_path: Path) -> None:
    for number in (1, 2, 3):
        checkpoint(tmp_path, number)
    for rank in (0, 1):
        (tmp_path / image_name("heat", rank, 3)).unlink()  # not restartable: it does not count
    prune(tmp_path, "heat", 2)
    assert (tmp_path / manifest_name("heat", 1)).exists() and (tmp_path / manifest_name("heat", 2)).exists()


def test_manifests_and_latest_are_private(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, 1)
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / LATEST).stat().st_mode & 0o777 == 0o600


def test_a_garbage_latest_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / LATEST).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ImageError, match=r"latest is damaged \(it does not name a manifest\)"):
        latest_manifest(tmp_path)


def test_rank_image_is_each_ranks_latest_and_a_rank_manifest_leaves_latest(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="no checkpoint of heat"):
        rank_image(tmp_path, "heat", 0, token=TOKEN)
    checkpoint(tmp_path, 1)
    assert rank_image(tmp_path, "heat", 1, token=TOKEN)[1] == 1
    # an independent checkpoint 2 of rank 1: rank 0's latest image is still checkpoint 1's
    (tmp_path / image_name("heat", 1, 2)).write_bytes(b"image")
    old = make_manifest(1)
    ranks = [msgspec.structs.replace(old.ranks[0], number=1), RankEntry(rank=1, file=image_name("heat", 1, 2))]
    write_manifest(tmp_path, msgspec.structs.replace(old, number=2, kind="rank", ranks=ranks), token=TOKEN)
    assert latest_manifest(tmp_path).name == manifest_name("heat", 1)  # a whole-job restart still uses 1
    assert [rank_image(tmp_path, "heat", r, token=TOKEN)[1] for r in (0, 1)] == [1, 2]
    with pytest.raises(ImageError, match="has no image of rank 5"):
        rank_image(tmp_path, "heat", 5, token=TOKEN)
