"""The DSM programs the tests run, with the arguments each test size uses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

PROTOCOLS = ("async", "onesided")  # the HLRC ones (dsm.HLRC): what remote logging and replay run on


@dataclass(frozen=True)
class DsmCase:
    """A program of dsm/programs: `quick` args (in process, 1/2/4 ranks), `long` args (a CLI run to checkpoint)."""

    name: str
    quick: tuple[str, ...]
    long: tuple[str, ...]
    checkpoint_at: int  # the step the restart test kills the long run at (it resumes from one at half that)

    def __str__(self) -> str:
        return self.name


CASES = [
    DsmCase("sor", ("64", "8"), ("128", "24"), 12),
    DsmCase("jacobi", (), ("128", "60"), 30),
    DsmCase("matmul", (), ("128", "4"), 20),
    DsmCase("lu", (), ("128", "4"), 20),
    DsmCase("isort", ("2048", "128", "3"), ("4096", "256", "30"), 20),
    DsmCase("tsp", ("8", "3", "8"), ("10", "4", "4"), 10),  # ~37 steps on 4 ranks (timing-dependent)
    DsmCase("water", ("64", "4", "4"), ("128", "30", "8"), 20),
]
#: (case, protocol) of the CLI restart tests: every program on both protocols.
#: Every program on both protocols; suite time: CI runs each on one, alternating (the other under -m stress;
#: both protocols are checkpointed through the CLI in CI by test_e2e_dsm's other tests and test_e2e_remotelog)
RESTARTS = [
    pytest.param(case, protocol, marks=[pytest.mark.stress] if (i + j) % 2 else [], id=f"{case}-{protocol}")
    for i, case in enumerate(CASES)
    for j, protocol in enumerate(PROTOCOLS)
] + [  # and under cashmere, both fills: CI restarts the multiple-lock, multiple-writer Water on simib with the copy
    # fill (and test_e2e_dsm SOR over tcp with the line fill); the rest under -m stress
    pytest.param(case, variant, marks=[] if (case.name, variant) == ("water", "cashmere") else [pytest.mark.stress],
                 id=f"{case}-{variant}")
    for case in CASES
    for variant in ("cashmere", "cashmere-line")
]  # fmt: skip


def protocol_args(variant: str) -> list[str]:
    """`ckpt launch`'s options for a RESTARTS variant: a protocol, or ``cashmere-line`` (cashmere, line fill)."""
    if variant == "cashmere-line":
        return ["--dsm-protocol", "cashmere", "--dsm-fill", "line"]
    return ["--dsm-protocol", variant]
