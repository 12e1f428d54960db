"""The `ckpt` command line: launch, checkpoint, status, restart, kill, coordinator, fabric, plugins, inspect."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckpt._errors import CkptError
from ckpt.coordinator import client as coord_client
from ckpt.coordinator import protocol

if TYPE_CHECKING:
    from ckpt._launcher import JobOptions

# launch / restart import the launcher (numpy, cloudpickle, lz4 ...) when they run, so that
# status / checkpoint / kill start quickly.

#: A restart under --debug waits at RESUME this long (seconds) for the debugged rank: practically for ever.
DEBUG_PHASE_TIMEOUT = 7 * 24 * 3600.0
#: Transport -> the plugin that provides its verbs provider (None: built in).
_TRANSPORTS: dict[str, str | None] = {"simib": None, "tcp": "ib2tcp"}


class _Group(click.Group):
    """Every CkptError becomes one line on stderr and exit status 1 — never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkptError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


def _ckpt_dir_option(f: Any) -> Any:
    return click.option(
        "--ckpt-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=lambda: os.environ.get("CKPT_DIR", "ckpt"),
        show_default="$CKPT_DIR or ./ckpt",
        help="Directory of images, manifests and coordinator.json.",
    )(f)


def _coordinator_option(f: Any) -> Any:
    return click.option(
        "--coordinator",
        envvar="CKPT_COORDINATOR",
        metavar="HOST:PORT",
        help="An existing coordinator (default: the one recorded in the ckpt dir).",
    )(f)


def _plugin_options(f: Any) -> Any:
    f = click.option("--with-plugin", "with_plugins", multiple=True, metavar="MODULE", help="Load a plugin module.")(f)
    f = click.option("--disable-plugin", "disabled", multiple=True, metavar="NAME", help="Do not load this plugin.")(f)
    return f


def _job_options(f: Any) -> Any:
    f = click.option("--interval", type=click.FloatRange(min=0.01), help="Checkpoint every SECONDS.")(f)
    f = click.option(
        "--keep",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Keep the newest K checkpoints (0 = all).",
    )(f)
    f = click.option("--host", default="127.0.0.1", show_default=True, help="Address the coordinator binds to.")(f)
    f = click.option("--port", type=click.IntRange(0, 65535), default=0, help="Coordinator port (0 = any free).")(f)
    f = click.option(
        "--transport",
        metavar="|".join(sorted(_TRANSPORTS)),
        help="Verbs provider of the ranks [launch: simib; restart: the checkpoint's].",
    )(f)
    f = click.option(
        "--phase-timeout",
        type=float,
        default=300.0,
        show_default=True,
        help="Abort a checkpoint whose phase takes longer (seconds).",
    )(f)
    f = click.option(
        "--fabric",
        envvar="CKPT_FABRIC",
        metavar="HOST:PORT",
        help="Run on an existing simulated fabric (token from $CKPT_FABRIC_TOKEN) instead of the job's own.",
    )(f)
    f = click.option("--fabric-latency", metavar="TIME", help="Link latency of the job's fabric, e.g. 2us.")(f)
    f = click.option("--fabric-bandwidth", metavar="RATE", help="Link bandwidth of the job's fabric, e.g. 4GB/s.")(f)
    f = click.option(
        "--log-level",
        default=lambda: os.environ.get("CKPT_LOG_LEVEL", "WARNING"),
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    )(f)
    return f


def _link_model(latency: str | None, bandwidth: str | None) -> tuple[float, float]:
    """(seconds, bytes/s) from --fabric-latency / --fabric-bandwidth; CkptError with one line if malformed."""
    from ckpt.verbs.fabric import parse_bandwidth, parse_latency

    try:
        return parse_latency(latency or "0"), parse_bandwidth(bandwidth or "0")
    except ValueError as exc:
        raise CkptError(str(exc)) from None


