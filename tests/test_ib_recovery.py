"""ckpt_ib under single-rank recovery: links to other ranks left in ERROR, peers look the recovered IDs up again."""

# Two "processes" of one job, each an IbEnv (its own provider and Virtualizer)
# on one shared KV: rank 0 opens HCA index 0, rank 1 index 1, with disjoint
# virtual IDs.  Rank 0 dies and is respawned alone (rt.recovered, incarnation
# 1) from an image of its objects, on another HCA (new real qp_nums, keys and
# LIDs), through the plugin's own hooks (`IbPlugin`); rank 1 runs on.

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest
from ib_util import VIRTUAL_BASE, IbEnv, real_of
from verbs_util import (
    Endpoint,
    bring_up,
    connect_self,
    make_endpoint,
    poll_one,
    poll_until,
    post_recv,
    rdma_wr,
    send_wr,
)

import ckpt_ib
from ckpt import verbs as v
from ckpt.plugin import ImageContents
from ckpt.testing import FakeRuntime
from ckpt_ib import IbPlugin
from ckpt_ib._recovery import forget_remote

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def job() -> Iterator[tuple[IbEnv, IbEnv]]:
    a, b = IbEnv(), IbEnv()
    b.rt = FakeRuntime(first_id=VIRTUAL_BASE + 0x2000)  # virtual IDs of its own, still 16-bit LIDs
    b.rt.rank, b.rt.kv = 1, a.rt.kv
    b.vz.rt = b.rt
    try:
        yield a, b
    finally:
        a.kill()
        b.kill()


def _plugin(env: IbEnv) -> IbPlugin:
    plugin = IbPlugin()
    plugin.vz = env.vz
    return plugin


def _connect(a_ctx: v.Context, b_ctx: v.Context, a_pd: v.PD | None = None) -> tuple[Endpoint, Endpoint]:
    x, y = make_endpoint(a_ctx, pd=a_pd), make_endpoint(b_ctx)
    bring_up(x.qp, y.qp.qp_num, y.lid)
    bring_up(y.qp, x.qp.qp_num, x.lid)
    return x, y


def _recover(env: IbEnv, state: Any) -> Any:
    """Rank `env` dies and its next incarnation restarts alone from an image of `state` (no drain: it died)."""
    blob = env.image(state)
    env.kill()
    env.hca_generation += 1
    env.rt.restarted, env.rt.recovered, env.rt.incarnation = True, True, 1
    registry, state, env.contexts = cloudpickle.loads(blob)
    plugin = _plugin(env)
    plugin.ckpt_restart(env.rt, ImageContents({"ib": registry}))
    plugin.ckpt_refresh(env.rt)
    plugin.ckpt_resume(env.rt, restarted=True, aborted=False)
    return state


def test_the_recovered_rank_leaves_links_to_other_ranks_in_error_and_sees_their_work_flushed(
    job: tuple[IbEnv, IbEnv],
) -> None:
    a, b = job
    x, _ = _connect(a.context(0), b.context(1))
    post_recv(x, offset=0, length=64, wr_id=41)
    post_recv(x, offset=64, length=64, wr_id=42)
    x.buf[512:516] = [1, 2, 3, 4]
    x.qp.post_send(send_wr([x.sge(512, 4)], wr_id=7))  # y has no receive: RNR, still in the log
    own = connect_self(a.contexts[0])

    x, own = _recover(a, (x, own))

    assert x.qp.qp_state == v.IBV_QPS_ERR
    assert [int(mask) & v.IBV_QP_DEST_QPN for _, mask in x.qp.handle.modifies] == [0, 0]  # INIT, then ERR
    flushed = {wc.wr_id: wc for wc in poll_until(x.cq, 3)}
    assert sorted(flushed) == [7, 41, 42]
    assert {wc.status for wc in flushed.values()} == {v.IBV_WC_WR_FLUSH_ERR}
    assert {wc.qp_num for wc in flushed.values()} == {x.qp.qp_num}  # the program's virtual qp_num
    # a connection within the rank is rebuilt as in any restart
    assert own.qp.qp_state == v.IBV_QPS_RTS
    post_recv(own, offset=0, length=64, wr_id=5)
    own.buf[1024:1027] = [7, 8, 9]
    own.qp.post_send(send_wr([own.sge(1024, 3)], wr_id=6))
    assert sorted(wc.wr_id for wc in poll_until(own.cq, 2) if wc.status == v.IBV_WC_SUCCESS) == [5, 6]
    assert list(own.buf[0:3]) == [7, 8, 9]


