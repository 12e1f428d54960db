"""docs/plugins.md against the contract: the generated hook reference, the worked examples, every public name."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ckpt import plugin, testing
from harness import ROOT

GUIDE = ROOT / "docs" / "plugins.md"
#: The worked examples of §11, each shown verbatim.
EXAMPLES = [
    "examples/plugins/ckpt_stepclock.py",
    "examples/plugins/ckpt_opcount.py",
    "tests/programs/plugins/ckpt_counted.py",
    "examples/plugins/ckpt_dsmtrace.py",
]


def test_the_hook_reference_is_generated_from_the_hookspecs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plugin_docs.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_the_reference_has_every_hook_of_both_contract_modules() -> None:
    import dsm.hookspecs

    guide = GUIDE.read_text()
    for module in (plugin.hookspecs, dsm.hookspecs):
        for name, fn in vars(module).items():
            if callable(fn) and hasattr(fn, "ckpt_spec"):
                assert re.search(rf"^#### `{name}\(", guide, re.M), f"{name} is not in the hook reference"


@pytest.mark.parametrize("path", EXAMPLES)
def test_the_guide_shows_each_worked_example_as_it_is(path: str) -> None:
    source = (ROOT / path).read_text().rstrip("\n")
    assert source in GUIDE.read_text(), f"docs/plugins.md must show {path} verbatim"


@pytest.mark.parametrize("name", sorted(set(plugin.__all__) | {"ckpt.testing"}))
def test_the_guide_names_every_public_name_of_the_contract(name: str) -> None:
    assert f"`{name}`" in GUIDE.read_text() or f"`{name}(" in GUIDE.read_text(), name


def test_the_guide_names_the_test_doubles() -> None:
    guide = GUIDE.read_text()
    for name in ("FakeRuntime", "FakeKeyValue", "run_program", "run_threads", "Jobs", "uninterrupted", "start_job"):
        assert name in testing.__all__ or name == "start_job"
        assert f"`{name}" in guide, name
