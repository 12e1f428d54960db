"""A shared counter on rank 0 bumped with ATOMIC_FETCH_AND_ADD by every rank, and RDMA READs of a neighbour's table.

    ckpt launch -n 4 tests/programs/ib_atomics.py [STEPS] [inflight]

Every step each rank posts FAA_PER_STEP fetch-and-adds of INC on rank 0's
counter (mostly unsignaled, every SIGNAL_EVERY-th signaled) and READS_PER_STEP
RDMA READs of slices of its right neighbour's table, then waits for them (RC
completes in order, so the batch's last signaled WR on each QP retires it).  At
the end every rank reads the counter, and the fetched values of all ranks are
gathered: they must be exactly 0, INC, 2*INC, ... (each add executed once).

With `inflight`, a step's batch is waited for only in the next step, so at every
step boundary up to two batches of READs and atomics are outstanding (more than
max_rd_atomic: some wait on the send queue); the job runs one step more.

Result of every rank: "counter=<ranks*steps*FAA_PER_STEP*INC> fetched=ok reads=<checksum>".
"""

from __future__ import annotations

import numpy as np
from ib_common import ACCESS, Deadline, connect_links, held, pausable, poll

import ckpt
from ckpt import verbs

INC = 3
FAA_PER_STEP = 16
READS_PER_STEP = 4
SIGNAL_EVERY = 8
TABLE = 512  # int64 entries in each rank's table
CHUNK = 8  # entries per READ
RD_ATOMIC = 16
MODULUS = (1 << 61) - 1


def table_of(rank: int) -> np.ndarray:
    return (rank + 1) * 1_000_003 + np.arange(TABLE, dtype=np.int64) * 7919


def read_offset(step: int, k: int) -> int:
    return (step * READS_PER_STEP + k) * 13 % (TABLE - CHUNK)


