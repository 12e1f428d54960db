"""Benchmark the runtime's per-step overhead: `ckpt launch` against `ckpt launch --native` on the same program."""

# Usage: python benchmarks/bench_overhead.py [--ranks 2] [--steps 1500] [--work-ms 1.0] [--every 1]
#                                            [--runs 15] [--checkpoints 3] [--quiet-wait 20] [--quiet-share 0.05]
#                                            [--json FILE]
#
# The program is benchmarks/programs/spin.py: each step busy-waits WORK_MS and
# every EVERY steps does one rt.allgather.  It times its own step loop
# (time.perf_counter() at the start of its first step and the end of its last)
# and returns the mean wall time of one step as its result, so process
# start-up, joining the coordinator and setup are not counted.  A run's
# per-step time is the mean over its ranks (with an allgather every step they
# agree to within a few microseconds).
#
# Runs alternate native / ckpt, the order flipping every round, so both modes
# see the same machine load; the table reports the median of each mode.  The
# overhead is median(ckpt) / median(native) - 1; the median of the per-round
# ratios is shown too, as a check that is less sensitive to load that drifts
# between rounds.  No checkpoint is taken during these runs.
#
# The machine is shared (other people's test suites run on the same 2 cores),
# and a 1 ms step is very sensitive to that.  So each round waits (up to
# --quiet-wait seconds) until other processes use less than 10% of the CPUs,
# and each run records how much CPU *other* processes used while it ran
# (/proc/stat busy time minus this benchmark's children's rusage).  A round
# whose two runs both saw less than --quiet-share of the machine used by
# others is "quiet"; the overhead over the quiet rounds alone is reported too.
#
# Then one more ckpt job of the same program runs long enough to take
# --checkpoints checkpoints with `ckpt checkpoint --wait`, one after the other;
# their times come from the manifests ("seconds": from the coordinator's
# request to the manifest being written; per rank, the image write).

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_image import machine

ROOT = Path(__file__).resolve().parent.parent
SPIN = ROOT / "benchmarks" / "programs" / "spin.py"
CKPT = [sys.executable, "-m", "ckpt"]
TARGET_PERCENT = 2.0
_RESULT = re.compile(r"^\[rank (\d+)\] result: (\S+)$", re.M)


