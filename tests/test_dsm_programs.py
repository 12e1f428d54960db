"""Every DSM program gives plain numpy's answer with 1, 2 and 4 ranks under every protocol, and both of Cashmere's
fill policies (thread-ranks)."""

from __future__ import annotations

import pytest
from dsm_cases import CASES, DsmCase
from dsm_util import FIRST_HCA, expected_lines, run_program

import ckpt.testing
import dsm
from dsm.programs import program_class

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_answer_is_numpys_and_the_same_for_any_rank_count_and_protocol(case: DsmCase) -> None:
    lines = {}
    for protocol, fill in [*((protocol, None) for protocol in dsm.PROTOCOLS), ("cashmere", "line")]:
        for size in (1, 2, 4):
            results = run_program(case.name, list(case.quick), size, protocol, fill)
            assert len(set(results)) == 1, (protocol, fill, size, results)
            lines[(protocol, fill, size)] = results[0]
    assert all("numpy=match" in line for line in lines.values()), lines
    assert len(set(lines.values())) == 1, lines
    # what the end-to-end tests compare with, without running the program: its line, computed
    assert next(iter(lines.values())) == expected_lines(case.name, case.quick, 1)[0]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_answer_is_numpys_under_cashmere_with_unsafe_pages(case: DsmCase) -> None:
    """--dsm-unsafe 1: every page with a reader to notify becomes unsafe, so its readers rely on reading its
    directory row at their acquires -- under both fills, on 4 ranks."""
    want = expected_lines(case.name, case.quick, 1)[0]
    for fill in dsm.FILLS:
        results = ckpt.testing.run_program(
            program_class(case.name),
            4,
            argv=list(case.quick),
            options={"dsm_protocol": "cashmere", "dsm_fill": fill, "dsm_unsafe": 1},
            first_device=FIRST_HCA,
            finish=lambda program: program.mem.close(),
        )
        assert results == [want] * 4, (fill, results)


@pytest.mark.stress  # the quick arguments above check the same computation; this costs 4 s of a worker a case
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_computed_answer_is_a_real_runs_with_the_end_to_end_tests_arguments(case: DsmCase) -> None:
    """`expected_lines` for the arguments the end-to-end tests run (`DsmCase.long`), against one real run."""
    assert dict(enumerate(run_program(case.name, list(case.long), 4, "async"))) == expected_lines(
        case.name, case.long, 4
    )
