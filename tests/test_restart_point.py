"""ckpt._restart_point: where a restart's checkpoint is, and the refusals that come before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt._errors import ImageError
from ckpt._restart_point import last_checkpoint, prepare_restart, restart_directory


def test_a_restart_without_target_uses_the_jobs_directory_and_its_latest(tmp_path: Path) -> None:
    assert restart_directory(None, tmp_path) == (tmp_path.resolve(), None)


def test_a_directory_target_restarts_its_latest_and_a_manifest_target_that_one(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    manifest = other / "ckpt_heat_3.json"
    manifest.write_text("{}")
    assert restart_directory(str(other), tmp_path / "unused") == (other.resolve(), None)
    assert restart_directory(str(manifest), tmp_path / "unused") == (other.resolve(), manifest.resolve())


def test_a_target_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"^no checkpoint at .*gone: no such file or directory$"):
        restart_directory(str(tmp_path / "gone"), tmp_path)


def test_no_token_to_authenticate_the_manifest_is_refused_before_reading_it(tmp_path: Path) -> None:
    manifest = tmp_path / "ckpt_heat_1.json"
    manifest.write_text("not even json")  # never read: the token is missing first
    with pytest.raises(ImageError, match=r"no token to authenticate .*ckpt_heat_1\.json: set CKPT_TOKEN"):
        prepare_restart(manifest, tmp_path, None)


def test_the_last_checkpoint_as_status_shows_it(tmp_path: Path) -> None:
    manifest = {
        "number": 4,
        "program": {"name": "heat"},
        "ranks": [{"bytes": 100}, {"bytes": 23}, {}],
        "seconds": 0.5,
    }
    assert last_checkpoint(manifest, tmp_path) == {
        "number": 4,
        "manifest": str(tmp_path / "ckpt_heat_4.json"),
        "bytes": 123,
        "seconds": 0.5,
    }
