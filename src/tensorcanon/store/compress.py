"""Lossless codecs for a tensor's bytes, chosen per tensor by what its bytes are (docs/STORE.md).

``raw`` (the bytes as they are), ``zstd`` (one zstd frame), ``grouped`` (the bytes split into
one plane per byte of an element, each plane a zstd frame or stored: ZipNN's idea, since the
exponent bytes of floats compress and the low mantissa bytes do not), ``delta`` (the bytes
XORed with those of a base tensor of the same dtype and shape the store holds, then grouped)
``delta-sub`` (each element, read as an unsigned integer, minus the base's element, the
difference zigzag-mapped so that small changes of either sign have small codes, then grouped:
consecutive checkpoints differ by a few units in the last place, and a float's integer view
moves smoothly across a power of two where its XOR flips the exponent and every mantissa bit)
and ``delta-twos`` (the same difference as it is, in two's complement: smaller where most
elements move the same way, as a decaying second moment does).
:func:`encode` tries the candidates on a sample of the tensor and encodes it whole with the best,
falling back to raw where nothing pays; :func:`decode_into` reverses any of them into a
caller's buffer. ``delta`` is written only for 16-byte elements, which the integer deltas do
not take, and is read as before.

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

#: zstd level, of every frame. On the planes that pay in the AdamW checkpoints of
#: benchmarks/store_codecs.py, levels 2 to 12 store 0.2-0.7% more than level 1 (level 3: 0.7%),
#: and only 15 and up store less (0.3-0.5% less, at 7 MB/s and below).
LEVEL = 1
#: Tensors smaller than this are stored raw: a blob header and a frame header cost more than they save.
MIN_COMPRESS = 512
#: Tensors of at most this many bytes try two candidates, not four: ``grouped`` (``zstd`` for
#: 1-byte elements, and as well where grouped shrinks them 4x: see REPETITIVE) and, where there
#: is a base, the delta that usually wins (``delta-sub``; ``delta`` for 16-byte elements). On
#: the frozen-base workloads of benchmarks/store_bench.py (LoRA adapters and their AdamW state,
#: 8-40 KiB each) the four candidates stored 0.792 and 0.751 of the raw bytes, delta-sub alone
#: 0.797 and 0.750; grouped stays a candidate for a tensor unrelated to its base (re-initialized),
#: which a delta would store worse and tie to that base (gc could not free it).
SMALL = 64 << 10
#: A small tensor saved again tries the codec its previous blob won with alone, unless that stores
#: more than this fraction of its bytes more than it did then (see :func:`encode`'s ``hint``).
HINT_SLACK = 0.02
#: A small tensor whose grouped planes shrink below 1/REPETITIVE of its bytes (zeros, masks, small
#: ints) also tries ``zstd``, which stores such bytes in fewer bytes than a frame per plane.
REPETITIVE = 4
#: The sample the choice is made on: up to three windows of this many bytes (start, middle, end).
#: 8 KiB windows chose as 16 KiB ones did on the AdamW checkpoints of benchmarks/store_codecs.py
#: (the same bytes stored, fp32 and bf16), at half the cost of the trials.
WINDOW = 8 << 10
#: A codec is chosen only if its sample is smaller than this fraction of the raw bytes.
PAYS = 0.97
#: A plane is compressed only if its sample's frame is smaller than this fraction of it.
PLANE_PAYS = 0.98
#: The planes of one tensor are compressed on this many threads (zstandard releases the GIL).
THREADS = 2
#: Element sizes a ``delta-sub`` blob may have: its elements are little-endian unsigned integers.
WORDS: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_SIGNED: dict[int, np.dtype[Any]] = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


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
_LOCAL = threading.local()  # zstd compressors and a decompressor per thread: making one costs more
                            # than compressing a small tensor


def _forget() -> None:  # a forked child has none of its parent's threads: it makes its own pool
    _POOL.clear()
    global _LOCAL
    _LOCAL = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _contexts(z: Any) -> dict[Any, Any]:
    found = getattr(_LOCAL, "ctx", None)
    if found is None or getattr(_LOCAL, "z", None) is not z:
        found = _LOCAL.ctx = {}
        _LOCAL.z = z
    return found


def _cctx(z: Any) -> Any:
    found = _contexts(z)
    c = found.get("c")
    if c is None:
        c = found["c"] = z.ZstdCompressor(level=LEVEL)
    return c


def _dctx(z: Any) -> Any:
    found = _contexts(z)
    d = found.get("d")
    if d is None:
        d = found["d"] = z.ZstdDecompressor()
    return d


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


def _planes_into(out: np.ndarray, s: int, chunk: np.ndarray, k: int, tmp: np.ndarray | None) -> None:
    """Write the byte planes of ``chunk`` (whole elements of size ``k``) into ``out[:, s:]``. For
    2- and 4-byte elements the planes are cut from little-endian words (a shift and a truncating
    copy each: 4-byte planes about 1.8x, 2-byte about 3.8x, as fast as a transposed byte copy);
    ``tmp``: a word buffer at least as long as the chunk's elements (None for other sizes)."""
    n = len(chunk) // k
    if tmp is None or k not in (2, 4):
        out[:, s : s + n] = chunk.reshape(-1, k).T
        return
    words, t = chunk.view(WORDS[k]), tmp[:n]
    np.copyto(out[0, s : s + n], words, casting="unsafe")  # (the low byte: the cast truncates)
    for i in range(1, k):
        np.right_shift(words, 8 * i, out=t)
        np.copyto(out[i, s : s + n], t, casting="unsafe")


