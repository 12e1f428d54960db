"""ckpt/runtime/_process.py: a rank process's stderr lines, its exit, its logging, the program's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ckpt.runtime import _process


def test_the_programs_traceback_leaves_out_ckpts_own_frames() -> None:
    def programs_code() -> None:
        raise ValueError("in the program")

    # caught in a ckpt frame that called the program, as the runtime catches a step's exception (_process's own
    # file stands in for the runtime's)
    runtime = "try:\n    programs_code()\nexcept ValueError as exc:\n    caught = exc\n"
    scope = {"programs_code": programs_code}
    exec(compile(runtime, _process.__file__, "exec"), scope)
    text = _process._program_traceback(scope["caught"])
    assert "programs_code" in text and "ValueError: in the program" in text
    assert _process.__file__ not in text  # the frame inside ckpt/ is not shown to the program's author


def test_say_writes_a_line_in_one_write_and_exit_flushes_first() -> None:
    code = textwrap.dedent(
        """
        import sys
        from ckpt.runtime import _process
        print("buffered", end="")
        _process.say("one line")
        _process._exit(3)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert done.returncode == 3
    assert done.stderr == "one line\n" and done.stdout == "buffered"
