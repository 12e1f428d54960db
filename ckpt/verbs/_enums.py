"""The libibverbs enums, as ``IntEnum`` / ``IntFlag`` classes with the C names and values of ``verbs.h``."""

# Values follow rdma-core's libibverbs/verbs.h. Each C enum is a class of the same
# name (pyverbs spells them so too), and every member is also a module-level
# alias, so both ``ibv_qp_state.IBV_QPS_RTS`` and ``IBV_QPS_RTS`` work. Sets of
# bits are ``IntFlag`` so that members combine with ``|`` and stay ints.

from __future__ import annotations

from enum import IntEnum, IntFlag
from typing import TYPE_CHECKING


class ibv_node_type(IntEnum):
    IBV_NODE_UNKNOWN = -1
    IBV_NODE_CA = 1
    IBV_NODE_SWITCH = 2
    IBV_NODE_ROUTER = 3
    IBV_NODE_RNIC = 4
    IBV_NODE_USNIC = 5
    IBV_NODE_USNIC_UDP = 6


class ibv_transport_type(IntEnum):
    IBV_TRANSPORT_UNKNOWN = -1
    IBV_TRANSPORT_IB = 0
    IBV_TRANSPORT_IWARP = 1
    IBV_TRANSPORT_USNIC = 2
    IBV_TRANSPORT_USNIC_UDP = 3


class ibv_device_cap_flags(IntFlag):
    IBV_DEVICE_RESIZE_MAX_WR = 1 << 0
    IBV_DEVICE_BAD_PKEY_CNTR = 1 << 1
    IBV_DEVICE_BAD_QKEY_CNTR = 1 << 2
    IBV_DEVICE_RAW_MULTI = 1 << 3
    IBV_DEVICE_AUTO_PATH_MIG = 1 << 4
    IBV_DEVICE_CHANGE_PHY_PORT = 1 << 5
    IBV_DEVICE_UD_AV_PORT_ENFORCE = 1 << 6
    IBV_DEVICE_CURR_QP_STATE_MOD = 1 << 7
    IBV_DEVICE_SHUTDOWN_PORT = 1 << 8
    IBV_DEVICE_INIT_TYPE = 1 << 9
    IBV_DEVICE_PORT_ACTIVE_EVENT = 1 << 10
    IBV_DEVICE_SYS_IMAGE_GUID = 1 << 11
    IBV_DEVICE_RC_RNR_NAK_GEN = 1 << 12
    IBV_DEVICE_SRQ_RESIZE = 1 << 13
    IBV_DEVICE_N_NOTIFY_CQ = 1 << 14
    IBV_DEVICE_MEM_WINDOW = 1 << 17
    IBV_DEVICE_UD_IP_CSUM = 1 << 18
    IBV_DEVICE_XRC = 1 << 20
    IBV_DEVICE_MEM_MGT_EXTENSIONS = 1 << 21
    IBV_DEVICE_MEM_WINDOW_TYPE_2A = 1 << 23
    IBV_DEVICE_MEM_WINDOW_TYPE_2B = 1 << 24
    IBV_DEVICE_RC_IP_CSUM = 1 << 25
    IBV_DEVICE_RAW_IP_CSUM = 1 << 26
    IBV_DEVICE_MANAGED_FLOW_STEERING = 1 << 29


class ibv_atomic_cap(IntEnum):
    IBV_ATOMIC_NONE = 0
    IBV_ATOMIC_HCA = 1
    IBV_ATOMIC_GLOB = 2


class ibv_mtu(IntEnum):
    IBV_MTU_256 = 1
    IBV_MTU_512 = 2
    IBV_MTU_1024 = 3
    IBV_MTU_2048 = 4
    IBV_MTU_4096 = 5


class ibv_port_state(IntEnum):
    IBV_PORT_NOP = 0
    IBV_PORT_DOWN = 1
    IBV_PORT_INIT = 2
    IBV_PORT_ARMED = 3
    IBV_PORT_ACTIVE = 4
    IBV_PORT_ACTIVE_DEFER = 5


class ibv_link_layer(IntEnum):
    # Anonymous in verbs.h; named here so ``PortAttr.link_layer`` has a type.
    IBV_LINK_LAYER_UNSPECIFIED = 0
    IBV_LINK_LAYER_INFINIBAND = 1
    IBV_LINK_LAYER_ETHERNET = 2


