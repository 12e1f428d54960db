"""Tests of the checkpoint image format: round trips, sharing, compression choice, and refusals."""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import pickle
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckpt._errors import ImageError
from ckpt._schemas import IMAGE_MINOR, ImageHeader
from ckpt.runtime import images
from ckpt.runtime.images import (
    FORMAT_VERSION,
    MAGIC,
    ImageInfo,
    UnpicklableStateError,
    describe_objects,
    inspect_image,
    read_header,
    read_image,
    verify_image,
    write_image,
)

TOKEN = b"test-token"
FIELDS: dict[str, Any] = {"program": "heat", "rank": 0, "size": 2, "number": 3, "generation": 1, "job": "j1"}
HEADER = ImageHeader(**FIELDS)
TRAILER_SIZE = 80


class Grid:
    """A program-like object at module level (pickled by reference)."""

    def __init__(self, n: int) -> None:
        self.values = np.arange(n, dtype=np.float64)
        self.step = 7


class ZeroCopyBytes(bytearray):
    """The PickleBuffer example of the pickle documentation: out of band, no copy."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return type(self)._reconstruct, (pickle.PickleBuffer(self),), None

    @classmethod
    def _reconstruct(cls, obj: Any) -> ZeroCopyBytes:
        with memoryview(obj) as view:
            return cls(view)


def roundtrip(tmp_path: Path, obj: object, name: str = "img.ckpt") -> tuple[dict[str, Any], Any]:
    path = tmp_path / name
    write_image(path, obj, header=HEADER, token=TOKEN)
    return read_image(path, token=TOKEN)


def content_digest(data: bytes) -> bytes:
    """The documented content checksum: SHA-256 over the SHA-256 of each 8 MiB piece."""
    piece = 8 << 20
    top = hashlib.sha256()
    for start in range(0, len(data), piece):
        top.update(hashlib.sha256(data[start : start + piece]).digest())
    return top.digest()


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut buffers into 64 KiB chunks so multi-chunk paths run on small data."""
    monkeypatch.setattr(images, "_CHUNK_BYTES", 64 << 10)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    obj = {"program": Grid(50_000), "noise": rng.integers(0, 256, 300_000, dtype=np.uint8)}
    path = tmp_path / "img.ckpt"
    write_image(path, obj, header=HEADER, token=TOKEN)
    return path


# --------------------------------------------------------------- round trips --


def test_roundtrip_returns_header_and_state(tmp_path: Path) -> None:
    path = tmp_path / "img.ckpt"
    info = write_image(path, {"program": Grid(100_000), "k": [1, "two", 3.0]}, header=HEADER, token=TOKEN)
    header, obj = read_image(path, token=TOKEN)
    assert isinstance(info, ImageInfo)
    assert info.path == str(path) and info.bytes == path.stat().st_size
    assert info.raw_bytes >= 800_000 and len(info.sha256) == 64 and info.seconds >= 0
    assert {key: getattr(header, key) for key in FIELDS} == FIELDS
    assert (header.format_version, header.format_minor) == (FORMAT_VERSION, IMAGE_MINOR)
    assert header.created > 0
    assert header.objects[0] == {"path": "program.values", "type": "numpy.ndarray", "bytes": 800_000}
    assert np.array_equal(obj["program"].values, np.arange(100_000, dtype=np.float64))
    assert obj["program"].step == 7 and obj["k"] == [1, "two", 3.0]
    assert not (tmp_path / "img.ckpt.tmp").exists()


def test_shared_array_stays_one_object_and_is_writable(tmp_path: Path) -> None:
    array = np.arange(200_000, dtype=np.int32)
    _, obj = roundtrip(tmp_path, {"a": array, "b": array, "inner": [array]})
    assert obj["a"] is obj["b"] is obj["inner"][0]
    assert obj["a"].flags.writeable
    obj["a"][0] = 42
    assert obj["b"][0] == 42


def test_array_views_round_trip(tmp_path: Path) -> None:
    base = np.arange(400_000, dtype=np.int64)
    fortran = np.asfortranarray(np.arange(90_000, dtype=np.float32).reshape(300, 300))
    state = {"slice": base[1000:300_000], "strided": base[::3], "fortran": fortran, "base": base}
    _, obj = roundtrip(tmp_path, state)
    for key, value in state.items():
        assert np.array_equal(obj[key], value) and obj[key].dtype == value.dtype
    assert obj["fortran"].flags.f_contiguous
    assert obj["slice"].flags.writeable and obj["strided"].flags.writeable


def test_read_only_array_stays_read_only(tmp_path: Path) -> None:
    array = np.ones(100_000)
    array.flags.writeable = False
    _, obj = roundtrip(tmp_path, {"frozen": array})
    assert np.array_equal(obj["frozen"], array) and not obj["frozen"].flags.writeable


