"""`--keep` with independent checkpoints: prune never deletes what a rank's recovery still needs."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from test_manifest import TOKEN, checkpoint, make_manifest

from ckpt._manifest import abandon_after, image_name, latest_manifest, manifest_name, prune, rank_image, write_manifest
from ckpt._schemas import Manifest, RankEntry

SIZE = 3


class Directory:
    """A checkpoint directory written the way the coordinator writes it, tracking each rank's latest image."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.latest: dict[int, int] = {}
        self.number = 0

    def coordinated(self) -> int:
        self.number += 1
        checkpoint(self.path, self.number, size=SIZE)
        self.latest = dict.fromkeys(range(SIZE), self.number)
        return self.number

    def independent(self, rank: int) -> int:
        self.number += 1
        (self.path / image_name("heat", rank, self.number)).write_bytes(b"image")
        self.latest[rank] = self.number
        ranks = [
            RankEntry(rank=r, file=image_name("heat", r, n), number=None if n == self.number else n)
            for r, n in sorted(self.latest.items())
        ]
        manifest: Manifest = msgspec.structs.replace(make_manifest(1, size=SIZE), number=self.number, kind="rank")
        write_manifest(self.path, msgspec.structs.replace(manifest, ranks=ranks), token=TOKEN)
        return self.number

    def files(self) -> set[str]:
        return {p.name for p in self.path.iterdir()}

    def assert_recoverable(self) -> None:
        """Every rank's latest image is named by the newest manifest and is on disk."""
        for rank, number in self.latest.items():
            assert rank_image(self.path, "heat", rank, token=TOKEN)[1] == number
            assert (self.path / image_name("heat", rank, number)).exists()


@pytest.fixture
def d(tmp_path: Path) -> Directory:
    return Directory(tmp_path)


def test_a_superseded_rank_manifest_goes_with_its_image(d: Directory) -> None:
    d.coordinated()  # 1
    d.independent(1)  # 2
    d.independent(1)  # 3: rank 1's image 2 is no one's latest any more
    deleted = {p.name for p in prune(d.path, "heat", keep=1)}
    assert deleted == {manifest_name("heat", 2), image_name("heat", 1, 2)}
    assert manifest_name("heat", 1) in d.files()  # the newest coordinated one: latest, and needed by ranks 0, 2
    d.assert_recoverable()


def test_a_superseded_rank_manifest_whose_image_is_still_needed_stays(d: Directory) -> None:
    d.coordinated()  # 1
    d.independent(0)  # 2
    d.independent(1)  # 3 names rank 0's image 2
    assert prune(d.path, "heat", keep=1) == []
    assert {manifest_name("heat", n) for n in (1, 2, 3)} <= d.files()
    d.assert_recoverable()


def test_an_old_coordinated_checkpoint_stays_while_a_rank_still_needs_its_image(d: Directory) -> None:
    d.coordinated()  # 1
    d.independent(0)  # 2
    d.independent(1)  # 3
    d.coordinated()  # 4
    d.coordinated()  # 5
    d.independent(0)  # 6: ranks 1 and 2 still need 5
    d.independent(1)  # 7
    deleted = {p.name for p in prune(d.path, "heat", keep=1)}
    # 1-4 are not needed; 5 is (rank 2's latest image), 6 is (rank 0's), 7 is the newest
    assert {manifest_name("heat", n) for n in (1, 2, 3, 4)} <= deleted
    assert {manifest_name("heat", n) for n in (5, 6, 7)} <= d.files()
    assert not any(f"_{n}.ckpt" in name for name in d.files() for n in (1, 2, 3, 4))
    assert latest_manifest(d.path).name == manifest_name("heat", 5)
    d.assert_recoverable()


def test_a_coordinated_checkpoint_makes_every_older_one_prunable(d: Directory) -> None:
    d.coordinated()  # 1
    d.independent(0)  # 2
    d.independent(2)  # 3
    d.coordinated()  # 4: every rank's latest image is its image of 4
    deleted = {p.name for p in prune(d.path, "heat", keep=1)}
    assert deleted == {manifest_name("heat", n) for n in (1, 2, 3)} | {
        image_name("heat", r, 1) for r in range(SIZE)
    } | {image_name("heat", 0, 2), image_name("heat", 2, 3)}
    d.assert_recoverable()


def test_keep_counts_coordinated_checkpoints_only(d: Directory) -> None:
    for _ in range(3):
        d.coordinated()
        d.independent(1)
    # 1 2 3 4 5 6: job manifests 1, 3, 5; keep 2 of them; 6 is the newest (rank 1's 6, the others' 5)
    deleted = {p.name for p in prune(d.path, "heat", keep=2)}
    assert manifest_name("heat", 1) in deleted and manifest_name("heat", 2) in deleted
    assert manifest_name("heat", 4) in deleted  # superseded: rank 1's latest is 6
    assert {manifest_name("heat", n) for n in (3, 5, 6)} <= d.files()
    assert image_name("heat", 1, 3) in d.files()  # checkpoint 3 is kept whole
    d.assert_recoverable()


def test_keep_zero_keeps_every_manifest(d: Directory) -> None:
    d.coordinated()
    d.independent(0)
    d.independent(0)
    assert prune(d.path, "heat", keep=0) == []


def test_a_manifest_whose_images_are_gone_is_neither_counted_nor_deleted(d: Directory) -> None:
    d.coordinated()  # 1
    d.independent(1)  # 2
    (d.path / image_name("heat", 1, 2)).unlink()  # 2 is not complete: the newest complete one is 1
    assert prune(d.path, "heat", keep=1) == []
    assert manifest_name("heat", 2) in d.files()


def test_a_restart_abandons_the_independent_checkpoints_after_its_checkpoint(d: Directory) -> None:
    d.coordinated()  # 1
    d.independent(0)  # 2
    d.coordinated()  # 3
    d.independent(1)  # 4
    d.independent(2)  # 5
    deleted = {p.name for p in abandon_after(d.path, "heat", 3)}
    assert deleted == {manifest_name("heat", 4), manifest_name("heat", 5)} | {
        image_name("heat", 1, 4),
        image_name("heat", 2, 5),
    }
    assert rank_image(d.path, "heat", 1, token=TOKEN)[1] == 3  # what the restarted run's recovery uses
    # an older restart point: the independent ones after it go, coordinated ones stay
    deleted = {p.name for p in abandon_after(d.path, "heat", 1)}
    assert deleted == {manifest_name("heat", 2), image_name("heat", 0, 2)}
    assert {manifest_name("heat", n) for n in (1, 3)} <= d.files()


@pytest.mark.parametrize("seed", range(5))
def test_pruning_after_every_commit_leaves_nothing_behind_and_every_rank_recoverable(d: Directory, seed: int) -> None:
    """What the coordinator does (prune after each commit), over a random mix of checkpoints: no image stays that
    no manifest names, no manifest stays that nothing needs, and every rank's latest image is there."""
    import json
    import random

    rng = random.Random(seed)
    d.coordinated()
    for _ in range(40):
        if rng.random() < 0.2:
            d.coordinated()
        else:
            d.independent(rng.randrange(SIZE))
        prune(d.path, "heat", keep=1)
        d.assert_recoverable()
        manifests_left = list(d.path.glob("ckpt_heat_*.json"))
        named = {e["file"] for p in manifests_left for e in json.loads(p.read_text())["ranks"]}
        assert {p.name for p in d.path.glob("ckpt_heat_*.ckpt")} <= named
        assert len(manifests_left) <= 1 + SIZE + 1  # the latest coordinated one, one per rank, the newest
