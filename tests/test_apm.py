"""ckpt_apm: alternate paths for every RC QP a program brings to RTS, re-armed after each migration, in one process.

The provider is ib_util's virtualized one (ckpt_ib's Virtualizer) with the APM wrapper installed on top of it,
as the plugins' CKPT_PLUGIN_ORDER stacks them in a rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ib_util import IbEnv, real_of
from verbs_util import (
    FAST_RETRY,
    FAST_TIMEOUT,
    Endpoint,
    connect_rc,
    exchange,
    paths,
    wait_event,
    wait_for,
    wait_link,
)
from verbs_util import subnet_manager as fabric_manager

from ckpt import verbs as v
from ckpt_apm import Apm

pytestmark = pytest.mark.timeout(60)


class ApmEnv(IbEnv):
    """An IbEnv whose table has APM on top of ckpt_ib."""

    def __init__(self, policy: str = "auto") -> None:
        self.apm = Apm(policy, interval=0.05)
        super().__init__()

    def _make_ops(self) -> v.VerbsOps:
        ops = super()._make_ops()
        self.apm.install(ops)
        return ops


@pytest.fixture
def env() -> Iterator[ApmEnv]:
    env = ApmEnv()
    try:
        yield env
    finally:
        env.apm.stop()
        env.kill()


def _pair(env: IbEnv) -> tuple[Endpoint, Endpoint]:
    return connect_rc(env.context(0), env.context(1), timeout=FAST_TIMEOUT, retry_cnt=FAST_RETRY)


def _armed(ep: Endpoint) -> None:
    wait_for(lambda: paths(ep)[2] == v.IBV_MIG_ARMED, what="the alternate path to be ARMED")


def _real_lid(env: IbEnv, ep: Endpoint, port: int) -> int:
    return int(env.vz.inner.query_port(real_of(ep.ctx), port).lid)


def test_every_rc_qp_brought_to_rts_gets_the_other_port_pair_armed(env: ApmEnv) -> None:
    a, b = _pair(env)
    _armed(a)
    _armed(b)
    assert paths(a) == ((1, b.lid), (2, b.lid2), v.IBV_MIG_ARMED)
    assert paths(b) == ((1, a.lid), (2, a.lid2), v.IBV_MIG_ARMED)
    stats = env.apm.stats
    assert (stats.qps, stats.rearms, stats.failed_rearms, stats.supported) == (2, 2, 0, True)
    exchange(a, b, 1)
    assert env.apm.ops.poll_cq is env.apm.inner.poll_cq  # no migration pending: polls do not pass through APM


def test_a_qp_whose_program_drives_apm_itself_is_left_alone(env: ApmEnv) -> None:
    a, b = _pair(env)
    _armed(a)
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS, path_mig_state=v.IBV_MIG_MIGRATED)
    a.qp.modify(attr, v.IBV_QP_PATH_MIG_STATE)  # the program migrates it by hand: from now on it is the program's
    wait_event(a.ctx, v.IBV_EVENT_PATH_MIG, a.qp)
    assert env.apm.stats.qps == 1 and env.apm.stats.migrations_manual == 0
    assert paths(a)[2] == v.IBV_MIG_MIGRATED  # not re-armed behind the program's back
    exchange(a, b, 2)


def test_a_refused_apm_modify_leaves_the_qp_managed(env: ApmEnv) -> None:
    a, _ = _pair(env)
    _armed(a)
    qps = env.apm.stats.qps
    attr = v.QPAttr(qp_state=v.IBV_QPS_RTS, path_mig_state=v.IBV_MIG_ARMED)  # only the HCA sets ARMED
    with pytest.raises(v.PyverbsRDMAError):
        a.qp.modify(attr, v.IBV_QP_PATH_MIG_STATE)
    assert env.apm.stats.qps == qps  # still managed: the modify changed nothing


def test_two_link_failures_in_a_row_are_survived_and_the_program_still_sees_every_event(env: ApmEnv) -> None:
    """a's port 1 fails: a migrates to port 2, b (ARMED) with it, and both are re-armed on a path that avoids
    the failed link (sharing one end: the fully disjoint pair runs through it).  Then b's port 2 fails: both
    migrate again.  Traffic never stops; each PATH_MIG also reaches the program."""
    sm = fabric_manager()
    a, b = _pair(env)
    _armed(a)
    _armed(b)
    exchange(a, b, 1)
    first, second = _real_lid(env, a, 1), _real_lid(env, b, 2)
    try:
        sm.fail_link(first)
        wait_link(first, up=False)
        exchange(a, b, 2)
        wait_for(lambda: env.apm.stats.migrations_automatic >= 2, what="both QPs to migrate")
        _armed(a)
        _armed(b)
        assert paths(a) == ((2, b.lid2), (2, b.lid), v.IBV_MIG_ARMED)  # alternate: to b's port 1, from port 2
        assert paths(b) == ((2, a.lid2), (1, a.lid2), v.IBV_MIG_ARMED)  # alternate: from b's port 1, to a's 2
        wait_event(a.ctx, v.IBV_EVENT_PATH_MIG, a.qp)  # handed on to the program
        sm.fail_link(second)
        wait_link(second, up=False)
        exchange(a, b, 3)
        wait_for(lambda: env.apm.stats.migrations_automatic >= 4, what="both QPs to migrate again")
        assert paths(a)[0] == (2, b.lid) and paths(b)[0] == (1, a.lid2)
        exchange(b, a, 4)
    finally:
        for lid in (first, second):
            sm.restore_link(lid)
            wait_link(lid, up=True)
    stats = env.apm.stats
    assert stats.port_faults >= 2 and stats.migration_errors == 0 and len(stats.fault_to_migration) >= 2
    assert all(0 < t < 30 for t in stats.fault_to_migration)
    # the exchanges after each migration polled completions on both QPs: each fault's first one is timed
    assert len(stats.fault_to_completion) >= 2 and all(0 < t < 30 for t in stats.fault_to_completion)


def test_a_qp_with_no_healthy_alternate_is_reported_and_armed_once_a_port_comes_back(env: ApmEnv) -> None:
    """Both HCAs' port 2 down: every path but the primary (port 1 to port 1) runs through one of them."""
    sm = fabric_manager()
    a, b = _pair(env)
    _armed(a)
    failed = [_real_lid(env, a, 2), _real_lid(env, b, 2)]
    try:
        for lid in failed:
            sm.fail_link(lid)
            wait_link(lid, up=False)
        c, d = _pair(env)
        wait_for(lambda: env.apm.stats.no_alternate >= 2, what="the missing alternates to be counted")
        assert paths(c)[2] == paths(d)[2] == v.IBV_MIG_MIGRATED
    finally:
        for lid in failed:
            sm.restore_link(lid)
            wait_link(lid, up=True)
    for ep, peer in ((c, d), (d, c)):  # armed on a PORT_ACTIVE, on whichever path was healthy then
        _armed(ep)
        primary, alternate, _ = paths(ep)
        assert primary == (1, peer.lid) and alternate in ((2, peer.lid2), (2, peer.lid), (1, peer.lid2))
    exchange(c, d, 5)


