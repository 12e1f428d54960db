"""Benchmark remote logging: its failure-free overhead (FT-KDSM Figure 4) and its recovery time (Figure 5)."""

# Usage: python benchmarks/bench_remotelog.py [--rounds 3] [--only water,tsp] [--protocols async,onesided]
#                                             [--plot docs/remotelog_overhead.png] [--csv FILE] [--json FILE]
#                                             [--quiet-wait 10] [--dir DIR] [--ranks 4] [--scale small|paper]
#        python benchmarks/bench_remotelog.py --recovery [--failures 1,2,3] [the same options]
#
# Failure-free overhead:
# every job is `ckpt launch -n 4 --logging MODE --dsm-protocol P` (plugins loaded, no
# checkpoint taken) of one of dsm/programs through benchmarks/programs/dsm_stats.py,
# which writes each rank's `statistics()`.  A run's figure is the mean over the ranks
# of the DSM's `total_seconds` (attach to the last step: the launch and the plugins'
# start-up are not in it).  In each round the three modes run back to back, their
# order rotating from round to round (the baseline is measured in the same run);
# the figure of a (program, protocol, mode) is the median over the rounds.
#
# The programs: Water (locks and barriers), TSP (locks), SOR (barriers, small diffs)
# and IS (barrier-heavy, large diffs: every rank writes every bucket).  Targets (the
# issue's): remote logging <= 10 % over `off`, as the geometric mean over the
# programs, per protocol; stable logging's overhead >= 5x remote's on the two most
# synchronization-heavy programs (most lock acquires + barriers per second under
# `off`).  Stable logs go to the job's checkpoint directory, on the benchmark's
# --dir (the machine's disk unless that is a tmpfs: the run records its type).
# `--scale paper` runs larger inputs (Water at the paper's own; `PAPER_ARGS`) with rings
# that hold the whole run, as the paper's did: the small inputs synchronize every
# millisecond or so, far more often than the paper's programs on their inputs.  Each
# row also gives the logging time per lock acquire or barrier (`log_seconds`: the program
# threads', and under async the handlers' appends to the home diff logs), and the run
# the latency of an fsync on the stable logs' disk.
# `--ranks N` runs N ranks instead of the issue's 4: with one rank per core the
# ranks no longer share cores, as the paper's nodes did not, so what logging costs
# in CPU stops being everyone's time and what it costs in waiting (an fsync) is
# felt again -- the targets are the issue's, on 4 ranks.
#
# Recovery time (--recovery): for each program and number of concurrent failures F
# (1 and 2 on 4 ranks; 3 on 8 ranks, since 3 of 4 ranks cannot fail without one
# being another's log home), a job `ckpt launch --on-failure recover --logging
# remote` of benchmarks/programs/dsm_recovery.py halts every rank at a gate before
# its last tenth of steps ("right before the job's end"; the step count is taken
# from an uninterrupted run first).  The benchmark kills F ranks no one of which
# is another's log home (1; 1, 3; 1, 3, 5) with SIGKILL and times, on its own
# clock, from the kill to the moment the last of them, respawned from its image
# (the coordinated checkpoint taken right after setup) and replayed, reaches the
# gate again: the *recovery time*.  The baseline is a whole-job `ckpt restart`
# from that same checkpoint, timed from the command to the moment the same ranks
# reach the gate: the *re-execution time* (it re-executes with live traffic and
# logs as it goes; the rings' contents are released at a whole-job restart).  The
# figure is recovery / re-execution, the median over the rounds; the victims'
# `replay_seconds` (the replay alone, from their statistics) is reported beside
# it.  Target (the issue's): a single failure recovers in <= 0.7x re-execution on
# the two most synchronization-heavy programs.  Both jobs must end with numpy's
# answer.

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_ib import alternate, launch, results
from bench_image import run_settings, write_results
from bench_overhead import Jobs, ckpt_cli, wait_quiet