def _fabric_job_options(job: dict[str, Any], transport: str) -> None:
    """Turn the fabric options of launch / restart into JobOptions fields (in place)."""
    latency, bandwidth = job["fabric_latency"], job["fabric_bandwidth"]
    if transport != "simib" and (latency or bandwidth):
        raise CkptError(f"--fabric-latency / --fabric-bandwidth model simib's links; --transport {transport} has none")
    if job["fabric"] and (latency or bandwidth):
        raise CkptError(
            "--fabric-latency / --fabric-bandwidth set the link model of a fabric the job starts itself; "
            "an existing fabric (--fabric) keeps the one it was started with"
        )
    job["fabric_latency"], job["fabric_bandwidth"] = _link_model(latency, bandwidth)


def _check_transport(name: str, *, native: bool, disabled: list[str]) -> str:
    """`name` if its provider will be there in the ranks; one clear line otherwise."""
    if name not in _TRANSPORTS:
        raise CkptError(f"unknown transport {name!r} (available: {', '.join(sorted(_TRANSPORTS))})")
    plugin = _TRANSPORTS[name]
    if plugin is None:
        return name
    if native:
        raise CkptError(f"--transport {name} is provided by the {plugin} plugin, and --native loads no plugins")
    if plugin in disabled:
        raise CkptError(f"--transport {name} is provided by the {plugin} plugin, which --disable-plugin turns off")
    import importlib.metadata

    from ckpt.runtime.plugins import ENTRY_POINT_GROUP

    if not any(ep.name == plugin for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)):
        raise CkptError(f"--transport {name} needs the {plugin} plugin (ckpt_{plugin}), which is not installed")
    return name


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckpt")
def cli() -> None:
    """ckpt: checkpoint/restart for distributed Python programs over (simulated) verbs."""


def main() -> None:
    """The `ckpt` console script: plugin-declared options are added to launch/restart first."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("launch", "restart"):
        try:
            _add_plugin_options(argv)
        except CkptError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
    cli()


_PLUGIN_OPTION = "plugin_option_"
_OPTION_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}


def _values_of(argv: list[str], flag: str) -> list[str]:
    """Values of `flag` among ckpt's own options: scanning stops at the program file."""
    values = []
    for i, word in enumerate(argv):
        if word.endswith(".py") and Path(word).is_file():
            break  # what follows are the program's own arguments
        if word == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif word.startswith(flag + "="):
            values.append(word.split("=", 1)[1])
    return values


def _add_plugin_options(argv: list[str]) -> None:
    """Turn every plugin's ckpt_add_options() declarations into --NAME options of launch and restart."""
    from ckpt.runtime.plugins import PluginHost

    host = PluginHost().load(_values_of(argv, "--with-plugin"), _values_of(argv, "--disable-plugin"))
    taken = {opt for command in (launch, restart) for param in command.params for opt in param.opts}
    for declared in host.pm.hook.ckpt_add_options():
        for spec in declared:
            name = str(spec["name"])
            flag = f"--{name}"
            if flag in taken:
                raise CkptError(f"a plugin declares option {flag}, which is already taken")
            taken.add(flag)
            kind = spec.get("type", "str")
            extra: dict[str, Any] = {"is_flag": True} if kind == "flag" else {"type": _OPTION_TYPES[kind]}
            if spec.get("choices"):
                extra["type"] = click.Choice([str(c) for c in spec["choices"]])
            option = click.Option(
                [flag, _PLUGIN_OPTION + name.replace("-", "_")],
                default=spec.get("default"),
                help=str(spec.get("help", "")) + " (plugin option)",
                **extra,
            )
            launch.params.append(option)
            restart.params.append(option)


