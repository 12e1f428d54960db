"""The modify-QP state machine follows the kernel's qp_state_table (ib_modify_qp_is_ok)."""

from __future__ import annotations

import pytest

from ckpt.verbs._enums import (
    IBV_QP_ACCESS_FLAGS,
    IBV_QP_ALT_PATH,
    IBV_QP_AV,
    IBV_QP_CAP,
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
    IBV_QPS_UNKNOWN,
    IBV_QPT_DRIVER,
    IBV_QPT_RC,
    IBV_QPT_UC,
    IBV_QPT_UD,
    ibv_qp_attr_mask,
)
from ckpt.verbs._qpstate import QP_STATE_TABLE, check_modify, mask_names, optional_mask, required_mask

RC, UC, UD = IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD
RESET, INIT, RTR, RTS, SQD, SQE, ERR = (
    IBV_QPS_RESET,
    IBV_QPS_INIT,
    IBV_QPS_RTR,
    IBV_QPS_RTS,
    IBV_QPS_SQD,
    IBV_QPS_SQE,
    IBV_QPS_ERR,
)
STATES = (RESET, INIT, RTR, RTS, SQD, SQE, ERR)

# ibv_modify_qp(3), written out independently of the table under test.
RC_REQUIRED: dict[tuple[int, int], int] = {
    (RESET, INIT): IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
    (INIT, RTR): IBV_QP_AV
    | IBV_QP_PATH_MTU
    | IBV_QP_DEST_QPN
    | IBV_QP_RQ_PSN
    | IBV_QP_MAX_DEST_RD_ATOMIC
    | IBV_QP_MIN_RNR_TIMER,
    (RTR, RTS): IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
}
VALID = (
    {
        (RESET, RESET),
        (RESET, INIT),
        (INIT, INIT),
        (INIT, RTR),
        (RTR, RTS),
        (RTS, RTS),
        (RTS, SQD),
        (SQD, RTS),
        (SQD, SQD),
        (SQE, RTS),
    }
    | {(s, RESET) for s in STATES}
    | {(s, ERR) for s in STATES if s != RESET}
)


def bits(mask: int) -> list[int]:
    return [1 << b for b in range(int(mask).bit_length()) if mask >> b & 1]


# ----------------------------------------------------------------- the RC bring-up
@pytest.mark.parametrize(("cur", "new"), sorted(RC_REQUIRED))
def test_rc_required_masks_are_accepted(cur: int, new: int) -> None:
    assert required_mask(RC, cur, new) == RC_REQUIRED[(cur, new)]
    assert check_modify(RC, cur, new, IBV_QP_STATE | RC_REQUIRED[(cur, new)]) is None


@pytest.mark.parametrize(
    ("cur", "new", "bit"), [(cur, new, bit) for (cur, new), req in sorted(RC_REQUIRED.items()) for bit in bits(req)]
)
def test_each_missing_required_bit_is_named(cur: int, new: int, bit: int) -> None:
    reason = check_modify(RC, cur, new, IBV_QP_STATE | RC_REQUIRED[(cur, new)] & ~bit)
    assert reason is not None
    name = str(ibv_qp_attr_mask(bit).name)
    assert reason.endswith(f"missing {name}"), reason
    assert "on an RC QP requires" in reason


def test_required_reason_reads_well() -> None:
    reason = check_modify(RC, RTR, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN)
    assert reason == (
        "RTR→RTS on an RC QP requires IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, "
        "IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_SQ_PSN; missing IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, "
        "IBV_QP_RNR_RETRY, IBV_QP_MAX_QP_RD_ATOMIC"
    )


def test_optional_attributes_are_accepted_and_others_rejected() -> None:
    mask = IBV_QP_STATE | RC_REQUIRED[(INIT, RTR)]
    assert check_modify(RC, INIT, RTR, mask | IBV_QP_ALT_PATH | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS) is None
    reason = check_modify(RC, INIT, RTR, mask | IBV_QP_SQ_PSN)
    assert reason is not None
    assert reason.startswith("attribute IBV_QP_SQ_PSN not allowed in INIT→RTR on an RC QP"), reason
    reason = check_modify(RC, RESET, INIT, IBV_QP_STATE | RC_REQUIRED[(RESET, INIT)] | IBV_QP_QKEY | IBV_QP_CAP)
    assert reason is not None and "attributes IBV_QP_QKEY, IBV_QP_CAP not allowed" in reason
    assert optional_mask(RC, RTR, RTS) & IBV_QP_MIN_RNR_TIMER


def test_unknown_mask_bits_are_rejected() -> None:
    reason = check_modify(RC, INIT, INIT, IBV_QP_STATE | 1 << 22)
    assert reason is not None and "bit 22" in reason
    assert mask_names(IBV_QP_STATE | IBV_QP_AV | 1 << 30) == ["IBV_QP_STATE", "IBV_QP_AV", "bit 30"]


# ----------------------------------------------------------------- UC and UD differ from RC
def test_uc_has_no_rdma_read_or_retry_attributes() -> None:
    assert required_mask(UC, INIT, RTR) == IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
    assert required_mask(UC, RTR, RTS) == IBV_QP_SQ_PSN
    assert check_modify(UC, RTR, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN) is None
    # What RC needs is not even allowed on UC.
    for extra in (IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER):
        reason = check_modify(UC, INIT, RTR, IBV_QP_STATE | required_mask(UC, INIT, RTR) | extra)
        assert reason is not None and str(ibv_qp_attr_mask(extra).name) in reason and "on a UC QP" in reason
    for extra in (IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_MAX_QP_RD_ATOMIC):
        reason = check_modify(UC, RTR, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN | extra)
        assert reason is not None and str(ibv_qp_attr_mask(extra).name) in reason
    # And RC without them is refused.
    assert check_modify(RC, RTR, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN) is not None


