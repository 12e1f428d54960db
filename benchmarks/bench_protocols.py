"""The protocol study (issue 16, after the Cashmere paper's Figures 1, 2, 7, 8): every DSM program under every protocol
across a sweep of the simulated fabric's link model, with each run's compute / page / wait / lock breakdown."""

# Usage: python benchmarks/bench_protocols.py [--rounds 1] [--programs sor,tsp] [--links base,lat10,...]
#                                             [--plot-dir docs] [--dir DIR] [--json FILE] [--quiet-wait 10]
#
# Variants: `async` and `onesided` (HLRC), `cashmere` with the copy fill (`C`) and with the line fill (`N`).
# Every job is `ckpt launch -n 4 --native` (the DSM over simib directly: the protocols' own costs) through
# benchmarks/programs/dsm_stats.py, which writes each rank's `statistics()`; a run's figures are the means over
# its ranks, and with --rounds > 1 the median run (by total time) of each cell is kept.
#
# Links (`--fabric-latency`, `--fabric-bandwidth`): `base`, no model -- the host's own speed, and direct
# placement over shared memory between the processes of this machine; then one-way latency added 1, 10 and 100 µs
# at 10 GB/s, and bandwidth 10, 1 and 0.1 GB/s at 1 µs.  A link model turns direct placement off: every
# operation goes through the simulated HCA's packets and their modelled delays.
#
# Plots (matplotlib, the `bench` extra), into --plot-dir:
#   protocols_breakdown.png  per program, the four variants' time broken down, on the base link (Figures 1, 2)
#   protocols_latency.png    per program, run time against added latency, a line per variant (Figure 7)
#   protocols_bandwidth.png  per program, run time against bandwidth, a line per variant (Figure 8)

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

from bench_dsm import RANKS, WITH_STATS
from bench_ib import launch, results
from bench_image import run_settings, write_results
from bench_overhead import Jobs, wait_quiet

#: (label, protocol, fill)
VARIANTS: list[tuple[str, str, str | None]] = [
    ("async", "async", None),
    ("onesided", "onesided", None),
    ("cashmere-C", "cashmere", "copy"),
    ("cashmere-N", "cashmere", "line"),
]
#: (name, added one-way latency in µs, bandwidth in GB/s); None: no link model.
LINKS: list[tuple[str, float | None, float | None]] = [
    ("base", None, None),
    ("lat1", 1, 10),
    ("lat10", 10, 10),
    ("lat100", 100, 10),
    ("bw1", 1, 1),
    ("bw0.1", 1, 0.1),
]
LATENCY_SWEEP = ["lat1", "lat10", "lat100"]  # at 10 GB/s
BANDWIDTH_SWEEP = ["lat1", "bw1", "bw0.1"]  # 10, 1, 0.1 GB/s at 1 µs
#: Each program's arguments: a few seconds on 4 ranks with no link model.
ARGS: dict[str, list[str]] = {
    "sor": ["128", "24"],
    "jacobi": ["128", "60"],
    "matmul": ["128", "4"],
    "lu": ["128", "4"],
    "isort": ["4096", "256", "30"],
    "tsp": ["10", "4", "4"],
    "water": ["128", "30", "8"],
}
PARTS = [("compute_seconds", "compute"), ("page_seconds", "page"), ("wait_seconds", "wait"), ("lock_seconds", "lock")]
COUNTS = (
    "page_fetches",
    "lock_acquires",
    "barriers",
    "diffs",
    "directory_ops",
    "notices_sent",
    "self_invalidations",
    "write_through_bytes",
    "line_fills",
    "fetch_retries",
)


def link_args(latency: float | None, bandwidth: float | None) -> list[str]:
    if latency is None:
        return []
    return ["--fabric-latency", f"{latency:g}us", "--fabric-bandwidth", f"{bandwidth * 1000:g}MB/s"]


def one_run(jobs: Jobs, directory: Path, name: str, variant: str, link: str) -> dict[str, Any]:
    """One job: the means of its ranks' breakdown, its counters summed, its wall time."""
    _, protocol, fill = next(v for v in VARIANTS if v[0] == variant)
    _, latency, bandwidth = next(v for v in LINKS if v[0] == link)
    tag = f"{name}-{variant}-{link}-{time.monotonic_ns()}"
    prefix = directory / f"stats-{tag}"
    os.environ["CKPT_BENCH_DSM_PROGRAM"], os.environ["CKPT_BENCH_DSM_STATS"] = name, str(prefix)
    chosen = ["--dsm-protocol", protocol, *(["--dsm-fill", fill] if fill else [])]
    started = time.perf_counter()
    stdout, foreign = launch(jobs, directory, tag, True, RANKS, [*chosen, *link_args(latency, bandwidth),
                                                                str(WITH_STATS), *ARGS[name]])  # fmt: skip
    wall = time.perf_counter() - started
    lines = set(results(stdout).values())
    if len(lines) != 1 or "numpy=match" not in next(iter(lines)):
        raise RuntimeError(f"{name} under {variant} on {link} did not give numpy's answer: {lines}")
    ranks = [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(RANKS)]
    row: dict[str, Any] = {"total_seconds": statistics.mean(s["total_seconds"] for s in ranks)}
    row |= {key: statistics.mean(s[key] for s in ranks) for key, _ in PARTS}
    row |= {key: sum(s.get(key, 0) for s in ranks) for key in COUNTS}
    return row | {"wall_seconds": wall, "foreign": foreign}