class Jobs:
    """CLI processes started by the benchmark, each in its own session; `close` kills their groups."""

    def __init__(self, command: list[str] = CKPT) -> None:
        self.command = command  # how to run `ckpt` (another checkout's, for bench_sched --compare commit)
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], out: Path) -> subprocess.Popen[str]:
        with open(out, "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
            process = subprocess.Popen(
                [*self.command, *args], stdout=stdout, stderr=stderr, text=True, start_new_session=True
            )
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
        self.processes.clear()


def _machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all CPUs, from /proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    """CPU seconds used by this process and its reaped descendants (the ckpt commands and their ranks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class ForeignLoad:
    """Share of the machine's CPUs used by processes other than this benchmark's, over an interval."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.monotonic(), _machine_busy(), _own_cpu()

    def share(self) -> float:
        wall = time.monotonic() - self.wall
        foreign = (_machine_busy() - self.busy) - (_own_cpu() - self.own)
        return max(0.0, foreign) / (wall * (os.cpu_count() or 1))


def wait_quiet(limit: float, threshold: float = 0.10) -> float:
    """Wait (at most `limit` s) for a second in which other processes use under `threshold` of the CPUs."""
    deadline = time.monotonic() + limit
    while True:
        load = ForeignLoad()
        time.sleep(1.0)
        share = load.share()
        if share < threshold or time.monotonic() > deadline:
            return share


def ckpt_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run a short ckpt command (status, checkpoint, kill) to completion."""
    return subprocess.run(
        [*CKPT, *args], capture_output=True, text=True, timeout=timeout, start_new_session=True, check=False
    )


def wait_stepping(ckpt_dir: Path, job: subprocess.Popen[str], timeout: float = 120.0) -> dict[str, Any]:
    """Poll `ckpt status --json` until every rank has completed a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.poll() is not None:
            raise RuntimeError(f"the job exited with status {job.returncode} before stepping")
        answer = ckpt_cli("status", "--json", "--ckpt-dir", str(ckpt_dir))
        if answer.returncode == 0:
            status: dict[str, Any] = json.loads(answer.stdout)
            ranks = status["ranks"]
            if len(ranks) == status["size"] and all(r["step"] >= 1 for r in ranks):
                return status
        time.sleep(0.1)
    raise RuntimeError(f"the job in {ckpt_dir} did not start stepping within {timeout} s")


def run_spin(jobs: Jobs, directory: Path, native: bool, args: argparse.Namespace, tag: str) -> tuple[float, float]:
    """One uninterrupted launch: (mean over ranks of the per-step time the program measured, foreign load)."""
    ckpt_dir = directory / f"ckpt-{tag}"
    out = directory / f"{tag}.out"
    command = ["launch", "-n", str(args.ranks), "--ckpt-dir", str(ckpt_dir)]
    command += ["--native"] if native else []
    command += [str(SPIN), str(args.steps), str(args.work_ms), str(args.every)]
    load = ForeignLoad()
    job = jobs.start(command, out)
    try:
        code = job.wait(timeout=args.steps * args.work_ms / 1000 * 20 + 60)
        foreign = load.share()
    finally:
        jobs.close()
    results = {int(rank): float(value) for rank, value in _RESULT.findall(out.read_text())}
    if code != 0 or len(results) != args.ranks:
        raise RuntimeError(f"{' '.join(command)} failed ({code}): {out.with_suffix('.err').read_text()}")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return statistics.mean(results.values()), foreign


def measure_overhead(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, float]] = []
    for i in range(args.runs):
        row = {"quiet_before": wait_quiet(args.quiet_wait)}
        for mode in ("native", "ckpt") if i % 2 == 0 else ("ckpt", "native"):
            row[mode], row[f"{mode}_foreign"] = run_spin(jobs, directory, mode == "native", args, f"{mode}-{i}")
            print(
                f"  round {i} {mode:<6}: {row[mode] * 1e3:.4f} ms/step, others used {row[f'{mode}_foreign']:.0%}",
                file=sys.stderr,
            )
        rounds.append(row)
    quiet = [r for r in rounds if max(r["native_foreign"], r["ckpt_foreign"]) < args.quiet_share]
    summary: dict[str, Any] = {"rounds": rounds, "quiet_rounds": len(quiet)}
    for name, subset in (("all", rounds), ("quiet", quiet)):
        if not subset:
            continue
        native_s = statistics.median(r["native"] for r in subset)
        ckpt_s = statistics.median(r["ckpt"] for r in subset)
        paired = statistics.median(r["ckpt"] / r["native"] for r in subset)
        summary[name] = {
            "native_s": native_s,
            "ckpt_s": ckpt_s,
            "overhead_percent": (ckpt_s / native_s - 1) * 100,
            "paired_overhead_percent": (paired - 1) * 100,
        }
    return summary


