"""Where two objects (or two files) differ, by path, and by how much.

:func:`diff` walks two values side by side in canonical order and records
every difference it finds as a :class:`Difference` at a path such as
``$["model"]["fc.weight"]``: keys added or removed, type, dtype or shape
changes, and, for tensors with the same dtype and shape, how many
elements differ, the largest absolute and relative difference and the first
differing index.

Equality, one rule. Two tensorcanon files (or sharded checkpoints) are identical exactly when
their file digests are equal (:func:`tensorcanon.format.digest.same_content`, which decides when
both use one algorithm and one format version): equal digests end the comparison, different
digests are a difference, and the walk of the values says where (:func:`compare_loaded`, the one
home of the verdict). A file's ties are the rows of its tensor table; dict keys and set members are
told apart as the file tells them (``1``, ``True`` and ``1.0`` are three keys); devices, which the
digest does not cover, are notes, not differences. Values of any other kind are compared by the walk.

Element comparison. With the default ``atol=0, rtol=0`` the comparison is
bit-exact, the same thing digests see: ``-0.0`` differs from ``0.0`` and two
NaNs are equal only when their bits are. With a tolerance, two elements match
when their bits are equal or ``|a - b| <= atol + rtol * |b|`` (as in
``torch.isclose``, B is the reference), with NaN matching NaN. Statistics are
computed in float64 (complex128 for complex dtypes). Values that differ within the tolerance are
counted (:attr:`DiffResult.tolerated`): not differences, and not :attr:`DiffResult.identical`.

Files. A ``str`` or path-like argument is read as a file: a tensorcanon file,
a plain safetensors file, a ``.pt`` file (through ``torch.load`` with
``weights_only=True``, never plain pickle), a ``.npz`` or a ``.npy`` file; a
directory, as a sharded checkpoint (``tensorcanon.dcp``), by its logical state.
Tensors are loaded to the CPU; the devices a tensorcanon file records are still
compared (as notes). To compare two ``str`` values, wrap them: ``diff([a], [b])``. A URL
(``s3://bucket/key``...) is read from its store, with ``storage_options``.

Example::

    result = tensorcanon.diff("run1/ckpt.safetensors", "run2/ckpt.safetensors", atol=1e-6)
    if result:                       # truthy when something differs
        print(result)                # one line per difference
        worst = result.differences[0]
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import os
import random
import re
import struct
import sys
import weakref
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..format import container, digest, dtypes, optional, packed, paths, registry, tensorbytes, tensorkinds, tree, walk
from ..format.errors import FormatError, LimitError, TensorCanonError, UnsupportedTypeError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.ordering import UnorderableKey, sorted_keys
from ..io import reader, storage
from ..io.source import Source, directory_error, open_path
from . import textout

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())  # imported on first use: reading .pt files, comparing values
    np = optional.numpy_module(globals())

__all__ = ["diff", "compare_loaded", "DiffResult", "Difference", "TensorStats", "load_file", "detect_format",
           "Loaded", "open_lazily"]

#: Kinds of difference, in the words used by :class:`Difference.kind`.
KINDS = ("added", "removed", "type", "value", "length", "order", "metadata",
         "dtype", "shape", "device", "requires_grad", "alias", "values", "items", "rng", "digest")
#: Kinds of :attr:`DiffResult.notes`: what differs outside the content (the file digest does not
#: cover it, docs/FORMAT.md §7.2), reported without making two values differ.
NOTE_KINDS = ("device",)

_CHUNK_ELEMENTS = 1 << 22  # elements compared at a time, to bound the memory used
_SHOWN = 60  # characters of each side of a value difference kept in the Difference (around where they differ)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TensorStats:
    """How two tensors of the same dtype and shape differ element by element."""

    numel: int                       # elements in each tensor
    count: int                       # elements that differ
    max_abs: float | None            # largest |a - b| over differing elements (None: dtype has no numbers)
    max_rel: float | None            # largest |a - b| / |b| (inf where b is 0)
    first_index: tuple[int, ...]     # index of the first differing element, in C order
    first_a: Any                     # the values there (Python scalars, or bit patterns as hex str)
    first_b: Any

    def __str__(self) -> str:
        text = f"{self.count} of {self.numel} elements differ"
        if self.max_abs is not None:
            text += f"; max abs diff {_num(self.max_abs)}, max rel diff {_num(self.max_rel)}"
        return text + f"; first at {list(self.first_index)}: {self.first_a} -> {self.first_b}"

    def to_dict(self) -> dict:
        return {
            "numel": self.numel, "count": self.count, "max_abs": _json_num(self.max_abs),
            "max_rel": _json_num(self.max_rel), "first_index": list(self.first_index),
            "first_a": _json_scalar(self.first_a), "first_b": _json_scalar(self.first_b),
        }


@dataclass(frozen=True)
class Difference:
    """One difference at one path. ``a`` and ``b`` describe each side (None: absent).

    Kind ``items`` is a list, tuple or deque holding no tensor whose items differ: ``count`` of
    its ``total`` compared items differ, and ``first`` is the first difference inside the first of
    them (a path below this one). Kind ``rng`` is a random state: ``note`` names the generators
    that differ. Kind ``digest`` is two tensorcanon files whose digests differ where the
    comparison of their values found nothing (a bug: it should never be seen)."""

    path: str
    kind: str
    a: str | None
    b: str | None
    stats: TensorStats | None = None
    count: int | None = None
    total: int | None = None
    first: Difference | None = None
    note: str | None = None

    def body(self) -> str:
        """What differs, without the path (``str(d)`` is ``"<path>: <body>"``)."""
        if self.kind == "added":
            return f"added in B: {self.b}"
        if self.kind == "removed":
            return f"only in A: {self.a}"
        if self.kind == "values":
            return str(self.stats)
        if self.kind == "alias":
            return f"{self.a} in A, {self.b} in B"
        if self.kind == "items" and self.first is not None:
            leaf = self.innermost()
            what = f"{leaf.a} -> {leaf.b}" if leaf.kind == "value" else leaf.body()
            return (f"{self.count} of {self.total} items differ; first at "
                    f"{leaf.path[len(self.path):] or '(here)'}: {what}")
        if self.kind == "rng":
            return f"random state differs: {self.note}"
        if self.kind == "digest":
            return (f"the file digests differ ({self.a} -> {self.b}) although no value differs as diff "
                    "compares them: a bug in tensorcanon, please report it with both files")
        return f"{self.kind} {self.a} -> {self.b}"

    def innermost(self) -> Difference:
        """The first difference this one stands for: itself, or the first item's for kind ``items``."""
        d = self
        while d.kind == "items" and d.first is not None:
            d = d.first
        return d

    def __str__(self) -> str:
        return textout.printable(f"{self.path}: {self.body()}")

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind, "a": self.a, "b": self.b}
        if self.stats is not None:
            out["stats"] = self.stats.to_dict()
        if self.kind == "items":
            out.update(count=self.count, total=self.total,
                       first=None if self.first is None else self.first.to_dict())
        if self.note is not None:
            out["note"] = self.note
        return out


