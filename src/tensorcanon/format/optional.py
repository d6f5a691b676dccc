"""PyTorch (and numpy), imported on first use: what lets the light install do without them.

``import tensorcanon`` and the commands that only read files (``hash``, ``verify``, ``check``,
``lock``, ``inspect``) never import torch, and import numpy only for a file whose contents need it
(numpy arrays or scalars, random state, ``.npz`` and ``.npy`` files): a file's bytes are
checked and hashed by the same code with or without them. A module that uses torch (or numpy)
binds the name through :func:`torch_module` (:func:`numpy_module`)::

    if TYPE_CHECKING:
        import torch
    else:
        torch = optional.torch_module(globals())

Type checkers see the module. At run time the name is a stand-in until the module is first used
(any attribute: ``torch.empty``, ``np.ndarray``); then it is imported, the name is rebound to the
real module in every such namespace (later uses cost nothing extra), and the hooks registered with
:func:`on_load` run (format/tree.py's: the classes its node kinds name in the module, by
``LazyType``, join the encoder's table; no other module fills a table here). If the program imported it
before, the name is the module itself from the start. Without torch installed, its first use raises
:class:`~tensorcanon.MissingDependencyError`: one line saying what to install.

No value can be a torch tensor (or a numpy array) unless its module is imported, so code that only
asks "is this a tensor?" uses :func:`imported` and never imports a module to answer no.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .errors import MissingDependencyError

__all__ = ["INSTALL", "NAMES", "torch_module", "numpy_module", "load", "on_load", "ready", "imported",
           "available"]

INSTALL = "pip install torch safetensors (the [torch] extra of tensorcanon)"
"""What adds everything to the light install: a command that works however tensorcanon was installed
(no package index serves tensorcanon itself: README.md, "Install")."""

_lock = threading.RLock()


class _Stub:
    """Stands for a module in a namespace until the module is first used."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(load(self._name), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use (tensorcanon.format.optional)>"


class _Lazy:
    """One module imported on first use: its stand-in, the namespaces holding it, the hooks."""

    def __init__(self, name: str, binding: str) -> None:
        self.name, self.binding = name, binding  # e.g. "numpy", bound as "np"
        self.stub: Any = _Stub(name)
        self.module: ModuleType | None = None
        self.ready = False
        self.namespaces: list[dict[str, Any]] = []
        self.hooks: list[Callable[[ModuleType], None]] = []


_MODULES = {"torch": _Lazy("torch", "torch"), "numpy": _Lazy("numpy", "np")}

NAMES = tuple(_MODULES)
"""The modules imported on first use: ``("torch", "numpy")``."""


def imported(name: str = "torch") -> ModuleType | None:
    """The module (torch, or numpy) if this process has imported it (whoever did), else None;
    never imports it."""
    return sys.modules.get(name)


def available() -> bool:
    """True when torch can be imported here (imports it if it is not yet)."""
    try:
        load()
    except MissingDependencyError:
        return False
    return True


def _bind(name: str, namespace: dict[str, Any]) -> Any:
    lazy = _MODULES[name]
    with _lock:
        lazy.namespaces.append(namespace)
    if lazy.ready or imported(name) is not None:
        return load(name)
    return lazy.stub


def torch_module(namespace: dict[str, Any]) -> Any:
    """The value for the name ``torch`` in the module whose ``globals()`` is ``namespace``: torch
    itself if it is imported already, else a stand-in that imports it on first use and then
    rebinds the name."""
    return _bind("torch", namespace)


def numpy_module(namespace: dict[str, Any]) -> Any:
    """:func:`torch_module` for numpy, bound as ``np``."""
    return _bind("numpy", namespace)


def _message(e: ImportError) -> str:
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "torch":
        return (f"this needs PyTorch, which is not installed: {INSTALL}; "
                "hash, verify, check, lock and inspect work without it")
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"this needs PyTorch, which cannot be imported here ({first}): reinstall it, e.g. {INSTALL}"


def load(name: str = "torch") -> ModuleType:
    """The module (torch, or numpy), imported now if it was not; raises MissingDependencyError
    where torch is missing."""
    lazy = _MODULES[name]
    if lazy.ready:
        assert lazy.module is not None
        return lazy.module
    with _lock:
        if lazy.module is None:
            try:
                module = importlib.import_module(name)
            except ImportError as e:
                if name != "torch":
                    raise
                raise MissingDependencyError(_message(e), name="torch") from e
            lazy.module = module
            for namespace in lazy.namespaces:
                if namespace.get(lazy.binding) is lazy.stub:
                    namespace[lazy.binding] = module
            for hook in lazy.hooks:
                hook(module)
            lazy.ready = True
        return lazy.module  # (also to a hook that uses the module while the hooks run: the same thread)


def on_load(hook: Callable[[ModuleType], None], name: str = "torch") -> None:
    """Call ``hook(module)`` once the module (torch, or numpy) is loaded: now if it is, else when it is.

    format/tree.py's hook gives the node kinds their classes of the module; a module that adds a
    node kind names its classes with ``tree.LazyType`` and registers no hook of its own."""
    lazy = _MODULES[name]
    with _lock:
        if not lazy.ready:
            lazy.hooks.append(hook)
            return
    assert lazy.module is not None
    hook(lazy.module)


def ready() -> None:
    """Finish tensorcanon's set-up for torch and numpy if the program imported them itself since:
    before encoding values, which may then be tensors or arrays (the node kinds need their classes)."""
    for name, lazy in _MODULES.items():
        if not lazy.ready and imported(name) is not None:
            load(name)
