"""The async home's handler (`dsm._handler`): what it does with a diff message it cannot apply whole."""

from __future__ import annotations

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime
from dsm import Diff, DsmError
from dsm._messages import Ack, DiffRequest

WORDS = 512  # float64 per 4 KiB page


def _send(mem: dsm.Memory, request: DiffRequest) -> str:
    """Send `request` to rank 0 as a writer would; the error the home answered with."""
    with pytest.raises(DsmError) as refused:
        mem._request(0, request, Ack, "diff ack from rank 0")
    return str(refused.value)


def hostile(mem: dsm.Memory, rt: ThreadRuntime) -> list[str]:
    a = mem.array(2 * WORDS, np.float64)
    if rt.rank == 0:
        with a.write(slice(0, 2 * WORDS)) as v:
            v[:] = 0.0  # rank 0 homes both pages
    mem.barrier()
    errors = []
    if rt.rank == 1:
        good = Diff.of_runs([(0, np.float64(7.0).tobytes())]).encode()
        # the second page's diff is damaged: the first, which decodes, must not be applied either
        errors.append(_send(mem, DiffRequest(mem._next_rid(), 1, [0, 1], [good, b"\xff\xff\xff\x00" + b"x" * 16])))
        errors.append(_send(mem, DiffRequest(mem._next_rid(), 1, [0, 1], [good])))  # a page without its diff
    mem.barrier()
    if rt.rank == 0:
        region = mem.regions[0]
        assert float(a[0]) == 0.0 and int(region.meta[0, 1]) == 0 and int(region.meta[1, 1]) == 0
        assert mem.statistics().diffs_applied == 0
    mem.barrier()
    return errors


def test_a_diff_message_with_one_bad_diff_changes_no_page_and_gets_one_error() -> None:
    errors = run_ranks(2, hostile, "async")[1]
    assert len(errors) == 2
    assert "malformed diff" in errors[0] and errors[0].startswith("rank 0: "), errors[0]
    assert "malformed diff message from rank 1: 2 page(s), 1 diff(s)" in errors[1], errors[1]
