"""Human-readable paths to values inside a saved object: ``$["model"]["fc.weight"]``.

str keys are JSON strings; every other key is rendered by the tensor-name grammar
(:func:`tensorcanon.format.names.key_text`: ``[3]``, ``[('a', 1)]``, ``[0x10000000000000000]``),
which never fails and never depends on the Python version.
"""

from __future__ import annotations

import json
from typing import Any

from .names import key_text

ROOT = "$"


def component(key: Any) -> str:
    """The path component for a dict key, list index or other position."""
    if type(key) is str:
        return "[" + json.dumps(key, ensure_ascii=False) + "]"
    try:
        return f"[{key_text(key)}]"
    except (TypeError, ValueError):  # not a key type, or members that tie (a path built by hand)
        return f"[<{type(key).__name__}>]"


def join(parts: tuple[Any, ...]) -> str:
    """Render a tuple of components (keys, indices) as one path string."""
    return ROOT + "".join(component(p) for p in parts)


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message: short, and never failing on a value from a file.

    ``repr`` of an int of more than 4,300 digits raises ValueError (and is slow well
    before that); such ints are shown by their leading hex digits and size instead.
    """
    if type(value) is int and value.bit_length() > 256:
        head = format(abs(value) >> (value.bit_length() - 64), "x")
        return f"{'-' if value < 0 else ''}0x{head}... (an int of {value.bit_length()} bits)"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a big int inside a container, a broken __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
