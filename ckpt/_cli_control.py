"""The `ckpt` commands that talk to a running job or read a directory: checkpoint, status, kill,
coordinator, plugins, inspect."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import click

from ckpt import _jobdir as jobdir
from ckpt import _wire as wire
from ckpt._cli_common import ckpt_dir_option, coordinator_option, plugin_options, serve_until_signal
from ckpt._errors import CkptError, ImageError
from ckpt.coordinator import client as coord_client

#: How long `checkpoint` and `kill` wait for a job that is still starting (its launcher holds the
#: directory, its coordinator is not up yet) before they give up ...
STARTING_WAIT = 30.0
#: ... and for a job to appear in a directory that has none yet (`ckpt launch ... &` was just typed).
APPEARING_WAIT = 5.0
#: A job's states once it is over (and a rank's, for `_long_waits`): nothing reported while it ran is shown then.
ENDED = ("failed", "killed", "finished", "fallback")


def _latest_hint(ckpt_dir: Path) -> str:
    from ckpt import _manifest as manifests

    try:
        latest = manifests.latest_manifest(ckpt_dir)
    except ImageError:
        return "; there is no checkpoint to restart from"
    return f"; its latest checkpoint is {latest.name}: ckpt restart --ckpt-dir {ckpt_dir}"


def _live_job(ckpt_dir: Path, *, wait: float) -> dict[str, Any]:
    """The job file of the job running in `ckpt_dir`; one clear line if there is none."""
    found = jobdir.find_job(ckpt_dir, wait=wait, wait_none=min(wait, APPEARING_WAIT))
    if found.state == "live":
        assert found.record is not None
        return found.record
    if found.state == "ended":
        assert found.record is not None
        ended = found.record["ended"]
        raise CkptError(f"the job in {ckpt_dir} has ended ({ended['state']}): {ended['message']}")
    if found.state == "starting":
        pid = (found.holder or {}).get("pid")
        raise CkptError(f"the job in {ckpt_dir} is still starting (launcher pid {pid}); try again in a moment")
    if found.state == "gone":
        pid = (found.record or {}).get("pid")
        raise CkptError(
            f"no job is running in {ckpt_dir}: its launcher (pid {pid}) exited without recording an end"
            f"{_latest_hint(ckpt_dir)}"
        )
    raise CkptError(
        f"no job in {ckpt_dir} (no {jobdir.JOB_FILE} there): pass --ckpt-dir of a running job "
        "or --coordinator HOST:PORT"
    )


def _control(
    coordinator: str | None, ckpt_dir: Path, *, wait: float = STARTING_WAIT
) -> tuple[coord_client.CoordinatorClient, str | None]:
    """A control connection to the job (--coordinator / $CKPT_COORDINATOR, else the one in the ckpt dir),
    and the claim id of the launcher holding the directory (None with --coordinator)."""
    token = os.environ.get("CKPT_TOKEN")
    if coordinator:
        return coord_client.control(*coord_client.locate(coordinator, ckpt_dir, token)), None
    record = _live_job(ckpt_dir, wait=wait)
    conn = coord_client.control(str(record["address"]), token or str(record["token"]))
    ends_with_its_job = not record.get("standalone")  # a standalone coordinator outlives its jobs
    return conn, (str(record.get("claim") or "") or None) if ends_with_its_job else None


def live_job_status(coordinator: str | None, ckpt_dir: Path) -> tuple[dict[str, Any], str, str]:
    """(status, address, token) of the job running in `ckpt_dir` (or at --coordinator): one clear line if none."""
    token = os.environ.get("CKPT_TOKEN")
    if coordinator:
        address, token = coord_client.locate(coordinator, ckpt_dir, token)
    else:
        record = _live_job(ckpt_dir, wait=0.0)
        address, token = str(record["address"]), token or str(record["token"])
    conn = coord_client.control(address, token)
    try:
        state: dict[str, Any] = conn.call("status")["status"]
    finally:
        conn.close()
    if state.get("job") is None or state["state"] in ("finished", "failed", "killed"):
        raise CkptError(f"the job at {address} has ended ({state['state']}): {state.get('message', '')}")
    return state, address, token


def _wait_for_the_end(ckpt_dir: Path, claim: str | None) -> None:
    """After a kill: return once the job's launcher has let go of the directory (its ranks reaped), so
    that a `ckpt restart` typed next finds it free."""
    if claim is not None and not jobdir.wait_released(ckpt_dir, claim, jobdir.ENDING_WAIT):
        click.echo(f"ckpt: the job's launcher still holds {ckpt_dir} after {jobdir.ENDING_WAIT:g} s", err=True)


@click.command()
@click.option("--wait", is_flag=True, help="Block until the checkpoint is written (or aborted).")
@click.option("--kill", is_flag=True, help="Kill the job once the checkpoint is written (waits for it, as --wait).")
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    metavar="R",
    help="Checkpoint rank R alone, at its next step boundary, while the others keep running (an image for "
    "its single-rank recovery; `latest` stays the last coordinated checkpoint).",
)
@coordinator_option
@ckpt_dir_option
def checkpoint(wait: bool, kill: bool, rank: int | None, coordinator: str | None, ckpt_dir: Path) -> None:
    """Request a checkpoint of the running job (of one rank alone with --rank)."""
    if rank is not None and kill:
        raise CkptError("--kill cannot go with --rank: only a coordinated checkpoint can end the job")
    ckpt_dir = ckpt_dir.resolve()
    conn, claim = _control(coordinator, ckpt_dir)
    answer = conn.call("checkpoint", wait=wait or kill, kill=kill, **({} if rank is None else {"rank": rank}))
    conn.close()
    if kill and "checkpoint" in answer:
        _wait_for_the_end(ckpt_dir, claim)
    # the same three answers for both kinds: written (with --wait), queued, or started
    what = "checkpoint" if rank is None else "independent checkpoint"
    of = "" if rank is None else f" of rank {rank}"
    if "checkpoint" in answer:
        last = answer["checkpoint"]
        click.echo(
            f"{what} {last['number']}{of} written: {last['manifest']} "
            f"({last['bytes']} bytes, {last['seconds']:.2f} s){'; job killed' if kill else ''}"
        )
    elif answer.get("queued"):
        click.echo(
            f"{what}{of} requested (it starts once every rank has joined the job or is back from a failure, "
            "no rank holds checkpoints, and no other checkpoint runs)"
        )
    else:
        click.echo(f"{what} {answer['number']}{of} requested")


def _starting_status(ckpt_dir: Path, holder: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "job": str((holder or {}).get("job") or ""),
        "generation": None,
        "size": 0,
        "state": "starting",
        "max_state": "starting",
        "unanimous": True,
        "ranks": [],
        "last_checkpoint": None,
        "checkpoint_in_progress": None,
        "independent_in_progress": None,
        "independent_queued": [],
        "last_rank_checkpoint": None,
        "fallbacks": None,
        "checkpoint_holds": [],
        "message": "the launcher holds the directory; its coordinator is not up yet",
        "coordinator": None,
        "ckpt_dir": str(ckpt_dir),
        "pid": (holder or {}).get("pid"),
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (the keys are documented).")
@coordinator_option
@ckpt_dir_option
def status(as_json: bool, coordinator: str | None, ckpt_dir: Path) -> None:
    """Show the job's ranks, states, generation and last checkpoint (an ended job's final status)."""
    ckpt_dir = ckpt_dir.resolve()
    found = None if coordinator else jobdir.find_job(ckpt_dir)
    if found is not None and found.state == "ended":
        assert found.record is not None
        state = found.record["ended"]  # the job is over: its coordinator is gone, its final status stays
    elif found is not None and found.state == "starting":
        state = _starting_status(ckpt_dir, found.holder)
    else:
        conn, _ = _control(coordinator, ckpt_dir, wait=0.0)
        state = conn.call("status")["status"]
        conn.close()
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    _print_status(state)


def _print_status(state: dict[str, Any]) -> None:
    joined = ""
    if state["state"] == "waiting":
        joined = f" ({len(state['ranks'])} of {state['size'] or '?'} ranks joined)"
    generation = "" if state["generation"] is None else f"  generation {state['generation']}"
    policy = "  on failure: recover" if state.get("on_failure") == "recover" else ""
    click.echo(
        f"job {state['job'] or '?'}{generation}  state {state['state']}{joined}"
        f"{'' if state['unanimous'] else ' (not unanimous)'}  coordinator {state['coordinator'] or '-'}{policy}"
    )
    for r in state["ranks"]:
        latest = r.get("latest_image")
        image = f"  latest image {latest}" if latest is not None else ""
        replay = r.get("replay")  # [done, total] while its replay runs (single-rank recovery)
        replaying = f"  replaying {replay[0]}/{replay[1]}" if replay and replay[0] < replay[1] else ""
        click.echo(
            f"  rank {r['rank']:>3}  {r['state']:<11} step {r['step']:<8} pid {r['pid']:<8} "
            f"incarnation {r.get('incarnation', 0):<3} {r['host']}{image}{replaying}"
        )
    for r in state["ranks"]:
        if r["state"] == "failed" and state["state"] not in ENDED:
            click.echo(
                f"rank {r['rank']} failed (incarnation {r.get('incarnation', 0)} was lost); its next incarnation "
                f"is {r.get('incarnation', 0) + 1} (ckpt restart --rank {r['rank']}, if no launcher respawns it)"
            )
    if state["state"] not in ENDED:
        now = time.time()
        for r in state["ranks"]:
            for line in _long_waits(r, now):
                click.echo(line)
    for hold in state.get("checkpoint_holds") or []:
        click.echo(f"checkpoints held by rank {hold['rank']}: {hold['reason']}")
    fallbacks = state.get("fallbacks")
    if fallbacks:
        click.echo(
            f"whole-job fallbacks: {fallbacks['count']}, the last from checkpoint {fallbacks['number']} "
            f"(rank {fallbacks['rank']}: {fallbacks['reason']})"
        )
    independent = state.get("independent_in_progress")
    if independent:
        click.echo(
            f"independent checkpoint {independent['number']} of rank {independent['rank']} in progress "
            f"({independent['stage']})"
        )
    last = state["last_checkpoint"]
    if last:
        click.echo(
            f"last checkpoint: {last['number']}  {last['manifest']}  {last['bytes']} bytes  {last['seconds']:.2f} s"
        )
    else:
        click.echo("last checkpoint: none")
    if state["message"]:
        click.echo(f"last event: {state['message']}")


def _long_waits(rank: dict[str, Any], now: float) -> list[str]:
    """What a live rank has waited for a while, and what it has seen stand still, as its plugins report it
    (STATS_NS `<rank>/<plugin>` maps with ``waits`` and ``facts``, each ``[{what, since}]``, and the
    ``incarnation`` that reports; docs/plugins.md)."""
    if rank["state"] in ENDED:  # its last report may not have been cleared before it ended
        return []
    lines = []
    for name, value in sorted((rank.get("plugins") or {}).items()):
        if not isinstance(value, dict) or value.get("incarnation", 0) != rank.get("incarnation", 0):
            continue  # a lost incarnation's report
        for what, waited in _since(value.get("waits"), now):
            lines.append(f"rank {rank['rank']} has waited {waited:.1f} s for {what} ({name})")
        for what, waited in _since(value.get("facts"), now):
            lines.append(f"at rank {rank['rank']}: {what} (for {waited:.1f} s, {name})")
    return lines


def _since(entries: Any, now: float) -> list[tuple[str, float]]:
    """(what, seconds since) of a report's ``[{what, since}]`` list; anything else in it is skipped."""
    out = []
    for entry in entries if isinstance(entries, list) else []:
        since = entry.get("since") if isinstance(entry, dict) else None
        if isinstance(since, int | float) and not isinstance(since, bool) and "what" in entry:
            out.append((str(entry["what"]), max(0.0, now - since)))
    return out


