"""examples/ring.py, unchanged, with its step wrapped by `ib_common.held` (for the checkpointing tests).

    ckpt launch -n 4 tests/programs/ib_ring.py [STEPS] [WORK_US]

Without $CKPT_TEST_HOLD and $CKPT_TEST_PAUSE_AT it is exactly the example
(`ib_common.held`, `ib_common.pausable`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from ib_common import held, pausable
from ring import Ring


class HeldRing(Ring):
    step = held(pausable(Ring.step))
