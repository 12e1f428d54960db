"""The DSM programs the tests run, with the arguments each test size uses."""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOLS = ("async", "onesided")


@dataclass(frozen=True)
class DsmCase:
    """A program of dsm/programs: `quick` args (in process, 1/2/4 ranks), `long` args (a CLI run to checkpoint).

    The restart tests run each program on the protocols in `protocols` (suite time: 2 cores, 15 minutes);
    the in-process tests run every program on both.
    """

    name: str
    quick: tuple[str, ...]
    long: tuple[str, ...]
    checkpoint_at: int  # the step the restart test kills the long run at (it resumes from one at half that)
    protocols: tuple[str, ...]  # the protocols its restart test runs on (both are run in process)

    def __str__(self) -> str:
        return self.name


CASES = [
    DsmCase("sor", ("64", "8"), ("128", "24"), 12, PROTOCOLS),
    DsmCase("jacobi", (), ("128", "60"), 30, ("onesided",)),
    DsmCase("matmul", (), ("128", "4"), 20, ("async",)),
    DsmCase("lu", (), ("128", "4"), 20, ("onesided",)),
    DsmCase("isort", ("2048", "128", "3"), ("4096", "256", "30"), 20, ("async",)),
    DsmCase("tsp", ("8", "3", "8"), ("10", "4", "4"), 10, ("onesided",)),  # ~37 steps on 4 ranks (timing-dependent)
    DsmCase("water", ("64", "4", "4"), ("128", "30", "8"), 20, ("async",)),
]
#: (case, protocol) of the CLI restart tests: every program once, the protocols alternating, SOR on both.
RESTARTS = [(case, protocol) for case in CASES for protocol in case.protocols]
