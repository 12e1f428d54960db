"""The `ckpt` command line: launch and restart here; the other commands in _cli_control and plugins."""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from ckpt import _jobdir as jobdir
from ckpt import _sched as sched
from ckpt._cli_common import ckpt_dir_option, coordinator_option, plugin_options
from ckpt._cli_control import checkpoint, coordinator_cmd, inspect, kill, plugins, status
from ckpt._errors import CkptError
from ckpt.coordinator import client as coord_client

if TYPE_CHECKING:
    from ckpt._launcher import JobOptions

# launch / restart import the launcher (numpy, cloudpickle, lz4 ...) when they run, and plugins are
# loaded only by the commands that need them (launch, restart, a plugin's own command, --help), so
# that status / checkpoint / kill start quickly.

#: A restart under --debug waits at RESUME this long (seconds) for the debugged rank: practically for ever.
DEBUG_PHASE_TIMEOUT = 7 * 24 * 3600.0
#: Job settings a restart takes from the checkpoint's manifest unless its command line gives them.
_RECORDED_SETTINGS = ("interval", "keep", "phase_timeout", "rank_interval", "on_failure")


class _Group(click.Group):
    """Every CkptError becomes one line on stderr and exit status 1 — never a traceback.

    Beside the core commands, the group has those installed plugins add (ckpt_cli_commands), loaded
    only when a command that is not a core one is asked for, or the list of them (--help).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plugin_commands: dict[str, click.Command] | None = None

    def _plugin_commands(self) -> dict[str, click.Command]:
        if self.plugin_commands is None:
            from ckpt._cli_plugins import plugin_commands

            self.plugin_commands = plugin_commands(self.commands)
        return self.plugin_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self._plugin_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands.get(cmd_name) or self._plugin_commands().get(cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkptError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


def _job_options(f: Any) -> Any:
    f = click.option(
        "--interval",
        type=click.FloatRange(min=0),
        help="Checkpoint every SECONDS (0: never)  [default: only on request; restart: the checkpoint's]",
    )(f)
    f = click.option(
        "--rank-interval",
        type=click.FloatRange(min=0),
        help="Checkpoint each rank alone every SECONDS, staggered over the ranks, while the others run on "
        "(0: never)  [default: never; restart: the checkpoint's]",
    )(f)
    f = click.option(
        "--keep",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Keep the newest K checkpoints (0 = all) [restart: the checkpoint's].",
    )(f)
    f = click.option("--host", default="127.0.0.1", show_default=True, help="Address the coordinator binds to.")(f)
    f = click.option("--port", type=click.IntRange(0, 65535), default=0, help="Coordinator port (0 = any free).")(f)
    f = click.option(
        "--transport",
        metavar="NAME",  # the installed ones' names, once plugins are loaded (_add_plugin_options)
        help="The network the ranks run on, one an installed plugin provides [launch: the default one; "
        "restart: the checkpoint's].",
    )(f)
    f = click.option(
        "--phase-timeout",
        type=click.FloatRange(min=0.01),
        default=300.0,
        show_default=True,
        help="Abort a checkpoint whose phase takes longer (seconds) [restart: the checkpoint's].",
    )(f)
    f = click.option(
        "--on-failure",
        type=click.Choice(["abort", "recover"]),
        default="abort",
        show_default=True,
        help="What a lost rank does: abort (the job fails) or recover (it is respawned from its own latest "
        "image while the others run on; every plugin with cross-rank state must support it) [restart: the "
        "checkpoint's].",
    )(f)
    f = click.option(
        "--sched",
        type=click.Choice(list(sched.POLICIES)),
        envvar=sched.ENV,
        show_envvar=True,
        default=sched.DEFAULT,
        show_default=True,
        help="CPU scheduling policy of this command, the coordinator it embeds and the ranks it runs: batch "
        "(no wake-up preemption; faster when the ranks' threads outnumber the cores) or other (the system's "
        "default); a policy set from outside (chrt: idle, real-time) is kept [per run: a restart takes its own].",
    )(f)
    f = click.option(
        "--log-level",
        default=lambda: os.environ.get("CKPT_LOG_LEVEL", "WARNING"),
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        show_default="$CKPT_LOG_LEVEL or WARNING",
        help="What the launcher, coordinator and ranks log on stderr (DEBUG: every phase and message).",
    )(f)
    return f


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckpt")
def cli() -> None:
    """ckpt: checkpoint/restart for distributed Python programs over (simulated) verbs."""


#: What the machine refuses with, when nothing else said it in a line of its own: a full disk, a read-only or
#: foreign directory, too many open files -- the file and the reason are the whole message.
_REFUSALS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE})


def main() -> None:
    """The `ckpt` console script: plugin-declared options are added to launch/restart first; every error
    a user can make is one line on stderr (usage errors exit 2, the others 1)."""
    argv = sys.argv[1:]
    try:
        if argv and argv[0] in ("launch", "restart"):
            _apply_sched(argv)
            _add_plugin_options(argv)
        code = cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "ckpt"
        click.echo(f"error: {exc.format_message()} (see: {where} --help)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("ckpt: aborted", err=True)
        sys.exit(1)
    except CkptError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        if exc.errno not in _REFUSALS:
            raise  # not the machine refusing: a bug, with its traceback
        where = "".join(f": {name}" for name in (exc.filename, exc.filename2) if name)
        click.echo(f"error: {exc.strerror or exc}{where}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


_PLUGIN_OPTION = "plugin_option_"
_OPTION_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}
#: The plugin options whose value belongs to one run ("per_run"): a restart does not take it from the manifest.
_PER_RUN: set[str] = set()


def _own_words(argv: list[str]) -> list[str]:
    """ckpt's own words of a command line: up to the program file, after which come the program's arguments."""
    for i, word in enumerate(argv):
        if word.endswith(".py") and Path(word).is_file():
            return argv[:i]
    return argv


def _values_of(argv: list[str], flag: str) -> list[str]:
    """Values of `flag` among ckpt's own options."""
    words, values = _own_words(argv), []
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            values.append(words[i + 1])
        elif word.startswith(flag + "="):
            values.append(word.split("=", 1)[1])
    return values


