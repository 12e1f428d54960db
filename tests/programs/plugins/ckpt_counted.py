"""A test transport from outside ckpt: `counted`, simib's engine under another name, counting every verbs call.

Everything a third-party transport needs, through the public contract only:
ckpt_transports declares it, ckpt_verbs_providers builds its table in the
ranks, ckpt_job_start / ckpt_job_stop run its subnet manager beside the job
(a job on another transport gets nothing from it), and ckpt_exit leaves the
count of this generation's calls in the ckpt dir: counted.<rank>.<generation>.
The launcher logs each start and stop in counted.log there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ckpt
from ckpt import verbs
from ckpt.plugin import JobInfo, Transport
from ckpt.verbs import fabric

CKPT_PLUGIN_API = 2
NAME = "counted"
LOG = "counted.log"

calls = 0
_fabrics: dict[Path, fabric.SubnetManager] = {}


@ckpt.hookimpl
def ckpt_transports() -> list[Transport]:
    return [Transport(NAME, "simib's engine, every call counted (a test)")]


def _counting(entry: Any) -> Any:
    def counted(*args: Any) -> Any:
        global calls
        calls += 1
        return entry(*args)

    return counted


def _make_ops() -> verbs.VerbsOps:
    inner = verbs.engine_ops(NAME)  # HCAs named counted0 ..., peers found through the job's subnet manager
    return verbs.VerbsOps(NAME, **{name: _counting(getattr(inner, name)) for name in verbs.OPERATIONS})


@ckpt.hookimpl
def ckpt_verbs_providers() -> dict[str, Any]:
    return {NAME: _make_ops}


@ckpt.hookimpl
def ckpt_job_start(job: JobInfo) -> dict[str, str] | None:
    with open(job.ckpt_dir / LOG, "a") as log:
        log.write(f"start {job.transport} restarted={job.restarted}\n")
    if job.transport != NAME:
        return None
    sm = fabric.SubnetManager(host=job.host).start()
    _fabrics[job.ckpt_dir] = sm
    return {fabric.ENV_ADDRESS: sm.address, fabric.ENV_TOKEN: sm.token}


@ckpt.hookimpl
def ckpt_job_stop(job: JobInfo) -> None:
    sm = _fabrics.pop(job.ckpt_dir, None)
    if sm is not None:
        sm.stop()
    with open(job.ckpt_dir / LOG, "a") as log:
        log.write(f"stop {job.transport}\n")


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    path = Path(rt.ckpt_dir, f"counted.{rt.rank}.{rt.generation}")
    path.write_text(json.dumps({"calls": calls, "transport": rt.device}))
