"""Every DSM program gives plain numpy's answer with 1, 2 and 4 ranks under both protocols (thread-ranks)."""

from __future__ import annotations

import pytest
from dsm_cases import CASES, PROTOCOLS, DsmCase
from dsm_util import run_program

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_answer_is_numpys_and_the_same_for_any_rank_count_and_protocol(case: DsmCase) -> None:
    lines = {}
    for protocol in PROTOCOLS:
        for size in (1, 2, 4):
            results = run_program(case.name, list(case.quick), size, protocol)
            assert len(set(results)) == 1, (protocol, size, results)
            lines[(protocol, size)] = results[0]
    assert all("numpy=match" in line for line in lines.values()), lines
    assert len(set(lines.values())) == 1, lines
