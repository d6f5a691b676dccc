"""The ``ops`` level: a ``TorchDispatchMode`` that records every ATen operation of a step.

An op's tensor inputs are hashed before it runs (an in-place op changes them), its outputs after;
its arguments that are not tensors make one text record (role ``args``). Backward ops are told
apart by the autograd engine's current graph task (phase backward from the first one on). The
recorder's own torch calls are not recorded, nor the ops between an optimizer step's end and the
next ``step()`` (``Recorder.ops_recorded``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..format import optional
from .values import args_text, is_tensor as _is_tensor, leaves as _leaves

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _uninitialized(name: str) -> bool:
    """True for the ops whose outputs are uninitialized memory (``aten.empty.memory_format``,
    ``aten.empty_like.default``, ``aten.new_empty_strided.default``, ...)."""
    op = name.split(".")[1] if name.count(".") >= 1 else name
    return op in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")


def _is_fresh(rec: Any, t: Any) -> bool:
    ref = rec._fresh.get(id(t))
    return ref is not None and ref() is t


def _uninitialized_text(t: Any) -> str:
    return f"uninitialized {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def make_mode(rec: Any) -> Any:
    """The dispatch mode recording every op into recorder ``rec`` (entered and left by it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if not rec.ops_recorded():
                return func(*args, **kwargs)
            with rec._busy():
                if rec.phase == "forward" and _in_backward():
                    rec.phase = "backward"
                phase = rec.phase
                scope = rec.scope() if phase == "forward" else ""
                name = str(func)
                call = rec.call_index(phase, "op", scope, name)
                leaves: list[tuple[str, Any]] = []
                _leaves(list(args) + ([kwargs] if kwargs else []), "", leaves)
                fresh_in = False
                for path, leaf in leaves:
                    if _is_tensor(leaf):
                        if _is_fresh(rec, leaf):  # never written since an empty op made it: not its bytes
                            fresh_in = True
                            leaf = _uninitialized_text(leaf)
                        rec._put(phase, "op", scope, name, f"in.{path}", leaf, call)
                text = args_text(list(args) + ([kwargs] if kwargs else []))
                if text.strip("[T, ]"):
                    rec._put(phase, "op", scope, name, "args", text, call)
            out = func(*args, **kwargs)
            with rec._busy():
                leaves = []
                _leaves(out, "", leaves)
                # memory an empty op returns holds whatever was there, and so does a view of it: such
                # a tensor is recorded by its dtype and shape until an op writes it
                fresh = _uninitialized(name) or (fresh_in and bool(getattr(func, "is_view", False)))
                for path, leaf in leaves:
                    if _is_tensor(leaf):
                        role = f"out.{path}" if path else "out"
                        if fresh:
                            rec._fresh[id(leaf)] = weakref.ref(leaf)
                            rec._put(phase, "op", scope, name, role, _uninitialized_text(leaf), call)
                        else:
                            rec._fresh.pop(id(leaf), None)
                            rec._put(phase, "op", scope, name, role, leaf, call)
            return out

    return Mode()
