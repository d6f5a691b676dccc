"""Tensor subclasses that implement PyTorch's ``__tensor_flatten__``/``__tensor_unflatten__``
protocol (torchao's quantized weights, torch's wrapper subclasses such as ``TwoTensor``), saved
as registered types (docs/FORMAT.md §6.12.5).

``tensorcanon.register(MySubclass)`` gives such a class this codec: its state is a ``dict`` of
the inner tensors (by the attribute names ``__tensor_flatten__`` gives), the flatten context
(any value the format holds, refused at save otherwise, naming its path), the outer size and
stride and ``requires_grad``. Loading calls ``MySubclass.__tensor_unflatten__`` of the class the
loading program registered under the recorded name: nothing is imported from a name in a file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import optional
from .errors import UnsupportedTypeError
from .limits import too_large  # (§5.3's rule: the one check)

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())

STATE_KEYS = ("ctx", "inner", "requires_grad", "size", "stride")


def implements_flatten(cls: type) -> bool:
    """Whether ``cls`` implements the flatten protocol (looked up on the class, importing nothing)."""
    return callable(getattr(cls, "__tensor_flatten__", None)) and callable(getattr(cls, "__tensor_unflatten__", None))


def _own(t: Any) -> Any:
    """``t``, or a copy of it in a storage of its own when it views a larger one: ``load(mmap=True)``
    gives tensors that view the file's map at their offsets, and a class's ``__tensor_unflatten__``
    may rely on what an eager load gives (TwoTensor asserts that both inner tensors start at one
    storage offset), so that both loads build the same value or refuse the same file."""
    if type(t) is torch.Tensor and (t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return t.clone()
    return t


def codec(cls: Any) -> tuple[Any, Any]:
    """``(encode, decode)`` for a tensor subclass that implements the flatten protocol."""

    def encode(value: Any) -> dict:
        if type(value) is not cls:
            raise UnsupportedTypeError(
                f"{type(value).__qualname__} is a subclass of the registered {cls.__qualname__}: register it too")
        names, ctx = value.__tensor_flatten__()
        if not all(type(n) is str for n in names):
            raise UnsupportedTypeError(f"{cls.__qualname__}.__tensor_flatten__ gave attribute names that are not str")
        inner = {n: getattr(value, n) for n in names}
        if too_large(value.shape, 1):  # (the reader's check of 'size', below)
            raise UnsupportedTypeError(f"{cls.__qualname__} of size {list(value.shape)}: its non-zero dimensions "
                                       "multiply to 2^63 or more, which no tensor the format holds has (§5.3)")
        return {"ctx": ctx, "inner": inner, "requires_grad": bool(value.requires_grad),
                "size": torch.Size(value.shape), "stride": list(value.stride())}

    def decode(state: Any) -> Any:
        if type(state) is not dict or tuple(sorted(state)) != STATE_KEYS:
            raise ValueError(f"the state of a tensor subclass is a dict with the keys {', '.join(STATE_KEYS)}")
        inner, size, stride, grad = state["inner"], state["size"], state["stride"], state["requires_grad"]
        if type(inner) is not dict or not all(type(k) is str and isinstance(t, torch.Tensor) for k, t in inner.items()):
            raise ValueError("'inner' must map attribute names (str) to tensors")
        if type(size) is not torch.Size or any(d < 0 for d in size):
            raise ValueError("'size' must be a torch.Size of non-negative dimensions")
        if too_large(size, 1):  # (checked before the class's own code sees it)
            raise ValueError(f"'size' {list(size)} has non-zero dimensions whose product reaches 2^63, which no "
                             "tensor has (docs/FORMAT.md §5.3)")
        if type(stride) is not list or len(stride) != len(size) or not all(type(s) is int and 0 <= s < 2**63
                                                                         for s in stride):
            raise ValueError("'stride' must be a list of non-negative ints below 2^63, one per dimension (torch "
                             "makes no tensor with a negative stride)")
        if type(grad) is not bool:
            raise ValueError("'requires_grad' must be a bool")
        inner = {k: _own(t) for k, t in inner.items()}
        value = cls.__tensor_unflatten__(inner, state["ctx"], size, tuple(stride))
        if type(value) is not cls or tuple(value.shape) != tuple(size):
            raise ValueError(f"{cls.__qualname__}.__tensor_unflatten__ did not rebuild a {cls.__qualname__} "
                             f"of size {tuple(size)}")
        return value.requires_grad_(True) if grad else value

    return encode, decode
