"""Benchmark the verbs virtualization plugin (ckpt_ib): runtime overhead, round-trip latency, checkpoint and restart."""

# Usage: python benchmarks/bench_ib.py [--rounds 7] [--ring-steps 400] [--work-us 1000] [--round-trips 3000]
#                                      [--qps 64] [--ckpt-rounds 3] [--checkpoints 3] [--quiet-wait 10]
#                                      [--only ring|pingpong|checkpoint|calls] [--dir DIR] [--json FILE]
#
# Three measurements, each against a baseline taken in the same run:
#
# 1. ring: examples/ring.py on 4 ranks with WORK_US of numpy work (the rank's
#    own CPU time) per step, under `ckpt launch -n 4` (the plugin wraps the
#    provider) and `ckpt launch -n 4 --native` (no plugins) on the same simib
#    provider.  Each rank times its own step loop and writes the mean step to
#    a file (ring.py's TIMING_FILE); a run's per-step time is the mean over
#    its ranks.  The two modes must compute the same result.
# 2. pingpong: benchmarks/programs/ib_pingpong_lat.py, an 8-byte SEND/RECV
#    ping-pong between 2 ranks that times ROUND_TRIPS round trips itself and
#    returns the µs of one; plugin against --native.  A third mode runs
#    natively with every send signaled, for the diagnosis: what an ACK and a
#    completion per message cost (ckpt_ib signaled every real WR until it
#    learnt to retire unsignaled WRs in order).
# 3. checkpoint: benchmarks/programs/ib_manyqp.py on 4 ranks with QPS RC QPs
#    each (all-to-all), and with 1 QP each for context.  A running job takes
#    --checkpoints checkpoints with `ckpt checkpoint --wait` (the manifest's
#    "seconds": the coordinator's request to the manifest being written; and
#    the command's wall time; a job's first checkpoint is reported apart, it
#    is slower), then `ckpt checkpoint --kill`; then
#    `ckpt restart` is timed as bench_checkpoint.py does: from just before the
#    command starts to the program's first step after the restart (the
#    latest time.time() the ranks write at that step), with the time the
#    slowest rank imported the program file ("rank started") split out.
# 4. calls: in one process, what ckpt_ib's wrappers cost per verbs call, with
#    the provider's own entries beneath them replaced by no-ops: post_send of
#    an 8-byte inline SEND, post_recv of one SGE, an empty poll_cq, and the
#    translation of one receive completion; against the front end alone (the
#    same calls on a table of no-ops).  No network, no threads: the figure
#    that the noisy round trip above hides.
#
# Rounds alternate which mode goes first; every figure is a median and every
# ratio a ratio of medians (the median of the per-round ratios is shown too
# for the two overheads).  Each round first waits (up to --quiet-wait s) for a
# second in which other processes use less than 10% of the CPUs, and each run
# records the share of the CPUs others used meanwhile (bench_overhead's
# ForeignLoad); the rounds in which others used less than 5% in every run are
# "quiet", and their medians are reported too.  A full run takes about 2.5 minutes.

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

from bench_checkpoint import wait_file
from bench_image import machine
from bench_overhead import ForeignLoad, Jobs, ckpt_cli, wait_quiet, wait_stepping

ROOT = Path(__file__).resolve().parent.parent
RING = ROOT / "examples" / "ring.py"
PINGPONG = ROOT / "benchmarks" / "programs" / "ib_pingpong_lat.py"
MANYQP = ROOT / "benchmarks" / "programs" / "ib_manyqp.py"
RING_TARGET = 1.02
PINGPONG_TARGET = 1.10
MODES = ("native", "plugin")
QUIET_SHARE = 0.05
_RESULT = re.compile(r"^\[rank (\d+)\] result: (.*)$", re.M)  # a result may have spaces (the DSM programs')


def launch(jobs: Jobs, directory: Path, tag: str, native: bool, ranks: int, program: list[str]) -> tuple[str, float]:
    """One uninterrupted `ckpt launch` to completion: (its stdout, the CPU share others used meanwhile)."""
    ckpt_dir, out = directory / f"ckpt-{tag}", directory / f"{tag}.out"
    command = ["launch", "-n", str(ranks), "--ckpt-dir", str(ckpt_dir), *(["--native"] if native else []), *program]
    load = ForeignLoad()
    job = jobs.start(command, out)
    try:
        code = job.wait(timeout=300)
        foreign = load.share()
    finally:
        jobs.close()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"ckpt {' '.join(command)} failed ({code}): {out.with_suffix('.err').read_text()}")
    return out.read_text(), foreign


