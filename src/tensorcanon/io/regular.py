"""Opening a path for reading: only a regular file, never one that could block or never end.

:func:`open_fd` is the one guard every file the library opens by path for reading goes
through: plain paths (source.py), ``file://`` URLs, and ``local://`` URLs and chains over a
local filesystem read through fsspec (storage.py). A FIFO, a socket or a device is refused
with a :class:`~tensorcanon.FileAccessError` that says what it is; a folder is a
:class:`~tensorcanon.FormatError`.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from typing import BinaryIO

from ..format import sharding
from ..format.errors import FileAccessError, FormatError, MissingFileError, TensorCanonError

__all__ = ["open_fd", "open_path", "directory_error", "directory_reason", "same_file"]


def same_file(out: str, paths: list[str] | tuple[str, ...]) -> str | None:
    """The first of ``paths`` that is the file ``out`` (the same device and inode: by name, symlink or
    hard link), None when none is or ``out`` does not exist yet. For the commands that must not write
    their output over one of their inputs (consolidate, diverge --html): the one check they share."""
    try:
        st = os.stat(out)
    except OSError:
        return None  # nothing there yet (or unreachable: the write says why)
    for path in paths:
        try:
            other = os.stat(path)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return path
    return None


def _os_error(e: OSError, path: str, doing: str) -> FileAccessError:
    if isinstance(e, FileNotFoundError):
        return MissingFileError(f"cannot {doing} {path!r}: no such file", filename=path, errno=errno.ENOENT)
    if isinstance(e, PermissionError):
        return FileAccessError(f"cannot {doing} {path!r}: permission denied; check the file's permissions",
                               filename=path, errno=e.errno)
    return FileAccessError(f"cannot {doing} {path!r}: {e.strerror or e}", filename=path, errno=e.errno)


def directory_error(path: str, what: str) -> FormatError:
    """The error for a directory read as a file: :func:`directory_reason` says what it is."""
    return FormatError(f"{path!r} {directory_reason(path, what)}")


_SCAN = 10_000  # entries of a directory looked at for the files of an interrupted save


def directory_reason(path: str, what: str = "a file") -> str:
    """What a directory given where ``what`` is read is, after its quoted name: a sharded
    checkpoint (and how to read it), the rank files of one that has no index yet (an interrupted
    save: the index is written last), or a directory that is neither. The one wording for the API,
    the command line and ``tensorcanon.dcp``'s readers (sharded/layout.missing)."""
    if os.path.isfile(os.path.join(path, sharding.INDEX_NAME)):
        return (f"is a directory, not {what}; it is a sharded checkpoint (tensorcanon.dcp): load it whole with "
                "tensorcanon.dcp.load_unsharded(path), into a state dict with tensorcanon.dcp.load, or write it "
                "as one file with tensorcanon consolidate; tensorcanon.verify and the command line read it as it is")
    rank_files, dcp = False, False
    try:
        with os.scandir(path) as entries:
            for entry in itertools.islice(entries, _SCAN):
                name = entry.name
                rank_files = rank_files or bool(sharding.RANK_FILE_RE.match(name)) or name.startswith(_RANK_TEMP)
                dcp = dcp or name == ".metadata"
    except OSError:
        pass
    if dcp:
        return (f"holds no {sharding.INDEX_NAME}: it is not a tensorcanon checkpoint but holds a '.metadata' "
                "file, a checkpoint in DCP's default format, which tensorcanon does not read (its metadata is a "
                "pickle)")
    if rank_files:
        return (f"holds no {sharding.INDEX_NAME}, so it is not a complete tensorcanon checkpoint: the index is "
                "written last, after every rank file, so an interrupted save leaves none")
    return f"is a directory, not {what} or a sharded checkpoint (it holds no {sharding.INDEX_NAME})"


_RANK_TEMP = (".rank-", "..rank-")  # how the temporary files of a rank file being written begin


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _not_regular(path: str, mode: int, doing: str, what: str) -> TensorCanonError:
    """The error for a path that names no regular file (a directory keeps its own error)."""
    if stat.S_ISDIR(mode):
        return directory_error(path, what)
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return FileAccessError(
        f"cannot {doing} {path!r}: it is {kind}, not a regular file; tensorcanon opens only regular files "
        "by path, as reading anything else could wait forever. To read a stream deliberately, pass an open "
        "binary file object: tensorcanon.load(open(path, 'rb')) or tensorcanon.load(sys.stdin.buffer)",
        filename=path)


# Opening never waits (a FIFO with no writer would block open() itself), never makes a terminal the
# controlling one, and the descriptor does not leak into child processes.
_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def open_fd(path: str | os.PathLike, doing: str = "read", what: str = "a tensorcanon file") -> int:
    """A read-only descriptor of the *regular* file at ``path`` (a symlink to one is followed).

    Every file the library opens by path goes through here. It is opened without
    blocking and checked with ``fstat`` before anything is read: a FIFO, a socket
    or a device (``/dev/zero``, ``/dev/stdin`` when it is a pipe) is refused with a
    :class:`FileAccessError` that says what it is, as reading one could block
    forever or never end; a folder is a :class:`FormatError`. The descriptor reads
    normally (blocking) once returned; the caller closes it.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, _READ_FLAGS)
    except IsADirectoryError:
        raise directory_error(name, what) from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket cannot be opened at all: say what it is
            try:
                mode = os.stat(name).st_mode
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):
                raise _not_regular(name, mode, doing, what) from None
        raise _os_error(e, name, doing) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(name, mode, doing, what)
        if _READ_FLAGS & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_path(path: str | os.PathLike, doing: str = "read", what: str = "a tensorcanon file") -> BinaryIO:
    """The regular file at ``path``, as ``open(path, "rb", buffering=0)`` gives it, checked by :func:`open_fd`."""
    name = os.fspath(path)
    fd = open_fd(name, doing, what)
    return open(name, "rb", buffering=0, opener=lambda _name, _flags: fd)
