"""The canonical traversal of Python containers: which children, in which order, at which path.

The encoder (save, fingerprint) and :func:`tensorcanon.diff` both walk values
through :func:`container`, and the decoder walks the written tree in the same
order (docs/FORMAT.md §6.4), so a value has the same path, such as
``$["opt"]["state"][0]``, in every error message and every diff.

Path components: a list or tuple index, a dict or OrderedDict key, or
``"_metadata"`` for an OrderedDict's metadata slot. Set members add no
component (a set is compared and reported as one value), and a registered
type adds none (its state's children follow directly).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from .ordering import sorted_keys

METADATA = "_metadata"  # the path component of an OrderedDict's metadata slot

_SEQUENCES: dict[type, str] = {list: "list", tuple: "tuple"}
_SETS: dict[type, str] = {set: "set", frozenset: "frozenset"}


@dataclass
class Container:
    """A container's children in canonical order.

    ``tag`` is the tree tag (``list``, ``tuple``, ``dict``, ``odict``, ``set``,
    ``frozenset``). ``children`` are the values of a list or tuple, the keys of
    a dict (canonical key order) or OrderedDict (its own order), or the members
    of a set (canonical order); ``mapping`` is the dict or OrderedDict itself
    (None for the others). :attr:`items` pairs a mapping's keys with their
    values. ``metadata`` is an OrderedDict's ``_metadata`` (None when absent).
    """

    tag: str
    children: list[Any]
    metadata: Any = None
    mapping: Any = None

    @property
    def is_mapping(self) -> bool:
        return self.tag in ("dict", "odict")

    @property
    def items(self) -> list[Any]:
        """The values of a list or tuple, the members of a set, or a mapping's ``(key, value)``
        pairs, in canonical order. (The encoder reads a mapping by its keys instead: a pair
        holding a tensor is one more object per tensor for the garbage collector.)"""
        m = self.mapping
        return self.children if m is None else [(k, m[k]) for k in self.children]


def container(value: Any, ordered: Any = sorted_keys) -> Container | None:
    """``value``'s children in canonical order, or None if it is not a container.

    Only the exact built-in types are containers (a dict subclass is not).
    ``ordered(keys)`` sorts dict keys and set members; the default raises
    ``UnorderableKey`` or ``ValueError`` for keys without a canonical order.
    """
    t = type(value)
    tag = _SEQUENCES.get(t)
    if tag is not None:
        return Container(tag, list(value))
    if t is dict:
        return Container("dict", ordered(value.keys()), mapping=value)
    if t is collections.OrderedDict:
        return Container("odict", list(value), getattr(value, METADATA, None), value)
    tag = _SETS.get(t)
    if tag is not None:
        return Container(tag, ordered(value))
    return None
