"""``tensorcanon inspect``: what a file holds, as a person reads it (a table that fits the terminal)
or as JSON (docs/CLI.md).

The object tree is walked by the decoder's own walk (``tree.Decoder.visit``), streaming: each row is
printed, or written as a JSON entry, as the walk reaches it, and nothing is kept per row (the text
table is walked twice, once to size its columns). A list of plain values (a packed list of
300,000 ints, Python's random state, a learning-rate history) is one row summarized from its node,
never expanded into one Python object per item, and a random-number generator's state is one row
naming the generator. So inspect takes the memory of checking the tree (docs/SECURITY.md), whatever
the rows. The text view also shows as one row each the values whose parts a person does not read one
by one (the states the format specifies, such as DeterminismSettings; an OrderedDict's
``_metadata``; a dict of a few plain values); ``--json`` lists their parts too.

Every string from the file is printed escaped (``textout.printable``; keys inside paths and reprs
of values are already escaped, and the unprintable characters left in them are escaped as JSON
escapes ``\\u001b``: ``textout.json_escaped``), so that a file cannot write terminal control sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ..format import codecs, devices, digest, manifest, packed, paths, registry, tensorkinds, tree, walk
from ..format.errors import TensorCanonError
from ..format.limits import DEFAULT, Limits
from ..format.tree import Decoder
from ..io import reader, storage, writer
from ..trace import layout as trace_layout
from . import textout
from .diff import describe, detect_format, load_file

__all__ = ["run", "path_filter", "size_text", "PIPE_WIDTH"]

PIPE_WIDTH = 120
"""The width the text view fits when it writes to a file or a pipe (no terminal, no ``$COLUMNS``)."""
VALUE_ROOM = 100
"""At most this many characters of a value's text (its repr, or a summary of a list)."""
FIRST_ITEMS = 8
"""How many of a summarized list's first items are shown (and listed in ``--json``'s ``items``)."""
SHORT_MAPPING = 60
"""A dict of plain values whose repr is at most this long is one row of the text view."""

_CONTAINERS = {"dict": "dict", "odict": "OrderedDict", "list": "list", "tuple": "tuple",
               "set": "set", "frozenset": "frozenset", "counter": "Counter", "defaultdict": "defaultdict",
               "deque": "deque"}
_MAPPINGS = ("dict", "odict", "counter", "defaultdict")
_SEQUENCES = ("list", "tuple", "deque", "set", "frozenset")
_TORCH_VALUES = {"size": "torch.Size", "dtype": "torch.dtype", "device": "torch.device"}
_LEAVES = frozenset({str, int, float, bool, type(None), bytes, msgpack.ExtType})
_ITEM_NAMES = {str: "str", int: "int", float: "float", bool: "bool", type(None): "None", bytes: "bytes",
               msgpack.ExtType: "int"}
_PLURAL = {"str": "strs", "int": "ints", "float": "floats", "bool": "bools", "None": "Nones", "bytes": "bytes values"}
_OPEN_CLOSE = {"list": ("[", "]"), "tuple": ("(", ")"), "deque": ("deque([", "])"), "set": ("{", "}"),
               "frozenset": ("frozenset({", "})")}


# --------------------------------------------------------------------------- the command line

EXIT_OK, EXIT_ERROR = 0, 2  # (tools/cli.py's)
_READ_ERRORS = (TensorCanonError, OSError)


def path_filter(pattern: str) -> Callable[[str], bool]:
    """Whether a path (as inspect shows it) is selected by ``--path PATTERN``: the path, or a path
    above it, matches PATTERN, where ``*`` is any text and ``?`` one character and everything else
    stands for itself (``[`` and ``]`` too); a PATTERN that does not start with ``$`` may match
    anywhere in the path."""
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    compiled = re.compile(f"{body}(?:\\[.*)?" if pattern.startswith("$") else f".*{body}.*", re.S)
    return lambda path: compiled.fullmatch(path) is not None


def run(args: argparse.Namespace, out: Any, message: Callable[[BaseException, str], str],
        checkpoint_dir: Callable[[Any], bool]) -> int:
    """``tensorcanon inspect FILE`` (tools/cli.py): ``out`` is the command line's output, ``message``
    its text of an error about a path, ``checkpoint_dir`` whether a target is a checkpoint directory."""
    path = storage.redact(args.file)  # a URL is shown without credentials
    select = _Select(getattr(args, "depth", None), getattr(args, "tensors", False), getattr(args, "path", None))
    sharded = None
    try:
        metadata, algorithm, version = None, digest.DEFAULT, manifest.VERSION
        target = storage.resolve(args.file)  # a URL: an object in a store, of which only the header is read
        if isinstance(target, storage.Location) and checkpoint_dir(target):  # a checkpoint directory URL
            from ..sharded import layout, tools

            sharded = tools.describe(target)
            fmt, size = layout.FORMAT, sharded["size"]
        elif isinstance(target, storage.Location):
            from ..io import remote

            target = target.but(sequential=False)
            fmt, size = detect_format(target), remote.size(target)
        elif os.path.isdir(target):  # a sharded checkpoint: its logical tree, and how it is laid out
            from ..sharded import layout, tools

            sharded = tools.describe(target)
            fmt, size = layout.FORMAT, sharded["size"]
        elif trace_layout.is_trace(target):  # a trace of a training run: its header and records, summed up
            return _trace(target, path, out, message)
        else:
            fmt = detect_format(target)
            size = os.path.getsize(target)
        if sharded is not None:
            root, table, file_digest, algorithm = (sharded["root"], sharded["table"], sharded["digest"],
                                                   sharded["algorithm"])
        elif fmt == "tensorcanon":
            with reader.open_file(target, DEFAULT) as cf:
                cf.check_tree()
                m = cf.manifest
                assert m is not None
                root, table, file_digest, algorithm = m.root, m.tensors, m.text(), m.algorithm
                version = m.version
                try:
                    metadata = cf.metadata()
                except TensorCanonError as e:
                    metadata = f"<cannot decode: {e}>"
        else:  # (a plain safetensors file: its tensors' bytes, without torch)
            loaded = load_file(target, wrap=out.wrap("read"), stored=True)
            p = writer.plan(loaded.value, None, DEFAULT)
            file_digest = writer.fingerprint(p)
            root, table = p.root, p.tensors
        head = _Head(path, fmt, version, file_digest, metadata, size, sharded, algorithm)
        if out.as_json:
            _write_json(out, head, root, table, select)
        else:
            _write_text(out, head, root, table, select)
    except _READ_ERRORS as e:
        if isinstance(e, BrokenPipeError):  # the reader of the output went away: cli.main's to handle
            raise
        out.error(message(e, path))
        return EXIT_ERROR
    finally:
        out.close_bars()
    return EXIT_OK


