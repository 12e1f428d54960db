"""examples/ring.py, unchanged, with its step wrapped by `ib_common.held` (for the checkpointing tests).

    ckpt launch -n 4 tests/programs/ib_ring.py [STEPS] [WORK_US]

Without $CKPT_TEST_HOLD it is exactly the example.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from ib_common import held
from ring import Ring


class HeldRing(Ring):
    step = held(Ring.step)
