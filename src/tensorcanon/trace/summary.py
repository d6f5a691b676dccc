"""A tensor's record content: its dtype name, shape, digest and float64 sum of squares.

The digest is the format's tensor digest (format/digest.py: dtype name, shape and the canonical
bytes of format/tensorbytes.py), so equal values give equal digests on any device or machine.
The sum of squares is summed in a fixed order (chunks of ``CHUNK`` elements, each by numpy's
pairwise sum, the chunks in order), so equal bytes also give equal sums, whatever the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import TYPE_CHECKING, Any

from ..format import digest as digests, optional
from ..format.dtypes import BY_NAME
from ..format.tensorbytes import host_bytes, unsaveable
from .layout import TEXT_DTYPE, text_digest

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())

CHUNK = 1 << 16
_FLOAT_VIEW = {"complex64": "<f4", "complex128": "<f8"}


def sum_of_squares(data: memoryview, dtype_name: str, t: Any = None, floats: Any = None) -> float:
    """The float64 sum of the squares of the values in ``data`` (of a tensor of ``dtype_name``;
    ``t`` the tensor itself, converted by torch for the dtypes numpy lacks, or ``floats`` that
    conversion already made)."""
    row = BY_NAME[dtype_name]
    if row.numpy is not None:
        a = np.frombuffer(data, dtype=_FLOAT_VIEW.get(dtype_name, row.numpy))
    elif floats is not None:
        a = floats
    elif t is not None and dtype_name in _TORCH_CONVERTED:
        u = t.detach()
        u = torch.view_as_real(u.to(torch.complex64)) if dtype_name == "complex32" else u.to(torch.float32)
        a = u.cpu().contiguous().reshape(-1).numpy()
    else:  # sub-byte and exotic types: the sum of squares of the bytes, a summary all the same
        a = np.frombuffer(data, dtype=np.uint8)
    if a.dtype.itemsize == 8 and a.dtype.kind == "f":  # only float64's squares can pass float64's range:
        with np.errstate(over="ignore"):                 # inf is the sum then, no warning (docs/TRACE.md)
            return _sum_sq(a)
    return _sum_sq(a)


def _sum_sq(a: Any) -> float:
    total = 0.0
    for i in range(0, a.size, CHUNK):
        c = a[i:i + CHUNK].astype(np.float64)
        c *= c
        total += float(np.add.reduce(c))
    return total


def host_view(t: Any) -> memoryview:
    """``format.tensorbytes.host_bytes(t, "tensor")`` (the same bytes), read without ``t.numpy()``
    when ``t``'s memory holds them as they are: numpy marks the memory it views as not resizable,
    for good, and a traced program that resizes a storage (FSDP2 frees a parameter's memory with
    ``storage.resize_(0)``) must not fail because it was traced."""
    if (t.is_cpu and t.numel() and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t._is_zerotensor() and t.dtype in _raw()):
        raw = (ctypes.c_uint8 * (t.numel() * t.element_size())).from_address(t.data_ptr())
        if t.dtype is torch.bool:
            a = np.frombuffer(raw, dtype=np.uint8)
            if a.max() > 1:  # canonical bools are 0 and 1 (as host_bytes makes them)
                return memoryview((a != 0).view(np.uint8))
        return memoryview(raw).cast("B")
    return host_bytes(t, "tensor")


def detached(t: Any) -> tuple[str, tuple[int, ...], bytes, Any] | None:
    """What hashing ``t`` needs, copied so that ``t`` may change at once: ``(dtype name, shape, its
    canonical bytes, the values of a dtype numpy lacks as float32 or None)``; None for a tensor
    :func:`summarize` hashes as a note."""
    if unsaveable(t) is not None:
        return None
    row = _BY_TORCH.get(t.dtype)
    if row is None:
        from ..format.dtypes import BY_TORCH

        _BY_TORCH.update(BY_TORCH)
        row = BY_TORCH[t.dtype]
    data = bytes(host_view(t))
    floats = None
    if row.numpy is None and row.name in _TORCH_CONVERTED:
        u = t.detach()
        u = torch.view_as_real(u.to(torch.complex64)) if row.name == "complex32" else u.to(torch.float32)
        floats = u.cpu().contiguous().reshape(-1).numpy().copy()
    return row.name, tuple(t.shape), data, floats


def finish(dtype_name: str, shape: tuple[int, ...], data: bytes, floats: Any,
           algorithm: str) -> tuple[str, tuple[int, ...], bytes, float, str]:
    """The record content of :func:`detached`'s copy (on any thread: numpy and xxhash release the GIL)."""
    h = digests.tensor_hasher(dtype_name, shape, algorithm)
    h.update(data)
    view = memoryview(data)
    return dtype_name, shape, h.digest(), sum_of_squares(view, dtype_name, None, floats), ""