class _Head:
    """What inspect says about a file above its tree."""

    def __init__(self, path: str, fmt: str, version: int, file_digest: str, metadata: Any, size: int,
                 sharded: dict | None, algorithm: str) -> None:
        self.path, self.fmt, self.digest, self.metadata, self.size = path, fmt, file_digest, metadata, size
        self.sharded, self.algorithm = sharded, algorithm
        if fmt == "tensorcanon":
            self.format_text = f"tensorcanon (format version {version})"
        else:
            self.format_text = f"{fmt} (no tensorcanon manifest: digests are those tensorcanon convert would record)"
        self.layout = None
        if sharded is not None:
            self.format_text = (f"sharded checkpoint, {sharded['world_size']} rank file(s); digest and entries "
                                "are its logical content (the same for every world size)")
            self.layout = {"world_size": sharded["world_size"], "files": sharded["files"],
                           "chunks": sharded["chunks"], "per_rank": sharded["per_rank"]}

    def totals(self, walker: _Walk) -> dict[str, Any]:
        return {"entries": walker.entries, "tensors": walker.tensors, "unique_tensors": len(walker.first_path),
                "tensor_bytes": walker.tensor_bytes, "file_bytes": self.size,
                **({"stored_bytes": self.sharded["stored_size"]} if self.sharded is not None else {})}


# --------------------------------------------------------------------------- rows

class Row:
    """One row of inspect: a value at a path. ``items`` (a summarized list: count, item types, first
    items) and ``folded`` (the text view shows the value's parts in this row) are inspect's own."""

    __slots__ = ("path", "depth", "type", "dtype", "shape", "device", "nbytes", "digest", "value", "same_as",
                 "items", "folded")

    def __init__(self, path: str, depth: int, type_: str) -> None:
        self.path, self.depth, self.type = path, depth, type_
        self.dtype: str | None = None
        self.shape: list[int] | None = None
        self.device: str | None = None
        self.nbytes: int | None = None
        self.digest: str | None = None
        self.value: str | None = None
        self.same_as: str | None = None
        self.items: dict[str, Any] | None = None
        self.folded = False

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def entry(self) -> dict[str, Any]:
        """The row as ``--json`` lists it."""
        out: dict[str, Any] = {"path": self.path, "type": self.type, "dtype": self.dtype, "shape": self.shape,
               "device": self.device, "bytes": self.nbytes, "digest": self.digest, "value": self.value,
               "same_as": self.same_as}
        if self.items is not None:
            out["items"] = self.items
        return out


class _Select:
    """Which rows are shown: ``--depth``, ``--tensors``, ``--path``."""

    def __init__(self, depth: int | None, tensors: bool, pattern: str | None) -> None:
        self.depth, self.tensors, self.pattern = depth, tensors, pattern
        self.match = path_filter(pattern) if pattern is not None else None

    @property
    def all(self) -> bool:
        return self.depth is None and not self.tensors and self.match is None

    def __call__(self, row: Row) -> bool:
        if self.depth is not None and row.depth > self.depth:
            return False
        if self.tensors and not row.is_tensor:
            return False
        return self.match is None or self.match(row.path)


