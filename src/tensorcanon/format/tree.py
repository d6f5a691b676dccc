"""The object tree: Python values to canonical msgpack-ready nodes and back.

A node is a msgpack-native leaf (nil, bool, int, float64, str, bin), the
big-int ext type, or a *tagged array* ``[tag, ...]`` whose first element names
what it holds (``"dict"``, ``"tuple"``, ``"tensor"``...). Each tag is a *node
kind*: the tag, its decoder, and the Python types it encodes, each with its
encoder. Every kind, this module's own and the random-state kinds of
training/rng.py alike, is registered once through :func:`register_kind`; the
encoder looks its encoder up by exact type and the decoder its decoder by tag in
tables that only this module writes (read them through :func:`node_kinds` and
:func:`kind_of`). docs/FORMAT.md, "The object tree", is the normative
description.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import math
import operator
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from . import codecs, container, devices, dtypes, ecosystem, optional, packed, paths, registry, tensorbytes, walk
from .errors import FormatError, LimitError, UnsupportedTypeError, UsageError
from .limits import DEFAULT
from .names import tensor_names  # the name rule lives in names.py (layout imports it from here too)
from .ordering import KEY_TYPES, MAX_SAME_HASH, NO_KEY, Unbuilt, UnorderableKey, crowded, sort_key, sorted_keys

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())  # imported on first use: reading a file needs no torch
    np = optional.numpy_module(globals())  # (nor numpy, unless it holds numpy values)

EXT_BIGINT = 1
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

ARRAYS = (list, tuple)
"""The types a tagged array has: a list as the encoder builds it, a tuple as a file's manifest is
read (manifest.unpack: immutable, and a tuple of atomic values is untracked by the garbage
collector). Both are a msgpack array; code that reads a tree accepts either."""


def tag_of(node: Any) -> str | None:
    """The tag of a tagged array (``"dict"``, ``"tensor"``...), None for anything else."""
    return node[0] if type(node) in ARRAYS and node and type(node[0]) is str else None


_FIRST_ITEM = {"dict": 1, "odict": 2, "counter": 1, "defaultdict": 2}  # (stdkinds.py: the last two)


def first_item(tag: str) -> int:
    """Where the key/value pairs of a mapping node start: ``["dict", k1, v1, ...]`` at 1, an
    ``odict``'s after its metadata slot, ``["odict", metadata, k1, v1, ...]``, at 2. The one place
    that knows it; every walker of a tree asks here."""
    return _FIRST_ITEM[tag]


def items(node: Sequence[Any]) -> Iterator[tuple[Any, Any]]:
    """The ``(key node, value node)`` pairs of a ``dict`` or ``odict`` node, in order (a trailing
    odd element, which no valid tree has, is left out)."""
    start = _FIRST_ITEM[node[0]]
    return zip(itertools.islice(node, start, None, 2), itertools.islice(node, start + 1, None, 2), strict=False)

_OrderedDict = collections.OrderedDict
_Sized = TypeVar("_Sized", bound=Sized)


def bigint_bytes(n: int) -> bytes:
    """Minimal two's-complement big-endian bytes of ``n``."""
    length = (~n if n < 0 else n).bit_length() // 8 + 1
    return n.to_bytes(length, "big", signed=True)


@dataclass
class TensorSource:
    """A tensor (or ndarray) found while encoding, before its bytes are written."""

    value: Any                   # the torch.Tensor or numpy.ndarray as given
    kind: str                    # "tensor" | "parameter" | "ndarray"
    dtype: dtypes.DType
    shape: tuple[int, ...]
    device: str
    requires_grad: bool
    path: tuple                  # first path at which it was found
    name: str = ""
    digest: bytes = b""
    memory_format: str | None = None  # "channels_last" / "channels_last_3d": layout, not content

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------------- encode


