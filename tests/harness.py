"""This project's end-to-end helpers on top of `ckpt.testing`: its directories, its fabric, hostile peers.

Running `ckpt` as a user would, and reaping what it started, is `ckpt.testing`'s
(`run`, `Job`, the ``start_job`` fixture); what is here knows this repository.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckpt.testing import run
from ckpt_simib import FABRIC_FILE

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PROGRAMS = Path(__file__).resolve().parent / "programs"
#: This suite's own plugins (--with-plugin ckpt_faults, ...): on every ckpt command's PYTHONPATH (conftest.py).
TEST_PLUGINS = PROGRAMS / "plugins"


def heat_results(ranks: int, steps: int, cells: int = 1000) -> dict[int, str]:
    """What examples/heat.py prints on `ranks` ranks (its WORK_MS changes nothing), computed here: the same
    float64 operations on the same values in the same order, so the same bits. An uninterrupted run of
    20000 steps through the CLI costs a test worker ~45 s; this costs ~1 s. test_e2e_checkpoint checks
    it against an uninterrupted run."""
    slices = [np.random.default_rng(rank).random(cells) for rank in range(ranks)]
    for _ in range(steps):
        edges = [(float(u[0]), float(u[-1])) for u in slices]  # what the allgather carries
        new = []
        for rank, u in enumerate(slices):
            left = edges[rank - 1][1] if rank > 0 else u[0]
            right = edges[rank + 1][0] if rank + 1 < ranks else u[-1]
            padded = np.concatenate(([left], u, [right]))
            new.append(u + 0.25 * (padded[:-2] - 2 * u + padded[2:]))
        slices = new
    return {rank: f"{float(u.sum()):.12f}" for rank, u in enumerate(slices)}


def counter_results(ranks: int, steps: int) -> dict[int, str]:
    """What tests/programs/counter.py prints on `ranks` ranks (its delays change nothing), computed here with the
    same int64 operations: an uninterrupted run through the CLI only to read them costs a test ~1-3 s of CPU.
    test_e2e_faults checks it against an uninterrupted run."""
    states = [np.arange(1000, dtype=np.int64) * (rank + 1) for rank in range(ranks)]
    for i in range(steps):
        total = sum(int(state.sum() % 1_000_003) for state in states)  # what the allgather carries, summed
        states = [(state * 31 + total + i) % 1_000_003 for state in states]
    return {rank: str(int(state.sum())) for rank, state in enumerate(states)}


def small_disk(mountpoint: Path, size: str, full: bool = False, fill_once: Path | None = None) -> list[str]:
    """A command prefix (`ckpt.testing.run(..., prefix=...)`): the command runs in a private mount namespace
    with a tmpfs of `size` at `mountpoint` -- a real disk, gone with the command -- filled up first (`full`),
    or as soon as file `fill_once` exists.  Skips the test where the machine does not allow it (root and
    unshare(1) are needed)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a small disk needs root and unshare(1) (a tmpfs in a private mount namespace)")
    mountpoint.mkdir(parents=True, exist_ok=True)
    probe = ["unshare", "--mount", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mountpoint)]
    tried = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if tried.returncode:
        pytest.skip(f"this machine does not let the test mount a tmpfs: {tried.stderr.strip()}")
    fill = 'head -c 1G /dev/zero > "$0/fill" 2>/dev/null; ' if full else ""
    if fill_once is not None:  # a background loop of the shell's, polling for the file (it has no other signal)
        # for at most 5 minutes, and holding none of the command's pipes: it never outlives a failed command long
        wait = f'i=0; while [ ! -e "{fill_once}" ] && [ $i -lt 6000 ]; do sleep 0.05; i=$((i+1)); done'
        fill += f'({wait}; head -c 1G /dev/zero > "$0/fill") >/dev/null 2>&1 </dev/null & '
    script = f'mount -t tmpfs -o size={size} tmpfs "$0" || exit 99; {fill}exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, str(mountpoint)]


def start_fabric(directory: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`ckpt fabric start --dir DIRECTORY ARGS`: (its fabric.json, its stdout). The fabric outlives the
    command: kill its record["pid"] (kill_pids) when done."""
    done = run("fabric", "start", "--dir", str(directory), *args, timeout=60)
    assert done.returncode == 0, done.stderr
    record: dict[str, Any] = json.loads((directory / FABRIC_FILE).read_text())
    return record, done.stdout


# ----------------------------------------------------------------- hostile peers of a server
def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the peer has closed `sock` (EOF or reset), False if it is still open after `timeout` s.

    What the peer sends meanwhile (a challenge, heartbeats) is read and dropped.
    """
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        try:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                return True
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return True
    return False


def trickle_until_closed(sock: socket.socket, data: bytes, pace: float) -> tuple[float, int]:
    """Send `data` one byte every `pace` s until the server closes `sock`: (seconds until then, bytes sent).

    A server with a timeout per read never closes such a peer; one with a deadline for the whole
    handshake does.  Fails the test if all of `data` but its last byte went out first.
    """
    start = time.monotonic()
    sent = 0
    while not closed_by_peer(sock, pace):
        if sent >= len(data) - 1:
            raise AssertionError(f"the server still had the connection open after {sent} bytes in {sent * pace:.1f} s")
        try:
            sock.sendall(data[sent : sent + 1])
        except OSError:
            break
        sent += 1
    return time.monotonic() - start, sent
