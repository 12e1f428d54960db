"""A DSM program of dsm/programs, chosen by $CKPT_TEST_DSM_PROGRAM, that a test can pause mid-run and hold at its end.

    CKPT_TEST_DSM_PROGRAM=sor ckpt launch -n 4 tests/programs/dsm_held.py [ARGS of sor.py]

* $CKPT_TEST_PAUSE_AT="10,20" with $CKPT_TEST_PAUSE=PREFIX (`ib_common.pausable`): before
  its 10th (then 20th) real step each rank idles until the file PREFIX.10 exists; rank 0
  first creates PREFIX.10.reached.  A test checkpoints there, so the
  checkpoint is mid-run however fast the program is.
* $CKPT_TEST_HOLD (`ib_common.held`): once done, ranks idle until that file exists.

Idle steps do no collective and change no state, so the result is the
program's.  A restart needs the same $CKPT_TEST_DSM_PROGRAM (the image names
this file's class).
"""

from __future__ import annotations

import os

from ib_common import held, pausable

from dsm.programs import program_class

PROGRAM_ENV = "CKPT_TEST_DSM_PROGRAM"

_base = program_class(os.environ[PROGRAM_ENV])


class Held(_base):  # type: ignore[valid-type,misc]
    step = held(pausable(_base.step))