class Encoder:
    """Turns one object into a tree of nodes and a table of tensors."""

    def __init__(self, max_depth: int, version: int | None = None,
                 max_string_bytes: int = DEFAULT.max_string_array_bytes) -> None:
        optional.ready()  # if the program imported torch, its types now have their node kinds
        self.max_depth = max_depth
        self.strings = _StringBudget(max_string_bytes, saving=True)
        # (a subclass that rewrites written lists, tensorcanon.dcp's: only then is the hook called)
        self._rewrites_lists = type(self).written_list is not Encoder.written_list
        # lists are packed (docs/FORMAT.md §6.13) from format version 3 on; an older version only
        # for what that version recorded (the fingerprints of old lockfiles)
        self.packs = version is None or version >= packed.SINCE
        self.tensors: list[TensorSource] = []
        self._by_id: dict[int, int] = {}
        self._by_view: dict[tuple, int] = {}
        self._keep: list = []  # every object whose id() is in _by_id stays alive until we finish
        self._path: list = []
        self._key_orders: dict[tuple, tuple] = {}  # (_str_keys) a small dict's keys -> in canonical order
        # The containers whose encoder enc_sequence and enc_dict call for a child directly, without
        # encode(): what encode() would call, when a subclass (tensorcanon.dcp's) does not replace
        # encode() to look at every value first.
        self._nested: dict[type, EncodeFn] = (
            {t: _ENCODERS[t] for t in _DIRECT} if type(self).encode is Encoder.encode else {})

    # -- helpers
    def path(self) -> str:
        """:meth:`current_path` as text (docs/FORMAT.md §3.1), as errors name it."""
        return paths.join(tuple(self._path))

    @contextlib.contextmanager
    def at(self, step: Any) -> Iterator[None]:
        """Encode what the ``with`` block encodes one step below the current path, at ``step`` (a
        key or an index): tensors found there, and errors, are named by that path."""
        self._path.append(step)
        try:
            yield
        finally:
            self._path.pop()

    def unsupported(self, message: str) -> UnsupportedTypeError:
        return UnsupportedTypeError(f"{message} (at {self.path()})", path=self.path())

    def check_depth(self, depth: int) -> None:
        """Refuse a tagged array at ``depth`` (the root is at 0) unless ``depth < max_depth``.

        :meth:`encode` checks every node it dispatches; an encoder that builds nested tagged
        arrays itself (the random-state tags) calls this for each level it adds.
        """
        if depth >= self.max_depth:
            where = self.path()
            raise LimitError(
                f"the object is nested deeper than max_depth={self.max_depth} at {where} (a reference "
                "cycle?)", limit="max_depth", path=where, saving=True)

    def encode(self, value: Any, depth: int = 0) -> Any:
        t = type(value)
        if t is str:
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise self.unsupported("str holds a lone surrogate and is not valid UTF-8") from None
            return value
        if t is float or t is bool or value is None or t is bytes:
            return value
        if t is int:
            if INT_MIN <= value <= INT_MAX:
                return value
            return msgpack.ExtType(EXT_BIGINT, bigint_bytes(value))
        self.check_depth(depth)
        enc = _ENCODERS.get(t)
        if enc is not None:
            return enc(self, value, depth + 1)
        return self._fallback(value, depth + 1)

    def _ordered(self, keys: Iterable[Any]) -> list:
        try:
            return sorted_keys(keys)
        except UnorderableKey as e:
            t = type(e.key)
            shown = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
            enum_hint = (f" (an Enum member is a key once its class is registered: tensorcanon.register("
                         f"{t.__qualname__}))" if isinstance(e.key, enum.Enum) else "")
            raise self.unsupported(
                f"a key or set member of type {shown} has no canonical order; "
                f"keys and set members must be {KEY_TYPES}{enum_hint}"
            ) from None
        except UnicodeEncodeError:  # (a ValueError too) sort_key encodes each str key as UTF-8
            raise self.unsupported(
                "a key or set member holds a str with a lone surrogate, which is not valid UTF-8 "
                "(docs/FORMAT.md §6.1)") from None
        except ValueError as e:
            raise self.unsupported(str(e)) from None

    def _not_crowded(self, ordered: list, tag: str) -> None:
        """Refuse keys (set members) in canonical order of which too many share a Python hash."""
        if not ordered or (type(ordered[0]) in _TEXT and type(ordered[-1]) in _TEXT):
            return  # only str and bytes (they sort last but for tuples and frozensets): not counted
        k = crowded(ordered)
        if k is not NO_KEY:
            raise self.unsupported(
                f"more than {MAX_SAME_HASH} {_KEYS[tag]} of this {_KIND[tag]} share one Python hash "
                f"(hash({paths.show(k)}) = {hash(k)}), which loading would need time quadratic in their "
                "number to rebuild, so the format does not allow it (docs/FORMAT.md §6.3); use str keys, or "
                "save a list of (key, value) pairs")

    def enc_sequence(self, v: list | tuple, depth: int) -> list:
        """A list or tuple: ``[tag, item, ...]``. Leaves are written here as :meth:`encode` writes
        them (a long run of them checked in bulk, in C); every other item goes through
        :meth:`encode`, under its index."""
        is_list = type(v) is list
        if isinstance(v, list) and self.packs and len(v) >= packed.MIN_RECORDS:  # one the format packs (§6.13)?
            first = type(v[0])
            if is_list and (first is dict or (first is int and len(v) >= packed.MIN_INTS)):
                node = self.packed_list(v, depth)
                if node is not None:
                    return node
        out: list[Any] = ["list" if is_list else "tuple"]
        if len(v) >= _BULK and _as_they_are(v, set(map(type, v))):
            out.extend(v)
            return out
        append, path = out.append, self._path
        nested = self._nested if depth < self.max_depth else None  # (else encode raises, naming the path)
        for i, item in enumerate(v):
            t = type(item)
            if t in _PLAIN or (t is str and item.isascii()) or (t is int and INT_MIN <= item <= INT_MAX):
                append(item)
            else:
                path.append(i)
                enc = nested.get(t) if nested is not None else None
                append(enc(self, item, depth + 1) if enc is not None else self.encode(item, depth))
                path.pop()
        return self.written_list(out) if is_list and self._rewrites_lists else out

    def written_list(self, out: list) -> list:
        """The node of a list written item by item, ``out`` (a ``list`` node): :meth:`packed_list`
        has decided on the values, so here it is ``out``. An encoder whose items are written from
        other values than the list holds (tensorcanon.dcp's takes PerRank values out of dicts)
        returns :func:`packed.pack_written` instead, the node a version-3 reader requires."""
        return out

    def packed_list(self, v: list, depth: int) -> list | None:
        """The ``ints`` or ``records`` node of the list ``v`` (docs/FORMAT.md §6.13), None when the
        format writes it as a ``list`` node. Records are dicts one level down: at ``max_depth`` the
        list is left to the general path, which refuses it naming the path."""
        first = type(v[0])
        if first is int:
            return packed.ints_node(v)
        if first is dict and depth < self.max_depth:
            return packed.records_node(v, self._key_orders, self._record_keys)
        return None

    def _record_keys(self, d: dict) -> Sequence[str] | None:
        return _str_keys(d, self._key_orders)

    def enc_dict(self, v: dict, depth: int) -> list:
        """A dict: ``["dict", k1, v1, ...]`` in canonical key order. A dict whose keys are all
        valid str (the common case) is sorted as it is (code point order is the canonical order of
        such strs: ordering.py) and its leaf values written here, in bulk when there are many; any
        other dict goes through :meth:`enc_container`."""
        keys: Sequence[Any] | None  # (str keys, or int keys: _int_keys)
        if len(v) <= _SMALL_DICT:  # _str_keys, inline: the key order of a small dict is remembered
            seen = tuple(v)
            keys = self._key_orders.get(seen)
            if keys is None or not set(map(type, seen)) <= _STRS:  # (a str subclass equals its str)
                keys = _str_keys(v, self._key_orders)
        else:
            keys = _str_keys(v, self._key_orders)
        if keys is None:
            keys = _int_keys(v)
            if keys is None:
                return self.enc_container(v, depth)
            self._not_crowded(keys, "dict")  # (ints hash to themselves: a crafted dict could crowd)
        if len(keys) >= _BULK:
            values = list(map(v.__getitem__, keys))
            if _as_they_are(values, set(map(type, values))):
                out: list[Any] = [None] * (2 * len(keys) + 1)
                out[0] = "dict"
                out[1::2] = keys
                out[2::2] = values
                return out
        out = ["dict"]
        append, path = out.append, self._path
        nested = self._nested if depth < self.max_depth else None  # (else encode raises, naming the path)
        for k in keys:
            item = v[k]
            append(k)
            t = type(item)
            if t in _PLAIN or (t is str and item.isascii()) or (t is int and INT_MIN <= item <= INT_MAX):
                append(item)
            else:
                path.append(k)
                enc = nested.get(t) if nested is not None else None
                append(enc(self, item, depth + 1) if enc is not None else self.encode(item, depth))
                path.pop()
        return out

    def enc_container(self, v: Any, depth: int) -> list:
        """list, tuple, dict, OrderedDict, set, frozenset: children in the order walk.container gives
        (the general path: :meth:`enc_sequence` and :meth:`enc_dict` take the common cases first)."""
        c = walk.container(v, self._ordered)
        assert c is not None  # the container kinds send only the container types here
        path = self._path
        out: list[Any] = [c.tag]
        if c.tag in ("list", "tuple"):
            if type(v) is list and len(v) >= packed.MIN_RECORDS and self.packs:
                node = self.packed_list(v, depth)
                if node is not None:
                    return node
            for i, item in enumerate(c.children):
                path.append(i)
                out.append(self.encode(item, depth))
                path.pop()
            return self.written_list(out) if c.tag == "list" else out
        if c.tag in ("set", "frozenset"):
            self._not_crowded(c.children, c.tag)
            out.extend(self.encode(m, depth) for m in c.children)
            return out
        if c.tag == "odict":  # keys keep their order, but must be key values, tie with none, not crowd
            self._not_crowded(self._ordered([k for k in c.children if type(k) is not str]), c.tag)
            path.append(walk.METADATA)
            out.append(None if c.metadata is None else self.encode(c.metadata, depth))
            path.pop()
        elif c.children and (type(c.children[0]) is not str or type(c.children[-1]) is not str):
            self._not_crowded(c.children, c.tag)  # (str keys, the common case, are not counted)
        mapping = c.mapping
        for k in c.children:
            out.append(self.encode(k, depth))
            path.append(k)
            out.append(self.encode(mapping[k], depth))
            path.pop()
        return out

    def encode_mapping(self, mapping: Mapping[Any, Any], tag: str, out: list, depth: int) -> list:
        """Append the keys of ``mapping`` in canonical order (docs/FORMAT.md §6.3), each followed by
        its value, to ``out`` (a node being built with ``tag``, a mapping tag of ``first_item``),
        as a dict's are written: keys without a canonical order, and too many sharing a hash, are
        refused. For the node kinds of other modules (format/stdkinds.py)."""
        keys = self._ordered(mapping.keys())
        if keys and (type(keys[0]) is not str or type(keys[-1]) is not str):
            self._not_crowded(keys, tag)
        path = self._path
        for k in keys:
            out.append(self.encode(k, depth))
            path.append(k)
            out.append(self.encode(mapping[k], depth))
            path.pop()
        return out

    # -- scalars and torch values
    def enc_complex(self, v: complex, depth: int) -> list:
        return ["complex", v.real, v.imag]

    def enc_size(self, v: torch.Size, depth: int) -> list:
        return ["size", *v]

    def enc_dtype(self, v: torch.dtype, depth: int) -> list:
        name = str(v).removeprefix("torch.")
        if name not in dtypes.TORCH_DTYPES_BY_NAME:
            raise self.unsupported(f"torch.{name} is not a dtype the format names (docs/FORMAT.md §4.4)")
        return ["dtype", name]

    def enc_device(self, v: torch.device, depth: int) -> list:
        text = str(v)
        if not devices.is_canonical(text):
            raise self.unsupported(
                f"torch.device({text!r}) cannot be saved: device types are {', '.join(devices.DEVICE_TYPES)} "
                f"with an index of at most {devices.MAX_INDEX} (docs/FORMAT.md §4.3)")
        return ["device", text]

    def enc_numpy_scalar(self, v: np.generic, depth: int) -> list:
        row = dtypes.BY_NUMPY.get(v.dtype.newbyteorder("<"))
        if row is None:
            raise self.unsupported(f"numpy scalar of dtype {v.dtype} is not supported")
        return ["np.scalar", row.name, np.asarray(v).astype(row.numpy).tobytes()]

    # -- tensors
    def add_tensor(self, value: Any, *, kind: str, dtype: dtypes.DType, shape: tuple[int, ...],
                   requires_grad: bool = False, device: str = "cpu", view_key: Any = None) -> list:
        """Record a tensor described by its metadata alone and return its ``["tensor", i]`` node.

        The hook for subclasses that encode tensor types this module does not know:
        tensorcanon.dcp plans the unsharded state of a DTensor from its global dtype
        and shape, without its data. The same object (by ``id``), or one with an equal
        ``view_key`` (not None), gets the index it got first, as tied tensors do.
        """
        idx = self._by_id.get(id(value))
        if idx is not None:
            return ["tensor", idx]
        return self._add_tensor(value, view_key, kind=kind, dtype=dtype, shape=tuple(shape),
                                device=device, requires_grad=requires_grad)

    def current_path(self) -> tuple:
        """The path (keys and indices from the root) of the value being encoded."""
        return tuple(self._path)

    def _add_tensor(self, value: Any, view_key: Any, **fields: Any) -> list:
        if view_key is not None:
            idx = self._by_view.get(view_key)
            if idx is not None:
                # ``value`` may be a temporary (a registered encode that returns fresh views):
                # keep it alive, or its id() could be reused by an unrelated tensor.
                self._keep.append(value)
                self._by_id[id(value)] = idx
                return ["tensor", idx]
        problem = container.size_problem(fields["shape"], fields["dtype"].itemsize)
        if problem is not None:  # (torch makes some: (2**60, 11, 0) of float32; no reader may take them)
            raise self.unsupported(f"the tensor {problem}")
        idx = len(self.tensors)
        self.tensors.append(TensorSource(value=value, path=tuple(self._path), **fields))
        self._by_id[id(value)] = idx
        if view_key is not None:
            self._by_view[view_key] = idx
        return ["tensor", idx]

    def enc_tensor(self, v: torch.Tensor, depth: int) -> list:
        idx = self._by_id.get(id(v))
        if idx is not None:
            return ["tensor", idx]
        if tensorbytes.unsaveable(v) is not None or tensorbytes.has_attributes(v):  # another layout, nested, meta
            return _TENSOR_HOOK[0](self, v, depth)
        return self.plain_tensor(v)

    def plain_tensor(self, v: torch.Tensor, merge: bool = True) -> list:
        """The ``["tensor", i]`` node of a dense tensor or Parameter that the table holds as it is;
        with ``merge`` false, it never shares a row with another view of its memory (§6.5)."""
        row = dtypes.BY_TORCH.get(v.dtype)
        if row is None:
            raise self.unsupported(tensorbytes.dtype_refusal(v.dtype))
        kind = "parameter" if type(v) is torch.nn.Parameter else "tensor"
        device = "cpu"
        if not v.is_cpu:
            device = str(v.device)
            problem = devices.of_tensor(device)
            if problem is not None:
                raise self.unsupported(f"{problem}; move the tensor to the CPU (t.cpu()) to save it")
        return self._add_tensor(
            v, tensorbytes.alias_key(v, kind) if merge else None, kind=kind, dtype=row, shape=tuple(v.shape),
            device=device, requires_grad=v.requires_grad, memory_format=tensorbytes.memory_format(v),
        )

    def enc_stored(self, v: tensorbytes.Stored, depth: int) -> list:
        """A tensor of a plain safetensors file, as its bytes: planned and hashed without torch, with
        the digest of the CPU tensor a load gives (tensorbytes.Stored)."""
        return self.add_tensor(v, kind="tensor", dtype=v.dtype, shape=v.shape)

    def enc_ndarray(self, v: np.ndarray, depth: int) -> list:
        idx = self._by_id.get(id(v))
        if idx is not None:
            return ["tensor", idx]
        row = dtypes.BY_NUMPY.get(v.dtype.newbyteorder("<")) if v.dtype.fields is None else None
        if row is None:
            if v.dtype.kind in _STRING_KINDS:
                return self.enc_string_array(v, depth)
            remedy = (": convert it, arr.tolist() (a list of its values) or arr.astype(str) (a fixed-width "
                      "str array) if its values are strs" if v.dtype.hasobject else "")
            raise self.unsupported(
                f"numpy arrays of dtype {v.dtype} are not supported (only bool, int, uint, "
                f"float16/32/64, complex64/128 and fixed-width str and bytes, U and S){remedy}"
            )
        return self._add_tensor(
            v, tensorbytes.alias_key(v, "ndarray"), kind="ndarray", dtype=row, shape=tuple(v.shape),
            device="cpu", requires_grad=False,
        )

    def enc_string_array(self, v: np.ndarray, depth: int) -> list:
        """A numpy array of dtype U or S (docs/FORMAT.md §6.11): its width, shape and elements."""
        kind = v.dtype.kind
        width = v.dtype.itemsize // _CHAR_SIZE[kind]
        problem = string_array_problem(kind, width, v.ndim, v.shape)
        if problem is not None:  # (the reader's check of the node: dec_string_array)
            raise self.unsupported(f"this numpy {v.dtype} array cannot be saved: {problem}; save it reshaped, or "
                                   "arr.tolist()")
        if kind == "U" and v.size:  # numpy holds any 32-bit code, and makes broken strs past U+10FFFF
            codes = np.ascontiguousarray(v.astype(v.dtype.newbyteorder("="))).reshape(-1).view(np.uint32)
            if int(codes.max()) > 0x10FFFF:
                raise self.unsupported("a numpy str array holds a code point above U+10FFFF, which is not Unicode")
        self.strings.take(v.size * v.dtype.itemsize, self.path())
        out: list[Any] = ["np.strings", kind, width, v.ndim, *v.shape]
        for item in v.reshape(-1).tolist():  # (numpy strips each element's trailing NULs)
            out.append(self.encode(item, depth))
        return out

    def enc_numpy_str(self, v: np.str_, depth: int) -> list:
        return ["np.str", self.encode(str.__add__(v, ""), depth)]  # (str(v) drops trailing NULs; v holds them)

    def enc_numpy_bytes(self, v: np.bytes_, depth: int) -> list:
        return ["np.bytes", bytes(v)]

    def _fallback(self, v: Any, depth: int) -> list:
        t = type(v)
        try:
            reg = registry.by_type(t)
        except UnsupportedTypeError as e:  # (a subclass of a registered dataclass: named here, at its path)
            raise self.unsupported(str(e)) from None
        if reg is not None:
            try:
                state = reg.encode(v)
            except UnsupportedTypeError as e:  # the codec says why (a built-in codec's refusal)
                raise self.unsupported(str(e)) from None
            except Exception as e:
                raise self.unsupported(f"the encode function registered for {reg.name!r} failed: {e!r}") from e
            return ["obj", reg.name, self.encode(state, depth)]
        if issubclass(t, np.generic):  # not isinstance: that reads v.__class__, which may raise
            return self.enc_numpy_scalar(v, depth)
        th = optional.imported()
        if th is not None and issubclass(t, th.Tensor):  # an unregistered subclass: nested, or refused
            return _TENSOR_HOOK[0](self, v, depth)
        try:
            message = unsaveable_message(v)
        except Exception as e:  # noqa: BLE001 - an object that raises when touched (a proxy, a ShardedTensor)
            message = f"cannot save a value of type {t.__module__}.{t.__qualname__} (touching it raised {e!r})"
        raise self.unsupported(message)

    # -- naming
    def assign_names(self, version: int = 2) -> None:
        """Give each tensor a readable, unique safetensors name from its path (docs/FORMAT.md §3)."""
        for src, name in zip(self.tensors, tensor_names([s.path for s in self.tensors], version), strict=True):
            src.name = name


