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
        }
    ]