def _apply_sched(argv: list[str]) -> None:
    """--sched (or $CKPT_SCHED), applied before anything starts a thread -- numpy's BLAS threads start when a
    plugin imports it -- so that every thread and process of the job inherits it; a wrong value is left to the
    option's check."""
    if {"-h", "--help"} & set(_own_words(argv)):
        return  # no job runs
    policy = [os.environ.get(sched.ENV) or sched.DEFAULT, *_values_of(argv, "--sched")][-1]
    if policy in sched.POLICIES:
        sched.apply(policy)


def _add_plugin_options(argv: list[str]) -> None:
    """Turn every plugin's ckpt_add_options() declarations into --NAME options of launch and restart
    (of launch only, for a "launch_only" option: the choice is in the images)."""
    from ckpt._cli_plugins import launcher_host, offered_transports

    with_plugins, disabled = _values_of(argv, "--with-plugin"), _values_of(argv, "--disable-plugin")
    host = launcher_host(tuple(dict.fromkeys(with_plugins)), tuple(disabled))
    names = "|".join(sorted(offered_transports(host)))
    for command in (launch, restart):  # --help shows what --transport accepts here
        for param in command.params:
            if param.name == "transport" and names:
                param.metavar = names
    taken = {opt for command in (launch, restart) for param in command.params for opt in param.opts}
    added = {param.name for param in launch.params if (param.name or "").startswith(_PLUGIN_OPTION)}
    for declared in host.call("ckpt_add_options"):  # down: the lower plugin's options first in --help
        for spec in declared:
            name = str(spec["name"])
            flag = f"--{name}"
            if _PLUGIN_OPTION + name.replace("-", "_") in added:
                continue  # main() ran before in this process (tests): the option is there already
            if flag in taken:
                raise CkptError(f"a plugin declares option {flag}, which is already taken")
            taken.add(flag)
            kind = spec.get("type", "str")
            extra: dict[str, Any] = {"is_flag": True} if kind == "flag" else {"type": _OPTION_TYPES[kind]}
            if spec.get("choices"):
                extra["type"] = click.Choice([str(c) for c in spec["choices"]])
            if spec.get("metavar"):
                extra["metavar"] = spec["metavar"]
            if spec.get("envvar"):
                extra.update(envvar=spec["envvar"], show_envvar=True)
            if spec.get("per_run"):
                _PER_RUN.add(name.replace("-", "_"))
            option = click.Option(
                [flag, _PLUGIN_OPTION + name.replace("-", "_")],
                default=spec.get("default"),
                help=str(spec.get("help", "")) + " (plugin option)",
                **extra,
            )
            launch.params.append(option)
            if not spec.get("launch_only"):
                restart.params.append(option)


