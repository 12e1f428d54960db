"""The QP state machine: which modify-QP transitions are valid, and with which attribute masks."""

# The table is the Linux kernel's ``qp_state_table`` (drivers/infiniband/core/
# verbs.c), which ``ib_modify_qp_is_ok`` consults for every ibv_modify_qp; its
# entries are the "required" and "optional" attributes of ibv_modify_qp(3). A
# transition that is not listed does not exist. Listed transitions with no masks
# take IBV_QP_STATE alone; this covers the moves to RESET and ERR from every state
# except that RESET→ERR is absent from the kernel's table, and so invalid here too.
#
# Kernel QP types map onto libibverbs' as XRC_INI = IBV_QPT_XRC_SEND and
# XRC_TGT = IBV_QPT_XRC_RECV (same numbers); the kernel-only SMI/GSI types are left out.

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ckpt.verbs._enums import (
    IBV_QP_ACCESS_FLAGS,
    IBV_QP_ALT_PATH,
    IBV_QP_AV,
    IBV_QP_CUR_STATE,
    IBV_QP_DEST_QPN,
    IBV_QP_EN_SQD_ASYNC_NOTIFY,
    IBV_QP_MAX_DEST_RD_ATOMIC,
    IBV_QP_MAX_QP_RD_ATOMIC,
    IBV_QP_MIN_RNR_TIMER,
    IBV_QP_PATH_MIG_STATE,
    IBV_QP_PATH_MTU,
    IBV_QP_PKEY_INDEX,
    IBV_QP_PORT,
    IBV_QP_QKEY,
    IBV_QP_RATE_LIMIT,
    IBV_QP_RETRY_CNT,
    IBV_QP_RNR_RETRY,
    IBV_QP_RQ_PSN,
    IBV_QP_SQ_PSN,
    IBV_QP_STATE,
    IBV_QP_TIMEOUT,
    IBV_QPS_ERR,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPS_RTR,
    IBV_QPS_RTS,
    IBV_QPS_SQD,
    IBV_QPS_SQE,
    IBV_QPT_RAW_PACKET,
    IBV_QPT_RC,
    IBV_QPT_UC,
    IBV_QPT_UD,
    IBV_QPT_XRC_RECV,
    IBV_QPT_XRC_SEND,
    ibv_qp_attr_mask,
    ibv_qp_state,
    ibv_qp_type,
)

__all__ = ["QP_STATE_TABLE", "Transition", "check_modify", "mask_names", "optional_mask", "required_mask"]

RC, UC, UD = IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD
RAW, XRC_INI, XRC_TGT = IBV_QPT_RAW_PACKET, IBV_QPT_XRC_SEND, IBV_QPT_XRC_RECV


class Transition(NamedTuple):
    """Attribute masks of one transition, per QP type (a type not listed has an empty mask)."""

    required: Mapping[int, int] = {}
    optional: Mapping[int, int] = {}


_STATE_ONLY = Transition()

# Attribute sets that recur in the table.
_PKEY_PORT_QKEY = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY
_PKEY_PORT_ACCESS = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
_CONNECT = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
_RESPONDER = IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER
_RETRY = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC
_REQUESTER = _RETRY | IBV_QP_SQ_PSN
_ALT_ACCESS_PKEY = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX
_CUR_QKEY = IBV_QP_CUR_STATE | IBV_QP_QKEY
_CUR_ALT_ACCESS_MIG = IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PATH_MIG_STATE
_PKEY_QKEY = IBV_QP_PKEY_INDEX | IBV_QP_QKEY
_SQD_RECONFIGURE = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PATH_MIG_STATE

