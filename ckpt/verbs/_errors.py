"""The exceptions of ckpt.verbs, named and shaped as pyverbs' (``pyverbs.pyverbs_error``)."""

from __future__ import annotations

import os

__all__ = ["PyverbsError", "PyverbsRDMAError", "PyverbsUserError"]


class PyverbsError(Exception):
    """Base of every error ckpt.verbs raises; ``error_code`` (an errno, or -1) is appended to the message."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        self._reduce_args: tuple[object, ...] = (msg, error_code)
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[type[PyverbsError], tuple[object, ...]]:
        # Rebuild from the constructor's arguments, not from the formatted message,
        # so that an error sent to another thread or process keeps its error_code.
        return type(self), self._reduce_args


class PyverbsRDMAError(PyverbsError):
    """A verb failed as libibverbs would fail it; ``error_code`` is the errno it would return."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(msg, error_code)
        self._error_code = error_code

    @property
    def error_code(self) -> int:
        return self._error_code


class PyverbsUserError(PyverbsError):
    """The caller passed something ckpt.verbs cannot use (a wrong type, a missing argument)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._reduce_args = (msg,)
