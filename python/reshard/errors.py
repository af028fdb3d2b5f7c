"""The exceptions reshard raises. Pure Python (no torch, no extension), so that the
independent test reader and tools can raise the same classes.

Every error is a :class:`ReshardError` whose ``code`` is the C++ core's error code
(``reshard::ErrorCode``, include/reshard/base/error.h): the extension raises the subclass of
that code, and the Python package raises the subclass that fits. Match classes, not messages::

    try:
        reshard.load(model, out)
    except reshard.LayoutMismatchError as e:   # e.code == "mismatch"
        ...
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "ReshardError",
    "InvalidArgumentError",
    "NotFoundError",
    "CorruptFileError",
    "LayoutMismatchError",
    "UnsupportedError",
    "ReshardIOError",
    "BusyError",
    "error_class",
]


class ReshardError(RuntimeError):
    """Base class of every reshard error. ``code`` names the kind (see the subclasses)."""

    code = "error"

    def __init__(self, message: str = "", code: Optional[str] = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(ReshardError, ValueError):
    """The caller asked for something impossible (a bad option, a bad rank range)."""

    code = "invalid_argument"


class NotFoundError(ReshardError):
    """A file or directory is missing (no rank file for this job, no manifest, no layout)."""

    code = "not_found"


class CorruptFileError(ReshardError):
    """A file is corrupt, truncated or malformed (a checksum mismatch, a bad header)."""

    code = "data_loss"


class LayoutMismatchError(ReshardError):
    """Valid files or models that do not belong together: another source, another layout,
    a model whose parameters differ from the file's."""

    code = "mismatch"


class UnsupportedError(ReshardError):
    """Valid input this version does not handle (say which, and what would)."""

    code = "unsupported"


class ReshardIOError(ReshardError):
    """The operating system refused (permissions, disk full, ...)."""

    code = "io"


class BusyError(ReshardError):
    """Another process holds the output directory's lock."""

    code = "busy"


_BY_CODE: Dict[str, Type[ReshardError]] = {
    c.code: c for c in (InvalidArgumentError, NotFoundError, CorruptFileError, LayoutMismatchError,
                        UnsupportedError, ReshardIOError, BusyError)
}


def error_class(code: str) -> Type[ReshardError]:
    """The class of error code `code` (ReshardError for an unknown one)."""
    return _BY_CODE.get(code, ReshardError)
