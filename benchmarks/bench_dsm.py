"""Benchmark the HLRC DSM: page-fetch time by protocol, per-program time breakdown, the link model's effect."""

# Usage: python benchmarks/bench_dsm.py [--rounds 5] [--pages 1024] [--only pagefetch|programs|link]
#                                       [--plot docs/dsm_breakdown.png] [--quiet-wait 10] [--dir DIR] [--json FILE]
#
# Every job is `ckpt launch -n 4 --native` (the DSM over the simib provider
# directly: the protocols' own costs, no checkpoint plugin in between).
#
# 1. pagefetch: benchmarks/programs/dsm_pagefetch.py, the NEWGENDSM paper's
#    microbenchmark: rank 0 writes PAGES pages first (so it is their home),
#    then the 3 other ranks read one word of each page at once; a reader's
#    figure is its mean time per page fault (each one a fetch from rank 0).
#    A run's figure is the mean over the readers.  `async` and `onesided`
#    alternate which goes first, --rounds rounds; the ratio is of medians
#    (target: onesided / async <= 0.8).
# 2. programs: every program of dsm/programs with its BENCH_ARGS, on both
#    protocols, through benchmarks/programs/dsm_stats.py, which writes each
#    rank's `statistics()`; the breakdown (compute / page / wait / lock
#    seconds) is the mean over the ranks.  --plot draws it as stacked bars
#    (matplotlib, from the `bench` extra).
# 3. link: the page-fetch run on fabrics with a link model (`--fabric-latency`,
#    `--fabric-bandwidth`): no model (the host's speed), a fast link and a
#    slow one; a faster link shortens the page time.
#
# Each round first waits (up to --quiet-wait s) for a quiet machine, as
# bench_ib does, and records the CPU share other processes used.

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_ib import alternate, launch, results
from bench_image import run_settings, write_results
from bench_overhead import Jobs

ROOT = Path(__file__).resolve().parent.parent
PAGEFETCH = ROOT / "benchmarks" / "programs" / "dsm_pagefetch.py"
WITH_STATS = ROOT / "benchmarks" / "programs" / "dsm_stats.py"
PROTOCOLS = ("async", "onesided")
RANKS = 4
TARGET = 0.8
#: Arguments of each program for the breakdown: each runs a few seconds on 4 ranks.
BENCH_ARGS: dict[str, list[str]] = {
    "sor": ["256", "40"],
    "jacobi": ["256", "60"],
    "matmul": ["256", "16"],
    "lu": ["256", "2"],
    "isort": ["4096", "256", "40"],
    "tsp": ["10", "4", "4"],
    "water": ["128", "30", "8"],
}
#: (name, --fabric-latency, --fabric-bandwidth) of the link-model runs; None: no model.
LINKS: list[tuple[str, str | None, str | None]] = [
    ("no model", None, None),
    ("fast: 2us, 4GB/s", "2us", "4GB/s"),
    ("slow: 50us, 200MB/s", "50us", "200MB/s"),
]


def pagefetch(jobs: Jobs, directory: Path, tag: str, protocol: str, pages: int, link: list[str]) -> tuple[float, float]:
    """One page-fetch job: (mean µs per page over the readers, CPU share of others)."""
    program = ["--dsm-protocol", protocol, *link, str(PAGEFETCH), str(pages)]
    stdout, foreign = launch(jobs, directory, tag, True, RANKS, program)
    readers = [float(v.split(",")[0].split("=")[1]) for r, v in results(stdout).items() if r != 0]
    if len(readers) != RANKS - 1:
        raise RuntimeError(f"page-fetch job printed {results(stdout)}")
    return statistics.mean(readers), foreign