QP_STATE_TABLE: dict[tuple[int, int], Transition] = {
    (IBV_QPS_RESET, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_RESET, IBV_QPS_INIT): Transition(
        required={
            UD: _PKEY_PORT_QKEY,
            RAW: IBV_QP_PORT,
            UC: _PKEY_PORT_ACCESS,
            RC: _PKEY_PORT_ACCESS,
            XRC_INI: _PKEY_PORT_ACCESS,
            XRC_TGT: _PKEY_PORT_ACCESS,
        },
    ),
    (IBV_QPS_INIT, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_INIT, IBV_QPS_ERR): _STATE_ONLY,
    (IBV_QPS_INIT, IBV_QPS_INIT): Transition(
        optional={
            UD: _PKEY_PORT_QKEY,
            UC: _PKEY_PORT_ACCESS,
            RC: _PKEY_PORT_ACCESS,
            XRC_INI: _PKEY_PORT_ACCESS,
            XRC_TGT: _PKEY_PORT_ACCESS,
        },
    ),
    (IBV_QPS_INIT, IBV_QPS_RTR): Transition(
        required={
            UC: _CONNECT,
            RC: _CONNECT | _RESPONDER,
            XRC_INI: _CONNECT,
            XRC_TGT: _CONNECT | _RESPONDER,
        },
        optional={
            UD: _PKEY_QKEY,
            UC: _ALT_ACCESS_PKEY,
            RC: _ALT_ACCESS_PKEY,
            XRC_INI: _ALT_ACCESS_PKEY,
            XRC_TGT: _ALT_ACCESS_PKEY,
        },
    ),
    (IBV_QPS_RTR, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_RTR, IBV_QPS_ERR): _STATE_ONLY,
    (IBV_QPS_RTR, IBV_QPS_RTS): Transition(
        required={
            UD: IBV_QP_SQ_PSN,
            UC: IBV_QP_SQ_PSN,
            RC: _REQUESTER,
            XRC_INI: _REQUESTER,
            XRC_TGT: IBV_QP_TIMEOUT | IBV_QP_SQ_PSN,
        },
        optional={
            UD: _CUR_QKEY,
            UC: _CUR_ALT_ACCESS_MIG,
            RC: _CUR_ALT_ACCESS_MIG | IBV_QP_MIN_RNR_TIMER,
            XRC_INI: _CUR_ALT_ACCESS_MIG,
            XRC_TGT: _CUR_ALT_ACCESS_MIG | IBV_QP_MIN_RNR_TIMER,
            RAW: IBV_QP_RATE_LIMIT,
        },
    ),
    (IBV_QPS_RTS, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_RTS, IBV_QPS_ERR): _STATE_ONLY,
    (IBV_QPS_RTS, IBV_QPS_RTS): Transition(
        optional={
            UD: _CUR_QKEY,
            UC: _CUR_ALT_ACCESS_MIG,
            RC: _CUR_ALT_ACCESS_MIG | IBV_QP_MIN_RNR_TIMER,
            XRC_INI: _CUR_ALT_ACCESS_MIG,
            XRC_TGT: _CUR_ALT_ACCESS_MIG | IBV_QP_MIN_RNR_TIMER,
            RAW: IBV_QP_RATE_LIMIT,
        },
    ),
    (IBV_QPS_RTS, IBV_QPS_SQD): Transition(
        optional={
            UD: IBV_QP_EN_SQD_ASYNC_NOTIFY,
            UC: IBV_QP_EN_SQD_ASYNC_NOTIFY,
            RC: IBV_QP_EN_SQD_ASYNC_NOTIFY,
            XRC_INI: IBV_QP_EN_SQD_ASYNC_NOTIFY,
            XRC_TGT: IBV_QP_EN_SQD_ASYNC_NOTIFY,
        },
    ),
    (IBV_QPS_SQD, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_SQD, IBV_QPS_ERR): _STATE_ONLY,
    (IBV_QPS_SQD, IBV_QPS_RTS): Transition(
        optional={
            UD: _CUR_QKEY,
            UC: _CUR_ALT_ACCESS_MIG,
            RC: _CUR_ALT_ACCESS_MIG | IBV_QP_MIN_RNR_TIMER,
            XRC_INI: _CUR_ALT_ACCESS_MIG,
            XRC_TGT: _CUR_ALT_ACCESS_MIG | IBV_QP_MIN_RNR_TIMER,
        },
    ),
    (IBV_QPS_SQD, IBV_QPS_SQD): Transition(
        optional={
            UD: _PKEY_QKEY,
            UC: IBV_QP_AV | _SQD_RECONFIGURE,
            RC: IBV_QP_PORT | IBV_QP_AV | _RETRY | _RESPONDER | _SQD_RECONFIGURE,
            XRC_INI: IBV_QP_PORT | IBV_QP_AV | _RETRY | _SQD_RECONFIGURE,
            XRC_TGT: IBV_QP_PORT | IBV_QP_AV | IBV_QP_TIMEOUT | _RESPONDER | _SQD_RECONFIGURE,
        },
    ),
    (IBV_QPS_SQE, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_SQE, IBV_QPS_ERR): _STATE_ONLY,
    (IBV_QPS_SQE, IBV_QPS_RTS): Transition(
        optional={
            UD: _CUR_QKEY,
            UC: IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS,
        },
    ),
    (IBV_QPS_ERR, IBV_QPS_RESET): _STATE_ONLY,
    (IBV_QPS_ERR, IBV_QPS_ERR): _STATE_ONLY,
}