class ibv_event_type(IntEnum):
    IBV_EVENT_CQ_ERR = 0
    IBV_EVENT_QP_FATAL = 1
    IBV_EVENT_QP_REQ_ERR = 2
    IBV_EVENT_QP_ACCESS_ERR = 3
    IBV_EVENT_COMM_EST = 4
    IBV_EVENT_SQ_DRAINED = 5
    IBV_EVENT_PATH_MIG = 6
    IBV_EVENT_PATH_MIG_ERR = 7
    IBV_EVENT_DEVICE_FATAL = 8
    IBV_EVENT_PORT_ACTIVE = 9
    IBV_EVENT_PORT_ERR = 10
    IBV_EVENT_LID_CHANGE = 11
    IBV_EVENT_PKEY_CHANGE = 12
    IBV_EVENT_SM_CHANGE = 13
    IBV_EVENT_SRQ_ERR = 14
    IBV_EVENT_SRQ_LIMIT_REACHED = 15
    IBV_EVENT_QP_LAST_WQE_REACHED = 16
    IBV_EVENT_CLIENT_REREGISTER = 17
    IBV_EVENT_GID_CHANGE = 18
    IBV_EVENT_WQ_FATAL = 19


class ibv_wc_status(IntEnum):
    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_LEN_ERR = 1
    IBV_WC_LOC_QP_OP_ERR = 2
    IBV_WC_LOC_EEC_OP_ERR = 3
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_MW_BIND_ERR = 6
    IBV_WC_BAD_RESP_ERR = 7
    IBV_WC_LOC_ACCESS_ERR = 8
    IBV_WC_REM_INV_REQ_ERR = 9
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_REM_OP_ERR = 11
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RNR_RETRY_EXC_ERR = 13
    IBV_WC_LOC_RDD_VIOL_ERR = 14
    IBV_WC_REM_INV_RD_REQ_ERR = 15
    IBV_WC_REM_ABORT_ERR = 16
    IBV_WC_INV_EECN_ERR = 17
    IBV_WC_INV_EEC_STATE_ERR = 18
    IBV_WC_FATAL_ERR = 19
    IBV_WC_RESP_TIMEOUT_ERR = 20
    IBV_WC_GENERAL_ERR = 21
    IBV_WC_TM_ERR = 22
    IBV_WC_TM_RNDV_INCOMPLETE = 23


class ibv_wc_opcode(IntEnum):
    IBV_WC_SEND = 0
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2
    IBV_WC_COMP_SWAP = 3
    IBV_WC_FETCH_ADD = 4
    IBV_WC_BIND_MW = 5
    IBV_WC_LOCAL_INV = 6
    IBV_WC_TSO = 7
    IBV_WC_FLUSH = 8
    IBV_WC_ATOMIC_WRITE = 9
    # Receive opcodes have bit 7 set, so ``opcode & IBV_WC_RECV`` tells a receive.
    IBV_WC_RECV = 1 << 7
    IBV_WC_RECV_RDMA_WITH_IMM = 129
    IBV_WC_TM_ADD = 130
    IBV_WC_TM_DEL = 131
    IBV_WC_TM_SYNC = 132
    IBV_WC_TM_RECV = 133
    IBV_WC_TM_NO_TAG = 134
    IBV_WC_DRIVER1 = 135
    IBV_WC_DRIVER2 = 136
    IBV_WC_DRIVER3 = 137


class ibv_wc_flags(IntFlag):
    IBV_WC_GRH = 1 << 0
    IBV_WC_WITH_IMM = 1 << 1
    IBV_WC_IP_CSUM_OK = 1 << 2
    IBV_WC_WITH_INV = 1 << 3
    IBV_WC_TM_SYNC_REQ = 1 << 4
    IBV_WC_TM_MATCH = 1 << 5
    IBV_WC_TM_DATA_VALID = 1 << 6


class ibv_access_flags(IntFlag):
    IBV_ACCESS_LOCAL_WRITE = 1 << 0
    IBV_ACCESS_REMOTE_WRITE = 1 << 1
    IBV_ACCESS_REMOTE_READ = 1 << 2
    IBV_ACCESS_REMOTE_ATOMIC = 1 << 3
    IBV_ACCESS_MW_BIND = 1 << 4
    IBV_ACCESS_ZERO_BASED = 1 << 5
    IBV_ACCESS_ON_DEMAND = 1 << 6
    IBV_ACCESS_HUGETLB = 1 << 7
    IBV_ACCESS_FLUSH_GLOBAL = 1 << 8
    IBV_ACCESS_FLUSH_PERSISTENT = 1 << 9
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20


class ibv_rate(IntEnum):
    # Not monotonic in the rate: values were appended as link speeds appeared.
    IBV_RATE_MAX = 0
    IBV_RATE_2_5_GBPS = 2
    IBV_RATE_5_GBPS = 5
    IBV_RATE_10_GBPS = 3
    IBV_RATE_20_GBPS = 6
    IBV_RATE_30_GBPS = 4
    IBV_RATE_40_GBPS = 7
    IBV_RATE_60_GBPS = 8
    IBV_RATE_80_GBPS = 9
    IBV_RATE_120_GBPS = 10
    IBV_RATE_14_GBPS = 11
    IBV_RATE_56_GBPS = 12
    IBV_RATE_112_GBPS = 13
    IBV_RATE_168_GBPS = 14
    IBV_RATE_25_GBPS = 15
    IBV_RATE_100_GBPS = 16
    IBV_RATE_200_GBPS = 17
    IBV_RATE_300_GBPS = 18
    IBV_RATE_28_GBPS = 19
    IBV_RATE_50_GBPS = 20
    IBV_RATE_400_GBPS = 21
    IBV_RATE_600_GBPS = 22
    IBV_RATE_800_GBPS = 23
    IBV_RATE_1200_GBPS = 24