@click.command()
@coordinator_option
@ckpt_dir_option
def kill(coordinator: str | None, ckpt_dir: Path) -> None:
    """Kill the running job (its checkpoints stay)."""
    ckpt_dir = ckpt_dir.resolve()
    conn, claim = _control(coordinator, ckpt_dir)
    conn.call("kill", reason="killed on request (ckpt kill)")
    conn.close()
    _wait_for_the_end(ckpt_dir, claim)
    click.echo("job killed")


@click.command("coordinator")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told).")
@click.option("--port", type=click.IntRange(0, 65535), default=7779, show_default=True, help="Port (0 = any free).")
@click.option(
    "--interval", type=click.FloatRange(min=0.01), help="Checkpoint every SECONDS  [default: only on request]"
)
@click.option("--keep", type=click.IntRange(min=0), default=0, show_default=True, help="Keep the newest K (0 = all).")
@click.option(
    "--rank-interval",
    type=click.FloatRange(min=0.01),
    help="Checkpoint each rank alone every SECONDS, staggered  [default: never]",
)
@click.option(
    "--phase-timeout",
    type=click.FloatRange(min=0.01),
    default=300.0,
    show_default=True,
    help="Abort a checkpoint whose phase takes longer (seconds).",
)
@ckpt_dir_option
def coordinator_cmd(
    host: str,
    port: int,
    interval: float | None,
    keep: int,
    rank_interval: float | None,
    phase_timeout: float,
    ckpt_dir: Path,
) -> None:
    """Run a standalone coordinator in the foreground (for ranks started by mpiexec / srun)."""
    from ckpt.coordinator.server import Coordinator

    ckpt_dir = ckpt_dir.resolve()
    claim = jobdir.claim(ckpt_dir)  # held until this process exits: the directory's jobs are this coordinator's
    existing = jobdir.read_job_file(ckpt_dir) or {}
    token = os.environ.get("CKPT_TOKEN") or existing.get("token") or wire.new_token()
    server = Coordinator(
        token=token,
        ckpt_dir=ckpt_dir,
        host=host,
        port=port,
        interval=interval,
        keep=keep,
        phase_timeout=phase_timeout,
        rank_interval=rank_interval,
        serve_forever=True,
    ).start()

    def record(ended: dict[str, Any] | None = None) -> None:
        jobdir.write_job_file(
            ckpt_dir, address=server.address, token=token, job="", pid=os.getpid(), claim=claim.id, standalone=True,
            ended=ended,
        )  # fmt: skip

    record()
    click.echo(f"ckpt coordinator listening on {server.address}")
    click.echo(f"export CKPT_COORDINATOR={server.address} CKPT_TOKEN={token}")
    try:
        serve_until_signal(threading.Event().wait, "ckpt coordinator")
    finally:
        server.kill("the coordinator was stopped")
        try:
            record(ended=server.status())
        except CkptError as exc:  # a full disk costs that record only
            click.echo(f"ckpt: warning: the coordinator's end could not be recorded: {exc}", err=True)
        server.stop()


