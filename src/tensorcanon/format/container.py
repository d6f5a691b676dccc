"""The safetensors container: the 8-byte length, the JSON header, the data.

Layout (docs/FORMAT.md, "Container")::

    u64 little-endian N | N bytes of JSON, space-padded to a multiple of 8 | tensor data

tensorcanon writes the JSON itself, compact with sorted keys, because
safetensors' own writer orders ``__metadata__`` keys randomly. Tensor data is
laid out by element size (largest first), then by name, with no gaps. This
module builds that header and parses any safetensors header, validating every
number before it is used.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring as encode_str  # json.dumps' own escaping (ensure_ascii=False)
from typing import Any, NoReturn, TypeVar

from . import dtypes, paths
from .errors import FormatError, LimitError
from .limits import Limits, exceeds, too_large  # (too_large: §5.3's rule, re-exported here)

_R = TypeVar("_R")

LENGTH_SIZE = 8
ALIGN = 8
META = "__metadata__"
_ENTRY_KEYS = {"data_offsets", "dtype", "shape"}


def size_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """What is wrong with a tensor of ``shape`` and ``itemsize`` by :func:`too_large` (to follow
    "tensor 'name' "), or None."""
    if not too_large(shape, itemsize):
        return None
    size = f"{itemsize} byte{'s' if itemsize != 1 else ''}"
    return (f"has shape {paths.show(list(shape))}, whose non-zero dimensions times its element size ({size}) "
            "reach 2^63 or more, which the format does not allow even for a tensor without elements: numpy "
            "cannot hold one, nor torch past 2^64 (docs/FORMAT.md §5.3)")


def data_order(name: str, itemsize: int) -> tuple:
    """Sort key of a tensor's data in the file: larger elements first, then name (its UTF-8 bytes)."""
    return (-itemsize, name.encode("utf-8"))


def in_data_order(rows: Iterable[_R], name: Callable[[_R], str], itemsize: Callable[[_R], int]) -> list[_R]:
    """``rows`` sorted as their data lies in the file (docs/FORMAT.md §2.5): :func:`data_order`,
    computed without a key tuple per row (a name is valid UTF-8, whose byte order is code point
    order: sort by name, then stably by element size, larger first)."""
    ordered = sorted(rows, key=name)
    ordered.sort(key=itemsize, reverse=True)  # (reverse keeps equal sizes in name order: sort is stable)
    return ordered


