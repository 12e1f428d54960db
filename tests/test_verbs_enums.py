"""The verbs enums carry libibverbs' names and values, as classes and as module-level aliases."""

from __future__ import annotations

import enum

import pytest

from ckpt.verbs import _enums
from ckpt.verbs._enums import (
    ENUMS,
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_QP_STATE,
    IBV_QPS_RTS,
    IBV_SEND_INLINE,
    IBV_SEND_SIGNALED,
    IBV_WC_RECV,
    IBV_WC_RECV_RDMA_WITH_IMM,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SEND,
    ibv_access_flags,
    ibv_qp_attr_mask,
    ibv_qp_state,
    ibv_send_flags,
    ibv_wc_opcode,
    ibv_wc_status,
)

# (class name, member name, value in libibverbs/verbs.h)
VERBS_H = [
    ("ibv_qp_state", "IBV_QPS_RESET", 0),
    ("ibv_qp_state", "IBV_QPS_RTS", 3),
    ("ibv_qp_state", "IBV_QPS_SQD", 4),
    ("ibv_qp_state", "IBV_QPS_ERR", 6),
    ("ibv_qp_type", "IBV_QPT_RC", 2),
    ("ibv_qp_type", "IBV_QPT_UC", 3),
    ("ibv_qp_type", "IBV_QPT_UD", 4),
    ("ibv_qp_type", "IBV_QPT_RAW_PACKET", 8),
    ("ibv_qp_type", "IBV_QPT_XRC_RECV", 10),
    ("ibv_wc_status", "IBV_WC_SUCCESS", 0),
    ("ibv_wc_status", "IBV_WC_LOC_LEN_ERR", 1),
    ("ibv_wc_status", "IBV_WC_LOC_PROT_ERR", 4),
    ("ibv_wc_status", "IBV_WC_WR_FLUSH_ERR", 5),
    ("ibv_wc_status", "IBV_WC_REM_INV_REQ_ERR", 9),
    ("ibv_wc_status", "IBV_WC_REM_ACCESS_ERR", 10),
    ("ibv_wc_status", "IBV_WC_RETRY_EXC_ERR", 12),
    ("ibv_wc_status", "IBV_WC_RNR_RETRY_EXC_ERR", 13),
    ("ibv_wc_status", "IBV_WC_GENERAL_ERR", 21),
    ("ibv_wc_status", "IBV_WC_TM_ERR", 22),
    ("ibv_wc_status", "IBV_WC_TM_RNDV_INCOMPLETE", 23),
    ("ibv_wc_opcode", "IBV_WC_SEND", 0),
    ("ibv_wc_opcode", "IBV_WC_RDMA_READ", 2),
    ("ibv_wc_opcode", "IBV_WC_FETCH_ADD", 4),
    ("ibv_wc_opcode", "IBV_WC_RECV", 128),
    ("ibv_wc_opcode", "IBV_WC_RECV_RDMA_WITH_IMM", 129),
    ("ibv_wc_flags", "IBV_WC_WITH_IMM", 2),
    ("ibv_wr_opcode", "IBV_WR_RDMA_WRITE", 0),
    ("ibv_wr_opcode", "IBV_WR_SEND", 2),
    ("ibv_wr_opcode", "IBV_WR_RDMA_READ", 4),
    ("ibv_wr_opcode", "IBV_WR_ATOMIC_CMP_AND_SWP", 5),
    ("ibv_wr_opcode", "IBV_WR_ATOMIC_FETCH_AND_ADD", 6),
    ("ibv_send_flags", "IBV_SEND_FENCE", 1),
    ("ibv_send_flags", "IBV_SEND_SIGNALED", 2),
    ("ibv_send_flags", "IBV_SEND_INLINE", 8),
    ("ibv_access_flags", "IBV_ACCESS_LOCAL_WRITE", 1),
    ("ibv_access_flags", "IBV_ACCESS_REMOTE_ATOMIC", 8),
    ("ibv_access_flags", "IBV_ACCESS_RELAXED_ORDERING", 1 << 20),
    ("ibv_qp_attr_mask", "IBV_QP_STATE", 1),
    ("ibv_qp_attr_mask", "IBV_QP_AV", 1 << 7),
    ("ibv_qp_attr_mask", "IBV_QP_DEST_QPN", 1 << 20),
    ("ibv_qp_attr_mask", "IBV_QP_RATE_LIMIT", 1 << 25),
    ("ibv_mig_state", "IBV_MIG_ARMED", 2),
    ("ibv_event_type", "IBV_EVENT_QP_FATAL", 1),
    ("ibv_event_type", "IBV_EVENT_PORT_ACTIVE", 9),
    ("ibv_event_type", "IBV_EVENT_SRQ_LIMIT_REACHED", 15),
    ("ibv_port_state", "IBV_PORT_ACTIVE", 4),
    ("ibv_mtu", "IBV_MTU_256", 1),
    ("ibv_mtu", "IBV_MTU_4096", 5),
    ("ibv_srq_attr_mask", "IBV_SRQ_LIMIT", 2),
    ("ibv_atomic_cap", "IBV_ATOMIC_HCA", 1),
    ("ibv_node_type", "IBV_NODE_UNKNOWN", -1),
    ("ibv_node_type", "IBV_NODE_CA", 1),
    ("ibv_transport_type", "IBV_TRANSPORT_IB", 0),
    ("ibv_device_cap_flags", "IBV_DEVICE_RC_RNR_NAK_GEN", 1 << 12),
    ("ibv_rate", "IBV_RATE_10_GBPS", 3),
    ("ibv_rate", "IBV_RATE_100_GBPS", 16),
]


