"""What :meth:`Store.save_async <tensorcanon.store.store.Store.save_async>` runs on and hands over:
the one background thread every store's background saves run on, one after another; what a call
took before returning (:class:`Snapshot`); its future (:class:`Pending`); and the exit rules (a
background save under way at exit finishes first; a save cannot start once Python stops its threads).
docs/STORE.md, "In the background".
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..format.errors import UsageError

_POOL: list[ThreadPoolExecutor] = []
# Set when Python stops its threads at exit (before atexit handlers run): from then on no thread pool
# takes work, so a save (which writes on threads) cannot start; it says so (refuse_at_exit).
_EXITING: list[bool] = []
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(lambda: _EXITING.append(True))
if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: it makes its own
    os.register_at_fork(after_in_child=_POOL.clear)

#: ``HERE.on``: this thread runs background saves (a store's own methods called there wait for nothing).
HERE = threading.local()


def refuse_at_exit(what: str, tag: str) -> None:
    if _EXITING:
        raise UsageError(f"{what} of tag {tag!r} cannot start: the program is exiting (an atexit handler or a "
                         "finalizer runs after Python stopped its threads, and a save writes on threads); "
                         "save before the program ends, e.g. at the end of the main function")


def pool() -> ThreadPoolExecutor:
    """The thread background saves run on, one after another (every Store's)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="tensorcanon-store-background"))
        # At exit, the background saves under way finish before the thread pools stop taking work (a
        # save uses several): threading's exit hooks run last registered first, and concurrent.futures
        # registered its own (which makes every pool refuse new work) when it was imported, before this.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_finish)
    return _POOL[0]


def _finish() -> None:
    while _POOL:
        _POOL.pop().shutdown(wait=True)


class Snapshot:
    """What a save_async call took before returning: the digest cache's entries for the tensors it
    hashed (``Store._remember``), and a copy of each tensor the store did not hold, by digest."""

    def __init__(self) -> None:
        self.hashed: dict[tuple, tuple[Any, int, int, bytes]] = {}
        self.data: dict[bytes, np.ndarray] = {}


class Pending(Future):
    """save_async's future: it remembers whether its outcome was asked for (``Store._drain``)."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.seen = False

    def result(self, timeout: float | None = None) -> Any:
        self.seen = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.seen = True
        return super().exception(timeout)