class ibv_srq_attr_mask(IntFlag):
    IBV_SRQ_MAX_WR = 1 << 0
    IBV_SRQ_LIMIT = 1 << 1


class ibv_qp_type(IntEnum):
    IBV_QPT_RC = 2
    IBV_QPT_UC = 3
    IBV_QPT_UD = 4
    IBV_QPT_RAW_PACKET = 8
    IBV_QPT_XRC_SEND = 9
    IBV_QPT_XRC_RECV = 10
    IBV_QPT_DRIVER = 0xFF


class ibv_qp_attr_mask(IntFlag):
    IBV_QP_STATE = 1 << 0
    IBV_QP_CUR_STATE = 1 << 1
    IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2
    IBV_QP_ACCESS_FLAGS = 1 << 3
    IBV_QP_PKEY_INDEX = 1 << 4
    IBV_QP_PORT = 1 << 5
    IBV_QP_QKEY = 1 << 6
    IBV_QP_AV = 1 << 7
    IBV_QP_PATH_MTU = 1 << 8
    IBV_QP_TIMEOUT = 1 << 9
    IBV_QP_RETRY_CNT = 1 << 10
    IBV_QP_RNR_RETRY = 1 << 11
    IBV_QP_RQ_PSN = 1 << 12
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
    IBV_QP_ALT_PATH = 1 << 14
    IBV_QP_MIN_RNR_TIMER = 1 << 15
    IBV_QP_SQ_PSN = 1 << 16
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
    IBV_QP_PATH_MIG_STATE = 1 << 18
    IBV_QP_CAP = 1 << 19
    IBV_QP_DEST_QPN = 1 << 20
    # Bits 21-24 were kernel-only (SMAC/VID) and never exposed by libibverbs.
    IBV_QP_RATE_LIMIT = 1 << 25


class ibv_qp_state(IntEnum):
    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6
    IBV_QPS_UNKNOWN = 7


class ibv_mig_state(IntEnum):
    IBV_MIG_MIGRATED = 0
    IBV_MIG_REARM = 1
    IBV_MIG_ARMED = 2


class ibv_wr_opcode(IntEnum):
    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2
    IBV_WR_SEND_WITH_IMM = 3
    IBV_WR_RDMA_READ = 4
    IBV_WR_ATOMIC_CMP_AND_SWP = 5
    IBV_WR_ATOMIC_FETCH_AND_ADD = 6
    IBV_WR_LOCAL_INV = 7
    IBV_WR_BIND_MW = 8
    IBV_WR_SEND_WITH_INV = 9
    IBV_WR_TSO = 10
    IBV_WR_DRIVER1 = 11
    IBV_WR_FLUSH = 14
    IBV_WR_ATOMIC_WRITE = 15


class ibv_send_flags(IntFlag):
    IBV_SEND_FENCE = 1 << 0
    IBV_SEND_SIGNALED = 1 << 1
    IBV_SEND_SOLICITED = 1 << 2
    IBV_SEND_INLINE = 1 << 3
    IBV_SEND_IP_CSUM = 1 << 4


ENUMS: tuple[type[IntEnum] | type[IntFlag], ...] = (
    ibv_node_type,
    ibv_transport_type,
    ibv_device_cap_flags,
    ibv_atomic_cap,
    ibv_mtu,
    ibv_port_state,
    ibv_link_layer,
    ibv_event_type,
    ibv_wc_status,
    ibv_wc_opcode,
    ibv_wc_flags,
    ibv_access_flags,
    ibv_rate,
    ibv_srq_attr_mask,
    ibv_qp_type,
    ibv_qp_attr_mask,
    ibv_qp_state,
    ibv_mig_state,
    ibv_wr_opcode,
    ibv_send_flags,
)


# Module-level aliases, one per member. Written out (not generated at import) so
# that mypy and editors see them; tests/test_verbs_enums.py checks they are complete.

# ibv_node_type
IBV_NODE_UNKNOWN = ibv_node_type.IBV_NODE_UNKNOWN
IBV_NODE_CA = ibv_node_type.IBV_NODE_CA
IBV_NODE_SWITCH = ibv_node_type.IBV_NODE_SWITCH
IBV_NODE_ROUTER = ibv_node_type.IBV_NODE_ROUTER
IBV_NODE_RNIC = ibv_node_type.IBV_NODE_RNIC
IBV_NODE_USNIC = ibv_node_type.IBV_NODE_USNIC
IBV_NODE_USNIC_UDP = ibv_node_type.IBV_NODE_USNIC_UDP

