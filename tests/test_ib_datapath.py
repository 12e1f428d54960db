"""ckpt_ib._datapath: work requests posted under the plugin's IDs and addresses, the send log, completions
translated back and hidden ones dropped."""

from __future__ import annotations

import numpy as np
import pytest
from ib_util import IbEnv, real_of
from verbs_util import (
    assert_no_completion,
    atomic_wr,
    poll_one,
    poll_until,
    post_recv,
    rdma_wr,
    send_wr,
)

from ckpt import verbs as v

pytestmark = pytest.mark.timeout(30)


def test_send_completions_carry_the_programs_ids(ib: IbEnv) -> None:
    a, b = ib.pair()
    post_recv(b, offset=128, length=64, wr_id=0xB0B)
    a.buf[:5] = list(b"hello")
    a.qp.post_send(send_wr([a.sge(0, 5)], wr_id=0xA11CE))
    sent = poll_one(a.scq)
    assert (sent.status, sent.wr_id, sent.qp_num) == (v.IBV_WC_SUCCESS, 0xA11CE, a.qp.qp_num)
    got = poll_one(b.rcq)
    assert (got.status, got.wr_id, got.byte_len) == (v.IBV_WC_SUCCESS, 0xB0B, 5)
    assert (got.qp_num, got.src_qp, got.slid) == (b.qp.qp_num, a.qp.qp_num, a.lid)
    assert bytes(b.buf[128:133]) == b"hello"
    assert not a.qp.handle.sends and not b.qp.handle.recvs  # both logs emptied by the polls


def test_rdma_write_and_read_use_virtual_rkeys_and_addresses(ib: IbEnv) -> None:
    a, b = ib.pair()
    a.buf[:8] = list(range(1, 9))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(256), wr_id=1))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert list(b.buf[256:264]) == list(range(1, 9))
    b.buf[512:516] = [7, 7, 7, 7]
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(64, 4), b.mr.rkey, b.addr(512), wr_id=2))
    wc = poll_one(a.scq)
    assert (wc.status, wc.wr_id) == (v.IBV_WC_SUCCESS, 2)
    assert list(a.buf[64:68]) == [7, 7, 7, 7]


def test_rdma_write_with_imm_completes_at_the_responder_with_virtual_ids(ib: IbEnv) -> None:
    a, b = ib.pair()
    post_recv(b, length=0, wr_id=44)
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE_WITH_IMM, a.sge(0, 8), b.mr.rkey, b.addr(8), wr_id=4, imm=0x1234))
    assert poll_one(a.scq).wr_id == 4
    wc = poll_one(b.rcq)
    assert (wc.opcode, wc.wr_id, wc.imm_data) == (v.IBV_WC_RECV_RDMA_WITH_IMM, 44, 0x1234)
    assert (wc.qp_num, wc.src_qp, wc.slid) == (b.qp.qp_num, a.qp.qp_num, a.lid)


def test_atomics_go_through_the_translation(ib: IbEnv) -> None:
    a, b = ib.pair()
    counter = b.buf[1024:1032].view(np.uint64)
    counter[0] = 40
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(0, 8), b.mr.rkey, b.addr(1024), 2, wr_id=1))
    assert poll_one(a.scq).status == v.IBV_WC_SUCCESS
    assert a.buf[0:8].view(np.uint64)[0] == 40 and counter[0] == 42
    a.qp.post_send(atomic_wr(v.IBV_WR_ATOMIC_CMP_AND_SWP, a.sge(8, 8), b.mr.rkey, b.addr(1024), 42, 99, wr_id=2))
    wc = poll_one(a.scq)
    assert (wc.status, wc.wr_id) == (v.IBV_WC_SUCCESS, 2)
    assert a.buf[8:16].view(np.uint64)[0] == 42 and counter[0] == 99


def test_unknown_lkey_gives_loc_prot_err(ib: IbEnv) -> None:
    a, b = ib.pair()
    post_recv(b)
    a.qp.post_send(send_wr([v.SGE(a.addr(0), 8, a.mr.lkey + 1000)], wr_id=1))
    wc = poll_one(a.scq)
    assert (wc.wr_id, wc.status, wc.qp_num) == (1, v.IBV_WC_LOC_PROT_ERR, a.qp.qp_num)


def test_real_lkey_is_not_accepted_as_a_virtual_one(ib: IbEnv) -> None:
    a, b = ib.pair()
    post_recv(b)
    a.qp.post_send(send_wr([v.SGE(a.addr(0), 8, real_of(a.mr).lkey)], wr_id=2))
    assert poll_one(a.scq).status == v.IBV_WC_LOC_PROT_ERR


def test_unknown_rkey_gives_rem_access_err(ib: IbEnv) -> None:
    a, b = ib.pair()
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey + 1000, b.addr(0), wr_id=9))
    wc = poll_one(a.scq)
    assert (wc.wr_id, wc.status, wc.qp_num) == (9, v.IBV_WC_REM_ACCESS_ERR, a.qp.qp_num)


def test_real_rkey_is_not_accepted_as_a_virtual_one(ib: IbEnv) -> None:
    a, b = ib.pair()
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), real_of(b.mr).rkey, b.addr(0), wr_id=9))
    assert poll_one(a.scq).status == v.IBV_WC_REM_ACCESS_ERR


