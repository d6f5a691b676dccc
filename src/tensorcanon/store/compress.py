"""Lossless codecs for a tensor's bytes, chosen per tensor by what its bytes are (docs/STORE.md).

``raw`` (the bytes as they are), ``zstd`` (one zstd frame), ``grouped`` (the bytes split into
one plane per byte of an element, each plane a zstd frame or stored: ZipNN's idea, since the
exponent bytes of floats compress and the low mantissa bytes do not) and ``delta`` (the bytes
XORed with those of a base tensor of the same dtype and shape the store holds, then grouped:
consecutive checkpoints share most high-order bits). :func:`encode` tries the candidates on a
sample of the tensor and encodes it whole with the best, falling back to raw where nothing
pays; :func:`decode_into` reverses any of them into a caller's buffer.

zstd comes from the ``zstandard`` package (the ``store`` extra); without it every blob is
written raw and a compressed blob is refused with an error naming the extra.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.errors import FormatError, MissingDependencyError
from . import layout

#: zstd level: level 1 compresses the exponent planes of floats as well as level 3 (often better)
#: at twice the speed, and every other plane is incompressible whatever the level.
LEVEL = 1
#: Tensors smaller than this are stored raw: a blob header and a frame header cost more than they save.
MIN_COMPRESS = 512
#: The sample the choice is made on: up to three windows of this many bytes (start, middle, end).
WINDOW = 16 << 10
#: A codec is chosen only if its sample is smaller than this fraction of the raw bytes.
PAYS = 0.97
#: The planes of one tensor are compressed on this many threads (zstandard releases the GIL).
THREADS = 2


def zstd() -> Any:
    """The ``zstandard`` module, or None where it is not installed."""
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def _need_zstd(where: str) -> Any:
    z = zstd()
    if z is None:
        raise MissingDependencyError(
            f"{where} is zstd-compressed, and the zstandard package is not installed; "
            "pip install zstandard (or the [store] extra of tensorcanon)")
    return z


_POOL: list[ThreadPoolExecutor] = []
_LOCAL = threading.local()  # one zstd compressor and decompressor per thread: making one costs more
                            # than compressing a small tensor


def _forget() -> None:  # a forked child has none of its parent's threads: it makes its own pool
    _POOL.clear()
    global _LOCAL
    _LOCAL = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _cctx(z: Any) -> Any:
    c = getattr(_LOCAL, "c", None)
    if c is None or getattr(_LOCAL, "z", None) is not z:
        _LOCAL.c, _LOCAL.d, _LOCAL.z = z.ZstdCompressor(level=LEVEL), z.ZstdDecompressor(), z
        c = _LOCAL.c
    return c


def _dctx(z: Any) -> Any:
    _cctx(z)
    return _LOCAL.d


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(THREADS, thread_name_prefix="tensorcanon-store"))
    return _POOL[0]


@dataclass
class Encoded:
    """A tensor's bytes, encoded: the codec, and the payload's pieces in order."""

    codec: int
    planes: list[tuple[int, int]] | None   # grouped, delta: (plane codec, length) per plane
    pieces: list[Any]                      # buffers, written one after another after the header

    @property
    def payload_size(self) -> int:
        return sum(len(memoryview(p).cast("B")) for p in self.pieces)


def as_u8(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


_BLOCK = 1 << 16  # elements transposed at a time: both sides stay in the cache


def split(a: np.ndarray, k: int) -> list[np.ndarray]:
    """The ``k`` byte planes of flat uint8 array ``a`` (element size ``k``), each contiguous."""
    if k == 1:
        return [a]
    grid = a.reshape(-1, k)
    n = len(grid)
    out = np.empty((k, n), dtype=np.uint8)
    for s in range(0, n, _BLOCK):
        out[:, s : s + _BLOCK] = grid[s : s + _BLOCK].T
    return list(out)


def xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a ^ b`` of two flat uint8 arrays of one length (8 bytes at a time where they allow)."""
    if len(a) % 8 == 0:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(a, b)


def _compress_plane(z: Any, plane: np.ndarray) -> tuple[int, Any]:
    frame = _cctx(z).compress(plane)
    if len(frame) >= len(plane):
        return layout.STORED, plane
    return layout.PLANE_ZSTD, frame


def _grouped(z: Any, a: np.ndarray, k: int, pool: bool) -> tuple[list[tuple[int, int]], list[Any]]:
    planes = split(a, k)
    if pool and len(a) >= 4 * WINDOW:
        done = list(_pool().map(lambda p: _compress_plane(z, p), planes))
    else:
        done = [_compress_plane(z, p) for p in planes]
    return [(c, len(p)) for c, p in done], [p for _, p in done]


