"""The verbs programs of the ckpt_ib end-to-end tests: what each computes in plain Python, and how tests drive them.

Shared by tests/test_e2e_ib.py (checkpoint, resume, restart on simib) and
tests/test_e2e_ib2tcp.py (the same programs across transports).
"""

from __future__ import annotations

import json
import os
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckpt.testing import run, wait_for
from harness import PROGRAMS

RANKS = 4
TRACE_ENV = "CKPT_IB_TRACE_DIR"
HOLD_ENV = "CKPT_TEST_HOLD"  # tests/programs/ib_common.py: the job does not finish before this file exists
MODULUS = (1 << 61) - 1


# ------------------------------------------------------------------ what each program computes, in plain Python
def expected_ring(ranks: int, steps: int) -> dict[int, str]:
    """examples/ring.py and ib_channel.py: each rank mixes in its left neighbour's value every step."""
    values = [rank + 1 for rank in range(ranks)]
    for i in range(steps):
        values = [(values[r] * 31 + values[(r - 1) % ranks] + i) % 1_000_003 for r in range(ranks)]
    return {rank: str(v) for rank, v in enumerate(values)}


def expected_pingpong(ranks: int, steps: int, rounds: int) -> dict[int, str]:
    """ib_pingpong.py: the pinger checksums the pongs, the ponger the pings (late or not)."""
    out = {}
    for pinger in range(0, ranks, 2):
        pair, ponger = pinger // 2, pinger + 1
        got_pinger = got_ponger = 0
        for message in range(steps * rounds):
            ping = bytes((j * (3 + 2 * pair) + message) % 256 for j in range(128))
            pong = bytes((b * 7 + 1 + ponger) % 256 for b in ping)
            got_ponger = (got_ponger * 1_000_003 + zlib.crc32(ping)) % MODULUS
            got_pinger = (got_pinger * 1_000_003 + zlib.crc32(pong)) % MODULUS
        out[pinger], out[ponger] = str(got_pinger), str(got_ponger)
    return out


def expected_atomics(ranks: int, steps: int) -> dict[int, str]:
    """ib_atomics.py: 16 adds of 3 per rank and step; 4 READs of 8 table entries of the right neighbour per step."""
    counter = ranks * steps * 16 * 3
    out = {}
    for rank in range(ranks):
        owner = (rank + 1) % ranks
        checksum = 0
        for step in range(steps):
            for k in range(4):
                offset = (step * 4 + k) * 13 % (512 - 8)
                chunk = sum((owner + 1) * 1_000_003 + (offset + j) * 7919 for j in range(8))
                checksum = (checksum * 31 + chunk) % MODULUS
        out[rank] = f"counter={counter} fetched=ok reads={checksum}"
    return out


def expected_srq(ranks: int, steps: int) -> dict[int, str]:
    """ib_srq.py: each rank mixes in the sum of every other rank's value every step."""
    values = [rank + 1 for rank in range(ranks)]
    for i in range(steps):
        total = sum(values)
        values = [(v * 31 + total - v + i) % 1_000_003 for v in values]
    return {rank: str(v) for rank, v in enumerate(values)}


def expected_seq(ranks: int, steps: int, per_step: int = 8) -> dict[int, str]:
    """ib_seq.py: every message from every source seen exactly once."""
    return {rank: f"{[(steps * per_step, 0, 0)] * (ranks - 1)} corrupt=0" for rank in range(ranks)}


@dataclass(frozen=True)
class Case:
    name: str
    program: Path
    options: tuple[str, ...]  # the program's arguments after STEPS
    expect: Callable[[int], dict[int, str]]  # steps -> what each rank prints
    steps: int  # a run long enough for a checkpoint that races it (`wait_step`) to fall mid-run, mostly
    checkpoint_at: int  # the gate (`Pauses`) or step a test checkpoints at

    @property
    def short(self) -> int:
        """The steps of a run with no checkpoint in it."""
        return self.steps // 3

    def argv(self, steps: int) -> tuple[str, ...]:
        return (str(self.program), str(steps), *self.options)


