"""Where a loaded tensor goes: its recorded device, or where ``map_location`` sends it.

``map_location`` means what it means for ``torch.load``: None (each tensor to
its recorded device), a device (everything there), a dict remapping recorded
devices (``{"cuda:1": "cuda:0"}``), or a callable ``(cpu_tensor, recorded) ->
tensor or None``. A device this machine lacks is a
:class:`~tensorcanon.DeviceUnavailableError` that says whether the file or
``map_location`` asked for it, raised before any tensor data is read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..format import optional
from ..format.errors import DeviceUnavailableError, UsageError
from ..format.tensorbytes import in_memory_format

if TYPE_CHECKING:
    import torch

    from ..format.manifest import TensorInfo
else:
    torch = optional.torch_module(globals())


def stays_on_cpu(kind: str, recorded: str, map_location: Any) -> bool:
    """True when a tensor needs no device handling at all (the common case, kept cheap)."""
    return kind == "ndarray" or (map_location is None and recorded == "cpu")


def target(recorded: str, map_location: Any) -> torch.device | None:
    """The device a tensor recorded on ``recorded`` goes to; None: ask the callable."""
    if map_location is None:
        where: Any = recorded
    elif isinstance(map_location, dict):
        where = map_location.get(recorded, recorded)
    elif isinstance(map_location, (str, torch.device)):
        where = map_location
    elif callable(map_location):
        return None
    else:
        raise UsageError(f"map_location must be None, a str, a torch.device, a dict or a callable, "
                         f"not {type(map_location).__name__}")
    try:
        return torch.device(where)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"map_location gave an invalid device {where!r}: {e}") from None


def _available(device: torch.device) -> tuple[bool, str]:
    """(whether ``device`` exists here, what this machine has of its kind)."""
    kind = device.type
    if kind in ("cpu", "meta"):
        return True, ""
    if kind == "mps":
        ok = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        count = int(ok)
    else:
        module = getattr(torch, kind, None)
        ok = bool(module is not None and hasattr(module, "is_available") and module.is_available())
        count = module.device_count() if module is not None and ok and hasattr(module, "device_count") else int(ok)
    have = f"{count} {kind} device(s)" if ok else f"no {kind} support"
    return ok and (device.index or 0) < count, have


def device_exists(device: torch.device) -> bool:
    """Whether ``device`` (its type, and its index where given) exists on this machine."""
    return _available(device)[0]


def check_device(device: torch.device, recorded: str, map_location: Any, where: Callable[[], str]) -> None:
    """Raise :class:`DeviceUnavailableError` when ``device`` does not exist on this machine.

    The message blames ``map_location`` when it chose the device, else the file.
    """
    ok, have = _available(device)
    if ok:
        return
    path = where()
    if map_location is not None and str(device) != recorded:
        message = (f"map_location sends tensor {path} (saved on {recorded}) to {device}, but this "
                   f"machine has {have}; pass a map_location that names a device it has, such as 'cpu'")
    else:
        message = (f"tensor {path} was saved on {device} but this machine has {have}; pass "
                   f"map_location='cpu' (or a dict such as {{'{device}': 'cpu'}}) to load it elsewhere")
    raise DeviceUnavailableError(message, path=path, device=str(device))


def check_all(rows: list[TensorInfo], map_location: Any, where: Callable[[int], str]) -> None:
    """Check every row's target device before any data is read (``rows`` have kind, device, index)."""
    if map_location is None:  # (stays_on_cpu, for every row at once: the common case)
        rows = [row for row in rows if row.device != "cpu" and row.kind != "ndarray"]
    for row in rows:
        if stays_on_cpu(row.kind, row.device, map_location):
            continue
        device = target(row.device, map_location)
        if device is not None:
            check_device(device, row.device, map_location, functools.partial(where, row.index))


def place(t: torch.Tensor, recorded: str, map_location: Any, where: Callable[[], str]) -> torch.Tensor:
    """Move a freshly read CPU tensor where ``map_location`` says, as torch.load would."""
    device = target(recorded, map_location)
    if device is None:
        moved = map_location(t, recorded)
        if isinstance(moved, torch.Tensor):
            return moved
        if moved is not None:
            raise UsageError(f"map_location callable returned {type(moved).__name__}, expected a tensor or None")
        device = torch.device(recorded)
    check_device(device, recorded, map_location, where)
    return t if device.type == "cpu" else t.to(device)


def as_recorded(value: Any, row: TensorInfo, map_location: Any, where: Callable[[], str]) -> Any:
    """A freshly read tensor or array, placed and typed as its table row says: on its device
    (or where ``map_location`` sends it), in its memory format, a Parameter or not, with its
    requires_grad."""
    if row.kind == "ndarray":
        return value
    if not stays_on_cpu(row.kind, row.device, map_location):
        value = place(value, row.device, map_location, where)
    fmt = getattr(row, "memory_format", None)
    if fmt is not None:
        value = in_memory_format(value, fmt)  # (also for dtypes torch has no copy kernel for)
    if row.kind == "parameter":
        return torch.nn.Parameter(value, requires_grad=row.requires_grad)
    if row.requires_grad:
        value.requires_grad_(True)
    return value