_TORCH_CONVERTED = ("bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "complex32")


def summarize(t: Any, algorithm: str) -> tuple[str, tuple[int, ...], bytes, float, str]:
    """``(dtype name, shape, digest, sum of squares, note)`` of tensor ``t``. A tensor whose bytes
    cannot be read (a meta or sparse tensor, a subclass) gets an empty digest text record and a
    note saying why."""
    why = unsaveable(t)
    if why is not None:
        note = f"not hashed: {type(t).__name__} {t.dtype} {list(t.shape)}"[:200]
        return summarize_text(note, algorithm)
    row = _BY_TORCH.get(t.dtype)
    if row is None:
        from ..format.dtypes import BY_TORCH

        _BY_TORCH.update(BY_TORCH)
        row = BY_TORCH[t.dtype]
    shape = tuple(t.shape)
    data = host_view(t)
    h = digests.tensor_hasher(row.name, shape, algorithm)
    h.update(data)
    return row.name, shape, h.digest(), sum_of_squares(data, row.name, t), ""


_BY_TORCH: dict[Any, Any] = {}
_RAW_NAMES = ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16",
              "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e5m2", "float8_e4m3fn",
              "float8_e5m2fnuz", "float8_e4m3fnuz")



@functools.cache
def _raw() -> frozenset[Any]:
    """The dtypes whose canonical bytes are their bytes in memory (little-endian machines, as
    host_bytes assumes; bool once its bytes are 0 or 1)."""
    return frozenset(getattr(torch, n) for n in _RAW_NAMES if hasattr(torch, n))


# significand bits (the leading one included) and the smallest normal exponent of each float dtype
# whose ULP distance the evidence reports
_PRECISION = {"float16": (11, -14), "bfloat16": (8, -126), "float32": (24, -126), "float64": (53, -1022)}


def max_ulp(a: Any, b: Any, dtype_name: str) -> int | float:
    """The largest distance in units in the last place between the values of ``a`` and ``b``
    (float64 numpy arrays of one shape holding the values of two ``dtype_name`` tensors,
    element by element; docs/TRACE.md "The evidence").

    The distance of two values x and y is |x − y| in ULPs of the larger magnitude of the two,
    rounded up: |x − y| / ulp(max(|x|, |y|)), where ulp(v) is the gap between v and the next
    larger magnitude of ``dtype_name`` (the gap of its smallest normal number for a subnormal
    or 0). So equal values are 0 apart (-0.0 and 0.0 too), adjacent floats 1, and two floats of
    one binade the number of floats between them, while values on both sides of zero are as far
    apart as their difference is in the larger one's last place: -0.002 and 0.002 in float32 are
    17 179 870 ULP apart (the larger's value has 8 589 935 ULPs), not the 1 980 114 142 floats
    that lie between them (floats crowd near zero: nearly half of the positive float32 numbers are
    smaller than 0.002). A NaN against a number, an inf against another value, are inf apart;
    two NaNs 0."""
    p, emin = _PRECISION[dtype_name]
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size == 0:
        return 0
    both_nan = np.isnan(a) & np.isnan(b)
    finite = np.isfinite(a) & np.isfinite(b)
    if bool(np.any(~finite & ~both_nan & (a != b))):
        return math.inf
    a, b = a[finite], b[finite]
    if a.size == 0:
        return 0
    _, e = np.frexp(np.maximum(np.abs(a), np.abs(b)))  # m * 2**e with m in [0.5, 1): 2**(e-1) <= v
    ulp = np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1))
    # v / ulp is exact (a power of two, no overflow: |v| / ulp < 2**p), so is most often the difference
    return int(np.ceil(np.abs(a / ulp - b / ulp)).max())


def summarize_text(text: str, algorithm: str) -> tuple[str, tuple[int, ...], bytes, float, str]:
    """A text record's content: the digest of its UTF-8 bytes (layout.text_digest), and the text itself."""
    return TEXT_DTYPE, (), text_digest(text, algorithm), 0.0, text