class _Walk:
    """The rows of a tree, in canonical order, handed to ``emit`` as the decoder's walk reaches them.

    ``fold``: the text view, where a value whose parts a person does not read one by one is one row
    (its parts are still walked, so that their tensors count, but not shown). Lists of plain values
    and random states are one row in both views, and their parts are not walked at all."""

    def __init__(self, table: Sequence[Any], algorithm: str, emit: Callable[[Row], None],
                 select: Callable[[Row], bool], fold: bool, limits: Limits = DEFAULT) -> None:
        self.table, self.algorithm, self.emit, self.select, self.fold = table, algorithm, emit, select, fold
        self.limits = limits
        self.values = Decoder([None] * len(table), limits.max_depth, build_objects=False)  # leaves' values
        self.first_path: dict[int, str] = {}  # tensor index -> the path of its first use
        self.entries = self.tensors = self.tensor_bytes = self.shown = 0
        self._hide_below: int | None = None  # the depth of a folded value, while the walk is inside it

    def run(self, root: Any) -> None:
        decoder = Decoder([None] * len(self.table), self.limits.max_depth, build_objects=False)
        decoder.visit = self.visit
        decoder.walk(root)

    def visit(self, trail: tuple, node: Any) -> bool:
        """One value of the walk; True when the walk is not to go into it (tree.Decoder.visit)."""
        depth = len(trail)
        if self._hide_below is not None and depth <= self._hide_below:
            self._hide_below = None
        hidden = self._hide_below is not None
        self.entries += 1
        row = Row(paths.join(trail), depth, "")
        skip = self._describe(row, node, trail)
        if row.folded and not hidden:
            self._hide_below = depth
        if not hidden and self.select(row):
            self.shown += 1
            self.emit(row)
        if not skip and tree.tag_of(node) == "odict" and node[1] is not None:  # an OrderedDict's _metadata slot
            self._metadata(trail, node[1], hidden or row.folded)
        return skip

    def _metadata(self, trail: tuple, meta: Any, hidden: bool) -> None:
        """The row of an OrderedDict's ``_metadata`` (torch's module versions): the decoder walks
        its values but not the slot itself."""
        self.entries += 1
        row = Row(paths.join((*trail, walk.METADATA)), len(trail) + 1, "metadata")
        if tree.tag_of(meta) in _MAPPINGS:
            keys = _mapping_keys(meta)
            row.value = _count(len(keys), "key") + _first_keys(keys)
        else:
            row.value = _safe(paths.show(self.values.decode(meta), VALUE_ROOM))
        row.folded = self.fold
        if not hidden and self.select(row):
            self.shown += 1
            self.emit(row)
        if row.folded and not hidden:
            self._hide_below = len(trail) + 1

    def _describe(self, row: Row, node: Any, trail: tuple) -> bool:
        """Fill ``row`` for ``node``; True when the walk is not to go into it."""
        tag = tree.tag_of(node)
        with_attributes = tag == "tensor.attrs"  # a tensor with attributes set on it (FORMAT.md §6.12.4)
        if with_attributes:
            node = node[1]
            tag = tree.tag_of(node)
        skip = False
        if tag == "tensor":
            self._tensor(row, node[1])
        elif tag in _MAPPINGS:
            skip = self._mapping(row, node, tag)
        elif tag in _SEQUENCES:
            skip = self._sequence(row, node, tag)
        elif tag == "ints":
            _ints(row, node)
            skip = True
        elif tag == "records":
            _records(row, node)
            skip = True
        elif tag == "np.strings":  # (a checked node: kind, width, ndim, the dimensions)
            row.type, row.value = "ndarray", f"{node[1]}{node[2]} array of shape {list(node[4:4 + node[3]])}"
        elif tag == "obj":
            self._object(row, node)
        elif tag in tensorkinds.TAGS:  # sparse, nested and meta tensors (FORMAT.md §6.12)
            shown = tensorkinds.row_of(node, self.table)
            row.type, row.value = shown["type"], _safe(shown["value"])
        elif tag in _TORCH_VALUES:  # shown as torch prints it, without torch
            row.type, row.value = _TORCH_VALUES[tag], _torch_value_text(node)
        elif tag is not None and tag.startswith("rng."):  # a random state: one row naming the generator
            row.type, row.value = _rng(node)
            skip = True
        else:
            value = self.values.decode(node)
            row.type = describe(value).split(" ", 1)[0]
            row.value = _safe(paths.show(value, VALUE_ROOM))
        if with_attributes:
            row.type = f"{row.type} with attributes"
        return skip

    def _tensor(self, row: Row, index: int) -> None:
        info = self.table[index]
        row.type, row.dtype, row.shape, row.device = info.kind, info.dtype.name, list(info.shape), info.device
        row.nbytes, row.digest = info.nbytes, digest.to_text(info.digest, self.algorithm)
        self.tensors += 1
        first = self.first_path.get(index)
        if first is not None:
            row.same_as = first
        else:
            self.first_path[index] = row.path
            self.tensor_bytes += info.nbytes

    def _mapping(self, row: Row, node: Sequence[Any], tag: str) -> bool:
        row.type = _CONTAINERS[tag]
        start = tree.first_item(tag)
        n = (len(node) - start) // 2
        row.value = _count(n, "key")
        state = _raw_rng_state(node, tag)
        if state is not None:  # (its parts are rows of --json)
            row.value, row.folded = state, self.fold
            return False
        if not self.fold or n == 0:
            return False
        keys, values = node[start::2], node[start + 1::2]
        if _all_leaves(values) and _all_leaves(keys):
            text = _brief({_leaf(k): _leaf(v) for k, v in zip(keys, values, strict=True)}, SHORT_MAPPING + 1)
            if len(text) <= SHORT_MAPPING:
                row.value, row.folded = _safe(text), True
        return False

    def _sequence(self, row: Row, node: Sequence[Any], tag: str) -> bool:
        row.type = _CONTAINERS[tag]
        start = 2 if tag == "deque" else 1
        items = node[start:]
        state = _raw_rng_state(node, tag) if tag == "tuple" else None
        if state is not None:  # (its parts are rows of --json)
            row.value, row.folded = state, self.fold
            return False
        if not _all_leaves(items):
            if tag == "list" and packed.should_pack(items) == "records":  # (a version-2 file's, as version 3's)
                _record_dicts(row, items)
                return True
            row.value = _count(len(items), "item")
            return False
        # a list of plain values: one row, its items summarized from the node (never one row each)
        first = [_leaf(v) for v in items[:FIRST_ITEMS]]
        kinds = sorted({_ITEM_NAMES[type(v)] for v in items})
        row.value = _items_text(tag, len(items), kinds, first, node[1] if tag == "deque" else None)
        if items:
            row.items = {"count": len(items), "types": kinds, "first": [_jsonable_leaf(v) for v in first]}
        return True

    def _object(self, row: Row, node: Sequence[Any]) -> None:
        name = node[1]
        if registry.specified(name) is None:  # a registered type of the user's: its fields are rows
            row.type, row.value = "object", textout.printable(name)
            return
        row.type = textout.printable(name.rsplit(".", 1)[-1])
        state = self.values.plain(node[2])
        row.value = _safe(_specified_text(name, state))
        row.folded = self.fold and _plain(state)  # (an argparse.Namespace holding a tensor: its fields are rows)


