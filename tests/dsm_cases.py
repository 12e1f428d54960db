"""The DSM programs the tests run, with the arguments each test size uses."""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOLS = ("async", "onesided")


@dataclass(frozen=True)
class DsmCase:
    """A program of dsm/programs: `quick` args (in process, 1/2/4 ranks), `long` args (a CLI run to checkpoint)."""

    name: str
    quick: tuple[str, ...]
    long: tuple[str, ...]
    checkpoint_at: int  # a step the long run reaches well before its end

    def __str__(self) -> str:
        return self.name


CASES = [
    DsmCase("sor", ("64", "8"), ("128", "60"), 10),
]