def _spy_posts(ib: IbEnv) -> list[tuple[int, int, int]]:
    """(wr_id, opcode, send_flags) of every real send WR the plugin posts from now on."""
    seen: list[tuple[int, int, int]] = []
    post = ib.vz.inner.post_send

    def spy(qp: object, wr: v.SendWR | None) -> None:
        first = wr
        while wr is not None:
            seen.append((wr.wr_id, int(wr.opcode), int(wr.send_flags)))
            wr = wr.next_wr
        post(qp, first)

    ib.vz.inner.post_send = spy
    return seen


def test_real_wrs_carry_the_plugins_wr_id_and_ask_for_a_completion_only_when_needed(ib: IbEnv) -> None:
    a, b = ib.pair(endpoint_a={"sq_sig_all": 0})
    post_recv(b)
    seen = _spy_posts(ib)
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=777, flags=0))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey, b.addr(64), wr_id=778))
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, a.sge(64, 8), b.mr.rkey, b.addr(0), wr_id=779, flags=0))
    a.qp.post_send(rdma_wr(v.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(128, 8), b.mr.rkey, b.addr(128), wr_id=780, flags=0))
    signaled = [bool(flags & v.IBV_SEND_SIGNALED) for _, _, flags in seen]
    assert signaled == [False, True, True, True]  # READ and atomics always: only their completion says they landed
    assert [wr_id for wr_id, _, _ in seen] == [e.seq for e in a.qp.handle.sends]
    assert 777 not in [wr_id for wr_id, _, _ in seen]
    assert [w.wr_id for w in poll_until(a.scq, 1)] == [778]
    assert_no_completion(a.scq, 0.05)  # the READ and the atomic complete hidden
    assert not a.qp.handle.sends


def test_uc_real_wrs_are_always_signaled(ib: IbEnv) -> None:
    a, b = ib.pair(qp_type=v.IBV_QPT_UC, endpoint_a={"sq_sig_all": 0})
    post_recv(b)
    seen = _spy_posts(ib)
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=1, flags=0))
    assert seen[0][2] & v.IBV_SEND_SIGNALED  # UC has no ACKs: only the completion retires the WR
    assert_no_completion(a.scq, 0.05)
    assert not a.qp.handle.sends


def test_a_stray_completion_leaves_the_log_alone(ib: IbEnv) -> None:
    a, _b = ib.pair(endpoint_a={"sq_sig_all": 0})
    for i in range(2):
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=i, flags=0))
    first, last = a.qp.handle.sends[0].seq, a.qp.handle.sends[-1].seq
    for wr_id in (first - 1, last + 1):
        stray = v.WC(wr_id=wr_id, status=v.IBV_WC_SUCCESS, opcode=v.IBV_WC_SEND, qp_num=real_of(a.qp).qp_num)
        assert ib.vz.translate(stray) is None
    assert [e.wr_id for e in a.qp.handle.sends] == [0, 1]


def test_unsignaled_wrs_complete_silently_and_leave_the_log(ib: IbEnv) -> None:
    a, b = ib.pair(endpoint_a={"sq_sig_all": 0})
    for i in range(4):
        post_recv(b, offset=64 * i, length=64, wr_id=i)
    for i in range(3):
        a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=100 + i, flags=0))
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=103))
    assert [e.wr_id for e in a.qp.handle.sends] == [100, 101, 102, 103]
    assert [e.signaled for e in a.qp.handle.sends] == [False, False, False, True]
    wc = poll_one(a.scq)
    assert wc.wr_id == 103
    assert not a.qp.handle.sends  # the hidden completions were polled too: the log is exact
    assert [w.wr_id for w in poll_until(b.rcq, 4)] == [0, 1, 2, 3]
    assert_no_completion(a.scq, 0.05)


def test_sq_sig_all_signals_wrs_without_the_flag(ib: IbEnv) -> None:
    a, b = ib.pair(endpoint_a={"sq_sig_all": 1})
    post_recv(b)
    a.qp.post_send(send_wr([a.sge(0, 8)], wr_id=5, flags=0))
    assert poll_one(a.scq).wr_id == 5


def test_errors_of_unsignaled_wrs_are_visible(ib: IbEnv) -> None:
    a, b = ib.pair(endpoint_a={"sq_sig_all": 0})
    a.qp.post_send(rdma_wr(v.IBV_WR_RDMA_WRITE, a.sge(0, 8), b.mr.rkey + 1000, b.addr(0), wr_id=66, flags=0))
    wc = poll_one(a.scq)
    assert (wc.wr_id, wc.status, wc.qp_num) == (66, v.IBV_WC_REM_ACCESS_ERR, a.qp.qp_num)
    assert not a.qp.handle.sends


def test_a_wr_whose_num_sge_exceeds_its_list_posts_what_it_has(ib: IbEnv) -> None:
    """num_sge says 1, the list is empty: the plugin logs and posts the SGEs there are (none), as it did before the
    one-SGE path, instead of failing with an IndexError out of that path."""
    a, b = ib.pair()
    b.qp.post_recv(v.RecvWR(wr_id=9, num_sge=1, sg=[]))
    a.qp.post_send(v.SendWR(wr_id=3, opcode=v.IBV_WR_SEND, num_sge=1, sg=[], send_flags=v.IBV_SEND_SIGNALED))
    assert a.qp.handle.sends[-1].sg == [] and b.qp.handle.recvs[max(b.qp.handle.recvs)].sg == []
