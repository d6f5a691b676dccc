"""A tensor's record content: its dtype name, shape, digest and float64 sum of squares.

The digest is the format's tensor digest (format/digest.py: dtype name, shape and the canonical
bytes of format/tensorbytes.py), so equal values give equal digests on any device or machine.
The sum of squares is summed in a fixed order (chunks of ``CHUNK`` elements, each by numpy's
pairwise sum, the chunks in order), so equal bytes also give equal sums, whatever the thread count.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

from ..format import digest as digests, optional
from ..format.dtypes import BY_NAME
from ..format.tensorbytes import host_bytes, memory_of, unsaveable
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
    return _digest_and_sum(None, data, _values(data, dtype_name, t, floats))


def _values(data: memoryview, dtype_name: str, t: Any, floats: Any) -> Any:
    """The values whose squares are summed, as a flat numpy array: a view of ``data`` where numpy
    has the dtype (a complex one as its real and imaginary parts), else torch's float32 conversion,
    else (sub-byte and exotic types) the bytes themselves."""
    row = BY_NAME[dtype_name]
    if row.numpy is not None:
        return np.frombuffer(data, dtype=_FLOAT_VIEW.get(dtype_name, row.numpy))
    if floats is not None:
        return floats
    if t is not None and dtype_name in _TORCH_CONVERTED:
        u = t.detach()
        u = torch.view_as_real(u.to(torch.complex64)) if dtype_name == "complex32" else u.to(torch.float32)
        return u.cpu().contiguous().reshape(-1).numpy()
    return np.frombuffer(data, dtype=np.uint8)


_LOCAL = threading.local()


def _squares_buffer() -> Any:
    """This thread's float64 buffer of CHUNK elements, where a chunk's squares are made and summed
    (reused: no allocation per chunk, and it stays in the cache)."""
    buf = getattr(_LOCAL, "squares", None)
    if buf is None:
        buf = _LOCAL.squares = np.empty(CHUNK, dtype=np.float64)
    return buf


def _digest_and_sum(h: Any, data: memoryview, a: Any) -> float:
    """Feed ``data`` (the canonical bytes) to hasher ``h`` (unless None) and return the float64 sum
    of the squares of ``a`` (the values: docs/TRACE.md "The file", item 4), in one pass: chunk by
    chunk of CHUNK values, each chunk's bytes hashed, then squared in float64 into one reused buffer
    and summed by numpy's pairwise sum (``np.add.reduce`` of a contiguous float64 array: the same
    array, so the same sum, as squaring a float64 copy of the chunk), the chunk sums added in
    order. The bytes are read from memory once: the squares read them while the hash left them in
    the cache. Equal to hashing all of ``data`` and then summing (a hash fed in pieces is the hash
    of their concatenation)."""
    n = a.size
    nbytes = data.nbytes
    step = nbytes // n if n else 0
    if step * n != nbytes:  # (values not one per fixed number of bytes: never for the dtypes above)
        if h is not None:
            h.update(data)
        h, step = None, 0
    if a.dtype.itemsize == 8 and a.dtype.kind == "f":  # only float64's squares can pass float64's range:
        with np.errstate(over="ignore"):                 # inf is the sum then, no warning (docs/TRACE.md)
            return _chunks(h, data, a, n, step)
    return _chunks(h, data, a, n, step)


def _chunk_sum(a: Any, i: int, n: int) -> float:
    """The sum of the squares of ``a[i:i + CHUNK]`` (in this thread's buffer)."""
    m = min(CHUNK, n - i)
    x, c = a[i:i + m], _squares_buffer()[:m]
    if a.dtype.kind == "f" and a.dtype.itemsize == 8:
        np.multiply(x, x, out=c)
    else:  # (the cast, then the squares in place: faster than a multiply that casts as it goes)
        np.copyto(c, x)
        np.multiply(c, c, out=c)
    return float(np.add.reduce(c))


def _chunks(h: Any, data: memoryview, a: Any, n: int, step: int) -> float:
    if n <= CHUNK:  # one chunk (most tensors a step meets)
        if h is not None:
            h.update(data)
        if n == 1 and a.dtype.kind == "f":  # (one value: its square in float64, as numpy's sum of one gives it)
            x = float(a[0])
            return 0.0 + x * x
        c = _squares_buffer()[:n]
        if a.dtype.kind == "f" and a.dtype.itemsize == 8:
            np.multiply(a, a, out=c)
        else:
            np.copyto(c, a)
            np.multiply(c, c, out=c)
        return 0.0 + float(np.add.reduce(c))  # (0.0 + as the loop below adds it: the same bits, -0.0 too)
    if n >= PARALLEL_FROM and not getattr(_LOCAL, "helping", False) and _helper() is not None:
        return _Split(a, n).run(h, data, step)
    buf = _squares_buffer()
    total = 0.0
    multiply, copyto, add = np.multiply, np.copyto, np.add.reduce
    wide = a.dtype.kind == "f" and a.dtype.itemsize == 8
    for i in range(0, n, CHUNK):
        m = min(CHUNK, n - i)
        if h is not None:
            h.update(data[i * step:(i + m) * step])
        x, c = a[i:i + m], buf[:m]
        if wide:
            multiply(x, x, out=c)
        else:
            copyto(c, x)
            multiply(c, c, out=c)
        total += float(add(c))
    return total


PARALLEL_FROM = 16 * CHUNK
"""Values from which a tensor's squares are summed on two threads (:class:`_Split`): 4 MiB of
float32, where handing work to the helper thread costs little beside the work."""


class _TwoEnded:
    """Work items ``0..count-1`` shared by two threads: the asking thread claims them from the first
    on (:meth:`front`), the helper thread from the last back (:meth:`back`), until they meet, so
    no item is done twice. Where no core is free the helper starts late or not at all and the
    asking thread does the rest; :meth:`finish` returns only once the helper is done with the
    items (on an error too), so the tensors are read only while the asking thread waits (nothing
    runs beside it that could change them). A subclass does the work in :meth:`_help`."""

    __slots__ = ("lock", "lo", "hi", "started", "cancelled", "done", "error")

    def __init__(self, count: int) -> None:
        self.lock = threading.Lock()
        self.lo, self.hi = 0, count  # items [lo, hi) are not claimed yet
        self.started = self.cancelled = False
        self.done = threading.Event()
        self.error: BaseException | None = None

    def front(self, k: int) -> bool:
        """Claim item ``k`` (the next from the front) for the asking thread, unless the helper has."""
        with self.lock:
            if k >= self.hi:
                return False
            self.lo = k + 1
            return True

    def back(self) -> int | None:
        """The next item from the back for the helper, or None where the two have met."""
        with self.lock:
            if self.hi - 1 < self.lo:
                return None
            self.hi -= 1
            return self.hi

    def finish(self) -> None:
        """On the asking thread: no more claims; wait for the helper if it started."""
        with self.lock:
            wait = self.started
            self.cancelled = True
            self.hi = self.lo
        if wait:
            self.done.wait()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def help(self) -> None:
        """On the helper thread (unless the asking thread finished first)."""
        with self.lock:
            if self.cancelled:
                return
            self.started = True
        try:
            self._help()
        except BaseException as e:  # noqa: BLE001 (raised on the thread that asked)
            self.error = e
        finally:
            self.done.set()

    def _help(self) -> None:
        raise NotImplementedError


class _Split(_TwoEnded):
    """One tensor's digest and sum of squares on two cores: this thread hashes every chunk in order
    and sums the squares of the chunks from the first on, a helper thread sums those from the last
    on (:class:`_TwoEnded`); each chunk's sum is kept and the sums are added in chunk order, so the
    total is bitwise the one of a single thread (numpy and xxhash release the GIL while they work)."""

    __slots__ = ("a", "n", "sums", "wide")

    def __init__(self, a: Any, n: int) -> None:
        chunks = -(-n // CHUNK)
        super().__init__(chunks)
        self.a, self.n = a, n
        self.sums = [0.0] * chunks
        self.wide = a.dtype.itemsize == 8 and a.dtype.kind == "f"

    def run(self, h: Any, data: memoryview, step: int) -> float:
        helper = _helper()
        assert helper is not None
        helper.put(self)
        a, n, sums = self.a, self.n, self.sums
        try:
            for k in range(len(sums)):
                i = k * CHUNK
                if h is not None:
                    h.update(data[i * step:min(i + CHUNK, n) * step])
                if self.front(k):
                    sums[k] = _chunk_sum(a, i, n)
        finally:
            self.finish()
        self.raise_error()
        total = 0.0
        for x in sums:
            total += x
        return total

    def _help(self) -> None:
        with np.errstate(over="ignore") if self.wide else contextlib.nullcontext():
            while (k := self.back()) is not None:
                self.sums[k] = _chunk_sum(self.a, k * CHUNK, self.n)


class _Many(_TwoEnded):
    """Several tensors' record contents on two cores: this thread and a helper thread share the
    large tensors (``shared``: this thread from the first on, the helper from the last back,
    :class:`_TwoEnded`), whose digest and squares run without the GIL, so both threads run at
    once; then this thread computes the small ones (``alone``: mostly Python, which holds the GIL,
    so a second thread would only wait for it). The results come back in the items' order, each
    what ``fn`` gives on one thread (a content depends on its tensor's bytes alone)."""

    __slots__ = ("fn", "items", "shared", "alone", "out")

    def __init__(self, fn: Any, items: list[Any], shared: list[int], alone: list[int]) -> None:
        super().__init__(len(shared))
        self.fn, self.items, self.shared, self.alone = fn, items, shared, alone
        self.out: list[Any] = [None] * len(items)

    def run(self) -> list[Any]:
        helper = _helper()
        assert helper is not None
        helper.put(self)
        fn, items, shared, out = self.fn, self.items, self.shared, self.out
        try:
            for j in range(len(shared)):
                if not self.front(j):
                    break
                out[shared[j]] = fn(items[shared[j]])
            for k in self.alone:  # (meanwhile the helper ends the large tensor it holds)
                out[k] = fn(items[k])
        finally:  # (on an error too: the helper is done with the tensors before this returns)
            self.finish()
        self.raise_error()
        return out

    def _help(self) -> None:
        _LOCAL.helping = True  # (a large tensor's squares are not handed to the helper: this thread is it)
        try:
            while (j := self.back()) is not None:
                k = self.shared[j]
                self.out[k] = self.fn(self.items[k])
        finally:
            _LOCAL.helping = False


SHARED_FROM = CHUNK * 4
"""Bytes from which a tensor is one :func:`contents` may hand to the helper thread: one chunk of
float32 values, whose digest and squares (without the GIL) take several times the Python
around them (with the GIL)."""
MANY_FROM = 1 << 20
"""Bytes of such tensors from which :func:`contents` hands part of them to the helper thread."""


def contents(fn: Any, items: list[Any], sizes: list[int]) -> list[Any]:
    """``[fn(x) for x in items]`` (record contents of tensors of ``sizes`` bytes), on this thread
    and the helper thread (:class:`_Many`: the tensors of SHARED_FROM bytes or more shared
    between them, the rest on this thread) where there are enough bytes and a second core."""
    shared = [k for k, n in enumerate(sizes) if n >= SHARED_FROM]
    if (len(shared) < 2 or sum(sizes[k] for k in shared) < MANY_FROM or getattr(_LOCAL, "helping", False)
            or _helper() is None):
        return [fn(x) for x in items]
    alone = [k for k, n in enumerate(sizes) if n < SHARED_FROM]
    return _Many(fn, items, shared, alone).run()


class _Helper:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Split | _Many] = queue.SimpleQueue()
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="tensorcanon-trace-sum", daemon=True).start()

    def put(self, job: _Split | _Many) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            self.jobs.get().help()


