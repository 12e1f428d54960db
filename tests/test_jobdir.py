"""The checkpoint directory of a job: one live job per directory, the job file, what clients see, leftovers."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckpt import CkptError
from ckpt import _jobdir as jobdir
from ckpt import _manifest as manifests


def _hold_in_child(directory: Path) -> subprocess.Popen[str]:
    """Another process that claims `directory` and keeps it until its stdin closes."""
    code = (
        "import sys; from pathlib import Path; from ckpt import _jobdir as j;"
        f"c = j.claim(Path({str(directory)!r}), job='other'); print(c.id, flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    child.claim_id = child.stdout.readline().strip()  # type: ignore[attr-defined]
    return child


def _release(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=30)


def test_a_second_claim_is_refused_in_one_line_naming_the_holder(tmp_path: Path) -> None:
    child = _hold_in_child(tmp_path / "d")
    try:
        with pytest.raises(jobdir.DirectoryBusy, match=r"job other is still running in .*\(pid \d+\).*ckpt kill"):
            jobdir.claim(tmp_path / "d")
    finally:
        _release(child)
    jobdir.claim(tmp_path / "d").release()  # free again once the holder is gone


def test_the_claim_dies_with_its_process(tmp_path: Path) -> None:
    child = _hold_in_child(tmp_path)
    assert jobdir.owner(tmp_path) == {"pid": child.pid, "claim": child.claim_id, "job": "other"}  # type: ignore[attr-defined]
    child.kill()  # kill -9: the kernel drops the flock
    child.wait()
    assert jobdir.owner(tmp_path) is None
    jobdir.claim(tmp_path).release()


def test_an_owner_probe_does_not_keep_a_launcher_out(tmp_path: Path) -> None:
    jobdir.claim(tmp_path).release()
    code = (
        "import sys; from pathlib import Path; from ckpt import _jobdir as j; d = Path(sys.argv[1]);"
        "print('probing', flush=True)\nwhile True: j.owner(d)"
    )
    prober = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout is not None and prober.stdout.readline().strip() == "probing"
        for _ in range(200):  # a client probing in a tight loop never makes a launcher's claim fail
            jobdir.claim(tmp_path).release()
    finally:
        prober.kill()
        prober.wait()


def test_the_directory_is_created_private_and_must_be_a_writable_directory(tmp_path: Path) -> None:
    jobdir.claim(tmp_path / "new").release()
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(CkptError, match="it is a file"):
        jobdir.claim(tmp_path / "file")


def test_the_job_file_is_private(tmp_path: Path) -> None:
    path = jobdir.write_job_file(tmp_path, address="127.0.0.1:1", token="t", job="j", pid=1, claim="c")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert jobdir.read_job_file(tmp_path) == {
        "address": "127.0.0.1:1",
        "token": "t",
        "job": "j",
        "pid": 1,
        "claim": "c",
    }


def test_a_job_file_a_full_disk_refuses_names_itself_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write's ENOSPC carries no file name: the error names the job file (the CLI prints it in one line)."""
    real = os.fdopen

    def full(fd: int, mode: str) -> object:
        f = real(fd, mode)
        f.write = _no_space  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(os, "fdopen", full)
    with pytest.raises(CkptError, match="No space left") as caught:
        jobdir.write_job_file(tmp_path, address="127.0.0.1:1", token="t", job="j", pid=1)
    assert str(caught.value) == f"cannot write {tmp_path / jobdir.JOB_FILE}: No space left on device"
    assert list(tmp_path.iterdir()) == []  # no .tmp left behind


def test_a_claim_a_full_disk_refuses_is_one_error_naming_the_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "pwrite", lambda *_: _no_space())
    with pytest.raises(CkptError, match=r"cannot write .*job.lock: No space left on device"):
        jobdir.claim(tmp_path / "ckpt")
    monkeypatch.undo()
    jobdir.claim(tmp_path / "ckpt").release()  # the failed claim let go of the directory


def _no_space(*_: object) -> int:
    raise OSError(28, "No space left on device")


