"""How the coordinator tells of a checkpoint that could not be written.

Two things made a full disk under ``--interval`` hard to read: every rank's error
line, each naming its own image, for the same cause; and the same warning again at
every interval for as long as the disk stayed full.  So the ranks whose errors read
the same but for their own image's name are named after the first one's error, and
of a run of failures that read the same but for their numbers (checkpoint, image)
only the first is told in full and the second briefly; the rest go to the debug log
(`ckpt status` still shows the latest) until a checkpoint completes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("ckpt.coordinator.job")
_NUMBERS = re.compile(r"\d+")


def rank_errors(values: Sequence[Any]) -> str | None:
    """The errors the ranks reported at a CHECKPOINT barrier (``values[rank]``), in one text; None if none did.

    A rank's report is ``{"error": text, "image": path}`` (the image it could not write, if it got that far).
    """
    groups: dict[str, list[tuple[int, str]]] = {}
    for rank, value in enumerate(values):
        if not (isinstance(value, dict) and "error" in value):
            continue
        text, image = str(value["error"]), value.get("image")
        key = text.replace(str(image), "\0") if image else text
        groups.setdefault(key, []).append((rank, text))
    if not groups:
        return None
    parts = []
    for members in groups.values():
        (rank, text), others = members[0], [r for r, _ in members[1:]]
        parts.append(f"rank {rank}: {text}" + (f" (and likewise {rank_list(others)})" if others else ""))
    return "; ".join(parts)


def rank_list(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 1, 4', 'ranks 1-3, 7': runs of consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" if b > a + 1 else f"{a}, {b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


class FailureReport:
    """Warns of failed checkpoints of one kind (coordinated, or independent), without repeating itself."""

    def __init__(self) -> None:
        self._shape: str | None = None  # the last failure, numbers left out
        self._repeats = 0

    def failed(self, message: str) -> None:
        shape = _NUMBERS.sub("#", message)
        if shape != self._shape:
            self._shape, self._repeats = shape, 0
            log.warning("%s", message)
            return
        self._repeats += 1
        if self._repeats == 1:
            lead = message.split(":", 1)[0]
            log.warning("%s: the same failure again (more like it are not reported until a checkpoint completes)", lead)
        else:
            log.debug("%s", message)

    def completed(self) -> None:
        """A checkpoint completed: the next failure is told in full."""
        self._shape, self._repeats = None, 0
