"""The ``ops`` level: a ``TorchDispatchMode`` that records every ATen operation of a step.

An op's tensor inputs are hashed before it runs (an in-place op changes them), its outputs after;
its arguments that are not tensors make one text record (role ``args``). Backward ops are told
apart by the autograd engine's current graph task (phase backward from the first one on). The
recorder's own torch calls are not recorded (``Recorder.busy``).
"""

from __future__ import annotations

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


def make_mode(rec: Any) -> Any:
    """The dispatch mode recording every op into recorder ``rec`` (entered and left by it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if not rec._in_step or rec.busy():
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
                for path, leaf in leaves:
                    if _is_tensor(leaf):
                        rec._put(phase, "op", scope, name, f"in.{path}", leaf, call)
                text = args_text(list(args) + ([kwargs] if kwargs else []))
                if text.strip("[T, ]"):
                    rec._put(phase, "op", scope, name, "args", text, call)
            out = func(*args, **kwargs)
            with rec._busy():
                leaves = []
                _leaves(out, "", leaves)
                for path, leaf in leaves:
                    if _is_tensor(leaf):
                        rec._put(phase, "op", scope, name, f"out.{path}" if path else "out", leaf, call)
            return out

    return Mode()
