"""Human-readable paths to values inside a saved object: ``["model"]["fc.weight"]``."""

from __future__ import annotations

import json
from typing import Any

ROOT = "$"


def component(key: Any) -> str:
    """The path component for a dict key, list index or other position."""
    if type(key) is str:
        return "[" + json.dumps(key, ensure_ascii=False) + "]"
    if type(key) is int:
        return f"[{key}]"
    return f"[{key!r}]"


def join(parts: tuple) -> str:
    """Render a tuple of components (keys, indices) as one path string."""
    return ROOT + "".join(component(p) for p in parts)
