"""Walking values: the tensor leaves of nested containers, and the canonical text of the rest."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..format import optional

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())

MAX_LEAVES = 10_000
"""Leaves recorded from one batch, one module's inputs or outputs, one op's arguments."""
MAX_DEPTH = 100
"""Containers deeper than this are one leaf (a text), and their text is cut: a value nested
thousands deep (or a list that holds itself) is recorded, never a RecursionError."""


_MAX_INT_BITS = 13_000
"""Ints of more bits are written by their size: Python refuses to write one of more than 4,300
digits (and takes quadratic time on the way)."""


def _key(k: Any) -> str:
    """A dict key in a path or a text."""
    if type(k) is int and k.bit_length() > _MAX_INT_BITS:
        return f"<int of {k.bit_length()} bits>"
    return str(k)


def is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def leaves(value: Any, path: str, out: list[tuple[str, Any]], depth: int = 0) -> None:
    """``(path, leaf)`` for the leaves of nested lists, tuples and dicts (keys in their order); a
    container deeper than MAX_DEPTH is a leaf itself."""
    if len(out) >= MAX_LEAVES:
        return
    if depth >= MAX_DEPTH:
        out.append((path, value))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            leaves(v, f"{path}.{i}" if path else str(i), out, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            leaves(v, f"{path}.{_key(k)}" if path else _key(k), out, depth + 1)
    elif hasattr(value, "items") and hasattr(value, "keys") and not isinstance(value, (str, bytes)):
        for k, v in value.items():  # BatchEncoding and other mappings
            leaves(v, f"{path}.{_key(k)}" if path else _key(k), out, depth + 1)
    else:
        out.append((path, value))


def args_text(value: Any, depth: int = 0) -> str:
    """The arguments of an op that are not tensors, as a canonical text: tensors stand as ``T``;
    numbers, texts, dtypes, devices and layouts as written; other objects by their type name
    (never an address); containers deeper than MAX_DEPTH as ``...``."""
    if depth > MAX_DEPTH:
        return "..."
    if isinstance(value, torch.Tensor):
        return "T"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_INT_BITS:
        return f"<int of {value.bit_length()} bits>"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(args_text(v, depth + 1) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)}={args_text(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return f"<{type(value).__name__}>"


_INDEX = tuple(str(i) for i in range(256))


@functools.cache
def _atoms() -> frozenset[Any]:
    """Types that :func:`leaves` takes as a leaf as they are (no list, tuple, dict or mapping)."""
    return frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, type(None), str, torch.dtype,
                      torch.device, torch.layout, torch.memory_format})


@functools.cache
def _tensor_types() -> frozenset[Any]:
    return frozenset({torch.Tensor, torch.nn.Parameter})


def op_leaves(args: tuple[Any, ...], kwargs: dict[str, Any], out: list[tuple[str, Any]]) -> None:
    """``leaves([*args, kwargs] if kwargs else list(args), "", out)``, the same leaves and paths,
    with fewer calls for the arguments most ops get (tensors and numbers)."""
    atoms = _atoms()
    index = _INDEX
    for i, v in enumerate(args):
        if len(out) >= MAX_LEAVES:
            return
        if type(v) in atoms:
            out.append((index[i] if i < 256 else str(i), v))
        else:
            leaves(v, index[i] if i < 256 else str(i), out, 1)
    if kwargs:
        leaves(kwargs, str(len(args)), out, 1)


def args_have_text(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any], depth: int = 0) -> bool:
    """False when ``args_text([*args, kwargs] if kwargs else list(args))`` is tensors and lists only
    (``[T, [T, T]]``: no record of the arguments), told without writing it; True otherwise (also
    where it does not look deeper: the text then decides)."""
    if kwargs or depth > 8:
        return True
    tensors = _tensor_types()
    for v in args:
        if type(v) in tensors:
            continue
        if type(v) is list and not args_have_text(v, {}, depth + 1):
            continue
        return True
    return False
