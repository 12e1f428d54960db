"""`ckpt fabric ...`: start, inspect and fault the simulated InfiniBand fabric's subnet manager."""

# Contributed to `ckpt` by the plugin's ckpt_cli_commands; imported only when `ckpt` lists or runs it.

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from ckpt import CkptError
from ckpt.plugin.cli import DEFAULT_CKPT_DIR, default_ckpt_dir, process_exists, serve_until_signal
from ckpt.verbs import fabric
from ckpt_simib import FABRIC_FILE, _service
from ckpt_simib._service import link_model

_FABRIC_START_TIMEOUT = 30.0


def _fabric_dir_option(f: Any) -> Any:
    return click.option(
        "--dir",
        "--ckpt-dir",
        "directory",
        type=click.Path(file_okay=False, path_type=Path),
        default=default_ckpt_dir,
        show_default=f"$CKPT_DIR or ./{DEFAULT_CKPT_DIR}",
        help="Directory of the fabric's fabric.json.",
    )(f)


def _fabric_locating_options(f: Any) -> Any:
    f = _fabric_dir_option(f)
    return click.option(
        "--fabric", "address", metavar="HOST:PORT", help="A running fabric (token from $CKPT_FABRIC_TOKEN)."
    )(f)


def _fabric_client(address: str | None, directory: Path) -> Any:
    """A connection to the fabric named by --fabric, else by DIR/fabric.json, else by $CKPT_FABRIC."""
    if address is None and _service.read_fabric_file(directory) is None:
        address = os.environ.get(fabric.ENV_ADDRESS) or None
    return fabric.FabricClient(*_service.locate(address, directory))


@click.group("fabric")
def fabric_group() -> None:
    """The simulated InfiniBand fabric: its subnet manager, LIDs, link states and fault injection."""


@fabric_group.command("start")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the subnet manager binds to.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="Subnet manager port (0 = any free).")
@_fabric_dir_option
@click.option("--fabric-latency", "latency", default="0", show_default=True, metavar="TIME", help="e.g. 2us.")
@click.option("--fabric-bandwidth", "bandwidth", default="0", show_default=True, metavar="RATE", help="e.g. 4GB/s.")
@click.option("--foreground", is_flag=True, help="Serve in this process until SIGTERM / SIGINT / `fabric stop`.")
def fabric_start(host: str, port: int, directory: Path, latency: str, bandwidth: str, foreground: bool) -> None:
    """Start a subnet manager in the background; print its CKPT_FABRIC / CKPT_FABRIC_TOKEN."""
    import subprocess

    model = fabric.LinkModel(*link_model(latency, bandwidth))
    directory = directory.resolve()
    running = _service.running_fabric(directory)
    if running is not None:
        raise CkptError(
            f"a fabric is already running at {running['address']} ({directory / FABRIC_FILE}); "
            f"stop it first: ckpt fabric stop --dir {directory}"
        )
    if foreground:
        _serve_fabric(fabric.SubnetManager(host, port, link_model=model), directory)
        return
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "fabric.log"
    command = [sys.executable, "-P", "-m", "ckpt", "fabric", "start", "--foreground", "--host", host]
    command += ["--port", str(port), "--dir", str(directory), "--fabric-latency", latency]
    command += ["--fabric-bandwidth", bandwidth]
    with open(log_path, "ab") as log_file:
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True
        )
    record = _wait_for_fabric(child, directory, log_path)
    click.echo(f"{fabric.ENV_ADDRESS}={record['address']}")
    click.echo(f"{fabric.ENV_TOKEN}={record['token']}")
    click.echo(
        f"ckpt fabric: subnet manager of fabric {record['fabric']} running at {record['address']} "
        f"(pid {child.pid}); stop it with: ckpt fabric stop --dir {directory}",
        err=True,
    )


def _wait_for_fabric(child: Any, directory: Path, log_path: Path) -> dict[str, Any]:
    """Poll until the background subnet manager has written its fabric.json (or has died saying why)."""
    import time

    deadline = time.monotonic() + _FABRIC_START_TIMEOUT
    while True:
        record = _service.read_fabric_file(directory)
        if record is not None and record.get("pid") == child.pid:
            return record
        if child.poll() is not None:
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("error: ")]
            reason = (
                lines[-1][len("error: ") :] if lines else f"it exited with status {child.returncode}; see {log_path}"
            )
            raise CkptError(reason)
        if time.monotonic() > deadline:
            child.kill()
            child.wait()
            raise CkptError(f"the subnet manager did not start within {_FABRIC_START_TIMEOUT:g} s; see {log_path}")
        time.sleep(0.02)  # the polling interval of a condition wait


