"""End-to-end: a third-party plugin installed with an entry point, outside ckpt/ and plugins/.

tests/programs/installed holds a dist-info (so importlib.metadata sees an
installed distribution `ckpt-recorder` with two `ckpt.plugins` entry points)
and the module.  Two stacked instances record every event they see.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt.testing import Job, env, results, run
from harness import EXAMPLES, PROGRAMS, heat_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

INSTALLED = PROGRAMS / "installed"
#: 300 steps of 20 ms (slept): the checkpoint --kill after step 60 has ~5 s to land (at 600 steps of 2 ms, a loaded
#: machine once ran the job to its end first), with half the allgathers, which are what the steps cost
HEAT = [str(EXAMPLES / "heat.py"), "300", "500", "20", "sleep"]
RANKS = 3


def _env(log_dir: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{INSTALLED}:{env()['PYTHONPATH']}", "CKPT_RECORDER_DIR": str(log_dir)}


def _events(log_dir: Path, rank: int) -> list[list[str]]:
    return [line.split() for line in (log_dir / f"rank{rank}.log").read_text().splitlines()]


def test_ckpt_plugins_lists_the_installed_plugin(tmp_path: Path) -> None:
    listed = run("plugins", "--json", extra_env=_env(tmp_path))
    assert listed.returncode == 0, listed.stderr
    by_name = {p["name"]: p for p in json.loads(listed.stdout)}
    assert {"recorder_a", "recorder_b"} <= by_name.keys()
    assert by_name["recorder_a"]["version"] == "1.2"
    assert by_name["recorder_a"]["source"] == "entry point of ckpt-recorder"
    assert "ckpt_refresh" in by_name["recorder_b"]["hooks"]
    helped = run("launch", "--help", extra_env=_env(tmp_path))
    assert "--recorder-tag" in helped.stdout and "(plugin option)" in helped.stdout
    human = run("plugins", extra_env=_env(tmp_path))
    assert "recorder_a 1.2" in human.stdout
    assert "recorder_a" not in run("plugins", "--disable-plugin", "recorder_a", extra_env=_env(tmp_path)).stdout


def test_the_plugin_sees_every_event_in_order_across_resume_and_restart(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt_dir = tmp_path / "ckpt"
    job = start_job(
        "launch", "-n", str(RANKS), "--ckpt-dir", str(ckpt_dir), "--recorder-tag", "blue", *HEAT, extra_env=_env(logs)
    )
    job.wait_step(20)
    assert run("checkpoint", "--wait", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    job.wait_step(60)
    assert run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert job.wait() == 0
    manifest = json.loads((ckpt_dir / "ckpt_heat_2.json").read_text())
    assert {"recorder_a", "recorder_b"} <= {p["name"] for p in manifest["plugins"]}
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), "--recorder-tag", "green", extra_env=_env(logs))
    assert again.wait() == 0, again.stderr
    assert results(again.stdout) == heat_results(RANKS, int(HEAT[1]), int(HEAT[2]))  # the uninterrupted run's

    drain_sum = sum(10 * r for r in range(RANKS))
    for rank in range(RANKS):
        events = _events(logs, rank)
        names = [f"{e[0][-1]}:{e[1]}" for e in events]
        checkpoint_and_resume = [
            "a:presuspend", "b:presuspend", "a:drain", "b:drain", "a:precheckpoint", "b:precheckpoint",
            "b:checkpointed", "a:checkpointed", "b:resume", "a:resume",
        ]  # fmt: skip
        checkpoint_and_kill = checkpoint_and_resume[:-2]
        restart = ["a:init", "b:init", "b:restart", "a:restart", "b:refresh", "a:refresh", "b:resume", "a:resume"]
        exit_ = ["b:exit", "a:exit"]
        assert names == ["a:init", "b:init", *checkpoint_and_resume, *checkpoint_and_kill, *exit_, *restart, *exit_]
        drains = [e for e in events if e[1] == "drain"]
        assert all(int(e[2]) == drain_sum for e in drains), "kv publish/subscribe across ranks"
        resumes = [e[2:] for e in events if e[1] == "resume"]
        assert resumes[:2] == [["restarted=False", "aborted=False"]] * 2
        assert resumes[-2:] == [["restarted=True", "aborted=False"]] * 2
        checkpointed = [e[2] for e in events if e[1] == "checkpointed"]
        assert checkpointed == ["1", "1", "2", "2"]
        init_pids = [e[2] for e in events if e[1] == "init"]
        for restarted in (e for e in events if e[1] == "restart"):
            fields = dict(word.split("=") for word in restarted[2:])
            assert fields["old"] == f"real-{init_pids[0]}", "the table's real id before the restart"
            assert fields["new"] == f"real-{init_pids[-1]}" and init_pids[-1] != init_pids[0]
            assert fields["virtual"] == "1", "the virtual id survives the restart"
            assert int(fields["fresh"]) > int(fields["global"]), "global ids after restart never collide"
        tags = [e[3] for e in events if e[1] == "init"]
        assert tags == ["tag=blue", "tag=blue", "tag=green", "tag=green"], "plugin options reach every rank"
        refreshes = [e for e in events if e[1] == "refresh"]
        assert all(int(e[2]) == RANKS for e in refreshes)


def test_a_restart_without_a_checkpointed_plugin_is_refused_unless_disabled(
    start_job: Callable[..., Job], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    job = start_job("launch", "-n", "2", "--ckpt-dir", str(ckpt_dir), *HEAT, extra_env=_env(tmp_path))
    job.wait_step(10)
    assert run("checkpoint", "--kill", "--ckpt-dir", str(ckpt_dir)).returncode == 0
    assert job.wait() == 0
    refused = run("restart", "--ckpt-dir", str(ckpt_dir))  # the recorder is not installed here
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "plugin 'recorder_a' (1.2), which is not loaded now" in refused.stderr
    dropped = run("restart", "--ckpt-dir", str(ckpt_dir), "--disable-plugin", "recorder_a",
                  "--disable-plugin", "recorder_b", timeout=120)  # fmt: skip
    assert dropped.returncode == 0, dropped.stderr
    assert sorted(results(dropped.stdout)) == [0, 1]
