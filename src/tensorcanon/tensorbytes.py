"""Tensors and arrays to their canonical bytes, and bytes back to tensors.

The canonical bytes of a tensor are its elements in C order, little-endian,
with lazy conjugation and negation resolved and bool stored as 0/1: never its
storage, strides or offset. docs/FORMAT.md, "Tensor data".
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .dtypes import DType
from .errors import FormatError

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("tensorcanon supports little-endian hosts only")


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_bytes(value, kind: str) -> memoryview:
    """A flat uint8 view of ``value``'s canonical bytes, copying only when needed.

    A contiguous CPU tensor or array is returned without a copy; a view that is
    not contiguous, a lazily conjugated/negated tensor or one on another device
    is copied once, tensor by tensor.
    """
    if kind == "ndarray":
        a = value
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if a.dtype == np.uint8 and value.dtype == np.bool_ and a.size and a.max() > 1:
            a = (a != 0).view(np.uint8)
        return memoryview(a)
    t = value.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype.itemsize in _SAME_SIZE_INT:
        # copy kernels exist for every int dtype but not for sub-byte or some float8 dtypes
        t = t.view(_SAME_SIZE_INT[t.dtype.itemsize])
    flat = t.contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # size-1 dims may keep any stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    u = flat.view(torch.uint8)
    if value.dtype is torch.bool and u.numel() and bool(u.max() > 1):
        u = (u != 0).view(torch.uint8)
    return memoryview(u.numpy())


def empty_buffer(nbytes: int, kind: str):
    """A fresh, writable flat uint8 buffer (tensor or array) and its memoryview."""
    if kind == "ndarray":
        arr = np.empty(nbytes, dtype=np.uint8)
        return arr, memoryview(arr)
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t, memoryview(t.numpy())


def finish(buffer, dtype: DType, shape: tuple[int, ...], kind: str, name: str):
    """Reinterpret a filled flat uint8 buffer as the recorded dtype and shape."""
    if dtype.name == "bool" and len(buffer) and buffer.max() > 1:
        raise FormatError(f"tensor {name!r} is bool but holds a byte other than 0 or 1")
    if kind == "ndarray":
        return buffer.view(dtype.numpy.newbyteorder("=")).reshape(shape)
    return buffer.view(dtype.torch).reshape(shape)