def _plugin_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the plugin options' values out of a command's kwargs: {"log_home": 3, ...}."""
    return {k[len(_PLUGIN_OPTION) :]: kwargs.pop(k) for k in list(kwargs) if k.startswith(_PLUGIN_OPTION)}


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--ranks", type=click.IntRange(min=1), default=1, show_default=True, help="Number of ranks.")
@_coordinator_option
@click.option("--new-coordinator", is_flag=True, help="Start an embedded coordinator even if CKPT_COORDINATOR is set.")
@_ckpt_dir_option
@_plugin_options
@_job_options
@click.option("--native", is_flag=True, help="No plugins, no checkpoint thread: the overhead baseline.")
@click.argument("program", type=click.Path())
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(
    program: str,
    args: tuple[str, ...],
    ranks: int,
    coordinator: str | None,
    new_coordinator: bool,
    ckpt_dir: Path,
    with_plugins: tuple[str, ...],
    disabled: tuple[str, ...],
    native: bool,
    **job: Any,
) -> None:
    """Run PROGRAM (a file defining one ckpt.Program) on N ranks, printing each rank's result."""
    from ckpt._launcher import JobOptions, external_rank, run_job
    from ckpt.runtime.rank import load_program

    load_program(program)  # one clear error here rather than one per rank
    options = _plugin_values(job)
    transport = _check_transport(job.pop("transport") or "simib", native=native, disabled=list(disabled))
    _fabric_job_options(job, transport)
    opts = JobOptions(
        program=str(Path(program).resolve()),
        argv=list(args),
        ranks=ranks,
        ckpt_dir=ckpt_dir.resolve(),
        coordinator=None if new_coordinator else coordinator,
        with_plugins=list(with_plugins),
        disabled=list(disabled),
        options=options,
        native=native,
        transport=transport,
        **job,
    )
    outside = external_rank()
    if outside is not None and opts.coordinator:
        _run_one_rank(opts, *outside)
    sys.exit(run_job(opts))


def _run_one_rank(opts: JobOptions, rank: int, size: int | None) -> None:
    """Under mpiexec / srun: this process is one rank of a job served by --coordinator."""
    from ckpt._launcher import rank_spec
    from ckpt.runtime import rank as rank_main

    assert opts.coordinator is not None
    opts.ranks = size or opts.ranks
    token = os.environ.get("CKPT_TOKEN")
    address, token = coord_client.locate(opts.coordinator, opts.ckpt_dir, token)
    if opts.fabric:  # otherwise each process has a private fabric: fine for one rank, not for a job
        from ckpt.verbs import fabric

        os.environ[fabric.ENV_ADDRESS], os.environ[fabric.ENV_TOKEN] = fabric.locate(opts.fabric, opts.ckpt_dir)
    spec = rank_spec(opts, rank, address, token, job="")
    spec["job"] = None
    spec["print_result"] = True
    rank_main.main(spec)


@cli.command()
@click.argument("target", required=False)
@_ckpt_dir_option
@_coordinator_option
@_plugin_options
@_job_options
@click.option(
    "--debug",
    type=click.IntRange(min=0),
    metavar="RANK",
    help="Stop RANK in pdb before its next step (it reads this terminal); the others wait until it continues.",
)
def restart(
    target: str | None,
    ckpt_dir: Path,
    coordinator: str | None,
    with_plugins: tuple[str, ...],
    disabled: tuple[str, ...],
    debug: int | None,
    **job: Any,
) -> None:
    """Restart the latest checkpoint in the ckpt dir (or TARGET: a manifest or a directory)."""
    from ckpt._launcher import JobOptions, external_rank, prepare_restart, run_job

    manifest, directory, token = prepare_restart(target, ckpt_dir, os.environ.get("CKPT_TOKEN"))
    _check_restart_plugins(manifest, list(with_plugins), list(disabled))
    options = _plugin_values(job)
    transport = _check_transport(
        job.pop("transport") or manifest.get("transport") or "simib", native=False, disabled=list(disabled)
    )
    _fabric_job_options(job, transport)
    if debug is not None:
        if debug >= int(manifest["size"]):
            raise CkptError(f"--debug {debug}: the checkpoint has ranks 0..{int(manifest['size']) - 1}")
        job["phase_timeout"] = DEBUG_PHASE_TIMEOUT  # the others wait at RESUME for as long as the debugging takes
    opts = JobOptions(
        program=manifest["program"]["path"],
        argv=list(manifest.get("argv", [])),
        ranks=int(manifest["size"]),
        ckpt_dir=directory,
        coordinator=coordinator,
        with_plugins=list(with_plugins),
        disabled=list(disabled),
        transport=transport,
        token=token,
        options=options,
        restart=manifest,
        debug=debug,
        **job,
    )
    outside = external_rank()
    if outside is not None and opts.coordinator:  # under mpiexec / srun: this process restarts one rank
        if outside[1] is not None and outside[1] != opts.ranks:
            raise CkptError(f"the checkpoint has {opts.ranks} ranks; the launcher started {outside[1]}")
        _run_one_rank(opts, *outside)
    click.echo(
        f"ckpt: restarting checkpoint {manifest['number']} of {manifest['program']['name']} "
        f"({manifest['size']} ranks, generation {manifest['generation'] + 1})",
        err=True,
    )
    sys.exit(run_job(opts))


