"""Device text: the closed vocabulary of device types and their canonical spelling.

A file names devices in three places: ``["device", spec]`` values, the devices
text of the header (``"3:cuda:0"``) and ``["rng.torch", device, state]``. All
three use one grammar, checked here without asking torch (whose list of device
types and whose parser change between versions)::

    device = type [ ":" index ]      type  = one of DEVICE_TYPES
                                     index = "0" | [1-9][0-9]*, at most 127

It is exactly what ``str(torch.device(...))`` prints for these types with
torch's 8-bit device index. docs/FORMAT.md §4.3 is the normative text.
"""

from __future__ import annotations

from typing import Any

DEVICE_TYPES = (
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
)
"""Every device type a version-2 file may name (torch 2.13's list, in its own order)."""

MAX_INDEX = 127  # torch's DeviceIndex is a signed 8-bit integer
_TYPES = frozenset(DEVICE_TYPES)


def parse(text: Any) -> tuple[str, int | None] | None:
    """``(type, index or None)`` for canonical device text, else None (never raises)."""
    if type(text) is not str or len(text) > 24:
        return None
    kind, sep, index = text.partition(":")
    if kind not in _TYPES:
        return None
    if not sep:
        return kind, None
    if not index.isascii() or not index.isdigit() or (len(index) > 1 and index[0] == "0"):
        return None
    n = int(index)
    return (kind, n) if n <= MAX_INDEX else None


def is_canonical(text: Any) -> bool:
    """True for text that :func:`parse` accepts."""
    return parse(text) is not None


def of_tensor(text: str) -> str | None:
    """Why a tensor's device text cannot be recorded in the devices text, or None if it can.

    A recorded device is canonical, not ``cpu`` (no item is written for the CPU)
    and not ``meta``, and carries an index (as every tensor's device does).
    """
    parsed = parse(text)
    if parsed is None:
        return (f"device {text!r} is not one a file can record (device types: "
                f"{', '.join(DEVICE_TYPES)}; index 0-{MAX_INDEX})")
    kind, index = parsed
    if kind in ("cpu", "meta") or index is None:
        return f"device {text!r} is not a device a tensor's data can be recorded on"
    return None


__all__ = ["DEVICE_TYPES", "MAX_INDEX", "parse", "is_canonical", "of_tensor"]