def _plain(v: Any) -> bool:
    """Whether ``v`` (Decoder.plain's) holds plain values only, no stand-in of a tensor or an object."""
    t = type(v)
    if t in (list, tuple):
        return all(map(_plain, v))
    if t is dict:
        return all(map(_plain, v.values()))
    return t in _LEAVES


# --------------------------------------------------------------------------- what a row says

def _count(n: int, unit: str) -> str:
    return f"{n:,} {unit}{'s' if n != 1 else ''}"


def _safe(text: str) -> str:
    """``text`` that is already escaped (a path, a repr) with every unprintable character left in it
    (C1 controls, bidi characters, the line separators U+2028 and U+2029) as a JSON escape (a path's
    keys are JSON strings): :func:`textout.json_escaped`."""
    return textout.json_escaped(text)


def _all_leaves(values: Sequence[Any]) -> bool:
    return set(map(type, values)) <= _LEAVES


def _leaf(v: Any) -> Any:
    """A plain value of a node as Python holds it (a big int's ext as the int)."""
    if type(v) is msgpack.ExtType:
        return int.from_bytes(v.data, "big", signed=True)
    return v


def _jsonable_leaf(v: Any) -> Any:
    if type(v) is int:
        return v if -(2**64) < v < 2**64 else paths.show(v, VALUE_ROOM)
    if type(v) is float:
        return v if math.isfinite(v) else repr(v)
    if type(v) is bytes:
        return paths.show(v, VALUE_ROOM)
    return v


def _brief(v: Any, limit: int) -> str:
    """``repr(v)``, built no further than ``limit`` characters (then cut with ``...``), whatever the
    size of ``v``: a value's text never costs memory in proportion to the value."""
    parts: list[str] = []
    room = [limit + 1]

    def put(text: str) -> bool:
        parts.append(text)
        room[0] -= len(text)
        return room[0] > 0

    def go(x: Any) -> bool:
        t = type(x)
        if t is dict:
            if not put("{"):
                return False
            for i, (k, w) in enumerate(x.items()):
                if (i and not put(", ")) or not go(k) or not put(": ") or not go(w):
                    return False
            return put("}")
        if t in (list, tuple):
            open_, close = ("[", "]") if t is list else ("(", ")")
            if not put(open_):
                return False
            for i, w in enumerate(x):
                if (i and not put(", ")) or not go(w):
                    return False
            return put("," + close if t is tuple and len(x) == 1 else close)
        return put(paths.show(x, max(room[0], 8)))

    go(v)
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _items_text(tag: str, n: int, kinds: list[str], first: list[Any], maxlen: Any = None) -> str:
    """A list of plain values in a line: its repr when short, else how many of what, and the first."""
    open_, close = _OPEN_CLOSE[tag]
    if maxlen is not None:  # (a deque's)
        close = f"], maxlen={maxlen})"
    if n <= len(first):
        text = open_ + ", ".join(_brief(v, VALUE_ROOM) for v in first) + ("," if tag == "tuple" and n == 1 else "")
        text += close
        if n == 0 and tag in ("tuple", "set", "frozenset"):
            text = {"tuple": "()", "set": "set()", "frozenset": "frozenset()"}[tag]
        if len(text) <= SHORT_MAPPING:
            return _safe(text)
    what = _PLURAL[kinds[0]] if len(kinds) == 1 else f"items ({', '.join(kinds)})"
    text = f"{n:,} {what}: " + ", ".join(_brief(v, 24) for v in first) + (", ..." if n > len(first) else "")
    if maxlen is not None:
        text = f"maxlen={maxlen}, {text}"
    return _safe(_clip(text))


def _clip(text: str, limit: int = VALUE_ROOM) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_STRUCT_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}


def _ints(row: Row, node: Sequence[Any]) -> None:
    """A packed list of ints (FORMAT.md §6.13.1), from its bytes: the first items only are read."""
    name, data = node[1], node[2]
    size = next(r[1] for r in packed.INT_DTYPES if r[0] == name)
    n = packed.item_count(node)
    k = min(n, FIRST_ITEMS)
    code = _STRUCT_CODES[size] if name.startswith("int") else _STRUCT_CODES[size].upper()
    first = list(struct.unpack_from(f"<{k}{code}", data))
    row.type = "list"
    row.value = _clip(f"{n:,} ints: " + ", ".join(map(str, first)) + (", ..." if n > k else ""))
    row.items = {"count": n, "types": ["int"], "first": first}


def _records(row: Row, node: Sequence[Any]) -> None:
    """A packed list of dicts of plain values (FORMAT.md §6.13.2): its first rows only are built."""
    schemas, rows = node[1], node[2:]
    first = [dict(zip(schemas[r[0]], map(_leaf, r[1:]), strict=True)) for r in rows[:3]]
    _dicts(row, len(rows), schemas[0], len(schemas), first)


def _record_dicts(row: Row, items: Sequence[Any]) -> None:
    """The list of ``dict`` nodes a version-2 file holds where a version-3 file holds ``records``:
    shown as that node is."""
    keys = {tuple(d[1::2]) for d in items}
    first = [dict(zip(map(_leaf, d[1::2]), map(_leaf, d[2::2]), strict=True)) for d in items[:3]]
    _dicts(row, len(items), items[0][1::2], len(keys), first)


def _dicts(row: Row, n: int, keys: Sequence[Any], key_sets: int, first: list[dict]) -> None:
    shown = ", ".join(_brief(k, 24) for k in keys[:FIRST_ITEMS]) + (", ..." if len(keys) > FIRST_ITEMS else "")
    more = f" and {key_sets - 1:,} other key set{'s' if key_sets > 2 else ''}" if key_sets > 1 else ""
    row.type = "list"
    row.value = _safe(_clip(f"{n:,} dicts (keys {shown}{more}): "
                            + ", ".join(_brief(d, 40) for d in first) + (", ..." if n > 3 else "")))
    row.items = {"count": n, "types": ["dict"],
                 "first": [{k: _jsonable_leaf(v) for k, v in d.items()} for d in first]}


