"""dsm._net links and the handler when a peer fails: bounded waits, wrong keys still raise, debts dropped."""

from __future__ import annotations

import re
import threading
from collections import deque

import numpy as np
import pytest
from dsm_util import run_ranks

import dsm
import dsm._net
from ckpt.testing import ThreadRuntime
from dsm._handler import LockState
from dsm._messages import AcquireRequest, Grant
from dsm._net import FAILED

pytestmark = pytest.mark.timeout(60)

WORDS = 512  # int64 per 4 KiB page


@pytest.mark.parametrize("protocol", ["async", "onesided"])
def test_a_peer_that_never_comes_back_fails_the_waiting_rank_after_the_recovery_timeout(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dsm._net, "RECOVERY_TIMEOUT", 1.0)
    gone = threading.Event()

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str:
        a = mem.array(2 * WORDS, np.int64)
        a[rt.rank * WORDS] = rt.rank + 1  # rank r is the home of page r
        mem.barrier()
        if rt.rank == 1:
            mem.close()  # its QPs vanish: rank 0's next request to it fails with RETRY_EXC_ERR
            gone.set()
            return "gone"
        gone.wait()
        with pytest.raises(dsm.DsmError, match=r"rank 1 failed .* has not come back") as failure:
            a[WORDS]
        assert mem.client.state[1] == FAILED
        assert not mem.pending  # given up: it will not be sent again if rank 1 ever comes back
        return str(failure.value)

    assert run_ranks(2, body, protocol)[1] == "gone"


def test_an_error_that_is_no_dead_peer_still_raises_at_once() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        a = mem.array(2 * WORDS, np.int64)
        a[rt.rank * WORDS] = rt.rank + 1
        mem.barrier()
        if rt.rank == 0:
            region = mem.regions[0]
            region.peers[1] = {**region.peers[1], "data_rkey": region.peers[1]["data_rkey"] ^ 0x5A5A}
            with pytest.raises(dsm.DsmError, match="REM_ACCESS_ERR"):
                a[WORDS]
            assert mem.client.state[1] != FAILED
        mem.barrier()

    run_ranks(2, body, "onesided")


@pytest.mark.parametrize("protocol", ["async", "onesided"])
def test_the_lock_home_grants_a_lock_again_to_the_rank_it_believes_holds_it(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> None:
        mem.lock()
        lock1 = mem.lock()  # home: rank 1
        if rt.rank == 0:
            lock1.acquire()
            # what a recovered incarnation does when it re-executes an acquire of a lock its predecessor held
            again = AcquireRequest(mem._next_rid(), 1, mem.vt, 0)
            assert isinstance(mem._request(1, again, Grant, "lock 1 again", 10.0), Grant)
            lock1.release()
        mem.barrier()

    run_ranks(2, body, protocol)


def test_a_request_that_times_out_says_where_it_stands() -> None:
    """A reply that never comes: the error says whether the request left, on which link, and the link's state
    (what tells a request dropped on a link that was down from a reply lost on the way)."""
    holding, asked = threading.Event(), threading.Event()

    def body(mem: dsm.Memory, rt: ThreadRuntime) -> str:
        mem.lock()
        lock1 = mem.lock()  # home: rank 1
        if rt.rank == 1:
            lock1.acquire()
            holding.set()
            assert asked.wait(30)
            lock1.release()
            mem.barrier()
            return ""
        assert holding.wait(30)
        request = AcquireRequest(mem._next_rid(), 1, mem.vt, 1)  # queued behind rank 1: no grant for now
        with pytest.raises(dsm.DsmError, match="no progress") as failure:
            mem._request(1, request, Grant, "lock 1", 0.3)
        asked.set()
        mem.barrier()
        return str(failure.value)

    message = run_ranks(2, body, "async")[0]
    assert re.search(r"\(request \d+ sent on link (\d+); the link to rank 1 is up, link \1\)$", message), message


def test_the_handler_forgets_what_a_failed_rank_waited_for_and_nothing_else() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[list[int], list[int], list[int], list[int], int]:
        handler = mem.handler
        with handler.mutex:
            handler.locks[7] = LockState([0, 0, 0], holder=1, queue=deque([(2, 11, [0] * 3, 1), (0, 12, [0] * 3, 1)]))
            handler.waiting = [(2, 13, 0, [0] * 3), (0, 14, 0, [0] * 3)]
            handler.arrivals = [(2, 15, 1, [0] * 3, []), (1, 16, 1, [0] * 3, [])]
            handler.held_back = [(2, [17], 0), (1, [18], 0)]  # lock requests held back during a replay
        handler.forget(2)
        state = handler.locks[7]
        left = [entry[1] for entry in state.queue], [w[1] for w in handler.waiting], [a[1] for a in handler.arrivals]
        held_back = [entry[1][0] for entry in handler.held_back]
        handler.forget_queues()
        assert not state.queue and not handler.waiting and not handler.arrivals and not handler.held_back
        return (*left, held_back, state.holder)

    assert run_ranks(3, body, "async")[0] == ([12], [14], [16], [18], 1)
