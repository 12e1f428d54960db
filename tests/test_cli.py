"""The click command tree: every option is documented, and usage errors are one line."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest

from ckpt.cli import cli, main


def _commands(group: click.Group, prefix: str = "ckpt") -> Iterator[tuple[str, click.Command]]:
    for name, command in sorted(group.commands.items()):
        path = f"{prefix} {name}"
        yield path, command
        if isinstance(command, click.Group):
            yield from _commands(command, path)


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