def _check_restart_plugins(manifest: dict[str, Any], with_plugins: list[str], disabled: list[str]) -> None:
    """A plugin whose state is in the images must be loaded again, or explicitly disabled."""
    import hashlib

    from ckpt.runtime.plugins import PluginHost

    loaded = {p.name for p in PluginHost().load(with_plugins, disabled).plugins}
    for plugin in manifest.get("plugins", []):
        name = plugin.get("name")
        if name not in loaded and name not in disabled:
            raise CkptError(
                f"checkpoint {manifest['number']} was taken with plugin {name!r} ({plugin.get('version')}), "
                f"which is not loaded now: install it (or --with-plugin {plugin.get('module', name)}), "
                f"or pass --disable-plugin {name} to drop its state"
            )
    program = manifest["program"]
    if hashlib.sha256(Path(program["path"]).read_bytes()).hexdigest() != program.get("sha256"):
        click.echo(f"ckpt: warning: {program['path']} changed since checkpoint {manifest['number']}", err=True)


def _control(coordinator: str | None, ckpt_dir: Path) -> coord_client.CoordinatorClient:
    ended = None if coordinator else (coord_client.read_job_file(ckpt_dir) or {}).get("ended")
    if ended is not None:
        raise CkptError(f"the job in {ckpt_dir} has ended ({ended['state']}): {ended['message']}")
    address, token = coord_client.locate(coordinator, ckpt_dir, os.environ.get("CKPT_TOKEN"))
    return coord_client.control(address, token)


@cli.command()
@click.option("--wait", is_flag=True, help="Block until the checkpoint is written.")
@click.option("--kill", is_flag=True, help="Kill the job once the checkpoint is written.")
@_coordinator_option
@_ckpt_dir_option
def checkpoint(wait: bool, kill: bool, coordinator: str | None, ckpt_dir: Path) -> None:
    """Request a checkpoint of the running job."""
    conn = _control(coordinator, ckpt_dir)
    answer = conn.call("checkpoint", wait=wait or kill, kill=kill)
    if "checkpoint" in answer:
        last = answer["checkpoint"]
        click.echo(
            f"checkpoint {last['number']} written: {last['manifest']} "
            f"({last['bytes']} bytes, {last['seconds']:.2f} s){'; job killed' if kill else ''}"
        )
    elif answer.get("queued"):
        click.echo("checkpoint requested (it starts once every rank has joined the job)")
    else:
        click.echo(f"checkpoint {answer['number']} requested")
    conn.close()


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_coordinator_option
@_ckpt_dir_option
def status(as_json: bool, coordinator: str | None, ckpt_dir: Path) -> None:
    """Show the job's ranks, states, generation and last checkpoint."""
    ended = None if coordinator else (coord_client.read_job_file(ckpt_dir) or {}).get("ended")
    if ended is not None:
        state = ended  # the job is over: its coordinator is gone, its final status stays
    else:
        conn = _control(coordinator, ckpt_dir)
        state = conn.call("status")["status"]
        conn.close()
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    click.echo(
        f"job {state['job']}  generation {state['generation']}  state {state['state']}"
        f"{'' if state['unanimous'] else ' (not unanimous)'}  coordinator {state['coordinator']}"
    )
    for r in state["ranks"]:
        click.echo(f"  rank {r['rank']:>3}  {r['state']:<11} step {r['step']:<8} pid {r['pid']:<8} {r['host']}")
    last = state["last_checkpoint"]
    if last:
        click.echo(
            f"last checkpoint: {last['number']}  {last['manifest']}  {last['bytes']} bytes  {last['seconds']:.2f} s"
        )
    else:
        click.echo("last checkpoint: none")
    if state["message"]:
        click.echo(f"last event: {state['message']}")


