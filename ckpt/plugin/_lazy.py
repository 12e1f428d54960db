"""`lazy_exports`: a package's names imported when first used, so that loading a plugin stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for `package`: each of `names` (name -> the module that defines it,
    relative to `package`) is imported when it is first used, then kept as a plain attribute.  The
    package's ``dir()`` lists them from the start.

        if not TYPE_CHECKING:  # type checkers see `from ._remote import RemoteLog` under TYPE_CHECKING
            __getattr__ = lazy_exports(__name__, {"RemoteLog": "._remote"})

    Every rank and every ``ckpt launch`` import every installed plugin; a plugin whose heavy parts serve
    only some jobs (an option that is off by default) keeps them out of the others' start-up this way.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    module = sys.modules[package]  # (being initialised: it calls this)

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names))

    module.__dir__ = __dir__  # type: ignore[method-assign]
    return __getattr__