def _mapping_keys(node: Sequence[Any]) -> list[Any]:
    return list(node[tree.first_item(node[0])::2])


def _first_keys(keys: list[Any]) -> str:
    if not keys or not _all_leaves(keys):
        return ""
    shown = ", ".join(_brief(_leaf(k), 24) for k in keys[:4])
    return _safe(_clip(f": {shown}{', ...' if len(keys) > 4 else ''}", 80))


def _torch_value_text(node: Any) -> str:
    """``repr()`` of the torch value a checked ``size``, ``dtype`` or ``device`` node holds, made
    without torch (which ``inspect`` does not import)."""
    tag = node[0]
    if tag == "size":
        return _clip(f"torch.Size({list(node[1:])!r})")
    if tag == "dtype":
        return f"torch.{node[1]}"
    parsed = devices.parse(node[1])
    assert parsed is not None  # the tree was checked
    kind, index = parsed
    return f"device(type={kind!r})" if index is None else f"device(type={kind!r}, index={index})"


# --------------------------------------------------------------------------- random states

def _u64(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset:offset + 8], "little")


def _torch_generator(device: str, state: bytes) -> str:
    """A torch generator's state (FORMAT.md §6.7.1) in words: its algorithm and seed."""
    if len(state) == 5056:  # CPUGeneratorImplState: the initial seed first
        return f"torch {device} (MT19937, seed {_u64(state, 0)})"
    if len(state) == 16:  # CUDA and XPU: seed and Philox offset
        return f"torch {device} (Philox, seed {_u64(state, 0)}, offset {_u64(state, 8)})"
    return f"torch {device} ({len(state):,}-byte state)"


def _bitgen(node: Sequence[Any]) -> str:
    """``numpy PCG64 (seed 5)``: a checked ``rng.bitgen`` node."""
    name, seed_seq = node[1], node[2]
    text = f"{name}"
    details = []
    if name == "MT19937" and len(node) == 5 and type(node[4]) is int:
        details.append(f"pos {node[4]}")
    entropy = seed_seq[1] if tree.tag_of(seed_seq) == "tuple" and len(seed_seq) == 5 else None
    if type(entropy) is int:
        details.append(f"seed {entropy}")
    return text + (f", {', '.join(details)}" if details else "")


def _rng(node: Sequence[Any]) -> tuple[str, str]:
    """(type, summary) of a checked random-state node (FORMAT.md §6.7)."""
    tag = node[0]
    if tag == "rng.random":
        cached = ", gauss_next cached" if node[4] is not None else ""
        return "Random", f"python random (MT19937, pos {node[3]}{cached})"
    if tag == "rng.torch":
        return "Generator", _torch_generator(node[1], node[2])
    if tag == "rng.numpy":
        return "Generator", f"numpy Generator ({_bitgen(node[1])})"
    if tag == "rng.legacy":
        cached = ", gauss cached" if node[1] else ""
        return "RandomState", f"numpy RandomState ({_bitgen(node[3])}{cached})"
    if tag == "rng.bitgen":
        return "BitGenerator", f"numpy {_bitgen(node)}"
    if tag == "rng.state":  # RngState.capture(): every generator of the process
        _, py, leg, cpu, cuda, mps, xpu = node
        parts = [f"python (MT19937, pos {py[3]})", f"numpy ({_bitgen(leg[3])})", _torch_generator("cpu", cpu)]
        for kind, states in (("cuda", cuda[1:]), ("xpu", xpu[1:])):
            if states:
                parts.append(_count(len(states), f"{kind} generator"))
        if mps is not None:
            parts.append("mps")
        return "RngState", ", ".join(parts)
    return tag, "random state"  # pragma: no cover - every rng tag is above


def _raw_rng_state(node: Sequence[Any], tag: str) -> str | None:
    """A random state saved as the plain value its library returns: ``random.getstate()`` and
    ``numpy.random.get_state()`` (a tuple, or the dict of ``legacy=False``), named; else None."""
    if tag == "tuple" and len(node) == 4 and node[1] == 3 and type(node[1]) is int \
            and tree.tag_of(node[2]) == "tuple" and len(node[2]) == 626 and type(node[3]) in (float, type(None)):
        pos = node[2][-1]
        if type(pos) is int:
            return f"python random.getstate() (MT19937, pos {pos})"
    if tag == "tuple" and len(node) == 6 and node[1] == "MT19937" and type(node[3]) is int:
        return f"numpy.random.get_state() (MT19937, pos {node[3]})"
    if tag == "dict" and len(node) >= 5:
        keys = node[1::2]
        if "bit_generator" in keys and "state" in keys:
            name = node[2 + 2 * keys.index("bit_generator")]
            if type(name) is str:
                return f"numpy bit generator state ({_safe(paths.show(name, 40))})"
    return None


class _Part:
    """A part of a value's state that is not a plain value (a tensor, an object): its own row."""

    def __repr__(self) -> str:
        return "<...>"


def _parts_marked(v: Any) -> Any:
    """Decoder.plain's value with every stand-in for a tensor or an object as ``<...>``."""
    t = type(v)
    if t is list or t is tuple:
        return t(map(_parts_marked, v))
    if t is dict:
        return {k: _parts_marked(w) for k, w in v.items()}
    return v if t in _LEAVES else _Part()


