"""The DSM handler's service to a recovery by replay: duplicate releases, repeated arrivals, minimal page versions."""

# Thread-ranks attached to one DSM (dsm_util.run_ranks); the requests a
# recovered rank sends again after its replay (design of issue 13 part 5,
# §2.5, §2.6) are built by hand and sent as the DSM sends them.  Lock l lives
# at rank l mod N; rank 0 manages barriers.

from __future__ import annotations

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from dsm_util import run_ranks

import dsm
from ckpt.testing import ThreadRuntime
from dsm._messages import Ack, BarrierReply, BarrierRequest, OldPageRequest, PageReply, ReleaseRequest
from dsm._region import gid_of

pytestmark = pytest.mark.timeout(60)

WORDS = 512  # int64 per 4 KiB page
ANSWER = 10.0  # seconds: a request the handler answers at once


def _release_again(mem: dsm.Memory, lock: int, token: int) -> Ack:
    """A release of `lock` as `Memory.release` sends it (token `token`), answered by the lock's home."""
    request = ReleaseRequest(mem._next_rid(), lock, list(mem.vt), [], token)
    return mem._request(lock % mem.size, request, Ack, f"release of lock {lock} again", ANSWER)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_release_sent_again_is_acked_and_changes_nothing(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[int, int, dict[int, int], list[int]] | None:
        mem.lock()
        lock1 = mem.lock()  # home: rank 1
        if rt.rank == 0:
            lock1.acquire()  # token 1
            lock1.release()
            _release_again(mem, 1, 1)  # the replay's last release, whose log record cannot say it left
            lock1.acquire()  # token 2: held again when the duplicate of token 1 comes
            _release_again(mem, 1, 1)
            with pytest.raises(dsm.DsmError, match="rank 0 released lock 0, which it does not hold"):
                _release_again(mem, 0, 5)  # lock 0 (home: rank 0) was never acquired: no duplicate, an error
            lock1.release()
        mem.barrier()
        if rt.rank == 1:
            state = mem.handler.locks[1]
            return state.holder, state.token, dict(state.released), list(state.vt)
        return None

    holder, token, released, vt = run_ranks(2, body, protocol)[1]
    # the second acquisition was released once, by its own token, and nothing else changed the lock
    assert (holder, token, released) == (-1, 0, {0: 2})
    assert vt[0] == 0  # rank 0 wrote nothing: no release raised the lock's timestamp


def test_the_barrier_manager_answers_an_arrival_at_its_last_barrier_from_its_stored_reply() -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[list[int], list[list[object]]] | None:
        a = mem.array(2 * WORDS, np.int64)
        a[rt.rank * WORDS] = rt.rank + 1  # an interval each: the barrier's union holds both notices
        mem.barrier()
        if rt.rank == 1:  # its reply lost with the manager's previous incarnation: it arrives again
            again = BarrierRequest(mem._next_rid(), mem.epoch, [0, 0], [])
            reply = mem._request(0, again, BarrierReply, "barrier 1 again", ANSWER)
            assert reply.vt == mem.vt
            return reply.vt, reply.notices
        return None

    vt, notices = run_ranks(2, body, "async")[1]
    assert vt == [1, 1]
    assert sorted((q, i) for q, i, _ in notices) == [(0, 1), (1, 1)]


class Versions:
    """A fake `dsm.PageVersions`: every version is the page filled with the sum of its timestamp."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.asked: list[tuple[int, list[int]]] = []

    def page(self, gid: int, vt: list[int]) -> bytes:
        self.asked.append((gid, list(vt)))
        return bytes([sum(vt) % 256]) * self.page_size


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_minimal_page_versions_are_served_by_the_home_from_its_page_versions(protocol: str) -> None:
    def body(mem: dsm.Memory, rt: ThreadRuntime) -> tuple[list[tuple[int, list[int]]], int] | None:
        a = mem.array(2 * WORDS, np.int64)
        a[rt.rank * WORDS] = rt.rank + 1  # rank r is the home of page r
        mem.barrier()
        versions = Versions(mem.page_size)
        if rt.rank == 1:
            mem.versions = versions
        mem.barrier()
        if rt.rank == 0:
            old = OldPageRequest(mem._next_rid(), gid_of(0, 1), [2, 3])
            reply = mem._request(1, old, PageReply, "page 1 at [2, 3]", ANSWER)
            assert reply.data == bytes([5]) * mem.page_size
            with pytest.raises(dsm.DsmError, match=r"page 0x0 is not homed here"):
                mem._request(1, OldPageRequest(mem._next_rid(), gid_of(0, 0), [0, 0]), PageReply, "page 0", ANSWER)
            with pytest.raises(dsm.DsmError, match="no page versions are kept here"):
                mem._request(0, OldPageRequest(mem._next_rid(), gid_of(0, 0), [0, 0]), PageReply, "page 0", ANSWER)
        mem.barrier()
        if rt.rank == 1:
            return versions.asked, mem.statistics().versions_served
        return None

    assert run_ranks(2, body, protocol)[1] == ([(gid_of(0, 1), [2, 3])], 1)