_STRING_KINDS = ("U", "S")  # numpy dtype kinds of the np.strings tag, and their bytes per character
_CHAR_SIZE = {"U": 4, "S": 1}
_MAX_STRING_NDIM = 32  # numpy 1.x's NPY_MAXDIMS
_TEXT = (str, bytes)  # key types whose hash is random per process: never counted as crowding
_PLAIN = frozenset({float, bool, type(None), bytes})  # leaves written as they are, with no check
_LEAF_TYPES = _PLAIN | {str, int}
_INTS = frozenset({int, bool})
_STRS = frozenset({str})
_INT = {int}
_BULK = 16  # from this many items, a container's leaves are checked in bulk (a few C calls)
_ORDERS_KEPT = 1024  # small dicts' key orders remembered per Encoder (the same keys recur: records)
_SMALL_DICT = 32  # at most this many keys: the dict's key order is remembered
_DIRECT = (list, tuple, dict)  # (Encoder._nested) children encoded without a call to encode()


def string_array_problem(kind: Any, width: Any, ndim: Any, shape: Sequence[Any]) -> str | None:
    """What keeps an ``np.strings`` node's kind, width, number of dimensions and dimensions from
    being a numpy string array's (docs/FORMAT.md §6.11), or None: the one check, which the writer
    makes on the array and every reader on the node."""
    if type(kind) is not str or kind not in _STRING_KINDS:
        return f"its kind must be 'U' or 'S', not {paths.show(kind)}"
    if type(width) is not int or not 1 <= width * _CHAR_SIZE[kind] < 2**31:
        return f"its width {paths.show(width)} is not an int in [1, 2^31) bytes"
    if type(ndim) is not int or not 0 <= ndim <= _MAX_STRING_NDIM:
        return (f"it has {paths.show(ndim)} dimensions, and a numpy string array has at most {_MAX_STRING_NDIM} "
                "(numpy 1.x's most, so that every reader can build it)")
    if not all(type(d) is int and 0 <= d for d in shape):
        return "its dimensions must be non-negative ints"
    problem = container.size_problem(shape, width * _CHAR_SIZE[kind])
    return None if problem is None else f"it {problem}"