def _specified_text(name: str, state: Any) -> str:
    """A value of a type whose state the format specifies (registry.specify), in a line."""
    if name == "tensorcanon.DeterminismSettings" and type(state) is dict:
        s = state
        on = [what for key, what in (("deterministic_algorithms", "deterministic algorithms"),
                                     ("cudnn_deterministic", "cuDNN deterministic"),
                                     ("cudnn_benchmark", "cuDNN benchmark")) if s.get(key) is True]
        versions = [f"{lib} {s[key]}" for lib, key in (("torch", "torch_version"), ("numpy", "numpy_version"),
                                                        ("CUDA", "cuda_version")) if type(s.get(key)) is str]
        threads = [f"{s['num_threads']} threads"] if type(s.get("num_threads")) is int else []
        return _clip(", ".join([*(on or ["deterministic algorithms off"]), *versions, *threads]))
    if name == codecs.PATH and type(state) is list and len(state) == 2:  # [kind, text]
        return _clip(f"{state[0]}({_brief(state[1], VALUE_ROOM)})")
    state = _parts_marked(state)
    short = name.rsplit(".", 1)[-1]
    if type(state) is dict and all(type(k) is str for k in state):  # Namespace(lr=0.1, ...)
        args = ", ".join(f"{k}={_brief(v, 40)}" for k, v in list(state.items())[:FIRST_ITEMS])
        return _clip(f"{short}({args}{', ...' if len(state) > FIRST_ITEMS else ''})")
    if type(state) in (list, tuple):
        return _clip(f"{short}({_brief(list(state), VALUE_ROOM)[1:-1]})")
    return _clip(f"{short}({_brief(state, VALUE_ROOM)})")


# --------------------------------------------------------------------------- JSON

def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict) and all(type(k) is str for k in v):
        return {k: _jsonable(x) for k, x in v.items()}
    return repr(v)


def _write_json(out: Any, head: _Head, root: Any, table: Sequence[Any], select: _Select) -> None:
    """The JSON document, written as the walk goes: the same text ``json.dumps(indent=2)`` gives
    for the whole, without holding it (or a row per entry)."""

    def put(text: str) -> None:
        out.stdout.write(textout.json_for_stream(textout.json_safe(text), out.stdout))

    def dumped(v: Any, indent: str) -> str:
        text = json.dumps(textout.utf8(v), indent=2, ensure_ascii=False, allow_nan=False)
        return text.replace("\n", "\n" + indent)

    put("{\n")
    for key, value in (("file", head.path), ("format", head.fmt), ("digest", head.digest),
                       ("metadata", _jsonable(head.metadata))):
        put(f"  {json.dumps(key)}: {dumped(value, '  ')},\n")
    put('  "entries": [')
    count = [0]

    def emit(row: Row) -> None:
        put(("," if count[0] else "") + "\n    " + dumped(row.entry(), "    "))
        count[0] += 1

    walker = _Walk(table, head.algorithm, emit, select, False)
    walker.run(root)
    put("\n  ]" if count[0] else "]")
    put(f',\n  "totals": {dumped(head.totals(walker), "  ")}')
    if head.layout:
        put(f',\n  "layout": {dumped(head.layout, "  ")}')
    put("\n}\n")


# --------------------------------------------------------------------------- text

def size_text(n: int) -> str:
    """``298,788 bytes (292 KiB)``: bytes with thousands separators, and in binary units from 1 KiB."""
    text = f"{n:,} byte{'s' if n != 1 else ''}"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        if value < 1:
            break
        if value < 1024 or unit == "EiB":
            return f"{text} ({value:.1f} {unit})" if value < 10 else f"{text} ({value:.0f} {unit})"
    return text


class _Widths:
    """The widths of the text table's columns, from a first walk over the rows shown."""

    def __init__(self) -> None:
        self.path = self.type = self.dtype = self.shape = self.device = self.nbytes = self.digest = 0
        self.devices: set[str] = set()
        self.tensor_rows = 0
        self.path_lengths: dict[int, int] = {}  # length -> rows (a few hundred lengths at most)

    def add(self, row: Row, cells: _Cells) -> None:
        self.path = max(self.path, len(cells.path))
        self.path_lengths[len(cells.path)] = self.path_lengths.get(len(cells.path), 0) + 1
        self.type = max(self.type, len(cells.type))
        if row.is_tensor:
            self.tensor_rows += 1
            self.dtype = max(self.dtype, len(cells.dtype))
            self.shape = max(self.shape, len(cells.shape))
            self.nbytes = max(self.nbytes, len(cells.nbytes))
            self.digest = max(self.digest, len(cells.digest))
            self.devices.add(cells.device)


class _Cells:
    """A row's text, before it is fitted to the columns."""

    __slots__ = ("path", "type", "dtype", "shape", "device", "nbytes", "digest", "value", "note")

    def __init__(self, row: Row) -> None:
        self.path = _safe(row.path)
        self.type = _safe(row.type).replace(" with attributes", "+attrs")
        self.dtype = row.dtype or ""
        self.shape = "" if row.shape is None else str(row.shape)
        self.device = row.device or ""
        self.nbytes = "" if row.nbytes is None else f"{row.nbytes:,}"
        self.digest = row.digest or ""
        self.value = row.value or ""
        self.note = f"same tensor as {_safe(row.same_as)}" if row.same_as else ""


_GAP = 2
_TYPE_ROOM, _SHAPE_ROOM, _DIGEST_MIN, _PATH_WANTED, _VALUE_LINES = 12, 16, 11, 40, 3