@dataclass
class DiffResult:
    """Every difference found, in canonical path order.

    Truthy when A and B differ beyond the tolerance (``len(result)`` differences), so
    ``if tensorcanon.diff(a, b): ...`` reads naturally. :attr:`identical` is stricter: the same
    content, bit for bit (for two tensorcanon files: the same file digest). With a tolerance,
    values that differ within it are counted in :attr:`tolerated` (not differences, and not
    identical either). :attr:`notes` lists what differs outside the content (the devices a file
    records: the digest does not cover them).
    """

    differences: list[Difference] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    a: str = "A"      # what was compared (a file path, or "A")
    b: str = "B"
    tensors_only: bool = False  # whether only tensors were compared (see diff())
    notes: list[Difference] = field(default_factory=list)
    tolerated: int = 0  # values (tensors, scalars) whose bits differ within the tolerance
    digests: tuple[str | None, str | None] = (None, None)  # two tensorcanon files' (or checkpoints') digests
    same_digest: bool | None = None  # format/digest.same_content of them (None: not files, or undecided)

    @property
    def identical(self) -> bool:
        """The same content, bit for bit: nothing differs, not even within a tolerance."""
        return not self.differences and not self.tolerated

    def __len__(self) -> int:
        return len(self.differences)

    def __iter__(self) -> Iterator[Difference]:
        return iter(self.differences)

    def first_tensor(self) -> Difference | None:
        """The first difference that concerns a tensor's values, dtype, shape or device."""
        for d in self.differences:
            if d.kind in ("values", "dtype", "shape", "device", "requires_grad", "alias"):
                return d
        return None

    def summary(self) -> str:
        """The last line of the report: ``identical ...``, ``equal within atol=..., rtol=...`` or
        ``N differences ...``, with what was compared."""
        n = len(self.differences)
        tolerant = bool(self.atol or self.rtol)
        tol = f"atol={self.atol:g}, rtol={self.rtol:g}"
        scope = ", tensors only" if self.tensors_only else ""
        if n:
            text = plural(n, "difference")
            if tolerant:
                return f"{text} beyond {tol}{scope}"
            qualifiers = [q for q, on in (("bit-exact", any(d.innermost().kind in ("values", "value", "rng")
                                                             for d in self.differences)),
                                          ("tensors only", self.tensors_only)) if on]
            return text + (f" ({', '.join(qualifiers)})" if qualifiers else "")
        if self.tolerated:
            verb = "differs" if self.tolerated == 1 else "differ"
            return f"equal within {tol}{scope} (not identical: {plural(self.tolerated, 'value')} {verb} within it)"
        if self.tensors_only:
            return "identical tensors (tensors only: other values, types, order and sharing not compared)"
        placed = f"; {plural(len(self.notes), 'tensor')} recorded on other devices" if self.notes else ""
        if self.same_digest:
            return f"identical: the same content digest {self.digests[0]}{placed}"
        return f"identical (bit-exact){placed}"

    def __str__(self) -> str:
        named = (self.a, self.b) != ("A", "B")
        lines = [f"A: {textout.printable(self.a)}", f"B: {textout.printable(self.b)}"] if named else []
        lines += [str(d) for d in self.differences]
        lines += [f"{d} (placement: the digest does not cover it)" for d in self.notes]
        lines.append(self.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol,
            "identical": self.identical, "tensors_only": self.tensors_only,
            "differences": [d.to_dict() for d in self.differences],
            "notes": [d.to_dict() for d in self.notes], "tolerated": self.tolerated,
            "digests": list(self.digests), "same_digest": self.same_digest,
        }


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 difference``, ``2 differences``, ``1,234 entries``: a count and its noun, agreed."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def _num(x: float | None) -> str:
    if x is None:
        return "n/a"
    return repr(x) if math.isinf(x) or x == 0 else f"{x:.6g}"


