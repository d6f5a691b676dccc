"""The library's exceptions.

Every failure raises a subclass of :class:`TensorCanonError`, and each class
also derives from the built-in that the same mistake raises elsewhere
(``ValueError``, ``TypeError``, ``FileNotFoundError``, ``OSError``...), so code
written for the built-ins keeps catching them.
"""

from __future__ import annotations

import errno as _errno
from typing import Any

from .redact import redact

__all__ = [
    "TensorCanonError",
    "FormatError",
    "LimitError",
    "IntegrityError",
    "UnsupportedTypeError",
    "DeviceUnavailableError",
    "UnsupportedAlgorithmError",
    "UsageError",
    "FileAccessError",
    "MissingFileError",
    "MissingDependencyError",
]


class TensorCanonError(Exception):
    """Base class of every error raised by tensorcanon.

    Every error pickles and unpickles intact (message and attributes), so it can
    cross process boundaries: torch.distributed.checkpoint sends a failing
    rank's exception to the other ranks that way.

    Its message holds no credential: every text argument passes through
    :func:`tensorcanon.format.redact.redact` when the error is made (and when it is
    unpickled), so a URL's password or a presigned URL's signature is shown as
    ``***`` whichever code built the message (docs/SECURITY.md, object storage).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # (kwargs: ImportError's name=, path=)
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args), **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduction calls cls(*args), which fails for the subclasses whose
        # __init__ takes keyword-only arguments (LimitError's limit=...).
        state = dict(self.__dict__)
        if isinstance(self, OSError):  # errno and filename are OSError slots, not in __dict__
            state["errno"], state["filename"] = self.errno, self.filename
        return (_rebuild, (type(self), self.args, state))


def _rebuild(cls: type[TensorCanonError], args: tuple[Any, ...], state: dict[str, Any]) -> TensorCanonError:
    error = cls.__new__(cls)
    error.args = tuple(redact(a) if isinstance(a, str) else a for a in args)
    for name, value in state.items():
        setattr(error, name, redact(value) if name == "filename" and isinstance(value, str) else value)
    return error


class FormatError(TensorCanonError, ValueError):
    """The bytes are not a well-formed tensorcanon (or safetensors) file.

    ``offset`` is the byte offset in the file where the problem was found,
    when one is known. ``damaged`` is True for a file that claims to be a tensorcanon
    file but whose header or manifest does not decode, or does not match the manifest its
    digest vouches for: bytes changed after it was written (``tensorcanon verify`` reports it
    ``CORRUPT``, as it does an :class:`IntegrityError`); False for a file written that way.
    """

    damaged = False

    def __init__(self, message: str, *, offset: int | None = None) -> None:
        self.offset = offset
        if offset is not None:
            message = f"{message} (at byte {offset})"
        super().__init__(message)


class LimitError(FormatError):
    """A file, or an object being saved, exceeds a safety limit (see :class:`tensorcanon.Limits`).

    ``limit`` names the :class:`~tensorcanon.Limits` field that was hit and
    ``path`` where in the object, when known. When reading, the message says
    how to raise the limit for a trusted file; when saving (``saving=True``), how
    to raise it for the save and every later load, since a file saved past a
    default limit needs the same raised limit to load. ``hint`` replaces both.
    """

    def __init__(self, message: str, *, limit: str, offset: int | None = None,
                 path: str | None = None, saving: bool = False, hint: str | None = None) -> None:
        self.limit = limit
        self.path = path
        if hint is None and saving:
            hint = (f"pass limits=tensorcanon.Limits({limit}=...) to save and to every load of the "
                    "file, or change the object")
        elif hint is None:
            hint = f"raise it with load(..., limits=tensorcanon.Limits({limit}=...)) if the file is trusted"
        super().__init__(f"{message}; {hint}", offset=offset)


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


class FileAccessError(TensorCanonError, OSError):
    """A path cannot be opened, read or written (permissions, a missing folder...).

    ``filename`` is the path as the caller gave it. The message says what was
    being done and how to fix it. Also an ``OSError``.
    """

    def __init__(self, message: str, *, filename: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.filename = redact(filename) if isinstance(filename, str) else filename
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MissingFileError(FileAccessError, FileNotFoundError):
    """A file (or the folder a file is saved into) does not exist. Also a ``FileNotFoundError``,
    whose ``errno`` is ``ENOENT``."""

    def __init__(self, message: str, *, filename: str | None = None, errno: int | None = _errno.ENOENT) -> None:
        super().__init__(message, filename=filename, errno=errno)


class MissingDependencyError(TensorCanonError, ImportError):
    """What was asked needs a package that is not installed: PyTorch (``torch``), which the light
    install (``pip install tensorcanon``: hash, verify, check, lock and inspect) does without.
    The message is one line saying what to install. Also an ``ImportError``."""