class _Layout:
    """Where each column of the text table goes at a width: PATH gets the room its longest path
    needs when it can; a path longer than its column is printed whole on a line of its own (on a
    terminal, wrapped between its keys), the row's cells on the next; a digest that does not fit
    loses its algorithm prefix, then its end, and at last its column; a note (``same tensor as``)
    that does not fit its cell goes on a line of its own below its row."""

    def __init__(self, w: _Widths, width: int, terminal: bool) -> None:
        self.width, self.terminal = width, terminal
        self.type = max(min(w.type, _TYPE_ROOM), len("TYPE"))  # a longer type of a value moves its value right
        self.one_device = len(w.devices) <= 1
        self.tensors = w.tensor_rows > 0
        if self.tensors:
            self.dtype = max(w.dtype, len("DTYPE"))
            self.shape = max(min(w.shape, _SHAPE_ROOM), len("SHAPE"))
            self.device = 0 if self.one_device else max(w.device, len("DEVICE"))
            self.nbytes = max(w.nbytes, len("BYTES"))
            cells = self.dtype + _GAP + self.shape + _GAP + (self.device + _GAP if self.device else 0) + self.nbytes
        else:
            self.dtype = self.shape = self.device = self.nbytes = 0
            cells = 0
        fixed = self.type + _GAP + cells  # after PATH and its gap
        rest = width - fixed - _GAP  # PATH, and the digest with its gap
        need = max(w.path, len("PATH"))
        if not self.tensors:
            self.path, self.digest = min(need, max(width - fixed - _GAP, 4)), 0
        elif need + _GAP + w.digest <= rest or need + _GAP + _DIGEST_MIN <= rest:
            self.path, self.digest = need, min(w.digest, rest - need - _GAP)
        else:  # the digest keeps a column if PATH's still holds most paths (or 40 characters)
            path = rest - _GAP - _DIGEST_MIN
            if path >= min(self._most(w), _PATH_WANTED):
                self.path, self.digest = path, _DIGEST_MIN
            else:
                self.path, self.digest = max(min(need, rest), 4), 0
        self.value_at = self.path + _GAP + self.type + _GAP  # where a value that is not a tensor starts

    @staticmethod
    def _most(w: _Widths) -> int:
        """The length of path that 3 in 4 rows' paths do not exceed."""
        total, seen = sum(w.path_lengths.values()), 0
        for length in sorted(w.path_lengths):
            seen += w.path_lengths[length]
            if seen * 4 >= total * 3:
                return length
        return w.path

    def header(self) -> str:
        cells = ["PATH".ljust(self.path), "TYPE".ljust(self.type)]
        if not self.tensors:
            return "  ".join([*cells, "VALUE"])
        cells += ["DTYPE".ljust(self.dtype), "SHAPE".ljust(self.shape)]
        if self.device:
            cells.append("DEVICE".ljust(self.device))
        cells.append("BYTES".rjust(self.nbytes))
        if self.digest:
            cells.append("DIGEST")
        return "  ".join(cells).rstrip()

    def lines(self, row: Row, c: _Cells) -> list[str]:
        out: list[str] = []
        if len(c.path) <= self.path:
            first = c.path.ljust(self.path)
        else:  # a path longer than its column: whole, on lines of its own
            out += self._wrapped(c.path, "  ")
            first = " " * self.path
        if not row.is_tensor:  # the value from the DTYPE column on, wrapped to the width (up to 3 lines)
            at = self.value_at + max(len(c.type) - self.type, 0)
            room = max(self.width - at, 16)
            lines = textwrap.wrap(c.value, room, break_on_hyphens=False, drop_whitespace=False) or [""]
            if len(lines) > _VALUE_LINES:
                lines = [*lines[:_VALUE_LINES - 1], _clip("".join(lines[_VALUE_LINES - 1:]), room)]
            out.append(f"{first}  {c.type.ljust(self.type)}  {lines[0].rstrip()}".rstrip())
            out += [" " * at + line.strip() for line in lines[1:]]
            return out
        type_text = _fit_type(c.type, self.type).ljust(self.type)
        cells = [first, type_text, c.dtype.ljust(self.dtype), _fit(c.shape, self.shape).ljust(self.shape)]
        if self.device:
            cells.append(c.device.ljust(self.device))
        cells.append(c.nbytes.rjust(self.nbytes))
        note = c.note
        if self.digest:
            if note and len(note) <= self.digest:
                cells.append(note)
                note = ""
            else:
                cells.append(_digest_cell(c.digest, self.digest))
        elif note and len("  ".join(cells)) + _GAP + len(note) <= self.width:
            cells.append(note)
            note = ""
        out.append("  ".join(cells).rstrip())
        if note:
            out += self._wrapped(f"({note})", "    ", first_indent="    ")
        return out

    def _wrapped(self, text: str, indent: str, first_indent: str = "") -> list[str]:
        """``text`` (a path, or a note naming one) on lines of at most the width: whole on a pipe;
        on a terminal broken before its keys (``["...`` / ``[3]``), and inside a key too long for a
        line, never cut."""
        if not self.terminal:
            return [first_indent + text]
        return _wrap_path(text, self.width, first_indent, indent)


