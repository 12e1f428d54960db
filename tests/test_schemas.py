"""Tests of the on-disk schemas: round trips, format refusals, files of the first format, newer minors."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from ckpt._errors import ImageError
from ckpt._manifest import read_manifest, write_manifest
from ckpt._restart_point import check_image
from ckpt._schemas import (
    IMAGE_FORMAT,
    MANIFEST_FORMAT,
    MANIFEST_MINOR,
    ImageHeader,
    Manifest,
    ProgramInfo,
    RankEntry,
    SchemaError,
    decode,
    to_dict,
)
from ckpt.coordinator.job import STATES
from ckpt.plugin import Phase
from ckpt.runtime._imageformat import MAGIC, PREFIX, TRAILER, TRAILER_MAGIC, ContentHash
from ckpt.runtime.images import inspect_image, read_header, read_image, write_image
from ckpt.testing import one_error_line, run

TOKEN = b"test-token"
#: A checkpoint of one rank written by ckpt before the schemas were explicit (format 1, no minor).
FORMAT1 = Path(__file__).parent / "data" / "format1"


def header() -> ImageHeader:
    return ImageHeader(
        program="heat", class_="Heat", program_sha256="ab" * 32, job="j1", rank=0, size=1, number=2, generation=1
    )


def manifest() -> Manifest:
    return Manifest(
        job="j1",
        program=ProgramInfo(path="/x/heat.py", name="heat", class_="Heat", sha256="ab" * 32),
        size=1,
        number=2,
        generation=1,
        ranks=[RankEntry(rank=0, file="ckpt_heat_0_2.ckpt", host="n1", pid=7, bytes=10, sha256="cd" * 32, step=4)],
        options={"log_home": None},
        transport="tcp",
    )


def resign_manifest(path: Path, change: dict[str, Any], token: bytes = TOKEN) -> None:
    """Rewrite a manifest with `change` applied and a valid HMAC, as another ckpt version would write it."""
    data = {k: v for k, v in json.loads(path.read_text()).items() if k != "hmac"} | change
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    data["hmac"] = hmac.new(token, canonical.encode(), hashlib.sha256).hexdigest()
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def resign_image(path: Path, change: dict[str, Any], major: int = IMAGE_FORMAT) -> None:
    """Rewrite an image's header with `change` applied, with a valid checksum and HMAC."""
    data = path.read_bytes()
    header_len = struct.unpack_from("<I", data, 10)[0]
    stored = json.loads(data[PREFIX.size : PREFIX.size + header_len]) | change
    body = json.dumps(stored).encode()
    prefix = PREFIX.pack(MAGIC, major, len(body), zlib.crc32(body)) + body
    records = data[PREFIX.size + header_len : len(data) - TRAILER.size]
    with ThreadPoolExecutor(2) as pool:
        content = ContentHash(pool)
        content.update(prefix)
        content.update(records)
        digest = content.digest()
    mac = hmac.new(TOKEN, digest, hashlib.sha256).digest()
    path.write_bytes(prefix + records + TRAILER.pack(TRAILER_MAGIC, len(records), digest, mac))


# --------------------------------------------------------------- round trips --


def test_manifest_round_trip(tmp_path: Path) -> None:
    written = manifest()
    back = read_manifest(write_manifest(tmp_path, written, token=TOKEN), token=TOKEN)
    assert msgspec.structs.replace(back, hmac="") == written
    stored = json.loads((tmp_path / "ckpt_heat_2.json").read_text())
    assert stored["program"]["class"] == "Heat" and "class_" not in stored["program"]  # the on-disk name
    assert (stored["manifest_version"], stored["manifest_minor"]) == (MANIFEST_FORMAT, MANIFEST_MINOR)


def test_image_header_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ckpt_heat_0_2.ckpt"
    write_image(path, {"a": np.arange(10)}, header=header(), token=TOKEN)
    back, state = read_image(path, token=TOKEN)
    assert read_header(path) == back
    assert msgspec.structs.replace(back, created=0.0, objects=[]) == header()
    assert back.created > 0 and back.objects and np.array_equal(state["a"], np.arange(10))  # type: ignore[index]


# ------------------------------------------------------------ format refusals --


def test_a_manifest_of_another_format_is_refused_naming_both(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, manifest(), token=TOKEN)
    resign_manifest(path, {"manifest_version": 3, "size": "renamed in format 3"})
    for token in (TOKEN, None):
        with pytest.raises(ImageError) as caught:
            read_manifest(path, token=token)
        assert str(caught.value) == f"manifest {path} has format 3; this ckpt reads format 1"


def test_an_image_of_another_format_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "ckpt_heat_0_2.ckpt"
    write_image(path, {"a": 1}, header=header(), token=TOKEN)
    resign_image(path, {"format_version": 2}, major=2)
    expected = f"checkpoint image {path} has format 2; this ckpt reads format 1"
    for read in (read_header, lambda p: read_image(p, token=TOKEN), inspect_image):
        with pytest.raises(ImageError) as caught:
            read(path)
        assert str(caught.value) == expected


def test_decode_names_both_formats_and_the_field_that_does_not_fit() -> None:
    raw = to_dict(header())
    with pytest.raises(SchemaError, match=r"^image x has format 7; this ckpt reads format 1$"):
        decode({**raw, "format_version": 7}, ImageHeader, "image x")
    with pytest.raises(SchemaError, match=r"^image x has no format version \(format_version\)$"):
        decode({k: v for k, v in raw.items() if k != "format_version"}, ImageHeader, "image x")
    with pytest.raises(SchemaError, match=r"^image x does not fit format 1: .*int.*\$\.rank"):
        decode({**raw, "rank": "zero"}, ImageHeader, "image x")
    with pytest.raises(SchemaError, match="is not a JSON object"):
        decode([raw], ImageHeader, "image x")