# ibv_transport_type
IBV_TRANSPORT_UNKNOWN = ibv_transport_type.IBV_TRANSPORT_UNKNOWN
IBV_TRANSPORT_IB = ibv_transport_type.IBV_TRANSPORT_IB
IBV_TRANSPORT_IWARP = ibv_transport_type.IBV_TRANSPORT_IWARP
IBV_TRANSPORT_USNIC = ibv_transport_type.IBV_TRANSPORT_USNIC
IBV_TRANSPORT_USNIC_UDP = ibv_transport_type.IBV_TRANSPORT_USNIC_UDP

# ibv_device_cap_flags
IBV_DEVICE_RESIZE_MAX_WR = ibv_device_cap_flags.IBV_DEVICE_RESIZE_MAX_WR
IBV_DEVICE_BAD_PKEY_CNTR = ibv_device_cap_flags.IBV_DEVICE_BAD_PKEY_CNTR
IBV_DEVICE_BAD_QKEY_CNTR = ibv_device_cap_flags.IBV_DEVICE_BAD_QKEY_CNTR
IBV_DEVICE_RAW_MULTI = ibv_device_cap_flags.IBV_DEVICE_RAW_MULTI
IBV_DEVICE_AUTO_PATH_MIG = ibv_device_cap_flags.IBV_DEVICE_AUTO_PATH_MIG
IBV_DEVICE_CHANGE_PHY_PORT = ibv_device_cap_flags.IBV_DEVICE_CHANGE_PHY_PORT
IBV_DEVICE_UD_AV_PORT_ENFORCE = ibv_device_cap_flags.IBV_DEVICE_UD_AV_PORT_ENFORCE
IBV_DEVICE_CURR_QP_STATE_MOD = ibv_device_cap_flags.IBV_DEVICE_CURR_QP_STATE_MOD
IBV_DEVICE_SHUTDOWN_PORT = ibv_device_cap_flags.IBV_DEVICE_SHUTDOWN_PORT
IBV_DEVICE_INIT_TYPE = ibv_device_cap_flags.IBV_DEVICE_INIT_TYPE
IBV_DEVICE_PORT_ACTIVE_EVENT = ibv_device_cap_flags.IBV_DEVICE_PORT_ACTIVE_EVENT
IBV_DEVICE_SYS_IMAGE_GUID = ibv_device_cap_flags.IBV_DEVICE_SYS_IMAGE_GUID
IBV_DEVICE_RC_RNR_NAK_GEN = ibv_device_cap_flags.IBV_DEVICE_RC_RNR_NAK_GEN
IBV_DEVICE_SRQ_RESIZE = ibv_device_cap_flags.IBV_DEVICE_SRQ_RESIZE
IBV_DEVICE_N_NOTIFY_CQ = ibv_device_cap_flags.IBV_DEVICE_N_NOTIFY_CQ
IBV_DEVICE_MEM_WINDOW = ibv_device_cap_flags.IBV_DEVICE_MEM_WINDOW
IBV_DEVICE_UD_IP_CSUM = ibv_device_cap_flags.IBV_DEVICE_UD_IP_CSUM
IBV_DEVICE_XRC = ibv_device_cap_flags.IBV_DEVICE_XRC
IBV_DEVICE_MEM_MGT_EXTENSIONS = ibv_device_cap_flags.IBV_DEVICE_MEM_MGT_EXTENSIONS
IBV_DEVICE_MEM_WINDOW_TYPE_2A = ibv_device_cap_flags.IBV_DEVICE_MEM_WINDOW_TYPE_2A
IBV_DEVICE_MEM_WINDOW_TYPE_2B = ibv_device_cap_flags.IBV_DEVICE_MEM_WINDOW_TYPE_2B
IBV_DEVICE_RC_IP_CSUM = ibv_device_cap_flags.IBV_DEVICE_RC_IP_CSUM
IBV_DEVICE_RAW_IP_CSUM = ibv_device_cap_flags.IBV_DEVICE_RAW_IP_CSUM
IBV_DEVICE_MANAGED_FLOW_STEERING = ibv_device_cap_flags.IBV_DEVICE_MANAGED_FLOW_STEERING

# ibv_atomic_cap
IBV_ATOMIC_NONE = ibv_atomic_cap.IBV_ATOMIC_NONE
IBV_ATOMIC_HCA = ibv_atomic_cap.IBV_ATOMIC_HCA
IBV_ATOMIC_GLOB = ibv_atomic_cap.IBV_ATOMIC_GLOB

# ibv_mtu
IBV_MTU_256 = ibv_mtu.IBV_MTU_256
IBV_MTU_512 = ibv_mtu.IBV_MTU_512
IBV_MTU_1024 = ibv_mtu.IBV_MTU_1024
IBV_MTU_2048 = ibv_mtu.IBV_MTU_2048
IBV_MTU_4096 = ibv_mtu.IBV_MTU_4096

