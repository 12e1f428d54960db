"""Test fixture: a third-party plugin (two instances, stacked) that records every event it sees.

Installed through the `ckpt.plugins` entry-point group by the dist-info beside
it.  Each instance appends "<name> <event> ..." lines to
$CKPT_RECORDER_DIR/rank<R>.log, exchanges values with the other ranks through
the key-value store at drain and at restart, and keeps a VirtualIdTable in the
image whose virtual IDs must survive a restart while its real IDs change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ckpt
from ckpt.plugin import VirtualIdTable


class Recorder:
    CKPT_PLUGIN_API = 2

    def __init__(self, name: str, order: int) -> None:
        self.name = name
        self.CKPT_PLUGIN_ORDER = order
        self.__version__ = "1.2"
        self.table: VirtualIdTable[str] | None = None
        self.checkpoints = 0

    def _log(self, rt: ckpt.Runtime, *words: object) -> None:
        directory = os.environ.get("CKPT_RECORDER_DIR")
        if directory:
            with open(Path(directory) / f"rank{rt.rank}.log", "a") as f:
                f.write(" ".join([self.name, *map(str, words)]) + "\n")

    @ckpt.hookimpl
    def ckpt_add_options(self) -> list[dict[str, Any]]:
        if self.name != "recorder_a":
            return []
        return [{"name": "recorder-tag", "type": "str", "default": "none", "help": "A word logged at init."}]

    @ckpt.hookimpl
    def ckpt_init(self, rt: ckpt.Runtime) -> None:
        self._log(rt, "init", os.getpid(), f"tag={rt.options.get('recorder_tag')}")
        if self.table is None:
            self.table = VirtualIdTable(self.name)
            self.virtual = self.table.add(f"real-{os.getpid()}")
            self.global_virtual = self.table.add(f"global-{os.getpid()}", global_id=True)

    @ckpt.hookimpl
    def ckpt_presuspend(self, rt: ckpt.Runtime) -> None:
        self._log(rt, "presuspend", rt.step)

    @ckpt.hookimpl
    def ckpt_drain(self, rt: ckpt.Runtime) -> None:
        self.checkpoints += 1
        key = f"{self.name}:drain{self.checkpoints}:"
        rt.kv.publish("recorder", f"{key}{rt.rank}", rt.rank * 10)
        seen = rt.kv.subscribe_prefix("recorder", key, count=rt.size, timeout=30)
        self._log(rt, "drain", sum(seen.values()))

    @ckpt.hookimpl
    def ckpt_precheckpoint(self, rt: ckpt.Runtime, image: Any) -> None:
        self._log(rt, "precheckpoint")
        image.add(
            self.name,
            {
                "table": self.table,
                "virtual": self.virtual,
                "global": self.global_virtual,
                "checkpoints": self.checkpoints,
            },
        )

    @ckpt.hookimpl
    def ckpt_checkpointed(self, rt: ckpt.Runtime, info: dict[str, Any]) -> None:
        self._log(rt, "checkpointed", info["number"])

    @ckpt.hookimpl
    def ckpt_resume(self, rt: ckpt.Runtime, restarted: bool, aborted: bool) -> None:
        self._log(rt, "resume", f"restarted={restarted}", f"aborted={aborted}")

    @ckpt.hookimpl
    def ckpt_restart(self, rt: ckpt.Runtime, image: Any) -> None:
        state = image.get(self.name)
        self.table, self.virtual, self.global_virtual = state["table"], state["virtual"], state["global"]
        self.checkpoints = state["checkpoints"]
        old = self.table.real(self.virtual)
        self.table.update(self.virtual, f"real-{os.getpid()}")
        fresh = self.table.add(f"after-{os.getpid()}", global_id=True)
        self._log(
            rt,
            "restart",
            f"virtual={self.virtual}",
            f"old={old}",
            f"new={self.table.real(self.virtual)}",
            f"global={self.global_virtual}",
            f"fresh={fresh}",
        )
        rt.kv.publish("recorder", f"{self.name}:restart:{rt.rank}", os.getpid())

    @ckpt.hookimpl
    def ckpt_refresh(self, rt: ckpt.Runtime) -> None:
        pids = rt.kv.subscribe_prefix("recorder", f"{self.name}:restart:", count=rt.size, timeout=30)
        self._log(rt, "refresh", len(pids))

    @ckpt.hookimpl
    def ckpt_exit(self, rt: ckpt.Runtime) -> None:
        self._log(rt, "exit")


lower = Recorder("recorder_a", 10)
upper = Recorder("recorder_b", 20)