def test_what_a_client_sees(tmp_path: Path) -> None:
    assert jobdir.find_job(tmp_path).state == "none"
    # a job that ended and said so
    jobdir.write_job_file(tmp_path, address="a:1", token="t", job="old", pid=1, claim="x", ended={"state": "finished"})
    assert jobdir.find_job(tmp_path).state == "ended"
    # a restart holds the directory but has not written its job file yet: the old job's is not its
    held = jobdir.claim(tmp_path)
    found = jobdir.find_job(tmp_path)
    assert found.state == "starting" and found.holder is not None and found.holder["claim"] == held.id
    jobdir.write_job_file(tmp_path, address="a:2", token="t", job="new", pid=os.getpid(), claim=held.id)
    found = jobdir.find_job(tmp_path)
    assert found.state == "live" and found.record is not None and found.record["job"] == "new"
    held.release()
    # its launcher died without recording an end (kill -9)
    assert jobdir.find_job(tmp_path).state == "gone"


def test_a_client_waits_for_a_starting_job(tmp_path: Path) -> None:
    held = jobdir.claim(tmp_path)
    code = (
        "import sys; from pathlib import Path; from ckpt import _jobdir as j; d = Path(sys.argv[1]);"
        "print(j.find_job(d).state, flush=True); print(j.find_job(d, wait=30).state, flush=True)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "starting"  # it has looked once: now it waits
    jobdir.write_job_file(tmp_path, address="a:2", token="t", job="new", pid=os.getpid(), claim=held.id)
    assert child.stdout.readline().strip() == "live"
    child.wait(timeout=30)


def test_a_holder_that_has_not_noted_itself_yet_is_starting(tmp_path: Path) -> None:
    """Between a new holder's flock and its note(), the lock file still names the previous holder."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    jobdir.write_job_file(tmp_path, address="a:1", token="t", job="old", pid=dead.pid, claim="old", ended={})
    held = jobdir.claim(tmp_path)
    os.pwrite(held.fd, json.dumps({"pid": dead.pid, "claim": "old", "job": "old"}).encode(), 0)
    assert jobdir.find_job(tmp_path).state == "starting"
    held.release()


def test_a_claim_waits_for_a_job_that_has_recorded_its_end(tmp_path: Path) -> None:
    """`ckpt kill` then `ckpt restart`: the killed job's launcher may still be reaping its ranks."""
    child = _hold_in_child(tmp_path)
    jobdir.write_job_file(
        tmp_path,
        address="a:1",
        token="t",
        job="other",
        pid=child.pid,
        claim=child.claim_id,
        ended={},  # type: ignore[attr-defined]
    )
    result: list[object] = []
    done = threading.Event()

    def claim() -> None:
        try:
            result.append(jobdir.claim(tmp_path))
        except CkptError as exc:
            result.append(exc)
        done.set()

    threading.Thread(target=claim, daemon=True).start()
    assert not done.wait(2.0), result  # past the 1 s a live job's directory is retried for
    _release(child)
    assert done.wait(30) and isinstance(result[0], jobdir.DirectoryClaim), result
    result[0].release()  # type: ignore[union-attr]


def test_wait_released(tmp_path: Path) -> None:
    child = _hold_in_child(tmp_path)
    assert not jobdir.wait_released(tmp_path, child.claim_id, 0.2)  # type: ignore[attr-defined]
    _release(child)
    assert jobdir.wait_released(tmp_path, child.claim_id, 30)  # type: ignore[attr-defined]


def test_a_restart_does_not_create_its_directory(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match=r"no checkpoint in .*missing: no such directory"):
        jobdir.claim(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_leftovers_of_a_killed_job_are_removed(tmp_path: Path) -> None:
    keep = ["ckpt_prog_0_1.ckpt", "ckpt_prog_1_1.ckpt", "ckpt_prog_1.json", "ckpt_other_0_2.ckpt", "notes.txt"]
    keep += ["download.part.tmp", "fabric.json.tmp"]  # the user's, and a plugin's (it cleans up after itself)
    stray = ["ckpt_prog_0_2.ckpt", "ckpt_prog_1_2.ckpt.tmp", "ckpt_prog_2.json.tmp", "latest.tmp"]
    for name in keep + stray:
        (tmp_path / name).write_text("x")
    removed = jobdir.remove_leftovers(tmp_path, "prog")
    assert sorted(p.name for p in removed) == sorted(stray)
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_remove_uncommitted_keeps_every_committed_image(tmp_path: Path) -> None:
    for name in ("ckpt_p_0_1.ckpt", "ckpt_p_0_3.ckpt", "ckpt_p_0_12.ckpt", "ckpt_p_1.json", "ckpt_p_12.json"):
        (tmp_path / name).write_text("x")
    assert [p.name for p in manifests.remove_uncommitted(tmp_path, "p")] == ["ckpt_p_0_3.ckpt"]
