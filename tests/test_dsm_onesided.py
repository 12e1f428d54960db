"""The one-sided protocol's ARDMAR and DRAW (dsm._onesided): a writer killed half-way through a DRAW."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime
from dsm import Diff, DsmError, _onesided

pytestmark = pytest.mark.timeout(60)
WORDS = 512  # int64 per 4 KiB page
INTERVAL = 5


def test_a_writer_killed_mid_draw_blocks_readers_until_its_next_incarnation_draws_the_interval_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1's DRAW of two runs into rank 0's page stops after its first run, as when the process is killed
    there: the page's column of rank 1 says a diff is in progress, so rank 2's ARDMAR finds no consistent copy
    (one clear line naming the writer).  The re-executed interval's DRAW, whole, clears it: the fetch then
    succeeds with both runs.  (With the shared FETCH_AND_ADD counters this replaced, the lost bracket kept
    them unequal for good and the last fetch failed too.)"""
    monkeypatch.setattr(_onesided, "FETCH_TIMEOUT", 0.3)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> Any:
        a = mem.array(WORDS, np.int64)
        region = mem.regions[-1]
        if rt.rank == 0:
            a[:] = 1  # first touch: rank 0 is the home of page 0
        mem.barrier()
        local = region.data.view(np.int64)
        runs = [(0, 8 * 4), (8 * 100, 8 * 3)]  # two runs: words 0-3 and 100-102
        diff = Diff.of_runs((offset, b"?" * n) for offset, n in runs)  # only rank 1 DRAWs it
        if rt.rank == 1:
            local[0:4], local[100:103] = 7, 9
            diff = Diff.of_runs((offset, local.tobytes()[offset : offset + n]) for offset, n in runs)
            whole = mem.client.run
            monkeypatch.setattr(mem.client, "run", lambda home, wrs, seq: whole(home, wrs[:2], seq))
            _onesided.draw(mem, {0: [(region, 0, diff)]}, INTERVAL)  # the opening WRITE and the first run only
            monkeypatch.setattr(mem.client, "run", whole)
        rt.barrier()
        out: dict[str, Any] = {}
        if rt.rank == 0:
            out["marked"] = int(region.meta[0, 1]), int(region.applied()[0, 1])
        need = np.array([0, 0, 0], dtype=np.int64)
        if rt.rank == 2:
            with pytest.raises(DsmError) as failed:
                _onesided.ardmar(mem, region, 0, 0, need)
            out["error"] = str(failed.value)
        rt.barrier()
        if rt.rank == 1:
            _onesided.draw(mem, {0: [(region, 0, diff)]}, INTERVAL)  # the next incarnation, re-executing
        rt.barrier()
        if rt.rank == 0:
            out["cleared"] = int(region.meta[0, 1])
        if rt.rank == 2:
            need[1] = INTERVAL
            _onesided.ardmar(mem, region, 0, 0, need)
            out["page"] = local[:104].tolist()
        rt.barrier()
        return out

    home, _, reader = run_ranks(3, body, "onesided")
    assert home["marked"] == (-INTERVAL, INTERVAL - 1)  # in progress; Region.applied reads it as not there
    assert home["cleared"] == INTERVAL
    assert reader["error"] == (
        "page 0x0: no consistent copy at rank 0 after 0 s (rank 1's diff of interval 5 still in progress)"
    )
    assert reader["page"] == [7] * 4 + [1] * 96 + [9] * 3 + [1]


def test_a_fetch_that_never_finds_the_needed_interval_says_what_the_home_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_onesided, "FETCH_TIMEOUT", 0.2)

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str | None:
        a = mem.array(WORDS, np.int64)
        if rt.rank == 0:
            a[:] = 1
        mem.barrier()
        error = None
        if rt.rank == 1:
            with pytest.raises(DsmError) as failed:
                _onesided.ardmar(mem, mem.regions[-1], 0, 0, np.array([0, 3], dtype=np.int64))
            error = str(failed.value)
        rt.barrier()
        return error

    assert run_ranks(2, body, "onesided")[1] == (
        "page 0x0: no consistent copy at rank 0 after 0 s (it holds [1, 0], [0, 3] needed)"
    )