_QP_TYPES = frozenset((RC, UC, UD, RAW, XRC_INI, XRC_TGT))
# The kernel accepts IBV_QP_CUR_STATE only from these states.
_CUR_STATE_FROM = frozenset((IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE))
_STATES = frozenset(range(IBV_QPS_RESET, IBV_QPS_ERR + 1))


def required_mask(qp_type: int, cur: int, new: int) -> int:
    """Attributes a ``cur``→``new`` modify must set on this QP type (IBV_QP_STATE aside); 0 if no such transition."""
    transition = QP_STATE_TABLE.get((cur, new))
    return int(transition.required.get(qp_type, 0)) if transition else 0


def optional_mask(qp_type: int, cur: int, new: int) -> int:
    """Attributes a ``cur``→``new`` modify may also set on this QP type; 0 if no such transition."""
    transition = QP_STATE_TABLE.get((cur, new))
    return int(transition.optional.get(qp_type, 0)) if transition else 0


def check_modify(qp_type: int, cur: int, new: int, mask: int) -> str | None:
    """Check a modify-QP as ``ib_modify_qp_is_ok`` does: None if valid, else why not, in words.

    ``cur`` is the state the modify starts from (the QP's state, or ``attr.cur_qp_state``
    when ``mask`` has IBV_QP_CUR_STATE); ``new`` is ``attr.qp_state``, ignored (the QP
    stays in ``cur``) when ``mask`` lacks IBV_QP_STATE.
    """
    if not mask & IBV_QP_STATE:
        new = cur
    for state in (cur, new):
        if state not in _STATES:
            return f"{_state_name(state)} is not a QP state a modify can start from or go to"
    if qp_type not in _QP_TYPES:
        return f"QP type {qp_type} has no modify-QP state machine here"
    if mask & IBV_QP_CUR_STATE and cur not in _CUR_STATE_FROM:
        return f"IBV_QP_CUR_STATE is only allowed from RTR, RTS, SQD or SQE, not from {_state_name(cur)}"
    transition = QP_STATE_TABLE.get((cur, new))
    if transition is None:
        return f"no transition {_state_name(cur)}→{_state_name(new)}"
    where = f"{_state_name(cur)}→{_state_name(new)} on {_type_article(qp_type)} QP"
    # Plain ints: an IntFlag's ~ keeps only defined bits and would hide unknown ones.
    mask = int(mask)
    required = int(transition.required.get(qp_type, 0))
    optional = int(transition.optional.get(qp_type, 0))
    missing = required & ~mask
    if missing:
        return f"{where} requires {', '.join(mask_names(required))}; missing {', '.join(mask_names(missing))}"
    extra = mask & ~(required | optional | int(IBV_QP_STATE))
    if extra:
        allowed = ", ".join(mask_names(required | optional)) or "nothing"
        noun = "attribute" if len(mask_names(extra)) == 1 else "attributes"
        return f"{noun} {', '.join(mask_names(extra))} not allowed in {where} (allowed besides IBV_QP_STATE: {allowed})"
    return None


def mask_names(mask: int) -> list[str]:
    """The ``IBV_QP_*`` names of the bits in ``mask``, lowest bit first (unnamed bits as ``bit N``)."""
    return [_MASK_BIT_NAMES.get(bit, f"bit {bit}") for bit in range(int(mask).bit_length()) if mask >> bit & 1]


_MASK_BIT_NAMES = {member.value.bit_length() - 1: name for name, member in ibv_qp_attr_mask.__members__.items()}


def _state_name(state: int) -> str:
    try:
        return ibv_qp_state(state).name.removeprefix("IBV_QPS_")
    except ValueError:
        return f"state {state}"


def _type_article(qp_type: int) -> str:
    name = ibv_qp_type(qp_type).name.removeprefix("IBV_QPT_")
    return f"{'an' if name[0] in 'AEFHILMNORSX' else 'a'} {name}"