@cli.command()
@_coordinator_option
@_ckpt_dir_option
def kill(coordinator: str | None, ckpt_dir: Path) -> None:
    """Kill the running job (its checkpoints stay)."""
    conn = _control(coordinator, ckpt_dir)
    conn.call("kill", reason="killed on request (ckpt kill)")
    conn.close()
    click.echo("job killed")


@cli.command("coordinator")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=7779, show_default=True)
@click.option("--interval", type=click.FloatRange(min=0.01), help="Checkpoint every SECONDS.")
@click.option("--keep", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--phase-timeout", type=float, default=300.0, show_default=True)
@_ckpt_dir_option
def coordinator_cmd(
    host: str, port: int, interval: float | None, keep: int, phase_timeout: float, ckpt_dir: Path
) -> None:
    """Run a standalone coordinator in the foreground (for ranks started by mpiexec / srun)."""
    from ckpt.coordinator.server import Coordinator

    token = os.environ.get("CKPT_TOKEN") or protocol.new_token()
    server = Coordinator(
        token=token,
        ckpt_dir=ckpt_dir,
        host=host,
        port=port,
        interval=interval,
        keep=keep,
        phase_timeout=phase_timeout,
        serve_forever=True,
    ).start()
    coord_client.write_job_file(ckpt_dir.resolve(), address=server.address, token=token, job="", pid=os.getpid())
    click.echo(f"ckpt coordinator listening on {server.address}")
    click.echo(f"export CKPT_COORDINATOR={server.address} CKPT_TOKEN={token}")

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        click.echo("ckpt coordinator: stopping", err=True)
    finally:
        server.stop()


# ----------------------------------------------------------- the simulated fabric
_FABRIC_START_TIMEOUT = 30.0


def _fabric_dir_option(f: Any) -> Any:
    return click.option(
        "--dir",
        "--ckpt-dir",
        "directory",
        type=click.Path(file_okay=False, path_type=Path),
        default=lambda: os.environ.get("CKPT_DIR", "ckpt"),
        show_default="$CKPT_DIR or ./ckpt",
        help="Directory of the fabric's fabric.json.",
    )(f)


def _fabric_locating_options(f: Any) -> Any:
    f = _fabric_dir_option(f)
    return click.option(
        "--fabric", "address", metavar="HOST:PORT", help="A running fabric (token from $CKPT_FABRIC_TOKEN)."
    )(f)


def _fabric_client(address: str | None, directory: Path) -> Any:
    """A connection to the fabric named by --fabric, else by DIR/fabric.json, else by $CKPT_FABRIC."""
    from ckpt.verbs import fabric

    if address is None and fabric.read_fabric_file(directory) is None:
        address = os.environ.get(fabric.ENV_ADDRESS) or None
    return fabric.FabricClient(*fabric.locate(address, directory))


@cli.group("fabric")
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

    from ckpt.verbs import fabric

    model = fabric.LinkModel(*_link_model(latency, bandwidth))
    directory = directory.resolve()
    running = fabric.running_fabric(directory)
    if running is not None:
        raise CkptError(
            f"a fabric is already running at {running['address']} ({directory / fabric.FABRIC_FILE}); "
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

    from ckpt.verbs import fabric

    deadline = time.monotonic() + _FABRIC_START_TIMEOUT
    while True:
        record = fabric.read_fabric_file(directory)
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
    from ckpt.verbs import fabric

    sm.start()
    fabric.write_fabric_file(directory, sm)
    click.echo(f"{fabric.ENV_ADDRESS}={sm.address}")
    click.echo(f"{fabric.ENV_TOKEN}={sm.token}")

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        sm.wait()
    except KeyboardInterrupt:
        click.echo("ckpt fabric: stopping", err=True)
    finally:
        sm.stop()
        fabric.remove_fabric_file(directory, sm.address)


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
        click.echo(f"  {hca['name']}  pid {hca['pid']}  host {hca['host']}  endpoint {hca['endpoint']}")
        for port in hca["ports"]:
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


@fabric_group.command("fail-link")
@click.argument("lid")
@_fabric_locating_options
def fabric_fail_link(lid: str, address: str | None, directory: Path) -> None:
    """Take the link of port LID down (every HCA is told, as when a cable is pulled)."""
    number = _lid(lid)
    with _fabric_client(address, directory) as client:
        client.fail_link(number)
    click.echo(f"link of LID {number} is down")


@fabric_group.command("restore-link")
@click.argument("lid")
@_fabric_locating_options
def fabric_restore_link(lid: str, address: str | None, directory: Path) -> None:
    """Bring the link of port LID back up."""
    number = _lid(lid)
    with _fabric_client(address, directory) as client:
        client.restore_link(number)
    click.echo(f"link of LID {number} is up")


@fabric_group.command("stop")
@_fabric_locating_options
def fabric_stop(address: str | None, directory: Path) -> None:
    """Stop the fabric's subnet manager and remove its fabric.json."""
    from ckpt.verbs import fabric

    try:
        client = _fabric_client(address, directory)
    except fabric.FabricError as exc:
        record = None if address else fabric.read_fabric_file(directory)
        if record is None or _process_exists(record.get("pid")):
            raise
        (directory / fabric.FABRIC_FILE).unlink(missing_ok=True)
        raise CkptError(f"{exc} (its process is gone: removed the stale {directory / fabric.FABRIC_FILE})") from None
    with client:
        client.stop()
    fabric.remove_fabric_file(directory, client.address)
    click.echo(f"fabric {client.fabric} at {client.address} stopped")


def _process_exists(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@cli.command()
@_plugin_options
@click.option("--json", "as_json", is_flag=True)
def plugins(with_plugins: tuple[str, ...], disabled: tuple[str, ...], as_json: bool) -> None:
    """List the installed plugins, their versions and the hooks they implement."""
    from ckpt.runtime.hookspecs import CKPT_PLUGIN_API
    from ckpt.runtime.plugins import PluginHost

    host = PluginHost().load(list(with_plugins), list(disabled))
    if as_json:
        click.echo(json.dumps([vars(p) | {"hooks": list(p.hooks)} for p in host.plugins], indent=2))
        return
    click.echo(f"plugin API {CKPT_PLUGIN_API}; {len(host.plugins)} plugin(s)")
    for p in host.plugins:
        click.echo(f"  {p.name} {p.version}  ({p.module}, {p.source}, order {p.order})")
        click.echo(f"      hooks: {', '.join(p.hooks) or 'none'}")


@cli.command()
@click.argument("image", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect(image: Path, as_json: bool) -> None:
    """Show an image's header, sizes, checksum and largest objects (exit 1 if it is damaged)."""
    from ckpt.runtime.images import inspect_image

    report = inspect_image(image)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    if not report.get("ok", True):
        raise CkptError(f"image {image} is damaged: {report.get('problem')}")


def _print_report(report: dict[str, Any]) -> None:
    for key, value in report.items():
        if key == "objects":
            click.echo("largest objects:")
            for obj in value:
                click.echo(f"  {obj['bytes']:>14,}  {obj['type']:<28} {obj['path']}")
        elif key == "header" and isinstance(value, dict):
            click.echo("header:")
            for k, v in value.items():
                if k != "objects":
                    click.echo(f"  {k}: {v}")
        else:
            click.echo(f"{key}: {value}")
