"""ckpt_dsm: the DSM's glue to ckpt -- the ``--dsm-protocol`` option and the DSM hookspecs.

``ckpt launch --dsm-protocol onesided prog.py`` reaches every rank as
``rt.options["dsm_protocol"]``, which ``dsm.attach(rt)`` uses when the program
names no protocol.  The plugin also brings ``dsm.hookspecs`` (``CKPT_HOOKSPECS``)
so that plugins implementing DSM hooks -- remote logging -- validate at load
time, before any program has attached a shared memory.
"""

from __future__ import annotations

from typing import Any

import ckpt
import dsm
from ckpt.plugin import JobInfo
from dsm import hookspecs

__all__ = ["CKPT_HOOKSPECS"]
__version__ = "0.1.0"
CKPT_PLUGIN_API = 2
CKPT_HOOKSPECS = hookspecs


@ckpt.hookimpl
def ckpt_add_options() -> list[dict[str, Any]]:
    return [
        {
            "name": "dsm-protocol",
            "help": f"DSM protocol for dsm.attach(rt): {' or '.join(dsm.PROTOCOLS)} (default async)",
            "default": None,
            "type": "str",
            "choices": list(dsm.PROTOCOLS),
            "launch_only": True,  # the protocol is in the images: a restart keeps it
        },
        {
            "name": "dsm-fill",
            "help": f"how cashmere's faults fill pages: {' or '.join(dsm.FILLS)} (default copy)",
            "default": None,
            "type": "str",
            "choices": list(dsm.FILLS),
            "launch_only": True,
        },
        {
            "name": "dsm-unsafe",
            "help": "cashmere: a page becomes unsafe once one release would notify this many readers; its writers "
            "then send no notices and its readers check its directory entry at acquires (default 0: never)",
            "default": None,
            "type": "int",
            "launch_only": True,
        },
    ]


@ckpt.hookimpl
def ckpt_job_start(job: JobInfo) -> None:
    """Refuse in one line, before anything starts, a fill policy or unsafe pages the protocol has no use for."""
    fill, protocol = job.options.get("dsm_fill"), job.options.get("dsm_protocol") or "async"
    unsafe = job.options.get("dsm_unsafe")
    if fill not in (None, "copy") and protocol != "cashmere":
        raise ckpt.CkptError(f"--dsm-fill {fill} is the cashmere protocol's: {protocol} copies whole pages")
    if unsafe is not None and int(unsafe) < 0:
        raise ckpt.CkptError(f"--dsm-unsafe {unsafe}: a number of readers (0: never unsafe)")
    if unsafe and protocol != "cashmere":
        raise ckpt.CkptError(f"--dsm-unsafe is the cashmere protocol's: {protocol} has no write notice lists")