ROOT = Path(__file__).resolve().parent.parent
WITH_STATS = ROOT / "benchmarks" / "programs" / "dsm_stats.py"
PROTOCOLS = ("async", "onesided")
MODES = ("off", "remote", "stable")
RANKS = 4
REMOTE_TARGET, STABLE_FACTOR = 0.10, 5.0
#: Each program's arguments: about a second of DSM time on 4 ranks of a 2-core machine (`--scale small`).
BENCH_ARGS: dict[str, list[str]] = {
    "water": ["128", "20", "8"],
    "tsp": ["10", "4", "4"],
    "sor": ["256", "30"],
    "isort": ["4096", "256", "30"],
}
#: `--scale paper`: Water at the paper's own input (Table 1: 1728 molecules, 5 steps); the others, which the
#: paper did not run (TSP: its 20 cities are out of reach of a Python depth-first search), at the largest input
#: whose `off` job takes at most ~10 s on 4 ranks of this machine, with the small scale's other arguments.
PAPER_ARGS: dict[str, list[str]] = {
    "water": ["1728", "5", "8"],
    "tsp": ["12", "4", "4"],
    "sor": ["1024", "30"],
    "isort": ["262144", "2048", "10"],
}
#: ... and rings that hold the whole run's logs, as the paper's did ("no checkpoint is taken and all logs remain
#: in memory", §6.1): with the default 4 MiB an IS of 2**18 keys fills its rings every step or two, and what the
#: figure would measure is the independent checkpoints that empty them.
PAPER_OPTIONS = ("--log-ring-bytes", str(64 << 20))
SCALES = {"small": (BENCH_ARGS, ()), "paper": (PAPER_ARGS, PAPER_OPTIONS)}
KEYS = (
    "lock_acquires",
    "barriers",
    "diffs",
    "diff_bytes",
    "log_records",
    "log_bytes",
    "log_seconds",
    "stable_fsyncs",
)


def run_once(
    jobs: Jobs,
    directory: Path,
    name: str,
    protocol: str,
    mode: str,
    i: int,
    options: tuple[str, ...] = (),
    with_stats: Path = WITH_STATS,
    ranks: int = RANKS,
    argv: list[str] | None = None,
) -> tuple[float, float]:
    """One job (with `options` too; `with_stats`: another checkout's dsm_stats.py; `argv`: the program's arguments,
    by default its `BENCH_ARGS`): (mean DSM seconds over the ranks, CPU share of others); its counters go to
    `LAST`."""
    prefix = directory / f"stats-{name}-{protocol}-{mode}-{i}"
    os.environ["CKPT_BENCH_DSM_PROGRAM"], os.environ["CKPT_BENCH_DSM_STATS"] = name, str(prefix)
    argv = BENCH_ARGS[name] if argv is None else argv
    program = [*options, "--dsm-protocol", protocol, "--logging", mode, str(with_stats), *argv]
    stdout, foreign = launch(jobs, directory, f"{name}-{protocol}-{mode}-{i}", False, ranks, program)
    lines = set(results(stdout).values())
    if len(lines) != 1 or "numpy=match" not in next(iter(lines)):
        raise RuntimeError(f"{name} on {protocol} with --logging {mode} did not give numpy's answer: {lines}")
    stats = [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(ranks)]
    LAST[(name, protocol, mode)] = {key: sum(s[key] for s in stats) for key in KEYS}
    return statistics.mean(s["total_seconds"] for s in stats), foreign


LAST: dict[tuple[str, str, str], dict[str, float]] = {}