def _serve_fabric(sm: Any, directory: Path) -> None:
    sm.start()
    _service.write_fabric_file(directory, sm)
    click.echo(f"{fabric.ENV_ADDRESS}={sm.address}")
    click.echo(f"{fabric.ENV_TOKEN}={sm.token}")
    try:
        serve_until_signal(sm.wait, "ckpt fabric")
    finally:
        sm.stop()
        _service.remove_fabric_file(directory, sm.address)


@fabric_group.command("status")
@_fabric_locating_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def fabric_status(address: str | None, directory: Path, as_json: bool) -> None:
    """Show the fabric's HCAs, their LIDs and link states, the link model and statistics."""
    with _fabric_client(address, directory) as client:
        state = client.status()
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    click.echo(
        f"fabric {state['fabric']} at {state['address']}  SM LID {state['sm_lid']}  "
        f"latency {_human_latency(state['latency'])}  bandwidth {_human_bandwidth(state['bandwidth'])}"
    )
    stats = state["statistics"]
    click.echo(
        f"statistics: {stats['hcas_registered']} HCA(s) registered ({stats['hcas_present']} present, "
        f"{stats['hcas_lost']} lost), {stats['resolves']} resolves, "
        f"{stats['links_failed']} link failure(s) injected, {stats['links_restored']} restored"
    )
    if not state["hcas"]:
        click.echo("no HCAs registered")
    for hca in state["hcas"]:
        node = f"  node {hca['node']}" if hca.get("node") else ""
        click.echo(f"  {hca['name']}  pid {hca['pid']}  host {hca['host']}{node}  endpoint {hca['endpoint']}")
        for port in hca["ports"]:
            click.echo(f"    port {port['port']}  LID {port['lid']:<6} {'up' if port['up'] else 'DOWN'}")
    for node in (n for n in state.get("nodes", []) if not n["present"]):  # cables kept for the node's next HCA
        click.echo(f"  node {node['node']} {node['name']}: no HCA on it now")
        for port in node["ports"]:
            click.echo(f"    port {port['port']}  LID {port['lid']:<6} {'up' if port['up'] else 'DOWN'}")


def _human_latency(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-9:g}ns"


def _human_bandwidth(rate: float) -> str:
    if rate == 0:
        return "unlimited"
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if rate >= scale:
            return f"{rate / scale:g}{unit}"
    return f"{rate:g}B/s"


def _lid(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise CkptError(f"bad LID {text!r}: expected a number (decimal, or hex with 0x)") from None


def _set_link(lid: str, address: str | None, directory: Path, up: bool) -> None:
    number = _lid(lid)
    with _fabric_client(address, directory) as client:
        (client.restore_link if up else client.fail_link)(number)
    click.echo(f"link of LID {number} is {'up' if up else 'down'}")


@fabric_group.command("fail-link")
@click.argument("lid")
@_fabric_locating_options
def fabric_fail_link(lid: str, address: str | None, directory: Path) -> None:
    """Take the link of port LID down (every HCA is told, as when a cable is pulled)."""
    _set_link(lid, address, directory, up=False)


@fabric_group.command("restore-link")
@click.argument("lid")
@_fabric_locating_options
def fabric_restore_link(lid: str, address: str | None, directory: Path) -> None:
    """Bring the link of port LID back up."""
    _set_link(lid, address, directory, up=True)


@fabric_group.command("stop")
@_fabric_locating_options
def fabric_stop(address: str | None, directory: Path) -> None:
    """Stop the fabric's subnet manager and remove its fabric.json."""
    try:
        client = _fabric_client(address, directory)
    except fabric.FabricError as exc:
        record = None if address else _service.read_fabric_file(directory)
        if record is None or process_exists(record.get("pid")):
            raise
        (directory / FABRIC_FILE).unlink(missing_ok=True)
        raise CkptError(f"{exc} (its process is gone: removed the stale {directory / FABRIC_FILE})") from None
    with client:
        client.stop()
    _service.remove_fabric_file(directory, client.address)
    click.echo(f"fabric {client.fabric} at {client.address} stopped")