def measure(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for link in args.links:
        for name in args.programs:
            for variant, _, _ in VARIANTS:
                wait_quiet(args.quiet_wait)
                runs = [one_run(jobs, directory, name, variant, link) for _ in range(args.rounds)]
                row = sorted(runs, key=lambda r: r["total_seconds"])[len(runs) // 2]
                table[f"{name}/{variant}/{link}"] = row
                parts = ", ".join(f"{label} {row[key]:.2f}" for key, label in PARTS)
                print(
                    f"  {link:<7} {name:<7} {variant:<11}: {row['total_seconds']:6.2f} s ({parts}), "
                    f"others {row['foreign']:.0%}",
                    file=sys.stderr,
                )
    return table


def plot(table: dict[str, Any], programs: list[str], directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v[0] for v in VARIANTS]
    if all(f"{p}/{v}/base" in table for p in programs for v in names):
        fig, axes = plt.subplots(1, len(programs), figsize=(2.2 * len(programs), 4), sharey=False)
        for ax, program in zip(axes if len(programs) > 1 else [axes], programs, strict=True):
            bottom = [0.0] * len(names)
            for key, label in PARTS:
                values = [table[f"{program}/{v}/base"][key] for v in names]
                ax.bar(range(len(names)), values, bottom=bottom, label=label)
                bottom = [b + x for b, x in zip(bottom, values, strict=True)]
            ax.set_title(program)
            ax.set_xticks(range(len(names)), ["A", "O", "C", "N"])
        axes_list = list(axes) if len(programs) > 1 else [axes]
        axes_list[0].set_ylabel("seconds per rank (mean of 4)")
        axes_list[-1].legend(fontsize=7)
        fig.suptitle("4 ranks, no link model: A async, O onesided, C cashmere copy, N cashmere line fill")
        fig.tight_layout()
        fig.savefig(directory / "protocols_breakdown.png", dpi=72)
    for sweep, xs, xlabel, filename in (
        (LATENCY_SWEEP, [1, 10, 100], "added one-way latency (µs), 10 GB/s", "protocols_latency.png"),
        (BANDWIDTH_SWEEP, [10, 1, 0.1], "bandwidth (GB/s), 1 µs", "protocols_bandwidth.png"),
    ):
        if not all(f"{p}/{v}/{link}" in table for p in programs for v in names for link in sweep):
            continue
        fig, axes = plt.subplots(1, len(programs), figsize=(2.4 * len(programs), 3.6))
        for ax, program in zip(axes if len(programs) > 1 else [axes], programs, strict=True):
            for variant in names:
                ax.plot(xs, [table[f"{program}/{variant}/{link}"]["total_seconds"] for link in sweep], marker="o",
                        label=variant)  # fmt: skip
            ax.set_xscale("log")
            ax.set_title(program)
            ax.set_xlabel(xlabel, fontsize=7)
        axes_list = list(axes) if len(programs) > 1 else [axes]
        axes_list[0].set_ylabel("run time per rank (s)")
        axes_list[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(directory / filename, dpi=72)


def report(settings: dict[str, Any], table: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"machine: {json.dumps(settings['machine'])}", f"command: {settings['command']}", ""]
    names = [v[0] for v in VARIANTS]
    for link in args.links:
        lines.append(f"link {link}: run time per rank, s (compute / page / wait / lock)")
        lines.append("| program | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for program in args.programs:
            cells = []
            for variant in names:
                row = table.get(f"{program}/{variant}/{link}")
                if row is None:
                    cells.append("-")
                    continue
                parts = " / ".join(f"{row[key]:.2f}" for key, _ in PARTS)
                cells.append(f"**{row['total_seconds']:.2f}** ({parts})")
            lines.append(f"| {program} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--programs", default=",".join(ARGS), help="comma-separated, of: " + ", ".join(ARGS))
    parser.add_argument("--links", default=",".join(n for n, _, _ in LINKS), help="comma-separated link names")
    parser.add_argument("--plot-dir", type=Path, default=None)
    parser.add_argument("--quiet-wait", type=float, default=10.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.programs = [p for p in args.programs.split(",") if p]
    args.links = [link for link in args.links.split(",") if link]
    unknown = [p for p in args.programs if p not in ARGS] + [k for k in args.links if k not in {n for n, _, _ in LINKS}]
    if unknown:
        parser.error(f"unknown program or link: {', '.join(unknown)}")
    settings = run_settings(rounds=args.rounds, programs=args.programs, links=args.links)
    jobs = Jobs()
    with tempfile.TemporaryDirectory(prefix="bench-protocols-", dir=args.dir) as tmp:
        try:
            table = measure(jobs, Path(tmp), args)
        finally:
            jobs.close()
    print(report(settings, table, args))
    write_results(args.json, settings, {"runs": table})
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot(table, args.programs, args.plot_dir)


if __name__ == "__main__":
    main()
