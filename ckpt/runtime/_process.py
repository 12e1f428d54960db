"""The rank process's plumbing: its lines on the shared stderr, its exit, its logging, the program's traceback."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn


def _program_traceback(exc: BaseException) -> str:
    """The program's own traceback (its frames, not ckpt's), so its author sees where it failed."""
    package = str(Path(__file__).resolve().parent.parent) + os.sep
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(package):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def say(line: str) -> None:
    """One line (or a block ending in one) on stderr in a single write: ranks share the launcher's stderr,
    and a print() of text and newline in two writes interleaves with another rank's."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def _exit(code: int) -> NoReturn:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def configure_logging(rank: int, level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.WARNING),
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