def _plugin_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the plugin options' values out of a command's kwargs: {"log_home": 3, ...}."""
    return {k[len(_PLUGIN_OPTION) :]: kwargs.pop(k) for k in list(kwargs) if k.startswith(_PLUGIN_OPTION)}


def _configure_logging(level: str) -> None:
    """The launcher's (and embedded coordinator's) log lines, in the ranks' format."""
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.WARNING),
        format="[launcher] %(levelname)s %(name)s: %(message)s",
    )


def _recorded_plugins(manifest: dict[str, Any], disabled: tuple[str, ...]) -> list[str]:
    """The --with-plugin modules the checkpoint recorded, but those whose plugin --disable-plugin drops."""
    names = {p.get("module"): p.get("name") for p in manifest.get("plugins", [])}
    return [m for m in manifest.get("with_plugins", []) if names.get(m, m.rpartition(".")[2]) not in disabled]


def _interval(seconds: float | None, flag: str = "--interval") -> float | None:
    """--interval, --rank-interval: 0 turns interval checkpoints off (a restart's way to drop the recorded one)."""
    if seconds is not None and 0 < seconds < 0.01:
        raise CkptError(f"{flag} {seconds:g}: at least 0.01 s (or 0: no interval checkpoints)")
    return seconds or None


def _refuse_split_launch(outside: tuple[int, int | None] | None, coordinator: str | None) -> None:
    """Under mpiexec / srun every process would start a job of its own without --coordinator."""
    if outside is not None and (outside[1] or 1) > 1 and not coordinator:
        raise CkptError(
            f"this process is rank {outside[0]} of {outside[1]} under an external launcher: give every rank "
            "--coordinator HOST:PORT of a `ckpt coordinator` (README: external launchers)"
        )


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("-n", "--ranks", type=click.IntRange(min=1), default=1, show_default=True, help="Number of ranks.")
@coordinator_option
@click.option("--new-coordinator", is_flag=True, help="Start an embedded coordinator even if CKPT_COORDINATOR is set.")
@ckpt_dir_option
@plugin_options
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
    """Run PROGRAM (a file defining one ckpt.Program) on N ranks, printing each rank's result.

    ckpt's options come before PROGRAM; what follows it are the program's own arguments (rt.argv).
    """
    from ckpt._cli_plugins import resolve_transport
    from ckpt._launcher import JobOptions, external_rank, run_job
    from ckpt._program import load_program

    job.pop("sched")  # applied by main() before anything started (`_apply_sched`)
    _configure_logging(job["log_level"])
    ckpt_dir = ckpt_dir.resolve()
    coordinator = None if new_coordinator else coordinator
    outside = external_rank()
    _refuse_split_launch(outside, coordinator)
    if native and job["on_failure"] == "recover":
        raise CkptError("--on-failure recover needs the checkpoint thread, and --native runs without one")
    claim = jobdir.claim(ckpt_dir) if coordinator is None else None
    load_program(program)  # one clear error here rather than one per rank
    job["interval"] = _interval(job["interval"])
    job["rank_interval"] = _interval(job["rank_interval"], "--rank-interval")
    options = _plugin_values(job)
    with_plugins = tuple(dict.fromkeys(with_plugins))
    transport = resolve_transport(with_plugins, disabled, job.pop("transport"), native=native)
    opts = JobOptions(
        program=str(Path(program).resolve()),
        argv=list(args),
        ranks=ranks,
        ckpt_dir=ckpt_dir,
        coordinator=coordinator,
        with_plugins=list(with_plugins),
        disabled=list(disabled),
        options=options,
        native=native,
        transport=transport,
        claim=claim,
        **job,
    )
    if outside is not None and opts.coordinator:
        _run_one_rank(opts, *outside)
    sys.exit(run_job(opts))


