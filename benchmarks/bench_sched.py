"""Benchmark two ways of running the DSM programs against each other in one run: `--sched`, links, placement, code."""

# Usage: python benchmarks/bench_sched.py [--compare sched|links|direct|commit] [--base REV] [--rounds 3]
#                                         [--only water,tsp,sor,isort] [--protocols async] [--modes off,remote]
#                                         [--quiet-wait 3] [--json FILE]
#
# Each job is bench_remotelog's (`ckpt launch -n 4 --logging MODE --dsm-protocol P` of a program of
# dsm/programs through benchmarks/programs/dsm_stats.py; its figure is the mean over the ranks of the DSM's
# `total_seconds`), once per variant, the order flipping every round; the figure of a (program, protocol,
# mode, variant) is the median over the rounds, and the table gives the second variant / the first.
#   --compare sched (the default): `--sched other` (Linux's default policy) against `--sched batch`.  4 ranks
#       of several threads each on the machine's cores: what wake-up preemption costs when threads
#       outnumber cores (ckpt/_sched.py).
#   --compare links: simib's links over loopback TCP (CKPT_SIMIB_UNIX=0, in the ranks' environment)
#       against same-host links over Unix sockets (docs/verbs.md, "Same-host links").
#   --compare direct: one-sided operations as packets (CKPT_SIMIB_DIRECT=0) against direct placement in
#       the peer's shared memory (docs/verbs.md, "Direct placement").
#   --compare commit --base REV: the code of commit REV against this checkout's.  REV is checked out into a
#       temporary git worktree with a virtual environment of its own (`pip install -e`: the package index or
#       pip's cache must be reachable); its jobs run its `ckpt` and its dsm_stats.py.  A change's effect
#       measured in one run, on one machine state: this VM's speed differs by 2x from one day to the next.

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_ib import alternate
from bench_image import run_settings, write_results
from bench_overhead import Jobs
from bench_remotelog import BENCH_ARGS, MODES, PROTOCOLS, WITH_STATS, run_once

#: What each comparison runs: (first variant, second variant), and how a job is told which.
VARIANTS: dict[str, tuple[str, str]] = {
    "sched": ("other", "batch"),
    "links": ("tcp", "unix"),
    "direct": ("packets", "direct"),
    "commit": ("base", "head"),
}
ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, directory: Path) -> tuple[Jobs, Path]:
    """Commit `rev` in a worktree under `directory`, installed in a venv of its own: (jobs running its `ckpt`, its
    dsm_stats.py).  `release` removes the worktree."""
    tree, venv, pins = directory / "base", directory / "base-venv", directory / "pins.txt"
    # the same versions of numpy, msgpack, ... as this checkout's environment: only ckpt's own code differs
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True
    )
    pins.write_text(frozen.stdout)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for command in (
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), rev],
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "-c", str(pins), "-e", str(tree)],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: cannot set up commit {rev}: {' '.join(command)}: {done.stderr.strip()[-300:]}")
    # -P: not the current directory first on sys.path (from this checkout, `-m ckpt` would import its ckpt)
    return Jobs([str(venv / "bin" / "python"), "-P", "-m", "ckpt"]), tree / WITH_STATS.relative_to(ROOT)


def _resolve(rev: str) -> str:
    git = ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"]
    found = subprocess.run(git, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"error: --base {rev}: not a commit of {ROOT}")
    return found.stdout.strip()


def release(directory: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(directory / "base")], check=False)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)  # and any a killed run left


def run_variant(compare: str, variant: str) -> tuple[str, ...]:
    """The launch options of `variant` (for links and placement: the environment the launcher passes to its ranks)."""
    if compare == "commit":
        return ()
    if compare == "sched":
        return ("--sched", variant)
    if compare == "direct":
        os.environ["CKPT_SIMIB_DIRECT"] = "1" if variant == "direct" else "0"
    else:
        os.environ["CKPT_SIMIB_UNIX"] = "1" if variant == "unix" else "0"
    return ()


