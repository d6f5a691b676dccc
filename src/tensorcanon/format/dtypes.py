"""The dtype table: every element type tensorcanon stores, in one place.

Each row gives the canonical dtype name (torch's name without ``torch.``, also
numpy's where numpy has the type), the element size, the safetensors dtype
string used in the header (``"U8"`` with an extra trailing dimension of
``itemsize`` for types that safetensors or ``safetensors.torch`` cannot map),
and the torch and numpy types. See docs/FORMAT.md, "Element types".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import optional

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = optional.numpy_module(globals())  # imported on first use: reading most files needs no numpy

_UNKNOWN: Any = object()  # DType.torch not looked up yet


class _TorchDtype:
    """:attr:`DType.torch`, looked up (importing torch) on first use: the dtype table, and every
    reader of files, work without torch. A value given to the constructor (``None`` to stand
    for a torch that lacks the type, as the tests do) is kept as it is."""

    def __get__(self, row: DType | None, owner: type | None = None) -> torch.dtype | None:
        if row is None:  # on the class: the descriptor (the field's default)
            return self  # type: ignore[return-value]
        t = row.__dict__.get("_torch", _UNKNOWN)
        if t is _UNKNOWN:
            t = row.__dict__["_torch"] = _torch_dtype(optional.load(), row.name)
        return t  # type: ignore[no-any-return]

    def __set__(self, row: DType, value: torch.dtype | None | _TorchDtype) -> None:
        row.__dict__["_torch"] = _UNKNOWN if value is self else value  # (the default: this descriptor)


class _NumpyDtype:
    """:attr:`DType.numpy`, made (importing numpy) on first use from its type code (``"<f4"``); the
    constructor also takes a numpy dtype, or None where numpy lacks the type."""

    def __get__(self, row: DType | None, owner: type | None = None) -> np.dtype | None:
        if row is None:  # on the class: the descriptor (the field's default)
            return self  # type: ignore[return-value]
        t = row.__dict__["_numpy"]
        if type(t) is str:
            t = row.__dict__["_numpy"] = np.dtype(t)
        return t  # type: ignore[no-any-return]

    def __set__(self, row: DType, value: np.dtype | str | None | _NumpyDtype) -> None:
        row.__dict__["_numpy"] = None if value is self else value


@dataclass(frozen=True)
class DType:
    name: str                   # canonical name, e.g. "float32"
    itemsize: int               # bytes per element
    st: str                     # safetensors dtype string written in the header
    torch: _TorchDtype = field(default=_TorchDtype(), repr=False, compare=False)  # None where this torch lacks it
    # little-endian numpy dtype, None if numpy lacks it (given as a type code: made on first use)
    numpy: _NumpyDtype = field(default=_NumpyDtype(), repr=False, compare=False)

    @property
    def has_numpy(self) -> bool:
        """True when numpy has the type (what :attr:`numpy` says, without importing numpy)."""
        return self.__dict__["_numpy"] is not None

    @property
    def differentiable(self) -> bool:
        """True for floating-point and complex types: the only ones whose tensors torch lets
        require gradients, so the only rows whose ``requires_grad`` may be true."""
        return self.name in DIFFERENTIABLE

    @property
    def native(self) -> bool:
        """True when safetensors stores the type directly (not as U8 bytes)."""
        return self.st != "U8" or self.name == "uint8"


def _torch_dtype(torch: Any, name: str) -> Any:
    t = getattr(torch, name, None)
    return t if isinstance(t, torch.dtype) else None


# (name, itemsize, safetensors string, numpy dtype code)
_ROWS = [
    ("bool", 1, "BOOL", "|b1"),
    ("uint8", 1, "U8", "|u1"),
    ("int8", 1, "I8", "|i1"),
    ("uint16", 2, "U16", "<u2"),
    ("int16", 2, "I16", "<i2"),
    ("uint32", 4, "U32", "<u4"),
    ("int32", 4, "I32", "<i4"),
    ("uint64", 8, "U64", "<u8"),
    ("int64", 8, "I64", "<i8"),
    ("float16", 2, "F16", "<f2"),
    ("bfloat16", 2, "BF16", None),
    ("float32", 4, "F32", "<f4"),
    ("float64", 8, "F64", "<f8"),
    ("complex64", 8, "C64", "<c8"),
    ("complex128", 16, "U8", "<c16"),
    ("complex32", 4, "U8", None),
    ("float8_e5m2", 1, "F8_E5M2", None),
    ("float8_e4m3fn", 1, "F8_E4M3", None),
    ("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", None),
    ("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", None),
    # safetensors.torch (0.8) cannot map F8_E8M0 or F4 to torch: store as bytes.
    ("float8_e8m0fnu", 1, "U8", None),
    ("float4_e2m1fn_x2", 1, "U8", None),
] + [(f"uint{n}", 1, "U8", None) for n in range(1, 8)] + [
    (f"int{n}", 1, "U8", None) for n in range(1, 8)
]

BY_NAME: dict[str, DType] = {_name: DType(_name, _size, _st, numpy=_code) for _name, _size, _st, _code in _ROWS}

DIFFERENTIABLE = frozenset([
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
])

# The closed list of names a ``["dtype", name]`` value may hold (docs/FORMAT.md §4.4): every
# row above plus the torch dtypes that hold no savable data. A name outside it is a format
# error; a name in it that this torch lacks is an error saying so.
DTYPE_VALUE_NAMES = tuple(name for name, *_ in _ROWS) + (
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
)

if TYPE_CHECKING:
    BY_NUMPY: dict[np.dtype, DType]
    """Every row numpy has, by its (little-endian) numpy dtype."""
    BY_TORCH: dict[torch.dtype, DType]
    """Every row whose dtype this torch has, by its torch dtype."""
    TORCH_DTYPES_BY_NAME: dict[str, torch.dtype]
    """Every torch.dtype of DTYPE_VALUE_NAMES which this torch has, by its canonical name."""


def __getattr__(name: str) -> Any:
    """``BY_NUMPY``, ``BY_TORCH`` and ``TORCH_DTYPES_BY_NAME``, built (importing numpy or torch) on first use."""
    if name == "BY_NUMPY":
        value: Any = {row.numpy: row for row in BY_NAME.values() if row.numpy is not None}
    elif name == "BY_TORCH":
        value = {row.torch: row for row in BY_NAME.values() if row.torch is not None}
    elif name == "TORCH_DTYPES_BY_NAME":
        torch = optional.load()
        value = {n: t for n in DTYPE_VALUE_NAMES if (t := _torch_dtype(torch, n)) is not None}
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals().setdefault(name, value)  # built once: later lookups find the global


# safetensors header dtype strings a plain safetensors file may use, with their
# element sizes, for reading files that tensorcanon did not write.
SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "C64": 8, "U64": 8, "I64": 8, "F64": 8,
    "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}
_ST_TO_NAME = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "F16": "float16", "BF16": "bfloat16", "U32": "uint32", "I32": "int32",
    "F32": "float32", "C64": "complex64", "U64": "uint64", "I64": "int64",
    "F64": "float64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def from_safetensors(st: str) -> DType | None:
    """The row for a plain safetensors dtype string, or None if unknown."""
    name = _ST_TO_NAME.get(st)
    return None if name is None else BY_NAME[name]


def header_shape(row: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape written in the safetensors header for a tensor of ``shape`` (docs/FORMAT.md §4.1):
    its own for a dtype safetensors knows, with one more dimension (the element size) for one it
    does not, whose elements are stored as bytes. Decided here only."""
    if row.native:
        return shape
    return (*shape, row.itemsize)

