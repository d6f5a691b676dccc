"""Tensors and arrays to their canonical bytes, and bytes back to tensors.

The canonical bytes of a tensor are its elements in C order, little-endian,
with lazy conjugation and negation resolved and bool stored as 0/1: never its
storage, strides or offset. docs/FORMAT.md, "Tensor data".
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
from typing import TYPE_CHECKING, Any

from . import optional
from .dtypes import DType
from .errors import FormatError, UnsupportedTypeError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())

_referents = gc.get_referents

_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ, _PYBUF_WRITE = 0x100, 0x200

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("tensorcanon supports little-endian hosts only")


@functools.cache
def same_size_int() -> dict[int, torch.dtype]:
    """The int dtype of each item size (torch's tables, built once torch is needed)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.cache
def numpy_viewable() -> frozenset[torch.dtype]:
    """Dtypes whose bytes numpy can expose directly (bool is not here: it needs the 0/1 check)."""
    return frozenset(
        getattr(torch, n) for n in (
            "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "float32", "float64", "complex64", "complex128",
        ) if hasattr(torch, n)
    )


@functools.cache
def numpy_viewable_names() -> frozenset[str]:
    """The canonical names of :func:`numpy_viewable`'s dtypes: a table row's ``dtype.name`` is
    checked against it without looking its torch dtype up (a descriptor call: loading many small
    tensors checks every one)."""
    return frozenset(str(t).removeprefix("torch.") for t in numpy_viewable())


@functools.cache
def _channels_last() -> dict[int, tuple[str, Any]]:
    return {4: ("channels_last", torch.channels_last), 5: ("channels_last_3d", torch.channels_last_3d)}


@functools.cache
def _memory_formats() -> dict[str, Any]:
    return dict(_channels_last().values())


if TYPE_CHECKING:
    SAME_SIZE_INT: dict[int, torch.dtype]
    NUMPY_VIEWABLE: frozenset[torch.dtype]
    MEMORY_FORMATS: dict[str, torch.memory_format]


def __getattr__(name: str) -> Any:
    """The torch tables by their former names, built (importing torch) on first use."""
    if name == "SAME_SIZE_INT":
        return same_size_int()
    if name == "NUMPY_VIEWABLE":
        return numpy_viewable()
    if name == "MEMORY_FORMATS":
        return _memory_formats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Stored:
    """A tensor of a plain safetensors file, as its bytes: what ``hash``, ``lock``, ``check`` and
    ``inspect`` plan and hash without torch. It stands for the CPU tensor a load gives (kind
    ``tensor``, no gradient, contiguous, sharing memory with no other) and so gets the same digest:
    :func:`host_bytes` gives its bytes as they are (bool bytes are checked when read: reader.py)."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: DType, shape: tuple[int, ...], data: memoryview) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with lazy conjugation and negation applied and an efficient zero tensor
    (``torch._efficientzerotensor``, which has no memory) made an ordinary one of zeros: the values
    its bytes must hold.

    The one place that decides what a tensor's logical values are, for saving on
    the CPU (:func:`host_bytes`), staging from a GPU (cuda.py) and comparing (diff).
    """
    t = t.detach()
    if t._is_zerotensor():
        t = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def alias_key(value: Any, kind: str) -> Any:
    """What makes two tensors (or two arrays) one stored tensor, or None if they never merge.

    docs/FORMAT.md §6.5: the same view of the same memory, i.e. the same address
    of the first element (``data_ptr()``, which is the storage's address plus the
    view's offset, so two storages sharing memory count as the same memory),
    device, shape, strides, dtype, kind, requires_grad and lazy conjugate/negative
    bits. Zero-size tensors own no memory and never merge.
    """
    if kind == "ndarray":
        if not value.size:
            return None
        return ("ndarray", value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
    if value.numel() == 0 or value._is_zerotensor():  # an efficient zero tensor has no memory
        return None
    device = "cpu" if value.is_cpu else str(value.device)
    return (value.data_ptr(), device, tuple(value.shape), value.stride(), value.dtype, kind,
            value.requires_grad, value.is_conj(), value.is_neg())


def memory_format(t: torch.Tensor) -> str | None:
    """``"channels_last"`` (4-d) or ``"channels_last_3d"`` (5-d) when ``t`` is laid out that way and
    not also C-contiguous, else None: the layout a loader restores (docs/FORMAT.md §5.6)."""
    entry = _channels_last().get(t.dim())
    if entry is None or t.is_contiguous() or not t.is_contiguous(memory_format=entry[1]):
        return None
    return entry[0]


def in_memory_format(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` laid out in the memory format ``name`` of :data:`MEMORY_FORMATS` (a copy unless it
    already is), for every dtype of the table: torch has no copy kernel for some (the sub-byte
    ints, ``float8_e8m0fnu``, ``float4_e2m1fn_x2``), so those are laid out as the int of their size."""
    fmt = _memory_formats()[name]
    if t.is_contiguous(memory_format=fmt):
        return t
    same = same_size_int().get(t.dtype.itemsize)
    if same is None:  # complex128
        return t.contiguous(memory_format=fmt)
    return t.view(same).contiguous(memory_format=fmt).view(t.dtype)


def unsaveable(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` cannot be saved and what to save instead, or None if it can be."""
    name = f"{type(t).__module__}.{type(t).__qualname__}"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        # Worded from the type alone: some subclasses (ShardedTensor) raise on any attribute access.
        if "FakeTensor" in type(t).__name__:
            return f"fake tensors ({name}) hold no data and cannot be saved"
        if type(t).__name__ == "ShardedTensor":
            return (f"{name} (torch's deprecated sharded tensor) is not supported; save DTensors with "
                    "tensorcanon.dcp, or the full tensor")
        if type(t).__name__ == "DTensor":
            return (f"a {name} cannot be saved whole by one process: save t.full_tensor() (the whole "
                    "tensor, a plain tensor), or save DTensors with tensorcanon.dcp")
        return f"tensor subclass {name} is not supported"  # (format/tensorkinds.py says what to do)
    if getattr(t, "is_nested", False):
        return ("nested tensors are not supported; save t.unbind() (a list of tensors) or "
                "t.to_padded_tensor(0) with the lengths")
    if t.layout is not torch.strided:
        return f"{t.layout} tensors are not supported; save t.to_dense() (or the tensors it is made of)"
    if t.is_quantized:
        return "quantized tensors are not supported; save t.dequantize() or t.int_repr() with its scales"
    if t.is_meta:
        return ("meta tensors hold no data and cannot be saved; materialize them first "
                "(e.g. module.to_empty(device='cpu') and initialize)")
    return None


def dtype_refusal(dtype: Any) -> str:
    """Why a tensor of ``dtype`` (one the format lacks, §4.1) is refused, with advice that works: the
    ``bits`` dtypes cannot be converted (``t.to`` raises) but can be viewed as the int of their size."""
    why = f"tensors of dtype {dtype} are not supported (docs/FORMAT.md §4.1 lists the dtypes that are)"
    same = same_size_int().get(dtype.itemsize)
    if str(dtype).startswith("torch.bits") and same is not None:
        name = str(same).removeprefix("torch.")
        return (f"{why}; save its bytes as t.view(torch.{name}) and view them back after loading "
                f"(t.view({dtype}))")
    return f"{why}; convert it, e.g. t.to(torch.float32)"


def has_attributes(t: Any) -> bool:
    """Whether attributes were set on tensor ``t`` (``t.foo = 1``: a non-empty ``__dict__``), found
    without making its ``__dict__``: reading ``t.__dict__`` creates an empty dict on every tensor that
    has none, 20,000 more objects for the garbage collector to walk in a save of 20,000 tensors."""
    for ref in _referents(t):  # (a tensor's referents: its type, and its __dict__ once it has one)
        if type(ref) is dict and ref:
            return True
    return False


# numpy < 2 allows 32 dimensions, numpy 2 allows 64 (as many as the format's default max_ndim).
@functools.cache
def numpy_max_dims() -> int:
    return 64 if int(np.__version__.split(".")[0]) >= 2 else 32


def memory_of(t: torch.Tensor, *, writable: bool = False) -> memoryview:
    """The bytes of a contiguous CPU tensor's memory as a flat uint8 memoryview, no copy, without
    ``t.numpy()``: numpy marks the storage it views as not resizable, for good, and neither a
    tensor a user saves nor one a load returns may come out of tensorcanon changed (FSDP2 frees a
    parameter's memory with ``storage.resize_(0)``). The view does not keep ``t`` alive: the
    caller holds ``t`` for as long as it uses the view."""
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(bytearray() if writable else b"")
    view: memoryview = _from_memory(t.data_ptr(), n, _PYBUF_WRITE if writable else _PYBUF_READ)
    return view


def host_view(value: Any, kind: str) -> memoryview | None:
    """:func:`host_bytes` of ``value`` where they are its own memory (a flat uint8 view, no copy):
    a contiguous CPU tensor numpy can view, not lazily conjugated or negated, or a
    :class:`Stored`; None where :func:`host_bytes` would copy (or for an array). Bytes that are
    the value's own memory can be read at any time, by any thread, without holding a copy."""
    if type(value) is Stored:
        return value.data
    if kind == "ndarray" or not (value.is_cpu and value.is_contiguous() and not value.is_conj()
                                 and not value.is_neg() and value.numel() and not value._is_zerotensor()):
        return None
    if value.dtype in numpy_viewable():
        # The common case, kept cheap for checkpoints of many small tensors: no copy, no reshape.
        return memory_of(value)
    if value.dtype is torch.bool or same_size_int().get(value.dtype.itemsize) is None:
        return None  # (bool: its bytes are checked, and may be copied, by _canonical)
    return _canonical(value)  # (bfloat16, float8...: viewed as the int of their size, not copied)


def host_bytes(value: Any, kind: str) -> memoryview:
    """A flat uint8 view of ``value``'s canonical bytes, copying only when needed.

    A contiguous CPU tensor or array is returned without a copy; a view that is
    not contiguous, a lazily conjugated/negated tensor or one on another device
    is copied once, tensor by tensor.
    """
    view = host_view(value, kind)
    if view is not None:
        return view
    if kind == "ndarray":
        a = value
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if a.dtype == np.uint8 and value.dtype == np.bool_ and a.size and a.max() > 1:
            a = (a != 0).view(np.uint8)
        return a.data
    return _canonical(value)


def _canonical(value: torch.Tensor) -> memoryview:
    """:func:`host_bytes` of a tensor, by the general path: copied where it must be (another
    device, not contiguous, lazily conjugated or negated, bool bytes other than 0/1), else viewed."""
    t = resolved(value)
    if t.device.type != "cpu":
        t = t.cpu()
    same = same_size_int().get(t.dtype.itemsize)
    if same is not None:
        # copy kernels exist for every int dtype but not for sub-byte or some float8 dtypes
        t = t.view(same)
    flat = t.contiguous().reshape(-1)
    if not flat.numel():  # no bytes (an empty view may keep any stride, which no dtype view accepts)
        return memoryview(b"")
    if flat.stride(0) != 1:  # size-1 dims may keep any stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    u = flat.view(torch.uint8)
    if value.dtype is torch.bool and u.numel() and bool(u.max() > 1):
        u = (u != 0).view(torch.uint8)
    if _same_memory(u, value):
        return memory_of(u)  # the caller's own memory: viewed, its storage left as it is
    return u.numpy().data  # a copy of ours, which the array keeps alive


def _same_memory(u: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``u`` views ``value``'s own storage (no copy was made on the way)."""
    try:
        return value.device.type == "cpu" and u.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass): it was copied
        return False


@functools.cache
def _cpu() -> torch.device:
    return torch.device("cpu")


def host_empty(shape: tuple[int, ...] | int, dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """A new, uninitialized tensor in this process's memory: the one way every reader path makes the
    tensors it fills (eager, mmap, lazy, open, sharded, dcp).

    The device is always given as ``"cpu"``: a tensor made on the default device would land on
    ``meta`` inside ``with torch.device("meta")`` or after ``torch.set_default_device(...)``, and
    writing bytes through its data pointer would crash the interpreter. A tensor mode that makes
    tensors without memory (``FakeTensorMode``) is refused, with what to do instead.
    """
    value = torch.empty(shape, dtype=dtype, device=_cpu(), pin_memory=pin_memory)
    if type(value) is not torch.Tensor or value.device.type != "cpu":
        raise UsageError(
            f"cannot read tensors while a tensor mode is active that makes {type(value).__name__} "
            "objects instead of CPU tensors with memory (e.g. FakeTensorMode): tensorcanon reads "
            "real data only; load outside the mode (then fake_mode.from_tensor(t) if fake "
            "tensors are wanted), or use tensorcanon.read_metadata / tensorcanon.open for shapes "
            "and dtypes without data")
    return value


def empty_tensor(dtype: DType, shape: tuple[int, ...], kind: str) -> tuple[torch.Tensor, memoryview] | None:
    """``(tensor, flat byte view of it)`` already of ``dtype`` and ``shape``, so that reading
    into the view finishes the tensor; None when the general path is needed (arrays, bool,
    dtypes numpy cannot view, zero-size shapes): :func:`empty_buffer`, then :func:`finish`."""
    if kind == "ndarray":
        return None
    t = dtype.torch
    if t not in numpy_viewable() or 0 in shape:
        return None
    value = host_empty(shape, t)
    return value, memory_of(value, writable=True)


def empty_buffer(nbytes: int, kind: str) -> tuple[Any, memoryview]:
    """A fresh, writable flat uint8 buffer (tensor or array; a bytearray for kind ``"bytes"``, which
    needs neither torch nor numpy) and its memoryview."""
    if kind == "bytes":
        raw = bytearray(nbytes)
        return raw, memoryview(raw)
    if kind == "ndarray":
        arr = np.empty(nbytes, dtype=np.uint8)
        return arr, arr.data
    t = host_empty(nbytes, torch.uint8)
    return t, memory_of(t, writable=True)


def check_bool(buffer: Any, dtype: DType, name: str) -> None:
    """Refuse the flat uint8 bytes of a bool tensor unless each is 0 or 1 (all a writer stores)."""
    if dtype.name != "bool" or not len(buffer):
        return
    if buffer.translate(None, b"\x00\x01") if type(buffer) is bytearray else bool(buffer.max() > 1):
        raise FormatError(f"tensor {name!r} is bool but holds a byte other than 0 or 1")


def finish(buffer: Any, dtype: DType, shape: tuple[int, ...], kind: str, name: str) -> Any:
    """Reinterpret a filled flat uint8 buffer as the recorded dtype and shape."""
    check_bool(buffer, dtype, name)
    if kind == "ndarray":
        if len(shape) > numpy_max_dims():
            raise UnsupportedTypeError(
                f"tensor {name!r} is a numpy array of {len(shape)} dimensions, more than this numpy "
                f"({np.__version__}) allows ({numpy_max_dims()}): load the file with numpy >= 2")
        assert dtype.numpy is not None  # an ndarray's dtype is one numpy has
        return buffer.view(dtype.numpy.newbyteorder("=")).reshape(shape)
    if dtype.torch is None:
        raise UnsupportedTypeError(
            f"tensor {name!r} has dtype {dtype.name}, which this torch ({torch.__version__}) does not "
            f"have: load the file with a torch that has torch.{dtype.name} (its bytes verify without "
            "one: tensorcanon.verify)")
    return buffer.view(dtype.torch).reshape(shape)


# ----------------------------------------------------------------- fast reading of CPU tensors

memmove = ctypes.memmove


def address(buffer: Any) -> int:
    """The address of a contiguous buffer's first byte (bytes, bytearray, memoryview, ndarray, mmap)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data if len(memoryview(buffer)) else 0


def viewed(mapped: torch.Tensor, dtype: DType, shape: tuple[int, ...], kind: str) -> Any:
    """The tensor (or array) of ``dtype`` and ``shape`` that views the uint8 tensor ``mapped``
    (no copy); None where its bytes must be copied (a dtype torch cannot view at that
    alignment, bool bytes other than 0/1 are checked by the caller)."""
    t = dtype.torch
    if kind == "ndarray":
        arr = mapped.numpy()
        if dtype.numpy is None or arr.ctypes.data % dtype.itemsize:
            return None
        return arr.view(dtype.numpy.newbyteorder("=")).reshape(shape)
    if t is None or mapped.data_ptr() % dtype.itemsize:
        return None
    try:
        return mapped.view(t).view(shape)
    except RuntimeError:  # a dtype torch cannot reinterpret uint8 as (sub-byte types)
        return None