def measure(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    table: dict[str, Any] = {}
    programs, options = SCALES[args.scale]
    for name in args.only:
        for protocol in args.protocols:

            def once(mode: str, i: int) -> tuple[float, float]:
                argv = programs[name]  # noqa: B023
                return run_once(jobs, directory, name, protocol, mode, i, options, ranks=args.ranks, argv=argv)  # noqa: B023

            rows = alternate(args.rounds, args.quiet_wait, once, f"{name}/{protocol}", MODES)
            row: dict[str, Any] = {mode: statistics.median(r[mode] for r in rows) for mode in MODES}
            for mode in MODES[1:]:
                row[f"{mode}_overhead"] = row[mode] / row["off"] - 1
                row[f"{mode}_paired"] = statistics.median(r[mode] / r["off"] for r in rows) - 1
            row["counters"] = {mode: LAST[(name, protocol, mode)] for mode in MODES}
            row["sync_per_second"] = (row["counters"]["off"]["lock_acquires"] + row["counters"]["off"]["barriers"]) / (
                args.ranks * row["off"]
            )
            row["rounds"] = rows
            table[f"{name}/{protocol}"] = row
    return table


def verdicts(table: dict[str, Any], protocols: list[str]) -> list[str]:
    lines = []
    for protocol in protocols:
        rows = {label.split("/")[0]: row for label, row in table.items() if label.endswith(f"/{protocol}")}
        if not rows:
            continue
        geo = math.exp(statistics.mean(math.log(1 + r["remote_overhead"]) for r in rows.values())) - 1
        ok = "met" if geo <= REMOTE_TARGET else f"missed by {100 * (geo - REMOTE_TARGET):.1f} points"
        lines.append(f"{protocol}: remote logging {100 * geo:+.1f} % over off (geometric mean; target <= 10 %: {ok})")
        busiest = sorted(rows, key=lambda n: rows[n]["sync_per_second"], reverse=True)[:2]
        for name in busiest:
            remote, stable = rows[name]["remote_overhead"], rows[name]["stable_overhead"]
            factor = stable / remote if remote > 0 else (math.inf if stable > 0 else 0.0)  # remote free: stable?
            ok = "met" if factor >= STABLE_FACTOR else "missed"
            lines.append(
                f"  {name} ({rows[name]['sync_per_second']:.0f} sync/s per rank): stable {100 * stable:+.1f} % vs "
                f"remote {100 * remote:+.1f} % = {factor:.1f}x (target >= {STABLE_FACTOR:.0f}x: {ok})"
            )
    return lines


def per_sync_ms(counters: dict[str, float]) -> float:
    """A job's logging time (`log_seconds`: program threads, and async handlers' home diff log appends) per lock
    acquire or barrier, in ms."""
    return 1e3 * counters["log_seconds"] / max(1.0, counters["lock_acquires"] + counters["barriers"])


def report(settings: dict[str, Any], table: dict[str, Any]) -> str:
    lines = [f"machine: {json.dumps(settings['machine'])}", f"command: {settings['command']}"]
    fsync = f"append + fsync of 4 KiB there: median {settings['fsync_us']:.0f} us"
    lines += [f"scale: {settings['scale']}", f"stable logs on: {settings['log_fs']} ({fsync})", ""]
    lines.append(
        "| program / protocol | off s | remote s | stable s | remote | stable | log records | stable fsyncs "
        "| logging per sync, remote; stable |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for label, row in table.items():
        counters = row["counters"]
        lines.append(
            f"| {label} | {row['off']:.3f} | {row['remote']:.3f} | {row['stable']:.3f} "
            f"| {100 * row['remote_overhead']:+.1f} % | {100 * row['stable_overhead']:+.1f} % "
            f"| {counters['remote']['log_records']:.0f} | {counters['stable']['stable_fsyncs']:.0f} "
            f"| {per_sync_ms(counters['remote']):.2f}; {per_sync_ms(counters['stable']):.2f} ms |"
        )
    return "\n".join([*lines, "", *verdicts(table, settings["protocols"])])


def fsync_latency(directory: Path, count: int = 200) -> float:
    """Median microseconds of appending 4 KiB to a file in `directory` and fsyncing it: what stable logging's
    flush waits for at a release or barrier, on the disk its logs go to."""
    path, block, times = directory / "fsync-probe", b"\0" * 4096, []
    with path.open("ab") as f:
        for _ in range(count):
            started = time.perf_counter()
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
            times.append(time.perf_counter() - started)
    path.unlink()
    return 1e6 * statistics.median(times)


def write_csv(table: dict[str, Any], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["program", "protocol", "off_s", "remote_s", "stable_s", "remote_overhead", "stable_overhead"])
        for label, row in table.items():
            name, protocol = label.split("/")
            values = [row["off"], row["remote"], row["stable"], row["remote_overhead"], row["stable_overhead"]]
            writer.writerow([name, protocol, *values])


def plot(table: dict[str, Any], path: Path, ranks: int = RANKS, scale: str = "small") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(table)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.27
    for k, mode in enumerate(MODES):
        values = [table[label][mode] / table[label]["off"] for label in labels]
        ax.bar([x + (k - 1) * width for x in range(len(labels))], values, width, label=mode)
    ax.axhline(1 + REMOTE_TARGET, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, rotation=30)
    ax.set_ylabel("time / time without logging")
    ax.set_title(f"Failure-free overhead of remote and stable logging, {ranks} ranks, {scale} inputs (FT-KDSM Fig. 4)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


# ------------------------------------------------------------------ recovery time (FT-KDSM Figure 5)
RECOVERY_PROGRAM = ROOT / "benchmarks" / "programs" / "dsm_recovery.py"
#: Concurrent failures -> (ranks, the killed ranks): with log homes at R + 1, none is another's log home.
FAILURES: dict[int, tuple[int, list[int]]] = {1: (4, [1]), 2: (4, [1, 3]), 3: (8, [1, 3, 5])}
RECOVERY_TARGET = 0.7
GATE_FRACTION = 0.9  # the gate: before the last tenth of the steps


def _gated_env(name: str, prefix: Path, gate: int, label: str) -> None:
    os.environ.update(
        CKPT_BENCH_DSM_PROGRAM=name, CKPT_BENCH_DSM_STATS=str(prefix), CKPT_BENCH_GATE_STEP=str(gate),
        CKPT_BENCH_RUN=label,
    )  # fmt: skip


def _answer(out: Path, ranks: int, what: str) -> None:
    lines = set(results(out.read_text()).values())
    if len(results(out.read_text())) != ranks or len(lines) != 1 or "numpy=match" not in next(iter(lines)):
        raise RuntimeError(f"{what} did not give numpy's answer: {lines} ({out.with_suffix('.err').read_text()})")


def _gates(prefix: Path, label: str, job: subprocess.Popen[str], want: Any, timeout: float = 300) -> dict[int, Any]:
    """{rank: (time, incarnation)} of the gate files of run `label` once want(found) is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found: dict[int, Any] = {}
        for path in prefix.parent.glob(f"{prefix.name}.gate.{label}.*"):
            if path.suffix == ".tmp":
                continue
            rank, record = int(path.name.split(".")[-2]), json.loads(path.read_text())
            if record["incarnation"] >= found.get(rank, {"incarnation": -1})["incarnation"]:
                found[rank] = record
        if want(found):
            return found
        if job.poll() is not None:
            raise RuntimeError(f"the job ended (exit {job.returncode}) before its ranks reached the gate: {found}")
        time.sleep(0.01)  # polling the ranks' gate files
    raise RuntimeError(f"the ranks did not reach the gate within {timeout} s")


def count_steps(jobs: Jobs, directory: Path, name: str, protocol: str, ranks: int) -> dict[str, Any]:
    """An uninterrupted run without gate: its step count and its synchronization rate (lock acquires + barriers
    per second per rank)."""
    prefix = directory / f"steps-{name}-{protocol}-{ranks}"
    _gated_env(name, prefix, -1, "steps")
    program = ["--dsm-protocol", protocol, "--logging", "remote", str(RECOVERY_PROGRAM), *BENCH_ARGS[name]]
    launch(jobs, directory, f"steps-{name}-{protocol}-{ranks}", False, ranks, program)
    stats = [json.loads(Path(f"{prefix}.stats.steps.{r}").read_text()) for r in range(ranks)]
    sync = statistics.mean((s["lock_acquires"] + s["barriers"]) / s["total_seconds"] for s in stats)
    return {"steps": min(s["real_steps"] for s in stats), "sync_per_second": sync}


def _coordinated(ckpt_dir: Path, newest: int) -> Path:
    """The newest coordinated ("job") manifest numbered <= `newest`: where a whole-job re-execution starts from
    the victims' images (a home diff log at its high-water mark may have asked for one after setup's)."""
    found = []
    for path in ckpt_dir.glob("ckpt_dsm_recovery_*.json"):
        number = int(path.stem.rpartition("_")[2])
        if number <= newest and json.loads(path.read_text()).get("kind") == "job":
            found.append((number, path))
    if not found:
        raise RuntimeError(f"no coordinated checkpoint numbered <= {newest} in {ckpt_dir}")
    return max(found)[1]


def recovery_round(jobs: Jobs, directory: Path, name: str, protocol: str, failures: int, gate: int, i: int) -> Any:
    """One recovery and a whole-job re-execution from the victims' checkpoint: their times, and the replay's."""
    ranks, victims = FAILURES[failures]
    tag = f"{name}-{protocol}-{failures}-{i}"
    prefix, ckpt_dir = directory / f"rec-{tag}", directory / f"ckpt-rec-{tag}"
    _gated_env(name, prefix, gate, "recover")
    out = directory / f"rec-{tag}.out"
    command = ["launch", "-n", str(ranks), "--ckpt-dir", str(ckpt_dir), "--on-failure", "recover"]
    command += ["--logging", "remote", "--dsm-protocol", protocol, str(RECOVERY_PROGRAM), *BENCH_ARGS[name]]
    try:
        job = jobs.start(command, out)
        before = _gates(prefix, "recover", job, lambda found: len(found) == ranks)
        state = json.loads(ckpt_cli("status", "--json", "--ckpt-dir", str(ckpt_dir)).stdout)
        pids = {r["rank"]: r["pid"] for r in state["ranks"]}
        images = {r["rank"]: r.get("latest_image") for r in state["ranks"] if r["rank"] in victims}
        killed = time.time()
        for rank in victims:
            os.kill(pids[rank], signal.SIGKILL)
        back = _gates(prefix, "recover", job, lambda found: all(found[v]["incarnation"] > 0 for v in victims))
        recovery = max(back[v]["time"] for v in victims) - killed
        Path(f"{prefix}.open.recover").touch()
        if job.wait(timeout=300) != 0:
            raise RuntimeError(f"the recovering job failed: {out.with_suffix('.err').read_text()}")
        _answer(out, ranks, f"{name} on {protocol} recovering {failures} rank(s)")
        replay = [json.loads(Path(f"{prefix}.stats.recover.{v}").read_text()) for v in victims]
        # the baseline: every rank re-executes from the same (first, coordinated) checkpoint, with live traffic
        _gated_env(name, prefix, gate, "reexec")
        out = directory / f"reexec-{tag}.out"
        manifest = _coordinated(ckpt_dir, min(int(n or 1) for n in images.values()))
        started = time.time()
        job = jobs.start(["restart", str(manifest)], out)
        again = _gates(prefix, "reexec", job, lambda found: all(v in found for v in victims))
        reexec = max(again[v]["time"] for v in victims) - started
        Path(f"{prefix}.open.reexec").touch()
        if job.wait(timeout=300) != 0:
            raise RuntimeError(f"the re-execution failed: {out.with_suffix('.err').read_text()}")
        _answer(out, ranks, f"{name} on {protocol} re-executed from {manifest.name}")
    finally:
        jobs.close()
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {
        "recovery": recovery,
        "reexec": reexec,
        "ratio": recovery / reexec,
        "replay_seconds": max(s["replay_seconds"] for s in replay),
        "replayed": sum(s["replayed_acquires"] + s["replayed_barriers"] for s in replay),
        "regenerated_pages": sum(s["regenerated_pages"] for s in replay),
        "images": images,  # the victims' latest images at the kill
        "baseline": int(manifest.stem.rpartition("_")[2]),  # != every image: not quite the same starting point
        "gate_spread": max(r["time"] for r in before.values()) - min(r["time"] for r in before.values()),
    }


def measure_recovery(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name in args.only:
        for protocol in args.protocols:
            for failures in args.failures:
                ranks = FAILURES[failures][0]
                plain = count_steps(jobs, directory, name, protocol, ranks)
                gate = max(1, int(plain["steps"] * GATE_FRACTION))
                rows = []
                for i in range(args.rounds):
                    wait_quiet(args.quiet_wait)
                    rows.append(recovery_round(jobs, directory, name, protocol, failures, gate, i))
                    row = rows[-1]
                    print(
                        f"  {name}/{protocol} {failures} failure(s) round {i}: recovery {row['recovery']:.2f} s, "
                        f"re-execution {row['reexec']:.2f} s, ratio {row['ratio']:.2f}, replay "
                        f"{row['replay_seconds']:.2f} s",
                        file=sys.stderr,
                    )
                summary = {key: statistics.median(r[key] for r in rows) for key in ("recovery", "reexec", "ratio")}
                summary["replay_seconds"] = statistics.median(r["replay_seconds"] for r in rows)
                table[f"{name}/{protocol}/{failures}"] = {
                    **summary, "ranks": ranks, "gate": gate, **plain, "rounds": rows,
                }  # fmt: skip
    return table


def recovery_report(settings: dict[str, Any], table: dict[str, Any]) -> str:
    lines = [f"machine: {json.dumps(settings['machine'])}", f"command: {settings['command']}", ""]
    lines.append(
        "| program / protocol | failures | ranks | gate step | recovery s | re-execution s | ratio | replay s |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for label, row in table.items():
        name, protocol, failures = label.split("/")
        lines.append(
            f"| {name}/{protocol} | {failures} | {row['ranks']} | {row['gate']} | {row['recovery']:.2f} "
            f"| {row['reexec']:.2f} | {row['ratio']:.2f} | {row['replay_seconds']:.2f} |"
        )
    lines.append("")
    for label, row in table.items():
        newer = sum(any(int(n or 0) != r["baseline"] for n in r["images"].values()) for r in row["rounds"])
        if newer:
            lines.append(
                f"{label}: in {newer} round(s) a victim's image was newer than the re-execution's checkpoint "
                "(an independent one): its recovery had less to replay than the baseline re-executed"
            )
    for protocol in settings["protocols"]:
        single = {k.split("/")[0]: r for k, r in table.items() if k.endswith(f"/{protocol}/1")}
        busiest = sorted(single, key=lambda n: single[n]["sync_per_second"], reverse=True)[:2]
        for name in busiest:
            ratio = single[name]["ratio"]
            ok = "met" if ratio <= RECOVERY_TARGET else "missed"
            lines.append(
                f"{protocol}: {name} ({single[name]['sync_per_second']:.0f} sync/s per rank): one failure recovers in "
                f"{ratio:.2f}x re-execution (target <= {RECOVERY_TARGET}x: {ok})"
            )
    return "\n".join(lines)


def write_recovery_csv(table: dict[str, Any], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["program", "protocol", "failures", "ranks", "recovery_s", "reexec_s", "ratio", "replay_s"])
        for label, row in table.items():
            values = [row["ranks"], row["recovery"], row["reexec"], row["ratio"], row["replay_seconds"]]
            writer.writerow([*label.split("/"), *values])


def plot_recovery(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(label.rpartition("/")[0] for label in table))  # in the table's order
    counts = sorted({int(label.rpartition("/")[2]) for label in table})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(counts)
    for k, failures in enumerate(counts):
        values = [table.get(f"{group}/{failures}", {}).get("ratio", 0.0) for group in groups]
        xs = [x + (k - (len(counts) - 1) / 2) * width for x in range(len(groups))]
        ranks = FAILURES[failures][0]
        ax.bar(xs, values, width, label=f"{failures} failure{'s' if failures > 1 else ''} ({ranks} ranks)")
    ax.axhline(RECOVERY_TARGET, color="grey", linestyle=":", linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(groups)), groups, rotation=30)
    ax.set_ylabel("recovery time / re-execution time")
    ax.set_title("Recovery by replay vs whole-job re-execution from the same checkpoint (FT-KDSM Fig. 5)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def filesystem(path: Path) -> str:
    found = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=False).stdout.splitlines()
    return found[-1].split()[1] if len(found) > 1 else "unknown"


def _failures(text: str) -> list[int]:
    """--failures: a comma-separated list of 1, 2, 3."""
    counts = [int(part) for part in text.split(",") if part.isdigit()]
    if len(counts) != len(text.split(",")) or any(c not in FAILURES for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrent failures are 1, 2 or 3 (comma-separated)")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(BENCH_ARGS))
    parser.add_argument("--protocols", type=lambda s: s.split(","), default=list(PROTOCOLS))
    parser.add_argument("--plot", type=Path, default=None, help="draw the normalized times into this PNG")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quiet-wait", type=float, default=10.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--ranks", type=int, default=RANKS, help="ranks per overhead job (the targets are on 4)")
    parser.add_argument(
        "--scale", choices=sorted(SCALES), default="small", help="the programs' inputs: small (default) or paper"
    )
    parser.add_argument("--recovery", action="store_true", help="measure recovery time (Fig. 5) instead of overhead")
    parser.add_argument("--failures", type=_failures, default=sorted(FAILURES), help="with --recovery: e.g. 1,2,3")
    args = parser.parse_args()
    if args.recovery and (args.ranks != RANKS or args.scale != "small"):
        parser.error("--ranks and --scale set the overhead jobs; --recovery runs its own (small) jobs")
    for name in args.only:
        if name not in BENCH_ARGS:
            parser.error(f"--only: unknown program {name!r} (choose from {', '.join(BENCH_ARGS)})")
    for protocol in args.protocols:
        if protocol not in PROTOCOLS:
            parser.error(f"--protocols: unknown protocol {protocol!r} (choose from {', '.join(PROTOCOLS)})")
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    jobs = Jobs()
    with tempfile.TemporaryDirectory(prefix="bench-remotelog-", dir=args.dir) as tmp:
        directory = Path(tmp)
        settings = run_settings(
            rounds=args.rounds,
            protocols=args.protocols,
            args={name: SCALES[args.scale][0][name] for name in args.only},
            options=list(SCALES[args.scale][1]),
            scale=args.scale,
            log_fs=filesystem(directory),
            fsync_us=fsync_latency(directory),
            ranks=args.ranks,
        )
        if args.recovery:
            settings["failures"] = {f: {"ranks": FAILURES[f][0], "killed": FAILURES[f][1]} for f in args.failures}
        try:
            table = (measure_recovery if args.recovery else measure)(jobs, directory, args)
        finally:
            jobs.close()
    print((recovery_report if args.recovery else report)(settings, table))
    if args.csv:
        (write_recovery_csv if args.recovery else write_csv)(table, args.csv)
    if args.plot and args.recovery:
        plot_recovery(table, args.plot)
    elif args.plot:
        plot(table, args.plot, args.ranks, args.scale)
    write_results(args.json, settings, table)


if __name__ == "__main__":
    main()