def _json_num(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else repr(x)


def _json_scalar(x: Any) -> bool | int | float | str | None:
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return _json_num(x) if not math.isnan(x) else "nan"
    return repr(x)


# --------------------------------------------------------------------------- files

FORMATS = ("tensorcanon", "safetensors", "torch", "npz", "npy")
# What zipfile raises on a damaged archive: names that are not UTF-8 (UnicodeDecodeError, a
# ValueError), unknown versions or methods (NotImplementedError), encryption (RuntimeError).
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError)
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass
class Loaded:
    """A file read for comparison: its object and what else the comparison needs."""

    value: Any
    format: str                                   # one of FORMATS
    path: str
    devices: dict[str, str] = field(default_factory=dict)  # path -> recorded device, where not "cpu"
    metadata: Any = None                          # a tensorcanon file's ``metadata`` dict, if any
    algorithm: str | None = None                  # a tensorcanon file's digest algorithm
    # Read lazily (:func:`open_lazily`): id of a placeholder tensor (no data) -> reads its values.
    fetch: dict[int, Callable[[], Any]] = field(default_factory=dict)
    closer: Callable[[], None] | None = None
    digest: str | None = None                     # a tensorcanon file's digest (a checkpoint's logical digest)
    version: int | None = None                    # and its format version
    # Read lazily: id of a placeholder tensor -> its row in the file's tensor table. Two uses of one
    # row are one stored tensor (FORMAT.md §6.5): ties are the file's, whatever the placeholders are.
    rows: dict[int, int] = field(default_factory=dict)
    # Read lazily: builds (value, metadata) when first needed (never, when the digests decide).
    pending: Callable[[], tuple[Any, Any]] | None = None

    def resolve(self) -> Loaded:
        """Build :attr:`value` and :attr:`metadata` if they are still to be decoded (open_lazily)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.value, self.metadata = pending()
        return self

    def close(self) -> None:
        """Check the tensors never read (a lazily read file) and close the file."""
        if self.closer is not None:
            closer, self.closer = self.closer, None
            closer()


def detect_format(path: str | os.PathLike | storage.Location, storage_options: Any = None) -> str:
    """Which of :data:`FORMATS` a file is, from its first bytes (and suffix for zips).

    Raises :class:`FormatError` when it is none of them.
    """
    target = storage.resolve(path, storage_options)
    if isinstance(target, storage.Location):
        return _detect_remote(target)
    return _detect_local(os.fspath(target))


def _detect_local(path: str) -> str:
    if os.path.isdir(path):
        raise directory_error(path, "a file")
    with open_path(path) as fh:  # a regular file (never a FIFO); the zip is read from this descriptor
        head = fh.read(9)
        size = os.fstat(fh.fileno()).st_size
        suffix = os.path.splitext(path)[1].lower()
        if head[:4] in (b"PK\x03\x04", b"PK\x05\x06") and suffix != ".npz":
            try:
                fh.seek(0)
                with zipfile.ZipFile(fh) as z:
                    names = z.namelist()
            except _ZIP_ERRORS as e:
                raise FormatError(f"{path}: damaged zip archive ({e})") from None
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        if suffix == ".npz":
            return "npz"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "torch"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if _legacy_torch(head, suffix, size):
        return "torch"
    _refuse(path, head, size)
    with reader.open_file(path, DEFAULT) as cf:
        return "tensorcanon" if cf.is_tensorcanon else "safetensors"


def _legacy_torch(head: bytes, suffix: str, size: int | None) -> bool:
    """A legacy (non-zip) torch.save file: under a torch file's name, bytes that start as a pickle
    does; under any other name, a pickle of protocol 2 or later (what torch.save writes with
    ``_use_new_zipfile_serialization=False``) whose bytes are no safetensors file (container.not_ours:
    a safetensors header length may start with the same two bytes). torch.load(weights_only=True)
    reads it, and refuses any other pickle naming what it holds."""
    if len(head) < 2 or head[0] != 0x80:
        return False
    return suffix in _TORCH_SUFFIXES or 2 <= head[1] <= 5 and container.not_ours(head, size, DEFAULT) is not None


def _refuse(name: str, head: bytes, size: int | None) -> None:
    """Raise when the file is no format this module reads: the reason ``tensorcanon.load`` gives for
    the same bytes (container.not_ours, the one judgement). The file's bytes are never quoted: the
    file may be anything (a lockfile line or an argument naming a secret)."""
    refusal = container.not_ours(head, size, DEFAULT)
    if refusal is not None:
        with reader.naming(name):
            raise refusal


def _detect_remote(loc: storage.Location) -> str:
    """:func:`detect_format` of an object in a store: its first bytes, and for a zip its names."""
    from ..io import remote

    name = loc.display
    suffix = os.path.splitext(loc.url.split("?", 1)[0])[1].lower()
    with remote.open_binary(loc.but(sequential=False, wrap=None)) as fh:
        head = fh.read(9)
        if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
            if suffix == ".npz":
                return "npz"
            try:
                with zipfile.ZipFile(fh) as z:
                    names = z.namelist()
            except _ZIP_ERRORS as e:
                raise FormatError(f"{name}: damaged zip archive ({e})") from None
            return "npz" if names and all(n.endswith(".npy") for n in names) else "torch"
        if head.startswith(b"\x93NUMPY"):
            return "npy"
        if _legacy_torch(head, suffix, getattr(fh, "size", None)):
            return "torch"
        _refuse(name, head, getattr(fh, "size", None))
        fh.seek(0)
        with reader.CheckedFile(Source(fh, name=name)) as cf:  # type: ignore[arg-type]  # a binary file
            return "tensorcanon" if cf.is_tensorcanon else "safetensors"


@contextlib.contextmanager
def _checked(path: str | storage.Location, limits: Limits,
             wrap: Callable[[Any, int], Any] | None) -> Iterator[reader.CheckedFile]:
    """A local file or an object opened for reading every tensor (``wrap`` draws progress)."""
    if isinstance(path, storage.Location):
        with reader.open_file(path.but(sequential=True, wrap=wrap), limits) as cf:
            yield cf
        return
    with open_path(path) as fh:
        f = wrap(fh, os.fstat(fh.fileno()).st_size) if wrap else fh
        with reader.open_file(f, limits) as cf:
            yield cf


def load_file(path: str | os.PathLike | storage.Location, *, limits: Limits = DEFAULT,
              wrap: Callable[[Any, int], Any] | None = None, storage_options: Any = None,
              stored: bool = False) -> Loaded:
    """Read any supported file (see :func:`detect_format`) with its tensors on the CPU.

    A directory is read as a sharded checkpoint (what ``tensorcanon.dcp``
    writes): its logical state, every chunk verified, as one file would hold it.
    ``wrap(file, size)`` may wrap the opened file (the command line uses it to
    draw progress; not for a directory). With ``stored``, a plain safetensors file's tensors
    come as their bytes (:class:`~tensorcanon.format.tensorbytes.Stored`, without torch), which plan
    and hash as the tensors would: what ``hash``, ``lock``, ``check`` and ``inspect`` read such
    a file with. Only safe loaders are used:
    tensorcanon's own reader, ``torch.load(weights_only=True)`` and
    ``numpy.load(allow_pickle=False)``.

    Example::

        loaded = load_file("weights.pt")
        loaded.value["fc.weight"]
    """
    target = storage.resolve(path, storage_options)
    if isinstance(target, storage.Location):
        where: str | storage.Location = target
        name = target.display
    else:
        where = name = os.fspath(target)
        if os.path.isdir(name):
            from ..sharded import layout, tools  # (imported for a directory only: `import tensorcanon` stays light)

            value, algorithm = tools.logical_state(name, limits)
            index = layout.read(name, limits)
            return Loaded(value, layout.FORMAT, name, algorithm=algorithm, digest=index.logical_digest,
                          version=index.logical.version)
    fmt = detect_format(where)
    if fmt in ("tensorcanon", "safetensors"):
        with _checked(where, limits, wrap) as cf:
            if stored and not cf.is_tensorcanon:
                return Loaded(cf.stored(), fmt, name)
            value = cf.load(map_location="cpu")
            if not cf.is_tensorcanon:
                return Loaded(value, fmt, name)
            return Loaded(value, fmt, name, cf.devices(), cf.metadata(), cf.algorithm, digest=cf.digest,
                          version=cf.manifest.version if cf.manifest is not None else None)
    if isinstance(where, storage.Location):  # read whole, as these formats are loaded whole anyway
        from ..io import remote

        return _load_foreign(io.BytesIO(remote.read_bytes(where)), fmt, name)
    with open_path(name) as fh:  # the regular file checked here, not whatever the path names later
        return _load_foreign(fh, fmt, name)


def _remaining(f: Any) -> int | None:
    """Bytes left in the file object ``f`` from its position, where that can be known."""
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
        return int(end - here)
    except (AttributeError, OSError, ValueError):
        return None


def open_lazily(path: str | os.PathLike | storage.Location, *, limits: Limits = DEFAULT,
                storage_options: Any = None) -> Loaded:
    """A file read for :func:`diff` with memory bounded by its largest tensor, not its size.

    A local tensorcanon or plain safetensors file comes with placeholder tensors that hold no data
    (meta tensors; zero-stride arrays), each read, verified, when it is compared
    (:attr:`Loaded.fetch`) and dropped after, and known by its row of the tensor table
    (:attr:`Loaded.rows`: ties are the file's); a tensorcanon file's object tree is checked now and
    built when first needed (:meth:`Loaded.resolve`: never, when the file digests decide).
    :meth:`Loaded.close` verifies the tensors never compared (a damaged file is an error, whatever
    is compared) and closes the file. Anything else is :func:`load_file` (loaded whole). Use it as
    ``with contextlib.closing(...)``.
    """
    target = storage.resolve(path, storage_options)
    if isinstance(target, storage.Location) or os.path.isdir(os.fspath(target)) \
            or detect_format(target) not in ("tensorcanon", "safetensors"):
        return load_file(target, limits=limits)
    name = os.fspath(target)
    cf = reader.open_file(name, limits)
    try:
        rows = cf.rows
        holders = [_placeholder(info) for info in rows]
        if any(h is None for h in holders):  # a dtype this torch or numpy cannot hold: read whole
            cf.close()
            return load_file(name, limits=limits)
        read: set[int] = set()

        def fetcher(index: int) -> Callable[[], Any]:
            def fetch() -> Any:
                read.add(index)
                return cf.read(index, map_location="cpu")
            return fetch

        def close() -> None:
            try:
                for info in rows:  # the tensors no comparison read: checked all the same
                    if info.index not in read:
                        cf.read(info.index, map_location="cpu")
            finally:
                cf.close()

        fetch = {id(h): fetcher(i) for i, h in enumerate(holders)}
        row_of = {id(h): i for i, h in enumerate(holders)}
        if cf.manifest is None:
            value = {r.name: holders[r.index] for r in sorted(rows, key=lambda r: r.name)}
            return Loaded(value, "safetensors", name, fetch=fetch, closer=close, rows=row_of)
        cf.check_tree()
        m = cf.manifest

        def decode() -> tuple[Any, Any]:
            for i in _composite_parts(m.root):  # a sparse or nested tensor is built from its parts' values
                del fetch[id(holders[i])]  # (before the placeholder goes: a new object may reuse its id)
                del row_of[id(holders[i])]
                holders[i] = cf.read(i, map_location="cpu")
                read.add(i)
            decoder = _PackedKept(holders, limits.max_depth, version=m.version,
                                  max_string_bytes=limits.max_string_array_bytes)  # (the tree: checked above)
            return decoder.decode(m.root), cf.metadata()

        return Loaded(None, "tensorcanon", name, cf.devices(), None, cf.algorithm, fetch=fetch, closer=close,
                      digest=cf.digest, version=m.version, rows=row_of, pending=decode)
    except BaseException:
        cf.close()
        raise


class PackedList:
    """A packed list of a tensorcanon file read by :func:`diff` (an ``ints`` or ``records`` node,
    FORMAT.md §6.13), kept as the file holds it: two of them are compared by their bytes and rows,
    without a Python object per item (:meth:`items` builds the list, for a comparison with a list
    held otherwise). The node was checked with the rest of the file's tree."""

    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node

    @property
    def tag(self) -> str:
        return str(self.node[0])

    def __len__(self) -> int:
        return packed.item_count(self.node)

    def items(self) -> list:
        """The list it stands for (its ints, or its records as dicts)."""
        if self.tag == "ints":
            return packed.ints_values(self.node, FormatError) or []
        return packed.records_values(self.node, FormatError) or []

    def ints(self) -> Any:
        """An ``ints`` node's items as a numpy array over its bytes (no copy)."""
        row = next(r for r in packed.INT_DTYPES if r[0] == self.node[1])
        return np.frombuffer(self.node[2], dtype=np.dtype(f"<{'i' if row[2] < 0 else 'u'}{row[1]}"))

    def row(self, i: int) -> tuple[tuple, tuple]:
        """A ``records`` node's row ``i``: its keys and its values."""
        row = self.node[2 + i]
        return tuple(self.node[1][row[0]]), tuple(row[1:])


# The tags whose children diff walks as values: a packed list among them is kept packed. (Inside any
# other node, such as a registered type's state or a random state, lists are built as they load.)
_WALKED = frozenset({"list", "tuple", "dict", "odict", "counter", "defaultdict", "deque"})


class _PackedKept(tree.Decoder):
    """The decoder that builds a checked tree for :func:`diff`, each packed list where diff walks
    values a :class:`PackedList` (its items are not built)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.walked = True  # whether the node being decoded is a value diff walks

    def decode(self, node: Any, depth: int = 0) -> Any:
        tag = tree.tag_of(node)
        if tag is None or tag in _WALKED:
            return super().decode(node, depth)
        if self.walked and (tag == "ints" or tag == "records"):
            return PackedList(node)
        walked, self.walked = self.walked, False
        try:
            return super().decode(node, depth)
        finally:
            self.walked = walked


def _composite_parts(root: Any) -> list[int]:
    """The table indices of the parts of every sparse and nested tensor of a checked tree (FORMAT.md
    §6.12): these tensors are built, and their index parts checked, from the parts' values, so the
    parts are read before the tree is decoded (a placeholder on "meta" has no values)."""
    found: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, inside = stack.pop()
        if type(node) not in tree.ARRAYS or not node:
            continue
        tag = node[0]
        if inside and tag == "tensor" and len(node) == 2 and type(node[1]) is int:
            found.add(node[1])
            continue
        inside = inside or tag in ("sparse", "nested")
        stack.extend((child, inside) for child in node[1:])
    return sorted(found)


def _placeholder(info: Any) -> Any:
    """A tensor or array with ``info``'s kind, dtype, shape and grad flag and no data, or None."""
    if info.kind == "ndarray":
        if not info.dtype.has_numpy:
            return None
        one = np.zeros(1, dtype=info.dtype.numpy)
        return np.lib.stride_tricks.as_strided(one, shape=info.shape, strides=(0,) * len(info.shape),
                                               writeable=False)
    dtype = info.dtype.torch
    if dtype is None:
        return None
    t = torch.empty(info.shape, dtype=dtype, device="meta")
    if info.kind == "parameter":
        t = torch.nn.Parameter(t, requires_grad=info.requires_grad)
    elif info.requires_grad:
        t.requires_grad_(True)
    _PLACEHOLDERS[id(t)] = t
    return t


# The tensors open_lazily made to stand for a stored dense tensor (on "meta", with no data): compared
# as the dense tensors they stand for, never as meta tensors (FORMAT.md §6.12.3) of their own.
_PLACEHOLDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor (a WeakSet would
# compare tensors with ==)


def _load_foreign(data: Any, fmt: str, path: str) -> Loaded:
    """A ``.pt``, ``.npy`` or ``.npz`` file's value, read from the file object ``data``, without
    unpickling anything but what ``torch.load(weights_only=True)`` allows."""
    if fmt == "torch":
        try:
            value = torch.load(data, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad or disallowed pickle
            raise FormatError(f"{path}: {_torch_refusal(e, data)}") from None
        return Loaded(value, fmt, path)
    from . import npyfile  # bounded by the bytes the file holds, object arrays refused (never unpickled)

    if fmt == "npz":
        value = npyfile.read_npz(data, path)
    else:
        value = npyfile.read_npy(data, path, _remaining(data))
    return Loaded(value, fmt, path)


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")  # terminal escape sequences (bold, colour)
_BLOCKED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")  # how torch names a class it does not trust


def _torch_refusal(e: Exception, data: Any) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in our words where we know better.

    A class its weights-only unpickler does not trust (an object of your own in the checkpoint)
    is named, with what to do (torch's own message, written for its console, has terminal escape
    codes and options it does not show): its names come from
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` (torch 2.5 and later; it reads the
    pickle without running it), else from torch's message. Any other failure is torch's first
    line, without escape codes."""
    text = _ESCAPES.sub("", str(e)).strip()
    blocked = _BLOCKED.findall(text)
    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if blocked and finder is not None:
        with contextlib.suppress(Exception):  # (a damaged pickle: the name from the message stays)
            data.seek(0)
            blocked = finder(data) or blocked
    if blocked:
        names = list(dict.fromkeys(blocked))
        one = len(names) == 1
        short = ", ".join(n.rsplit(".", 1)[-1] for n in names)
        return (f"torch.load(weights_only=True) cannot read it: it names {', '.join(names)}, which torch's "
                f"weights-only loader imports only when told to trust {'it' if one else 'them'}; tensorcanon "
                f"never unpickles. If you trust the file and {'that is a class' if one else 'those are classes'} "
                f"of yours, convert it in Python, where {'it' if one else 'they'} can be imported: "
                f"torch.serialization.add_safe_globals([{short}]), tensorcanon.register({names[0].rsplit('.', 1)[-1]})"
                f"{' (each class)' if not one else ''} (with encode= and decode=, unless it is a dataclass, "
                "NamedTuple or Enum), then tensorcanon.save(torch.load(path, weights_only=True), out)")
    first = text.splitlines()[0].strip() if text else type(e).__name__
    return f"torch.load(weights_only=True) cannot read it: {first}; tensorcanon never unpickles arbitrary objects"


# --------------------------------------------------------------------------- describing


def _tensor_kind(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return "ndarray"
    return "Parameter" if type(v) is torch.nn.Parameter else "tensor"


def _dtype_name(v: Any) -> str:
    if isinstance(v, np.ndarray):
        row = dtypes.BY_NUMPY.get(v.dtype.newbyteorder("<")) if v.dtype.fields is None else None
        return row.name if row else str(v.dtype)
    return str(v.dtype).removeprefix("torch.")


def _special(v: Any) -> tuple[str, list] | None:
    """What a sparse, nested, meta or subclass tensor is, and its parts (format/tensorkinds.py)."""
    if isinstance(v, np.ndarray) or _PLACEHOLDERS.get(id(v)) is v:
        return None
    return tensorkinds.parts(v)


def describe(v: Any) -> str:
    """A short description of a value: ``tensor float32[4, 3]``, ``dict (2 keys)``, ``int 3``."""
    if type(v) is PackedList:
        return f"list ({plural(len(v), 'item')})"
    if _is_tensorlike(v):
        special = _special(v)
        if special is not None and special[0].startswith("nested strided"):  # (it has no single shape)
            return f"{special[0]} {_tensor_kind(v)} {_dtype_name(v)} ({len(special[1])} elements)"
        what = "" if special is None else f"{special[0]} "
        return f"{what}{_tensor_kind(v)} {_dtype_name(v)}{list(v.shape)}"
    t = type(v)
    if isinstance(v, dict):
        return f"{t.__name__} ({len(v)} key{'s' if len(v) != 1 else ''})"
    if t in (list, tuple, set, frozenset):
        return f"{t.__name__} ({len(v)} item{'s' if len(v) != 1 else ''})"
    return f"{_type_name(v)} {_short(v)}"


def _type_name(v: Any) -> str:
    t = type(v)
    if v is None:
        return "None"
    if t.__module__ in ("builtins",):
        return t.__name__
    return f"{t.__module__}.{t.__qualname__}"


def _short(v: Any, limit: int = 60) -> str:
    return _cut(repr(v), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_tensorlike(v: Any) -> bool:
    numpy, th = optional.imported("numpy"), optional.imported()  # (no value is one unless its module is imported)
    if numpy is not None and isinstance(v, numpy.ndarray):
        return v.dtype.kind not in "US"  # a str or bytes array is a value (FORMAT.md §6.11), not a tensor
    return th is not None and isinstance(v, th.Tensor)


# --------------------------------------------------------------------------- comparing


def diff(a: Any, b: Any, *, atol: float = 0.0, rtol: float = 0.0, tensors_only: bool = False,
         limits: Limits = DEFAULT, storage_options: Any = None) -> DiffResult:
    """Compare ``a`` with ``b`` (objects, or paths to files) and return every difference.

    ``a`` is the reference ("A", "only in A") and ``b`` the candidate ("B",
    "added in B"); relative differences are relative to B. See the module
    docstring for the element rules and the file formats read.

    ``tensors_only=True`` compares the tensors (and arrays) at each path and
    nothing else: container types (dict or OrderedDict, list or tuple), key
    order, ``_metadata``, which tensors share memory, and values that are not
    tensors are ignored, so a tensorcanon file compares cleanly with one that
    transformers or safetensors wrote for the same weights.

    ``storage_options`` are used for whichever of ``a`` and ``b`` is a URL.

    Example::

        r = tensorcanon.diff({"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 1.0, 0.0])})
        str(r.differences[0])  # '$["w"]: 1 of 3 elements differ; ... first at [1]: 0.0 -> 1.0'
    """
    if not (atol >= 0 and rtol >= 0 and math.isfinite(atol) and math.isfinite(rtol)):
        raise UsageError(f"atol and rtol must be finite and >= 0, got atol={atol!r}, rtol={rtol!r}")
    sides: list[Loaded] = []
    with contextlib.ExitStack() as opened:
        for value in (a, b):
            if isinstance(value, (str, os.PathLike, storage.Location)):  # read one tensor at a time
                loc = storage.resolve(value, storage_options) if storage.is_url(value) else value
                sides.append(opened.enter_context(contextlib.closing(open_lazily(loc, limits=limits))))
            elif isinstance(value, Loaded):
                sides.append(value)
            else:
                sides.append(Loaded(value, "object", ""))
        return compare_loaded(sides[0], sides[1], atol=float(atol), rtol=float(rtol),
                              tensors_only=bool(tensors_only), max_depth=limits.max_depth)


def compare_loaded(la: Loaded, lb: Loaded, *, atol: float = 0.0, rtol: float = 0.0, tensors_only: bool = False,
                   max_depth: int = DEFAULT.max_depth) -> DiffResult:
    """The one home of "are these the same, and where not" for :func:`diff` and ``tensorcanon diff``.

    When both sides are tensorcanon files (or sharded checkpoints) whose digests can decide
    (:func:`tensorcanon.format.digest.same_content`: one algorithm, one format version), the
    digests decide: equal digests are identical content and nothing is walked (only the devices
    each file records, which the digest does not cover, are compared, as notes); different digests
    are a difference, and the walk says where. Should the walk find nothing then, the difference
    is reported as it is, at the level of the digests (kind ``digest``), never as "identical". Any
    other pair (objects, other formats, digests of different algorithms or format versions) is
    decided by the walk alone. ``tensors_only`` asks another question (the tensors only), which the
    digests do not answer.
    """
    decided: bool | None = None
    if la.digest is not None and lb.digest is not None:
        versions = (la.version, lb.version) if la.version is not None and lb.version is not None else None
        decided = digest.same_content(la.digest, lb.digest, versions)
    d = _Differ(atol, rtol, la.devices, lb.devices, max_depth, tensors_only, la.fetch, lb.fetch, la.rows, lb.rows)
    if decided:
        for where in list(la.devices) + [p for p in lb.devices if p not in la.devices]:
            dev_a, dev_b = la.devices.get(where, "cpu"), lb.devices.get(where, "cpu")
            if dev_a != dev_b:
                d.notes.append(Difference(where, "device", dev_a, dev_b))
    else:
        d.compare(la.resolve().value, lb.resolve().value, (), 0)
        if la.format == lb.format == "tensorcanon" and (la.metadata is not None or lb.metadata is not None):
            d.root = "metadata"  # (user metadata: part of the content, FORMAT.md §6.8)
            if la.metadata is None:
                d.add((), "added", None, describe(lb.metadata))
            elif lb.metadata is None:
                d.add((), "removed", describe(la.metadata), None)
            else:
                d.compare(la.metadata, lb.metadata, (), 0)
        if decided is False and not tensors_only and not d.out and not d.tolerated:
            d.out.append(Difference(paths.ROOT, "digest", la.digest, lb.digest))
    return DiffResult(d.out, atol, rtol, la.path or "A", lb.path or "B", tensors_only, d.notes, d.tolerated,
                      (la.digest, lb.digest), decided)


def _alias_key(v: Any, rows: dict[int, int] | None = None) -> Any:
    """What makes two tensors one stored tensor: for a placeholder of a file read lazily, its row of
    the file's tensor table (``rows``: the file's own ties, FORMAT.md §6.5); for any other tensor,
    the writer's own rule (tensorbytes.alias_key), which a loaded file's tensors follow too."""
    row = rows.get(id(v)) if rows else None
    if row is not None:
        return ("row", row)
    if isinstance(v, np.ndarray):
        key = tensorbytes.alias_key(v, "ndarray")
    elif _special(v) is not None or tensorkinds.attributes(v):  # one object per saved object (§6.12)
        key = None
    else:
        key = tensorbytes.alias_key(v, "parameter" if type(v) is torch.nn.Parameter else "tensor")
    return ("id", id(v)) if key is None else key


def _as_torch(v: Any) -> torch.Tensor:
    if isinstance(v, np.ndarray):
        a = v.astype(v.dtype.newbyteorder("<"), copy=False) if v.dtype.byteorder == ">" else v
        return torch.from_numpy(np.ascontiguousarray(a))
    t = tensorbytes.resolved(v)
    return t.cpu() if t.device.type != "cpu" else t


def _factory_name(d: collections.defaultdict) -> str:
    f = d.default_factory
    if f is None:
        return "None"
    name = f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', repr(f))}"
    return name.removeprefix("builtins.")


def _lenient_order(keys: Any) -> list:
    """Keys in canonical order, or as given when some have none (diff compares any object)."""
    keys = list(keys)
    try:
        return sorted_keys(keys)
    except (UnorderableKey, ValueError, TypeError):
        return keys


def _container(v: Any) -> walk.Container | None:
    """The children of ``v`` as the encoder sees them; dict subclasses count as dicts here."""
    t = type(v)
    if t is list or t is tuple:  # (its items as they are: a long list is not copied)
        return walk.Container(t.__name__, v)  # (read only: not copied)
    c = walk.container(v, _lenient_order)
    if c is None and isinstance(v, dict):
        c = walk.container(dict(v), _lenient_order)
    if c is None and type(v) is collections.deque:  # items as a list's (FORMAT.md §6.10.3)
        c = walk.Container("deque", list(v))
    return c


def _numeric(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype statistics are computed in, or None when torch cannot convert this one."""
    target = torch.complex128 if dtype.is_complex else torch.float64
    try:
        torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype).to(target)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return target


def _bits_hex(u: torch.Tensor) -> str:
    return "0x" + bytes(u.tolist())[::-1].hex()


def _scalar(flat: torch.Tensor, u: torch.Tensor, i: int, numeric: torch.dtype | None) -> Any:
    x = flat[i]
    if numeric is None:
        return _bits_hex(u[i])
    if not (flat.dtype.is_floating_point or flat.dtype.is_complex):
        return x.item()
    value = x.to(numeric).item()
    if flat.dtype.is_complex:
        part = torch.float32 if flat.dtype == torch.complex64 else torch.float64
        if flat.dtype == torch.complex32:
            part = torch.float16
        return complex(_shortest(value.real, part), _shortest(value.imag, part))
    return _shortest(value, flat.dtype)


def _shortest(value: float, dtype: torch.dtype) -> float:
    """``value`` (exactly a ``dtype`` number) as the float with the fewest decimal digits that is
    still that ``dtype`` number: a float32 element prints as ``0.45777494``, as numpy and torch
    print it, not with the 17 digits of its float64 widening (``0.45777493715286255``)."""
    if dtype == torch.float64 or not math.isfinite(value):
        return value
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    want = torch.tensor(value, dtype=torch.float64).to(dtype).view(bits)
    for digits in range(1, 18):
        candidate = float(f"{value:.{digits}g}")
        if bool(torch.tensor(candidate, dtype=torch.float64).to(dtype).view(bits) == want):
            return candidate
    return value


def tensor_stats(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> TensorStats | None:
    """Element statistics of two CPU tensors of equal dtype and shape; None if they match."""
    return _stats(a, b, atol, rtol)[0]


def _stats(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[TensorStats | None, int]:
    """:func:`tensor_stats`, and how many elements' bits differ (within the tolerance or not)."""
    n = a.numel()
    shape = tuple(a.shape)
    itemsize = a.element_size()
    fa, fb = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    ua, ub = fa.view(torch.uint8).reshape(-1, itemsize), fb.view(torch.uint8).reshape(-1, itemsize)
    numeric = _numeric(a.dtype)
    tolerant = (atol > 0 or rtol > 0) and numeric is not None
    whole = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(itemsize)
    ia, ib = (fa.view(whole), fb.view(whole)) if whole is not None else (None, None)
    count, first, bits = 0, None, 0
    max_abs = max_rel = 0.0
    for start in range(0, n, _CHUNK_ELEMENTS):
        end = min(start + _CHUNK_ELEMENTS, n)
        if ia is not None and ib is not None:  # bits compared an element at a time: 1 byte per element
            ne = ia[start:end] != ib[start:end]
        else:
            ne = (ua[start:end] != ub[start:end]).any(dim=1)
        if tolerant:
            bits += int(ne.sum())
            close = torch.isclose(fa[start:end].to(numeric), fb[start:end].to(numeric),
                                  rtol=rtol, atol=atol, equal_nan=True)
            ne &= ~close
        k = int(ne.sum())
        if not k:
            continue
        count += k
        if first is None:
            first = start + int(torch.nonzero(ne)[0, 0])
        if numeric is not None:
            # select the differing elements by their bytes: torch < 2.13 has no boolean indexing
            # for uint16-64 and float8 tensors, every torch has it for uint8
            xa = ua[start:end][ne].reshape(-1).view(a.dtype).to(numeric)
            xb = ub[start:end][ne].reshape(-1).view(a.dtype).to(numeric)
            d = (xa - xb).abs()
            d = torch.where(xa.isnan() & xb.isnan(), torch.zeros_like(d), d)
            d = torch.where(d.isnan(), torch.full_like(d, math.inf), d)
            ref = xb.abs()
            rel = torch.where(ref > 0, d / torch.where(ref > 0, ref, torch.ones_like(ref)),
                              torch.where(d > 0, torch.full_like(d, math.inf), torch.zeros_like(d)))
            rel = torch.where(rel.isnan(), torch.full_like(rel, math.inf), rel)
            max_abs = max(max_abs, float(d.max()))
            max_rel = max(max_rel, float(rel.max()))
    if first is None:  # no element differs (count == 0)
        return None, bits
    index, rest = [], first
    for dim in reversed(shape):
        index.append(rest % dim)
        rest //= dim
    va, vb = _scalar(fa, ua, first, numeric), _scalar(fb, ub, first, numeric)
    if numeric is not None and repr(va) == repr(vb):  # same value, different bits: -0.0, NaN payloads
        va, vb = f"{va!r} ({_bits_hex(ua[first])})", f"{vb!r} ({_bits_hex(ub[first])})"
    return TensorStats(
        numel=n, count=count,
        max_abs=max_abs if numeric is not None else None,
        max_rel=max_rel if numeric is not None else None,
        first_index=tuple(reversed(index)), first_a=va, first_b=vb,
    ), max(bits, count)


_SEQUENCES = ("list", "tuple", "deque")
# Differences that say how values are held, not what they are: ignored with tensors_only.
_STRUCTURE_KINDS = frozenset({"type", "order", "metadata", "alias"})
# Leaves whose == is their identity in a file (floats are not: -0.0 == 0.0, NaN != NaN)
_EXACT_LEAVES = frozenset({int, str, bytes, bool, type(None)})
_LEAVES = _EXACT_LEAVES | {float, complex}


def _has_tensor(*values: Any) -> bool:
    """True if any of ``values`` is or holds a tensor or array (at any depth)."""
    stack = list(values)
    while stack:
        v = stack.pop()
        if type(v) in _LEAVES:  # (most items of a long list: no module lookups for them)
            continue
        if _is_tensorlike(v):
            return True
        c = _container(v)
        if c is not None:
            stack.extend(x for item in c.items for x in (item if c.is_mapping else (item,)))
        else:
            reg = registry.by_type(type(v))
            if reg is not None:
                stack.append(reg.encode(v))
    return False


def _holds_tensor(items: list | tuple) -> bool:
    """:func:`_has_tensor` of a sequence's items, without a copy of a long list of leaves."""
    return any(type(v) not in _LEAVES and _has_tensor(v) for v in items)


def _same_leaf(x: Any, y: Any) -> bool:
    """True when ``x`` and ``y`` are certainly the same value in a file (the same object, or equal
    leaves of one type, floats by their bits); False when they may differ (then compared in full)."""
    if x is y:
        return True
    t = type(x)
    if t is not type(y):
        return False
    if t in _EXACT_LEAVES:
        return bool(x == y)
    if t is complex:
        return _float_bits(x.real) == _float_bits(y.real) and _float_bits(x.imag) == _float_bits(y.imag)
    return t is float and (x == y and x != 0.0 or _float_bits(x) == _float_bits(y))


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _key_id(k: Any) -> Any:
    """A dict key or set member as the file tells it apart from others (FORMAT.md §6.3): ``1``,
    ``True`` and ``1.0`` are three keys, ``0.0`` and ``-0.0`` two, a NaN matches the same NaN bits,
    although Python's ``==`` merges or separates them."""
    t = type(k)
    if t is float:
        return (float, _float_bits(k))
    if t is tuple:
        return (tuple, tuple(_key_id(x) for x in k))
    if t is frozenset:
        return (frozenset, frozenset(_key_id(x) for x in k))
    numpy = optional.imported("numpy")
    if numpy is not None and isinstance(k, numpy.generic):
        return (t, k.dtype.str, k.tobytes())
    try:
        hash(k)
    except TypeError:  # (not a key a file holds: compared by identity)
        return (t, id(k))
    return (t, k)


def _shown_pair(a: Any, b: Any, limit: int = _SHOWN) -> tuple[str, str]:
    """``repr`` of two values that differ, each at most about ``limit`` characters, cut so that the
    place where their texts first differ stays visible on both sides."""
    ra, rb = paths.show(a, 1 << 16), paths.show(b, 1 << 16)
    return textout.around(ra, rb, limit)


class _Differ:
    def __init__(self, atol: float, rtol: float, devices_a: dict, devices_b: dict, max_depth: int,
                 tensors_only: bool = False, fetch_a: dict | None = None, fetch_b: dict | None = None,
                 rows_a: dict | None = None, rows_b: dict | None = None) -> None:
        self.fetch_a, self.fetch_b = fetch_a or {}, fetch_b or {}  # placeholders of files read lazily
        self.rows_a, self.rows_b = rows_a or {}, rows_b or {}  # and their rows in the tensor tables
        self.atol, self.rtol = atol, rtol
        self.tolerant = atol > 0 or rtol > 0
        self.devices_a, self.devices_b = devices_a, devices_b
        self.max_depth = max_depth
        self.tensors_only = tensors_only
        self.out: list[Difference] = []
        self.notes: list[Difference] = []
        self.tolerated = 0  # values whose bits differ, within the tolerance
        self.seen_a: dict = {}
        self.seen_b: dict = {}
        self.root = paths.ROOT  # what a path starts with ("metadata" for a file's user metadata)

    def where(self, trail: tuple) -> str:
        return self.root + paths.join(trail)[len(paths.ROOT):]

    def add(self, trail: tuple, kind: str, a: str | None, b: str | None, stats: TensorStats | None = None,
            **more: Any) -> None:
        if self.tensors_only and kind in _STRUCTURE_KINDS:
            return
        self.out.append(Difference(self.where(trail), kind, a, b, stats, **more))

    def found(self, compare: Callable[[], None]) -> list[Difference]:
        """The differences ``compare()`` finds, kept apart from the others."""
        saved, self.out = self.out, []
        try:
            compare()
            return self.out
        finally:
            self.out = saved

    def compare(self, a: Any, b: Any, trail: tuple, depth: int) -> None:
        if depth > self.max_depth:
            raise LimitError(
                f"objects nested deeper than max_depth={self.max_depth} at {self.where(trail)} "
                "(a reference cycle?)", limit="max_depth", path=self.where(trail),
                hint="pass diff(..., limits=tensorcanon.Limits(max_depth=...)) to compare deeper objects",
            )
        if _is_tensorlike(a) and _is_tensorlike(b):
            self.tensors(a, b, trail)
            return
        if type(a) is PackedList or type(b) is PackedList:
            if type(a) is PackedList and type(b) is PackedList and a.tag == b.tag and not self.tolerant:
                self.packed_lists(a, b, trail, depth)
                return
            a = a.items() if type(a) is PackedList else a  # (against a list held otherwise: as lists)
            b = b.items() if type(b) is PackedList else b
        ca, cb = _container(a), _container(b)
        if ca is not None and cb is not None and ca.is_mapping and cb.is_mapping:
            if type(a) is not type(b):
                self.add(trail, "type", _type_name(a), _type_name(b))
            elif type(a) is collections.defaultdict and a.default_factory is not b.default_factory:
                self.add(trail, "value", f"default_factory={_factory_name(a)}",
                         f"default_factory={_factory_name(b)}")  # (saved: FORMAT.md §6.10.2)
            self.mappings(ca, cb, trail, depth)
            return
        if ca is not None and cb is not None and ca.tag in _SEQUENCES and cb.tag in _SEQUENCES:
            if ca.tag != cb.tag:
                self.add(trail, "type", ca.tag, cb.tag)
            elif ca.tag == "deque" and a.maxlen != b.maxlen:
                self.add(trail, "value", f"maxlen={a.maxlen}", f"maxlen={b.maxlen}")
            self.sequences(ca.items, cb.items, trail, depth)
            return
        if self.tensors_only and not (_has_tensor(a) or _has_tensor(b)):
            return
        ta, tb = type(a), type(b)
        if ta is not tb:
            self.add(trail, "type", describe(a), describe(b))
            return
        if ta in (set, frozenset):
            self.sets(a, b, trail)
            return
        generators = _generators(a)
        if generators is not None:
            self.random_states(generators, _generators(b) or [], trail)
            return
        reg = registry.by_type(ta)
        if reg is not None:  # a registered type: compare what would be saved
            self.compare(reg.encode(a), reg.encode(b), trail, depth + 1)
            return
        if self.equal_scalars(a, b):
            return
        self.add(trail, "value", *_shown_pair(a, b))

    def sequences(self, ia: list, ib: list, trail: tuple, depth: int) -> None:
        """Items in order; a list that holds no tensor is one difference however many items differ
        (``items``: how many, the first), or the one item's differences when one item differs."""
        n = min(len(ia), len(ib))
        if _holds_tensor(ia) or _holds_tensor(ib):  # each tensor has its line (and its ties)
            for i in range(n):
                self.compare(ia[i], ib[i], trail + (i,), depth + 1)
        elif not self.tensors_only:
            leaves = not self.tolerant  # (a tolerance may find two different leaves equal)
            self.items(trail, n, ((i, ia[i], ib[i], leaves and type(ia[i]) in _LEAVES and type(ib[i]) in _LEAVES)
                                  for i in range(n) if not _same_leaf(ia[i], ib[i])), depth)
        if len(ia) != len(ib):
            self.add(trail, "length", plural(len(ia), "item"), plural(len(ib), "item"))

    def items(self, trail: tuple, n: int, pairs: Iterator[tuple[int, Any, Any, bool]], depth: int,
              build: Callable[[Any], Any] | None = None) -> None:
        """The items of a list that holds no tensor, ``pairs`` those that may differ (and whether
        they certainly do): one difference (``items``) when several do, the item's own differences
        when one does. Once the first is described, an item that certainly differs is only counted
        (``build(item)`` makes the value of an item to compare, where the pairs hold something else)."""
        count, first = 0, None
        for i, x, y, certain in pairs:
            if certain and first is not None:
                count += 1
                continue
            if build is not None:  # (items built only to be compared: a packed row as its dict)
                x, y = build(x), build(y)
            inner = self.found(lambda: self.compare(x, y, trail + (i,), depth + 1))  # noqa: B023
            if inner:
                count += 1
                first = first or inner
        if count == 1 and first is not None:
            self.out += first
        elif count and first is not None:
            self.add(trail, "items", None, None, count=count, total=n, first=first[0])

    def packed_lists(self, a: PackedList, b: PackedList, trail: tuple, depth: int) -> None:
        """Two packed lists of one tag, by their bytes (``ints``) or rows (``records``): no Python
        object per item unless an item differs (bit-exact; a tolerance compares them as lists)."""
        if self.tensors_only:
            return
        na, nb = len(a), len(b)
        n = min(na, nb)
        if a.tag == "ints":
            xa, xb = a.ints()[:n], b.ints()[:n]
            if xa.dtype != xb.dtype:  # (one type holds both, but for uint64 against a signed type)
                common = np.promote_types(xa.dtype, xb.dtype)
                if common.kind == "f":
                    self.items(trail, n, ((i, int(xa[i]), int(xb[i]), True) for i in range(n)
                                          if int(xa[i]) != int(xb[i])), depth)
                    n = -1
                else:
                    xa, xb = xa.astype(common), xb.astype(common)
            if n >= 0:
                ne = xa != xb
                count = int(np.count_nonzero(ne))
                if count:
                    i = int(np.argmax(ne))
                    one = Difference(self.where(trail + (i,)), "value", repr(int(xa[i])), repr(int(xb[i])))
                    self.out.append(one if count == 1 else
                                    Difference(self.where(trail), "items", None, None, count=count, total=n, first=one))
        else:
            def differing() -> Iterator[tuple[int, Any, Any, bool]]:
                for i in range(n):
                    (ka, va), (kb, vb) = a.row(i), b.row(i)
                    if ka != kb or len(va) != len(vb) or not all(map(_same_leaf, va, vb)):  # (certainly)
                        yield i, (ka, va), (kb, vb), True
            self.items(trail, n, differing(), depth, lambda row: dict(zip(*row, strict=True)))
        if na != nb:
            self.add(trail, "length", plural(na, "item"), plural(nb, "item"))

    def sets(self, a: set | frozenset, b: set | frozenset, trail: tuple) -> None:
        ida = {_key_id(m): m for m in a}
        idb = {_key_id(m): m for m in b}
        only_a = sorted(paths.show(m) for k, m in ida.items() if k not in idb)
        only_b = sorted(paths.show(m) for k, m in idb.items() if k not in ida)
        if only_a or only_b:
            self.add(trail, "value", _cut("{" + ", ".join(only_a) + "} only in A", 200),
                     _cut("{" + ", ".join(only_b) + "} only in B", 200))

    def random_states(self, ga: list[tuple[str, Any]], gb: list[tuple[str, Any]], trail: tuple) -> None:
        """A random state or generator, by the generators it holds: which of them differ (bit for
        bit, whatever the tolerance: a state is not a measurement)."""
        sa, sb = dict(ga), dict(gb)
        differ: list[str] = []
        same: list[str] = []
        for name in list(sa) + [n for n in sb if n not in sa]:
            if name not in sa or name not in sb:
                differ.append(f"{name} (only in {'A' if name in sa else 'B'})")
                continue
            tolerant, self.tolerant = self.tolerant, False
            try:
                found = self.found(lambda n=name: self.compare(sa[n], sb[n], trail, 1))  # type: ignore[misc]
            finally:
                self.tolerant = tolerant
            (differ if found else same).append(name)
        if differ:
            note = ", ".join(differ) + (f" ({', '.join(same)} equal)" if same else "")
            self.add(trail, "rng", None, None, note=note)

    def equal_scalars(self, a: Any, b: Any) -> bool:
        """Whether two values of one type are equal (bit-exact, or within the tolerance: then
        counted in :attr:`tolerated`)."""
        t = type(a)
        if t is float:
            if _float_bits(a) == _float_bits(b):
                return True
            return self.within(a, b)
        if t is complex:
            if _float_bits(a.real) == _float_bits(b.real) and _float_bits(a.imag) == _float_bits(b.imag):
                return True
            return self.within(a, b)
        if t is int:
            return a == b or self.within(a, b)
        if isinstance(a, np.generic):
            if a.dtype != b.dtype:
                return False
            if np.asarray(a).tobytes() == np.asarray(b).tobytes():
                return True
            return a.dtype.kind in "iufc" and self.within(complex(a), complex(b))
        if isinstance(a, (torch.dtype, torch.device, str, bytes, bool)) or a is None:
            return a == b
        if isinstance(a, np.ndarray):  # a str or bytes array (tensors are compared as tensors)
            return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
        try:
            eq = a == b
        except Exception:  # noqa: BLE001 - a user type's __eq__ may raise anything; repr decides then
            eq = NotImplemented
        if isinstance(eq, (bool, np.bool_)):
            return bool(eq)
        return repr(a) == repr(b)

    def within(self, a: Any, b: Any) -> bool:
        """Two numbers whose bits differ: equal within the tolerance (and counted), or not."""
        if self.tolerant and self.close(a, b):
            self.tolerated += 1
            return True
        return False

    def close(self, a: Any, b: Any) -> bool:
        if a != a and b != b:  # NaN matches NaN under a tolerance
            return True
        try:
            return abs(a - b) <= self.atol + self.rtol * abs(b)
        except OverflowError:
            return False

    def mappings(self, ca: walk.Container, cb: walk.Container, trail: tuple, depth: int) -> None:
        a = {_key_id(k): (k, v) for k, v in ca.items}
        b = {_key_id(k): (k, v) for k, v in cb.items}
        keys = _lenient_order([k for k, _ in ca.items] + [k for kid, (k, _) in b.items() if kid not in a])
        for k in keys:
            kid = _key_id(k)
            x, y = a.get(kid), b.get(kid)
            if x is not None and y is not None:
                self.compare(x[1], y[1], trail + (k,), depth + 1)
            elif self.tensors_only and not _has_tensor((x or y or (None, None))[1]):
                continue
            elif x is not None:
                self.add(trail + (k,), "removed", describe(x[1]), None)
            elif y is not None:
                self.add(trail + (k,), "added", None, describe(y[1]))
        if ca.tag == "odict" and cb.tag == "odict":
            # Order is content for OrderedDicts (it is saved), not for dicts.
            common_a = [k for k, _ in ca.items if _key_id(k) in b]
            common_b = [k for k, _ in cb.items if _key_id(k) in a]
            if [_key_id(k) for k in common_a] != [_key_id(k) for k in common_b]:
                self.add(trail, "order", *_shown_pair(common_a, common_b))
            if ca.metadata is not None and cb.metadata is not None:
                self.compare(ca.metadata, cb.metadata, trail + (walk.METADATA,), depth + 1)
            elif ca.metadata is not None or cb.metadata is not None:
                self.add(trail, "metadata", "_metadata " + _short(ca.metadata), "_metadata " + _short(cb.metadata))

    def parts(self, a: Any, b: Any, special_a: tuple | None, special_b: tuple | None, trail: tuple) -> None:
        """Sparse, nested, meta and subclass tensors (§6.12): what each is, then part by part."""
        what_a = "dense" if special_a is None else special_a[0]
        what_b = "dense" if special_b is None else special_b[0]
        if what_a != what_b or special_a is None or special_b is None:
            self.add(trail, "type", f"{what_a} tensor", f"{what_b} tensor")
            return
        if _dtype_name(a) != _dtype_name(b):
            self.add(trail, "dtype", _dtype_name(a), _dtype_name(b))
            return
        if not what_a.startswith("nested") and tuple(a.shape) != tuple(b.shape):  # (nested: by element)
            self.add(trail, "shape", str(list(a.shape)), str(list(b.shape)))
            return
        if bool(a.requires_grad) != bool(b.requires_grad):
            self.add(trail, "requires_grad", str(bool(a.requires_grad)), str(bool(b.requires_grad)))
        for (step, x), (_, y) in zip(special_a[1], special_b[1], strict=False):
            self.compare(x, y, trail + (step,), 1)
        if len(special_a[1]) != len(special_b[1]):
            self.add(trail, "length", plural(len(special_a[1]), "element"), plural(len(special_b[1]), "element"))

    def tensors(self, a: Any, b: Any, trail: tuple) -> None:
        where = self.where(trail)
        first_a = self.seen_a.setdefault(_alias_key(a, self.rows_a), where)
        first_b = self.seen_b.setdefault(_alias_key(b, self.rows_b), where)
        if first_a != first_b and not self.tensors_only:
            self.add(trail, "alias",
                     f"same tensor as {first_a}" if first_a != where else "a separate tensor",
                     f"same tensor as {first_b}" if first_b != where else "a separate tensor")
        if _tensor_kind(a) != _tensor_kind(b):
            self.add(trail, "type", _tensor_kind(a), _tensor_kind(b))
        if not isinstance(a, np.ndarray) and not isinstance(b, np.ndarray):
            attrs_a, attrs_b = tensorkinds.attributes(a), tensorkinds.attributes(b)
            if attrs_a or attrs_b:  # attributes set on the tensors (§6.12.4), by their names
                self.compare(dict(attrs_a), dict(attrs_b), trail, 1)
        special_a, special_b = _special(a), _special(b)
        if special_a is not None or special_b is not None:
            self.parts(a, b, special_a, special_b, trail)
            return
        if _dtype_name(a) != _dtype_name(b):
            self.add(trail, "dtype", _dtype_name(a), _dtype_name(b))
            return
        if tuple(a.shape) != tuple(b.shape):
            self.add(trail, "shape", str(list(a.shape)), str(list(b.shape)))
            return
        fa, fb = self.fetch_a.get(id(a)), self.fetch_b.get(id(b))
        dev_a = self.devices_a.get(where, "cpu" if fa or isinstance(a, np.ndarray) else str(a.device))
        dev_b = self.devices_b.get(where, "cpu" if fb or isinstance(b, np.ndarray) else str(b.device))
        if dev_a != dev_b:  # placement, not content (the digest does not cover it): a note
            self.notes.append(Difference(where, "device", dev_a, dev_b))
        rg_a = bool(getattr(a, "requires_grad", False))
        rg_b = bool(getattr(b, "requires_grad", False))
        if rg_a != rg_b:
            self.add(trail, "requires_grad", str(rg_a), str(rg_b))
        if (not fa and getattr(a, "is_meta", False)) or (not fb and getattr(b, "is_meta", False)):
            return  # meta tensors hold no values
        for v in (a, b):
            if isinstance(v, np.ndarray) and (v.dtype.fields is not None
                                              or dtypes.BY_NUMPY.get(v.dtype.newbyteorder("<")) is None):
                raise UnsupportedTypeError(
                    f"{where}: a numpy array of dtype {v.dtype}, which tensorcanon does not save, so diff "
                    "does not compare its elements; compare such arrays with numpy", path=where)
        # (a placeholder's values are read now, and dropped once compared: memory is bounded by
        # the tensors compared at once, not by the files)
        stats, bits = _stats(_as_torch(fa() if fa else a), _as_torch(fb() if fb else b), self.atol, self.rtol)
        if stats is not None:
            self.add(trail, "values", None, None, stats)
        elif bits:
            self.tolerated += 1


def _generators(v: Any) -> list[tuple[str, Any]] | None:
    """A random state (:class:`~tensorcanon.RngState`) or generator object as ``(generator name,
    its state)`` pairs, None for any other value. Each state is what the format saves of it
    (FORMAT.md §6.7): an RngState's parts as they are, a generator object by the digest of saving
    it alone (its seed sequence included), so two generators are equal when they would save the same."""
    t = type(v)
    th, numpy = optional.imported(), optional.imported("numpy")
    rng = sys.modules.get("tensorcanon.training.rng")
    if rng is not None and t is rng.RngState:
        out: list[tuple[str, Any]] = [("python", v.python), ("numpy", v.numpy), ("torch cpu", v.torch_cpu)]
        out += [(f"cuda:{i}", s) for i, s in enumerate(v.cuda)]
        out += [("mps", v.mps)] if v.mps is not None else []
        return out + [(f"xpu:{i}", s) for i, s in enumerate(v.xpu)]
    if th is not None and t is th.Generator:
        return [(f"torch.Generator ({v.device})", _saved(v, lambda: bytes(v.get_state().numpy().tobytes())))]
    if t is random.Random:
        return [("random.Random", _saved(v, v.getstate))]
    if numpy is not None and (t in (numpy.random.Generator, numpy.random.RandomState)
                              or isinstance(v, numpy.random.BitGenerator)):
        inner = v.bit_generator if t is numpy.random.Generator else v
        plain = inner.get_state if t is numpy.random.RandomState else (lambda: inner.state)
        return [(f"numpy {t.__name__}", _saved(v, plain))]
    return None


def _saved(v: Any, plain: Callable[[], Any]) -> Any:
    """The digest of saving ``v`` alone (what the format keeps of a generator), or its ``plain()``
    state where the format cannot save it (diff compares any object)."""
    from .. import api  # (tools is above api: a generator is rare in a diff)

    try:
        return api.fingerprint(v)
    except TensorCanonError:
        return plain()