def test_a_paused_apm_touches_no_qp_until_it_resumes(env: ApmEnv) -> None:
    """From DRAIN to RESUME the event thread holds off: a migration's re-arm waits for the resume."""
    a, _ = _pair(env)
    _armed(a)
    env.apm.pause()
    try:
        assert env.apm.lock.locked() and env.apm.paused
        # a migration the program did not ask for (the program itself is parked at a checkpoint)
        migrate = v.QPAttr(qp_state=v.IBV_QPS_RTS, path_mig_state=v.IBV_MIG_MIGRATED)
        env.apm.inner.modify_qp(a.qp.handle, migrate, v.IBV_QP_PATH_MIG_STATE)
        with pytest.raises(AssertionError):
            wait_for(lambda: env.apm.stats.rearms > 2, timeout=0.3, what="a re-arm while paused")
    finally:
        env.apm.resume()
    assert not env.apm.lock.locked()
    wait_for(lambda: env.apm.stats.rearms > 2, what="the re-arm after the resume")
    _armed(a)


def test_balance_moves_armed_qps_between_healthy_paths() -> None:
    env = ApmEnv("balance")
    try:
        a, b = _pair(env)
        wait_for(lambda: env.apm.stats.migrations_manual >= 2, what="two balancing migrations")
        exchange(a, b, 6)
        assert env.apm.stats.migration_errors == 0 and env.apm.stats.port_faults == 0
    finally:
        env.apm.stop()
        env.kill()


def test_without_a_subnet_manager_apm_says_once_that_it_is_a_no_op(
    env: ApmEnv, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A transport with no path records (tcp: no subnet manager) gets no alternate path, and one line says so."""
    env.context(0)  # builds the table: the wrapper's inner entries exist from here on
    monkeypatch.setattr(env.apm.inner, "query_paths", lambda device, dlid: [])
    with caplog.at_level("WARNING", logger="ckpt_apm"):
        a, b = _pair(env)
        _pair(env)  # a second pair: still one line
    assert [r.getMessage() for r in caplog.records] == [
        "APM is a no-op here: the transport has no subnet manager to give alternate paths"
    ]
    stats = env.apm.stats
    assert (stats.supported, stats.rearms, stats.no_alternate) == (False, 0, 0)
    assert paths(a)[2] == v.IBV_MIG_MIGRATED
    exchange(a, b, 7)
