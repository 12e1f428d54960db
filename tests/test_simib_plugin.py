"""The ckpt_simib plugin: the simib transport, fabric.json, a job's own fabric, and `ckpt fabric` only with it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ckpt_simib
from ckpt import CkptError, _cli_plugins
from ckpt.cli import cli, main
from ckpt.plugin import ENTRY_POINT_GROUP, JobInfo
from ckpt.verbs import fabric
from ckpt.verbs.fabric import FabricClient, FabricError, LinkModel, SubnetManager
from ckpt_simib import _service

pytestmark = pytest.mark.timeout(60)

#: The real launcher_host (a test may replace the module's), whose cache the fixture clears.
LAUNCHER_HOST = _cli_plugins.launcher_host


def test_the_plugin_declares_simib_the_native_default() -> None:
    (transport,) = ckpt_simib.ckpt_transports()
    assert (transport.name, transport.default, transport.native) == ("simib", True, True)
    options = {o["name"]: o for o in ckpt_simib.ckpt_add_options()}
    assert set(options) == {"fabric", "fabric-latency", "fabric-bandwidth"}
    assert options["fabric"].get("envvar") == "CKPT_FABRIC" and options["fabric"].get("per_run")
    assert not options["fabric-latency"].get("per_run")  # recorded: a restart gets the same link model


def test_each_rank_stands_for_a_node_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """ckpt_init names the rank's node (the subnet manager keeps a node's LIDs and cut cables for its next HCA):
    rank<R>, or the job's $CKPT_SIMIB_NODE with {rank} filled in."""
    monkeypatch.delenv(fabric.ENV_NODE, raising=False)
    ckpt_simib.ckpt_init(rt=SimpleNamespace(rank=5))
    assert os.environ[fabric.ENV_NODE] == "rank5"
    monkeypatch.setenv(fabric.ENV_NODE, "rack2-{rank}")
    ckpt_simib.ckpt_init(rt=SimpleNamespace(rank=3))
    assert os.environ[fabric.ENV_NODE] == "rack2-3"
    assert ckpt_simib.node_of(1, "") == "rank1"