def test_a_manifest_that_does_not_fit_its_format_is_refused_in_one_line(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, manifest(), token=TOKEN)
    resign_manifest(path, {"size": "two"})
    with pytest.raises(ImageError) as caught:
        read_manifest(path, token=TOKEN)
    message = str(caught.value)
    assert message.startswith(f"checkpoint manifest {path} does not fit format 1: ") and "$.size" in message
    assert "\n" not in message


# ------------------------------------------- newer minors and unknown fields --


def test_a_newer_minor_with_unknown_fields_is_read(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, manifest(), token=TOKEN)
    ranks = [{**to_dict(manifest().ranks[0]), "numa_node": 3}]  # a newer rank entry too
    resign_manifest(path, {"manifest_minor": 9, "lineage": {"parent": 1}, "ranks": ranks})
    read = read_manifest(path, token=TOKEN)
    assert read.manifest_minor == 9 and read.ranks[0].step == 4
    # the HMAC covers what this ckpt does not know: changing it is tampering
    data = json.loads(path.read_text())
    data["lineage"]["parent"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ImageError, match="not authentic"):
        read_manifest(path, token=TOKEN)


def test_an_image_of_a_newer_minor_with_unknown_fields_is_read(tmp_path: Path) -> None:
    path = tmp_path / "ckpt_heat_0_2.ckpt"
    write_image(path, {"a": np.arange(5)}, header=header(), token=TOKEN)
    resign_image(path, {"format_minor": 4, "numa_node": 1})
    back, state = read_image(path, token=TOKEN)
    assert back.format_minor == 4 and back.rank == 0 and np.array_equal(state["a"], np.arange(5))  # type: ignore[index]
    report = inspect_image(path)
    assert report["ok"] and report["header"]["numa_node"] == 1  # inspect shows the file as it is


# --------------------------------------------------- files of the first format --


def test_a_format1_checkpoint_is_read(tmp_path: Path) -> None:
    stored = json.loads((FORMAT1 / "ckpt_heat_2.json").read_text())
    assert stored["manifest_version"] == 1 and "manifest_minor" not in stored  # written before the schemas
    old = read_manifest(FORMAT1 / "ckpt_heat_2.json", token=TOKEN)
    assert (old.manifest_minor, old.job, old.program.class_) == (0, "0123456789ab", "Heat")
    assert old.settings.phase_timeout == 300 and old.options == {"log_home": None}
    (entry,) = old.ranks
    assert (entry.host, entry.pid, entry.step) == ("node1", 4242, 7)
    image = FORMAT1 / entry.file
    check_image(image, entry, old, "ckpt_heat_2.json")  # what a restart checks before starting anything
    head, state = read_image(image, token=TOKEN, expected_sha256=entry.sha256)
    assert (head.format_minor, head.class_, head.step, head.finished, head.result) == (0, "Heat", 7, False, None)
    assert np.array_equal(state["program"]["grid"], np.arange(16))  # type: ignore[index]
    # and a format-1 manifest rewritten by this ckpt reads back the same, now of this ckpt's minor
    again = read_manifest(write_manifest(tmp_path, old, token=TOKEN), token=TOKEN)
    assert again.manifest_minor == MANIFEST_MINOR and (again.kind, again.ranks[0].number) == ("job", None)
    assert msgspec.structs.replace(again, hmac="", manifest_minor=0) == msgspec.structs.replace(old, hmac="")


def test_ckpt_inspect_shows_a_format1_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "old"
    shutil.copytree(FORMAT1, directory)
    shown = run("inspect", str(directory / "ckpt_heat_2.json"), extra_env={"CKPT_TOKEN": TOKEN.decode()})
    assert shown.returncode == 0, shown.stderr
    assert "manifest of checkpoint 2 of heat" in shown.stdout and "format 1.0" in shown.stdout
    assert "authentic: yes" in shown.stdout and "rank   0  ckpt_heat_0_2.ckpt" in shown.stdout
    image = run("inspect", str(directory / "ckpt_heat_0_2.ckpt"))
    assert image.returncode == 0 and "format_version: 1" in image.stdout and "ok: True" in image.stdout
    resign_manifest(directory / "ckpt_heat_2.json", {"manifest_version": 2})
    one_error_line(run("inspect", str(directory / "ckpt_heat_2.json")), "has format 2; this ckpt reads format 1")


# ---------------------------------------------------------------- phases --


def test_barrier_names_are_built_from_and_parsed_into_phases() -> None:
    for phase in Phase:
        assert Phase.of_barrier(phase.barrier("ckpt3")) == ("ckpt3", phase)
    assert Phase.REACH.barrier("ckpt1") == "ckpt1:REACH" and Phase.RESTART.barrier("gen2") == "gen2:RESTART"
    assert Phase.of_barrier("ckpt3:dsm:flush") == ("ckpt3", None)  # a plugin's own barrier
    assert Phase.of_barrier("ckpt3:reach") == ("ckpt3", None)


def test_rank_states_follow_the_phase_order() -> None:
    assert STATES == ("running", "presuspend", "drain", "checkpoint", "resume", "restart", "refresh", "finished")