def test_bytearray_goes_out_of_band_and_comes_back_shared(tmp_path: Path) -> None:
    big = bytearray(np.random.default_rng(2).integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    small = bytearray(b"tiny")
    _, obj = roundtrip(tmp_path, {"big": big, "again": big, "small": small})
    assert type(obj["big"]) is bytearray and obj["big"] == big
    assert obj["big"] is obj["again"]
    assert obj["small"] == small
    report = inspect_image(tmp_path / "img.ckpt")
    assert report["sections"] == {"pickle": 1, "buffer": 0, "bytearray": 1}
    assert report["raw_bytes"] < 200_000 + 4096  # the big one is not also in the pickle stream


def test_pickle_buffer_object_round_trips_out_of_band(tmp_path: Path) -> None:
    data = ZeroCopyBytes(b"abc" * 100_000)
    _, obj = roundtrip(tmp_path, {"data": data})
    assert type(obj["data"]) is ZeroCopyBytes and obj["data"] == data
    assert inspect_image(tmp_path / "img.ckpt")["sections"]["buffer"] == 1


def test_cloudpickled_local_class_instance(tmp_path: Path) -> None:
    class Local:
        def __init__(self) -> None:
            self.grid = np.full(70_000, 3.5)
            self.name = "local"

        def total(self) -> float:
            return float(self.grid.sum())

    _, obj = roundtrip(tmp_path, {"program": Local()})
    assert obj["program"].name == "local"
    assert obj["program"].total() == pytest.approx(3.5 * 70_000)


def test_many_chunks_compress_only_what_pays(tmp_path: Path, small_chunks: None) -> None:
    noise = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    zeros = np.zeros(1 << 20, dtype=np.uint8)
    zeros[::997] = 5
    _, obj = roundtrip(tmp_path, {"noise": noise, "zeros": zeros})
    assert np.array_equal(obj["noise"], noise) and np.array_equal(obj["zeros"], zeros)
    report = inspect_image(tmp_path / "img.ckpt")
    assert report["ok"] and report["sections"]["buffer"] == 2
    assert report["chunks"]["raw"] >= 16 and report["chunks"]["lz4"] >= 16
    assert 1 << 20 <= report["stored_raw_bytes"] < (1 << 20) + 4096  # noise + pickle stream
    assert report["compressed_raw_bytes"] >= 1 << 20
    assert report["compressed_bytes"] < (1 << 20) // 10
    assert report["file_bytes"] < (1 << 20) * 1.2


def test_image_larger_than_one_hash_piece(tmp_path: Path) -> None:
    noise = np.random.default_rng(4).integers(0, 256, (8 << 20) + 12345, dtype=np.uint8)
    path = tmp_path / "img.ckpt"
    info = write_image(path, {"noise": noise}, header=HEADER, token=TOKEN)
    data = path.read_bytes()
    assert info.sha256 == content_digest(data[:-TRAILER_SIZE]).hex()
    assert np.array_equal(read_image(path, token=TOKEN)[1]["noise"], noise)


def test_progress_reports_up_to_the_total(tmp_path: Path, small_chunks: None) -> None:
    path = tmp_path / "img.ckpt"
    write_image(path, {"a": np.zeros(3 << 20, dtype=np.uint8)}, header=HEADER, token=TOKEN)
    calls: list[tuple[int, int]] = []
    read_image(path, token=TOKEN, progress=lambda done, total: calls.append((done, total)))
    size = path.stat().st_size
    assert calls[-1] == (size, size)
    assert all(done <= total == size for done, total in calls)


def test_write_replaces_an_existing_image(image: Path) -> None:
    write_image(image, {"fresh": 1}, header=HEADER, token=TOKEN)
    assert read_image(image, token=TOKEN)[1] == {"fresh": 1}


# ------------------------------------------------------ header, verify, inspect --


def test_read_header_reads_the_header_only(image: Path) -> None:
    header = read_header(image)
    assert header.rank == 0 and header.format_version == FORMAT_VERSION
    data = image.read_bytes()
    header_len = struct.unpack_from("<I", data, 10)[0]
    image.write_bytes(data[: 18 + header_len])  # no records, no trailer: still a header
    assert read_header(image).job == "j1"


def test_verify_matches_write(tmp_path: Path) -> None:
    path = tmp_path / "img.ckpt"
    written = write_image(path, {"a": np.arange(100_000)}, header=HEADER, token=TOKEN)
    verified = verify_image(path, token=TOKEN)
    assert (verified.path, verified.bytes, verified.sha256, verified.raw_bytes) == (
        written.path,
        written.bytes,
        written.sha256,
        written.raw_bytes,
    )
    with pytest.raises(ImageError, match="not authentic"):
        verify_image(path, token=b"other")


def test_inspect_reports_layout_without_the_token(image: Path) -> None:
    report = inspect_image(image)
    assert report["ok"] and report["problem"] is None
    assert report["header"]["program"] == "heat"
    assert report["file_bytes"] == image.stat().st_size
    assert report["sha256"] == verify_image(image, token=TOKEN).sha256
    assert report["records"] == sum(report["sections"].values()) + sum(report["chunks"].values())
    assert report["objects"][0]["path"] == "program.values"
    json.dumps(report)  # printable by `ckpt inspect --json`


def test_inspect_reports_damage(image: Path) -> None:
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF
    image.write_bytes(data)
    report = inspect_image(image)
    assert not report["ok"] and "damaged" in report["problem"]
    image.write_bytes(data[:-10])
    report = inspect_image(image)
    assert not report["ok"] and "truncated" in report["problem"]
    assert report["sections"] is None and report["header"]["program"] == "heat"


# ------------------------------------------------------------------- refusals --


def assert_refused(path: Path, pattern: str, token: bytes = TOKEN) -> None:
    with pytest.raises(ImageError, match=pattern) as caught:
        read_image(path, token=token)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message


def test_missing_file(tmp_path: Path) -> None:
    assert_refused(tmp_path / "nope.ckpt", "missing file")
    with pytest.raises(ImageError, match="missing file"):
        read_header(tmp_path / "nope.ckpt")


def test_directory_is_unreadable(tmp_path: Path) -> None:
    assert_refused(tmp_path, "unreadable")


def test_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "foreign.ckpt"
    path.write_bytes(b"PK\x03\x04 this is a zip file, really" * 10)
    assert_refused(path, r"not a ckpt image \(bad magic\)")
    with pytest.raises(ImageError, match="not a ckpt image"):
        read_header(path)


def test_newer_format_version(image: Path) -> None:
    data = bytearray(image.read_bytes())
    struct.pack_into("<H", data, len(MAGIC), FORMAT_VERSION + 1)
    image.write_bytes(data)
    assert_refused(image, r"^checkpoint image \S+ has format 2; this ckpt reads format 1$")
    with pytest.raises(ImageError, match="has format 2; this ckpt reads format 1"):
        read_header(image)


@pytest.mark.parametrize("keep", [0, 5, 12, 30, -TRAILER_SIZE - 100, -TRAILER_SIZE, -1])
def test_truncated(image: Path, keep: int) -> None:
    data = image.read_bytes()
    image.write_bytes(data[:keep])
    assert_refused(image, "truncated")


def test_truncated_inside_header_is_caught_by_read_header(image: Path) -> None:
    image.write_bytes(image.read_bytes()[:40])
    with pytest.raises(ImageError, match="truncated"):
        read_header(image)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("where", "pattern"),
    [
        (lambda size, hlen: 20, r"damaged \(header checksum mismatch\)"),  # header JSON
        (lambda size, hlen: 18 + hlen + 3, r"damaged \(record header fails its CRC"),
        (lambda size, hlen: 18 + hlen + 40, "damaged"),  # pickle stream
        (lambda size, hlen: size // 2, r"damaged \(checksum mismatch\)"),  # buffer payload
        (lambda size, hlen: size - TRAILER_SIZE - 1, r"damaged \(checksum mismatch\)"),
        (lambda size, hlen: size - TRAILER_SIZE + 10, "damaged"),  # record count in trailer
        (lambda size, hlen: size - 40, r"damaged \(checksum mismatch\)"),  # stored digest
        (lambda size, hlen: size - 1, "not authentic"),  # stored HMAC
    ],
)
def test_any_flipped_byte_is_refused(image: Path, where: Any, pattern: str) -> None:
    size = image.stat().st_size
    header_len = struct.unpack_from("<I", image.read_bytes(), 10)[0]
    flip(image, where(size, header_len))
    assert_refused(image, pattern)
    with pytest.raises(ImageError):
        verify_image(image, token=TOKEN)


def test_flipped_byte_in_a_compressed_chunk(tmp_path: Path, small_chunks: None) -> None:
    path = tmp_path / "img.ckpt"
    write_image(path, {"zeros": np.zeros(1 << 20, dtype=np.uint8)}, header=HEADER, token=TOKEN)
    flip(path, path.stat().st_size - TRAILER_SIZE - 5)
    assert_refused(path, "damaged")


def test_wrong_token(image: Path) -> None:
    assert_refused(image, r"not authentic \(HMAC mismatch: wrong CKPT_TOKEN or tampered image\)", b"x")


def test_tampered_image_with_recomputed_checksum_fails_the_hmac(image: Path) -> None:
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF
    body = bytes(data[:-TRAILER_SIZE])
    magic, record_bytes, _, mac = struct.unpack("<8sQ32s32s", data[-TRAILER_SIZE:])
    forged = struct.pack("<8sQ32s32s", magic, record_bytes, content_digest(body), mac)
    image.write_bytes(body + forged)
    assert inspect_image(image)["ok"]  # the checksum alone is fooled...
    assert_refused(image, "not authentic")  # ...the HMAC is not
    good_mac = hmac.new(TOKEN, content_digest(body), hashlib.sha256).digest()
    image.write_bytes(body + struct.pack("<8sQ32s32s", magic, record_bytes, content_digest(body), good_mac))
    read_image(image, token=TOKEN)  # with the token, the forgery would be accepted


def test_unpicklable_state_leaves_no_file_and_names_the_attribute(tmp_path: Path) -> None:
    path = tmp_path / "img.ckpt"
    program = Grid(10)
    program.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(UnpicklableStateError) as caught:
        write_image(path, {"program": program, "runtime": {"step": 3}}, header=HEADER, token=TOKEN)
    assert str(caught.value) == (
        f"cannot write checkpoint image {path}: cannot pickle the state: attribute program.lock "
        "(a _thread.lock) cannot be pickled: TypeError: cannot pickle '_thread.lock' object"
    )
    assert caught.value.culprit.path == "program.lock"
    assert isinstance(caught.value, ImageError)
    assert list(tmp_path.iterdir()) == []


def test_write_image_lets_go_of_the_state_at_once(tmp_path: Path) -> None:
    """No reference cycle keeps the pickled state alive after the write: gc is off, refcounts must do."""
    program = Grid(100_000)  # 800 KB: out of band
    blob = program.blob = bytearray(100_000)  # type: ignore[attr-defined]
    owner, values = weakref.ref(program), weakref.ref(program.values)
    enabled = gc.isenabled()
    gc.disable()
    try:
        write_image(tmp_path / "img.ckpt", {"program": program}, header=HEADER, token=TOKEN)
        del program
        assert owner() is None and values() is None
        blob.append(1)  # a bytearray still exported through a view could not grow
    finally:
        if enabled:
            gc.enable()


def test_header_must_be_json(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="header is not JSON"):
        write_image(tmp_path / "img.ckpt", {}, header=ImageHeader(**{**FIELDS, "result": object()}), token=TOKEN)


def test_write_into_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="cannot write checkpoint image"):
        write_image(tmp_path / "no" / "img.ckpt", {}, header=HEADER, token=TOKEN)


