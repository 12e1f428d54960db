"""Benchmark checkpoint image write and read against a raw write / read of the same bytes."""

# Usage: python benchmarks/bench_image.py [--size-mib 1024] [--dir DIR] [--repeat 3] [--json FILE]
#
# Cases, each repeated (median reported), raw and image interleaved so that
# both see the same machine state:
#   write  raw baseline: the array's bytes written in 8 MiB pieces to a new file,
#          then fsync; against write_image of a program-like object holding the
#          array (incompressible random bytes, and zeros with ~1% random bytes).
#   read   raw baseline: a fresh numpy.empty buffer filled by readinto from the
#          raw file; against read_image of the image.  The page cache of both
#          files is dropped first (posix_fadvise DONTNEED after fsync), so both
#          read from the same source (which may still be the host's cache).
#
# Before every timed operation, raw or image, memory is warmed: a block of
# 2 x size + 512 MiB is allocated, touched and freed.  This machine is a VM
# with virtio-balloon free page reporting: memory the guest freed a few seconds
# ago has been handed back to the host, and the page cache (or numpy.empty)
# faulting it in again costs up to 3 s per GiB of guest system time, at random.
# Warming makes both sides reuse memory the host still backs; --no-warm turns
# it off to see the raw effect.

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt._schemas import ImageHeader
from ckpt.runtime.images import read_image, write_image

PIECE = 8 << 20
TOKEN = b"bench-token"
TARGETS = {
    ("write", "incompressible"): ("<=", 1.25),
    ("write", "mostly-zero"): ("<", 1.0),
    ("read", "incompressible"): ("<=", 1.25),
    ("read", "mostly-zero"): ("<=", 1.25),
}


class BenchProgram:
    """Stand-in for a user program: a big grid plus a little bookkeeping."""

    def __init__(self, grid: np.ndarray) -> None:
        self.grid = grid
        self.step = 1234
        self.params = {"alpha": 0.5, "name": "bench", "shape": list(grid.shape)}
        self.history = [float(i) for i in range(1000)]


def make_state(kind: str, size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "incompressible":
        return rng.integers(0, 256, size, dtype=np.uint8)
    grid = np.zeros(size, dtype=np.uint8)
    where = rng.integers(0, size, size // 100)
    grid[where] = rng.integers(1, 256, where.size, dtype=np.uint8)
    return grid


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, grid: np.ndarray) -> None:
    view = grid.data.cast("B")
    with open(path, "wb", buffering=0) as f:
        for start in range(0, view.nbytes, PIECE):
            f.write(view[start : start + PIECE])
        os.fsync(f.fileno())


def raw_read(path: Path, size: int) -> np.ndarray:
    grid = np.empty(size, dtype=np.uint8)
    view = grid.data
    with open(path, "rb", buffering=0) as f:
        for start in range(0, size, PIECE):
            f.readinto(view[start : start + PIECE])
    return grid


def image_write(path: Path, grid: np.ndarray) -> None:
    obj = {"program": BenchProgram(grid), "plugins": {}}
    header = ImageHeader(program="bench", job="bench", rank=0, size=1, number=1, generation=0)
    write_image(path, obj, header=header, token=TOKEN)


def image_read(path: Path) -> object:
    _, obj = read_image(path, token=TOKEN)
    return obj


WARM = True


def warm_memory(size: int) -> None:
    """Touch and free enough memory that the timed operation reuses host-backed pages."""
    if WARM:
        block = np.ones(2 * size + (512 << 20), dtype=np.uint8)
        del block


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - started
    del result
    return seconds


def run_settings(**extra: Any) -> dict[str, Any]:
    """What a run's results are recorded with: the machine, the exact command, and the run's own `extra`."""
    return {"machine": machine(), "command": " ".join(["python", *sys.argv]), **extra}


def write_results(path: Path | None, settings: dict[str, Any], data: Any) -> None:
    """--json: the run's settings and data, to `path` (nothing when None)."""
    if path is not None:
        path.write_text(json.dumps({"settings": settings, "data": data}, indent=1))


def machine() -> dict[str, Any]:
    model = "unknown"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "ram_gib": round(ram / (1 << 30), 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def interleaved(
    raw_op: Callable[[], float], image_op: Callable[[], float], repeat: int
) -> tuple[list[float], list[float]]:
    """Time both after one uncounted warm-up, alternating which goes first."""
    raw_op(), image_op()  # warm-up: the first write to fresh disk blocks is much slower
    raw_times: list[float] = []
    image_times: list[float] = []
    for rep in range(repeat):
        if rep % 2:
            image_times.append(image_op())
            raw_times.append(raw_op())
        else:
            raw_times.append(raw_op())
            image_times.append(image_op())
    return raw_times, image_times


def measure(kind: str, size: int, directory: Path, repeat: int) -> list[dict[str, Any]]:
    grid = make_state(kind, size)
    raw_path, image_path = directory / f"raw-{kind}.bin", directory / f"image-{kind}.ckpt"

    def write_raw() -> float:
        raw_path.unlink(missing_ok=True)
        warm_memory(size)
        return timed(lambda: raw_write(raw_path, grid))

    def write_image_() -> float:
        image_path.unlink(missing_ok=True)
        warm_memory(size)
        return timed(lambda: image_write(image_path, grid))

    def read_raw() -> float:
        drop_cache(raw_path)
        warm_memory(size)
        return timed(lambda: raw_read(raw_path, size))

    def read_image_() -> float:
        drop_cache(image_path)
        warm_memory(size)
        return timed(lambda: image_read(image_path))

    times = {
        "write": interleaved(write_raw, write_image_, repeat),
        "read": interleaved(read_raw, read_image_, repeat),
    }
    image_bytes = image_path.stat().st_size
    raw_path.unlink()
    image_path.unlink()
    rows = []
    for case, (raw_all, image_all) in times.items():
        raw_s, image_s = statistics.median(raw_all), statistics.median(image_all)
        rows.append(
            {
                "case": case,
                "state": kind,
                "mib": size >> 20,
                "image_bytes": image_bytes,
                "raw_s": raw_s,
                "image_s": image_s,
                "ratio": image_s / raw_s,
                "raw_all": raw_all,
                "image_all": image_all,
            }
        )
    return rows


def run(size_mib: int, directory: Path, repeat: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind in ("incompressible", "mostly-zero"):
        rows += measure(kind, size_mib << 20, directory, repeat)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | state | image size | raw (s) | image (s) | image GB/s | ratio | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        op, bound = TARGETS[(row["case"], row["state"])]
        met = row["ratio"] <= bound if op == "<=" else row["ratio"] < bound
        lines.append(
            f"| {row['case']} | {row['state']} | {row['image_bytes'] / (1 << 20):.0f} MiB "
            f"| {row['raw_s']:.3f} | {row['image_s']:.3f} "
            f"| {row['mib'] * (1 << 20) / row['image_s'] / 1e9:.2f} "
            f"| {row['ratio']:.2f} | {op} {bound} | {'yes' if met else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-warm", action="store_true", help="do not warm memory before timing")
    args = parser.parse_args()
    global WARM
    WARM = not args.no_warm
    directory = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        rows = run(args.size_mib, directory, args.repeat)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    info = machine()
    print(f"machine: {info}")
    print(table(rows))
    if args.json is not None:
        settings = {"size_mib": args.size_mib, "repeat": args.repeat, "warm": WARM}
        args.json.write_text(json.dumps({"machine": info, "settings": settings, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