def _interleave(chunk: np.ndarray, planes: Sequence[np.ndarray], s: int, k: int, tmp: np.ndarray | None) -> None:
    """The inverse of :func:`_planes_into`: elements ``s`` onward of ``planes`` interleaved into
    ``chunk`` (whole elements of size ``k``). 2-byte elements are built as little-endian words
    (widened, shifted and or-ed in: twice as fast as two strided byte copies) where ``tmp`` is a
    buffer of ``WORDS[k]`` at least as long as the chunk's elements; None: strided byte copies. The
    reader passes one for 2-byte elements only: 4-byte words built so ran 1.3x faster on one thread
    and slower on two (ten numpy calls a chunk instead of four, each taking the GIL back)."""
    n = len(chunk) // k
    if k == 1:
        chunk[:] = planes[0][s : s + n]
    elif tmp is None:
        grid = chunk.reshape(-1, k)
        for i in range(k):
            grid[:, i] = planes[i][s : s + n]
    else:
        words, t = chunk.view(WORDS[k]), tmp[:n]
        np.copyto(words, planes[0][s : s + n])
        for i in range(1, k):
            np.copyto(t, planes[i][s : s + n])
            np.left_shift(t, 8 * i, out=t)
            np.bitwise_or(words, t, out=words)


def _words(k: int, n: int) -> np.ndarray | None:
    """A scratch buffer of ``n`` words for :func:`_planes_into` and :func:`_interleave`."""
    return np.empty(n, dtype=WORDS[k]) if k in (2, 4) else None


def split(a: np.ndarray, k: int) -> list[np.ndarray]:
    """The ``k`` byte planes of flat uint8 array ``a`` (element size ``k``), each contiguous."""
    if k == 1:
        return [a]
    n = len(a) // k
    out = np.empty((k, n), dtype=np.uint8)
    tmp = _words(k, min(n, _BLOCK))
    for s in range(0, n, _BLOCK):
        _planes_into(out, s, a[s * k : (s + _BLOCK) * k], k, tmp)
    return list(out)


def xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a ^ b`` of two flat uint8 arrays of one length (8 bytes at a time where they allow)."""
    if len(a) % 8 == 0:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(a, b)


def sub(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """The ``delta-sub`` transform of flat uint8 ``a`` against ``b`` (element size ``k``, a key of
    :data:`WORDS`): each element ``zigzag((a - b) mod 2^(8k))`` (docs/STORE.md, "Blobs")."""
    w = WORDS[k]
    d = np.subtract(a.view(w), b.view(w))        # (unsigned: wraps modulo 2^(8k))
    sign = np.right_shift(d.view(_SIGNED[k]), 8 * k - 1)  # (arithmetic: 0, or every bit set)
    np.left_shift(d, 1, out=d)
    np.bitwise_xor(d, sign.view(w), out=d)
    return d.view(np.uint8)


def _unsub(g: np.ndarray, b: np.ndarray, k: int, tmp: np.ndarray) -> None:
    """Reverse :func:`sub` in place: ``g`` (zigzag codes) becomes ``b + unzigzag(g)``; ``tmp`` is
    scratch of ``g``'s length."""
    w = WORDS[k]
    gw, tw = g.view(w), tmp[: len(g)].view(w)
    np.bitwise_and(gw, 1, out=tw)
    np.negative(tw.view(_SIGNED[k]), out=tw.view(_SIGNED[k]))  # 0, or every bit set
    np.right_shift(gw, 1, out=gw)
    np.bitwise_xor(gw, tw, out=gw)
    np.add(gw, b.view(w), out=gw)


