"""The kill campaign of recovery by replay: DSM jobs under `--on-failure recover`, ranks killed -9, runs checked.

One shape for every run (tests/test_e2e_replay.py and its stress campaign):
launch a DSM program through the CLI on 4 ranks with remote logging under
``--on-failure recover`` (ckpt_ib loaded) -> wait for the first checkpoint ->
kill -9 the chosen ranks, at a step (from the test, by PID) or at the Nth call
of a DSM hook (from inside, tests/programs/plugins/ckpt_dsmkill.py) -> wait
until each is back and has finished its steps -> let the job end -> compare
with the uninterrupted answer, the survivors' PIDs, the recovered ranks'
statistics.  The job idles at its end until the test lets it finish
(tests/programs/dsm_replayed.py, $CKPT_TEST_HOLD), so the survivors are
still there to serve a rank that recovers late in the run.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsm_util import expected_lines
from ib_cases import HOLD_ENV

from ckpt.testing import Job, results, wait_for
from ckpt.testing import run as run_ckpt
from harness import PROGRAMS

RANKS = 4
LOG_HOME_OFFSET = 1  # ckpt_remotelog's default: rank R's log home is R + 1
PROGRAM = PROGRAMS / "dsm_replayed.py"
RECOVER = ("--on-failure", "recover", "--logging", "remote", "--with-plugin", "ckpt_dsmkill")
PROGRAM_ENV, STATS_ENV = "CKPT_TEST_DSM_PROGRAM", "CKPT_TEST_DSM_STATS"
KILL_ENV, MARK_ENV = "CKPT_TEST_DSM_KILL", "CKPT_TEST_DSM_KILL_MARK"
#: What the launcher says when a rank cannot be recovered from the logs (design §2.2a, §2.7).
FALLBACK = "failed together with its log home"
#: How long a recovery may take on a loaded 2-core machine (respawn, image, reconnection, replay).
RECOVERY_TIMEOUT = 120.0


@dataclass(frozen=True)
class ReplayCase:
    """A program of dsm/programs as the campaign runs it on 4 ranks (2-5 s uninterrupted on 2 cores)."""

    name: str
    args: tuple[str, ...]
    steps: int  # what an uninterrupted run takes (TSP's count depends on timing: a lower bound)
    #: hook -> a count every rank (but rank 0 for dsm_diff_sent, see `hooks_for`) reaches after the first
    #: checkpoint: the largest N a run may kill at (the counts of 4-rank runs, halved)
    hooks: dict[str, int] = field(default_factory=dict)
    #: Does every rank read pages homed elsewhere after (nearly) every barrier?  Then a replay of 5 steps faults
    #: on them and must get minimal versions (`regenerated_pages`).  Water, TSP and IS: rank 0 is home of
    #: (nearly) all it reads; the other ranks fault at least once a step (4-rank runs: 1 to 9 per step).
    all_read_remote: bool = True

    def __str__(self) -> str:
        return self.name

    def hooks_for(self, rank: int) -> dict[str, int]:
        """Rank 0 first-touches (is home of) what Water and TSP share: it may send no diff at all."""
        return {h: n for h, n in self.hooks.items() if rank != 0 or h != "dsm_diff_sent"}


_BARRIERS = ("dsm_barrier_arriving", "dsm_barrier_passed")
_LOCKS = ("dsm_lock_acquired", "dsm_lock_releasing", "dsm_lock_released")
CASES = {
    case.name: case
    for case in [
        ReplayCase("sor", ("128", "60"), 60, {**dict.fromkeys(_BARRIERS, 100), "dsm_interval_closing": 60}),
        ReplayCase(
            "water",
            ("128", "30", "8"),
            30,
            {
                **dict.fromkeys(_BARRIERS, 50),
                **dict.fromkeys(_LOCKS, 45),
                # 128 molecules are one page per array, homed by whichever rank touched it first: a rank home
                # of the forces may send little more than its energy diffs, one a step to rank 0 (30 a run;
                # counted over 6 runs per protocol: 60 to 300 per rank)
                "dsm_diff_sent": 25,
                "dsm_interval_closing": 60,
            },
            all_read_remote=False,
        ),
        ReplayCase(
            "isort",
            ("4096", "256", "30"),
            30,
            {
                **dict.fromkeys(_BARRIERS, 50),
                **dict.fromkeys(_LOCKS, 15),
                "dsm_diff_sent": 90,
                "dsm_interval_closing": 45,
            },
            all_read_remote=False,
        ),
        ReplayCase(
            "tsp",
            ("10", "4", "4"),
            30,
            {
                **dict.fromkeys(_BARRIERS, 50),
                **dict.fromkeys(_LOCKS, 150),
                "dsm_diff_sent": 150,
                "dsm_interval_closing": 150,
            },
            all_read_remote=False,
        ),
    ]
}


@dataclass(frozen=True)
class Kill:
    """kill -9 of `rank`: by the test once the rank reported step `step`, or by the rank itself at the `n`th
    call of DSM hook `hook` after the first checkpoint (tests/programs/plugins/ckpt_dsmkill.py)."""

    rank: int
    step: int = 0
    hook: str = ""
    n: int = 0

    def __str__(self) -> str:
        return f"rank {self.rank} at {self.hook} #{self.n}" if self.hook else f"rank {self.rank} at step {self.step}"


def log_home(rank: int) -> int:
    return (rank + LOG_HOME_OFFSET) % RANKS


@functools.cache
def uninterrupted(name: str, protocol: str) -> dict[int, str]:
    """What every run of `name` must end with, under either protocol: what an uninterrupted run prints
    (`expected_lines`: numpy's answer, which test_dsm_programs checks against real runs)."""
    return expected_lines(name, CASES[name].args, RANKS)


# ----------------------------------------------------------------- choosing a run from a seed
def random_kills(rng: random.Random, case: ReplayCase, victims: list[int]) -> list[Kill]:
    """One kill per victim at a random moment: at a random step of the run (all at the same one when there are
    several), or, for a single victim, one time in two at the Nth call of a random DSM hook it surely reaches."""
    if len(victims) == 1 and rng.random() < 0.5:
        hooks = case.hooks_for(victims[0])
        hook = rng.choice(sorted(hooks))
        return [Kill(victims[0], hook=hook, n=rng.randint(2, hooks[hook]))]
    step = rng.randint(1, case.steps * 3 // 4)
    return [Kill(rank, step=step) for rank in victims]


def non_adjacent_pair(rng: random.Random) -> list[int]:
    """Two ranks neither of which is the other's log home: both recover from logs kept by live ranks."""
    first = rng.randrange(RANKS)
    candidates = [r for r in range(RANKS) if r != first and log_home(r) != first and log_home(first) != r]
    return sorted([first, rng.choice(candidates)])


# ----------------------------------------------------------------- one run
class ReplayRun:
    """One DSM job under `--on-failure recover`: its files, its job, and the checks of its end."""

    def __init__(
        self,
        start_job: Callable[..., Job],
        tmp_path: Path,
        case: ReplayCase,
        protocol: str,
        label: str,
        options: tuple[str, ...] = (),
    ):
        self.case, self.protocol, self.label, self.options = case, protocol, label, options
        self.ckpt_dir = tmp_path / "ckpt"
        self.stats_prefix, self.marks, self.hold = tmp_path / "stats", tmp_path / "marks", tmp_path / "release"
        self.marks.mkdir(parents=True, exist_ok=True)
        self.start_job = start_job
        self.job: Job | None = None

    def fail(self, what: str) -> AssertionError:
        """An assertion naming the run (its seed) and showing the end of the job's output."""
        out, err = self.job.read() if self.job is not None and self.job.process is not None else ("", "")
        tail = "\n".join((out + err).strip().splitlines()[-25:])
        running = self.job is not None and self.job.process is not None and self.job.process.poll() is None
        shown = run_ckpt("status", "--ckpt-dir", str(self.ckpt_dir), timeout=30).stdout if running else ""
        stacks = self.stacks() if running else ""
        stats = {
            r: _replay_counters(s) | {"incarnation": s["incarnation"]} for r in range(RANKS) if (s := self.stats(r))
        }
        return AssertionError(
            f"{self.label}: {what}\n--- ckpt status ---\n{shown}--- statistics written ---\n{stats}\n"
            f"--- job output (end) ---\n{tail}{stacks}"
        )

    def stacks(self) -> str:
        """Every live rank's DSM state (SIGUSR2) and threads' stacks (SIGUSR1), for a run that hangs
        (tests/programs/dsm_replayed.py)."""
        assert self.job is not None
        state = self.job.poll_status() or {"ranks": []}
        files: dict[int, list[Path]] = {}
        for entry in state["ranks"]:
            paths = [Path(f"{self.stats_prefix}.{kind}.{entry['pid']}") for kind in ("dsm", "stacks")]
            try:
                os.kill(entry["pid"], signal.SIGUSR2)
                os.kill(entry["pid"], signal.SIGUSR1)
            except ProcessLookupError:
                continue
            files[entry["rank"]] = paths
        written = [p for paths in files.values() for p in paths]
        try:
            wait_for(lambda: all(p.exists() and p.stat().st_size for p in written), 10, "the stacks")
        except AssertionError:
            pass  # show what there is
        shown = [
            f"--- rank {r} ---\n" + "".join(p.read_text() if p.exists() else f"(no {p.name})\n" for p in paths)
            for r, paths in sorted(files.items())
        ]
        return "\n--- DSM state (SIGUSR2) and stacks (SIGUSR1) ---\n" + "\n".join(shown)

    def check(self, condition: object, what: str) -> None:
        if not condition:
            raise self.fail(what)

    def launch(self, kills: list[Kill]) -> Job:
        hooked = [k for k in kills if k.hook]
        assert len(hooked) <= 1, "ckpt_dsmkill kills one rank per job"
        env = {
            PROGRAM_ENV: self.case.name,
            STATS_ENV: str(self.stats_prefix),
            HOLD_ENV: str(self.hold),
            MARK_ENV: str(self.marks),
            **({KILL_ENV: f"{hooked[0].hook}:{hooked[0].rank}:{hooked[0].n}"} if hooked else {}),
        }
        options = ("--dsm-protocol", self.protocol, *RECOVER, *self.options)
        argv = [str(PROGRAM), *self.case.args]
        self.job = self.start_job(
            "launch", "-n", str(RANKS), "--ckpt-dir", str(self.ckpt_dir), *options, *argv,
            ckpt_dir=self.ckpt_dir, extra_env=env,
        )  # fmt: skip
        return self.job

    # -- waits
    def status(self) -> dict[str, Any] | None:
        assert self.job is not None and self.job.process is not None
        if self.job.process.poll() is not None:
            raise self.fail(f"the job ended early (exit {self.job.process.returncode})")
        return self.job.poll_status()

    def settled(self) -> dict[str, Any]:
        """The status once every rank runs, none failed or recovering, and the first checkpoint is written."""

        def settled() -> dict[str, Any] | None:
            state = self.status()
            if (
                not state
                or len(state["ranks"]) < RANKS
                or state["state"] in ("waiting", "finished", "failed", "killed")
            ):
                return None
            if any(r["state"] in ("failed", "recovering") for r in state["ranks"]) or not state["last_checkpoint"]:
                return None
            return state

        return self._wait(settled, 90, "every rank running after the first checkpoint")

    def _wait(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        try:
            return wait_for(condition, timeout, what)
        except AssertionError as exc:
            if str(exc).startswith(self.label):
                raise
            raise self.fail(str(exc)) from None

    def kill(self, kills: list[Kill]) -> None:
        """Do the kills: the test's own (every victim back to back once the first reached its step), and
        wait for the hooked one's mark."""
        stepped = [k for k in kills if not k.hook]
        if stepped:
            target = stepped[0].step

            def reached() -> dict[str, Any] | None:
                state = self.status()
                steps = {r["rank"]: r for r in (state or {}).get("ranks", [])}
                return steps if steps.get(stepped[0].rank, {}).get("step", -1) >= target else None

            now = self._wait(reached, 90, f"rank {stepped[0].rank} past step {target}")
            for k in stepped:
                os.kill(now[k.rank]["pid"], signal.SIGKILL)
        for k in kills:
            if k.hook:
                mark = self.marks / f"killed.{k.rank}"
                self._wait(mark.exists, 90, f"rank {k.rank} to kill itself at {k.hook} #{k.n}")

    def stats(self, rank: int) -> dict[str, Any] | None:
        path = Path(f"{self.stats_prefix}.{rank}")
        return json.loads(path.read_text()) if path.exists() else None

    def wait_recovered(self, victims: list[int]) -> dict[int, dict[str, Any]]:
        """Each victim's statistics once its next incarnation has finished its steps (its replay is over), and
        the survivors' once they have."""

        def done() -> dict[int, dict[str, Any]] | None:
            self.status()  # fails at once if the job ended meanwhile
            found = {r: self.stats(r) for r in range(RANKS)}
            if any(s is None or (r in victims and s["incarnation"] < 1) for r, s in found.items()):
                return None
            return found  # type: ignore[return-value]

        return self._wait(done, RECOVERY_TIMEOUT, f"ranks {victims} back and through their steps")  # type: ignore[no-any-return]

    def wait_restarted(self) -> dict[int, dict[str, Any]]:
        """Every rank's statistics once the whole job, restarted from the coordinated checkpoint, did its steps."""

        def done() -> dict[int, dict[str, Any]] | None:
            self.status()
            found = {r: self.stats(r) for r in range(RANKS)}
            if any(s is None or not s["restarted"] or s["recovered"] for s in found.values()):
                return None
            return found  # type: ignore[return-value]

        return self._wait(done, RECOVERY_TIMEOUT, "the whole job restarted and through its steps")  # type: ignore[no-any-return]

    def finish(self) -> str:
        """Let the job end; it must end well with the uninterrupted answer.  Its stderr."""
        assert self.job is not None
        self.hold.touch()
        code = self.job.wait(RECOVERY_TIMEOUT)
        self.check(code == 0, f"the job exited with {code}")
        want = uninterrupted(self.case.name, self.protocol)
        got = results(self.job.stdout)
        self.check(got == want, f"the results differ from an uninterrupted run's:\n got  {got}\n want {want}")
        self.check("Traceback" not in self.job.stderr, "a traceback in the job's output")
        return self.job.stderr


def run_recovering(
    start_job: Callable[..., Job],
    tmp_path: Path,
    case: ReplayCase,
    protocol: str,
    kills: list[Kill],
    label: str,
    options: tuple[str, ...] = (),
) -> dict[int, dict[str, Any]]:
    """A run whose victims (not log homes of each other) recover alone by replay; every check of the campaign.

    The job ends with the uninterrupted answer; the other ranks have their first PIDs, incarnation 0, all along
    (their statistics are written by that same process at its end); each victim is incarnation 1 and
    verifiably replayed: replayed acquires / barriers, no message to the barrier manager or a lock home for
    what it replayed, minimal-version pages where it faulted.  The statistics of every rank.  `options`: more
    options of `ckpt launch`.
    """
    run = ReplayRun(start_job, tmp_path, case, protocol, label, options)
    run.launch(kills)
    first = {r["rank"]: r["pid"] for r in run.settled()["ranks"]}
    run.kill(kills)
    for k in kills:  # a hook kill may fire before `settled` saw the first pids: its mark has the victim's
        if k.hook:
            first[k.rank] = int(json.loads((run.marks / f"killed.{k.rank}").read_text())["pid"])
    victims = sorted({k.rank for k in kills})
    stats = run.wait_recovered(victims)
    now = run.status()
    assert now is not None
    for entry in now["ranks"]:
        rank = entry["rank"]
        if rank in victims:
            run.check(entry["incarnation"] == 1 and entry["pid"] != first[rank], f"rank {rank} not respawned once")
        else:
            run.check((entry["pid"], entry["incarnation"]) == (first[rank], 0), f"survivor {rank} changed: {entry}")
    stderr = run.finish()
    run.check(FALLBACK not in stderr and "diverged" not in stderr, "the job fell back to a whole-job restart")
    said = re.finditer(r"rank (\d+) \(pid \d+ on [^)]*\) was lost at step (\d+)", stderr)
    lost = {int(m[1]): int(m[2]) for m in said}  # the steps each victim's failed incarnation had done
    for rank, s in stats.items():
        if rank not in victims:
            run.check((s["pid"], s["incarnation"]) == (first[rank], 0), f"survivor {rank} ended as {s['pid']}")
    survivor = stats[min(set(range(RANKS)) - set(victims))]
    for rank in victims:
        check_replayed(run, case, stats[rank], survivor, alone=len(victims) == 1, lost_at=lost.get(rank))
    return stats


def check_replayed(
    run: ReplayRun, case: ReplayCase, s: dict[str, Any], survivor: dict[str, Any], alone: bool, lost_at: int | None
) -> None:
    """A recovered rank replayed from the log rather than re-executing with live traffic.

    `lost_at`: the steps its failed incarnation had done (the launcher's "was lost at step N").
    """
    rank = s["rank"]
    run.check(s["recovered"] and s["incarnation"] == 1, f"rank {rank}'s statistics are not its recovered process's")
    replayed = s["replayed_acquires"] + s["replayed_releases"] + s["replayed_barriers"]
    # one logged operation or none: a kill right after the image (e.g. at its first barrier, before the exit was
    # logged: its arrival is sent again) leaves nothing to replay; any more hold an acquire, release or exit
    run.check(
        replayed > 0 or s["replay_operations"] <= 1, f"rank {rank} replayed no logged operation: {_replay_counters(s)}"
    )
    if s["replay_operations"] == 0:
        # nothing logged after its image: fine only if that image is of the step it was lost in (say, an
        # independent checkpoint at that step's boundary, and the kill right after it)
        run.check(
            lost_at is not None and s["resumed_at"] >= lost_at,
            f"rank {rank} had nothing to replay, yet resumed at step {s['resumed_at']} after it was lost at step "
            f"{lost_at}: {_replay_counters(s)}",
        )
    else:
        run.check(s["replay_seconds"] > 0, f"rank {rank}'s replay_seconds is 0: {_replay_counters(s)}")
    if alone:  # with another rank recovering, requests re-sent over a rebuilt link are counted twice
        messages = s["messages"]
        run.check(
            messages.get("barrier", 0) + s["replayed_barriers"] == survivor["barriers"],
            f"rank {rank}: {messages.get('barrier', 0)} barrier arrivals sent + {s['replayed_barriers']} replayed "
            f"!= the {survivor['barriers']} barriers of the job: it contacted the barrier manager while replaying",
        )
        acquires, releases = messages.get("acquire", 0), messages.get("release", 0)
        # whether `lock_acquires` counts the replayed acquires or only the live ones, a replayed one sent nothing
        run.check(
            s["lock_acquires"] in (acquires + s["replayed_acquires"], acquires),
            f"rank {rank}: {acquires} acquires sent, {s['replayed_acquires']} replayed, {s['lock_acquires']} "
            "counted: it contacted a lock home while replaying",
        )
        run.check(
            releases + s["replayed_releases"] == acquires + s["replayed_acquires"],
            f"rank {rank}: {releases} releases sent + {s['replayed_releases']} replayed != {acquires} acquires sent "
            f"+ {s['replayed_acquires']} replayed",
        )
    if (case.all_read_remote or rank != 0) and s["replayed_barriers"] >= 10:
        run.check(
            s["regenerated_pages"] > 0, f"rank {rank} replayed without a minimal-version page: {_replay_counters(s)}"
        )


def _replay_counters(s: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "replay_operations",
        "replayed_acquires",
        "replayed_releases",
        "replayed_barriers",
        "regenerated_pages",
        "replay_seconds",
    )
    return {k: s.get(k) for k in keys}


def run_falling_back(
    start_job: Callable[..., Job], tmp_path: Path, case: ReplayCase, protocol: str, rank: int, step: int, label: str
) -> str:
    """Rank `rank` killed together with its log home: one line says so, the whole job restarts from the
    coordinated checkpoint, still under recover, and ends with the uninterrupted answer.  That line."""
    run = ReplayRun(start_job, tmp_path, case, protocol, label)
    run.launch([])
    run.settled()
    run.kill([Kill(rank, step=step), Kill(log_home(rank), step=step)])
    run.wait_restarted()
    state = run.status()
    run.check(
        state is not None and state["on_failure"] == "recover", f"the restarted job is not under recover: {state}"
    )
    stderr = run.finish()
    lines = [line for line in stderr.splitlines() if FALLBACK in line]
    run.check(len(lines) == 1, f"not one line saying rank {rank} failed with its log home: {lines}")
    (line,) = lines
    run.check(f"rank {rank}" in line or f"rank {log_home(rank)}" in line, f"the line names neither rank: {line}")
    return line