# ibv_port_state
IBV_PORT_NOP = ibv_port_state.IBV_PORT_NOP
IBV_PORT_DOWN = ibv_port_state.IBV_PORT_DOWN
IBV_PORT_INIT = ibv_port_state.IBV_PORT_INIT
IBV_PORT_ARMED = ibv_port_state.IBV_PORT_ARMED
IBV_PORT_ACTIVE = ibv_port_state.IBV_PORT_ACTIVE
IBV_PORT_ACTIVE_DEFER = ibv_port_state.IBV_PORT_ACTIVE_DEFER

# ibv_link_layer
IBV_LINK_LAYER_UNSPECIFIED = ibv_link_layer.IBV_LINK_LAYER_UNSPECIFIED
IBV_LINK_LAYER_INFINIBAND = ibv_link_layer.IBV_LINK_LAYER_INFINIBAND
IBV_LINK_LAYER_ETHERNET = ibv_link_layer.IBV_LINK_LAYER_ETHERNET

# ibv_event_type
IBV_EVENT_CQ_ERR = ibv_event_type.IBV_EVENT_CQ_ERR
IBV_EVENT_QP_FATAL = ibv_event_type.IBV_EVENT_QP_FATAL
IBV_EVENT_QP_REQ_ERR = ibv_event_type.IBV_EVENT_QP_REQ_ERR
IBV_EVENT_QP_ACCESS_ERR = ibv_event_type.IBV_EVENT_QP_ACCESS_ERR
IBV_EVENT_COMM_EST = ibv_event_type.IBV_EVENT_COMM_EST
IBV_EVENT_SQ_DRAINED = ibv_event_type.IBV_EVENT_SQ_DRAINED
IBV_EVENT_PATH_MIG = ibv_event_type.IBV_EVENT_PATH_MIG
IBV_EVENT_PATH_MIG_ERR = ibv_event_type.IBV_EVENT_PATH_MIG_ERR
IBV_EVENT_DEVICE_FATAL = ibv_event_type.IBV_EVENT_DEVICE_FATAL
IBV_EVENT_PORT_ACTIVE = ibv_event_type.IBV_EVENT_PORT_ACTIVE
IBV_EVENT_PORT_ERR = ibv_event_type.IBV_EVENT_PORT_ERR
IBV_EVENT_LID_CHANGE = ibv_event_type.IBV_EVENT_LID_CHANGE
IBV_EVENT_PKEY_CHANGE = ibv_event_type.IBV_EVENT_PKEY_CHANGE
IBV_EVENT_SM_CHANGE = ibv_event_type.IBV_EVENT_SM_CHANGE
IBV_EVENT_SRQ_ERR = ibv_event_type.IBV_EVENT_SRQ_ERR
IBV_EVENT_SRQ_LIMIT_REACHED = ibv_event_type.IBV_EVENT_SRQ_LIMIT_REACHED
IBV_EVENT_QP_LAST_WQE_REACHED = ibv_event_type.IBV_EVENT_QP_LAST_WQE_REACHED
IBV_EVENT_CLIENT_REREGISTER = ibv_event_type.IBV_EVENT_CLIENT_REREGISTER
IBV_EVENT_GID_CHANGE = ibv_event_type.IBV_EVENT_GID_CHANGE
IBV_EVENT_WQ_FATAL = ibv_event_type.IBV_EVENT_WQ_FATAL

# ibv_wc_status
IBV_WC_SUCCESS = ibv_wc_status.IBV_WC_SUCCESS
IBV_WC_LOC_LEN_ERR = ibv_wc_status.IBV_WC_LOC_LEN_ERR
IBV_WC_LOC_QP_OP_ERR = ibv_wc_status.IBV_WC_LOC_QP_OP_ERR
IBV_WC_LOC_EEC_OP_ERR = ibv_wc_status.IBV_WC_LOC_EEC_OP_ERR
IBV_WC_LOC_PROT_ERR = ibv_wc_status.IBV_WC_LOC_PROT_ERR
IBV_WC_WR_FLUSH_ERR = ibv_wc_status.IBV_WC_WR_FLUSH_ERR
IBV_WC_MW_BIND_ERR = ibv_wc_status.IBV_WC_MW_BIND_ERR
IBV_WC_BAD_RESP_ERR = ibv_wc_status.IBV_WC_BAD_RESP_ERR
IBV_WC_LOC_ACCESS_ERR = ibv_wc_status.IBV_WC_LOC_ACCESS_ERR
IBV_WC_REM_INV_REQ_ERR = ibv_wc_status.IBV_WC_REM_INV_REQ_ERR
IBV_WC_REM_ACCESS_ERR = ibv_wc_status.IBV_WC_REM_ACCESS_ERR
IBV_WC_REM_OP_ERR = ibv_wc_status.IBV_WC_REM_OP_ERR
IBV_WC_RETRY_EXC_ERR = ibv_wc_status.IBV_WC_RETRY_EXC_ERR
IBV_WC_RNR_RETRY_EXC_ERR = ibv_wc_status.IBV_WC_RNR_RETRY_EXC_ERR
IBV_WC_LOC_RDD_VIOL_ERR = ibv_wc_status.IBV_WC_LOC_RDD_VIOL_ERR
IBV_WC_REM_INV_RD_REQ_ERR = ibv_wc_status.IBV_WC_REM_INV_RD_REQ_ERR
IBV_WC_REM_ABORT_ERR = ibv_wc_status.IBV_WC_REM_ABORT_ERR
IBV_WC_INV_EECN_ERR = ibv_wc_status.IBV_WC_INV_EECN_ERR
IBV_WC_INV_EEC_STATE_ERR = ibv_wc_status.IBV_WC_INV_EEC_STATE_ERR
IBV_WC_FATAL_ERR = ibv_wc_status.IBV_WC_FATAL_ERR
IBV_WC_RESP_TIMEOUT_ERR = ibv_wc_status.IBV_WC_RESP_TIMEOUT_ERR
IBV_WC_GENERAL_ERR = ibv_wc_status.IBV_WC_GENERAL_ERR
IBV_WC_TM_ERR = ibv_wc_status.IBV_WC_TM_ERR
IBV_WC_TM_RNDV_INCOMPLETE = ibv_wc_status.IBV_WC_TM_RNDV_INCOMPLETE