def test_the_recovered_rank_publishes_which_ids_its_peers_must_look_up_again(job: tuple[IbEnv, IbEnv]) -> None:
    a, b = job
    x, _ = _connect(a.context(0), b.context(1))
    vlids = [x.lid, x.lid2]
    x = _recover(a, x)
    ids = a.rt.kv.get("ib", "rank/0/1")
    assert x.qp.qp_num in ids["qpn"] and x.mr.rkey in ids["rkey"] and vlids == ids["lid"]
    assert a.rt.kv.get("ib", f"qpn/{x.qp.qp_num}") == real_of(x.qp).qp_num  # overwritten in the same generation


def test_a_survivor_drops_its_cached_translations_at_ckpt_rank_recovered_and_reaches_the_new_incarnation(
    job: tuple[IbEnv, IbEnv],
) -> None:
    a, b = job
    x, y = _connect(a.context(0), b.context(1))
    x.buf[4096:4100] = [9, 8, 7, 6]
    y.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, y.sge(0, 4), x.mr.rkey, x.addr(4096), wr_id=1))
    assert poll_one(y.cq).status == v.IBV_WC_SUCCESS  # rank 1 has rank 0's LID and rkey cached now
    stale_lid, stale_key = b.vz.remote_lid[x.lid], b.vz.remote_key[x.mr.rkey]

    x = _recover(a, x)
    assert b.vz.remote_lid[x.lid] == stale_lid  # nothing told rank 1 yet
    _plugin(b).ckpt_rank_recovered(b.rt, rank=0, incarnation=1)
    assert x.lid not in b.vz.remote_lid and x.mr.rkey not in b.vz.remote_key

    # the survivor replaces its link (its owner's job) and reaches the new incarnation
    x2, y2 = _connect(x.ctx, y.ctx, x.pd)
    assert b.vz.remote_lid[x.lid] != stale_lid
    x2.buf[4096:4100] = [1, 2, 3, 4]
    y2.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, y2.sge(0, 4), x2.mr.rkey, x2.addr(4096), wr_id=2))
    assert poll_one(y2.cq).status == v.IBV_WC_SUCCESS
    assert list(y2.buf[0:4]) == [1, 2, 3, 4]
    y2.qp.post_send(rdma_wr(v.IBV_WR_RDMA_READ, y2.sge(8, 4), x.mr.rkey, x.addr(4096), wr_id=3))  # the old region
    assert poll_one(y2.cq).status == v.IBV_WC_SUCCESS
    assert list(y2.buf[8:12]) == [9, 8, 7, 6]
    assert b.vz.remote_key[x.mr.rkey] != stale_key


def test_a_look_up_that_races_with_a_drop_is_used_but_not_cached(job: tuple[IbEnv, IbEnv]) -> None:
    a, _ = job
    a.rt.kv.publish("ib", "lid/60000", 17)
    real_get = a.rt.kv.get

    def get_while_a_peer_recovers(ns: str, key: str, default: Any = None) -> Any:
        value = real_get(ns, key, default)
        forget_remote(a.vz, None)  # ckpt_rank_recovered ran between the read and the caching
        return value

    a.rt.kv.get = get_while_a_peer_recovers  # type: ignore[method-assign]
    assert a.vz.real_lid(60000) == 17
    assert 60000 not in a.vz.remote_lid
    a.rt.kv.get = real_get  # type: ignore[method-assign]
    assert a.vz.real_lid(60000) == 17
    assert a.vz.remote_lid[60000] == 17


def test_launching_under_on_failure_recover_is_refused_unless_another_plugin_answers_for_it() -> None:
    answer = ckpt_ib.ckpt_single_rank_recovery(job=None)  # the launcher prefixes "--on-failure recover: ..."
    assert isinstance(answer, str) and "--disable-plugin ib" in answer and "\n" not in answer