def packed(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Where each of the tensors of ``sizes`` (bytes, in data order) starts in the data section
    (each where the one before ends, the first at 0: §2.5, no padding), and the section's size."""
    starts = list(itertools.accumulate(sizes, initial=0))  # (in C: no Python step per tensor)
    position = starts.pop()
    return starts, position


@dataclass(frozen=True)
class Entry:
    """One tensor as the header declares it."""

    name: str
    dtype: str          # safetensors dtype string
    shape: tuple[int, ...]
    begin: int          # offsets relative to the start of the data section
    end: int


def entry_text(name: str, dtype: str, shape: Sequence[int], begin: int, end: int) -> str:
    """One tensor member of the canonical header JSON, ``"name":{...}``, as :func:`build` writes it.

    Byte for byte what ``json.dumps(..., sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)`` gives for the member (the same string escaping, ints
    in decimal), built without the intermediate dicts: a header of 20,000
    tensors is built (by the writer) and rebuilt (by every reader, to check it
    is canonical) in a few milliseconds. ``dtype`` is a safetensors dtype
    string from the dtype table (plain ASCII, nothing to escape).
    """
    dims = ",".join(map(str, shape))
    return f'{encode_str(name)}:{{"data_offsets":[{begin},{end}],"dtype":"{dtype}","shape":[{dims}]}}'


def assemble(members: dict[str, str], metadata: dict[str, str] | None) -> bytes:
    """The canonical header bytes from ``{name: entry_text}`` and ``__metadata__``.

    Members are ordered by name (as ``sort_keys`` orders them); the JSON is
    space-padded to a multiple of 8 and prefixed with its length. A header of
    many tensors is megabytes (its manifest mostly), so the text is joined once:
    no intermediate copies of the whole.
    """
    if metadata is not None:
        members[META] = encode_str(META) + ":" + metadata_text(metadata)
    parts = [members[k] for k in sorted(members)]
    if parts:
        parts[0] = "{" + parts[0]
        parts[-1] += "}"
    text = ",".join(parts).encode("utf-8") if parts else b"{}"
    pad = -len(text) % ALIGN
    return b"".join([struct.pack("<Q", len(text) + pad), text, b" " * pad])




def metadata_text(metadata: dict[str, str]) -> str:
    """``__metadata__`` as ``json.dumps(metadata, sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)`` writes it.

    A value of plain ASCII (no quote, backslash or control character: a
    tensorcanon file's base64 manifest, digest and lists) is written as it is,
    which for a manifest of megabytes is several times faster than the JSON
    encoder's escaping scan; any other value goes through that encoder.
    """
    items = []
    for k in sorted(metadata):
        v = metadata[k]
        # (printable ASCII has no control character: json.dumps would escape those)
        if type(k) is str and type(v) is str and k.isascii() and v.isascii() and '"' not in v \
                and "\\" not in v and v.isprintable() \
                and '"' not in k and "\\" not in k and k.isprintable():
            items.append(f'"{k}":"{v}"')
        else:
            return json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "{" + ",".join(items) + "}"


def build(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The canonical header bytes: length prefix, JSON, space padding."""
    return assemble({e.name: entry_text(e.name, e.dtype, e.shape, e.begin, e.end) for e in entries}, metadata)


class Header:
    """A parsed header: ``length`` (N, the JSON length including padding), ``entries``
    (in data order), ``metadata`` (``__metadata__``, or None), ``data_size`` and ``raw``
    (the length prefix and the JSON, as read).

    A canonical tensorcanon header checked in one pass (fastparse.py) builds its
    entries only when asked for: its readers use the manifest's table instead.
    """

    __slots__ = ("length", "_entries", "metadata", "data_size", "raw", "_make_entries")

    def __init__(self, length: int, entries: list[Entry] | None, metadata: dict[str, str] | None,
                 data_size: int, raw: bytes, make_entries: Callable[[], list[Entry]] | None = None) -> None:
        self.length, self._entries, self.metadata = length, entries, metadata
        self.data_size, self.raw, self._make_entries = data_size, raw, make_entries

    @property
    def entries(self) -> list[Entry]:
        if self._entries is None:
            assert self._make_entries is not None
            self._entries, self._make_entries = self._make_entries(), None
        return self._entries

    @property
    def data_start(self) -> int:
        return LENGTH_SIZE + self.length


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"header: key {k!r} appears twice")
        out[k] = v
    return out


def _reject_constant(name: str) -> NoReturn:
    raise FormatError(f"header: {name} is not valid JSON")


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise FormatError(f"header: {what} must be a non-negative integer, found {value!r}")
    return value


NOT_OURS = "not a safetensors or tensorcanon file"
"""How every refusal of a file that is not a safetensors file at all begins (:func:`not_ours`)."""

TRACE_MAGIC = b"\x89TCTRC\r\n"
"""The first 8 bytes of a trace of a training run (trace/layout.MAGIC, which a test holds equal)."""

_CONVERT = ("convert it once with `tensorcanon convert FILE OUT.safetensors` (from Python: "
            "tensorcanon.save(torch.load(path, weights_only=True), new_path))")


# The start of a protocol 0 or 1 pickle: a global (``cmodule\n``), a mark before a dict, list or
# tuple, or an empty dict or list followed by a memo, a mark or the end. (Not any text that starts
# with "c" or "(": a note that begins "config" is not called a pickle.)
_OLD_PICKLE = re.compile(rb"c[A-Za-z_][\w.]{0,6}\n|\((?:dp?|lp?|t)|[}\]](?:q|\(|\.)")


def foreign_kind(head: bytes) -> tuple[str, str] | None:
    """``(what the file is, what to do with it)`` when its first bytes are a format tensorcanon
    knows and does not read as a safetensors file: a torch.save zip or pickle, a numpy file, a
    trace; else None. The one list of them: the reader's messages, the command line's and a
    lockfile's refusal of a tensor file all come from here (with :func:`not_ours`)."""
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return ("a zip archive (torch.save's format, which holds a pickle, or numpy's .npz)",
                f"tensorcanon never unpickles: {_CONVERT}")
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a pickle (torch.save's legacy format)", f"tensorcanon never unpickles: {_CONVERT}"
    if _OLD_PICKLE.match(head):  # (protocols 0 and 1: never torch.save's)
        return "a pickle", "tensorcanon never unpickles, and torch.save does not write this kind"
    if head.startswith(b"\x93NUMPY"):
        return "a numpy .npy file", "`tensorcanon convert FILE OUT.safetensors` makes a tensorcanon file of it"
    if head[:LENGTH_SIZE] == TRACE_MAGIC:
        return ("a trace of a training run (docs/TRACE.md)",
                "`tensorcanon verify` checks it, `tensorcanon diverge` compares two")
    return None


def _size_text(n: int) -> str:
    """A byte count for a message: ``4,096 bytes``, and from a megabyte on ``320 PB``."""
    if n < 1_000_000:
        return f"{n:,} byte{'' if n == 1 else 's'}"
    x = n / 1e6
    for unit in ("MB", "GB", "TB", "PB"):
        if x < 999.5:
            return f"{x:.3g} {unit}"
        x /= 1000
    return f"{x:.3g} EB"


def not_ours(head: bytes, file_size: int | None, limits: Limits) -> FormatError | None:
    """The error for a file that is not a safetensors file at all, judged from its first bytes
    ``head`` (9 of them when the file has them; the reader has only the 8 of the length), or None
    when it may be one (the reader's checks of docs/FORMAT.md §9.1 then say what is wrong).

    One judgement for the reader (``tensorcanon.load``), the command line and lockfiles, so that
    they give the same reason for the same file: empty or too short; a format it is instead
    (:func:`foreign_kind`); a length that claims more bytes than the file has, or than
    ``max_header_bytes`` (a :class:`LimitError`, as §9.1 item 2 orders); a header that does not
    start with ``{``. A file that may be valid is never refused by a guess: a foreign format is
    named only where the bytes already fail as a safetensors file."""
    known = file_size
    if (len(head) if known is None else known) < LENGTH_SIZE:
        n = len(head) if known is None else known
        what = "it is empty" if n == 0 else f"it has only {_size_text(n)}"
        return FormatError(f"{NOT_OURS}: {what}, so the file ends inside the header length", offset=0)
    (length,) = struct.unpack("<Q", head[:LENGTH_SIZE])
    brace = head[LENGTH_SIZE:LENGTH_SIZE + 1]
    too_long = length > limits.max_header_bytes
    past_end = known is not None and LENGTH_SIZE + length > known
    no_brace = brace not in (b"", b"{")
    if not (too_long or past_end or no_brace):
        return None
    kind = foreign_kind(head)
    if kind is not None:
        return FormatError(f"{NOT_OURS}: it is {kind[0]}; {kind[1]}", offset=0)
    claim = f"its first 8 bytes claim a header of {_size_text(length)}"
    if too_long and (past_end or no_brace):
        has = f"the file has {_size_text(known)}" if known is not None else "its header does not start with '{'"
        return LimitError(f"{NOT_OURS}: {claim} (over max_header_bytes={limits.max_header_bytes})",
                          limit="max_header_bytes", hint=has, offset=0)
    if too_long:  # a header that large may be a real file's: the limit says how to read it
        return None
    if no_brace and past_end:
        return FormatError(f"{NOT_OURS}: {claim}, and the file has {_size_text(known or 0)}", offset=0)
    if no_brace:
        return FormatError(f"{NOT_OURS}: its header does not start with '{{'", offset=LENGTH_SIZE)
    return None  # past the end, with a '{' after the length: a truncated file (read_raw says so)


def parse(read: Callable[[int, str], bytes], file_size: int | None, limits: Limits) -> Header:
    """Read and validate a safetensors header through ``read(n, what)``.

    ``file_size`` (when known) is checked against the declared data size, so a
    truncated file or one with trailing bytes is refused before any tensor is
    allocated.
    """
    prefix, raw = read_raw(read, file_size, limits)
    return parse_raw(prefix, raw, file_size, limits)


def read_raw(read: Callable[[int, str], bytes], file_size: int | None, limits: Limits) -> tuple[bytes, bytes]:
    """``(length prefix, header bytes)``, read after checking the length (docs/FORMAT.md §9.1 1-2)."""
    if file_size is not None and file_size < LENGTH_SIZE:
        refusal = not_ours(b"", file_size, limits)
        assert refusal is not None
        raise refusal
    prefix = read(LENGTH_SIZE, "header length")
    (length,) = struct.unpack("<Q", prefix)
    refusal = not_ours(prefix, file_size, limits)
    if refusal is not None:  # not a safetensors file at all (the same words as the command line's)
        raise refusal
    if exceeds(limits, "max_header_bytes", length):
        raise LimitError(
            f"header declares {length} bytes ({_size_text(length)}), over max_header_bytes="
            f"{limits.max_header_bytes}", limit="max_header_bytes", offset=0,
        )
    if length < 2:
        raise FormatError(f"header length {length} is too small to hold a JSON object", offset=0)
    if file_size is not None and LENGTH_SIZE + length > file_size:
        raise FormatError(
            f"header declares {length} bytes but the file has only {file_size - LENGTH_SIZE} after "
            "the length: the file is truncated or not a safetensors file", offset=0,
        )
    return prefix, read(length, "header")


def parse_raw(prefix: bytes, raw: bytes, file_size: int | None, limits: Limits) -> Header:
    """Validate header bytes read by :func:`read_raw` (docs/FORMAT.md §9.1 3-9), in order."""
    length = len(raw)
    if not raw.startswith(b"{"):  # (not_ours: the words the command line uses for the same file)
        refusal = not_ours(prefix + raw[:1], file_size, limits)
        raise refusal if refusal is not None else FormatError(f"{NOT_OURS}: its header does not start with '{{'",
                                                              offset=LENGTH_SIZE)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError("header is not valid UTF-8", offset=LENGTH_SIZE + e.start) from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise FormatError(f"header is not valid JSON: {e.msg}",
                          offset=LENGTH_SIZE + len(text[: e.pos].encode())) from None
    except RecursionError:
        raise FormatError("header JSON is nested too deeply", offset=LENGTH_SIZE) from None
    if type(obj) is not dict:
        raise FormatError("header is not a JSON object", offset=LENGTH_SIZE)

    metadata = obj.pop(META, None)
    if metadata is not None:
        if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
            raise FormatError("header: __metadata__ must map strings to strings", offset=LENGTH_SIZE)
    if exceeds(limits, "max_tensors", len(obj)):
        raise LimitError(
            f"header declares {len(obj)} tensors, over max_tensors={limits.max_tensors}",
            limit="max_tensors", offset=LENGTH_SIZE,
        )

    entries = []
    for name, info in obj.items():
        where = f"tensor {name!r}"
        if type(info) is not dict or set(info) != _ENTRY_KEYS:
            raise FormatError(f"header: {where} must have exactly dtype, shape and data_offsets")
        st = info["dtype"]
        itemsize = dtypes.SAFETENSORS_ITEMSIZE.get(st) if type(st) is str else None
        if itemsize is None:
            raise FormatError(f"header: {where} has unsupported dtype {st!r}")
        shape = info["shape"]
        if type(shape) is not list:
            raise FormatError(f"header: {where} shape must be a list")
        if exceeds(limits, "max_ndim", len(shape)):
            raise LimitError(f"header: {where} has {len(shape)} dimensions, over max_ndim={limits.max_ndim}",
                             limit="max_ndim")
        for d in shape:
            _int(d, f"{where} shape")
        offsets = info["data_offsets"]
        if type(offsets) is not list or len(offsets) != 2:
            raise FormatError(f"header: {where} data_offsets must be [begin, end]")
        begin, end = (_int(o, f"{where} data_offsets") for o in offsets)
        if end < begin:
            raise FormatError(f"header: {where} ends (at {end}) before it begins (at {begin})")
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes:
            raise FormatError(
                f"header: {where} declares shape {shape} of {st} ({nbytes} bytes) "
                f"but data_offsets span {end - begin} bytes"
            )
        problem = size_problem(shape, itemsize)
        if problem is not None:
            raise FormatError(f"header: {where} {problem}")
        entries.append(Entry(name, st, tuple(shape), begin, end))

    entries.sort(key=lambda entry: (entry.begin, entry.end))
    position = 0
    for entry in entries:
        if entry.begin != position:
            kind = "overlaps the previous tensor" if entry.begin < position else "leaves a gap before it"
            raise FormatError(
                f"header: tensor {entry.name!r} starts at data offset {entry.begin}, which {kind} "
                f"(expected {position})", offset=LENGTH_SIZE + length + min(entry.begin, position),
            )
        position = entry.end
    if file_size is not None and LENGTH_SIZE + length + position != file_size:
        actual = file_size - LENGTH_SIZE - length
        what = "the file is truncated" if actual < position else "the file has trailing bytes"
        raise FormatError(
            f"header declares {position} bytes of tensor data but {actual} follow it: {what}",
            offset=file_size,
        )
    return Header(length, entries, metadata, position, prefix + raw)
