"""End-to-end: the worked examples of docs/plugins.md §11.2 and §11.4, a verbs wrapper and a DSM-hooks plugin.

Each runs through launch -> checkpoint --kill -> restart with `--with-plugin` (the restart loads it again
from the manifest), the program's results equal an uninterrupted run's, and the plugin's totals came back
from the image: what it counted after the restart adds up to what an uninterrupted run counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpt.testing import Jobs, env, results, run, uninterrupted
from harness import EXAMPLES, ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PLUGIN_DIR = EXAMPLES / "plugins"
# Each job is killed early (its checkpoint must bring back what was counted before it), and has 2000 (ring) or 200
# (sor) steps after that point: ~2 s at least in which `ckpt checkpoint --kill` must come, the program still running.
RING_KILL_AT, RING_STEPS = 100, 2100
# 300 us of work per step
RING = [str(EXAMPLES / "ring.py"), str(RING_STEPS), "300"]
SOR_KILL_AT, SOR_STEPS = 20, 220
SOR = [str(ROOT / "dsm" / "programs" / "sor.py"), "128", str(SOR_STEPS)]


def _env(variable: str, pattern: Path) -> dict[str, str]:
    return {"PYTHONPATH": env(pythonpath=[PLUGIN_DIR])["PYTHONPATH"], variable: str(pattern)}


def _summaries(directory: Path, prefix: str, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((directory / f"{prefix}-{rank}.json").read_text()) for rank in range(ranks)]


def test_opcount_counts_every_post_across_a_restart(ckpt_jobs: Jobs, tmp_path: Path) -> None:
    plain = uninterrupted(tmp_path / "plain", 2, *RING)
    counts = _env("CKPT_OPCOUNT_FILE", tmp_path / "ops-{rank}.json")
    restarted = ckpt_jobs.restarted_results(
        2, *RING, kill_at=[RING_KILL_AT], launch=["--with-plugin", "ckpt_opcount"], extra_env=counts
    )
    assert restarted == plain
    for summary in _summaries(tmp_path, "ops", 2):
        assert summary["generation"] == 1, "the summary is the restarted run's"
        # one post_send per step: the counts of the steps before the checkpoint came back from the image,
        # and ckpt_ib's own re-posts at the restart, beneath this wrapper, are not the program's calls
        assert summary["ops"]["post_send"] == RING_STEPS
        assert summary["ops"]["poll_cq"] >= RING_STEPS


def test_dsmtrace_totals_survive_a_restart(ckpt_jobs: Jobs, tmp_path: Path) -> None:
    plugin = ["--with-plugin", "ckpt_dsmtrace"]
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    done = run(
        "launch",
        "-n",
        "3",
        "--ckpt-dir",
        str(plain_dir),
        *plugin,
        *SOR,
        extra_env=_env("CKPT_DSMTRACE_FILE", plain_dir / "trace-{rank}.json"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    restarted = ckpt_jobs.restarted_results(
        3,
        *SOR,
        kill_at=[SOR_KILL_AT],
        launch=plugin,
        extra_env=_env("CKPT_DSMTRACE_FILE", tmp_path / "trace-{rank}.json"),
    )
    assert restarted == results(done.stdout)
    plains, summaries = _summaries(plain_dir, "trace", 3), _summaries(tmp_path, "trace", 3)
    for plain, summary in zip(plains, summaries, strict=True):
        assert summary["generation"] == 1 and plain["generation"] == 0
        # step-aligned events are deterministic: the restarted run's totals are the uninterrupted run's
        assert summary["barriers"] == plain["barriers"] > 0
    # Diffs come from the two pages that neighbouring bands share (128 rows of 1 KiB over 3 ranks: rows 40-43 and
    # 84-87): both ranks first-touch each in setup, whichever claims it first is its home, and the other sends a diff
    # of it at every barrier (440 in 220 steps) -- plus one of its setup write or not, as the race went.  Which rank
    # that is differs between launches, so only the job's total compares, to within one per shared page (totals
    # that lost the counts of the 20 steps before the checkpoint would be short by 40).
    restarted_diffs, plain_diffs = sum(s["diffs"] for s in summaries), sum(p["diffs"] for p in plains)
    assert plain_diffs > 0 and abs(restarted_diffs - plain_diffs) <= 2, (restarted_diffs, plain_diffs)
    assert sum(s["diff_bytes"] for s in summaries) > 0


def test_the_counts_come_back_from_the_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit test docs/plugins.md §10 shows, run as it is shown."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import ckpt_opcount

    from ckpt.plugin import ImageContents
    from ckpt.testing import FakeRuntime

    monkeypatch.setenv("CKPT_OPCOUNT_FILE", str(tmp_path / "ops-{rank}.json"))
    rt, image = FakeRuntime(), ImageContents()
    ckpt_opcount._counts.update(post_send=3)
    ckpt_opcount.ckpt_precheckpoint(image)
    ckpt_opcount._counts.clear()  # the process is gone
    rt.new_generation()  # a restart
    ckpt_opcount.ckpt_restart(image)
    ckpt_opcount.ckpt_exit(rt)
    assert json.loads((tmp_path / "ops-0.json").read_text()) == {"generation": 1, "ops": {"post_send": 3}}
