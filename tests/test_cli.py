"""The click command tree: every option is documented, and usage errors are one line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from ckpt._launcher import RANK_VARIABLES, external_rank
from ckpt.cli import cli, main


def _commands(group: click.Group, prefix: str = "ckpt") -> Iterator[tuple[str, click.Command]]:
    """Every command and subcommand, those installed plugins add (`ckpt fabric ...`) included."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        path = f"{prefix} {name}"
        yield path, command
        if isinstance(command, click.Group):
            yield from _commands(command, path)


def test_the_command_walk_sees_plugin_commands() -> None:
    assert "ckpt fabric status" in dict(_commands(cli))  # else the test below would skip them


def test_every_option_of_every_command_says_what_it_does() -> None:
    undocumented = [
        f"{path} {param.opts[0]}"
        for path, command in _commands(cli)
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()
    ]
    assert undocumented == []
    assert all((command.help or "").strip() for _, command in _commands(cli))


def _help(*args: str) -> str:
    with pytest.raises(SystemExit) as exit_info, pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", ["ckpt", *args, "--help"])
        main()
    assert exit_info.value.code == 0
    return ""


def test_defaults_and_waiting_are_shown(capsys: pytest.CaptureFixture[str]) -> None:
    _help("launch")
    text = " ".join(capsys.readouterr().out.split())
    assert "only on request" in text  # --interval's default
    assert "$CKPT_DIR or ./ckpt-images" in text
    assert "$CKPT_LOG_LEVEL or WARNING" in text
    _help("checkpoint")
    assert "waits for it" in " ".join(capsys.readouterr().out.split())  # --kill waits for the checkpoint


def test_help_leaves_the_scheduling_policy_alone_and_shows_its_choices(capsys: pytest.CaptureFixture[str]) -> None:
    before = os.sched_getscheduler(0)
    _help("launch")  # main() applies --sched before it imports plugins, but not for a command that runs no job
    assert os.sched_getscheduler(0) == before
    text = " ".join(capsys.readouterr().out.split())
    assert "--sched [batch|other]" in text and "env var: CKPT_SCHED; default: batch" in text


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["launch", "--chekpoint-dir", "x", "prog.py"], ["No such option '--chekpoint-dir'", "--ckpt-dir"]),
        (["lanch"], ["No such command 'lanch'"]),
        (["--verbose"], ["No such option '--verbose'"]),
        (["status", "--json", "extra"], ["Got unexpected extra argument"]),
    ],
)
def test_a_usage_error_is_one_line(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["ckpt", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ")
    for needle in needles:
        assert needle in err, err


def test_a_restart_can_drop_a_recorded_with_plugin_module() -> None:
    from ckpt.cli import _recorded_plugins

    manifest = {
        "with_plugins": ["pkg.ckpt_probe", "ckpt_other"],
        "plugins": [{"name": "probe", "module": "pkg.ckpt_probe"}, {"name": "ib", "module": "ckpt_ib"}],
    }
    assert _recorded_plugins(manifest, ()) == ["pkg.ckpt_probe", "ckpt_other"]
    assert _recorded_plugins(manifest, ("probe",)) == ["ckpt_other"]  # by the name the manifest records
    assert _recorded_plugins(manifest, ("ckpt_other",)) == ["pkg.ckpt_probe"]  # or the module's own name
    assert _recorded_plugins({}, ()) == []


def test_interval_zero_turns_interval_checkpoints_off() -> None:
    from ckpt import CkptError
    from ckpt.cli import _interval

    assert _interval(None) is None and _interval(0.0) is None and _interval(2.5) == 2.5
    with pytest.raises(CkptError, match=r"at least 0\.01 s"):
        _interval(0.001)


def test_ranks_of_an_external_launcher_need_a_coordinator(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.delenv("CKPT_COORDINATOR", raising=False)
    monkeypatch.setattr("sys.argv", ["ckpt", "launch", "--ckpt-dir", str(tmp_path / "d"), "prog.py"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: this process is rank 1 of 4 under an external launcher") and "--coordinator" in err
    assert not (tmp_path / "d").exists()  # refused before it claimed anything


@pytest.mark.parametrize(("rank_var", "size_var"), RANK_VARIABLES)
def test_every_external_launchers_rank_variables_are_read(
    rank_var: str, size_var: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CI's end-to-end run uses PMI_*; the others are read the same way (test_e2e_external, stress)."""
    for names in RANK_VARIABLES:
        for name in names:
            monkeypatch.delenv(name, raising=False)
    assert external_rank() is None
    monkeypatch.setenv(rank_var, "2")
    assert external_rank() == (2, None)
    monkeypatch.setenv(size_var, "5")
    assert external_rank() == (2, 5)


def test_ckpt_plugins_names_the_transports_and_commands_of_the_installed_plugins(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["ckpt", "plugins"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "transports: simib (default)" in out and "commands: fabric" in out and "transports: tcp" in out


def _rank(state: str = "running", incarnation: int = 0, **plugins: object) -> dict[str, object]:
    return {"rank": 2, "state": state, "incarnation": incarnation, "plugins": plugins}


def test_status_shows_a_live_ranks_long_waits_as_its_plugins_report_them() -> None:
    from ckpt._cli_control import _long_waits

    dsm = {"waits": [{"what": "barrier 4", "since": 90.0}, {"what": "room in the log rings", "since": 97.5}]}
    assert _long_waits(_rank(dsm={**dsm, "incarnation": 0}, apm={"rearms": 1}), now=100.0) == [
        "rank 2 has waited 10.0 s for barrier 4 (dsm)",
        "rank 2 has waited 2.5 s for room in the log rings (dsm)",
    ]
    assert _long_waits(_rank(incarnation=1, dsm={**dsm, "incarnation": 0}), now=100.0) == []  # a lost incarnation's
    assert _long_waits(_rank(state="failed", dsm={**dsm, "incarnation": 0}), now=100.0) == []
    assert _long_waits(_rank(dsm={"waits": [], "incarnation": 0}, other=[1, 2]), now=100.0) == []
    skewed = {"waits": [{"what": "lock 1", "since": 105.0}], "incarnation": 0}  # another host's clock runs ahead
    assert _long_waits(_rank(dsm=skewed), now=100.0) == ["rank 2 has waited 0.0 s for lock 1 (dsm)"]
    home = {"waits": [], "facts": [{"what": "lock 0 is held by rank 3, wanted by ranks 1, 2", "since": 95.0}]}
    assert _long_waits(_rank(dsm={**home, "incarnation": 0}), now=100.0) == [
        "at rank 2: lock 0 is held by rank 3, wanted by ranks 1, 2 (for 5.0 s, dsm)"
    ]
    for ended in ("finished", "killed", "failed"):  # a rank that ended may not have cleared its last report
        assert _long_waits(_rank(state=ended, dsm={**dsm, "incarnation": 0}), now=100.0) == []


@pytest.mark.parametrize(
    "value",
    [
        {"waits": 3},  # a plugin's counter that happens to be called "waits"
        {"waits": [{"what": "x", "since": "yesterday"}]},
        {"waits": [{"what": "x"}]},
        {"waits": [{"since": 1.0}]},
        {"waits": ["lock 1"]},
        {"waits": [{"what": "x", "since": True}]},
        {"facts": "lock 0"},
        {"facts": [{"what": "x", "since": None}]},
    ],
)
def test_status_skips_what_is_not_a_wait_rather_than_fail(value: dict[str, object]) -> None:
    from ckpt._cli_control import _long_waits

    assert _long_waits(_rank(other=value), now=100.0) == []