def _fit_type(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    last = text.rsplit(".", 1)[-1]
    return last if len(last) <= width else text[: max(width - 3, 1)] + "..."


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by an ellipsis in its middle (a shape: both ends count)."""
    if len(text) <= width:
        return text
    keep = max(width - 3, 2)
    head = (keep + 1) // 2
    return text[:head] + "..." + text[len(text) - (keep - head):]


def _digest_cell(text: str, width: int) -> str:
    """A digest in ``width`` characters: whole, without its ``xxh3-128:`` prefix, or its start."""
    if len(text) <= width:
        return text
    algorithm, colon, rest = text.partition(":")
    if colon and algorithm in digest.ALGORITHMS:
        text = rest
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


_BREAK = re.compile(r'(?=\[)|(?<=[._/ -])')


def _wrap_path(text: str, width: int, first_indent: str, indent: str) -> list[str]:
    """``text`` on lines of at most ``width`` characters, broken before a ``[`` where it can, else
    after a ``.``, ``_``, ``/``, space or ``-`` inside a key, else anywhere: every character kept."""
    lines: list[str] = []
    line = first_indent
    for piece in _BREAK.split(text):
        if len(line) + len(piece) > width and line.strip():
            lines.append(line)
            line = indent
        while len(line) + len(piece) > width:  # a piece longer than a line: split it
            room = max(width - len(line), 1)
            lines.append(line + piece[:room])
            piece, line = piece[room:], indent
        line += piece
    if line.strip():
        lines.append(line)
    return lines


def _write_text(out: Any, head: _Head, root: Any, table: Sequence[Any], select: _Select) -> None:
    width = textout.terminal_width(out.stdout)
    terminal = width is not None
    width = width or PIPE_WIDTH
    widths = _Widths()
    fold = not select.tensors  # (--tensors: every tensor, those inside a value shown in one row too)
    sizing = _Walk(table, head.algorithm, lambda row: widths.add(row, _Cells(row)), select, fold)
    sizing.run(root)
    layout = _Layout(widths, width, terminal)

    def field(name: str, text: str) -> None:  # wrapped to the width
        label = f"{name + ':':<10}"
        if len(label) + len(text) <= width:
            out.line(label + text)
            return
        for line in textwrap.wrap(text, max(width - 10, 20), initial_indent=label, subsequent_indent=" " * 10,
                                  break_on_hyphens=False):
            out.line(line)

    field("file", textout.printable(head.path))
    field("format", head.format_text)
    field("digest", head.digest)
    if head.layout:
        split = sum(1 for cs in head.layout["chunks"].values() if len(cs) > 1)
        per_rank = ", ".join(_safe(str(p)) for p in head.layout["per_rank"]) or "none"
        field("layout", f"{split} of {len(head.layout['chunks'])} tensors split into chunks; per-rank values at "
                        f"{per_rank}")
    if head.metadata is not None:
        field("metadata", _safe(_brief(head.metadata, 200)))
    if layout.tensors and layout.one_device and widths.devices:
        field("devices", f"every tensor on {next(iter(widths.devices))}")
    out.line()
    out.line(layout.header())
    def show(row: Row) -> None:
        for line in layout.lines(row, _Cells(row)):
            out.line(line)

    printing = _Walk(table, head.algorithm, show, select, fold)
    printing.run(root)
    out.line()
    t = head.totals(printing)
    size = f"file {size_text(t['file_bytes'])}"
    if head.sharded is not None:  # one definition of a checkpoint's size (lock records the same)
        size = (f"{size_text(t['file_bytes'])} as one file ({size_text(t['stored_bytes'])} in its "
                f"{head.sharded['world_size'] + 1} files)")
    total = (f"total: {_count(t['entries'], 'entry').replace('entrys', 'entries')}, "
             f"{_count(t['tensors'], 'tensor')} ({t['unique_tensors']:,} stored), "
             f"{size_text(t['tensor_bytes'])} of tensor data, {size}")
    for line in textwrap.wrap(total, max(width, 20), subsequent_indent="       "):
        out.line(line)
    if printing.shown != t["entries"]:
        if select.all:
            why = "a short dict, a random state or settings is one row (--json lists its parts)"
        else:
            why = "selected by " + " ".join(
                [*([f"--depth {select.depth}"] if select.depth is not None else []),
                 *(["--tensors"] if select.tensors else []),
                 *([f"--path {textout.printable(select.pattern)}"] if select.pattern is not None else [])])
        for line in textwrap.wrap(f"shown: {_count(printing.shown, 'row')} for {t['entries']:,} entries: {why}",
                                  max(width, 20), subsequent_indent="       "):
            out.line(line)


# --------------------------------------------------------------------------- traces

def _trace(target: str, path: str, out: Any, message: Callable[[BaseException, str], str]) -> int:
    """inspect of a trace of a training run (docs/TRACE.md): its header and its records summed up
    (read streaming), and what to do with it."""
    kinds: dict[str, int] = {}
    steps: list[int] = []
    try:
        with trace_layout.Reader(target, strict=False) as r:
            header = r.header
            first = last = None
            for record in r:
                kinds[record.kind] = kinds.get(record.kind, 0) + 1
                if first is None:
                    first = record.step
                last = record.step
            tail = r.tail
        if first is not None and last is not None:
            steps = [first, last]
    except _READ_ERRORS as e:
        out.error(f"{message(e, path)} (a trace of a training run: `tensorcanon verify` checks it, "
                  "`tensorcanon diverge A B` compares two)")
        return EXIT_ERROR
    ended = "complete" if tail.complete else f"incomplete: {tail.stopped}"
    out.json({"file": path, "format": trace_layout.FORMAT, "version": header.version, "level": header.level,
              "algorithm": header.algorithm, "rank": header.rank, "world_size": header.world_size,
              "records": tail.records, "steps": steps or None, "kinds": kinds, "complete": tail.complete,
              "stopped": tail.stopped or None})
    if out.as_json:
        return EXIT_OK
    width = textout.terminal_width(out.stdout) or PIPE_WIDTH
    lines = [
        ("file", textout.printable(path)),
        ("format", f"tensorcanon trace of a training run, version {header.version} (docs/TRACE.md)"),
        ("level", f"{header.level}; {header.algorithm} digests; rank {header.rank} of {header.world_size}"),
        ("records", f"{tail.records:,}" + (f", steps {steps[0]:,} to {steps[1]:,}" if steps else "") + f"; {ended}"),
    ]
    if kinds:
        lines.append(("kinds", ", ".join(f"{textout.printable(k)} {n:,}" for k, n in sorted(kinds.items()))))
    for name, text in lines:
        for line in textwrap.wrap(text, max(width - 10, 20), initial_indent=f"{name + ':':<10}",
                                  subsequent_indent=" " * 10, break_on_hyphens=False):
            out.line(line)
    out.line()
    for line in textwrap.wrap("A trace holds digests of a run, not a checkpoint: `tensorcanon diverge A B` finds "
                              "the first record where two traces differ; `tensorcanon verify FILE` checks every "
                              "frame of one.", max(width, 20)):
        out.line(line)
    return EXIT_OK