def _run_one_rank(opts: JobOptions, rank: int, size: int | None) -> None:
    """Under mpiexec / srun: this process is one rank of a job served by --coordinator.

    The plugins' job services run in this process too (JobInfo.external_rank says so: they start
    nothing the job shares, only locate what their options name) and their environment is the rank's.
    """
    from ckpt._launcher import job_services, rank_spec
    from ckpt.runtime import rank as rank_main

    assert opts.coordinator is not None
    opts.ranks = size or opts.ranks
    token = os.environ.get("CKPT_TOKEN")
    address, token = coord_client.locate(opts.coordinator, opts.ckpt_dir, token)
    services = job_services(opts, job="", external_rank=rank)
    os.environ.update(services.start())
    try:
        spec = rank_spec(opts, rank, address, token, job="")
        spec["job"] = None
        spec["print_result"] = True
        rank_main.main(spec)
    finally:
        services.stop()


@cli.command()
@click.argument("target", required=False)
@ckpt_dir_option
@coordinator_option
@plugin_options
@_job_options
@click.option(
    "--debug",
    type=click.IntRange(min=0),
    metavar="RANK",
    help="Stop RANK in pdb before its next step (it reads this terminal); the others wait until it continues.",
)
@click.option(
    "--rank",
    "recover_rank",
    type=click.IntRange(min=0),
    metavar="R",
    help="Restart failed rank R alone, in this process, from its latest image, into the running job "
    "(--on-failure recover; found through --ckpt-dir or --coordinator); it prints its own result.",
)
def restart(
    target: str | None,
    ckpt_dir: Path,
    coordinator: str | None,
    with_plugins: tuple[str, ...],
    disabled: tuple[str, ...],
    debug: int | None,
    recover_rank: int | None,
    **job: Any,
) -> None:
    """Restart the latest checkpoint in the ckpt dir (or TARGET: a manifest or a directory).

    The job runs again with the plugins, plugin options and settings its manifest recorded; options given
    here override them.  With --rank R, only failed rank R of the running job starts again.
    """
    from ckpt._cli_plugins import resolve_transport
    from ckpt._launcher import JobOptions, external_rank, run_job
    from ckpt._restart_point import prepare_restart, restart_directory

    job.pop("sched")  # applied by main() before anything started (`_apply_sched`)
    _configure_logging(job["log_level"])
    if recover_rank is not None:
        _restart_one_rank(recover_rank, ckpt_dir.resolve(), coordinator, with_plugins, disabled, job["log_level"])
    directory, manifest_path = restart_directory(target, ckpt_dir)
    outside = external_rank()
    _refuse_split_launch(outside, coordinator)
    claim = jobdir.claim(directory, create=False) if coordinator is None else None
    manifest, token = prepare_restart(manifest_path, directory, os.environ.get("CKPT_TOKEN"))
    with_plugins = tuple(dict.fromkeys([*_recorded_plugins(manifest, disabled), *with_plugins]))
    _check_restart_plugins(manifest, list(with_plugins), list(disabled))
    context = click.get_current_context()
    given = {name for name in context.params if context.get_parameter_source(name) != ParameterSource.DEFAULT}
    values = _plugin_values(job)  # every plugin option, given or default
    reused = {k: v for k, v in manifest.get("options", {}).items() if k not in _PER_RUN}
    options = {
        **values,
        **reused,
        **{k: v for k, v in values.items() if _PLUGIN_OPTION + k in given or k in _PER_RUN},
    }
    for name in _RECORDED_SETTINGS:
        recorded = manifest.get("settings", {}).get(name)
        if name not in given and recorded is not None:
            job[name] = recorded
    job["interval"] = _interval(job["interval"])
    job["rank_interval"] = _interval(job["rank_interval"], "--rank-interval")
    transport = resolve_transport(
        with_plugins, disabled, job.pop("transport") or manifest.get("transport") or None, native=False
    )
    if debug is not None:
        if debug >= int(manifest["size"]):
            raise CkptError(f"--debug {debug}: the checkpoint has ranks 0..{int(manifest['size']) - 1}")
        job["recorded_phase_timeout"] = job["phase_timeout"]  # what its checkpoints record: not the debug wait
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
        claim=claim,
        **job,
    )
    if outside is not None and opts.coordinator:  # under mpiexec / srun: this process restarts one rank
        if outside[1] is not None and outside[1] != opts.ranks:
            raise CkptError(f"the checkpoint has {opts.ranks} ranks; the launcher started {outside[1]}")
        _run_one_rank(opts, *outside)
    sys.exit(run_job(opts))


