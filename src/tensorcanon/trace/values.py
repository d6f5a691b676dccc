"""Walking values: the tensor leaves of nested containers, and the canonical text of the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..format import optional

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())

MAX_LEAVES = 10_000
"""Leaves recorded from one batch, one module's inputs or outputs, one op's arguments."""


def is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def leaves(value: Any, path: str, out: list[tuple[str, Any]]) -> None:
    """``(path, leaf)`` for the leaves of nested lists, tuples and dicts (keys in their order)."""
    if len(out) >= MAX_LEAVES:
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            leaves(v, f"{path}.{i}" if path else str(i), out)
    elif isinstance(value, dict):
        for k, v in value.items():
            leaves(v, f"{path}.{k}" if path else str(k), out)
    elif hasattr(value, "items") and hasattr(value, "keys") and not isinstance(value, (str, bytes)):
        for k, v in value.items():  # BatchEncoding and other mappings
            leaves(v, f"{path}.{k}" if path else str(k), out)
    else:
        out.append((path, value))


def args_text(value: Any) -> str:
    """The arguments of an op that are not tensors, as a canonical text: tensors stand as ``T``;
    numbers, texts, dtypes, devices and layouts as written; other objects by their type name
    (never an address)."""
    if isinstance(value, torch.Tensor):
        return "T"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(args_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={args_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return f"<{type(value).__name__}>"
