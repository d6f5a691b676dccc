"""Reserving a file's blocks before a large save writes them.

On Linux, :func:`reserve` asks the file system for the blocks the save is about to
fill, with ``fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length)``: the file's size and
contents do not change, so a save that fails part way leaves the same bytes as
without it. What it saves is the file system's work per page while the bytes are
written. On ext4 (measured in benchmarks/RESULTS.md) it is large: without it every
page written is allocated later, and closing a file that was truncated and
rewritten (``open(path, "wb")`` over an existing file) starts writing all of it to
disk before ``close`` returns (ext4's ``auto_da_alloc``).

Memory-backed file systems (tmpfs, ramfs) are not asked: there the reservation
allocates the pages that the writes would have allocated anyway, but up front,
before the hashing thread can overlap with any of it, and a large save measured a
few percent slower with it than without.

One side effect to know: btrfs writes data into reserved blocks without
compressing it, so on a btrfs volume mounted with compression a saved file
takes its full size on disk (tensor data rarely compresses much anyway).

Best effort, never an error: a file system without ``fallocate`` (or a pipe, a
socket, another platform) is written exactly as before, and a disk too full for
the reservation is left for the writes themselves to report. ``posix_fallocate``
is not used: where the file system lacks ``fallocate`` it falls back to writing
zeros, which would double the I/O.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

_KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE, linux/falloc.h
_MEMORY_BACKED = {0x01021994, 0x858458F6}  # TMPFS_MAGIC, RAMFS_MAGIC, linux/magic.h
MIN_BYTES = 1 << 20  # below this a save is too small for the call to pay


@functools.cache
def _calls() -> tuple[Callable[[int, int, int, int], int], Callable[[int, Any], int]] | None:
    """libc's ``fallocate`` and ``fstatfs``, or None off Linux or where libc lacks them."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = getattr(libc, "fallocate64", None) or libc.fallocate
        fstatfs = libc.fstatfs
    except (OSError, AttributeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fstatfs.restype = ctypes.c_int
    return fallocate, fstatfs


def memory_backed(fd: int) -> bool:
    """True when the file open as ``fd`` lives on tmpfs or ramfs (False when unknown)."""
    calls = _calls()
    if calls is None:
        return False
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    if calls[1](fd, buf) != 0:
        return False
    f_type = ctypes.c_long.from_buffer(buf).value  # its first field, a long on every glibc target
    return f_type & 0xFFFFFFFF in _MEMORY_BACKED


def reserve(f: BinaryIO, offset: int, nbytes: int) -> bool:
    """Reserve the blocks of bytes ``[offset, offset + nbytes)`` of ``f``, keeping its size.

    True when the file system reserved them; False when it could not or was not asked
    (``f`` has no file descriptor or is memory-backed, ``nbytes`` is under
    :data:`MIN_BYTES`, not Linux).
    """
    calls = _calls()
    if calls is None or nbytes < MIN_BYTES or offset < 0:
        return False
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    return not memory_backed(fd) and calls[0](fd, _KEEP_SIZE, offset, nbytes) == 0