def _sample(a: np.ndarray, k: int) -> list[slice]:
    """Where the sample lies: the whole of a small tensor, else three element-aligned windows."""
    n = len(a)
    if n <= 3 * WINDOW:
        return [slice(0, n)]
    mid = (n // 2) // k * k
    end = (n - WINDOW) // k * k
    return [slice(0, WINDOW), slice(mid, mid + WINDOW), slice(end, end + WINDOW)]


def _take(a: np.ndarray, where: list[slice]) -> np.ndarray:
    return a[where[0]] if len(where) == 1 else np.concatenate([a[w] for w in where])


def _candidates(a: np.ndarray, k: int, base: np.ndarray | None, z: Any) -> dict[int, Encoded]:
    """Every candidate codec's encoding of flat uint8 ``a`` (``base``: a delta's base bytes)."""
    out = {layout.ZSTD: Encoded(layout.ZSTD, None, [_cctx(z).compress(a)])}
    if k > 1:
        planes, pieces = _grouped(z, a, k, False)
        out[layout.GROUPED] = Encoded(layout.GROUPED, planes, pieces)
    if base is not None:
        planes, pieces = _grouped(z, xor(a, base), k, False)
        out[layout.DELTA] = Encoded(layout.DELTA, planes, pieces)
    return out


def _size(e: Encoded) -> int:
    return sum(n for _, n in e.planes) if e.planes is not None else e.payload_size


def _best(a: np.ndarray, k: int, base: np.ndarray | None, z: Any) -> tuple[int, Encoded | None]:
    """The codec whose output is smallest on a sample of ``a``, or RAW; with its encoding of the
    whole of ``a`` where the sample was the whole (a small tensor is compressed once, not twice)."""
    where = _sample(a, k)
    whole = len(where) == 1
    s = _take(a, where)
    found = _candidates(s, k, _take(base, where) if base is not None else None, z)
    best = min(found, key=lambda c: (_size(found[c]), c))
    if _size(found[best]) >= PAYS * len(s):
        return layout.RAW, None
    return best, found[best] if whole else None


def choose(a: np.ndarray, k: int, base: np.ndarray | None) -> int:
    """The codec whose output is smallest on a sample of ``a`` (``base``: a delta's base bytes), or RAW."""
    z = zstd()
    if z is None or len(a) < MIN_COMPRESS:
        return layout.RAW
    return _best(a, k, base, z)[0]


def encode(data: Any, k: int, base: Any = None, *, pool: bool = True) -> Encoded:
    """``data`` (a tensor's flat bytes, element size ``k``) encoded with the codec :func:`choose`
    picks; ``base``: the bytes of the tensor a delta would be taken against (same length), if any.
    ``pool``: a large tensor's planes are compressed on the module's threads."""
    a = as_u8(data)
    b = as_u8(base) if base is not None else None
    z = zstd()
    if z is None or len(a) < MIN_COMPRESS:
        return Encoded(layout.RAW, None, [data])
    codec, out = _best(a, k, b, z)
    if codec == layout.RAW:
        return Encoded(layout.RAW, None, [data])
    if out is None:
        if codec == layout.ZSTD:
            out = Encoded(layout.ZSTD, None, [_cctx(z).compress(a)])
        else:
            src = a if codec == layout.GROUPED else xor(a, b)  # type: ignore[arg-type]
            planes, pieces = _grouped(z, src, k, pool)
            out = Encoded(codec, planes, pieces)
    if out.payload_size + (16 * k if out.planes else 0) >= len(a):
        return Encoded(layout.RAW, None, [data])
    return out


# --------------------------------------------------------------------------- decoding


def _frame(z: Any, frame: Any, size: int, where: str) -> bytes:
    """One zstd frame decoded, after checking it says it holds exactly ``size`` bytes."""
    try:
        claimed = z.frame_content_size(frame)
    except z.ZstdError as e:
        raise FormatError(f"{where}: not a zstd frame ({e})") from None
    if claimed != size:
        raise FormatError(f"{where}: a zstd frame of {claimed} bytes where {size} are expected")
    try:
        out = _dctx(z).decompress(frame, max_output_size=size)
    except z.ZstdError as e:
        raise FormatError(f"{where}: its zstd frame is damaged ({e})") from None
    if len(out) != size:
        raise FormatError(f"{where}: its zstd frame decodes to {len(out)} bytes, not {size}")
    return out


def decode_into(h: layout.BlobHeader, blob: Any, out: memoryview, base: Callable[[], Any] | None,
                where: str, *, pool: bool = True) -> None:
    """Decode the blob whose bytes are ``blob`` (its header ``h``, checked) into ``out`` (``h.size``
    bytes); ``base()`` gives a delta's base bytes, decoded and checked against its digest.
    ``pool``: a large blob's planes are decoded on the module's threads."""
    data = memoryview(blob).cast("B")
    o = as_u8(out)
    if h.codec == layout.RAW:
        out[:] = data[h.payload : h.payload + h.size]
        return
    z = _need_zstd(where)
    if h.codec == layout.ZSTD:
        out[:] = _frame(z, data[h.payload :], h.size, where)
        return
    k = h.dtype.itemsize
    n = h.size // k
    grid = o.reshape(-1, k) if k > 1 else o.reshape(-1, 1)

    def plane(i: int) -> None:
        codec, start, length = h.planes[i]
        piece = data[start : start + length]
        src = piece if codec == layout.STORED else _frame(z, piece, n, f"{where} (plane {i})")
        grid[:, i] = np.frombuffer(src, dtype=np.uint8)

    if pool and h.size >= 4 * WINDOW and k > 1:
        list(_pool().map(plane, range(k)))
    else:
        for i in range(k):
            plane(i)
    if h.codec == layout.DELTA:
        assert base is not None
        b = as_u8(base())
        if len(o) % 8 == 0:
            np.bitwise_xor(o.view(np.uint64), b.view(np.uint64), out=o.view(np.uint64))
        else:
            np.bitwise_xor(o, b, out=o)


def plane_summary(planes: Sequence[tuple[int, int, int]]) -> str:
    return ",".join("z" if c == layout.PLANE_ZSTD else "s" for c, _, _ in planes)