def measure_checkpoints(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoints of a running ckpt job of the same program, taken one after the other."""
    ckpt_dir = directory / "ckpt-checkpoints"
    command = ["launch", "-n", str(args.ranks), "--ckpt-dir", str(ckpt_dir)]
    command += [str(SPIN), str(10**9), str(args.work_ms), str(args.every)]
    job = jobs.start(command, directory / "checkpoints.out")
    rows: list[dict[str, Any]] = []
    try:
        wait_stepping(ckpt_dir, job)
        for _ in range(args.checkpoints):
            started = time.perf_counter()
            answer = ckpt_cli("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
            cli_s = time.perf_counter() - started
            if answer.returncode != 0:
                raise RuntimeError(f"ckpt checkpoint failed: {answer.stderr.strip()}")
            name = (ckpt_dir / "latest").read_text().strip()
            manifest = json.loads((ckpt_dir / name).read_text())
            rows.append(
                {
                    "number": manifest["number"],
                    "seconds": manifest["seconds"],
                    "image_seconds": [r["seconds"] for r in manifest["ranks"]],
                    "bytes": sum(r["bytes"] for r in manifest["ranks"]),
                    "cli_s": cli_s,
                }
            )
        ckpt_cli("kill", "--ckpt-dir", str(ckpt_dir))
        job.wait(timeout=30)
    finally:
        jobs.close()
    return {
        "seconds": statistics.median(r["seconds"] for r in rows),
        "image_seconds": statistics.median(max(r["image_seconds"]) for r in rows),
        "cli_s": statistics.median(r["cli_s"] for r in rows),
        "bytes": rows[-1]["bytes"],
        "all": rows,
    }


def report(settings: dict[str, Any], overhead: dict[str, Any], checkpoints: dict[str, Any]) -> str:
    work = settings["work_ms"] / 1e3
    lines = [
        f"{settings['ranks']} ranks, {settings['steps']} steps of {settings['work_ms']} ms busy work, "
        f"an allgather every {settings['every']} step(s); {settings['runs']} rounds (one run per mode each), "
        f"{overhead['quiet_rounds']} of them quiet (others used < {settings['quiet_share']:.0%} of the CPUs)",
        "",
        "| rounds | native per step (ms) | ckpt per step (ms) | runtime cost beyond the work, native / ckpt (µs) "
        "| overhead | median per-round overhead | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("all", "quiet"):
        if name not in overhead:
            continue
        o = overhead[name]
        met = "yes" if o["overhead_percent"] <= TARGET_PERCENT else "NO"
        lines.append(
            f"| {name} | {o['native_s'] * 1e3:.4f} | {o['ckpt_s'] * 1e3:.4f} "
            f"| {(o['native_s'] - work) * 1e6:.0f} / {(o['ckpt_s'] - work) * 1e6:.0f} "
            f"| {o['overhead_percent']:+.2f} % | {o['paired_overhead_percent']:+.2f} % "
            f"| <= {TARGET_PERCENT} % | {met} |"
        )
    lines += ["", "every round: native, ckpt (ms per step), CPU share used by others during each run"]
    for i, r in enumerate(overhead["rounds"]):
        lines.append(
            f"  {i}: {r['native'] * 1e3:.4f} {r['ckpt'] * 1e3:.4f}   "
            f"others {r['native_foreign']:.0%} {r['ckpt_foreign']:.0%}"
        )
    lines += [
        "",
        f"checkpoint of the running job ({checkpoints['bytes']} bytes in {settings['ranks']} images), "
        f"median of {len(checkpoints['all'])}: {checkpoints['seconds'] * 1e3:.1f} ms "
        f"(slowest image write {checkpoints['image_seconds'] * 1e3:.1f} ms; "
        f"`ckpt checkpoint --wait` wall time {checkpoints['cli_s'] * 1e3:.0f} ms)",
        "  every checkpoint, ms: " + " ".join(f"{r['seconds'] * 1e3:.1f}" for r in checkpoints["all"]),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--work-ms", type=float, default=1.0, help="busy work per step")
    parser.add_argument("--every", type=int, default=1, help="one allgather every K steps")
    parser.add_argument("--runs", type=int, default=15, help="rounds, one run per mode each (at least 5)")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints of the running job to time")
    parser.add_argument("--quiet-wait", type=float, default=20.0, help="wait at most this long for a quiet machine")
    parser.add_argument("--quiet-share", type=float, default=0.05, help="a quiet run: others used less CPU than this")
    parser.add_argument("--dir", type=Path, default=None, help="where the temp dir goes")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be at least 5")

    def on_sigterm(signum: int, frame: object) -> None:
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    directory = Path(tempfile.mkdtemp(prefix="ckpt-bench-overhead-", dir=args.dir))
    jobs = Jobs()
    try:
        overhead = measure_overhead(jobs, directory, args)
        checkpoints = measure_checkpoints(jobs, directory, args)
    finally:
        jobs.close()
        shutil.rmtree(directory, ignore_errors=True)
    settings = {k: getattr(args, k) for k in ("ranks", "steps", "work_ms", "every", "runs", "quiet_share")}
    info = machine()
    print(f"machine: {info}; load average at the end: {os.getloadavg()}")
    print(report(settings, overhead, checkpoints))
    if args.json is not None:
        data = {"machine": info, "settings": settings, "overhead": overhead, "checkpoints": checkpoints}
        args.json.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
