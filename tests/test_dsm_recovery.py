"""DSM reconnection: ranks killed mid-run and respawned alone from their images; the survivors' work completes."""

# Three thread-ranks, each a verbs process of its own under ckpt_ib
# (recovery_util).  Rank r is the home of page r of the shared arrays (first
# touch), lock l lives at rank l, rank 0 is the barrier manager.  In each
# round one rank, the victim v, writes its page, and after a barrier takes an
# image of itself (its handler quiesced, as at a checkpoint) and dies: its
# verbs resources vanish.  Rank v+1 then faults on page v (a page request
# under `async`, RDMA READs under `onesided`) and rank v+2 asks for lock v:
# both wait, and their links to v fail by themselves (RETRY_EXC_ERR).  The
# runtime's notifications follow -- ckpt_rank_failed on the survivors, the
# respawn (RESTART), then REFRESH on the new incarnation while the survivors
# run ckpt_rank_recovered -- and the pending work completes against the new
# incarnation, which then takes part in locks, barriers (also as their
# manager) and page service as before.  A victim is reconnected, not
# replayed: nothing happened to its state between its image and its failure,
# so every answer is the uninterrupted one.

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from dsm_cases import PROTOCOLS
from recovery_util import RankProcess, RecoveryJob, concurrently

import dsm
from ckpt.testing import wait_for
from dsm._net import FAILED, UP

pytestmark = pytest.mark.timeout(120)

WORDS = 512  # int64 per 4 KiB page
SIZE = 3
FAILS_WITHIN = 20.0  # seconds for a survivor's link to a dead rank to fail by itself (RETRY_EXC_ERR takes ~0.5 s)


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _value(victims: list[int], page: int, rounds: int) -> int:
    """What page `page` holds after `rounds` rounds: the victim of a round rewrites its page."""
    value = page + 1
    for k, victim in enumerate(victims[:rounds]):
        if victim == page:
            value = 10 * (k + 1) + page
    return value


def _recovery_rounds(protocol: str, victims: list[int], in_flight: bool = False) -> None:
    """Each round's victim fails and comes back; `in_flight`: the survivors' requests reach it before it dies."""
    job = RecoveryJob(SIZE, {"dsm_protocol": protocol})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    imaged = threading.Barrier(SIZE, timeout=60)
    dead = [threading.Event() for _ in victims]
    fetched: dict[int, np.ndarray] = {}
    links: dict[int, dict[int, tuple[str, str, int]]] = {}  # round -> rank -> its link to the victim

    def rank_main(proc: RankProcess) -> tuple[np.ndarray, np.ndarray, int]:
        me = proc.rank
        mem = dsm.attach(proc.rt, protocol)
        memories[me] = mem
        pages, marks, count = (mem.array(SIZE * WORDS, np.int64) for _ in range(3))
        locks = [mem.lock() for _ in range(SIZE)]
        pages[me * WORDS : (me + 1) * WORDS] = me + 1  # first touch: rank r is the home of page r of each
        marks[me * WORDS] = 0
        count[me * WORDS] = 0
        mem.barrier()
        for k, victim in enumerate(victims):
            if me == victim:
                pages[me * WORDS : (me + 1) * WORDS] = 10 * (k + 1) + me
            mem.barrier()
            if me == victim:
                mem, pages, marks, count, locks = _die_and_come_back(
                    job, proc, memories, k, (pages, marks, count, locks)
                )
                links[k] = {
                    r: (m.client.state[victim], m.server.state[victim], m.client.link[victim])
                    for r, m in memories.items()
                }
            else:
                imaged.wait()
                if not in_flight:
                    dead[k].wait()
                if me == (victim + 1) % SIZE:
                    fetched[k] = pages[victim * WORDS : (victim + 1) * WORDS]  # its home is dead: waits
                else:
                    with locks[victim]:  # the lock's home is dead: waits too
                        marks[me * WORDS + 1 + k] = 1
                mem = memories[me]
            mem.barrier()
            with locks[victim]:  # served by the new incarnation
                count[0] += 1
            mem.barrier()
        return np.asarray(pages[...]), np.asarray(marks[...]), int(count[0])

    def _landed(rank: int, victim: int, k: int) -> bool:
        """Has `rank`'s work of round `k` reached `victim` (a request its HCA acknowledged, or READs done)?"""
        if protocol == "onesided" and rank == (victim + 1) % SIZE:
            return k in fetched  # one-sided READs need no handler: they completed
        client = memories[rank].client
        sent = [dst == victim and link == client.link[victim] for dst, _, link in list(memories[rank].pending.values())]
        return any(sent) and len(client.free[victim]) == client.nsend

    def _die_and_come_back(
        job: RecoveryJob, proc: RankProcess, memories: dict[int, dsm.Memory], k: int, state: Any
    ) -> Any:
        mem = memories[proc.rank]
        mem._halt()  # quiesced, as at a checkpoint: nothing of the image changes while it is pickled
        image = proc.snapshot((mem, *state))
        survivors = [other for other in job.ranks if other is not proc]
        if in_flight:  # the handler stays stopped: the survivors' requests land here and are never answered
            imaged.wait()
            for other in survivors:
                wait_for(lambda other=other: _landed(other.rank, proc.rank, k), FAILS_WITHIN, "a request in flight")
        else:
            mem._start()
            imaged.wait()
            mem._halt()
        proc.kill()  # kill -9: the handler stops serving (above) and every verbs resource vanishes
        dead[k].set()
        for other in survivors if not in_flight else []:  # their pending work found the link dead by itself
            link = memories[other.rank].client

            def failed(link: Any = link) -> bool:
                return bool(link.state[proc.rank] == FAILED)

            wait_for(failed, FAILS_WITHIN, f"rank {other.rank}'s link to rank {proc.rank} to fail")
        for other in survivors:
            other.call("ckpt_rank_failed", rank=proc.rank, incarnation=proc.incarnation)
        mem, *restored = proc.respawn(image)  # RESTART of the next incarnation
        memories[proc.rank] = mem
        incarnation = proc.incarnation

        def recovered(other: RankProcess) -> Any:
            return lambda: other.call("ckpt_rank_recovered", rank=proc.rank, incarnation=incarnation)

        # the new rank in REFRESH while the survivors hear it is back: neither waits for the other
        concurrently(lambda: proc.call("ckpt_refresh"), *(recovered(other) for other in survivors))
        proc.call("ckpt_resume", restarted=True, aborted=False, independent=False)
        return (mem, *restored)

    results = job.run([rank_main] * SIZE)

    rounds = len(victims)
    expected_pages = np.repeat([_value(victims, p, rounds) for p in range(SIZE)], WORDS)
    expected_marks = np.zeros(SIZE * WORDS, dtype=np.int64)
    for k, victim in enumerate(victims):
        expected_marks[(victim + 2) % SIZE * WORDS + 1 + k] = 1
        assert np.array_equal(fetched[k], np.full(WORDS, _value(victims, victim, k + 1)))
        so_far = victims[: k + 1]
        # a link is replaced when either end is recovered (a recovered rank replaces all of its links)
        replaced = {r: so_far.count(victim) + (so_far.count(r) if r != victim else 0) for r in range(SIZE)}
        assert links[k] == {r: (UP, UP, replaced[r]) for r in range(SIZE)}
    for pages, marks, count in results:
        assert np.array_equal(pages, expected_pages)
        assert np.array_equal(marks, expected_marks)
        assert count == SIZE * rounds


