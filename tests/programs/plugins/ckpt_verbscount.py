"""A test plugin: counts every post_send through ckpt_wrap_verbs and contributes a provider that delegates to simib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ckpt
from ckpt import verbs

CKPT_PLUGIN_API = 2
posts = 0


def _countib() -> verbs.VerbsOps:
    """A provider of its own: simib's table under another name (what ib2tcp's `tcp` provider plugs in as)."""
    from ckpt.verbs import _simib

    table = _simib.make_ops()
    return verbs.VerbsOps("countib", **{name: getattr(table, name) for name in verbs.OPERATIONS})


@ckpt.hookimpl
def ckpt_verbs_providers() -> dict[str, Any]:
    return {"countib": _countib}


@ckpt.hookimpl
def ckpt_wrap_verbs(rt: ckpt.Runtime, ops: verbs.VerbsOps) -> None:
    inner = ops.post_send

    def post_send(qp: Any, wr: Any) -> None:
        global posts
        posts += 1
        inner(qp, wr)

    ops.post_send = post_send


@ckpt.hookimpl
def ckpt_exit(rt: ckpt.Runtime) -> None:
    Path(rt.ckpt_dir, f"verbscount.{rt.rank}").write_text(f"{posts} {','.join(verbs.providers())}\n")