class Exploding:
    def __reduce__(self) -> Any:
        return (_explode, ())


def _explode() -> None:
    raise RuntimeError("cannot come back")


def test_state_that_fails_to_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "img.ckpt"
    write_image(path, {"x": Exploding()}, header=HEADER, token=TOKEN)
    assert_refused(path, r"cannot rebuild the saved state \(RuntimeError: cannot come back\)")


# ----------------------------------------------------------- describe_objects --


class Node:
    def __init__(self) -> None:
        self.child: Any = None
        self.payload = np.zeros(10, dtype=np.float64)


def test_describe_objects_paths_sizes_and_order() -> None:
    program = Grid(1000)
    obj = {"program": program, "blob": b"x" * 5000, 7: bytearray(300), "items": [np.ones(3), "s"]}
    found = describe_objects(obj)
    assert found[0] == {"path": "program.values", "type": "numpy.ndarray", "bytes": 8000}
    assert found[1] == {"path": "blob", "type": "bytes", "bytes": 5000}
    paths = {entry["path"] for entry in found}
    assert {"[7]", "items[0]", "items[1]", "program.step"} <= paths
    assert [entry["bytes"] for entry in found] == sorted((e["bytes"] for e in found), reverse=True)
    assert len(describe_objects(obj, limit=2)) == 2


def test_describe_objects_is_safe_on_cycles_and_stops_at_depth_three() -> None:
    a, b = Node(), Node()
    a.child, b.child = b, a
    found = describe_objects({"a": a})
    paths = {entry["path"] for entry in found}
    assert "a.payload" in paths and "a.child.payload" in paths
    assert "a.child.child" not in paths  # the cycle back to a is not walked twice
    deep = {"l1": {"l2": {"l3": {"l4": 1}}}}
    assert describe_objects(deep) == [{"path": "l1.l2.l3", "type": "dict", "bytes": pytest.approx(184, abs=200)}]


def test_describe_objects_summarises_big_containers() -> None:
    floats = [float(i) for i in range(100_000)]
    (entry,) = describe_objects({"history": floats})
    assert entry["path"] == "history" and entry["type"] == "list"
    assert entry["bytes"] > 100_000 * 24  # the list plus an estimate of its floats


def test_describe_objects_of_a_bare_array() -> None:
    assert describe_objects(np.zeros(4)) == [{"path": "<root>", "type": "numpy.ndarray", "bytes": 32}]