def _valid_text(text: str) -> bool:
    """Whether ``text`` is valid UTF-8 when encoded (holds no lone surrogate): :meth:`Encoder.encode`'s
    rule for a str, checked on many strs joined."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_they_are(values: Sequence[Any], types: set) -> bool:
    """Whether every one of ``values`` (of the types ``types``) is a leaf that :meth:`Encoder.encode`
    returns as it is: of a leaf type, every str valid UTF-8, every int within 64 bits (else a big
    int). A few C-level passes instead of a Python step per value; False sends the caller to the
    per-value path, which writes big ints and names the invalid str by its path."""
    if not types <= _LEAF_TYPES:
        return False
    if str in types and not _valid_text("".join(values if types <= _STRS else [x for x in values if type(x) is str])):
        return False
    if int in types:
        ints = values if types <= _INTS else [x for x in values if type(x) is int]
        if min(ints) < INT_MIN or max(ints) > INT_MAX:
            return False
    return True


def _str_keys(d: dict, orders: dict[tuple, tuple]) -> Sequence[str] | None:
    """``d``'s keys in canonical order when every one is a str (exactly) that is valid UTF-8; None
    otherwise (other keys go through ordering.sorted_keys). The order of a small dict's keys is
    remembered in ``orders`` by their insertion order: a list of records (log entries) has the same
    keys in each."""
    if len(d) > _SMALL_DICT:
        if not set(map(type, d)) <= _STRS or not _valid_text("".join(d)):
            return None
        return sorted(d)  # (code point order is the canonical order of valid strs: ordering.py)
    seen = tuple(d)
    known = orders.get(seen)
    if known is not None and set(map(type, seen)) <= _STRS:  # (a str subclass equals the str it holds)
        return known
    if not set(map(type, seen)) <= _STRS or not _valid_text("".join(seen)):
        return None
    known = tuple(sorted(seen))
    if len(orders) < _ORDERS_KEPT:
        orders[seen] = known
    return known


def _int_keys(d: dict) -> list[int] | None:
    """``d``'s keys in canonical order when every one is an int (exactly: not a bool) of 64 bits,
    which :meth:`Encoder.encode` writes as it is (a label map's class ids); None otherwise. Numbers
    sort by value (ordering.py), and distinct ints never tie."""
    if not d or set(map(type, d)) != _INT or min(d) < INT_MIN or max(d) > INT_MAX:
        return None
    return sorted(d)


_KIND = {"dict": "dict", "odict": "OrderedDict", "set": "set", "frozenset": "frozenset", "counter": "Counter",
         "defaultdict": "defaultdict"}
_KEYS = {"dict": "keys", "odict": "keys", "set": "members", "frozenset": "members", "counter": "keys",
         "defaultdict": "keys"}

def unsaveable_message(v: Any) -> str:
    """Why ``v`` (of a type nothing encodes) cannot be saved, and what to save instead."""
    t = type(v)
    name = f"{t.__module__}.{t.__qualname__}"
    th = optional.imported()  # (no value is a torch object unless torch is imported)
    if th is not None and isinstance(v, th.Tensor):
        return tensorbytes.unsaveable(v) or f"tensor subclass {name} is not supported"
    if th is not None and isinstance(v, th.nn.Module):
        return (f"cannot save a {name} (a torch.nn.Module): save its state_dict() instead "
                "(model.state_dict()) and rebuild the module in code before load_state_dict()")
    for what, base in _stateful(th):
        if base is not None and isinstance(v, base):
            return (f"cannot save a {name} ({what}): save its state_dict() instead and call "
                    "load_state_dict() on a freshly built one after loading")
    if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
        return (f"cannot save a {name}: it has state_dict()/load_state_dict(), so save "
                "obj.state_dict() instead and restore it with load_state_dict() after loading")
    opt_in = codecs.hint(v)
    if opt_in is not None:
        return (f"cannot save a {name}: paths, dates and times are saved by built-in codecs that are off "
                f"by default (argparse namespaces once unregistered); call {opt_in} (or "
                "tensorcanon.register_builtin_codecs() for all of them) before saving and loading")
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                      functools.partial, types.ModuleType, type)):
        kind = ("module" if isinstance(v, types.ModuleType) else "class" if isinstance(v, type)
                else "lambda" if getattr(v, "__name__", "") == "<lambda>" else "function")
        return (f"cannot save a {kind} ({_qualname(v)}): functions, lambdas, classes and modules are "
                "code, and tensorcanon files hold only data so that loading one can never run code; "
                "save the name or settings that select it (e.g. a str) and look it up when loading")
    return (
        f"cannot save a value of type {name}: tensorcanon saves None, bool, int, float, complex, "
        "str, bytes, list, tuple, dict, OrderedDict, set, frozenset, Counter, defaultdict, deque, "
        f"tensors, numpy arrays and scalars, torch.Size/dtype/device; to save {t.__qualname__}, call "
        f"tensorcanon.register({t.__qualname__}) first ({_REGISTER_HOW})"
    )


_REGISTER_HOW = ("dataclasses, NamedTuples, Enums and dict or list subclasses need nothing more; other classes "
                 "pass encode= and decode=")


def _qualname(v: Any) -> str:
    module = getattr(v, "__module__", None)
    qual = getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or type(v).__qualname__
    return f"{module}.{qual}" if module else str(qual)


def _stateful(th: Any) -> list[tuple[str, Any]]:
    if th is None:
        return []
    return [
        ("an optimizer", th.optim.Optimizer),
        ("a learning-rate scheduler", getattr(th.optim.lr_scheduler, "LRScheduler", None)),
        ("a learning-rate scheduler", getattr(th.optim.lr_scheduler, "ReduceLROnPlateau", None)),
    ]


class _StringBudget:
    """The bytes the numpy string arrays of one file take together (docs/FORMAT.md §9.4,
    ``max_string_array_bytes``): counted before any is built, by the writer and by every reader."""

    def __init__(self, limit: int, saving: bool) -> None:
        self.limit, self.saving, self.used = limit, saving, 0

    def take(self, nbytes: int, where: str) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise LimitError(
                f"{'' if self.saving else 'manifest: '}the numpy string arrays up to the one at {where} take "
                f"{self.used} bytes together, more than max_string_array_bytes={self.limit} (an array's width "
                "times its elements: a claim the file makes, like a shape)", limit="max_string_array_bytes",
                path=where, saving=self.saving)


# --------------------------------------------------------------------------- decode


_NO_KEY = object()  # no previous key yet (Decoder._fill)
_TORCH_VALUES = {"size": "Size", "dtype": "dtype", "device": "device"}  # tag -> type name (build_objects=False)
_first = operator.itemgetter(0)


class Decoder:
    """Builds values from a validated manifest's tree, checking every node."""

    def __init__(self, tensors: list, max_depth: int, build_objects: bool = True,
                 version: int | None = None, max_string_bytes: int = DEFAULT.max_string_array_bytes) -> None:
        self.tensors = tensors
        self.strings = _StringBudget(max_string_bytes, saving=False)
        self.build_objects = build_objects
        # The format version whose list rules apply (docs/FORMAT.md §6.13): from 3, a list that the
        # writer packs must be packed; before 3, no packed node is allowed. None: a walker of a tree
        # already checked, which accepts both.
        self.version = version
        self.used = [False] * len(tensors)
        self.first_paths: list[tuple] = []  # path of each tensor's first use, in table order
        self.uses: list[tuple[tuple, int]] | None = None  # set to a list to record every use
        # Called as visit(path, node) for the root and every value in it (list and tuple
        # items, dict and OrderedDict values; not keys, set members or _metadata slots;
        # a registered object's state is not visited itself, its children are). When it
        # returns true, the values inside that node are not visited (the node is still
        # decoded and checked): a walker that shows a list in one line (inspect) keeps out.
        self.visit: Callable[[tuple, Any], Any] | None = None
        self.max_depth = max_depth
        self._path: list = []
        # verify (build_objects false): the table's rows (manifest.TensorInfo), for the checks of a
        # node kind on its parts' dtypes and shapes; and the checks on its parts' values, which the
        # reader runs on those parts' verified bytes (tensorkinds.Deferred)
        self.rows: Sequence[Any] | None = None
        self.deferred: list[Any] = []

    def walk(self, node: Any) -> Any:
        """Decode ``node`` as the root, calling :attr:`visit` on the way."""
        if self.visit is not None and self.visit((), node):
            return self.unvisited(node, 0)
        return self.decode(node)

    def unvisited(self, node: Any, depth: int) -> Any:
        """:meth:`decode` of ``node`` without calling :attr:`visit` inside it (its visit said so)."""
        visit, self.visit = self.visit, None
        try:
            return self.decode(node, depth)
        finally:
            self.visit = visit

    def error(self, message: str) -> FormatError:
        """A FormatError saying ``message`` at the current path."""
        return FormatError(f"manifest: {message} at {self.path()}")

    def current_path(self) -> tuple:
        """The path (keys and indices from the root) of the node being decoded."""
        return tuple(self._path)

    def path(self) -> str:
        """:meth:`current_path` as text (docs/FORMAT.md §3.1), as errors name it."""
        return paths.join(tuple(self._path))

    @contextlib.contextmanager
    def at(self, step: Any) -> Iterator[None]:
        """Decode what the ``with`` block decodes one step below the current path, at ``step`` (a
        key, an index, or a part's name such as ``"bit_generator"``): errors, and the paths
        recorded for tensors, then name it."""
        self._path.append(step)
        try:
            yield
        finally:
            self._path.pop()

    def check_depth(self, depth: int) -> None:
        """Reject a tagged array at ``depth`` (the root is at 0) unless ``depth < max_depth``.

        :meth:`decode` checks every node it dispatches; a decoder that walks nested tagged
        arrays itself (the random-state tags) calls this for each level it enters.
        """
        if depth >= self.max_depth:
            raise LimitError(
                f"manifest: object nested deeper than max_depth={self.max_depth} at {self.path()}",
                limit="max_depth",
            )

    def decode(self, node: Any, depth: int = 0) -> Any:
        t = type(node)
        if t is str or t is float or t is int or t is bool or node is None or t is bytes:
            return node
        if t is msgpack.ExtType:
            return self._ext(node)
        if t is not tuple and t is not list:  # (see ARRAYS)
            raise self.error(f"unexpected {t.__name__} node")
        if depth >= self.max_depth:  # (check_depth's test, inline: one call fewer per node)
            self.check_depth(depth)
        if not node or type(node[0]) is not str:
            raise self.error("a tagged array must start with a str tag")
        dec = _DECODERS.get(node[0])
        if dec is None:
            raise self.error(f"unknown tag {node[0]!r}")
        return dec(self, node, depth + 1)

    def _ext(self, node: msgpack.ExtType) -> int:
        if node.code != EXT_BIGINT:
            raise self.error(f"unknown ext type {node.code}")
        data = node.data
        n = int.from_bytes(data, "big", signed=True)
        if INT_MIN <= n <= INT_MAX or bigint_bytes(n) != data:
            raise self.error("big int is not in canonical form")
        return n

    def _args(self, node: Sequence[Any], n: int) -> Sequence[Any]:
        if len(node) != n + 1:
            raise self.error(f"{node[0]!r} takes {n} values, found {len(node) - 1}")
        return node[1:]

    def _items(self, node: Sequence[Any], depth: int) -> list:
        out = []
        path = self._path
        visit = self.visit
        for i in range(1, len(node)):
            path.append(i - 1)
            if visit is not None and visit(tuple(path), node[i]):  # (inline: one frame per level of nesting)
                out.append(self.unvisited(node[i], depth))
            else:
                out.append(self.decode(node[i], depth))
            path.pop()
        return out

    def _key(self, node: Any, depth: int) -> tuple[Any, tuple]:
        visit = self.visit
        if visit is None:
            k = self.decode(node, depth)
        else:  # a key's parts (a tuple key's items) are not values of the tree: not visited
            self.visit = None
            try:
                k = self.decode(node, depth)
            finally:
                self.visit = visit
        if k is None and not self.build_objects and tag_of(node) is not None:  # refused as when built
            # Nothing built (verify): a tagged node stands for None only when its value is not
            # built, and no tagged node's value is the key None; key values that verify does not
            # build (dtypes, registered types) are Unbuilt stand-ins, not None.
            what = _TORCH_VALUES.get(node[0], repr(node[0]))
            raise self.error(f"a key or set member of type {what} is not allowed")
        try:
            return k, sort_key(k)
        except (UnorderableKey, UnicodeEncodeError):
            raise self.error(f"a key or set member of type {type(k).__name__} is not allowed") from None

    def _members(self, node: Sequence[Any], depth: int) -> list:
        out, prev = [], None
        for i in range(1, len(node)):
            k, sk = self._key(node[i], depth)
            if prev is not None and not prev < sk:
                raise self.error("set members are not in canonical order (or repeat)")
            prev = sk
            out.append(k)
        k = crowded(out)
        if k is not NO_KEY:
            raise self._crowded(node[0], k)
        return out

    def _crowded(self, tag: str, key: Any) -> FormatError:
        return self.error(
            f"more than {MAX_SAME_HASH} {_KEYS[tag]} of this {_KIND[tag]} share one Python hash (such as "
            f"{paths.show(key)}), which would take time quadratic in their number to rebuild; no "
            "conforming writer writes such a container (docs/FORMAT.md §6.3)")

    def _fill(self, node: Sequence[Any], start: int, depth: int, ordered: bool, out: dict) -> int:
        """Decode the keys and values of ``node`` from ``start`` into ``out``; the number of pairs.

        Fills ``out`` directly rather than through a list of ``(key, value)`` pairs: a pair
        holding a tensor is one more object per tensor for the garbage collector to track.
        An ASCII str key (the common case) is compared as it is: for such strs, code point
        order is the canonical order (bytes order), without building sort keys.
        """
        if (len(node) - start) % 2:
            raise self.error(f"{node[0]!r} has an odd number of keys and values")
        prev: Any = _NO_KEY
        prev_sk: Any = None  # the previous key's sort key; None when it was an ASCII str (not built)
        seen: set = set()  # (OrderedDict) ASCII str keys
        others: list | None = None  # (OrderedDict) (sort key, key) of the other keys: sorted, not hashed
        hashes: dict[int, int] | None = None  # how many keys (not str or bytes) have each hash
        crowdable = len(node) - start > 2 * MAX_SAME_HASH  # (fewer keys cannot break the bound)
        path = self._path
        for i in range(start, len(node), 2):
            k = node[i]
            if type(k) is str and k.isascii():  # decode() returns it as it is
                if ordered:
                    if prev is not _NO_KEY and not (prev < k if prev_sk is None else prev_sk < sort_key(k)):
                        raise self.error("dict keys are not in canonical order (or repeat)")
                elif k in seen:
                    raise self.error(f"OrderedDict key {paths.show(k)} repeats")
                else:
                    seen.add(k)
                prev_sk = None
            else:
                k, sk = self._key(k, depth)
                if crowdable and type(k) is not str and type(k) is not bytes:
                    if hashes is None:
                        hashes = {}
                    h = hash(k)
                    n = hashes[h] = hashes.get(h, 0) + 1
                    if n > MAX_SAME_HASH:  # before out[k], which would take time quadratic in n
                        raise self._crowded(node[0], k)
                if ordered:
                    if prev is not _NO_KEY and not (sort_key(prev) if prev_sk is None else prev_sk) < sk:
                        raise self.error("dict keys are not in canonical order (or repeat)")
                elif others is None:
                    others = [(sk, k)]
                else:
                    others.append((sk, k))
                prev_sk = sk
            prev = k
            path.append(k)
            if self.visit is not None and self.visit(tuple(path), node[i + 1]):
                out[k] = self.unvisited(node[i + 1], depth)
            else:
                out[k] = self.decode(node[i + 1], depth)
            path.pop()
        if others:  # a sort key's hash is not the key's, so not bounded by MAX_SAME_HASH: no set of them
            others.sort(key=_first)
            for (a, k), (b, _) in itertools.pairwise(others):
                if a == b:
                    raise self.error(f"OrderedDict key {paths.show(k)} repeats")
        return (len(node) - start) // 2

    def decode_mapping(self, node: Sequence[Any], depth: int, out: Any, what: str) -> Any:
        """Decode the keys and values of ``node`` (a mapping tag of ``first_item``) into ``out``, a
        dict or dict subclass, with every check of a ``dict`` node (docs/FORMAT.md §6.3): canonical
        order, no repeats, the hash bound, no keys Python merges (``what`` names the container in
        that error). For the node kinds of other modules (format/stdkinds.py)."""
        return self._no_merged_keys(out, self._fill(node, first_item(node[0]), depth, True, out), what)

    def decode_items(self, node: Sequence[Any], start: int, depth: int) -> list:
        """The values of ``node[start:]``, decoded as a list's items (paths 0, 1, ...)."""
        out = []
        path = self._path
        visit = self.visit
        for i in range(start, len(node)):
            path.append(i - start)
            if visit is not None and visit(tuple(path), node[i]):
                out.append(self.unvisited(node[i], depth))
            else:
                out.append(self.decode(node[i], depth))
            path.pop()
        return out

    def dec_list(self, node: Sequence[Any], depth: int) -> list:
        if self.version is not None and self.version >= packed.SINCE and len(node) > packed.MIN_RECORDS:
            tag = packed.should_pack(node[1:])
            if tag is not None:
                what = "ints" if tag == "ints" else "dicts of str keys and leaf values"
                raise self.error(f"a list of {len(node) - 1} {what} is written as a {tag!r} node from format version "
                                 f"{packed.SINCE} on "
                                 "(docs/FORMAT.md §6.13); the file was not written by a conforming writer")
        return self._items(node, depth)

    def _packed_allowed(self, tag: str) -> None:
        if self.version is not None and self.version < packed.SINCE:
            raise self.error(f"the tag {tag!r} is not in format version {self.version} (it was added in version "
                             f"{packed.SINCE}: docs/FORMAT.md §6.13)")

    def dec_ints(self, node: Sequence[Any], depth: int) -> list:
        self._packed_allowed("ints")
        # (verify: checked, not built; an empty list stands for it, which is no key either)
        values = packed.ints_values(node, self.error, self.build_objects or self.visit is not None)
        if self.visit is not None and values is not None:  # a walker sees the list a version-2 file holds
            return self._items(("list", *values), depth)
        return [] if values is None else values

    def dec_records(self, node: Sequence[Any], depth: int) -> list:
        self._packed_allowed("records")
        if depth >= self.max_depth:  # each record is a dict, one level below the list
            self.check_depth(depth)
        # (verify: as dec_ints; a walker: checked here, built once by expand)
        values = packed.records_values(node, self.error, self.build_objects and self.visit is None)
        if self.visit is not None:  # a walker sees the list of dict nodes a version-2 file holds
            return self._items(packed.expand(node), depth)
        return [] if values is None else values

    def dec_tuple(self, node: Sequence[Any], depth: int) -> tuple:
        return tuple(self._items(node, depth))

    def _no_merged_keys(self, out: _Sized, n: int, what: str) -> _Sized:
        # Keys the canonical order tells apart but Python merges (True and 1, (1,) and (True,))
        # would silently drop entries: such a file was not written from a real dict or set.
        if len(out) != n:
            raise self.error(f"{what} holds keys that Python treats as equal (such as True and 1)")
        return out

    def dec_dict(self, node: Sequence[Any], depth: int) -> dict:
        out: dict = {}
        return self._no_merged_keys(out, self._fill(node, first_item("dict"), depth, True, out), "dict")

    def dec_odict(self, node: Sequence[Any], depth: int) -> collections.OrderedDict:
        if len(node) < 2:
            raise self.error("'odict' needs its metadata slot")
        self._path.append(walk.METADATA)
        meta = self.decode(node[1], depth)
        self._path.pop()
        out: collections.OrderedDict = _OrderedDict()
        self._no_merged_keys(out, self._fill(node, first_item("odict"), depth, False, out), "OrderedDict")
        if meta is not None:
            setattr(out, walk.METADATA, meta)  # where torch's state_dict() keeps it
        return out

    def dec_set(self, node: Sequence[Any], depth: int) -> set:
        members = self._members(node, depth)
        return self._no_merged_keys(set(members), len(members), "set")

    def dec_frozenset(self, node: Sequence[Any], depth: int) -> frozenset:
        members = self._members(node, depth)
        return self._no_merged_keys(frozenset(members), len(members), "frozenset")

    def dec_complex(self, node: Sequence[Any], depth: int) -> complex:
        re, im = self._args(node, 2)
        if type(re) is not float or type(im) is not float:
            raise self.error("'complex' takes two floats")
        return complex(re, im)

    def dec_size(self, node: Sequence[Any], depth: int) -> torch.Size | None:
        dims = node[1:]
        if not all(type(d) is int and -(2**63) <= d < 2**63 for d in dims):
            raise self.error("'size' takes ints that fit in 64 bits")
        if not self.build_objects:  # structural check only (verify): no torch needed
            return None
        return torch.Size(dims)

    def dec_dtype(self, node: Sequence[Any], depth: int) -> torch.dtype | Unbuilt:
        (name,) = self._args(node, 1)
        if type(name) is not str or name not in dtypes.DTYPE_VALUE_NAMES:
            raise self.error(f"unknown torch dtype {paths.show(name)} (docs/FORMAT.md §4.4 lists the names)")
        if not self.build_objects:  # structural check only (verify): any torch, or none, accepts the name
            return Unbuilt("dtype", name)  # (None, but a key: sorts where the dtype would)
        d = dtypes.TORCH_DTYPES_BY_NAME.get(name)
        if d is None:
            raise self.error(f"the file holds torch.{name}, which this torch ({torch.__version__}) lacks; "
                             "load it with a newer torch")
        return d

    def dec_device(self, node: Sequence[Any], depth: int) -> torch.device | None:
        (spec,) = self._args(node, 1)
        if not devices.is_canonical(spec):
            raise self.error(f"device {paths.show(spec)} is not canonical device text (docs/FORMAT.md §4.3)")
        if not self.build_objects:  # structural check only (verify): no torch needed
            return None
        try:
            return torch.device(spec)
        except (RuntimeError, ValueError) as e:  # a type this torch does not know
            raise self.error(f"this torch ({torch.__version__}) cannot make device {spec!r}: {e}") from None

    def dec_numpy_scalar(self, node: Sequence[Any], depth: int) -> Any:
        name, data = self._args(node, 2)
        row = dtypes.BY_NAME.get(name) if type(name) is str else None
        if row is None or row.numpy is None or type(data) is not bytes or len(data) != row.itemsize:
            raise self.error(f"invalid numpy scalar of dtype {paths.show(name)}")
        value = np.frombuffer(data, dtype=row.numpy)[0]
        if row.name == "bool" and data not in (b"\x00", b"\x01"):
            raise self.error("numpy bool scalar holds a byte other than 0 or 1")
        return value.astype(row.numpy.newbyteorder("="))[()]

    def dec_numpy_str(self, node: Sequence[Any], depth: int) -> Any:
        (text,) = self._args(node, 1)
        if type(text) is not str:
            raise self.error("'np.str' takes a str")
        return np.str_(text)

    def dec_numpy_bytes(self, node: Sequence[Any], depth: int) -> Any:
        (data,) = self._args(node, 1)
        if type(data) is not bytes:
            raise self.error("'np.bytes' takes a bin")
        return np.bytes_(data)

    def dec_string_array(self, node: Sequence[Any], depth: int) -> Any:
        if len(node) < 4:
            raise self.error("'np.strings' needs its kind, width and number of dimensions")
        kind, width, ndim = node[1], node[2], node[3]
        shape = tuple(node[4:4 + ndim]) if type(ndim) is int and 0 <= ndim <= _MAX_STRING_NDIM else ()
        problem = string_array_problem(kind, width, ndim, shape)
        if problem is None and len(node) < 4 + ndim:
            problem = f"it holds {len(node) - 4} dimensions, not {ndim}"
        if problem is not None:
            raise self.error(f"an 'np.strings' node: {problem}")
        items = node[4 + ndim:]
        if len(items) != math.prod(shape):
            raise self.error(f"'np.strings' of shape {list(shape)} holds {len(items)} elements")
        self.strings.take(len(items) * width * _CHAR_SIZE[kind], self.path())  # (verify too: verify => load)
        want, nul = (str, "\x00") if kind == "U" else (bytes, b"\x00")
        for item in items:
            if type(item) is not want or len(item) > width or item.endswith(nul):  # type: ignore[arg-type]
                raise self.error(f"an element of an 'np.strings' array of kind {kind} is a {want.__name__} of at "
                                 f"most {width} characters that does not end with a NUL")
        if not self.build_objects:
            return None
        try:
            return np.array(list(items), dtype=f"{kind}{width}").reshape(shape)
        except MemoryError:
            raise LimitError(f"manifest: the numpy string array at {self.path()} does not fit in memory "
                             f"({len(items)} elements of {kind}{width})", limit="max_string_array_bytes",
                             path=self.path()) from None

    def dec_tensor(self, node: Sequence[Any], depth: int) -> Any:
        idx = node[1] if len(node) == 2 else self._args(node, 1)[0]  # (_args raises; inline when valid)
        if type(idx) is not int or not 0 <= idx < len(self.tensors):
            raise self.error(f"tensor index {paths.show(idx)} is out of range")
        if not self.used[idx]:
            if idx != len(self.first_paths):
                raise self.error(
                    f"tensor {idx} is used before tensor {len(self.first_paths)}; the table must list "
                    "tensors in the order the tree first uses them"
                )
            self.used[idx] = True
            self.first_paths.append(tuple(self._path))
        if self.uses is not None:
            self.uses.append((tuple(self._path), idx))
        return self.tensors[idx]

    def check_table(self, names: list[str], version: int = 2) -> None:
        """After decoding the root: every tensor is used, and each has its canonical name
        (by the name rule of format ``version``: docs/FORMAT.md §3)."""
        if not all(self.used):
            unused = [names[i] for i, u in enumerate(self.used) if not u][:3]
            raise FormatError(f"manifest: tensors {unused} are listed but never used in the object")
        for i, (name, want) in enumerate(zip(names, tensor_names(self.first_paths, version), strict=True)):
            if name != want:
                raise FormatError(
                    f"manifest: tensor {i} at {paths.join(self.first_paths[i])} is named {paths.show(name)}, "
                    f"but its canonical name is {paths.show(want)}; the file was not written by a conforming "
                    "writer (re-save it with tensorcanon.save)"
                )

    def decode_metadata(self, node: Any) -> dict:
        """The user metadata tree: a dict with str keys, holding no tensors."""
        self._path = ["metadata"]
        value = self.decode(node)
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise FormatError("manifest: user metadata must be a dict with str keys")
        return value

    def dec_obj(self, node: Sequence[Any], depth: int) -> Any:
        name, state = self._args(node, 2)
        if type(name) is not str:
            raise self.error("'obj' needs a str type name")
        reg = registry.by_name(name)
        where = self.path()
        if not self.build_objects:  # verify: the structure, and a state the format specifies
            decoded = self.decode(state, depth)
            rebuild = registry.specified(name)
            if rebuild is not None:  # the check load runs (below), on the state as far as it is plain
                _rebuilt(name, where, rebuild, self.plain(state))
            return Unbuilt("obj", name, decoded)  # a stand-in that sorts as a key would
        if reg is None:
            enable, library = codecs.NAMES.get(name), ecosystem.library_for(name)
            if library is not None:  # one of the ecosystem's codecs (§6.9.5): active once the library is
                raise UnsupportedTypeError(
                    f"the file holds a {paths.show(name)} at {where}: import {library} before loading it "
                    "(tensorcanon saves and loads it once the program has imported it, and never imports "
                    "names found in a file)", path=where)
            how = (f"call tensorcanon.codecs.{enable}() (or tensorcanon.register_builtin_codecs()) "
                   "before loading" if enable else "call tensorcanon.register(<that class>) before loading")
            raise UnsupportedTypeError(
                f"the file holds a value of the registered type {paths.show(name)} at {where}, which is "
                f"not registered in this process; {how} (tensorcanon never imports names found in a file)",
                path=where,
            )
        return _rebuilt(name, where, reg.decode, self.decode(state, depth))

    def plain(self, node: Any) -> Any:
        """The value of a node that :meth:`decode` has checked, built without objects: leaves (big
        ints included), lists, tuples, dicts and OrderedDicts (without torch's metadata) as they load;
        a tensor node a :class:`registry.UnbuiltTensor`; every other node (a torch value, a registered
        object, a set...) a new opaque object, which no specified state accepts where a loaded one
        would be refused (registry.specify)."""
        t = type(node)
        if t is msgpack.ExtType:
            return self._ext(node)
        if t is not list and t is not tuple:
            return node
        tag = node[0]
        if tag == "list":
            return [self.plain(x) for x in node[1:]]
        if tag == "ints":  # only leaves inside: the list load gives, built (a checked node)
            return packed.ints_values(node, self.error)
        if tag == "records":
            return packed.records_values(node, self.error)
        if tag == "tuple":
            return tuple(self.plain(x) for x in node[1:])
        if tag == "dict":
            return {self.plain(node[i]): self.plain(node[i + 1]) for i in range(first_item("dict"), len(node), 2)}
        if tag == "odict" and node[1] is None:  # an OrderedDict without torch's metadata, as it loads
            return _OrderedDict((self.plain(node[i]), self.plain(node[i + 1]))
                                for i in range(first_item("odict"), len(node), 2))
        if tag in _TENSOR_TAGS:  # a tensor, which a specified state may hold (a PackedSequence's)
            return registry.UnbuiltTensor()
        return object()


#: the nodes that load as a tensor (docs/FORMAT.md §5.3, §6.12): what Decoder.plain gives a stand-in for
_TENSOR_TAGS = frozenset(("tensor", "sparse", "nested", "meta", "tensor.attrs"))


def _rebuilt(name: str, where: str, rebuild: Callable[[Any], Any], state: Any) -> Any:
    """``rebuild(state)``, a registered type's value; its failure a FormatError naming the path: the
    one check of a registered value's state, for load and (for specified states) verify alike."""
    try:
        return rebuild(state)
    except Exception as e:
        raise FormatError(f"manifest: could not rebuild {name!r} at {where}: {e!r}") from e


# --------------------------------------------------------------------------- node kinds


EncodeFn = Callable[[Encoder, Any, int], Any]
"""``encode(encoder, value, depth)``: the node of ``value``, whose own node sits at ``depth - 1``. It
encodes children with ``encoder.encode(child, depth)`` (under ``encoder.at(step)`` to name their
path), calls ``encoder.check_depth`` for each level of tagged arrays it builds itself, and refuses
a value with ``raise encoder.unsupported(why)``."""

DecodeFn = Callable[[Decoder, Sequence[Any], int], Any]
"""``decode(decoder, node, depth)``: the value of ``node`` (a list or a tuple: ``ARRAYS``) whose tag
picked it, its children at ``depth``. It checks every argument, decodes children with
``decoder.decode(child, depth)`` (under ``decoder.at(step)``), calls ``decoder.check_depth`` for
each level it walks itself, rejects a node with ``raise decoder.error(why)``, and builds nothing
(returns None) when ``decoder.build_objects`` is false."""


@dataclass(frozen=True)
class LazyType:
    """A class of torch or numpy named by its module and attribute path (``LazyType("torch",
    "nn.Parameter")``, ``LazyType("numpy", "random.Generator")``): a node kind lists it without
    importing the module, and its encoder applies once the module is loaded (format/optional.py)."""

    module: str     # one of optional.NAMES: "torch" or "numpy"
    attribute: str  # dotted, from the module: "Size", "nn.Parameter", "random.Generator"

    def __post_init__(self) -> None:
        if self.module not in optional.NAMES:
            raise UsageError(
                f"LazyType({self.module!r}, {self.attribute!r}): only the modules tensorcanon imports on "
                f"first use ({', '.join(optional.NAMES)}) are named; list a class of any other module as "
                "the class itself")
        if type(self.attribute) is not str or not all(p.isidentifier() for p in self.attribute.split(".")):
            raise UsageError(f"LazyType({self.module!r}, {self.attribute!r}): the attribute must be a dotted "
                             "name, such as 'nn.Parameter'")

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"

    def resolve(self, module: types.ModuleType) -> type:
        """The class in the loaded ``module``; UsageError if it holds no such class."""
        value: Any = module
        for part in self.attribute.split("."):
            value = getattr(value, part, None)
        if not isinstance(value, type):
            version = getattr(module, "__version__", "?")
            raise UsageError(f"{self} is not a class in this {self.module} ({version}): a node kind lists it; "
                             "correct the name given to LazyType")
        return value


@dataclass(frozen=True)
class NodeKind:
    """One tag of the tree (docs/FORMAT.md §6.2, §6.7) as :func:`register_kind` registered it: its
    decoder, and the types it encodes (classes, or :class:`LazyType` names), each with its encoder.

    A kind may list no types: numpy scalars (``np.scalar``, every subclass of ``numpy.generic``)
    and registered classes (``obj``, format/registry.py) are found by the encoder's fallback,
    after the exact-type lookup misses.
    """

    tag: str
    decode: DecodeFn
    encoders: tuple[tuple[type | LazyType, EncodeFn], ...] = ()

    @property
    def types(self) -> tuple[type | LazyType, ...]:
        return tuple(t for t, _ in self.encoders)

    @property
    def origin(self) -> str:
        """The module that registered the kind (its decoder's module)."""
        return str(getattr(self.decode, "__module__", None) or "an unknown module")


def _no_tensor_hook(enc: Encoder, v: Any, depth: int) -> list:
    raise enc.unsupported(tensorbytes.unsaveable(v) or unsaveable_message(v))


_TENSOR_HOOK: list[EncodeFn] = [_no_tensor_hook]


def set_tensor_hook(encode: EncodeFn) -> None:
    """Set the encoder of every tensor that the ``tensor`` node does not hold as it is (another
    layout, nested, meta, attributes set on it, an unregistered subclass): format/tensorkinds.py,
    which returns its node or refuses it."""
    _TENSOR_HOOK[0] = encode


# The tables, written by register_kind and _loaded only (under _lock). Encoder.encode and
# Decoder.decode read _ENCODERS and _DECODERS directly: one dict lookup per node.
_KINDS: dict[str, NodeKind] = {}                  # tag -> its kind, in registration order
_DECODERS: dict[str, DecodeFn] = {}               # tag -> decoder
_ENCODERS: dict[type, EncodeFn] = {}              # exact type -> encoder (a LazyType's once resolved)
_KIND_OF: dict[type, NodeKind] = {}               # exact type -> its kind
_WAITING: dict[str, list[tuple[LazyType, EncodeFn, NodeKind]]] = {name: [] for name in optional.NAMES}
_LOADED: dict[str, types.ModuleType] = {}         # the modules of optional.NAMES loaded so far
_lock = threading.RLock()
_LEAVES = (str, float, bool, type(None), bytes, int)  # Encoder.encode writes them before any lookup
for _leaf in _LEAVES:
    registry.reserve(_leaf, "a leaf (docs/FORMAT.md §6.1)")



def _type_name(t: type | LazyType) -> str:
    return str(t) if isinstance(t, LazyType) else f"{t.__module__}.{t.__qualname__}"


def _taken(t: type | LazyType, by: NodeKind) -> UsageError:
    return UsageError(f"{_type_name(t)} is already encoded by the node kind {by.tag!r} (registered by "
                      f"{by.origin}): a type has one node kind; register the new kind without it")


def register_kind(tag: str, decode: DecodeFn,
                  encoders: Mapping[type | LazyType, EncodeFn] | None = None) -> NodeKind:
    """Register the node kind ``tag``: ``decode`` (a :data:`DecodeFn`) builds the value of every
    ``[tag, ...]`` node, and ``encoders`` maps each Python type whose values it writes (by exact
    type, not subclasses) to its :data:`EncodeFn`. A class of torch or numpy is named by a
    :class:`LazyType`, so that registering imports neither: its encoder applies once the module
    is loaded (at once if it is).

    The one way a tag or a type enters the tables; each is registered once. A tag or a type that
    another kind has, or a leaf type (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``:
    docs/FORMAT.md §6.1), raises :class:`~tensorcanon.UsageError` and registers nothing. A
    :class:`LazyType` naming the class of another kind under another name is found when its module
    loads, and raises then. A tag is a format rule: docs/FORMAT.md lists every one.

    Example (training/rng.py)::

        tree.register_kind("rng.random", _dec_random, {random.Random: _enc_random})
        tree.register_kind("rng.torch", _dec_torch, {tree.LazyType("torch", "Generator"): _enc_torch})
    """
    if type(tag) is not str or not tag:
        raise UsageError(f"register_kind() takes a non-empty str tag, not {tag!r}")
    if not callable(decode):
        raise UsageError(f"register_kind({tag!r}): decode must be a function (decoder, node, depth) -> value, "
                         f"not {type(decode).__name__}")
    pairs = tuple((encoders or {}).items())
    for t, enc in pairs:
        if not isinstance(t, (type, LazyType)):
            raise UsageError(f"register_kind({tag!r}): encoders are keyed by a class or a LazyType, not {t!r}")
        if t in _LEAVES:
            raise UsageError(f"register_kind({tag!r}): {t.__qualname__} values are leaves (docs/FORMAT.md §6.1), "
                             "written as they are before any node kind is looked up; they cannot have a kind")
        if not callable(enc):
            raise UsageError(f"register_kind({tag!r}): the encoder of {_type_name(t)} must be a function "
                             f"(encoder, value, depth) -> node, not {type(enc).__name__}")
    kind = NodeKind(tag, decode, pairs)
    with _lock:
        old = _KINDS.get(tag)
        if old is not None:
            raise UsageError(f"the tag {tag!r} is already registered (by {old.origin}): a tag has one node "
                             "kind; register it once, or choose another tag")
        now: dict[type, EncodeFn] = {}
        later: list[tuple[LazyType, EncodeFn]] = []
        for t, enc in pairs:
            if isinstance(t, LazyType) and t.module not in _LOADED:
                held = next((k for ref, _, k in _WAITING[t.module] if ref == t), None)
                if held is not None:
                    raise _taken(t, held)
                later.append((t, enc))
                continue
            cls = t.resolve(_LOADED[t.module]) if isinstance(t, LazyType) else t
            held = _KIND_OF.get(cls)
            if held is not None or cls in now:
                raise _taken(t, held or kind)
            now[cls] = enc
        _KINDS[tag] = kind
        _DECODERS[tag] = decode
        for cls, enc in now.items():
            _ENCODERS[cls] = enc
            _KIND_OF[cls] = kind
            registry.reserve(cls, f"the tag {tag!r} (docs/FORMAT.md §6)")
        for ref, enc in later:
            _WAITING[ref.module].append((ref, enc, kind))
    return kind


def _loaded(module: types.ModuleType) -> None:
    """optional's hook for torch and numpy: ``module`` is loaded, and the classes the node kinds
    name in it (LazyType) join the encoder's table."""
    clashes = []
    with _lock:
        for ref, enc, kind in _WAITING.pop(module.__name__, []):
            try:
                cls = ref.resolve(module)
                held = _KIND_OF.get(cls)
                if held is not None:
                    raise _taken(ref, held)
            except UsageError as e:
                clashes.append(str(e))
                continue
            _ENCODERS[cls] = enc
            _KIND_OF[cls] = kind
            registry.reserve(cls, f"the tag {kind.tag!r} (docs/FORMAT.md §6)")
        _LOADED[module.__name__] = module
    if clashes:
        raise UsageError(f"{module.__name__} was loaded, but the node kinds that name its classes clash: "
                         + "; ".join(clashes))


def node_kinds() -> tuple[NodeKind, ...]:
    """Every registered node kind, in registration order (tree's own first)."""
    with _lock:
        return tuple(_KINDS.values())


def kind_of(cls: type) -> NodeKind | None:
    """The node kind that encodes values of exactly the type ``cls``, None if none does (a leaf, a
    registered class, a numpy scalar, or any other type). A program's own import of torch or numpy
    counts: their classes are looked up as the encoder would."""
    optional.ready()
    return _KIND_OF.get(cls)


for _name in optional.NAMES:
    optional.on_load(_loaded, _name)

register_kind("list", Decoder.dec_list, {list: Encoder.enc_sequence})
register_kind("tuple", Decoder.dec_tuple, {tuple: Encoder.enc_sequence})
register_kind("dict", Decoder.dec_dict, {dict: Encoder.enc_dict})
register_kind("odict", Decoder.dec_odict, {_OrderedDict: Encoder.enc_container})
register_kind("set", Decoder.dec_set, {set: Encoder.enc_container})
register_kind("frozenset", Decoder.dec_frozenset, {frozenset: Encoder.enc_container})
register_kind("complex", Decoder.dec_complex, {complex: Encoder.enc_complex})
register_kind("size", Decoder.dec_size, {LazyType("torch", "Size"): Encoder.enc_size})
register_kind("dtype", Decoder.dec_dtype, {LazyType("torch", "dtype"): Encoder.enc_dtype})
register_kind("device", Decoder.dec_device, {LazyType("torch", "device"): Encoder.enc_device})
register_kind("np.scalar", Decoder.dec_numpy_scalar)  # every numpy.generic: Encoder._fallback
register_kind("np.str", Decoder.dec_numpy_str, {LazyType("numpy", "str_"): Encoder.enc_numpy_str})
register_kind("np.bytes", Decoder.dec_numpy_bytes, {LazyType("numpy", "bytes_"): Encoder.enc_numpy_bytes})
register_kind("np.strings", Decoder.dec_string_array)  # numpy arrays of dtype U and S: Encoder.enc_ndarray
register_kind("tensor", Decoder.dec_tensor, {
    LazyType("torch", "Tensor"): Encoder.enc_tensor,
    LazyType("torch", "nn.Parameter"): Encoder.enc_tensor,
    LazyType("numpy", "ndarray"): Encoder.enc_ndarray,
    tensorbytes.Stored: Encoder.enc_stored,
})
register_kind("obj", Decoder.dec_obj)  # the classes of format/registry.py: Encoder._fallback
register_kind("ints", Decoder.dec_ints)  # lists the format packs (§6.13): Encoder.enc_sequence
register_kind("records", Decoder.dec_records)


def decode_manifest(root: Any, meta: Any, names: list[str], version: int, max_depth: int,
                    values: list | None = None, uses: bool = False,
                    rows: Sequence[Any] | None = None,
                    max_string_bytes: int = DEFAULT.max_string_array_bytes) -> tuple[Any, Decoder]:
    """Every rule of docs/FORMAT.md §6 on a manifest's object tree, its table's names and order
    (:meth:`Decoder.check_table`) and its user metadata tree: the one structural check of a file,
    for every reader (the file reader, the sharded index). With ``values`` (one per table row)
    the object is built, else nothing is; with ``uses``, every tensor use is recorded; with ``rows``
    (the table, when nothing is built) the checks on parts' dtypes and shapes are made and the checks
    on their values recorded in ``decoder.deferred`` (tensorkinds.run_deferred runs them).
    Returns ``(object or None, the decoder)``."""
    decoder = Decoder(values if values is not None else [None] * len(names), max_depth,
                      build_objects=values is not None, version=version, max_string_bytes=max_string_bytes)
    decoder.rows = rows
    if uses:
        decoder.uses = []
    try:
        obj = decoder.decode(root)
    except RecursionError:
        raise FormatError(
            "manifest: the object tree is nested deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}) allows to decode, although within max_depth="
            f"{max_depth}; files saved with the default limits never are") from None
    decoder.check_table(names, version)
    if meta is not None:
        Decoder([], max_depth, build_objects=False, version=version,
                max_string_bytes=max_string_bytes).decode_metadata(meta)
    return obj, decoder


def nodes(root: Any, tensor_count: int, max_depth: int) -> list[tuple[tuple, Any]]:
    """Every value node of a valid tree with its path, parents first, in canonical order.

    The decoder's own walk (:attr:`Decoder.visit`): list and tuple items and dict
    values are entries; keys, set members and ``_metadata`` slots are not, and a
    registered object's state's children appear under the object's path.
    """
    decoder = Decoder([None] * tensor_count, max_depth, build_objects=False)
    out: list[tuple[tuple, Any]] = []
    decoder.visit = lambda trail, node: out.append((trail, node))
    decoder.walk(root)
    return out