def results(stdout: str) -> dict[int, str]:
    return {int(rank): value for rank, value in _RESULT.findall(stdout)}


def alternate(
    rounds: int, quiet_wait: float, run: Any, label: str, modes: tuple[str, ...] = MODES
) -> list[dict[str, float]]:
    """`rounds` rounds of run(mode, round) for every mode, the order rotating (two modes: flipping) every round."""
    rows = []
    for i in range(rounds):
        row = {"quiet_before": wait_quiet(quiet_wait)}
        shift = i % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            row[mode], row[f"{mode}_foreign"] = run(mode, i)
            print(
                f"  {label} round {i} {mode:<6}: {row[mode]:.6g}, others {row[f'{mode}_foreign']:.0%}", file=sys.stderr
            )
        rows.append(row)
    return rows


def medians(rows: list[dict[str, float]], modes: tuple[str, ...]) -> dict[str, Any]:
    summary: dict[str, Any] = {mode: statistics.median(r[mode] for r in rows) for mode in modes}
    for mode in modes[1:]:
        suffix = "" if mode == "plugin" else f"_{mode}"
        summary[f"ratio{suffix}"] = summary[mode] / summary["native"]
        summary[f"paired_ratio{suffix}"] = statistics.median(r[mode] / r["native"] for r in rows)
    return summary | {"n": len(rows)}


