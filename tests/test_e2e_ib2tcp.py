"""End-to-end: the ckpt_ib programs across transports (on tcp, simib -> tcp, tcp -> simib, and back), via the CLI.

The ib2tcp plugin contributes the `tcp` verbs provider; ckpt_ib rebuilds the
program's verbs objects on whichever transport the restart names.  Each
restart is checked against the plain-Python answer (tests/ib_cases.py) and
the trace ckpt_ib writes shows which provider each generation ran on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ib_cases import (
    BY_NAME,
    CASES,
    RANKS,
    TRACE_ENV,
    Case,
    Hold,
    Pauses,
    expected_seq,
    gated_steps,
    launch_args,
    take,
    traced,
)

from ckpt.testing import Job, results, run
from harness import PROGRAMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _providers(trace: Path, generation: int) -> set[str]:
    return {traced(trace, rank, generation)["provider"] for rank in range(RANKS)}


def test_a_run_on_tcp_gives_the_plain_python_answer(tmp_path: Path) -> None:
    """The ring here; every other program runs on tcp in the restart tests below."""
    case = next(c for c in CASES if c.name == "ring")
    trace = tmp_path / "trace"
    trace.mkdir()
    argv = case.argv(case.short)
    done = run(*launch_args(tmp_path / "ckpt", argv, "--transport", "tcp"), extra_env={TRACE_ENV: str(trace)})
    assert done.returncode == 0, done.stderr
    assert results(done.stdout) == case.expect(case.short)
    assert _providers(trace, 0) == {"tcp"}
    assert not (tmp_path / "ckpt" / "fabric.json").exists(), "a tcp job needs no subnet manager"


def _switch(
    start_job: Callable[..., Job], tmp_path: Path, case: Case, transports: list[str], *, explicit: bool = True
) -> None:
    """Launch on transports[0], then for each next one: checkpoint --kill, restart on it; the last run ends."""
    gates = [case.checkpoint_at * generation for generation in range(1, len(transports))]
    pauses = Pauses(tmp_path, *gates)  # each checkpoint falls mid-run, however fast the steps are
    ckpt_dir, trace, steps, hold = tmp_path / "ckpt", tmp_path / "trace", gated_steps(gates[-1]), Hold(tmp_path)
    trace.mkdir()
    env = {TRACE_ENV: str(trace), **hold.env, **pauses.env}
    job = start_job(
        *launch_args(ckpt_dir, case.argv(steps), "--transport", transports[0]), ckpt_dir=ckpt_dir, extra_env=env
    )
    for generation, (transport, at) in enumerate(zip(transports[1:], gates, strict=True), start=1):
        pauses.wait(at)
        take(ckpt_dir, "--kill")
        assert job.wait() == 0, job.stderr
        pauses.open(at)
        if generation == len(transports) - 1:
            hold.release()
        how = ["--transport", transport] if explicit else []
        job = start_job("restart", *how, "--ckpt-dir", str(ckpt_dir), ckpt_dir=ckpt_dir, extra_env=env)
    assert job.wait() == 0, job.stderr
    assert results(job.stdout) == case.expect(steps)
    for generation, transport in enumerate(transports):
        assert _providers(trace, generation) == {transport}, f"generation {generation}"


@BY_NAME  # every program: the only tcp run of most of them
def test_checkpointed_on_simib_restarts_on_tcp(case: Case, start_job: Callable[..., Job], tmp_path: Path) -> None:
    _switch(start_job, tmp_path, case, ["simib", "tcp"])


SEQ = Case("seq", PROGRAMS / "ib_seq.py", (), lambda n: expected_seq(RANKS, n), 600, 10)
PINGPONG = next(c for c in CASES if c.name == "pingpong")


@pytest.mark.parametrize(
    "case", [pytest.param(SEQ, id="seq", marks=pytest.mark.stress), pytest.param(PINGPONG, id="pingpong")]
)
def test_launched_on_tcp_restarts_on_simib(case: Case, start_job: Callable[..., Job], tmp_path: Path) -> None:
    _switch(start_job, tmp_path, case, ["tcp", "simib"])


def test_two_consecutive_switches_lose_and_repeat_nothing(start_job: Callable[..., Job], tmp_path: Path) -> None:
    _switch(start_job, tmp_path, SEQ, ["simib", "tcp", "simib"])


def test_a_restart_keeps_the_transport_of_its_checkpoint(start_job: Callable[..., Job], tmp_path: Path) -> None:
    _switch(start_job, tmp_path, SEQ, ["tcp", "tcp"], explicit=False)


def test_restart_one_rank_under_pdb_over_tcp(start_job: Callable[..., Job], tmp_path: Path) -> None:
    """The docs/ib2tcp.md walkthrough: checkpointed on simib, restarted over TCP with rank 2 in pdb."""
    case = next(c for c in CASES if c.name == "ring")
    ckpt_dir, steps = tmp_path / "ckpt", gated_steps(case.checkpoint_at)
    hold, pauses = Hold(tmp_path), Pauses(tmp_path, case.checkpoint_at)
    job = start_job(*launch_args(ckpt_dir, case.argv(steps)), ckpt_dir=ckpt_dir, extra_env={**hold.env, **pauses.env})
    pauses.wait(case.checkpoint_at)
    take(ckpt_dir, "--kill")
    assert job.wait() == 0, job.stderr
    pauses.open(case.checkpoint_at)
    hold.release()

    wrong = run("restart", "--debug", str(RANKS), "--ckpt-dir", str(ckpt_dir))
    assert wrong.returncode != 0 and "error: --debug 4: the checkpoint has ranks 0..3" in wrong.stderr, wrong.stderr

    restart = ["restart", "--debug", "2", "--transport", "tcp", "--ckpt-dir", str(ckpt_dir)]
    commands = "p type(program).__name__, program.steps\nc\n"
    done = run(*restart, stdin=commands, timeout=120, extra_env=hold.env)
    assert done.returncode == 0, done.stderr
    assert "ckpt: rank 2 restarted before step" in done.stderr, done.stderr
    assert f"(Pdb) ('HeldRing', {steps})" in done.stdout, done.stdout  # pdb ran in rank 2, on its program
    after_pdb = done.stdout.replace("(Pdb) ", "")  # the last prompt shares a line with the first result
    assert results(after_pdb) == case.expect(steps)