def test_fabric_file_and_locate(
    start_sm: Callable[..., SubnetManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(fabric.ENV_TOKEN, raising=False)
    sm = start_sm(link_model=LinkModel(1e-6, 1e9))
    path = _service.write_fabric_file(tmp_path, sm)
    assert path.stat().st_mode & 0o777 == 0o600
    record = _service.read_fabric_file(tmp_path)
    assert record is not None
    assert {k: record[k] for k in ("address", "token", "pid", "fabric", "latency", "bandwidth")} == {
        "address": sm.address,
        "token": sm.token,
        "pid": os.getpid(),
        "fabric": sm.fabric_id,
        "latency": 1e-6,
        "bandwidth": 1e9,
    }
    assert _service.locate(None, tmp_path) == (sm.address, sm.token)
    assert _service.locate(sm.address, tmp_path) == (sm.address, sm.token)
    assert _service.running_fabric(tmp_path) == record
    with pytest.raises(FabricError, match="set CKPT_FABRIC_TOKEN"):
        _service.locate("127.0.0.1:1", tmp_path)
    monkeypatch.setenv(fabric.ENV_TOKEN, "t")
    assert _service.locate("127.0.0.1:1", None) == ("127.0.0.1:1", "t")
    with pytest.raises(FabricError, match=r"no fabric\.json in"):
        _service.locate(None, tmp_path / "empty")
    _service.remove_fabric_file(tmp_path, "127.0.0.1:1")  # names another fabric: kept
    assert _service.read_fabric_file(tmp_path) is not None
    _service.remove_fabric_file(tmp_path, sm.address)
    assert _service.read_fabric_file(tmp_path) is None
    (tmp_path / ckpt_simib.FABRIC_FILE).write_text("[1, 2]")
    with pytest.raises(FabricError, match="not a ckpt fabric file"):
        _service.read_fabric_file(tmp_path)


# ----------------------------------------------------------- a job's fabric
def _job(ckpt_dir: Path, transport: str = "simib", **fields: Any) -> JobInfo:
    options = {"fabric": None, "fabric_latency": None, "fabric_bandwidth": None, **fields.pop("options", {})}
    return JobInfo(
        job="0123456789ab", ckpt_dir=ckpt_dir, transport=transport, host="127.0.0.1", options=options, **fields
    )


def test_a_job_gets_a_fabric_of_its_own_recorded_in_its_dir(tmp_path: Path) -> None:
    job = _job(tmp_path, options={"fabric_latency": "2us", "fabric_bandwidth": "4GB/s"})
    env = ckpt_simib.ckpt_job_start(job)
    assert env is not None
    try:
        record = _service.read_fabric_file(tmp_path)
        assert record is not None and record["job"] == job.job
        assert env == {fabric.ENV_ADDRESS: record["address"], fabric.ENV_TOKEN: record["token"]}
        with FabricClient(env[fabric.ENV_ADDRESS], env[fabric.ENV_TOKEN]) as client:
            state = client.status()
        assert (state["latency"], state["bandwidth"]) == (2e-6, 4e9)
    finally:
        ckpt_simib.ckpt_job_stop(job)
    assert _service.read_fabric_file(tmp_path) is None
    with pytest.raises(FabricError, match="cannot reach"):
        FabricClient(env[fabric.ENV_ADDRESS], env[fabric.ENV_TOKEN], timeout=2.0)
    ckpt_simib.ckpt_job_stop(job)  # stopping again: nothing left, no error


def test_another_transport_gets_no_fabric(tmp_path: Path) -> None:
    assert ckpt_simib.ckpt_job_start(_job(tmp_path, "tcp")) is None
    assert _service.read_fabric_file(tmp_path) is None
    with pytest.raises(CkptError, match="model simib's links; --transport tcp has none"):
        ckpt_simib.ckpt_job_start(_job(tmp_path, "tcp", options={"fabric_latency": "2us"}))
    # a restart onto tcp of a job launched with a link model: the recorded model does not apply, no error
    assert ckpt_simib.ckpt_job_start(_job(tmp_path, "tcp", options={"fabric_latency": "2us"}, restarted=True)) is None


def test_bad_link_units_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match=r"^bad latency '3xs'"):
        ckpt_simib.ckpt_job_start(_job(tmp_path, options={"fabric_latency": "3xs"}))
    with pytest.raises(CkptError, match=r"^bad bandwidth '4XB/s'"):
        ckpt_simib.ckpt_job_start(_job(tmp_path, options={"fabric_bandwidth": "4XB/s"}))
    assert _service.read_fabric_file(tmp_path) is None


def test_an_existing_fabric_is_located_not_started(
    start_sm: Callable[..., SubnetManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(fabric.ENV_TOKEN, raising=False)
    sm = start_sm()
    fabric_dir, job_dir = tmp_path / "fabric", tmp_path / "job"
    _service.write_fabric_file(fabric_dir, sm)  # standalone: `ckpt fabric start`
    with pytest.raises(FabricError, match=f"pass --fabric {sm.address} to run on it"):
        ckpt_simib.ckpt_job_start(_job(fabric_dir))
    with pytest.raises(FabricError, match="set CKPT_FABRIC_TOKEN"):
        ckpt_simib.ckpt_job_start(_job(job_dir, options={"fabric": sm.address}))
    monkeypatch.setenv(fabric.ENV_TOKEN, sm.token)
    env = ckpt_simib.ckpt_job_start(_job(job_dir, options={"fabric": sm.address}))
    assert env == {fabric.ENV_ADDRESS: sm.address, fabric.ENV_TOKEN: sm.token}
    assert _service.read_fabric_file(job_dir) is None  # nothing of the job's own
    given = {"fabric": sm.address, "fabric_latency": "2us"}
    with pytest.raises(CkptError, match="an existing fabric \\(--fabric\\) keeps the one it was started with"):
        ckpt_simib.ckpt_job_start(_job(job_dir, options=given))
    assert ckpt_simib.ckpt_job_start(_job(job_dir, options=given, restarted=True)) == env
    ckpt_simib.ckpt_job_stop(_job(job_dir))
    assert FabricClient(sm.address, sm.token).status()["address"] == sm.address  # not the job's to stop


def test_an_external_rank_starts_no_fabric(tmp_path: Path) -> None:
    assert ckpt_simib.ckpt_job_start(_job(tmp_path, external_rank=3)) is None
    assert _service.read_fabric_file(tmp_path) is None


# ----------------------------------------------------------- `ckpt fabric` comes with the plugin
@pytest.fixture
def fresh_commands(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CLI's plugin commands found afresh in this test, and again after it."""
    LAUNCHER_HOST.cache_clear()
    monkeypatch.setattr(cli, "plugin_commands", None)
    yield
    LAUNCHER_HOST.cache_clear()


def _run_main(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr("sys.argv", ["ckpt", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return int(exit_info.value.code or 0)


def _listed(out: str) -> set[str]:
    commands = out.split("Commands:", 1)[1]
    return {line.split()[0] for line in commands.splitlines() if line.startswith("  ")}


def test_help_lists_fabric_with_the_plugin(
    fresh_commands: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_main(monkeypatch, "--help") == 0
    assert {"fabric", "launch", "status"} <= _listed(capsys.readouterr().out)
    assert _run_main(monkeypatch, "fabric", "--help") == 0
    assert "fail-link" in capsys.readouterr().out


def test_without_the_plugin_there_is_no_fabric_command(
    fresh_commands: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.metadata.entry_points

    def without_simib(**select: Any) -> Any:
        found: Any = real(**select)
        if select.get("group") == ENTRY_POINT_GROUP:
            return [ep for ep in found if ep.name != "simib"]
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", without_simib)
    assert _run_main(monkeypatch, "--help") == 0
    listed = _listed(capsys.readouterr().out)
    assert "fabric" not in listed and {"launch", "status"} <= listed
    assert _run_main(monkeypatch, "fabric", "status") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No such command 'fabric'") and len(err.strip().splitlines()) == 1, err


def test_status_loads_no_plugin(fresh_commands: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The often-called core commands do not pay for plugins (`ckpt status` starts fast)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a core command loaded plugins")

    monkeypatch.setattr(_cli_plugins, "launcher_host", refuse)
    assert _run_main(monkeypatch, "status", "--ckpt-dir", str(tmp_path)) == 1  # no job there: one error line


def test_a_dead_jobs_fabric_file_is_removed_a_standalone_or_live_one_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    recorded = tmp_path / "fabric.json"
    for record, stays in (
        ({"address": "a:1", "token": "t", "pid": dead.pid, "job": "j"}, False),  # its launcher was killed
        ({"address": "a:1", "token": "t", "pid": os.getpid(), "job": "j"}, True),  # alive
        ({"address": "a:1", "token": "t", "pid": dead.pid, "job": None}, True),  # `ckpt fabric stop` handles those
    ):
        recorded.write_text(json.dumps(record))
        (tmp_path / "fabric.json.tmp").write_text("x")
        _service.remove_stale_fabric_file(tmp_path)
        assert recorded.exists() == stays, record
        assert not (tmp_path / "fabric.json.tmp").exists()


def test_a_job_start_on_any_transport_clears_a_dead_jobs_fabric_file(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "fabric.json").write_text(json.dumps({"address": "a:1", "token": "t", "pid": dead.pid, "job": "j"}))
    assert _service.job_start(_job(tmp_path, transport="tcp")) is None
    assert not (tmp_path / "fabric.json").exists()
