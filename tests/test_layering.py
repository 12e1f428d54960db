"""The layering contracts in pyproject.toml: complete (every plugin, every internal module named) and kept."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: What a plugin (and the DSM) may import of ckpt: the public API, nothing else.
PUBLIC = {"plugin", "verbs", "testing", "__init__"}


def _config() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]  # type: ignore[no-any-return]


def _contract(name_start: str) -> dict[str, Any]:
    (contract,) = [c for c in _config()["contracts"] if c["name"].startswith(name_start)]
    return contract


def test_every_plugin_package_and_the_dsm_are_bound_by_the_public_api_contract() -> None:
    packages = {p.name for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").is_file()} | {"dsm"}
    contract = _contract("plugins and the DSM")
    assert set(contract["source_modules"]) == packages
    assert packages <= set(_config()["root_packages"])


def test_every_internal_part_of_ckpt_is_forbidden_to_plugins() -> None:
    internal = {
        f"ckpt.{p.stem}"
        for p in (ROOT / "ckpt").iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.stem not in PUBLIC
    }
    assert internal, "the walk found nothing: wrong root?"
    assert set(_contract("plugins and the DSM")["forbidden_modules"]) == internal


def test_the_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