class Atomics(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.steps = int(rt.argv[0]) if rt.argv else 300
        self.lag = 1 if "inflight" in rt.argv[1:] else 0
        self.ctx = verbs.Context(name=rt.device)
        self.pd = verbs.PD(self.ctx)
        self.cq = verbs.CQ(self.ctx, 1024)
        self.counter = np.zeros(1, dtype=np.uint64)  # used on rank 0 only
        self.table = table_of(rt.rank)
        # two batches' landing zones (a batch may be outstanding while the next is posted), and the final counter read
        self.fetched = np.zeros((2, FAA_PER_STEP), dtype=np.uint64)
        self.reads = np.zeros((2, READS_PER_STEP, CHUNK), dtype=np.int64)
        self.final = np.zeros(1, dtype=np.uint64)
        self.counter_mr = verbs.MR(self.pd, self.counter, ACCESS)
        self.table_mr = verbs.MR(self.pd, self.table, ACCESS)
        self.fetched_mr = verbs.MR(self.pd, self.fetched, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.reads_mr = verbs.MR(self.pd, self.reads, verbs.IBV_ACCESS_LOCAL_WRITE)
        self.final_mr = verbs.MR(self.pd, self.final, verbs.IBV_ACCESS_LOCAL_WRITE)
        right, left = (rt.rank + 1) % rt.size, (rt.rank - 1) % rt.size
        links = {(0, "counter"), (right, "table"), (left, "table")}
        if rt.rank == 0:
            links |= {(r, "counter") for r in range(rt.size)}
        publish = {
            "counter": (self.counter_mr.rkey, self.counter_mr.buf),
            "table": (self.table_mr.rkey, self.table_mr.buf),
        }
        qps, everyone = connect_links(
            rt, self.ctx, self.pd, self.cq, links, send_wr=128, rd_atomic=RD_ATOMIC, publish=publish
        )
        self.counter_qp, self.table_qp = qps[(0, "counter")], qps[(right, "table")]
        self.remote_counter = everyone[0]["counter"]
        self.remote_table = everyone[right]["table"]
        self.posted = 0  # WRs posted, as wr_ids
        self.done: set[int] = set()  # wr_ids of signaled WRs completed but not yet waited for
        self.seen: list[int] = []  # every fetched value of this rank
        self.read_checksum = 0
        self.outcome = ""
        self.i = 0

    @held
    @pausable
    def step(self, rt: ckpt.Runtime) -> bool:
        last = self.steps + self.lag
        if self.i < self.steps:
            self._post_batch(self.i)
        if self.i >= self.lag:
            self._collect(self.i - self.lag)
        self.i += 1
        rt.barrier()  # every add of this step has landed on rank 0 before anyone reads the final counter
        if self.i < last:
            return True
        everyone = rt.allgather(self.seen)
        wanted = self._post(self.counter_qp, verbs.IBV_WR_RDMA_READ, self.final_mr, 0, 8, self.remote_counter, True)
        self._wait({wanted})
        fetched = sorted(v for seen in everyone for v in seen)
        ok = fetched == [INC * n for n in range(rt.size * self.steps * FAA_PER_STEP)]
        self.outcome = f"counter={int(self.final[0])} fetched={'ok' if ok else 'BAD'} reads={self.read_checksum}"
        return False

    def _post_batch(self, step: int) -> None:
        zone = step % 2
        rkey, addr = self.remote_counter
        for k in range(FAA_PER_STEP):
            signaled = k % SIGNAL_EVERY == SIGNAL_EVERY - 1
            wr = self._wr(
                verbs.IBV_WR_ATOMIC_FETCH_AND_ADD, self.fetched_mr, (zone * FAA_PER_STEP + k) * 8, 8, signaled
            )
            wr.set_wr_atomic(rkey, addr, INC, 0)
            self.counter_qp.post_send(wr)
        rkey, addr = self.remote_table
        for k in range(READS_PER_STEP):
            offset = (zone * READS_PER_STEP + k) * CHUNK * 8
            remote = addr + read_offset(step, k) * 8
            signaled = k == READS_PER_STEP - 1
            self._post(
                self.table_qp, verbs.IBV_WR_RDMA_READ, self.reads_mr, offset, CHUNK * 8, (rkey, remote), signaled
            )

    def _collect(self, step: int) -> None:
        """Wait for `step`'s batch (its last FAA and last READ are signaled) and record what it fetched and read."""
        first = step * (FAA_PER_STEP + READS_PER_STEP)
        self._wait({first + FAA_PER_STEP - 1, first + FAA_PER_STEP + READS_PER_STEP - 1})
        zone = step % 2
        self.seen.extend(int(v) for v in self.fetched[zone])
        for k in range(READS_PER_STEP):
            self.read_checksum = (self.read_checksum * 31 + int(self.reads[zone, k].sum())) % MODULUS

    def _wr(self, opcode: int, mr: verbs.MR, offset: int, length: int, signaled: bool) -> verbs.SendWR:
        wr = verbs.SendWR(
            wr_id=self.posted,
            opcode=opcode,
            num_sge=1,
            sg=[verbs.SGE(mr.buf + offset, length, mr.lkey)],
            send_flags=verbs.IBV_SEND_SIGNALED if signaled else 0,
        )
        self.posted += 1
        return wr

    def _post(
        self,
        qp: verbs.QP,
        opcode: int,
        mr: verbs.MR,
        offset: int,
        length: int,
        remote: tuple[int, int],
        signaled: bool,
    ) -> int:
        wr = self._wr(opcode, mr, offset, length, signaled)
        wr.set_wr_rdma(*remote)
        qp.post_send(wr)
        return wr.wr_id

    def _wait(self, wr_ids: set[int]) -> None:
        deadline = Deadline(f"work requests {sorted(wr_ids)}")
        while not wr_ids <= self.done:
            wcs = poll(self.cq)
            self.done.update(wc.wr_id for wc in wcs)
            if wcs:
                deadline.progress()
            deadline.check()
        self.done -= wr_ids

    def result(self) -> str:
        return self.outcome