_HELPER: list[_Helper] = []
_HELPER_LOCK = threading.Lock()


@functools.cache
def _cores() -> int:
    return os.cpu_count() or 1


def _helper() -> _Helper | None:
    """The helper thread of this process (started on first use; a forked child starts its own), or
    None on a machine of one core."""
    if _cores() < 2:
        return None
    got = _HELPER[0] if _HELPER else None
    if got is not None and got.pid == os.getpid():
        return got
    with _HELPER_LOCK:
        if not _HELPER or _HELPER[0].pid != os.getpid():
            _HELPER[:] = [_Helper()]
        return _HELPER[0]


def host_view(t: Any) -> memoryview:
    """``format.tensorbytes.host_bytes(t, "tensor")`` (the same bytes), read without ``t.numpy()``
    when ``t``'s memory holds them as they are: numpy marks the memory it views as not resizable,
    for good, and a traced program that resizes a storage (FSDP2 frees a parameter's memory with
    ``storage.resize_(0)``) must not fail because it was traced."""
    if (t.is_cpu and t.numel() and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t._is_zerotensor() and t.dtype in _raw()):
        raw = memory_of(t)  # (the one way tensorcanon views a tensor's memory: format/tensorbytes.py)
        if t.dtype is torch.bool:
            a = np.frombuffer(raw, dtype=np.uint8)
            if a.max() > 1:  # canonical bools are 0 and 1 (as host_bytes makes them)
                return memoryview((a != 0).view(np.uint8))
        return raw
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
    h = digests.constructor(algorithm)(_prefix(dtype_name, shape))
    view = memoryview(data)
    sumsq = _digest_and_sum(h, view, _values(view, dtype_name, None, floats))
    return dtype_name, shape, h.digest(), sumsq, ""


