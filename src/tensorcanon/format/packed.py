"""Packed lists (format version 3, docs/FORMAT.md §6.13): the rules of the ``ints`` and ``records``
nodes, for the encoder, the decoder and every walker of a tree.

A list of many ints is stored as one byte string of fixed-width little-endian integers
(``["ints", dtype, data]``); a list of dicts whose keys are str and whose values are leaves (a
training log, a dataset's metadata rows) as rows of values under shared key lists
(``["records", schemas, row, ...]``). Neither holds a tensor or any other tagged node, so a
walker that only looks for tensors may skip them, and :func:`expand` gives any other walker the
``list`` node a version-2 writer would have written.

Which lists are packed is decided by the values alone (:func:`ints_node`, :func:`records_node`),
and a version-3 reader rejects a ``list`` node that the writer would have packed
(:func:`should_pack`), so each content still has one byte sequence.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import paths

SINCE = 3
"""The format version that added packed lists."""
MIN_INTS = 16
"""A list of at least this many ints (and nothing else) is an ``ints`` node."""
MIN_RECORDS = 2
"""A list of at least this many record dicts (and nothing else) is a ``records`` node."""

INT_MIN, INT_MAX = -(2**63), 2**64 - 1


def _code(size: int, signed: bool) -> str:
    """The :mod:`array` type code of a ``size``-byte integer on this platform."""
    for code in ("bhilq" if signed else "BHILQ"):
        if array.array(code).itemsize == size:
            return code
    raise AssertionError(f"internal error: no array type code for {size}-byte integers")  # pragma: no cover


# The element types of an ``ints`` node, in the order a writer tries them: the first that holds
# every item is the one written. (name, bytes, lowest, highest, array type code)
INT_DTYPES: tuple[tuple[str, int, int, int, str], ...] = tuple(
    (f"{'int' if signed else 'uint'}{8 * size}", size,
     -(2 ** (8 * size - 1)) if signed else 0,
     2 ** (8 * size - 1) - 1 if signed else 2 ** (8 * size) - 1,
     _code(size, signed))
    for size in (1, 2, 4, 8) for signed in (False, True))
_BY_NAME = {row[0]: row for row in INT_DTYPES}
_SWAP = sys.byteorder != "little"

LEAF_TYPES = frozenset({type(None), bool, int, float, str, bytes})
"""The value types of a record: leaves as msgpack holds them natively (a big int, an ext, is not one)."""
_STRS = frozenset({str})


def _shown(value: Any) -> str:
    """A value read from a file, as an error quotes it: shortened (paths.show), an ext as what it is."""
    if type(value).__name__ == "ExtType":  # (msgpack's; a big int in the file's tree)
        return "an ext value (a big int)"
    return paths.show(value)


def int_dtype(lowest: int, highest: int) -> tuple[str, int, int, int, str] | None:
    """The ``ints`` element type of items from ``lowest`` to ``highest``; None when none holds both."""
    for row in INT_DTYPES:
        if row[2] <= lowest and highest <= row[3]:
            return row
    return None


def ints_node(items: Sequence[Any], types: set | None = None) -> list | None:
    """``["ints", dtype, data]`` for a list's ``items`` when the format packs them (at least
    :data:`MIN_INTS` items, every one an ``int``, not a bool, and one element type holds them
    all); None otherwise. ``types`` is ``set(map(type, items))``, when the caller has it."""
    if len(items) < MIN_INTS:
        return None
    if (types if types is not None else set(map(type, items))) != {int}:
        return None
    row = int_dtype(min(items), max(items))
    if row is None:
        return None
    packed = array.array(row[4], items)
    if _SWAP:  # pragma: no cover - big-endian machines
        packed.byteswap()
    return ["ints", row[0], packed.tobytes()]


def ints_values(node: Sequence[Any], error: Callable[[str], Exception], build: bool = True) -> list[int] | None:
    """The items of an ``ints`` node, after every check of §6.13.1 (``error(message)`` is raised);
    None with ``build`` false (verify: the checks without the list)."""
    if len(node) != 3:
        raise error(f"'ints' takes 2 values, found {len(node) - 1}")
    name, data = node[1], node[2]
    row = _BY_NAME.get(name) if type(name) is str else None
    if row is None:
        raise error(f"'ints' element type {_shown(name)} is not one of {', '.join(_BY_NAME)}")
    if type(data) is not bytes or len(data) % row[1]:
        raise error(f"'ints' data must be a bin whose length is a multiple of {row[1]} ({name})")
    if len(data) < MIN_INTS * row[1]:
        raise error(f"'ints' holds {len(data) // row[1]} items; a list of fewer than {MIN_INTS} ints is a 'list' node")
    packed = array.array(row[4])
    packed.frombytes(data)
    if _SWAP:  # pragma: no cover - big-endian machines
        packed.byteswap()
    values: Any = packed.tolist() if build else packed
    first = int_dtype(min(values), max(values))
    if first is not row:
        raise error(f"'ints' items fit {first[0] if first else '?'}, which comes before {name} in the order "
                    "of docs/FORMAT.md §6.13.1: a writer uses the first element type that holds them all")
    return values if build else None


def records_node(items: Sequence[Any], orders: dict[tuple, tuple],
                 str_keys: Callable[[dict], Sequence[str] | None]) -> list | None:
    """``["records", schemas, row, ...]`` for a list's ``items`` when the format packs them (at least
    :data:`MIN_RECORDS` items, every one a ``dict`` of exactly that type whose keys are all valid
    str and whose values are all leaves of :data:`LEAF_TYPES`, ints within 64 bits and str valid
    UTF-8); None otherwise. ``str_keys(d)`` gives a dict's keys in canonical order, None when they
    are not all valid str; ``orders`` maps the keys of dicts seen before, in insertion order, to
    their canonical order (so that a log's entries cost no call each)."""
    if len(items) < MIN_RECORDS:
        return None
    index: dict[tuple, int] = {}
    rows: list[Any] = []
    for d in items:
        if type(d) is not dict:
            return None
        seen = tuple(d)
        keys: tuple | None = orders.get(seen)
        if keys is None or not set(map(type, seen)) <= _STRS:  # (a str subclass equals its str)
            found = str_keys(d)
            if found is None:
                return None
            keys = tuple(found)
        s = index.get(keys)
        if s is None:
            s = index[keys] = len(index)
        row: list[Any] = [s]
        append = row.append
        for k in keys:
            x = d[k]
            t = type(x)
            if t is float or t is bool or x is None or t is bytes or (t is str and x.isascii()) \
                    or (t is int and INT_MIN <= x <= INT_MAX):
                append(x)
            elif t is str and _utf8(x):
                append(x)
            else:
                return None
        rows.append(row)
    return ["records", [list(k) for k in index], *rows]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def records_values(node: Sequence[Any], error: Callable[[str], Exception], build: bool = True) -> list[dict] | None:
    """The dicts of a ``records`` node, after every check of §6.13.2 (``error(message)`` is raised);
    None with ``build`` false (verify: the checks without the dicts)."""
    if len(node) < 2 + MIN_RECORDS:
        raise error(f"'records' holds its key lists and at least {MIN_RECORDS} rows")
    schemas = node[1]
    if type(schemas) not in (tuple, list) or not schemas:
        raise error("'records' key lists must be a non-empty array")
    seen: set = set()
    for keys in schemas:
        if type(keys) not in (tuple, list) or not set(map(type, keys)) <= _STRS \
                or any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
            raise error("each 'records' key list is an array of str in strictly increasing UTF-8 order")
        keys = tuple(keys)
        if keys in seen:
            raise error("a 'records' key list repeats")
        seen.add(keys)
    out: list[dict] = []
    append = out.append
    used = 0  # key lists used so far: a row uses one of them, or introduces the next
    count = len(schemas)
    for i in range(2, len(node)):
        row = node[i]
        if type(row) not in (tuple, list) or not row:
            raise error(f"'records' row {i - 2} must be an array that starts with its key list's index")
        s = row[0]
        if type(s) is not int or not 0 <= s < count or s > used:
            raise error(f"'records' row {i - 2} names key list {_shown(s)}; rows use the key lists in order of "
                        f"first use, and there are {count}")
        if s == used:
            used += 1
        keys = schemas[s]
        if len(row) != len(keys) + 1:
            raise error(f"'records' row {i - 2} holds {len(row) - 1} values for {len(keys)} keys")
        values = row[1:]
        if not set(map(type, values)) <= LEAF_TYPES:
            raise error(f"'records' row {i - 2} holds a value that is not a leaf (nil, bool, int, float, str, bin)")
        if build:
            append(dict(zip(keys, values, strict=True)))
    if used != count:
        raise error(f"'records' lists {count} key lists but its rows use {used}")
    return out if build else None


def is_record_node(node: Any) -> bool:
    """Whether a tree node is a ``dict`` node that a version-3 writer would have put in a
    ``records`` row: str keys, leaf values (:data:`LEAF_TYPES`)."""
    return (type(node) in (tuple, list) and len(node) % 2 == 1 and node[0] == "dict"
            and set(map(type, node[1::2])) <= _STRS and set(map(type, node[2::2])) <= LEAF_TYPES)


def should_pack(items: Sequence[Any]) -> str | None:
    """The tag a version-3 writer gives a ``list`` node of these (written) ``items``: ``"ints"``,
    ``"records"``, or None when it writes a ``list`` node (a reader's check, §6.13)."""
    if len(items) >= MIN_INTS and type(items[0]) is int and set(map(type, items)) == {int} \
            and int_dtype(min(items), max(items)) is not None:
        return "ints"
    if len(items) >= MIN_RECORDS and all(map(is_record_node, items)):
        return "records"
    return None


def item_count(node: Sequence[Any]) -> int:
    """The number of items of a checked ``ints`` or ``records`` node (the length of its list)."""
    if node[0] == "ints":
        return len(node[2]) // _BY_NAME[node[1]][1]
    return len(node) - 2


def as_list(node: Any, cache: dict[int, Any]) -> Any:
    """:func:`expand` for a walker that follows paths and keys what it found by ``id``: each packed
    node is expanded once and kept in ``cache`` (by the id of the packed node, which the walked
    tree keeps alive), so no two expanded nodes share an id while the walk lasts."""
    if type(node) not in (tuple, list) or not node or (node[0] != "ints" and node[0] != "records"):
        return node
    found = cache.get(id(node))
    if found is None:
        found = cache[id(node)] = expand(node)
    return found


def pack_written(items: Sequence[Any]) -> list | None:
    """The ``ints`` or ``records`` node for the written ``items`` of a ``list`` node that a
    version-3 reader requires packed (:func:`should_pack`), None for any other. For an encoder that
    wrote items other than the values it was given (tensorcanon.dcp's takes PerRank values out of
    dicts), so that what it writes is what :func:`ints_node` and :func:`records_node` would give."""
    tag = should_pack(items)
    if tag == "ints":
        return ints_node(items)
    if tag != "records":
        return None
    index: dict[tuple, int] = {}
    rows: list[Any] = []
    for d in items:  # dict nodes: keys already in canonical (UTF-8) order, values leaves
        keys = tuple(d[1::2])
        rows.append([index.setdefault(keys, len(index)), *d[2::2]])
    return ["records", [list(k) for k in index], *rows]


def expand(node: Any) -> Any:
    """The ``list`` node a version-2 writer would have written for a checked ``ints`` or ``records``
    node (items as they are, each record a ``dict`` node in canonical key order); any other node as
    it is. For walkers of a checked tree that look into lists."""
    tag = node[0] if type(node) in (tuple, list) and node else None
    if tag == "ints":
        return ("list", *(ints_values(node, ValueError) or ()))
    if tag == "records":
        rows = []
        for d in records_values(node, ValueError) or ():
            flat: list[Any] = ["dict"]
            for k, v in d.items():
                flat += (k, v)
            rows.append(tuple(flat))
        return ("list", *rows)
    return node
