"""Benchmark checkpoint and restart end to end, through the CLI, against a raw write / read of the same bytes."""

# Usage: python benchmarks/bench_checkpoint.py [--size-mib 1024] [--state both|incompressible|mostly-zero]
#                                              [--repeat 3] [--step-ms 10] [--no-warm] [--dir DIR] [--json FILE]
#
# The job is benchmarks/programs/bigstate.py on one rank: SIZE MiB of numpy
# state (the same bytes as bench_image.make_state) and a step that sleeps
# STEP_MS.  Each round:
#
#   1. `ckpt launch` the job; poll `ckpt status --json` until it has completed
#      a step (it is in its step loop);
#   2. `ckpt checkpoint --kill`, and read the new manifest: its "seconds"
#      (coordinator: from the request to the manifest being written — reach,
#      park, the phase barriers, the image, the manifest) and the rank's
#      "seconds" (write_image: pickle, compress, hash, write, fsync, rename);
#      against raw: bench_image.raw_write of the same array, write + fsync;
#   3. `ckpt restart --log-level DEBUG`, timed from just before the command is
#      started to the `time.time()` the program records at its first step
#      after the restart (bigstate.py's STAMP_FILE).  The same file gives the
#      time the rank process imported the program (early in its start-up,
#      before it reads its image), and the rank's DEBUG log gives read_image's
#      own time ("read ... in X s"); the rest (connecting to the coordinator,
#      the RESTART / REFRESH / RESUME barriers, up to the first step) is what
#      remains.  Against raw: bench_image.raw_read, a fresh numpy.empty filled
#      by readinto.
#
# Raw and ckpt alternate which goes first from round to round; the first round
# is a warm-up and is not counted.  As in bench_image.py, page caches of the
# raw file and the image are dropped before each read, and memory is warmed
# (bench_image.warm_memory) before every timed operation, raw or ckpt, because
# this VM hands freed memory back to its host (see docs/benchmarks.md);
# --no-warm turns that off.  Warming does not always help: the host takes
# free pages back whenever this guest reports them (free page reporting,
# /sys/module/page_reporting), and an operation that allocates right after a
# report pays 2-3 s per GiB of page faults.  So the script records how much
# memory the guest reported during every timed operation, and besides the
# medians over all rounds gives the medians over the "clean" rounds, in which
# neither the ckpt operation nor its raw counterpart saw more than
# CLEAN_MIB reported.  Ratios are ratios of medians; "rest" is the median of
# the per-round rests.

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_image
import numpy as np
from bench_image import drop_cache, machine, make_state, raw_read, raw_write, timed, warm_memory
from bench_overhead import Jobs, ckpt_cli, wait_stepping

ROOT = Path(__file__).resolve().parent.parent
BIGSTATE = ROOT / "benchmarks" / "programs" / "bigstate.py"
CKPT = [sys.executable, "-m", "ckpt"]
TARGETS = {
    ("write", "incompressible"): ("<=", 1.25),
    ("write", "mostly-zero"): ("<", 1.0),
    ("restart", "incompressible"): ("<=", 1.25),
    ("restart", "mostly-zero"): ("<=", 1.25),
}
CLEAN_MIB = 64
_SLOW = 300.0  # seconds a CLI step of a 1 GiB job may take
_REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")
_READ_LOG = re.compile(r"DEBUG ckpt\.runtime\.images: read \S+: (\d+) bytes \((\d+) raw\) in ([0-9.]+) s")


