"""The DSM's glue to ckpt.testing's thread-ranks: a memory attached on each rank, each on an HCA of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ckpt.testing
import dsm
from ckpt.plugin import PluginCalls
from ckpt.testing import ThreadRuntime, run_threads
from dsm.programs import program_class

FIRST_HCA = 10  # rank r opens simib<10 + r>: HCAs no other test uses, shared by the DSM tests (each closes its own)


def run_ranks(
    size: int,
    body: Callable[[dsm.Memory, ThreadRuntime], Any],
    protocol: str,
    plugins: Callable[[int], PluginCalls | None] | None = None,
    **attach: Any,
) -> list[Any]:
    """Run body(mem, rt) on `size` thread-ranks attached to one DSM; their return values, by rank.

    `plugins(rank)`, if given, makes each rank's `rt.plugins` (a ckpt PluginHost).  Every memory is
    closed once all ranks are done (a rank's memory serves the others until then).
    """

    def rank_body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, protocol, **attach)
        rt.at_end(memory.close)
        return body(memory, rt)

    return run_threads(size, rank_body, first_device=FIRST_HCA, plugins=plugins, options={"dsm_protocol": protocol})


def run_program(name: str, argv: list[str], size: int, protocol: str) -> list[Any]:
    """Run dsm/programs/<name>.py on `size` thread-ranks as `ckpt launch` would (setup, steps); its results."""
    return ckpt.testing.run_program(
        program_class(name),
        size,
        argv=argv,
        options={"dsm_protocol": protocol},
        first_device=FIRST_HCA,
        finish=lambda program: program.mem.close(),  # type: ignore[attr-defined]  (the programs keep theirs as `mem`)
    )