# The checkpointing tests hold the job (HOLD_ENV) until their last checkpoint is taken, so a fast run
# cannot end before it.  Most checkpoint at a gate (`Pauses`, before real step `checkpoint_at`), so the
# checkpoint is mid-run under any load, and run `gated_steps` steps; the others (apm's, which fail a link at a
# moment no gate decides) race `steps`.  Runs with no checkpoint take a third of the steps (`short`).
# ib_ring.py is examples/ring.py with its step held; the ring's option paces each step by a 0.5 ms sleep
# (not the example's CPU work: the suite is CPU-bound), which does not change its result.
CASES = [
    Case("ring", PROGRAMS / "ib_ring.py", ("500",), lambda n: expected_ring(RANKS, n), 1500, 20),
    Case("pingpong", PROGRAMS / "ib_pingpong.py", ("8",), lambda n: expected_pingpong(RANKS, n, 8), 500, 10),
    Case("atomics", PROGRAMS / "ib_atomics.py", (), lambda n: expected_atomics(RANKS, n), 500, 10),
    Case("channel", PROGRAMS / "ib_channel.py", (), lambda n: expected_ring(RANKS, n), 3000, 30),
    Case("srq", PROGRAMS / "ib_srq.py", (), lambda n: expected_srq(RANKS, n), 2000, 20),
]
BY_NAME = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


def by_name_in_ci(*names: str) -> pytest.MarkDecorator:
    """BY_NAME, with the cases not in `names` marked stress (suite time: CI runs `names`)."""
    return pytest.mark.parametrize(
        "case",
        [pytest.param(c, id=c.name, marks=[] if c.name in names else [pytest.mark.stress]) for c in CASES],
    )


def launch_args(ckpt_dir: Path, argv: tuple[str, ...] | list[str], *options: str) -> list[str]:
    """`ckpt launch` of RANKS ranks with `options` (e.g. "--transport", "tcp") before the program."""
    return ["launch", "-n", str(RANKS), "--ckpt-dir", str(ckpt_dir), *options, *argv]


def take(ckpt_dir: Path, how: str) -> None:
    """`ckpt checkpoint --wait` or `--kill`; it must be written."""
    taken = run("checkpoint", how, "--ckpt-dir", str(ckpt_dir), timeout=120)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "written" in taken.stdout, taken.stdout


def gated_steps(last_gate: int) -> int:
    """The steps of a run whose checkpoints wait at gates (`Pauses`), the last before step `last_gate`: three
    times as many steps again run on the restored queue pairs, and no more (the suite is CPU-bound)."""
    return 4 * last_gate


def traced(directory: Path, rank: int, generation: int) -> dict[str, Any]:
    """What ckpt_ib recorded for a rank's generation ($CKPT_IB_TRACE_DIR): real IDs and the provider."""
    data: dict[str, Any] = json.loads((directory / f"ib.{rank}.{generation}.json").read_text())
    return data


class Pauses:
    """Steps where a job of tests/programs idles until the test opens the gate (`ib_common.pausable`): `env`,
    `wait(step)`, `open(step)`."""

    def __init__(self, tmp_path: Path, *steps: int) -> None:
        self.prefix = tmp_path / "pause"
        self.env = {"CKPT_TEST_PAUSE": str(self.prefix), "CKPT_TEST_PAUSE_AT": ",".join(map(str, steps))}

    def wait(self, step: int) -> None:
        wait_for(Path(f"{self.prefix}.{step}.reached").exists, 60, f"the job to pause before step {step}")

    def open(self, step: int) -> None:
        Path(f"{self.prefix}.{step}").touch()


class Hold:
    """The file a held job waits for before it finishes: `env` for launch and restart, `release()` at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "release"
        self.env = {HOLD_ENV: str(self.path)}

    def release(self) -> None:
        self.path.touch()


def random_seed() -> int:
    """$CKPT_TEST_SEED, or a fresh seed: a test that picks random moments prints it so a failure can be replayed."""
    return int(os.environ.get("CKPT_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
