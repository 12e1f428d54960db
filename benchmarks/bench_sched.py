"""Benchmark `ckpt launch --sched`: the DSM programs under SCHED_BATCH against SCHED_OTHER, in the same run."""

# Usage: python benchmarks/bench_sched.py [--rounds 3] [--only water,tsp,sor,isort] [--protocols async]
#                                         [--modes off,remote] [--quiet-wait 3] [--json FILE]
#
# Each job is bench_remotelog's (`ckpt launch -n 4 --logging MODE --dsm-protocol P` of a program of
# dsm/programs through benchmarks/programs/dsm_stats.py; its figure is the mean over the ranks of the DSM's
# `total_seconds`), once with `--sched other` (Linux's default policy) and once with `--sched batch`,
# the order flipping every round; the figure of a (program, protocol, mode, policy) is the median over
# the rounds, and the table gives batch / other.  4 ranks of several threads each on the machine's
# cores: what wake-up preemption costs when threads outnumber cores (ckpt/_sched.py).

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_ib import alternate
from bench_image import run_settings, write_results
from bench_overhead import Jobs
from bench_remotelog import BENCH_ARGS, MODES, PROTOCOLS, run_once

POLICIES = ("other", "batch")


def measure(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Per (program, protocol, logging mode): the median DSM seconds under each policy and batch / other."""
    table: dict[str, Any] = {}
    for name in args.only:
        for protocol in args.protocols:
            for mode in args.modes:
                # B023: `alternate` calls it right away, within this iteration of the loops
                def run(policy: str, i: int) -> tuple[float, float]:
                    options = ("--sched", policy)
                    got: tuple[float, float] = run_once(jobs, directory, name, protocol, mode, i, options)  # noqa: B023
                    return got  # (typed: mypy sees bench_remotelog's helpers through an untyped import)

                rows = alternate(args.rounds, args.quiet_wait, run, f"{name}/{protocol}/{mode}", POLICIES)
                row: dict[str, Any] = {policy: statistics.median(r[policy] for r in rows) for policy in POLICIES}
                row["ratio"] = row["batch"] / row["other"]
                row["paired_ratio"] = statistics.median(r["batch"] / r["other"] for r in rows)
                row["rounds"] = rows
                table[f"{name}/{protocol}/{mode}"] = row
    return table


def report(settings: dict[str, Any], table: dict[str, Any]) -> str:
    """The table in docs/benchmarks.md's form, and the geometric means of batch / other."""
    lines = [f"machine: {json.dumps(settings['machine'])}", f"command: {settings['command']}", ""]
    lines.append("| program / protocol / logging | other s | batch s | batch / other | median per-round ratio |")
    lines.append("|---|---|---|---|---|")
    for label, row in table.items():
        lines.append(
            f"| {label} | {row['other']:.3f} | {row['batch']:.3f} | {row['ratio']:.3f} | {row['paired_ratio']:.3f} |"
        )
    ratios = [row["ratio"] for row in table.values()]
    lines += ["", f"geometric mean of batch / other: {statistics.geometric_mean(ratios):.3f}"]
    for mode in settings["modes"]:
        of_mode = [row["ratio"] for label, row in table.items() if label.endswith(f"/{mode}")]
        lines.append(f"  --logging {mode}: {statistics.geometric_mean(of_mode):.3f}")
    return "\n".join(lines)


def _choices(allowed: tuple[str, ...] | list[str], what: str) -> Any:
    def parse(text: str) -> list[str]:
        names = text.split(",")
        for name in names:
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r} (choose from {', '.join(allowed)})")
        return names

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", type=_choices(list(BENCH_ARGS), "program"), default=list(BENCH_ARGS))
    parser.add_argument("--protocols", type=_choices(PROTOCOLS, "protocol"), default=["async"])
    parser.add_argument("--modes", type=_choices(MODES, "logging mode"), default=["off", "remote"])
    parser.add_argument("--quiet-wait", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    jobs = Jobs()
    settings = run_settings(rounds=args.rounds, modes=args.modes, args={name: BENCH_ARGS[name] for name in args.only})
    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        try:
            table = measure(jobs, Path(tmp), args)
        finally:
            jobs.close()
    print(report(settings, table))
    write_results(args.json, settings, table)


if __name__ == "__main__":
    main()