@click.command()
@plugin_options
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def plugins(with_plugins: tuple[str, ...], disabled: tuple[str, ...], as_json: bool) -> None:
    """List the installed plugins: versions, hooks, and the transports and commands each contributes."""
    from ckpt._cli_plugins import contributions
    from ckpt.plugin import CKPT_PLUGIN_API
    from ckpt.runtime.plugins import PluginHost

    host = PluginHost().load(list(with_plugins), list(disabled))
    offered = contributions(host)
    if as_json:
        listed = [vars(p) | {"hooks": list(p.hooks), **offered[p.name]} for p in host.plugins]
        click.echo(json.dumps(listed, indent=2))
        return
    click.echo(f"plugin API {CKPT_PLUGIN_API}; {len(host.plugins)} plugin(s)")
    for p in host.plugins:
        click.echo(f"  {p.name} {p.version}  ({p.module}, {p.source}, order {p.order})")
        click.echo(f"      hooks: {', '.join(p.hooks) or 'none'}")
        mine = offered[p.name]
        if mine["transports"]:
            marked = [f"{n} (default)" if n in mine["default_transport"] else n for n in mine["transports"]]
            click.echo(f"      transports: {', '.join(marked)}")
        if mine["commands"]:
            click.echo(f"      commands: {', '.join(mine['commands'])}")