def measure_pagefetch(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = alternate(
        args.rounds,
        args.quiet_wait,
        lambda mode, i: pagefetch(jobs, directory, f"pf-{mode}-{i}", mode, args.pages, []),
        "page fetch",
        PROTOCOLS,
    )
    summary: dict[str, Any] = {p: statistics.median(r[p] for r in rows) for p in PROTOCOLS}
    summary["ratio"] = summary["onesided"] / summary["async"]
    summary["paired_ratio"] = statistics.median(r["onesided"] / r["async"] for r in rows)
    return summary | {"rounds": rows}


def measure_programs(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, argv in BENCH_ARGS.items():
        if not (ROOT / "dsm" / "programs" / f"{name}.py").exists():
            print(f"  {name}: not in dsm/programs, skipped", file=sys.stderr)
            continue
        for protocol in PROTOCOLS:
            prefix = directory / f"stats-{name}-{protocol}"
            os.environ["CKPT_BENCH_DSM_PROGRAM"], os.environ["CKPT_BENCH_DSM_STATS"] = name, str(prefix)
            started = time.perf_counter()
            stdout, foreign = launch(
                jobs, directory, f"{name}-{protocol}", True, RANKS,
                ["--dsm-protocol", protocol, str(WITH_STATS), *argv],
            )  # fmt: skip
            wall = time.perf_counter() - started
            lines = set(results(stdout).values())
            if len(lines) != 1 or "numpy=match" not in next(iter(lines)):
                raise RuntimeError(f"{name} on {protocol} did not give numpy's answer: {lines}")
            ranks = [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(RANKS)]
            row = {
                key: statistics.mean(s[key] for s in ranks)
                for key in ("total_seconds", "compute_seconds", "page_seconds", "wait_seconds", "lock_seconds")
            }
            for key in ("page_fetches", "diffs", "diff_bytes", "lock_acquires", "barriers", "fetch_retries"):
                row[key] = sum(s[key] for s in ranks)
            row |= {"wall_seconds": wall, "foreign": foreign, "argv": argv}
            table[f"{name}/{protocol}"] = row
            print(f"  {name:<7} {protocol:<8}: {row['total_seconds']:.2f} s, others {foreign:.0%}", file=sys.stderr)
    return table


def measure_link(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, latency, bandwidth in LINKS:
        link = ["--fabric-latency", latency] if latency else []
        link += ["--fabric-bandwidth", bandwidth] if bandwidth else []
        for protocol in PROTOCOLS:
            runs = [pagefetch(jobs, directory, f"link-{protocol}-{i}", protocol, args.pages // 4, link)[0]
                    for i in range(max(1, args.rounds // 2))]  # fmt: skip
            table[f"{name}/{protocol}"] = statistics.median(runs)
            print(f"  link {name:<22} {protocol:<8}: {table[f'{name}/{protocol}']:.1f} µs/page", file=sys.stderr)
    return table


def plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(table)
    parts = [("compute_seconds", "compute"), ("page_seconds", "page")]
    parts += [("wait_seconds", "wait"), ("lock_seconds", "lock")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(labels)
    for key, name in parts:
        values = [table[label][key] for label in labels]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("seconds per rank (mean of 4)")
    ax.set_title("DSM programs on 4 ranks: time breakdown by protocol (ckpt launch --native, simib)")
    ax.tick_params(axis="x", rotation=60)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def report(settings: dict[str, Any], data: dict[str, Any]) -> str:
    lines = [f"machine: {json.dumps(settings['machine'])}", f"command: {settings['command']}", ""]
    if "pagefetch" in data:
        pf = data["pagefetch"]
        verdict = "met" if pf["ratio"] <= TARGET else "missed"
        lines += [
            f"page fetch ({settings['pages']} pages, 3 readers, median of {settings['rounds']} rounds):",
            f"  async    {pf['async']:.1f} µs/page",
            f"  onesided {pf['onesided']:.1f} µs/page",
            f"  onesided / async = {pf['ratio']:.2f} (paired {pf['paired_ratio']:.2f}; target <= {TARGET}: {verdict})",
            "",
        ]
    if "programs" in data:
        lines.append("| program / protocol | total s | compute | page | wait | lock | fetches | diffs | retries |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for label, row in data["programs"].items():
            lines.append(
                f"| {label} | {row['total_seconds']:.2f} | {row['compute_seconds']:.2f} | {row['page_seconds']:.2f} "
                f"| {row['wait_seconds']:.2f} | {row['lock_seconds']:.2f} | {row['page_fetches']} | {row['diffs']} "
                f"| {row['fetch_retries']} |"
            )
        lines.append("")
    if "link" in data:
        lines.append("page fetch by link model (µs/page):")
        for label, value in data["link"].items():
            lines.append(f"  {label:<32} {value:.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--only", choices=["pagefetch", "programs", "link"], default=None)
    parser.add_argument("--plot", type=Path, default=None, help="draw the program breakdown into this PNG")
    parser.add_argument("--quiet-wait", type=float, default=10.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    settings = run_settings(rounds=args.rounds, pages=args.pages)
    data: dict[str, Any] = {}
    jobs = Jobs()
    with tempfile.TemporaryDirectory(prefix="bench-dsm-", dir=args.dir) as tmp:
        directory = Path(tmp)
        try:
            if args.only in (None, "pagefetch"):
                data["pagefetch"] = measure_pagefetch(jobs, directory, args)
            if args.only in (None, "programs"):
                data["programs"] = measure_programs(jobs, directory, args)
                if args.plot:
                    plot(data["programs"], args.plot)
            if args.only in (None, "link"):
                data["link"] = measure_link(jobs, directory, args)
        finally:
            jobs.close()
    print(report(settings, data))
    write_results(args.json, settings, data)


if __name__ == "__main__":
    main()
