"""Pausing Python's cyclic garbage collector during a save or a load.

Saving or loading a checkpoint of many small tensors builds hundreds of
thousands of short-lived, acyclic Python objects (tree nodes, table rows, tensor
wrappers). Each allocation counts towards the collector's thresholds, so the
collector repeatedly scans every live object, which on 20,000 small tensors
costs about as much as the save itself (benchmarks/RESULTS.md). Nothing the
library builds is cyclic, so reference counting frees it all; the collector
only has to wait until the call returns.

The pause nests and is thread-safe: the collector is re-enabled when the last
concurrent save or load returns, and only if it was enabled when the first
began, so a program that disabled it itself keeps it disabled.
"""

from __future__ import annotations

import functools
import gc
import threading
from typing import Callable, TypeVar

_F = TypeVar("_F", bound=Callable)

_lock = threading.Lock()
_depth = 0
_reenable = False


def _enter() -> None:
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1


def _exit() -> None:
    global _depth, _reenable
    with _lock:
        _depth -= 1
        if _depth == 0 and _reenable:
            _reenable = False
            gc.enable()


def paused(fn: _F) -> _F:
    """Decorator: run ``fn`` with the cyclic garbage collector paused."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _exit()

    return wrapper  # type: ignore[return-value]