def _restart_one_rank(
    rank: int,
    ckpt_dir: Path,
    coordinator: str | None,
    with_plugins: tuple[str, ...],
    disabled: tuple[str, ...],
    log_level: str,
) -> None:
    """`ckpt restart --rank R`: run failed rank R's next incarnation in this process, from its latest image."""
    from ckpt import _manifest as manifests
    from ckpt import _wire as wire
    from ckpt._cli_control import live_job_status
    from ckpt._cli_plugins import launcher_host
    from ckpt._launcher import JobOptions, job_services, recovery_spec
    from ckpt.runtime import rank as rank_main

    state, address, token = live_job_status(coordinator, ckpt_dir)
    if state.get("on_failure") != "recover":
        raise CkptError(
            f"job {state['job']} does not run under --on-failure recover: its ranks cannot be restarted alone "
            "(ckpt restart without --rank restarts the whole job from its latest checkpoint once it has ended)"
        )
    ranks = {int(r["rank"]): r for r in state["ranks"]}
    if rank not in ranks:
        raise CkptError(f"job {state['job']} has no rank {rank} (it has ranks 0..{int(state['size']) - 1})")
    if ranks[rank]["state"] != "failed":
        raise CkptError(f"rank {rank} of job {state['job']} has not failed (it is {ranks[rank]['state']})")
    number = ranks[rank].get("latest_image")
    if number is None:  # the coordinator, not the directory, knows which image is of this run
        raise CkptError(f"the coordinator of job {state['job']} names no image of rank {rank} to restart it from")
    directory = Path(state["ckpt_dir"])
    program = str(state.get("program") or "")
    path = directory / manifests.manifest_name(program, int(number))
    manifest = manifests.read_manifest(path, token=wire.token_bytes(token))
    # the rank runs with the plugins the job runs with: those its checkpoint recorded, not every one installed
    modules = list(dict.fromkeys([*manifest.with_plugins, *with_plugins]))
    recorded = {str(p.get("name")) for p in manifest.plugins}
    installed = {p.name for p in launcher_host(tuple(modules), ()).plugins}
    opts = JobOptions(
        program=manifest.program.path,
        argv=list(manifest.argv),
        ranks=manifest.size,
        ckpt_dir=directory,
        transport=manifest.transport,
        coordinator=address,
        with_plugins=modules,
        disabled=sorted({*disabled, *(installed - recorded)}),
        options=dict(manifest.options),
        log_level=log_level,
        on_failure="recover",
    )
    spec = recovery_spec(
        opts, rank, int(ranks[rank]["incarnation"]) + 1, int(number), address, token, str(state["job"])
    )
    spec["print_result"] = True  # no launcher prints it: as a rank under an external launcher does
    services = job_services(opts, job=str(state["job"]), external_rank=rank)
    os.environ.update(services.start())
    try:
        rank_main.main(spec)
    finally:
        services.stop()


def _check_restart_plugins(manifest: dict[str, Any], with_plugins: list[str], disabled: list[str]) -> None:
    """A plugin whose state is in the images must be loaded again, or explicitly disabled."""
    import hashlib

    from ckpt._cli_plugins import launcher_host

    loaded = {p.name for p in launcher_host(tuple(with_plugins), tuple(disabled)).plugins}
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


for _command in (checkpoint, status, kill, coordinator_cmd, plugins, inspect):
    cli.add_command(_command)
