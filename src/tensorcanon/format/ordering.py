"""The canonical total order of dict keys and set members.

Plain dicts, sets and frozensets are written in this order, so their bytes do
not depend on insertion order or on PYTHONHASHSEED. The order is meant to read
naturally: numbers numerically, strings by their UTF-8 bytes (the same as code
point order). Values of different kinds are ranked::

    None < bool < numbers (int and float, by value) < NaN < str < bytes
         < tuple < frozenset < torch.dtype < registered Enum members

numpy bools, integers, ``str_`` and ``bytes_`` scalars rank with Python's bools,
numbers, strs and bytes (Python holds ``np.int64(1)`` and ``1`` as one key).
Tuples compare element by element (a prefix sorts first); frozensets compare
as the tuple of their members in this order. NaN keys rank after all numbers,
ordered by their bit pattern. dtypes compare by name, Enum members by their
registration name, then by their value. Any other key type is not supported.
docs/FORMAT.md, "Canonical key order", is the normative text.
"""

from __future__ import annotations

import enum
import itertools
import math
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import registry

(_RANK_NONE, _RANK_BOOL, _RANK_NUMBER, _RANK_NAN, _RANK_STR, _RANK_BYTES, _RANK_TUPLE, _RANK_FROZENSET,
 _RANK_DTYPE, _RANK_ENUM) = range(10)

KEY_TYPES = ("None, bool, int, float, str, bytes, numpy bool, integer, str_ and bytes_ scalars, torch.dtype, "
             "members of registered Enums, and tuples or frozensets of these")

MAX_SAME_HASH = 64
"""How many keys of one dict or OrderedDict, or members of one set or frozenset, other than str and
bytes, may share one Python hash (docs/FORMAT.md §6.3). Python builds a dict or set in time quadratic
in the number of keys with equal hashes, and the hash of an int (``n % (2**61 - 1)``), a float, and
so of tuples and frozensets of them, is not randomized: without this bound, a small file of such
keys would take minutes to load. str and bytes hash with a key random per process."""


class UnorderableKey(TypeError):
    """Raised (internally) for a key type outside the canonical order."""

    def __init__(self, key: Any) -> None:
        self.key = key
        super().__init__(type(key).__name__)


def sort_key(key: Any) -> tuple[Any, ...]:
    """A Python value whose ``<`` is the canonical order of ``key``."""
    t = type(key)
    if t is str:
        return (_RANK_STR, key.encode("utf-8"))
    if t is int:
        return (_RANK_NUMBER, key)
    if t is float:
        if math.isnan(key):
            return (_RANK_NAN, struct.pack(">d", key))
        return (_RANK_NUMBER, key)
    if key is None:
        return (_RANK_NONE,)
    if t is bool:
        return (_RANK_BOOL, key)
    if t is bytes:
        return (_RANK_BYTES, key)
    if t is tuple:
        return (_RANK_TUPLE, tuple(sort_key(k) for k in key))
    if t is frozenset:
        return (_RANK_FROZENSET, tuple(sorted(sort_key(k) for k in key)))
    return _other_key(key, t)


def _other_key(key: Any, t: type) -> tuple[Any, ...]:
    """The sort key of a key of the kinds added in issue 30 (docs/FORMAT.md §6.3): numpy scalars,
    torch dtypes, registered Enum members, and a verifying reader's :class:`Unbuilt` stand-ins."""
    if t is Unbuilt:
        stand_in: Unbuilt = key
        return stand_in.sort_key()
    np = sys.modules.get("numpy")  # (a numpy scalar is only made once numpy is imported)
    if np is not None and issubclass(t, np.generic):
        if t is np.bool_:
            return (_RANK_BOOL, bool(key))
        if issubclass(t, np.integer):
            return (_RANK_NUMBER, int(key))
        if t is np.str_:  # (str() would drop trailing NULs, which the value holds)
            return (_RANK_STR, str.__add__(key, "").encode("utf-8"))
        if t is np.bytes_:
            return (_RANK_BYTES, bytes(key))
        raise UnorderableKey(key)
    th = sys.modules.get("torch")
    if th is not None and t is th.dtype:
        return (_RANK_DTYPE, str(key).removeprefix("torch.").encode("utf-8"))
    if isinstance(key, enum.Enum):
        reg = registry.by_type(t)
        if reg is not None and reg.automatic and reg.cls is t:
            return (_RANK_ENUM, reg.name.encode("utf-8"), sort_key(key.value))
    raise UnorderableKey(key)


@dataclass(frozen=True)
class Unbuilt:
    """What a verifying reader, which builds no values, decodes a ``dtype`` node or an ``obj`` node
    to: it sorts (as a key) where the value would, and is equal to another only for the same node."""

    tag: str        # "dtype" or "obj"
    name: str       # the dtype name, or the registration name
    state: Any = None  # (obj) the state, as decoded

    def sort_key(self) -> tuple[Any, ...]:
        if self.tag == "dtype":
            return (_RANK_DTYPE, self.name.encode("utf-8"))
        return (_RANK_ENUM, self.name.encode("utf-8"), sort_key(self.state))


def crowded(keys: list[Any]) -> Any:
    """A key (or member) of ``keys`` whose Python hash more than :data:`MAX_SAME_HASH` of them share,
    str, bytes and None not counted; :data:`NO_KEY` when there is none. (None's hash is a constant
    from Python 3.12 and its object's address before: counting it would make the verdict depend on
    the Python version, and it is one key at most.)

    Linear time: the hashes are counted in a set first (in C: with fewer than MAX_SAME_HASH repeats
    in all, no hash can be shared MAX_SAME_HASH + 1 times), then, only if that is not enough, one
    by one. Distinct hash values rarely share a hash themselves (ints below 2**61 - 1 hash to
    themselves; at most 4 of the 64-bit range to each value).
    """
    if len(keys) <= MAX_SAME_HASH or len(keys) - len(set(map(hash, keys))) < MAX_SAME_HASH:
        return NO_KEY
    counts: dict[int, int] = {}
    get = counts.get
    for k in keys:
        t = type(k)
        if t is str or t is bytes or k is None:
            continue
        h = hash(k)
        n = get(h, 0) + 1
        if n > MAX_SAME_HASH:
            return k
        counts[h] = n
    return NO_KEY


NO_KEY = object()
"""What :func:`crowded` returns when no hash is shared by too many keys (None is a key)."""


def sorted_keys(keys: Iterable[Any]) -> list[Any]:
    """Keys in canonical order. Raises UnorderableKey or ValueError on ties."""
    keys = list(keys)
    if all(type(k) is str for k in keys):
        # Code point order equals UTF-8 byte order for encodable strings.
        out = sorted(keys)
        return out
    decorated = sorted(((sort_key(k), i) for i, k in enumerate(keys)), key=lambda p: p[0])
    for a, b in itertools.pairwise(decorated):
        if a[0] == b[0]:
            raise ValueError(f"keys {keys[a[1]]!r} and {keys[b[1]]!r} have the same canonical position")
    return [keys[i] for _, i in decorated]