@click.command()
@click.argument("path", metavar="IMAGE|MANIFEST", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(path: Path, as_json: bool) -> None:
    """Show an image's header, sizes, checksum and largest objects, or a manifest and the state of each
    image it names (exit 1 if anything is damaged or missing)."""
    from ckpt.runtime.images import MAGIC, inspect_image

    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
    except OSError as exc:
        raise CkptError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != MAGIC and magic.lstrip()[:1] == b"{":
        _inspect_manifest(path, as_json)
        return
    if magic != MAGIC:
        raise CkptError(f"{path} is neither a ckpt image nor a ckpt manifest")
    report = inspect_image(path)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    if not report.get("ok", True):
        raise CkptError(f"image {path} is damaged: {report.get('problem')}")


def _inspect_manifest(path: Path, as_json: bool) -> None:
    from ckpt import _manifest as manifests
    from ckpt._restart_point import check_image
    from ckpt._schemas import to_dict
    from ckpt.runtime.images import inspect_image

    directory = path.resolve().parent
    manifest = manifests.read_manifest(path, token=None)
    token = os.environ.get("CKPT_TOKEN") or (jobdir.read_job_file(directory) or {}).get("token")
    authentic: bool | None = None
    if token:
        try:
            manifests.read_manifest(path, token=wire.token_bytes(token))
            authentic = True
        except ImageError:
            authentic = False
    images = []
    for entry in manifest.ranks:
        problem = None
        try:
            check_image(directory / entry.file, entry, manifest, path.name)
            content = inspect_image(directory / entry.file)  # the whole content against its checksum
            if not content["ok"]:
                problem = str(content["problem"])
        except ImageError as exc:
            problem = str(exc)
        images.append({**to_dict(entry), "ok": problem is None, "problem": problem})
    report = {"path": str(path), "authentic": authentic, **to_dict(manifest), "ranks": images}
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(
            f"manifest of checkpoint {manifest.number} of {manifest.program.name} "
            f"(job {manifest.job}, generation {manifest.generation}, {manifest.size} ranks, "
            f"format {manifest.manifest_version}.{manifest.manifest_minor})"
        )
        click.echo(f"created: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created))}")
        click.echo(f"took: {manifest.seconds:.3f} s")
        click.echo(f"transport: {manifest.transport}")
        if manifest.with_plugins:
            click.echo(f"--with-plugin: {' '.join(manifest.with_plugins)}")
        given = {k: v for k, v in manifest.options.items() if v is not None}
        if given:
            click.echo("plugin options: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(given.items())))
        click.echo(f"plugins: {', '.join(p.get('name', '?') for p in manifest.plugins) or 'none'}")
        click.echo(f"authentic: {'unknown (no token)' if authentic is None else 'yes' if authentic else 'NO'}")
        for image in images:
            state = "ok" if image["ok"] else f"BAD: {image['problem']}"
            size = f"{image.get('bytes')} bytes"
            click.echo(f"  rank {image['rank']:>3}  {image['file']}  {size}  step {image.get('step')}  {state}")
    bad = [image for image in images if not image["ok"]]
    if authentic is False:
        raise CkptError(f"manifest {path} is not authentic (HMAC mismatch: wrong CKPT_TOKEN or tampered manifest)")
    if bad:
        raise CkptError(bad[0]["problem"])


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