def twos(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """The ``delta-twos`` transform: each element ``(a - b) mod 2^(8k)``, as it is."""
    w = WORDS[k]
    return np.subtract(a.view(w), b.view(w)).view(np.uint8)


def _delta_codecs(k: int) -> tuple[int, ...]:
    """The delta codecs the writer tries for element size ``k``."""
    return (layout.DELTA_SUB, layout.DELTA_TWOS) if k in WORDS else (layout.DELTA,)


def _transform(codec: int, a: np.ndarray, b: np.ndarray | None, k: int) -> np.ndarray:
    if codec == layout.GROUPED:
        return a
    assert b is not None
    if codec == layout.DELTA_SUB:
        return sub(a, b, k)
    return twos(a, b, k) if codec == layout.DELTA_TWOS else xor(a, b)


def _compress_plane(z: Any, plane: np.ndarray) -> tuple[int, Any]:
    frame = _cctx(z).compress(plane)
    if len(frame) >= len(plane):
        return layout.STORED, plane
    return layout.PLANE_ZSTD, frame


def _split_transformed(codec: int, a: np.ndarray, b: np.ndarray | None, k: int) -> list[np.ndarray]:
    """The planes of ``_transform(codec, a, b, k)``, transformed and split a block at a time (the
    block stays in the cache between the two, and no transformed copy of the whole is made)."""
    if codec == layout.GROUPED or k == 1:
        return split(_transform(codec, a, b, k), k)
    assert b is not None
    n = len(a) // k
    out = np.empty((k, n), dtype=np.uint8)
    tmp = _words(k, min(n, _BLOCK))
    for s in range(0, n, _BLOCK):
        e = min(n, s + _BLOCK)
        _planes_into(out, s, _transform(codec, a[s * k : e * k], b[s * k : e * k], k), k, tmp)
    return list(out)


def _grouped(z: Any, a: np.ndarray | None, k: int, pool: bool, which: Sequence[bool] | None = None,
             planes: list[np.ndarray] | None = None) -> tuple[list[tuple[int, int]], list[Any]]:
    """The planes of ``a`` (or ``planes``, already split), each a zstd frame or stored;
    ``which``: the planes worth trying (the others are stored untried), all where None."""
    if planes is None:
        assert a is not None
        planes = split(a, k)

    def one(i: int) -> tuple[int, Any]:
        if which is not None and not which[i]:
            return layout.STORED, planes[i]
        return _compress_plane(z, planes[i])

    if pool and k * len(planes[0]) >= 4 * WINDOW:
        done = list(_pool().map(one, range(k)))
    else:
        done = [one(i) for i in range(k)]
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


def _candidates(a: np.ndarray, k: int, base: np.ndarray | None, z: Any, small: bool = False) -> dict[int, Encoded]:
    """Every candidate codec's encoding of flat uint8 ``a`` (``base``: a delta's base bytes), at the
    trial level; ``small``: of a tensor of at most SMALL bytes, two candidates (three where zstd
    is worth trying too, see REPETITIVE)."""
    if small:
        out = {}
        if k > 1:
            planes, pieces = _grouped(z, a, k, False)
            out[layout.GROUPED] = Encoded(layout.GROUPED, planes, pieces)
        if k == 1 or _size(out[layout.GROUPED]) < len(a) // REPETITIVE:
            out[layout.ZSTD] = Encoded(layout.ZSTD, None, [_cctx(z).compress(a)])
        if base is not None:
            codec = _delta_codecs(k)[0]
            planes, pieces = _grouped(z, _transform(codec, a, base, k), k, False)
            out[codec] = Encoded(codec, planes, pieces)
        return out
    out = {layout.ZSTD: Encoded(layout.ZSTD, None, [_cctx(z).compress(a)])}
    if k > 1:
        planes, pieces = _grouped(z, a, k, False)
        out[layout.GROUPED] = Encoded(layout.GROUPED, planes, pieces)
    if base is not None:
        for codec in _delta_codecs(k):
            planes, pieces = _grouped(z, _transform(codec, a, base, k), k, False)
            out[codec] = Encoded(codec, planes, pieces)
    return out


def _size(e: Encoded) -> int:
    return sum(n for _, n in e.planes) if e.planes is not None else e.payload_size


def _hinted(a: np.ndarray, k: int, base: np.ndarray | None, z: Any,
            hint: tuple[int, float]) -> dict[int, Encoded] | None:
    """The one candidate a small tensor tries where the same tensor's last blob used codec
    ``hint[0]`` and stored ``hint[1]`` of its bytes (RAW: the cheapest candidate, ``grouped``, or
    ``zstd`` for 1-byte elements); None where that candidate cannot be tried (a delta without a
    base) or stores more than HINT_SLACK of the bytes more than last time (the content changed in
    kind: every candidate is tried)."""
    codec, ratio = hint
    if codec in layout.DELTAS:
        if base is None or codec not in _delta_codecs(k):
            return None
        planes, pieces = _grouped(z, _transform(codec, a, base, k), k, False)
        found = {codec: Encoded(codec, planes, pieces)}
    elif codec == layout.ZSTD or k == 1:
        found = {layout.ZSTD: Encoded(layout.ZSTD, None, [_cctx(z).compress(a)])}
    else:
        planes, pieces = _grouped(z, a, k, False)
        found = {layout.GROUPED: Encoded(layout.GROUPED, planes, pieces)}
    (e,) = found.values()
    if _size(e) >= PAYS * len(a):
        return {} if codec == layout.RAW else None  # (RAW again: nothing paid last time, nor now)
    return found if _size(e) <= (ratio + HINT_SLACK) * len(a) else None


def _best(a: np.ndarray, k: int, base: np.ndarray | None, z: Any,
          hint: tuple[int, float] | None = None) -> tuple[int, Encoded | None, bool]:
    """The codec whose output is smallest on a sample of ``a``, or RAW, with its trial encoding,
    and whether that trial encoded the whole of ``a``. ``hint``: see :func:`encode`."""
    small = len(a) <= SMALL
    found = _hinted(a, k, base, z, hint) if small and hint is not None else None
    if found == {}:
        return layout.RAW, None, True
    where = [slice(0, len(a))] if found is not None else _sample(a, k)
    s = _take(a, where)
    if found is None:
        found = _candidates(s, k, _take(base, where) if base is not None else None, z, small)
    best = min(found, key=lambda c: (_size(found[c]), c))
    if _size(found[best]) >= PAYS * len(s):
        return layout.RAW, None, len(where) == 1
    return best, found[best], len(where) == 1


def choose(a: np.ndarray, k: int, base: np.ndarray | None) -> int:
    """The codec whose output is smallest on a sample of ``a`` (``base``: a delta's base bytes), or RAW."""
    z = zstd()
    if z is None or len(a) < MIN_COMPRESS:
        return layout.RAW
    return _best(a, k, base, z)[0]


def encode(data: Any, k: int, base: Any = None, *, pool: bool = True,
           hint: tuple[int, float] | None = None) -> Encoded:
    """``data`` (a tensor's flat bytes, element size ``k``) encoded with the codec :func:`choose`
    picks; ``base``: the bytes of the tensor a delta would be taken against (same length), if any.
    ``pool``: a large tensor's planes are compressed on the module's threads. ``hint``: the codec
    the same tensor's previous blob was stored with, and the fraction of its bytes it stored (the
    caller passes one only where a base is at hand as it was then): a tensor of at most SMALL bytes
    (whose trials compress the whole of it) tries that candidate alone, and every candidate only
    where it stores more than HINT_SLACK more than last time; where the previous blob was raw,
    ``grouped`` alone. (A small tensor's trials are its compression: on LoRA adapters and their
    AdamW state, 8-32 KiB each, two or three of them cost more than the rest of a save:
    benchmarks/store_bench.py.)

    The winner's planes that paid on the sample are compressed whole, the others stored untried
    (a mantissa plane is noise: compressing it costs time and saves nothing)."""
    a = as_u8(data)
    b = as_u8(base) if base is not None else None
    z = zstd()
    if z is None or len(a) < MIN_COMPRESS:
        return Encoded(layout.RAW, None, [data])
    codec, trial, whole = _best(a, k, b, z, hint)
    if codec == layout.RAW:
        return Encoded(layout.RAW, None, [data])
    assert trial is not None
    if whole:  # (the sample was the whole: a small tensor is compressed once, not twice)
        out = trial
    elif codec == layout.ZSTD:
        out = Encoded(layout.ZSTD, None, [_cctx(z).compress(a)])
    else:
        assert trial.planes is not None
        sample_plane = 3 * WINDOW // k
        which = [n < PLANE_PAYS * sample_plane for _, n in trial.planes]
        planes, pieces = _grouped(z, None, k, pool, which, _split_transformed(codec, a, b, k))
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


#: Elements interleaved and combined with a delta's base at a time: the chunk stays in the cache
#: between the interleaving, the transform and the base's addition. Each chunk costs about ten
#: numpy calls, each taking the GIL back: two threads decoding at once ran 11-13% (fp32 delta-sub)
#: and 12-27% (bf16) faster with chunks of 2^18 elements than of 2^16 (benchmarks/RESULTS.md).
_CHUNK = 1 << 18


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
    if h.codec in (layout.DELTA_SUB, layout.DELTA_TWOS) and k not in WORDS:  # (parse_header refuses it)
        raise FormatError(f"{where}: a {h.codec_name} blob of {k}-byte elements (1, 2, 4 or 8 only)")
    threads = pool and h.size >= 4 * WINDOW and k > 1

    def plane(i: int) -> np.ndarray:
        codec, start, length = h.planes[i]
        piece = data[start : start + length]
        if codec == layout.STORED:
            return np.frombuffer(piece, dtype=np.uint8)
        return np.frombuffer(_frame(z, piece, n, f"{where} (plane {i})"), dtype=np.uint8)

    srcs = list(_pool().map(plane, range(k))) if threads else [plane(i) for i in range(k)]
    b = as_u8(base()) if h.codec in layout.DELTAS and base is not None else None
    if h.codec != layout.GROUPED and b is None:
        raise FormatError(f"{where}: a delta blob decoded without its base")

    def part(lo: int, hi: int) -> None:
        """Elements ``lo`` to ``hi``: interleaved from the planes, then combined with the base,
        a chunk at a time."""
        tmp = np.empty(_CHUNK * k, dtype=np.uint8) if h.codec == layout.DELTA_SUB else None
        step = _CHUNK if h.codec != layout.GROUPED or k == 2 else hi - lo  # (nothing follows the interleaving)
        wide = _words(k, min(step, hi - lo)) if k == 2 else None
        for s in range(lo, hi, step):
            e = min(hi, s + step)
            chunk = o[s * k : e * k]
            _interleave(chunk, srcs, s, k, wide)
            if h.codec == layout.DELTA:
                assert b is not None
                if len(chunk) % 8 == 0:
                    np.bitwise_xor(chunk.view(np.uint64), b[s * k : e * k].view(np.uint64),
                                   out=chunk.view(np.uint64))
                else:
                    np.bitwise_xor(chunk, b[s * k : e * k], out=chunk)
            elif h.codec == layout.DELTA_SUB:
                assert b is not None and tmp is not None
                _unsub(chunk, b[s * k : e * k], k, tmp)
            elif h.codec == layout.DELTA_TWOS:
                assert b is not None
                np.add(chunk.view(WORDS[k]), b[s * k : e * k].view(WORDS[k]), out=chunk.view(WORDS[k]))

    if threads and n >= 4 * _CHUNK:
        half = (n // 2) // _CHUNK * _CHUNK
        list(_pool().map(lambda r: part(*r), [(0, half), (half, n)]))
    else:
        part(0, n)


def plane_summary(planes: Sequence[tuple[int, int, int]]) -> str:
    return ",".join("z" if c == layout.PLANE_ZSTD else "s" for c, _, _ in planes)
