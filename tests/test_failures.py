"""ckpt.coordinator._failures: one text for the ranks that failed alike, one warning for failures that repeat."""

from __future__ import annotations

import logging

import pytest

from ckpt.coordinator._failures import FailureReport, rank_errors, rank_list


def _image(rank: int, number: int = 9) -> str:
    return f"/d/ckpt_heat_{rank}_{number}.ckpt"


def _full(rank: int) -> dict[str, str]:
    return {"error": f"cannot write checkpoint image {_image(rank)}: No space left on device", "image": _image(rank)}


def test_ranks_that_failed_alike_but_for_their_own_image_are_named_after_the_first() -> None:
    values = [_full(0), {"file": "ok"}, _full(2), _full(3), {"error": "cannot pickle the program state: x"}]
    assert rank_errors(values) == (
        f"rank 0: cannot write checkpoint image {_image(0)}: No space left on device (and likewise ranks 2, 3); "
        "rank 4: cannot pickle the program state: x"
    )


def test_errors_that_differ_are_each_told() -> None:
    read_only = f"cannot write checkpoint image {_image(1)}: Read-only file system"
    values = [_full(0), {"error": read_only, "image": _image(1)}]
    assert rank_errors(values) == (
        f"rank 0: cannot write checkpoint image {_image(0)}: No space left on device; "
        f"rank 1: cannot write checkpoint image {_image(1)}: Read-only file system"
    )


def test_no_error_is_none() -> None:
    assert rank_errors([{"file": "a"}, None, "x"]) is None


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([3], "rank 3"), ([4, 1], "ranks 1, 4"), ([1, 2], "ranks 1, 2"), ([7, 1, 2, 3], "ranks 1-3, 7")],
)
def test_rank_list(ranks: list[int], text: str) -> None:
    assert rank_list(ranks) == text


def test_a_failure_that_repeats_is_told_once_in_full_once_briefly_then_not_until_a_checkpoint_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    report = FailureReport()

    def failed(number: int, why: str = "No space left on device") -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ckpt.coordinator.job"):
            report.failed(f"checkpoint {number} could not be written: rank 0: {_image(0, number)}: {why}")
        return [f"{r.levelname} {r.getMessage()}" for r in caplog.records]

    assert failed(9) == [f"WARNING checkpoint 9 could not be written: rank 0: {_image(0)}: No space left on device"]
    assert failed(10) == [
        "WARNING checkpoint 10 could not be written: the same failure again "
        "(more like it are not reported until a checkpoint completes)"
    ]
    assert [line.split()[0] for line in failed(11) + failed(12)] == ["DEBUG", "DEBUG"]
    assert failed(13, "Read-only file system")[0].startswith("WARNING checkpoint 13 could not be written: rank 0:")
    report.completed()
    assert failed(14, "Read-only file system")[0].startswith("WARNING checkpoint 14 could not be written: rank 0:")
