"""A DSM program of dsm/programs, chosen by $CKPT_TEST_DSM_PROGRAM, with its step wrapped by `ib_common.held`.

    CKPT_TEST_DSM_PROGRAM=sor ckpt launch -n 4 tests/programs/dsm_held.py [ARGS of sor.py]

Without $CKPT_TEST_HOLD it is exactly the program.  A restart needs the same
$CKPT_TEST_DSM_PROGRAM (the image names this file's class).
"""

from __future__ import annotations

import importlib
import os

from ib_common import held

import ckpt

PROGRAM_ENV = "CKPT_TEST_DSM_PROGRAM"

_module = importlib.import_module(f"dsm.programs.{os.environ[PROGRAM_ENV]}")
(_base,) = [
    c
    for c in vars(_module).values()
    if isinstance(c, type) and issubclass(c, ckpt.Program) and c.__module__ == _module.__name__
]


class Held(_base):  # type: ignore[valid-type,misc]
    step = held(_base.step)