def test_ud_needs_qkey_and_no_connection() -> None:
    assert required_mask(UD, RESET, INIT) == IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY
    assert required_mask(UD, INIT, RTR) == 0
    assert check_modify(UD, INIT, RTR, IBV_QP_STATE) is None
    assert check_modify(UD, INIT, RTR, IBV_QP_STATE | IBV_QP_AV) is not None
    assert check_modify(UD, RESET, INIT, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) is not None
    assert check_modify(UD, RTR, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_QKEY) is None


# ----------------------------------------------------------------- which transitions exist
@pytest.mark.parametrize("qp_type", [RC, UC, UD])
@pytest.mark.parametrize("cur", STATES)
@pytest.mark.parametrize("new", STATES)
def test_transition_exists_exactly_as_in_the_kernel(qp_type: int, cur: int, new: int) -> None:
    mask = IBV_QP_STATE | required_mask(qp_type, cur, new)
    reason = check_modify(qp_type, cur, new, mask)
    if (cur, new) in VALID:
        assert reason is None, reason
    else:
        assert reason == f"no transition {STATE_NAMES[cur]}→{STATE_NAMES[new]}"
    assert ((cur, new) in QP_STATE_TABLE) == ((cur, new) in VALID)


STATE_NAMES: dict[int, str] = {RESET: "RESET", INIT: "INIT", RTR: "RTR", RTS: "RTS", SQD: "SQD", SQE: "SQE", ERR: "ERR"}


def test_invalid_transitions_are_rejected() -> None:
    assert check_modify(RC, RESET, RTS, IBV_QP_STATE) == "no transition RESET→RTS"
    assert check_modify(RC, INIT, RTS, IBV_QP_STATE | RC_REQUIRED[(RTR, RTS)]) == "no transition INIT→RTS"
    assert check_modify(RC, RTR, RTR, IBV_QP_STATE) == "no transition RTR→RTR"
    assert check_modify(RC, ERR, RTS, IBV_QP_STATE) == "no transition ERR→RTS"
    # The kernel table has no RESET→ERR: a fresh QP cannot be moved to ERR.
    assert check_modify(RC, RESET, ERR, IBV_QP_STATE) == "no transition RESET→ERR"


def test_rts_sqd_rts() -> None:
    assert check_modify(RC, RTS, SQD, IBV_QP_STATE) is None
    assert check_modify(RC, RTS, SQD, IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY) is None
    assert check_modify(RC, SQD, SQD, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_AV | IBV_QP_PORT) is None
    assert check_modify(UC, SQD, SQD, IBV_QP_STATE | IBV_QP_TIMEOUT) is not None
    assert check_modify(RC, SQD, RTS, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MIG_STATE) is None
    assert check_modify(RC, SQD, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN) is not None


@pytest.mark.parametrize("qp_type", [RC, UC, UD])
@pytest.mark.parametrize("cur", STATES)
def test_any_state_to_reset_and_error_with_state_only(qp_type: int, cur: int) -> None:
    assert check_modify(qp_type, cur, RESET, IBV_QP_STATE) is None
    if cur != RESET:
        assert check_modify(qp_type, cur, ERR, IBV_QP_STATE) is None
    # Nothing else may ride along.
    reason = check_modify(qp_type, cur, RESET, IBV_QP_STATE | IBV_QP_QKEY)
    assert reason is not None and "IBV_QP_QKEY" in reason


# ----------------------------------------------------------------- kernel details
def test_without_state_bit_the_qp_stays_where_it_is() -> None:
    # new is ignored: this is an RTS→RTS modify, where MIN_RNR_TIMER is optional on RC.
    assert check_modify(RC, RTS, RESET, IBV_QP_MIN_RNR_TIMER) is None
    assert check_modify(RC, RTS, RESET, IBV_QP_AV) is not None
    assert check_modify(RC, RTR, ERR, 0) == "no transition RTR→RTR"
    assert check_modify(UD, INIT, RTS, IBV_QP_QKEY) is None


def test_cur_state_attribute_only_from_rtr_rts_sqd_sqe() -> None:
    assert check_modify(RC, RTS, RTS, IBV_QP_STATE | IBV_QP_CUR_STATE) is None
    assert check_modify(UD, RTR, RTS, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_CUR_STATE) is None
    reason = check_modify(RC, INIT, INIT, IBV_QP_STATE | IBV_QP_CUR_STATE)
    assert reason is not None and "IBV_QP_CUR_STATE" in reason and "INIT" in reason
    # Allowed from SQD to RTS, but not in SQD→SQD.
    assert check_modify(RC, SQD, RTS, IBV_QP_STATE | IBV_QP_CUR_STATE) is None
    assert check_modify(RC, SQD, SQD, IBV_QP_STATE | IBV_QP_CUR_STATE) is not None


def test_sqe_to_rts_is_for_uc_and_ud_attributes() -> None:
    assert check_modify(UC, SQE, RTS, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_CUR_STATE) is None
    assert check_modify(UD, SQE, RTS, IBV_QP_STATE | IBV_QP_QKEY) is None
    assert check_modify(RC, SQE, RTS, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS) is not None


def test_bad_states_and_types_are_reported() -> None:
    assert check_modify(RC, IBV_QPS_UNKNOWN, RESET, IBV_QP_STATE) is not None
    assert check_modify(RC, RTS, 42, IBV_QP_STATE) is not None
    reason = check_modify(IBV_QPT_DRIVER, RESET, INIT, IBV_QP_STATE)
    assert reason is not None and "QP type 255" in reason
    assert required_mask(RC, RESET, RTS) == 0 and optional_mask(RC, RESET, RTS) == 0