def summarize(rows: list[dict[str, float]], modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """Medians over all rounds, and over the quiet ones (others used < QUIET_SHARE of the CPUs in every run)."""
    quiet = [r for r in rows if max(r[f"{mode}_foreign"] for mode in modes) < QUIET_SHARE]
    summary = medians(rows, modes) | {"rounds": rows}
    if quiet and len(quiet) < len(rows):
        summary["quiet"] = medians(quiet, modes)
    return summary


def measure_ring(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    first: list[dict[int, str]] = []  # the first run's result: every run must compute the same

    def run(mode: str, i: int) -> tuple[float, float]:
        timing = directory / f"ring-{mode}-{i}"
        program = [str(RING), str(args.ring_steps), str(args.work_us), str(timing)]
        stdout, foreign = launch(jobs, directory, f"ring-{mode}-{i}", mode == "native", 4, program)
        answer = results(stdout)
        first.append(answer)
        if answer != first[0] or len(answer) != 4:
            raise RuntimeError(f"the ring computed {answer} under {mode}, the first run {first[0]}")
        per_step = [float(Path(f"{timing}.{rank}").read_text()) for rank in range(4)]
        return statistics.mean(per_step), foreign

    return summarize(alternate(args.rounds, args.quiet_wait, run, "ring"))


def measure_pingpong(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    # "signaled": native, but every send signaled, as ckpt_ib posts every real WR -- the share of the
    # plugin's cost that comes from the extra ACKs and completions rather than from its Python wrappers
    modes = ("native", "plugin", "signaled")

    def run(mode: str, i: int) -> tuple[float, float]:
        program = [str(PINGPONG), str(args.round_trips), "100", "1" if mode == "signaled" else "64"]
        stdout, foreign = launch(jobs, directory, f"pingpong-{mode}-{i}", mode != "plugin", 2, program)
        return float(results(stdout)[0]), foreign

    return summarize(alternate(args.rounds, args.quiet_wait, run, "pingpong", modes), modes)


def checkpoint_round(jobs: Jobs, directory: Path, qps: int, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    """Launch the many-QP job, time --checkpoints checkpoints, checkpoint --kill, time one restart."""
    ckpt_dir, stamp = directory / f"ckpt-manyqp-{qps}-{rnd}", directory / f"stamp-{qps}-{rnd}"
    program = [str(MANYQP), str(qps), str(args.step_ms), str(stamp)]
    row: dict[str, Any] = {"checkpoints": []}
    try:
        job = jobs.start(["launch", "-n", "4", "--ckpt-dir", str(ckpt_dir), *program], directory / f"manyqp-{rnd}.out")
        wait_stepping(ckpt_dir, job)
        for _ in range(args.checkpoints):
            started = time.perf_counter()
            answer = ckpt_cli("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir))
            wall = time.perf_counter() - started
            if answer.returncode != 0:
                raise RuntimeError(f"ckpt checkpoint --wait failed: {answer.stderr.strip()}")
            manifest = json.loads((ckpt_dir / (ckpt_dir / "latest").read_text().strip()).read_text())
            row["checkpoints"].append(
                {
                    "seconds": manifest["seconds"],
                    "wall": wall,
                    "image_seconds": max(r["seconds"] for r in manifest["ranks"]),
                    "bytes": sum(r["bytes"] for r in manifest["ranks"]),
                }
            )
        answer = ckpt_cli("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir))
        if answer.returncode != 0 or job.wait(timeout=60) != 0:
            raise RuntimeError(f"ckpt checkpoint --kill failed: {answer.stderr.strip()}")
        started_at = time.time()
        restart = jobs.start(["restart", "--ckpt-dir", str(ckpt_dir)], directory / f"restart-{qps}-{rnd}.out")
        stamps = [Path(f"{stamp}.{rank}") for rank in range(4)]
        for path in stamps:
            wait_file(path, restart, timeout=120)
        records = [json.loads(path.read_text()) for path in stamps]
        wait_stepping(ckpt_dir, restart)  # and the job keeps stepping
        ckpt_cli("kill", "--ckpt-dir", str(ckpt_dir))
        restart.wait(timeout=60)
    finally:
        jobs.close()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    first, *later = row["checkpoints"]  # the first checkpoint of a job is slower: reported apart
    row["first_checkpoint_s"] = first["seconds"]
    row["checkpoint_s"] = statistics.median(c["seconds"] for c in later)
    row["checkpoint_wall_s"] = statistics.median(c["wall"] for c in later)
    row["image_write_s"] = statistics.median(c["image_seconds"] for c in later)
    row["image_bytes"] = row["checkpoints"][-1]["bytes"]
    row["restart_s"] = max(r["first_step"] for r in records) - started_at
    row["rank_started_s"] = max(r["imported"] for r in records) - started_at
    row["after_start_s"] = row["restart_s"] - row["rank_started_s"]
    return row


def measure_checkpoint(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    sizes = (args.qps, 1)
    rows: dict[int, list[dict[str, Any]]] = {qps: [] for qps in sizes}
    for rnd in range(args.ckpt_rounds):
        wait_quiet(args.quiet_wait)
        for qps in sizes if rnd % 2 == 0 else sizes[::-1]:
            row = checkpoint_round(jobs, directory, qps, rnd, args)
            print(
                f"  checkpoint round {rnd} {qps} QP(s): checkpoint {row['checkpoint_s'] * 1e3:.1f} ms "
                f"(wall {row['checkpoint_wall_s'] * 1e3:.0f} ms), restart {row['restart_s'] * 1e3:.0f} ms",
                file=sys.stderr,
            )
            rows[qps].append(row)
    keys = (
        "first_checkpoint_s",
        "checkpoint_s",
        "checkpoint_wall_s",
        "image_write_s",
        "restart_s",
        "rank_started_s",
        "after_start_s",
    )
    summary: dict[str, Any] = {}
    for qps, subset in rows.items():
        summary[str(qps)] = {k: statistics.median(r[k] for r in subset) for k in keys}
        summary[str(qps)] |= {"image_bytes": subset[-1]["image_bytes"], "rounds": subset}
    return summary


def measure_calls(jobs: Jobs, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """µs per call of the plugin's wrappers over no-op provider entries, and of the front end alone."""
    import types

    sys.path.insert(0, str(ROOT / "tests"))
    from ib_util import ib_env
    from verbs_util import connect_rc

    from ckpt import verbs

    env = ib_env()
    ib = next(env)
    try:
        ends = {"max_inline": 64, "max_send_wr": 128, "max_recv_wr": 128, "separate_cqs": True, "sq_sig_all": 0}
        a, b = connect_rc(ib.context(0), ib.context(1), endpoint_a=ends, endpoint_b=ends)
        inner = ib.vz.inner
        sge = a.sge(0, 8)
        send = verbs.SendWR(wr_id=1, opcode=verbs.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=verbs.IBV_SEND_INLINE)
        recv = verbs.RecvWR(wr_id=1, num_sge=1, sg=[sge])
        real_qpn = int(b.qp.handle.real.qp_num)
        sends, recvs = a.qp.handle.sends, b.qp.handle.recvs
        n = args.calls

        def per_call(fn: Any) -> float:
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - start) / n)
            return best * 1e6

        def translate() -> float:
            """One receive completion turned into the program's (its log entry found and dropped)."""
            for _ in range(n):
                b.qp.post_recv(recv)
            wcs = [verbs.WC(wr_id=seq, opcode=verbs.IBV_WC_RECV, qp_num=real_qpn, byte_len=8) for seq in recvs]
            start = time.perf_counter()
            for wc in wcs:
                ib.vz.translate(wc)
            return (time.perf_counter() - start) / n * 1e6

        saved = {k: getattr(inner, k) for k in ("post_send", "post_recv", "poll_cq")}
        inner.post_send = inner.post_recv = lambda handle, wr: None
        inner.poll_cq = lambda handle, num: []
        try:
            plugin = {
                "post_send": per_call(lambda: (a.qp.post_send(send), sends.clear())),
                "post_recv": per_call(lambda: (b.qp.post_recv(recv), recvs.clear())),
                "poll_cq": per_call(lambda: b.rcq.poll(1)),
                "translate a receive completion": translate(),
            }
        finally:
            for k, fn in saved.items():
                setattr(inner, k, fn)
        noop = types.SimpleNamespace(
            post_send=lambda h, wr: None, post_recv=lambda h, wr: None, poll_cq=lambda h, k: []
        )
        tables = (a.qp._ops, b.qp._ops)
        a.qp._ops = b.qp._ops = noop
        try:
            front = {
                "post_send": per_call(lambda: a.qp.post_send(send)),
                "post_recv": per_call(lambda: b.qp.post_recv(recv)),
            }
        finally:
            a.qp._ops, b.qp._ops = tables
    finally:
        env.close()
    return {"plugin_us": plugin, "front_end_us": front, "calls": n}


def _met(ratio: float, target: float) -> str:
    return "yes" if ratio <= target else "NO"


def _subsets(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    subsets = [(f"all {summary['n']}", summary)]
    if "quiet" in summary:
        subsets.append((f"quiet {summary['quiet']['n']}", summary["quiet"]))
    return subsets


def report(settings: dict[str, Any], data: dict[str, Any]) -> str:
    lines = []
    if "ring" in data:
        r = data["ring"]
        lines += [
            f"ring: examples/ring.py, 4 ranks, {settings['ring_steps']} steps, {settings['work_us']} µs of work "
            f"per step, medians",
            "",
            "| rounds | native per step (ms) | plugin per step (ms) | plugin / native | median per-round ratio "
            "| target | met |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {label} | {x['native'] * 1e3:.4f} | {x['plugin'] * 1e3:.4f} | **{x['ratio']:.4f}** "
                f"| {x['paired_ratio']:.4f} | <= {RING_TARGET} | {_met(x['ratio'], RING_TARGET)} |"
                for label, x in _subsets(r)
            ),
            "",
            "every round, ms per step (CPU share used by others):",
            *(
                f"  {i}: native {x['native'] * 1e3:.4f} ({x['native_foreign']:.0%}), "
                f"plugin {x['plugin'] * 1e3:.4f} ({x['plugin_foreign']:.0%})"
                for i, x in enumerate(r["rounds"])
            ),
            "",
        ]
    if "pingpong" in data:
        p = data["pingpong"]
        lines += [
            f"pingpong: 2 ranks, 8-byte SEND/RECV, {settings['round_trips']} round trips per run, medians",
            "",
            "| rounds | native round trip (µs) | plugin round trip (µs) | plugin / native | median per-round ratio "
            "| target | met | native, every send signaled (µs) | ÷ native |",
            "|---|---|---|---|---|---|---|---|---|",
            *(
                f"| {label} | {x['native']:.1f} | {x['plugin']:.1f} | **{x['ratio']:.3f}** | {x['paired_ratio']:.3f} "
                f"| <= {PINGPONG_TARGET} | {_met(x['ratio'], PINGPONG_TARGET)} | {x['signaled']:.1f} "
                f"| {x['ratio_signaled']:.3f} |"
                for label, x in _subsets(p)
            ),
            "",
            "every round, µs per round trip (CPU share used by others):",
            *(
                f"  {i}: native {x['native']:.1f} ({x['native_foreign']:.0%}), "
                f"plugin {x['plugin']:.1f} ({x['plugin_foreign']:.0%}), "
                f"signaled {x['signaled']:.1f} ({x['signaled_foreign']:.0%})"
                for i, x in enumerate(p["rounds"])
            ),
            "",
        ]
    if "checkpoint" in data:
        c = data["checkpoint"]
        many, one = c[str(settings["qps"])], c["1"]
        lines += [
            f"checkpoint and restart: benchmarks/programs/ib_manyqp.py, 4 ranks; {settings['checkpoints']} "
            f"checkpoints and 1 restart per round, median of {len(many['rounds'])} rounds (ms); "
            "the first checkpoint of each job apart, the others pooled per round",
            "",
            "| QPs per rank | images | first checkpoint | checkpoint (manifest) | slowest image write "
            "| `checkpoint --wait` wall | restart to first step | of which rank started | after start |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for qps, x in ((settings["qps"], many), (1, one)):
            lines.append(
                f"| {qps} | {x['image_bytes'] / 1024:.0f} KiB | {x['first_checkpoint_s'] * 1e3:.1f} "
                f"| {x['checkpoint_s'] * 1e3:.1f} "
                f"| {x['image_write_s'] * 1e3:.1f} | {x['checkpoint_wall_s'] * 1e3:.0f} | {x['restart_s'] * 1e3:.0f} "
                f"| {x['rank_started_s'] * 1e3:.0f} | {x['after_start_s'] * 1e3:.0f} |"
            )
        lines += [
            f"| ratio {settings['qps']} / 1 | | {many['first_checkpoint_s'] / one['first_checkpoint_s']:.2f} "
            f"| {many['checkpoint_s'] / one['checkpoint_s']:.2f} "
            f"| {many['image_write_s'] / one['image_write_s']:.2f} "
            f"| {many['checkpoint_wall_s'] / one['checkpoint_wall_s']:.2f} "
            f"| {many['restart_s'] / one['restart_s']:.2f} | {many['rank_started_s'] / one['rank_started_s']:.2f} "
            f"| {many['after_start_s'] / one['after_start_s']:.2f} |",
            "",
            "every round, ms: checkpoints (manifest) / restart",
        ]
        for qps, x in ((settings["qps"], many), (1, one)):
            for i, row in enumerate(x["rounds"]):
                each = " ".join(f"{k['seconds'] * 1e3:.1f}" for k in row["checkpoints"])
                lines.append(f"  {qps:>3} QPs round {i}: {each} / {row['restart_s'] * 1e3:.0f}")
    if "calls" in data:
        c = data["calls"]
        plugin, front = c["plugin_us"], c["front_end_us"]
        lines += [
            "",
            f"calls: µs per verbs call in one process, provider entries replaced by no-ops (best of 5 x {c['calls']})",
            "",
            "| call | front end + ckpt_ib | front end alone | ckpt_ib's share |",
            "|---|---|---|---|",
            *(
                f"| {name} | {us:.2f} | {front[name]:.2f} | {us - front[name]:.2f} |"
                if name in front
                else f"| {name} | {us:.2f} | | |"
                for name, us in plugin.items()
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the ring and the ping-pong (one run per mode)")
    parser.add_argument("--ring-steps", type=int, default=400)
    parser.add_argument("--work-us", type=int, default=1000, help="µs of numpy work per ring step")
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--qps", type=int, default=64, help="QPs per rank of the many-QP job")
    parser.add_argument("--ckpt-rounds", type=int, default=3, help="launches per QP count of the many-QP job")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints per launch of the many-QP job")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sleep per step of the many-QP job")
    parser.add_argument("--quiet-wait", type=float, default=10.0, help="wait at most this long for a quiet machine")
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing of the in-process measurement")
    parser.add_argument("--only", choices=["ring", "pingpong", "checkpoint", "calls"], default=None)
    parser.add_argument("--dir", type=Path, default=None, help="where the temp dir goes")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    def on_sigterm(signum: int, frame: object) -> None:
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    directory = Path(tempfile.mkdtemp(prefix="ckpt-bench-ib-", dir=args.dir))
    jobs = Jobs()
    data: dict[str, Any] = {}
    measures = {
        "ring": measure_ring,
        "pingpong": measure_pingpong,
        "checkpoint": measure_checkpoint,
        "calls": measure_calls,
    }
    started = time.monotonic()
    try:
        for name, measure in measures.items():
            if args.only in (None, name):
                data[name] = measure(jobs, directory, args)
    finally:
        jobs.close()
        shutil.rmtree(directory, ignore_errors=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("dir", "json", "only")}
    info = machine()
    print(f"command: {subprocess.list2cmdline([sys.executable, *sys.argv])}")
    print(
        f"machine: {info}; load average at the end: {os.getloadavg()}; the run took {time.monotonic() - started:.0f} s"
    )
    print(report(settings, data))
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "settings": settings, **data}, indent=2) + "\n")


if __name__ == "__main__":
    main()
