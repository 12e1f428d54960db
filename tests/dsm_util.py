"""The DSM's glue to ckpt.testing's thread-ranks: a memory attached on each rank, each on an HCA of its own."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

import ckpt.testing
import dsm
from ckpt.plugin import PluginCalls
from ckpt.testing import ThreadRuntime, run_threads
from dsm.programs import program_class

#: What the memory-model tests run under: every protocol, and Cashmere with its line fill too (``LINE_FILL``,
#: which `run_ranks` takes for ``dsm.attach(rt, "cashmere", fill="line")``).
LINE_FILL = "cashmere-line"
MODELS = (*dsm.PROTOCOLS, LINE_FILL)
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

    if protocol == LINE_FILL:
        protocol, attach = "cashmere", {**attach, "fill": "line"}

    def rank_body(rt: ThreadRuntime) -> Any:
        memory = dsm.attach(rt, protocol, **attach)
        rt.at_end(memory.close)
        return body(memory, rt)

    return run_threads(size, rank_body, first_device=FIRST_HCA, plugins=plugins, options={"dsm_protocol": protocol})


def run_program(name: str, argv: list[str], size: int, protocol: str, fill: str | None = None) -> list[Any]:
    """Run dsm/programs/<name>.py on `size` thread-ranks as `ckpt launch` would (setup, steps); its results."""
    return ckpt.testing.run_program(
        program_class(name),
        size,
        argv=argv,
        options={"dsm_protocol": protocol, "dsm_fill": fill},
        first_device=FIRST_HCA,
        finish=lambda program: program.mem.close(),  # type: ignore[attr-defined]  (the programs keep theirs as `mem`)
    )


def expected_lines(name: str, argv: Sequence[str], ranks: int) -> dict[int, str]:
    """What every rank of dsm/programs/<name>.py prints at the end of a right run, by rank: the program's verdict
    (`dsm.programs._common.verdict`) on numpy's own answer, which a right run's answer is bit for bit -- from the
    program's reference functions, in milliseconds, where running the program on thread-ranks takes 4-10 s of
    a test worker.  test_dsm_programs checks it against real runs of every program."""
    from dsm.programs._common import args, verdict

    module: Any = importlib.import_module(f"dsm.programs.{name}")
    rt = SimpleNamespace(argv=list(argv))
    want: np.ndarray
    if name in ("sor", "jacobi"):
        n, iterations = args(rt, [256, 40] if name == "sor" else [128, 30])  # type: ignore[arg-type]
        want = module.initial(n)
        for _ in range(iterations):
            if name == "sor":
                module.sweep(want, 0)
                module.sweep(want, 1)
            else:
                want[1:-1] = module.relax(want)
    elif name == "matmul":
        a, b = module.inputs(args(rt, [128, 16])[0])  # type: ignore[arg-type]
        want = a @ b
    elif name == "lu":
        want = module.doolittle(module.matrix(args(rt, [96, 8])[0]))  # type: ignore[arg-type]
    elif name == "isort":
        want = module.reference(*args(rt, [4096, 256, 4]))  # type: ignore[arg-type]
    elif name == "tsp":
        want = np.array([module.held_karp(module.distances(args(rt, [9, 3, 8])[0]))])  # type: ignore[arg-type]
    elif name == "water":
        molecules, steps, _ = args(rt, [96, 6, 8])  # type: ignore[arg-type]
        want = module.outcome(*module.reference(molecules, steps))
    else:
        raise ValueError(f"no reference for DSM program {name!r}")
    return dict.fromkeys(range(ranks), verdict(name, want, want, exact=True))
