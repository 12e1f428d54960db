"""What the `ckpt` commands share: the checkpoint directory's default, common options, serving."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

#: The checkpoint directory when neither --ckpt-dir nor $CKPT_DIR says: not ./ckpt, which would be
#: the package directory (and shadow the package) when ckpt runs from a source checkout.
DEFAULT_CKPT_DIR = "ckpt-images"


def default_ckpt_dir() -> str:
    return os.environ.get("CKPT_DIR") or DEFAULT_CKPT_DIR


def ckpt_dir_option(f: Any) -> Any:
    return click.option(
        "--ckpt-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=default_ckpt_dir,
        show_default=f"$CKPT_DIR or ./{DEFAULT_CKPT_DIR}",
        help="Directory of the job's images, manifests and coordinator.json.",
    )(f)


def coordinator_option(f: Any) -> Any:
    return click.option(
        "--coordinator",
        envvar="CKPT_COORDINATOR",
        metavar="HOST:PORT",
        help="An existing coordinator (token from $CKPT_TOKEN) [default: the job recorded in the ckpt dir].",
    )(f)


def plugin_options(f: Any) -> Any:
    f = click.option(
        "--with-plugin", "with_plugins", multiple=True, metavar="MODULE", help="Also load this plugin module."
    )(f)
    f = click.option(
        "--disable-plugin", "disabled", multiple=True, metavar="NAME", help="Do not load this installed plugin."
    )(f)
    return f


def serve_until_signal(wait: Callable[[], object], what: str) -> None:
    """Run `wait()` (a server's life) in the foreground until it returns, Ctrl-C or SIGTERM."""

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        wait()
    except KeyboardInterrupt:
        click.echo(f"{what}: stopping", err=True)