# ibv_wc_opcode
IBV_WC_SEND = ibv_wc_opcode.IBV_WC_SEND
IBV_WC_RDMA_WRITE = ibv_wc_opcode.IBV_WC_RDMA_WRITE
IBV_WC_RDMA_READ = ibv_wc_opcode.IBV_WC_RDMA_READ
IBV_WC_COMP_SWAP = ibv_wc_opcode.IBV_WC_COMP_SWAP
IBV_WC_FETCH_ADD = ibv_wc_opcode.IBV_WC_FETCH_ADD
IBV_WC_BIND_MW = ibv_wc_opcode.IBV_WC_BIND_MW
IBV_WC_LOCAL_INV = ibv_wc_opcode.IBV_WC_LOCAL_INV
IBV_WC_TSO = ibv_wc_opcode.IBV_WC_TSO
IBV_WC_FLUSH = ibv_wc_opcode.IBV_WC_FLUSH
IBV_WC_ATOMIC_WRITE = ibv_wc_opcode.IBV_WC_ATOMIC_WRITE
IBV_WC_RECV = ibv_wc_opcode.IBV_WC_RECV
IBV_WC_RECV_RDMA_WITH_IMM = ibv_wc_opcode.IBV_WC_RECV_RDMA_WITH_IMM
IBV_WC_TM_ADD = ibv_wc_opcode.IBV_WC_TM_ADD
IBV_WC_TM_DEL = ibv_wc_opcode.IBV_WC_TM_DEL
IBV_WC_TM_SYNC = ibv_wc_opcode.IBV_WC_TM_SYNC
IBV_WC_TM_RECV = ibv_wc_opcode.IBV_WC_TM_RECV
IBV_WC_TM_NO_TAG = ibv_wc_opcode.IBV_WC_TM_NO_TAG
IBV_WC_DRIVER1 = ibv_wc_opcode.IBV_WC_DRIVER1
IBV_WC_DRIVER2 = ibv_wc_opcode.IBV_WC_DRIVER2
IBV_WC_DRIVER3 = ibv_wc_opcode.IBV_WC_DRIVER3

# ibv_wc_flags
IBV_WC_GRH = ibv_wc_flags.IBV_WC_GRH
IBV_WC_WITH_IMM = ibv_wc_flags.IBV_WC_WITH_IMM
IBV_WC_IP_CSUM_OK = ibv_wc_flags.IBV_WC_IP_CSUM_OK
IBV_WC_WITH_INV = ibv_wc_flags.IBV_WC_WITH_INV
IBV_WC_TM_SYNC_REQ = ibv_wc_flags.IBV_WC_TM_SYNC_REQ
IBV_WC_TM_MATCH = ibv_wc_flags.IBV_WC_TM_MATCH
IBV_WC_TM_DATA_VALID = ibv_wc_flags.IBV_WC_TM_DATA_VALID

# ibv_access_flags
IBV_ACCESS_LOCAL_WRITE = ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
IBV_ACCESS_REMOTE_WRITE = ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
IBV_ACCESS_REMOTE_READ = ibv_access_flags.IBV_ACCESS_REMOTE_READ
IBV_ACCESS_REMOTE_ATOMIC = ibv_access_flags.IBV_ACCESS_REMOTE_ATOMIC
IBV_ACCESS_MW_BIND = ibv_access_flags.IBV_ACCESS_MW_BIND
IBV_ACCESS_ZERO_BASED = ibv_access_flags.IBV_ACCESS_ZERO_BASED
IBV_ACCESS_ON_DEMAND = ibv_access_flags.IBV_ACCESS_ON_DEMAND
IBV_ACCESS_HUGETLB = ibv_access_flags.IBV_ACCESS_HUGETLB
IBV_ACCESS_FLUSH_GLOBAL = ibv_access_flags.IBV_ACCESS_FLUSH_GLOBAL
IBV_ACCESS_FLUSH_PERSISTENT = ibv_access_flags.IBV_ACCESS_FLUSH_PERSISTENT
IBV_ACCESS_RELAXED_ORDERING = ibv_access_flags.IBV_ACCESS_RELAXED_ORDERING