def measure(jobs: Jobs, directory: Path, args: argparse.Namespace, base: tuple[Jobs, Path] | None) -> dict[str, Any]:
    """Per (program, protocol, logging mode): the median DSM seconds of each variant, and second / first
    (`base`: --compare commit's jobs and dsm_stats.py of the base commit)."""
    first, second = variants = VARIANTS[args.compare]
    table: dict[str, Any] = {}
    for name in args.only:
        for protocol in args.protocols:
            for mode in args.modes:
                # B023: `alternate` calls it right away, within this iteration of the loops
                def run(variant: str, i: int) -> tuple[float, float]:
                    runner, stats = (base[0], base[1]) if base is not None and variant == "base" else (jobs, WITH_STATS)
                    options = run_variant(args.compare, variant)
                    got: tuple[float, float] = run_once(runner, directory, name, protocol, mode, i, options, stats)  # noqa: B023
                    return got  # (typed: mypy sees bench_remotelog's helpers through an untyped import)

                rows = alternate(args.rounds, args.quiet_wait, run, f"{name}/{protocol}/{mode}", variants)
                row: dict[str, Any] = {variant: statistics.median(r[variant] for r in rows) for variant in variants}
                row["ratio"] = row[second] / row[first]
                row["paired_ratio"] = statistics.median(r[second] / r[first] for r in rows)
                row["rounds"] = rows
                table[f"{name}/{protocol}/{mode}"] = row
    return table


def report(settings: dict[str, Any], table: dict[str, Any]) -> str:
    """The table in docs/benchmarks.md's form, and the geometric means of second / first."""
    first, second = VARIANTS[settings["compare"]]
    lines = [f"machine: {json.dumps(settings['machine'])}", f"command: {settings['command']}", ""]
    heading = f"| {first} s | {second} s | {second} / {first} | median per-round ratio |"
    lines += [f"| program / protocol / logging {heading}", "|---|---|---|---|---|"]
    for label, row in table.items():
        figures = f"{row[first]:.3f} | {row[second]:.3f} | {row['ratio']:.3f} | {row['paired_ratio']:.3f}"
        lines.append(f"| {label} | {figures} |")
    ratios = [row["ratio"] for row in table.values()]
    lines += ["", f"geometric mean of {second} / {first}: {statistics.geometric_mean(ratios):.3f}"]
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
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="sched", help="what the two variants differ in")
    parser.add_argument("--base", default=None, help="with --compare commit: the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", type=_choices(list(BENCH_ARGS), "program"), default=list(BENCH_ARGS))
    parser.add_argument("--protocols", type=_choices(PROTOCOLS, "protocol"), default=["async"])
    parser.add_argument("--modes", type=_choices(MODES, "logging mode"), default=["off", "remote"])
    parser.add_argument("--quiet-wait", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if (args.compare == "commit") != (args.base is not None):
        parser.error("--base REV goes with --compare commit, and only with it")
    jobs = Jobs()
    programs = {name: BENCH_ARGS[name] for name in args.only}
    based = {}
    if args.base is not None:  # the commits compared, resolved; the jobs of "head" run the working tree
        based = {variant: _resolve(rev) for variant, rev in (("base", args.base), ("head", "HEAD"))}
        status = ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]
        based["head_modified"] = bool(subprocess.run(status, capture_output=True, text=True).stdout.strip())
    settings = run_settings(compare=args.compare, rounds=args.rounds, modes=args.modes, args=programs, **based)
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.compare}-") as tmp:
        base = None
        try:
            base = checkout(str(based["base"]), Path(tmp)) if based else None
            table = measure(jobs, Path(tmp), args, base)
        finally:
            jobs.close()
            if base is not None:
                base[0].close()
            if based:
                release(Path(tmp))
    print(report(settings, table))
    write_results(args.json, settings, table)


if __name__ == "__main__":
    main()
