"""End-to-end: the example plugin examples/plugins/ckpt_stepclock.py, used exactly as docs/plugins.md says.

launch --with-plugin -> checkpoint -> checkpoint --kill -> restart --with-plugin
-> checkpoint -> finish; then the per-rank JSON summaries the plugin writes at
exit must show every checkpoint's phases, the same exchanged values on every
rank, and a history that came back from the image after the restart.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt.testing import Job, checkpoint, env, results, run
from harness import EXAMPLES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PLUGIN_DIR = EXAMPLES / "plugins"
HEAT = [str(EXAMPLES / "heat.py"), "1000", "500", "4", "sleep"]
RANKS = 3
PHASES = ("presuspend", "drain", "checkpoint")


def _env(summaries: Path) -> dict[str, str]:
    return {
        "PYTHONPATH": env(pythonpath=[PLUGIN_DIR])["PYTHONPATH"],  # the plugin is not installed: found on the path
        "CKPT_STEPCLOCK_FILE": str(summaries / "stepclock-{rank}.json"),
    }


def _summaries(directory: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in range(RANKS):
        path = directory / f"stepclock-{rank}.json"
        assert path.exists(), f"rank {rank} wrote no summary at exit"
        found[rank] = json.loads(path.read_text())
    return found


def _max_step(job: Job) -> int:
    state = job.status()
    assert state is not None
    return max(r["step"] for r in state["ranks"])


def test_ckpt_plugins_lists_the_example_plugin(tmp_path: Path) -> None:
    listed = run("plugins", "--with-plugin", "ckpt_stepclock", extra_env=_env(tmp_path))
    assert listed.returncode == 0, listed.stderr
    assert "stepclock 1.0  (ckpt_stepclock, --with-plugin, order 10)" in listed.stdout
    helped = run("launch", "--with-plugin", "ckpt_stepclock", "--help", extra_env=_env(tmp_path))
    assert helped.returncode == 0 and "--stepclock-file" in helped.stdout, helped.stderr
    as_json = run("plugins", "--json", "--with-plugin", "ckpt_stepclock", extra_env=_env(tmp_path))
    assert as_json.returncode == 0, as_json.stderr
    (info,) = [p for p in json.loads(as_json.stdout) if p["name"] == "stepclock"]
    assert "ckpt_add_options" in info["hooks"]
    assert info["api"] == 2 and info["version"] == "1.0" and info["module"] == "ckpt_stepclock"
    assert {"ckpt_presuspend", "ckpt_drain", "ckpt_precheckpoint", "ckpt_checkpointed", "ckpt_resume"} <= set(
        info["hooks"]
    )
    assert {"ckpt_restart", "ckpt_refresh", "ckpt_exit"} <= set(info["hooks"])


def test_the_timings_survive_a_restart(start_job: Callable[..., Job], tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    killed_dir, final_dir = tmp_path / "killed", tmp_path / "final"
    killed_dir.mkdir()
    final_dir.mkdir()
    plugin = ["--with-plugin", "ckpt_stepclock"]

    # generation 0: checkpoint 1 (the job resumes), checkpoint 2 (the job is killed)
    job = start_job("launch", "-n", str(RANKS), "--ckpt-dir", str(ckpt_dir), *plugin, *HEAT, extra_env=_env(killed_dir))
    job.wait_step(20)
    assert "checkpoint 1 written" in checkpoint(ckpt_dir, "--wait")
    job.wait_step(_max_step(job) + 20)
    assert "checkpoint 2 written" in checkpoint(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    manifest = json.loads((ckpt_dir / "ckpt_heat_2.json").read_text())
    assert {"name": "stepclock", "version": "1.0", "module": "ckpt_stepclock"} in manifest["plugins"]
    killed_at = max(r["step"] for r in manifest["ranks"])

    # `checkpoint --kill` runs ckpt_exit: the killed job's summaries hold checkpoints 1 and 2
    killed = _summaries(killed_dir)
    for rank, summary in killed.items():
        assert summary["rank"] == rank and summary["generation"] == 0
        assert [c["number"] for c in summary["checkpoints"]] == [1, 2]
        assert summary["checkpoints"][1]["ended"] == "killed"

    # generation 1: restart with the plugin, checkpoint 3, run to the end; the plugin's own
    # --stepclock-file option (from ckpt_add_options) takes precedence over $CKPT_STEPCLOCK_FILE
    option = ["--stepclock-file", str(final_dir / "stepclock-{rank}.json")]
    again = start_job("restart", "--ckpt-dir", str(ckpt_dir), *plugin, *option, extra_env=_env(killed_dir))
    again.wait_step(killed_at + 1)  # the restarted job is up (not the killed one's final status)
    assert "checkpoint 3 written" in checkpoint(ckpt_dir, "--wait")
    assert again.wait() == 0, again.stderr
    assert sorted(results(again.stdout)) == list(range(RANKS))

    final = _summaries(final_dir)
    for rank, summary in final.items():
        before = killed[rank]
        assert summary["generation"] == 1 and summary["pid"] != before["pid"]
        first, restored, third = summary["checkpoints"]
        # the history came back from the image: checkpoint 1 exactly as the killed process knew it
        assert first == before["checkpoints"][0]
        # checkpoint 2 as its image saved it: timed up to the image write, not numbered yet
        assert restored["restored"] is True and "number" not in restored
        assert {k: restored[k] for k in ("seq", "step", "presuspend", "drain")} == {
            k: before["checkpoints"][1][k] for k in ("seq", "step", "presuspend", "drain")
        }
        assert [c["seq"] for c in summary["checkpoints"]] == [1, 2, 3]
        assert [c["generation"] for c in summary["checkpoints"]] == [0, 0, 1]
        assert third["number"] == 3 and third["step"] > killed_at
        for record in (first, third):
            assert all(record[phase] >= 0 for phase in PHASES)
            assert record["suspended"] >= record["presuspend"] + record["drain"] - 1e-5
        (restart,) = summary["restarts"]
        assert restart["generation"] == 1 and restart["load"] > 0
        assert restart["restart"] >= 0 and restart["refresh"] >= 0
        assert len(restart["ranks_load"]) == RANKS and restart["ranks_load"][rank] == restart["load"]
        assert summary["aborted"] == 0

    # what was exchanged through rt.kv is the same on every rank, and each rank's own value is in it
    for index in range(3):
        exchanged = {tuple(s["checkpoints"][index]["ranks_presuspend"]) for s in final.values()}
        assert len(exchanged) == 1, exchanged
        for rank, summary in final.items():
            record = summary["checkpoints"][index]
            assert record["ranks_presuspend"][rank] == record["presuspend"]
    assert len({tuple(s["restarts"][0]["ranks_load"]) for s in final.values()}) == 1