# ibv_rate
IBV_RATE_MAX = ibv_rate.IBV_RATE_MAX
IBV_RATE_2_5_GBPS = ibv_rate.IBV_RATE_2_5_GBPS
IBV_RATE_5_GBPS = ibv_rate.IBV_RATE_5_GBPS
IBV_RATE_10_GBPS = ibv_rate.IBV_RATE_10_GBPS
IBV_RATE_20_GBPS = ibv_rate.IBV_RATE_20_GBPS
IBV_RATE_30_GBPS = ibv_rate.IBV_RATE_30_GBPS
IBV_RATE_40_GBPS = ibv_rate.IBV_RATE_40_GBPS
IBV_RATE_60_GBPS = ibv_rate.IBV_RATE_60_GBPS
IBV_RATE_80_GBPS = ibv_rate.IBV_RATE_80_GBPS
IBV_RATE_120_GBPS = ibv_rate.IBV_RATE_120_GBPS
IBV_RATE_14_GBPS = ibv_rate.IBV_RATE_14_GBPS
IBV_RATE_56_GBPS = ibv_rate.IBV_RATE_56_GBPS
IBV_RATE_112_GBPS = ibv_rate.IBV_RATE_112_GBPS
IBV_RATE_168_GBPS = ibv_rate.IBV_RATE_168_GBPS
IBV_RATE_25_GBPS = ibv_rate.IBV_RATE_25_GBPS
IBV_RATE_100_GBPS = ibv_rate.IBV_RATE_100_GBPS
IBV_RATE_200_GBPS = ibv_rate.IBV_RATE_200_GBPS
IBV_RATE_300_GBPS = ibv_rate.IBV_RATE_300_GBPS
IBV_RATE_28_GBPS = ibv_rate.IBV_RATE_28_GBPS
IBV_RATE_50_GBPS = ibv_rate.IBV_RATE_50_GBPS
IBV_RATE_400_GBPS = ibv_rate.IBV_RATE_400_GBPS
IBV_RATE_600_GBPS = ibv_rate.IBV_RATE_600_GBPS
IBV_RATE_800_GBPS = ibv_rate.IBV_RATE_800_GBPS
IBV_RATE_1200_GBPS = ibv_rate.IBV_RATE_1200_GBPS

# ibv_srq_attr_mask
IBV_SRQ_MAX_WR = ibv_srq_attr_mask.IBV_SRQ_MAX_WR
IBV_SRQ_LIMIT = ibv_srq_attr_mask.IBV_SRQ_LIMIT

# ibv_qp_type
IBV_QPT_RC = ibv_qp_type.IBV_QPT_RC
IBV_QPT_UC = ibv_qp_type.IBV_QPT_UC
IBV_QPT_UD = ibv_qp_type.IBV_QPT_UD
IBV_QPT_RAW_PACKET = ibv_qp_type.IBV_QPT_RAW_PACKET
IBV_QPT_XRC_SEND = ibv_qp_type.IBV_QPT_XRC_SEND
IBV_QPT_XRC_RECV = ibv_qp_type.IBV_QPT_XRC_RECV
IBV_QPT_DRIVER = ibv_qp_type.IBV_QPT_DRIVER

