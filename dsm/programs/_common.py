"""What the DSM programs share: argument parsing, row bands, and a result line that says whether numpy agrees."""

from __future__ import annotations

from typing import Any

import numpy as np

import ckpt


def args(rt: ckpt.Runtime, defaults: list[int]) -> list[int]:
    """Integer arguments after the program, with `defaults` for the missing ones."""
    given = [int(a) for a in rt.argv]
    return given + defaults[len(given) :]


def band(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [lo, hi) of `n` that `rank` of `size` owns (contiguous, sizes differing by at most one)."""
    return rank * n // size, (rank + 1) * n // size


def interior(n: int, rank: int, size: int) -> tuple[int, int]:
    """`band` without a grid's first and last rows (fixed boundary values); may be empty."""
    lo, hi = band(n, rank, size)
    return max(lo, 1), min(hi, n - 1)


def verdict(name: str, got: np.ndarray, want: np.ndarray, exact: bool = True) -> str:
    """`result()`'s line: a checksum of the DSM answer and whether plain numpy computed the same.

    `exact` asks for bit-for-bit equality; otherwise numpy.allclose (rtol 1e-9) decides, and
    the checksum is rounded to 6 significant digits so that it does not depend on the rank count.
    """
    same = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-9, atol=1e-12)
    total = float(np.sum(np.asarray(got, dtype=np.float64)))
    checksum = repr(total) if exact else f"{total:.6g}"
    return f"{name} checksum={checksum} numpy={'match' if same else 'MISMATCH'}"


def answer_or_raise(line: str | None) -> Any:
    if line is None:
        raise RuntimeError("the program has not finished")
    if "MISMATCH" in line:
        raise RuntimeError(f"the DSM answer differs from numpy's: {line}")
    return line
