"""Tensor names and key text: the grammar of docs/FORMAT.md §3, defined by the spec alone.

A tensor's safetensors name is built from the path at which it is first found:
str components verbatim, every other key rendered as text by :func:`key_text`.
The rendering depends on nothing but the key: not on the Python version, its
Unicode database or its int-to-str limit, so another language can reproduce it
byte for byte (``repr()`` would not do: which characters it escapes follows the
running Python's Unicode tables).

=============  ======================================================  ==================
key            text                                                    example
=============  ======================================================  ==================
str (nested)   quoted (see :func:`quoted`): ``'a'``; ``"it's"``        ``('a', 1)``
int            decimal in [-2**63, 2**64-1], else ``0x``/``-0x`` hex    ``7``, ``0x1000…``
float          shortest round-trip decimal; NaN with its bits           ``1.5``, ``nan:7ff8…``
None, bool     ``None``, ``True``, ``False``
bytes          ``b'…'``: printable ASCII kept, the rest ``\\xNN``       ``b'k\\x00'``
tuple          ``(a, b)``, ``(a,)``, ``()``                             ``(1, 'a')``
frozenset      members in canonical key order                          ``frozenset({1, 'a'})``
numpy scalar   the text of the bool, int, str or bytes it equals         ``3``
torch.dtype    ``torch.`` and its name                                   ``torch.float32``
Enum member    registration name, then its value's text in parentheses   ``pkg.Split('train')``
=============  ======================================================  ==================

Version-1 files derived names with ``repr()``; :func:`tensor_names` applies that
rule to them (``version=1``), see docs/FORMAT.md §3.5.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Callable
from typing import Any

from . import registry
from .errors import FormatError
from .ordering import Unbuilt, sorted_keys

INT_MIN, INT_MAX = -(2**63), 2**64 - 1
RESERVED = "__metadata__"
EMPTY = "_"
# Python's int-to-str limit (4,300 digits, about 14,284 bits): a version-1 writer could not name
# a tensor below a longer int, so a version-1 file holding one is refused before repr() is tried.
_V1_MAX_BITS = 14_300


def int_text(n: int) -> str:
    """Decimal for ints that msgpack stores natively, ``0x``/``-0x`` lowercase hex beyond.

    Hex is linear in the size of the int (decimal conversion is quadratic in
    CPython and refused past 4,300 digits), so names and error paths never
    fail or stall on a big int from a file.
    """
    if INT_MIN <= n <= INT_MAX:
        return str(n)
    return ("-0x" if n < 0 else "0x") + format(-n if n < 0 else n, "x")


def float_text(x: float) -> str:
    """Shortest round-trip decimal in Python's layout (``1.5``, ``1e+16``, ``-0.0``, ``inf``);
    NaN as ``nan:`` and its 16 hex digits of IEEE 754 bits, so payloads stay apart."""
    if x != x:
        return "nan:" + struct.pack(">d", x).hex()
    # CPython's repr of a float is, on every IEEE 754 platform and since Python 3.1, the
    # shortest round-trip digits laid out by the rule of docs/FORMAT.md §3.2 (tested against
    # an independent implementation of that rule in tests/test_names.py).
    return repr(x)


def _escaped(text: str | bytes, quote: str, code: Callable[[Any], int]) -> str:
    out = [quote]
    for ch in text:
        o = code(ch)
        if o == 0x5C:
            out.append("\\\\")
        elif o == ord(quote):
            out.append("\\" + quote)
        elif o == 0x09:
            out.append("\\t")
        elif o == 0x0A:
            out.append("\\n")
        elif o == 0x0D:
            out.append("\\r")
        elif o < 0x20 or 0x7F <= o <= 0x9F or (o > 0x7F and type(ch) is int):
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch if type(ch) is str else chr(o))
    out.append(quote)
    return "".join(out)


def _quote_for(has_single: bool, has_double: bool) -> str:
    return '"' if has_single and not has_double else "'"


def quoted(s: str) -> str:
    """A str inside a tuple or frozenset key: quoted, with only fixed characters escaped.

    The quote is ``"`` when the text holds ``'`` and no ``"``, else ``'``. Escaped:
    backslash, the quote, ``\\t \\n \\r``, and every other code point of U+0000-U+001F
    and U+007F-U+009F (the C0 and C1 controls, a set Unicode never changes) as
    ``\\xNN``; every other character is written as itself.
    """
    return _escaped(s, _quote_for("'" in s, '"' in s), ord)


def bytes_text(b: bytes) -> str:
    """``b'...'``: printable ASCII (0x20-0x7e) as itself, except backslash and the quote;
    ``\\t \\n \\r``; every other byte as ``\\xNN`` (lowercase hex). Quote as for str."""
    return "b" + _escaped(b, _quote_for(0x27 in b, 0x22 in b), int)


def key_text(key: Any) -> str:
    """The text of one non-str path component (a str component is itself)."""
    if type(key) is int:
        return int_text(key)
    if type(key) is str:
        return key
    plain = _plain(key)
    if type(plain) is str:  # a numpy str_: written as the str it holds
        return plain
    return _value_text(key)


def _plain(key: Any) -> Any:
    """A numpy bool, integer, str_ or bytes_ key as the Python value it equals (its text is that
    value's, docs/FORMAT.md §3.2); any other key as it is."""
    np = sys.modules.get("numpy")
    t = type(key)
    if np is None or not issubclass(t, np.generic):
        return key
    if t is np.bool_:
        return bool(key)
    if issubclass(t, np.integer):
        return int(key)
    if t is np.str_:
        return str.__add__(key, "")  # (str() would drop trailing NULs, which the value holds)
    if t is np.bytes_:
        return bytes(key)
    return key


def _compound(key: Any, leaf: Callable[[Any], str]) -> str:
    """A key's text with tuples and frozensets (members in canonical order) written the same way
    in every version; ``leaf`` writes every other key."""
    t = type(key)
    if t is tuple:
        inner = ", ".join(_compound(k, leaf) for k in key)
        return f"({inner},)" if len(key) == 1 else f"({inner})"
    if t is frozenset:
        if not key:
            return "frozenset()"
        return "frozenset({" + ", ".join(_compound(k, leaf) for k in sorted_keys(key)) + "})"
    return leaf(key)


def _value_text(key: Any) -> str:
    return _compound(key, _leaf_text)


def _leaf_text(key: Any) -> str:
    t = type(key)
    if t is str:
        return quoted(key)
    if t is int:
        return int_text(key)
    if t is float:
        return float_text(key)
    if key is None or t is bool:
        return repr(key)  # "None", "True", "False"
    if t is bytes:
        return bytes_text(key)
    return _other_text(key)


def _other_text(key: Any) -> str:
    """The text of the key kinds added in issue 30 (docs/FORMAT.md §3.2): numpy scalars as the
    Python value they equal, ``torch.<name>`` for a dtype, ``<registration name>(<value>)`` for a
    registered Enum member (what a verifying reader's :class:`~.ordering.Unbuilt` stands for too)."""
    plain = _plain(key)
    if plain is not key:
        return _leaf_text(plain)
    t = type(key)
    if t is Unbuilt:
        return f"torch.{key.name}" if key.tag == "dtype" else f"{key.name}({_value_text(key.state)})"
    th = sys.modules.get("torch")
    if th is not None and t is th.dtype:
        return str(key)
    if isinstance(key, enum.Enum):
        reg = registry.by_type(t)
        if reg is not None:
            return f"{reg.name}({_value_text(key.value)})"
    raise TypeError(f"{t.__name__} is not a key type")


def _v1_text(key: Any) -> str:
    """Version 1's rendering: ``repr()``, frozenset members in canonical order."""
    return _compound(key, _v1_leaf)


def _v1_leaf(key: Any) -> str:
    if type(key) is int and key.bit_length() > _V1_MAX_BITS:
        raise FormatError(
            f"manifest: a version-1 file names a tensor below an int key of {key.bit_length()} bits; "
            "the version-1 writer could not name such a tensor (Python's int-to-str limit), so the "
            "file was not written by it")
    try:
        return repr(key)
    except ValueError:  # more than 4,300 digits
        raise FormatError(
            "manifest: a version-1 file names a tensor below an int key of more than 4,300 digits, "
            "which the version-1 writer could not do") from None


def base_name(path: tuple[Any, ...], version: int = 2) -> str:
    """The name of a tensor first found at ``path`` before de-duplication (§3.3)."""
    if len(path) == 1 and type(path[0]) is str:  # a flat dict's key, in either version
        return path[0] or EMPTY
    render = key_text if version >= 2 else (lambda p: p if type(p) is str else _v1_text(p))
    return ".".join(render(p) for p in path) or EMPTY


def tensor_names(first_paths: list[tuple[Any, ...]], version: int = 2) -> list[str]:
    """The canonical safetensors names of tensors first found at ``first_paths`` (table order):
    each path's base name, with ``~1``, ``~2``... appended to make it unique (§3.4).

    Linear time, however many paths share a base name (keys ``1`` and ``"1"`` at each of 14
    levels give 16,384 paths of one base name): the search for a free ``base~n`` resumes where
    the last search for the same base stopped. That gives the same names as starting from ``~1``
    every time, since every name it skips was taken then and the used set only grows.
    """
    used: set[str] = {RESERVED}
    last: dict[str, int] = {}  # base name -> the suffix its last search ended at (0: the base itself)
    out = []
    for path in first_paths:
        if len(path) == 1 and type(path[0]) is str and path[0]:  # base_name, inline: a flat dict's key
            base = path[0]
        else:
            base = base_name(path, version)
        if base not in used:  # (then no search for it has run: a name searched for was taken)
            used.add(base)
            out.append(base)
            continue
        n = last.get(base, 0) + 1
        name = f"{base}~{n}"
        while name in used:
            n += 1
            name = f"{base}~{n}"
        last[base] = n
        used.add(name)
        out.append(name)
    return out


__all__ = ["int_text", "float_text", "quoted", "bytes_text", "key_text", "base_name", "tensor_names"]