@pytest.mark.parametrize(("cls_name", "member", "value"), VERBS_H)
def test_values_equal_verbs_h_in_both_access_styles(cls_name: str, member: str, value: int) -> None:
    cls = getattr(_enums, cls_name)
    assert int(getattr(cls, member)) == value
    assert getattr(_enums, member) is getattr(cls, member)
    assert getattr(_enums, member) == value


def test_every_member_has_a_module_alias_and_is_exported() -> None:
    for cls in ENUMS:
        assert cls.__name__ in _enums.__all__
        for name, member in cls.__members__.items():
            assert getattr(_enums, name) is member, name
            assert name in _enums.__all__


def test_member_names_are_unique_across_enums() -> None:
    names = [name for cls in ENUMS for name in cls.__members__]
    assert len(names) == len(set(names))


def test_wc_status_has_all_24_values_in_order() -> None:
    assert [int(s) for s in ibv_wc_status] == list(range(24))
    assert ibv_wc_status(10) is IBV_WC_REM_ACCESS_ERR
    assert IBV_WC_REM_ACCESS_ERR.name == "IBV_WC_REM_ACCESS_ERR"


def test_flags_combine_and_stay_ints() -> None:
    access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
    assert access == 7
    assert isinstance(access, ibv_access_flags) and isinstance(access, int)
    assert access & IBV_ACCESS_REMOTE_READ
    assert not access & IBV_ACCESS_REMOTE_ATOMIC
    assert ibv_access_flags(15) == access | IBV_ACCESS_REMOTE_ATOMIC
    assert IBV_SEND_SIGNALED | IBV_SEND_INLINE == 10
    assert isinstance(IBV_SEND_SIGNALED | IBV_SEND_INLINE, ibv_send_flags)
    mask = IBV_QP_STATE | ibv_qp_attr_mask.IBV_QP_PKEY_INDEX | ibv_qp_attr_mask.IBV_QP_PORT
    assert mask == 0b110001


def test_receive_opcodes_have_bit_7() -> None:
    assert IBV_WC_RECV_RDMA_WITH_IMM & IBV_WC_RECV
    assert not IBV_WC_SEND & IBV_WC_RECV
    assert all(op & IBV_WC_RECV for op in ibv_wc_opcode if op >= IBV_WC_RECV)


def test_flag_sets_are_intflag_and_the_rest_intenum() -> None:
    flags = {"ibv_access_flags", "ibv_send_flags", "ibv_wc_flags", "ibv_qp_attr_mask", "ibv_srq_attr_mask"}
    flags.add("ibv_device_cap_flags")
    for cls in ENUMS:
        expected = enum.IntFlag if cls.__name__ in flags else enum.IntEnum
        assert issubclass(cls, expected), cls.__name__
    assert ibv_qp_state.IBV_QPS_RTS is IBV_QPS_RTS
