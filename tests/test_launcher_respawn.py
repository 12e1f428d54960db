"""The launcher's part of single-rank recovery: which image a respawned rank loads, and a respawn that fails."""

from __future__ import annotations

import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from ckpt import _launcher
from ckpt._errors import ImageError
from ckpt._manifest import image_name, write_manifest
from ckpt._schemas import Manifest, ProgramInfo, RankEntry
from ckpt._wire import Heartbeat

pytestmark = pytest.mark.timeout(30)

TOKEN = "respawn-token-0123456789"
WAIT = 5.0


def _manifest(number: int, kind: str = "job", ranks: list[RankEntry] | None = None) -> Manifest:
    return Manifest(
        job="j1",
        program=ProgramInfo(path="/x/heat.py", name="heat", class_="Heat", sha256="ab" * 32),
        argv=[],
        size=2,
        number=number,
        generation=0,
        created=1700000000.0,
        seconds=0.5,
        transport="tcp",
        plugins=[],
        coordinator="127.0.0.1:1",
        id_counters={},
        kind=kind,
        ranks=ranks or [RankEntry(rank=r, file=image_name("heat", r, number), bytes=5) for r in range(2)],
    )


def _checkpoint(directory: Path, number: int) -> None:
    for rank in range(2):
        (directory / image_name("heat", rank, number)).write_bytes(b"image")
    write_manifest(directory, _manifest(number), token=TOKEN.encode())


def _opts(directory: Path) -> _launcher.JobOptions:
    return _launcher.JobOptions(
        program="/x/heat.py", argv=[], ranks=2, ckpt_dir=directory, transport="tcp", on_failure="recover"
    )


def _spec(directory: Path, rank: int, number: int) -> dict[str, Any]:
    return _launcher.recovery_spec(_opts(directory), rank, 1, number, "127.0.0.1:1", TOKEN, "j1")


def test_a_respawned_rank_loads_the_image_the_coordinator_names_not_the_newest_on_disk(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2)  # say, of a run that a whole-job restart from 1 rolled back
    spec = _spec(tmp_path, 1, 1)
    assert spec["restart"]["number"] == 1 and spec["restart"]["image"] == str(tmp_path / image_name("heat", 1, 1))
    assert spec["recover"] == {"incarnation": 1}
    # an independent checkpoint 3 of rank 1: rank 0's image in it is still checkpoint 2's
    (tmp_path / image_name("heat", 1, 3)).write_bytes(b"image")
    ranks = [RankEntry(rank=0, file=image_name("heat", 0, 2), bytes=5, number=2)]
    ranks.append(RankEntry(rank=1, file=image_name("heat", 1, 3), bytes=5))
    write_manifest(tmp_path, _manifest(3, "rank", ranks), token=TOKEN.encode())
    assert _spec(tmp_path, 1, 3)["restart"]["image"] == str(tmp_path / image_name("heat", 1, 3))
    with pytest.raises(ImageError, match=r"ckpt_heat_3\.json has no image of rank 0 from checkpoint 3"):
        _spec(tmp_path, 0, 3)
    with pytest.raises(ImageError, match=r"rank 0.s latest image is checkpoint 7, but .* does not exist"):
        _spec(tmp_path, 0, 7)


class _Coordinator:
    """What the respawner tells the coordinator: the job's failure."""

    def __init__(self) -> None:
        self.failures: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.outcome: dict[str, Any] | None = None

    def fail(self, message: str) -> None:
        self.failures.put(message)


def test_a_respawn_that_cannot_start_its_process_fails_the_job_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint(tmp_path, 1)

    def no_process(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    job = object.__new__(_launcher._Job)  # only the respawner's state: no coordinator, no processes
    coordinator = _Coordinator()
    job.opts, job.address, job.token, job.job_id = _opts(tmp_path), "127.0.0.1:1", TOKEN, "j1"
    job.coordinator = coordinator  # type: ignore[assignment]
    job.changed, job.processes, job.current, job.exited = threading.Condition(), [], {}, {}
    job._respawns, job.services_env, job.heartbeat, job.epoch = queue.SimpleQueue(), {}, Heartbeat(), 0
    threading.Thread(target=job._respawner, daemon=True).start()
    job._respawns.put((0, 1, 1, 1))
    assert coordinator.failures.get(timeout=WAIT) == "cannot respawn rank 1: [Errno 24] Too many open files"
    job._respawns.put((0, 0, 1, 9))  # the thread lives on: a later failure is said too
    assert "cannot respawn rank 0: rank 0's latest image is checkpoint 9" in coordinator.failures.get(timeout=WAIT)
    # after a fallback's whole-job restart (epoch 1), a respawn the job before asked for is dropped
    job.epoch = 1
    job._respawns.put((0, 1, 1, 1))
    job._respawns.put((1, 0, 1, 1))
    assert coordinator.failures.get(timeout=WAIT) == "cannot respawn rank 0: [Errno 24] Too many open files"