@pytest.mark.parametrize("victims", [[1], [0, 2, 0]], ids=["one", "manager-and-twice"])
def test_a_rank_respawned_alone_is_reconnected_and_the_survivors_pending_work_completes(
    protocol: str, victims: list[int]
) -> None:
    _recovery_rounds(protocol, victims)


def test_requests_in_flight_when_their_home_dies_are_sent_again_to_its_next_incarnation(protocol: str) -> None:
    _recovery_rounds(protocol, [2, 0], in_flight=True)  # no traffic after the death: only the hook tells


@pytest.mark.stress
def test_many_recoveries_in_a_row(protocol: str) -> None:
    _recovery_rounds(protocol, [1, 2, 0, 1, 1, 2, 0, 0, 2, 1])


def test_a_diff_its_home_applied_before_failing_is_sent_again_to_its_next_incarnation(protocol: str) -> None:
    """Rank 0 writes page 1 and closes the interval at a barrier: rank 1 applies (acks) the diff, then fails
    before rank 0's interval has completed -- with remote logging, before its record at rank 1's log home
    is sure to be there.  Rank 1 comes back from an image without the diff; rank 0 sends it again once
    its interval has completed (`Memory._send_again`), so rank 2 reads rank 0's write from rank 1.  Without
    that, rank 1's copy never holds the interval rank 2's fetch needs, and the fetch waits for it forever."""
    job = RecoveryJob(SIZE, {"dsm_protocol": protocol})
    memories: dict[int, dsm.Memory] = {}
    job.finalizers.append(lambda: [memory.close() for memory in memories.values()])
    imaged = threading.Barrier(SIZE, timeout=60)
    closing, back = threading.Event(), threading.Event()
    victim, writer = 1, 0

    def holding(mem: dsm.Memory) -> None:
        """The writer's `dsm_interval_closed` waits until the victim has died and come back."""
        fire = mem.hook

        def hook(name: str, **kwargs: Any) -> None:
            if name == "dsm_interval_closed":
                closing.set()
                assert back.wait(60), "the victim did not come back"
            fire(name, **kwargs)

        mem.hook = hook  # type: ignore[method-assign]
        mem._fire = mem._fire | {"dsm_interval_closed"}

    def rank_main(proc: RankProcess) -> np.ndarray:
        me = proc.rank
        mem = dsm.attach(proc.rt, protocol)
        memories[me] = mem
        pages = mem.array(SIZE * WORDS, np.int64)
        pages[me * WORDS : (me + 1) * WORDS] = me + 1  # first touch: rank r is the home of page r
        mem.barrier()
        if me == victim:
            mem._halt()
            image = proc.snapshot((mem, pages))
            mem._start()
            imaged.wait()
            assert closing.wait(60), "the writer never closed its interval"
            proc.kill()
            survivors = [other for other in job.ranks if other is not proc]
            for other in survivors:
                other.call("ckpt_rank_failed", rank=me, incarnation=proc.incarnation)
            mem, pages = proc.respawn(image)
            memories[me] = mem
            incarnation = proc.incarnation
            concurrently(
                lambda: proc.call("ckpt_refresh"),
                *(lambda o=o: o.call("ckpt_rank_recovered", rank=me, incarnation=incarnation) for o in survivors),
            )
            proc.call("ckpt_resume", restarted=True, aborted=False, independent=False)
            back.set()
        else:
            imaged.wait()
            if me == writer:
                holding(mem)
                pages[victim * WORDS : (victim + 1) * WORDS] = 99
        mem.barrier()
        return np.asarray(pages[victim * WORDS : (victim + 1) * WORDS])

    results = job.run([rank_main] * SIZE, timeout=30)
    for seen in results:
        assert np.array_equal(seen, np.full(WORDS, 99))
