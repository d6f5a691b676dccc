"""Reading ``.npy`` and ``.npz`` files as hostile input: every size claimed is bounded by bytes
that really arrive, object arrays are refused before anything is unpickled, and every failure is
a :class:`~tensorcanon.FormatError` naming the file (and the member of an ``.npz``).

``numpy.load`` trusts the header: an ``.npy`` header claiming an 8 TiB array makes it allocate
8 TiB before reading a byte, a damaged ``.npz`` member raises ``zlib.error``. Here the header is
parsed with numpy's own parser (:mod:`numpy.lib.format`), the array's bytes are read in pieces as
they come (a claim larger than what the file holds fails when the data ends, having held only
the bytes that were there) and only then viewed as an array.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from typing import IO, TYPE_CHECKING, Any

from ..format import optional
from ..format.errors import FormatError

if TYPE_CHECKING:
    import numpy as np
else:
    np = optional.numpy_module(globals())

__all__ = ["read_npy", "read_npz"]

_PIECE = 1 << 24  # bytes read at a time: memory grows with the bytes that arrive, never with a claim
_MAX_HEADER = 10_000  # numpy.load's own default bound on the header's length


def _read_exactly(f: IO[bytes], n: int, where: str, limit: int | None) -> bytearray:
    """``n`` bytes of ``f``, read in pieces; FormatError when the file ends first or ``n`` exceeds
    ``limit`` (the bytes known to remain, when known)."""
    if limit is not None and n > limit:
        raise FormatError(f"{where}: its header claims {n} bytes of array data, but only {limit} bytes follow "
                          "(a damaged or hostile file)")
    buf = bytearray()
    while len(buf) < n:
        piece = f.read(min(_PIECE, n - len(buf)))
        if not piece:
            raise FormatError(f"{where}: its header claims {n} bytes of array data, but the data ends after "
                              f"{len(buf)} bytes (truncated or damaged)")
        buf += piece
    return buf


def _header(f: IO[bytes], where: str) -> tuple[Any, tuple[int, ...], bool]:
    try:
        dtype, shape, fortran = _parsed_header(f)
    except (FormatError, OSError, EOFError, zlib.error, zipfile.BadZipFile):
        raise  # (reading failed: said by the caller, as for the data)
    except Exception as e:  # noqa: BLE001 - numpy's parser (tokenize, ast) raises undocumented types
        raise FormatError(f"{where}: not a valid .npy header: {type(e).__name__}: {e}") from None
    if dtype.hasobject:
        raise FormatError(f"{where}: holds an object array (dtype {dtype}), which only unpickling could "
                          "read; tensorcanon never unpickles: save it as numeric arrays")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FormatError(f"{where}: bad shape {shape!r} in its header")
    return dtype, tuple(shape), bool(fortran)


def _parsed_header(f: IO[bytes]) -> tuple[Any, Any, Any]:
    """``(dtype, shape, fortran_order)`` as numpy's own parser reads them (no object is built
    from the header but by ``ast.literal_eval``)."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(f, max_header_size=_MAX_HEADER)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(f, max_header_size=_MAX_HEADER)
    else:  # (3, 0): UTF-8 field names; numpy parses it with a private function only
        reader = getattr(fmt, "_read_array_header", None)
        if reader is None:
            raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported by this numpy")
        shape, fortran, dtype = reader(f, version, max_header_size=_MAX_HEADER)
    return dtype, shape, fortran


def _array(f: IO[bytes], where: str, remaining: int | None) -> Any:
    """One array from ``f``, positioned at an ``.npy`` header; ``remaining``: bytes left in ``f``
    from there, when known (a bound checked before reading)."""
    try:
        start = f.tell() if remaining is not None else 0
        dtype, shape, fortran = _header(f, where)
        if remaining is not None:
            remaining -= f.tell() - start
        nbytes = math.prod(shape) * dtype.itemsize
        data = _read_exactly(f, nbytes, where, remaining)
        flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape)) if nbytes else np.zeros(0, dtype)
        if fortran:
            return flat.reshape(shape[::-1]).transpose()
        return flat.reshape(shape)
    except FormatError:
        raise
    except (ValueError, TypeError, OSError, EOFError, zlib.error, zipfile.BadZipFile, SyntaxError) as e:
        raise FormatError(f"{where}: not a valid .npy array: {e}") from None


def read_npy(f: IO[bytes], name: str, size: int | None) -> Any:
    """The array of an ``.npy`` file ``f`` (``size``: its length in bytes, when known)."""
    return _array(f, name, size)


def read_npz(f: IO[bytes], name: str) -> dict[str, Any]:
    """The arrays of an ``.npz`` file ``f``, by name (as ``numpy.load`` names them: a member's name
    without ``.npy``; a member that is not an ``.npy`` file comes as its bytes)."""
    try:
        with zipfile.ZipFile(f) as z:
            members = z.infolist()
            out: dict[str, Any] = {}
            for info in sorted(members, key=lambda i: i.filename):
                key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                where = f"{name}, member {info.filename!r}"
                if key in out:
                    raise FormatError(f"{where}: the name {key!r} appears twice in the archive")
                with z.open(info) as m:
                    if info.filename.endswith(".npy"):
                        out[key] = _array(m, where, info.file_size)
                    else:
                        out[key] = bytes(_read_exactly(m, info.file_size, where, None))
            return out
    except FormatError:
        raise
    except (ValueError, OSError, EOFError, zlib.error, zipfile.BadZipFile, NotImplementedError,
            RuntimeError) as e:
        raise FormatError(f"{name}: not a valid .npz archive: {e}") from None