_TORCH_CONVERTED = ("bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "complex32")


def summarize(t: Any, algorithm: str) -> tuple[str, tuple[int, ...], bytes, float, str]:
    """``(dtype name, shape, digest, sum of squares, note)`` of tensor ``t``. A tensor whose bytes
    cannot be read (a meta or sparse tensor, a subclass) gets an empty digest text record and a
    note saying why."""
    if not _plain(t):
        why = unsaveable(t)
        if why is not None:
            note = f"not hashed: {type(t).__name__} {t.dtype} {list(t.shape)}"[:200]
            return summarize_text(note, algorithm)
    row = _BY_TORCH.get(t.dtype)
    if row is None:
        from ..format.dtypes import BY_TORCH

        _BY_TORCH.update(BY_TORCH)
        row = BY_TORCH[t.dtype]
    name = row.name
    shape = tuple(t.shape)
    data = host_view(t)
    h = digests.constructor(algorithm)(_prefix(name, shape))
    sumsq = _digest_and_sum(h, data, _values(data, name, t, None))
    return name, shape, h.digest(), sumsq, ""


def same_bytes_key(t: Any) -> tuple[Any, int, int, Any] | None:
    """``(storage, storage offset, elements, dtype)`` of a plain contiguous CPU tensor whose
    canonical bytes are its memory as it is (:func:`host_view`'s raw path): two such tensors with
    the same key hold the same bytes while that memory is not written (a view that reshapes an
    activation and its base: their digests differ by the shape, their sums of squares do not).
    None for any other tensor."""
    if not (_plain(t) and t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t._is_zerotensor() and t.dtype in _raw()):
        return None
    return t.untyped_storage(), t.storage_offset(), t.numel(), t.dtype


def summarize_with(t: Any, algorithm: str, sumsq: float) -> tuple[str, tuple[int, ...], bytes, float, str]:
    """:func:`summarize` of a tensor whose sum of squares is known (that of another tensor of the
    same :func:`same_bytes_key`, its memory not written since): only its digest is computed."""
    row = _BY_TORCH.get(t.dtype)
    if row is None:
        return summarize(t, algorithm)
    shape = tuple(t.shape)
    h = digests.constructor(algorithm)(_prefix(row.name, shape))
    h.update(host_view(t))
    return row.name, shape, h.digest(), sumsq, ""


def _plain(t: Any) -> bool:
    """A plain strided tensor with memory (what ``unsaveable`` passes), told without building its
    message: most tensors a trace meets are."""
    return (type(t) in _plain_types() and t.layout is _strided() and not t.is_meta and not t.is_quantized
            and not t.is_nested)


_PREFIXES: dict[tuple[str, tuple[int, ...]], bytes] = {}
_MAX_PREFIXES = 4096


def _prefix(name: str, shape: tuple[int, ...]) -> bytes:
    """``digest.tensor_prefix``, kept for the shapes met (a step meets few; at most _MAX_PREFIXES)."""
    key = (name, shape)
    prefix = _PREFIXES.get(key)
    if prefix is None:
        prefix = digests.tensor_prefix(name, shape)
        if len(_PREFIXES) >= _MAX_PREFIXES:
            _PREFIXES.clear()
        _PREFIXES[key] = prefix
    return prefix


_BY_TORCH: dict[Any, Any] = {}


@functools.cache
def _strided() -> Any:
    return torch.strided


@functools.cache
def _plain_types() -> tuple[Any, ...]:
    return (torch.Tensor, torch.nn.Parameter)
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
