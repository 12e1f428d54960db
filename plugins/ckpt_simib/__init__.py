"""ckpt_simib: the simulated InfiniBand fabric as ckpt's default transport, and `ckpt fabric`.

The fabric itself -- the HCA engine, the subnet manager (`SubnetManager`), its
client and the link model -- is a library in `ckpt.verbs`, so `ckpt.verbs`
works in one process on its own.  This plugin makes it a transport of jobs:
it declares `simib` (the default, and native: `--native` ranks have it), adds
`--fabric`, `--fabric-latency` and `--fabric-bandwidth` to launch / restart
(recorded in the manifest, so a restart gets the same link model; `--fabric`
names a running fabric and is not reused), starts each job's own subnet
manager and records it in the ckpt dir's fabric.json, and adds the
`ckpt fabric` command group (start, status, fail-link, restore-link, stop).

Kept light: the hooks import the fabric's code when they run, so `ckpt`
start-up and the ranks pay only for this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt.plugin import JobInfo, PluginOption, Runtime, Transport, hookimpl

if TYPE_CHECKING:
    import click

__all__ = ["FABRIC_FILE", "TRANSPORT"]
__version__ = "0.1.0"
CKPT_PLUGIN_API = 2
#: The transport's name: `ckpt launch --transport simib`, and the verbs provider ckpt.verbs has built in.
TRANSPORT = "simib"
#: Where a running fabric is recorded in its directory (mode 0600: it holds the token).
FABRIC_FILE = "fabric.json"


@hookimpl
def ckpt_transports() -> list[Transport]:
    return [Transport(TRANSPORT, "the simulated InfiniBand fabric and its subnet manager", default=True, native=True)]


@hookimpl
def ckpt_add_options() -> list[PluginOption]:
    return [
        {
            "name": "fabric",
            "help": "Run on an existing simulated fabric (token from $CKPT_FABRIC_TOKEN) instead of the job's own.",
            "metavar": "HOST:PORT",
            "envvar": "CKPT_FABRIC",
            "per_run": True,  # an address of today: a restart starts a fresh fabric unless given one again
        },
        {"name": "fabric-latency", "help": "Link latency of the job's fabric, e.g. 2us.", "metavar": "TIME"},
        {"name": "fabric-bandwidth", "help": "Link bandwidth of the job's fabric, e.g. 4GB/s.", "metavar": "RATE"},
    ]


@hookimpl
def ckpt_init(rt: Runtime) -> None:
    """The rank's HCAs stand for node "rank<R>" of the fabric ($CKPT_SIMIB_NODE, if the job has it, is a pattern
    with ``{rank}``): a restarted or respawned rank gets its ports' LIDs back, and a link that failed before is
    still down, as on a cluster whose cable nobody replaced (docs/verbs.md, "Nodes")."""
    import os

    from ckpt.verbs.fabric import ENV_NODE

    os.environ[ENV_NODE] = node_of(rt.rank, os.environ.get(ENV_NODE))


def node_of(rank: int, pattern: str | None) -> str:
    """The node of `rank`: `pattern` with ``{rank}`` filled in (one node for every rank without it), else rank<R>."""
    if not pattern:
        return f"rank{rank}"
    return pattern.replace("{rank}", str(rank))


@hookimpl
def ckpt_job_start(job: JobInfo) -> dict[str, str] | None:
    from ckpt_simib import _service

    return _service.job_start(job)


@hookimpl
def ckpt_job_stop(job: JobInfo) -> None:
    from ckpt_simib import _service

    _service.job_stop(job)


@hookimpl
def ckpt_cli_commands() -> list[click.Command]:
    from ckpt_simib._cli import fabric_group

    return [fabric_group]