# ibv_qp_attr_mask
IBV_QP_STATE = ibv_qp_attr_mask.IBV_QP_STATE
IBV_QP_CUR_STATE = ibv_qp_attr_mask.IBV_QP_CUR_STATE
IBV_QP_EN_SQD_ASYNC_NOTIFY = ibv_qp_attr_mask.IBV_QP_EN_SQD_ASYNC_NOTIFY
IBV_QP_ACCESS_FLAGS = ibv_qp_attr_mask.IBV_QP_ACCESS_FLAGS
IBV_QP_PKEY_INDEX = ibv_qp_attr_mask.IBV_QP_PKEY_INDEX
IBV_QP_PORT = ibv_qp_attr_mask.IBV_QP_PORT
IBV_QP_QKEY = ibv_qp_attr_mask.IBV_QP_QKEY
IBV_QP_AV = ibv_qp_attr_mask.IBV_QP_AV
IBV_QP_PATH_MTU = ibv_qp_attr_mask.IBV_QP_PATH_MTU
IBV_QP_TIMEOUT = ibv_qp_attr_mask.IBV_QP_TIMEOUT
IBV_QP_RETRY_CNT = ibv_qp_attr_mask.IBV_QP_RETRY_CNT
IBV_QP_RNR_RETRY = ibv_qp_attr_mask.IBV_QP_RNR_RETRY
IBV_QP_RQ_PSN = ibv_qp_attr_mask.IBV_QP_RQ_PSN
IBV_QP_MAX_QP_RD_ATOMIC = ibv_qp_attr_mask.IBV_QP_MAX_QP_RD_ATOMIC
IBV_QP_ALT_PATH = ibv_qp_attr_mask.IBV_QP_ALT_PATH
IBV_QP_MIN_RNR_TIMER = ibv_qp_attr_mask.IBV_QP_MIN_RNR_TIMER
IBV_QP_SQ_PSN = ibv_qp_attr_mask.IBV_QP_SQ_PSN
IBV_QP_MAX_DEST_RD_ATOMIC = ibv_qp_attr_mask.IBV_QP_MAX_DEST_RD_ATOMIC
IBV_QP_PATH_MIG_STATE = ibv_qp_attr_mask.IBV_QP_PATH_MIG_STATE
IBV_QP_CAP = ibv_qp_attr_mask.IBV_QP_CAP
IBV_QP_DEST_QPN = ibv_qp_attr_mask.IBV_QP_DEST_QPN
IBV_QP_RATE_LIMIT = ibv_qp_attr_mask.IBV_QP_RATE_LIMIT

# ibv_qp_state
IBV_QPS_RESET = ibv_qp_state.IBV_QPS_RESET
IBV_QPS_INIT = ibv_qp_state.IBV_QPS_INIT
IBV_QPS_RTR = ibv_qp_state.IBV_QPS_RTR
IBV_QPS_RTS = ibv_qp_state.IBV_QPS_RTS
IBV_QPS_SQD = ibv_qp_state.IBV_QPS_SQD
IBV_QPS_SQE = ibv_qp_state.IBV_QPS_SQE
IBV_QPS_ERR = ibv_qp_state.IBV_QPS_ERR
IBV_QPS_UNKNOWN = ibv_qp_state.IBV_QPS_UNKNOWN

# ibv_mig_state
IBV_MIG_MIGRATED = ibv_mig_state.IBV_MIG_MIGRATED
IBV_MIG_REARM = ibv_mig_state.IBV_MIG_REARM
IBV_MIG_ARMED = ibv_mig_state.IBV_MIG_ARMED

# ibv_wr_opcode
IBV_WR_RDMA_WRITE = ibv_wr_opcode.IBV_WR_RDMA_WRITE
IBV_WR_RDMA_WRITE_WITH_IMM = ibv_wr_opcode.IBV_WR_RDMA_WRITE_WITH_IMM
IBV_WR_SEND = ibv_wr_opcode.IBV_WR_SEND
IBV_WR_SEND_WITH_IMM = ibv_wr_opcode.IBV_WR_SEND_WITH_IMM
IBV_WR_RDMA_READ = ibv_wr_opcode.IBV_WR_RDMA_READ
IBV_WR_ATOMIC_CMP_AND_SWP = ibv_wr_opcode.IBV_WR_ATOMIC_CMP_AND_SWP
IBV_WR_ATOMIC_FETCH_AND_ADD = ibv_wr_opcode.IBV_WR_ATOMIC_FETCH_AND_ADD
IBV_WR_LOCAL_INV = ibv_wr_opcode.IBV_WR_LOCAL_INV
IBV_WR_BIND_MW = ibv_wr_opcode.IBV_WR_BIND_MW
IBV_WR_SEND_WITH_INV = ibv_wr_opcode.IBV_WR_SEND_WITH_INV
IBV_WR_TSO = ibv_wr_opcode.IBV_WR_TSO
IBV_WR_DRIVER1 = ibv_wr_opcode.IBV_WR_DRIVER1
IBV_WR_FLUSH = ibv_wr_opcode.IBV_WR_FLUSH
IBV_WR_ATOMIC_WRITE = ibv_wr_opcode.IBV_WR_ATOMIC_WRITE

# ibv_send_flags
IBV_SEND_FENCE = ibv_send_flags.IBV_SEND_FENCE
IBV_SEND_SIGNALED = ibv_send_flags.IBV_SEND_SIGNALED
IBV_SEND_SOLICITED = ibv_send_flags.IBV_SEND_SOLICITED
IBV_SEND_INLINE = ibv_send_flags.IBV_SEND_INLINE
IBV_SEND_IP_CSUM = ibv_send_flags.IBV_SEND_IP_CSUM


if not TYPE_CHECKING:
    # Hidden from type checkers on purpose: with no static __all__, mypy's view of
    # `from ckpt.verbs._enums import *` is every public name, aliases included.
    __all__ = [cls.__name__ for cls in ENUMS] + [name for cls in ENUMS for name in cls.__members__]
    __all__ += ["ENUMS"]
