"""The library's exceptions.

Every failure raises a subclass of :class:`TensorCanonError`. The classes that
describe a bad argument or a bad file also derive from the matching built-in
(``ValueError``, ``TypeError``), so callers may catch either.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TensorCanonError",
    "FormatError",
    "LimitError",
    "IntegrityError",
    "UnsupportedTypeError",
    "DeviceUnavailableError",
    "UnsupportedAlgorithmError",
    "UsageError",
]


class TensorCanonError(Exception):
    """Base class of every error raised by tensorcanon."""


class FormatError(TensorCanonError, ValueError):
    """The bytes are not a well-formed tensorcanon (or safetensors) file.

    ``offset`` is the byte offset in the file where the problem was found,
    when one is known.
    """

    def __init__(self, message: str, *, offset: int | None = None) -> None:
        self.offset = offset
        if offset is not None:
            message = f"{message} (at byte {offset})"
        super().__init__(message)


class LimitError(FormatError):
    """A file exceeds a configured safety limit (see :class:`tensorcanon.Limits`).

    ``limit`` names the :class:`~tensorcanon.Limits` field that was hit.
    """

    def __init__(self, message: str, *, limit: str, offset: int | None = None) -> None:
        self.limit = limit
        super().__init__(
            f"{message}; raise it with load(..., limits=tensorcanon.Limits({limit}=...)) "
            "if the file is trusted",
            offset=offset,
        )


class IntegrityError(TensorCanonError):
    """Bytes do not hash to the digest recorded for them.

    ``path`` is the location of the damaged value in the saved object
    (for example ``["model"]["fc.weight"]``), or ``None`` for the manifest.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        expected: str | None = None,
        actual: str | None = None,
    ) -> None:
        self.path = path
        self.expected = expected
        self.actual = actual
        super().__init__(message)


class UnsupportedTypeError(TensorCanonError, TypeError):
    """A value cannot be saved (or a registered type is unknown when loading).

    ``path`` is where the value sits in the object, e.g. ``["opt"]["state"][0]``.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class DeviceUnavailableError(TensorCanonError, RuntimeError):
    """A tensor was recorded on a device this machine does not have."""

    def __init__(self, message: str, *, path: str | None = None, device: str | None = None) -> None:
        self.path = path
        self.device = device
        super().__init__(message)


class UnsupportedAlgorithmError(TensorCanonError, ValueError):
    """A digest algorithm name that tensorcanon does not know.

    ``algorithm`` is the name that was given.
    """

    def __init__(self, message: str, *, algorithm: Any = None) -> None:
        self.algorithm = algorithm
        super().__init__(message)


class UsageError(TensorCanonError, ValueError, TypeError):
    """A function was called with an argument it cannot use (a bad ``map_location``,
    a negative tolerance, a seed out of range...). The message names the argument
    and what it accepts. Also a ``ValueError`` and a ``TypeError``, the built-ins
    such mistakes raise elsewhere, so existing ``except`` clauses keep working."""
