"""The dtype table: every element type tensorcanon stores, in one place.

Each row gives the canonical dtype name (torch's name without ``torch.``, also
numpy's where numpy has the type), the element size, the safetensors dtype
string used in the header (``"U8"`` with an extra trailing dimension of
``itemsize`` for types that safetensors or ``safetensors.torch`` cannot map),
and the torch and numpy types. See docs/FORMAT.md, "Element types".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    name: str                   # canonical name, e.g. "float32"
    itemsize: int               # bytes per element
    st: str                     # safetensors dtype string written in the header
    torch: torch.dtype | None   # None where this torch build lacks the type
    numpy: np.dtype | None      # little-endian numpy dtype, None if numpy lacks it

    @property
    def differentiable(self) -> bool:
        """True for floating-point and complex types: the only ones whose tensors torch lets
        require gradients, so the only rows whose ``requires_grad`` may be true."""
        return self.name in DIFFERENTIABLE

    @property
    def native(self) -> bool:
        """True when safetensors stores the type directly (not as U8 bytes)."""
        return self.st != "U8" or self.name == "uint8"


def _np(code: str | None) -> np.dtype | None:
    return None if code is None else np.dtype(code)


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

BY_NAME: dict[str, DType] = {}
BY_TORCH: dict[torch.dtype, DType] = {}
BY_NUMPY: dict[np.dtype, DType] = {}

for _name, _size, _st, _code in _ROWS:
    _t = getattr(torch, _name, None)
    if _t is not None and not isinstance(_t, torch.dtype):
        _t = None
    _row = DType(_name, _size, _st, _t, _np(_code))
    BY_NAME[_name] = _row
    if _t is not None:
        BY_TORCH[_t] = _row
    if _row.numpy is not None:
        BY_NUMPY[_row.numpy] = _row

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

# Every torch.dtype of that list which this torch has, by its canonical name.
TORCH_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in DTYPE_VALUE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}

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


def header_shape(row: DType, shape: tuple[int, ...]) -> list[int]:
    """The shape written in the safetensors header for a tensor of ``shape``."""
    if row.native:
        return list(shape)
    return [*shape, row.itemsize]

