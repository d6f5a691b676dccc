"""The standard-library containers as node kinds: ``collections.Counter``, ``defaultdict`` and ``deque``.

docs/FORMAT.md §6.10 is the normative text. Each is written like the container it is built on:

- ``["counter", k0, v0, k1, v1, ...]``: a Counter's keys in canonical key order (§6.3), as a dict's;
- ``["defaultdict", factory, k0, v0, ...]``: ``factory`` names its ``default_factory``, one of the
  closed list :data:`FACTORIES` (nil for None), then the keys in canonical order;
- ``["deque", maxlen, item0, item1, ...]``: ``maxlen`` nil or an int, then the items in order.

Registered through :func:`tree.register_kind` when the package is imported (api.py imports this
module; exact types only: a subclass of one of these is
refused, or saved by a registration of its own, format/registry.py). A default factory is saved by
its name from the closed list only: the reader maps the name back through that list, never by
importing or looking up a name found in a file.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from . import paths, tree

COUNTER, DEFAULTDICT, DEQUE = "counter", "defaultdict", "deque"

#: The default factories a ``defaultdict`` may have, by the name the file records (docs/FORMAT.md
#: §6.10.2). ``None`` (no factory) is written as nil.
FACTORIES: dict[str, type] = {
    "int": int, "float": float, "complex": complex, "bool": bool, "str": str, "bytes": bytes,
    "list": list, "tuple": tuple, "dict": dict, "set": set, "frozenset": frozenset,
    "collections.OrderedDict": collections.OrderedDict, "collections.Counter": collections.Counter,
    "collections.defaultdict": collections.defaultdict, "collections.deque": collections.deque,
}
_FACTORY_NAMES: dict[Any, str] = {cls: name for name, cls in FACTORIES.items()}

MAX_MAXLEN = 2**63 - 1  # a deque's maxlen is a Py_ssize_t

_KINDS_SHOWN = {COUNTER: "Counter", DEFAULTDICT: "defaultdict"}


def factory_names() -> str:
    return ", ".join(["None", *FACTORIES])


# ------------------------------------------------------------------ encode


def _enc_counter(enc: tree.Encoder, v: collections.Counter, depth: int) -> list:
    extra = getattr(v, "__dict__", None)
    if extra:
        raise enc.unsupported(
            f"this collections.Counter has attributes set on it ({', '.join(sorted(map(repr, extra))[:5])}), "
            "which would be lost: only its keys and counts are saved; save the attributes next to it")
    return enc.encode_mapping(v, COUNTER, [COUNTER], depth)


def _enc_defaultdict(enc: tree.Encoder, v: collections.defaultdict, depth: int) -> list:
    factory = v.default_factory
    name: str | None = None
    if factory is not None:
        try:
            name = _FACTORY_NAMES.get(factory)
        except TypeError:  # an unhashable callable
            name = None
        if name is None:
            raise enc.unsupported(
                f"a collections.defaultdict whose default_factory is {_describe(factory)} cannot be saved: "
                "a file holds data, not code, and names only the factories of a closed list "
                f"({factory_names()}; docs/FORMAT.md §6.10.2); save dict(value) and rebuild the "
                "defaultdict after loading, or use one of these factories")
    return enc.encode_mapping(v, DEFAULTDICT, [DEFAULTDICT, name], depth)


def _describe(factory: Any) -> str:
    module = getattr(factory, "__module__", None)
    qual = getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None)
    if qual:
        return f"{module}.{qual}" if module and module != "builtins" else str(qual)
    return f"a {type(factory).__qualname__} object"


def _enc_deque(enc: tree.Encoder, v: collections.deque, depth: int) -> list:
    out: list[Any] = [DEQUE, v.maxlen]
    for i, item in enumerate(v):
        with enc.at(i):
            out.append(enc.encode(item, depth))
    return out


# ------------------------------------------------------------------ decode


def _dec_counter(dec: tree.Decoder, node: Sequence[Any], depth: int) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    return dec.decode_mapping(node, depth, out, "Counter")


def _dec_defaultdict(dec: tree.Decoder, node: Sequence[Any], depth: int) -> collections.defaultdict:
    if len(node) < 2:
        raise dec.error("'defaultdict' needs its default factory slot")
    name = node[1]
    if name is not None and (type(name) is not str or name not in FACTORIES):
        raise dec.error(f"{paths.show(name)} is not a default factory of docs/FORMAT.md §6.10.2 "
                        f"({factory_names()})")
    out: collections.defaultdict = collections.defaultdict(None if name is None else FACTORIES[name])
    return dec.decode_mapping(node, depth, out, "defaultdict")


def _dec_deque(dec: tree.Decoder, node: Sequence[Any], depth: int) -> collections.deque:
    if len(node) < 2:
        raise dec.error("'deque' needs its maxlen slot")
    maxlen = node[1]
    if maxlen is not None and (type(maxlen) is not int or not 0 <= maxlen <= MAX_MAXLEN):
        raise dec.error(f"a deque's maxlen is nil or an int in [0, 2^63 - 1], not {paths.show(maxlen)}")
    if maxlen is not None and len(node) - 2 > maxlen:
        raise dec.error(f"a deque of maxlen {maxlen} holds {len(node) - 2} items")
    return collections.deque(dec.decode_items(node, 2, depth), maxlen)


tree.register_kind(COUNTER, _dec_counter, {collections.Counter: _enc_counter})
tree.register_kind(DEFAULTDICT, _dec_defaultdict, {collections.defaultdict: _enc_defaultdict})
tree.register_kind(DEQUE, _dec_deque, {collections.deque: _enc_deque})