def wait_file(path: Path, job: subprocess.Popen[str], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.poll() is not None:
            raise RuntimeError(f"the restarted job exited with status {job.returncode} before stepping")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the restarted job did not step within {timeout} s")
        time.sleep(0.002)


def reported_mib() -> float:
    """MiB of free memory this guest has reported to its host so far (NaN without page reporting)."""
    try:
        return int(_REPORTED.read_text()) / 1024
    except (OSError, ValueError):
        return float("nan")


def checkpoint_round(
    jobs: Jobs, directory: Path, grid: np.ndarray, kind: str, args: argparse.Namespace, rnd: int
) -> dict[str, Any]:
    """Launch, checkpoint --kill, restart: one sample of every ckpt and raw time."""
    size = grid.nbytes
    ckpt_dir, stamp = directory / f"ckpt-{kind}-{rnd}", directory / f"stamp-{kind}-{rnd}.json"
    raw_path = directory / f"raw-{kind}.bin"
    raw_first = rnd % 2 == 0
    row: dict[str, Any] = {}

    def write_raw() -> None:
        raw_path.unlink(missing_ok=True)
        warm_memory(size)
        before = reported_mib()
        row["raw_write_s"] = timed(lambda: raw_write(raw_path, grid))
        row["raw_write_reported_mib"] = reported_mib() - before

    def read_raw() -> None:
        drop_cache(raw_path)
        warm_memory(size)
        before = reported_mib()
        row["raw_read_s"] = timed(lambda: raw_read(raw_path, size))
        row["raw_read_reported_mib"] = reported_mib() - before

    try:
        program = [str(BIGSTATE), str(args.size_mib), kind, str(args.step_ms), str(stamp)]
        launch = jobs.start(["launch", "--ckpt-dir", str(ckpt_dir), *program], directory / f"launch-{rnd}.out")
        wait_stepping(ckpt_dir, launch, timeout=_SLOW)
        if raw_first:
            write_raw()
        warm_memory(size)
        before, started = reported_mib(), time.perf_counter()
        answer = ckpt_cli("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir), timeout=_SLOW)
        row["checkpoint_cli_s"] = time.perf_counter() - started
        row["checkpoint_reported_mib"] = reported_mib() - before
        if answer.returncode != 0:
            raise RuntimeError(f"ckpt checkpoint --kill failed: {answer.stderr.strip()}")
        if launch.wait(timeout=60) != 0:
            raise RuntimeError(f"ckpt launch exited with status {launch.returncode} after checkpoint --kill")
        if not raw_first:
            write_raw()
        manifest = json.loads((ckpt_dir / (ckpt_dir / "latest").read_text().strip()).read_text())
        (rank,) = manifest["ranks"]
        row.update(checkpoint_s=manifest["seconds"], image_write_s=rank["seconds"], image_bytes=rank["bytes"])

        if raw_first:
            read_raw()
        drop_cache(ckpt_dir / rank["file"])
        warm_memory(size)
        before, started_at = reported_mib(), time.time()
        restart = jobs.start(
            ["restart", "--log-level", "DEBUG", "--ckpt-dir", str(ckpt_dir)], directory / f"restart-{rnd}.out"
        )
        wait_file(stamp, restart)
        row["restart_reported_mib"] = reported_mib() - before
        record = json.loads(stamp.read_text())
        ckpt_cli("kill", "--ckpt-dir", str(ckpt_dir))
        restart.wait(timeout=60)
        if not raw_first:
            read_raw()
    finally:
        jobs.close()
    if not record["intact"]:
        raise RuntimeError("the restarted state differs from the checkpointed state")
    log = (directory / f"restart-{rnd}.err").read_text()
    found = _READ_LOG.search(log)
    row.update(
        restart_s=record["first_step"] - started_at,
        rank_started_s=record["imported"] - started_at,
        image_read_s=float(found.group(3)) if found else float("nan"),
    )
    row["rest_s"] = row["restart_s"] - row["rank_started_s"] - row["image_read_s"]
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return row


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} | {"n": len(rounds)}


def _clean(row: dict[str, Any], ops: tuple[str, str]) -> bool:
    return all(row[f"{op}_reported_mib"] <= CLEAN_MIB for op in ops)


def measure(jobs: Jobs, kind: str, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    grid = make_state(kind, args.size_mib << 20)
    rounds = []
    for rnd in range(args.repeat + 1):
        row = checkpoint_round(jobs, directory, grid, kind, args, rnd)
        label = "warm-up" if rnd == 0 else f"round {rnd}"
        print(f"  {kind} {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), file=sys.stderr)
        if rnd:
            rounds.append(row)
    (directory / f"raw-{kind}.bin").unlink(missing_ok=True)
    summary: dict[str, Any] = {"state": kind, "mib": args.size_mib, "rounds": rounds, "all": _medians(rounds)}
    if _REPORTED.exists():
        for case, ops in (("write", ("raw_write", "checkpoint")), ("restart", ("raw_read", "restart"))):
            clean = [r for r in rounds if _clean(r, ops)]
            summary[f"clean_{case}"] = _medians(clean) if clean else None
    return summary


def _target(case: str, kind: str) -> str:
    op, bound = TARGETS[(case, kind)]
    return f"{op} {bound}"


def _met(case: str, kind: str, ratio: float) -> str:
    op, bound = TARGETS[(case, kind)]
    return "yes" if (ratio <= bound if op == "<=" else ratio < bound) else "NO"


def _subsets(row: dict[str, Any], case: str) -> list[tuple[str, dict[str, Any]]]:
    subsets = [(f"all {row['all']['n']}", row["all"])]
    clean = row.get(f"clean_{case}")
    if clean is not None and clean["n"] < row["all"]["n"]:
        subsets.append((f"clean {clean['n']}", clean))
    return subsets


def tables(rows: list[dict[str, Any]]) -> str:
    lines = [
        "checkpoint, seconds (ratio = ckpt / raw write + fsync of the same bytes)",
        "",
        "| state | rounds | image size | raw write | image write | ratio | checkpoint | ratio | target "
        "| met (image, whole) | `checkpoint --kill` wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        kind = row["state"]
        for label, r in _subsets(row, "write"):
            image, whole = r["image_write_s"] / r["raw_write_s"], r["checkpoint_s"] / r["raw_write_s"]
            lines.append(
                f"| {kind} | {label} | {r['image_bytes'] / (1 << 20):.0f} MiB | {r['raw_write_s']:.3f} "
                f"| {r['image_write_s']:.3f} | {image:.2f} | {r['checkpoint_s']:.3f} | {whole:.2f} "
                f"| {_target('write', kind)} | {_met('write', kind, image)}, {_met('write', kind, whole)} "
                f"| {r['checkpoint_cli_s']:.3f} |"
            )
    lines += [
        "",
        "restart, seconds from starting `ckpt restart` to the program's first step (ratio = ckpt / raw read)",
        "",
        "| state | rounds | raw read | restart | ratio | rank started | image read | ratio | rest | target "
        "| met (image read, whole) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        kind = row["state"]
        for label, r in _subsets(row, "restart"):
            whole, image = r["restart_s"] / r["raw_read_s"], r["image_read_s"] / r["raw_read_s"]
            lines.append(
                f"| {kind} | {label} | {r['raw_read_s']:.3f} | {r['restart_s']:.3f} | {whole:.2f} "
                f"| {r['rank_started_s']:.3f} | {r['image_read_s']:.3f} | {image:.2f} | {r['rest_s']:.3f} "
                f"| {_target('restart', kind)} | {_met('restart', kind, image)}, {_met('restart', kind, whole)} |"
            )
    lines += ["", "every round: seconds [MiB the guest reported to the host meanwhile]"]
    for row in rows:
        for key, reported in (
            ("raw_write_s", "raw_write"),
            ("image_write_s", "checkpoint"),
            ("checkpoint_s", "checkpoint"),
            ("raw_read_s", "raw_read"),
            ("restart_s", "restart"),
            ("image_read_s", "restart"),
        ):
            values = " ".join(f"{r[key]:.3f} [{r[f'{reported}_reported_mib']:.0f}]" for r in row["rounds"])
            lines.append(f"  {row['state']:<14} {key:<14} {values}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--state", choices=["both", "incompressible", "mostly-zero"], default="both")
    parser.add_argument("--repeat", type=int, default=3, help="counted rounds per state (after one warm-up)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="how long one step of the job sleeps")
    parser.add_argument("--no-warm", action="store_true", help="do not warm memory before timing")
    parser.add_argument("--dir", type=Path, default=None, help="where the temp dir goes")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    bench_image.WARM = not args.no_warm

    def on_sigterm(signum: int, frame: object) -> None:
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    kinds = ["incompressible", "mostly-zero"] if args.state == "both" else [args.state]
    directory = Path(tempfile.mkdtemp(prefix="ckpt-bench-checkpoint-", dir=args.dir))
    jobs = Jobs()
    try:
        rows = [measure(jobs, kind, directory, args) for kind in kinds]
    finally:
        jobs.close()
        shutil.rmtree(directory, ignore_errors=True)
    info = machine()
    print(f"machine: {info}; load average at the end: {os.getloadavg()}")
    print(tables(rows))
    if args.json is not None:
        settings = {"size_mib": args.size_mib, "repeat": args.repeat, "step_ms": args.step_ms, "warm": not args.no_warm}
        args.json.write_text(json.dumps({"machine": info, "settings": settings, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
