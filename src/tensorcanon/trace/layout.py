"""The trace file's bytes (docs/TRACE.md, "The file"): one place for the writer and every reader.

A trace file is ``MAGIC`` and then frames, each ``u32 length | payload | u64 check``
(little-endian). The payload is a msgpack array; the check is xxh3-64 of the payload seeded with
the previous frame's check (0 for the first), so a frame dropped, repeated or moved breaks the
chain. The first frame is the header, the last one (on a clean close) the end frame; between them
one frame per record. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

import msgpack
import xxhash

from ..format import digest as digests
from ..format.dtypes import BY_NAME
from ..format.errors import FormatError, IntegrityError, UsageError
from ..io.source import open_fd

MAGIC = b"\x89TCTRC\r\n"
FORMAT = "tensorcanon-trace"
VERSION = 1
"""The version of a trace that records the optimizer state at every step (``state_every`` 1)."""
VERSION_WINDOWS = 2
"""The version of a trace that records the optimizer state every ``state_every`` > 1 steps (its
header has an eighth item, ``state_every``); both are read, each writer writes the lowest version
that holds what it records, so a version-1 trace is written byte for byte as before."""
MAX_STATE_EVERY = 1 << 31
"""The largest ``state_every`` a header may give."""
MAX_PAYLOAD = 1 << 20
"""The largest payload a frame may hold, in bytes (a record is ~70 bytes; a long argument note
is cut to MAX_TEXT characters)."""
MAX_TEXT = 4096
MAX_DIMS = 64
MAX_WORLD = 1 << 31
"""The largest world size a header may give."""

TAG_HEADER, TAG_RECORD, TAG_END = 0, 1, 2
LEVELS = ("steps", "modules", "ops")
PHASES = ("data", "rng", "forward", "backward", "optimizer")
KIND_LEVEL = {"batch": "steps", "rng": "steps", "loss": "steps", "param": "steps", "optim": "steps",
              "module": "modules", "grad": "modules", "op": "ops"}
"""Every record kind, and the lowest level that records it (a level records its own kinds and
those of the levels below it)."""
TEXT_DTYPE = "text"
"""The dtype of a record that holds a text (an op's arguments that are not tensors), not a tensor."""

_HEAD = struct.Struct("<I")
_CHECK = struct.Struct("<Q")


def fit(text: str) -> str:
    """``text`` if it has at most MAX_TEXT characters, else its start and the xxh3-64 of all of it
    (MAX_TEXT characters in all): the writer never writes a name its reader refuses, and two long
    names that differ anywhere stay apart."""
    if len(text) <= MAX_TEXT:
        return text
    tail = "...#" + xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
    return text[:MAX_TEXT - len(tail)] + tail


def text_digest(note: str, algorithm: str) -> bytes:
    """A text record's digest: the digest of its note's UTF-8 bytes (the writer's and every
    reader's rule, docs/TRACE.md "Records")."""
    return digests.constructor(algorithm)(note.encode("utf-8")).digest()


def kinds_of(level: str) -> frozenset[str]:
    """The record kinds a trace of ``level`` holds."""
    upto = LEVELS.index(level)
    return frozenset(k for k, lv in KIND_LEVEL.items() if LEVELS.index(lv) <= upto)


class Record(NamedTuple):
    """One record: what it is (step .. role) and what it held (dtype .. note)."""

    step: int
    phase: str
    kind: str
    scope: str      # the module a record of an op ran in ("" if none or unknown)
    name: str       # batch path, generator, module path, op name, parameter name
    call: int       # how many records of (step, phase, kind, scope, name) came before, per role group
    role: str       # "in.0", "out", "value", "grad", an optimizer state key ...
    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    sumsq: float    # float64 sum of squares of the values (of real and imaginary parts)
    note: str       # "" or the text of a text record

    @property
    def identity(self) -> tuple[Any, ...]:
        return self[:7]

    def where(self) -> str:
        """The record's identity, for people: ``step 7 forward module layers.3.noise #0 out``."""
        what = f"{self.scope}/{self.name}" if self.scope else self.name
        return f"step {self.step} {self.phase} {self.kind} {what} call {self.call} {self.role}"


@dataclass(frozen=True)
class Header:
    level: str
    algorithm: str
    rank: int
    world_size: int
    state_every: int = 1
    """The optimizer state (``optim`` records) is recorded at the optimizer steps of the steps s
    with (s + 1) % state_every == 0 only (docs/TRACE.md "Cost"); 1: at every step (version 1)."""

    @property
    def version(self) -> int:
        """The trace format version of a trace with this header."""
        return VERSION if self.state_every == 1 else VERSION_WINDOWS

    def payload(self) -> list[Any]:
        """The header frame's items; a header its reader (``_header``) would refuse is a UsageError
        here, so no writer writes one."""
        items = [TAG_HEADER, FORMAT, VERSION, self.level, self.algorithm, self.rank, self.world_size]
        if self.state_every != 1:
            items = [TAG_HEADER, FORMAT, VERSION_WINDOWS, *items[3:], self.state_every]
        problem = _header(items)
        if isinstance(problem, str):
            raise UsageError(f"trace header: {problem}")
        return items


def canonical_float(x: float) -> float:
    """NaN with one bit pattern (a sum can give either sign), so equal runs write equal bytes."""
    return math.nan if x != x else x


def pack_record(r: Record, pack: Any = None) -> bytes:
    """A record's payload; ``pack`` a ``msgpack.Packer(use_bin_type=True).pack`` to reuse (the same
    bytes as ``msgpack.packb``, which makes a packer per call)."""
    items = [TAG_RECORD, *r[:8], list(r.shape), r.digest, canonical_float(r.sumsq), r.note]
    return msgpack.packb(items, use_bin_type=True) if pack is None else pack(items)


class Writer:
    """Appends frames to a file; ``flush`` makes what was written so far a readable prefix."""

    def __init__(self, fh: BinaryIO, previous: int = 0, count: int = 0) -> None:
        self.fh = fh
        self.previous = previous   # the check of the last frame written
        self.count = count         # records written (the header and end frames are not records)
        self._pack = msgpack.Packer(use_bin_type=True).pack  # (one writer's records are written one at a time)

    def frame(self, payload: bytes) -> None:
        if len(payload) > MAX_PAYLOAD:
            raise UsageError(f"a trace record of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        check = xxhash.xxh3_64_intdigest(payload, seed=self.previous)
        self.fh.write(_HEAD.pack(len(payload)) + payload + _CHECK.pack(check))
        self.previous = check

    def record(self, r: Record) -> None:
        if len(r.scope) > MAX_TEXT or len(r.name) > MAX_TEXT or len(r.role) > MAX_TEXT:
            r = r._replace(scope=fit(r.scope), name=fit(r.name), role=fit(r.role))
        self.frame(pack_record(r, self._pack))  # (the record's layout lives in pack_record alone)
        self.count += 1

    def end(self) -> None:
        self.frame(msgpack.packb([TAG_END, self.count]))
        self.fh.flush()


# --------------------------------------------------------------------------- reading


@dataclass
class Tail:
    """How a read ended: ``complete`` (an end frame that counts the records), or why not."""

    records: int = 0
    complete: bool = False
    stopped: str = ""      # "" when complete; else what was found after the last good record
    offset: int = 0        # the byte offset just past the last good frame
    check: int = 0         # the check of the last good frame (where an append continues the chain)


def _bad(path: str, index: int | str, what: str, offset: int) -> FormatError:
    return FormatError(f"{path}: trace record {index}: {what}; the file is damaged or not a trace written by "
                       "tensorcanon (records before it are intact: `tensorcanon verify` checks the file)",
                       offset=offset)


def _int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _str(v: Any) -> bool:
    return type(v) is str and len(v) <= MAX_TEXT


def _record(p: Any, header: Header) -> Record | str:
    """The record of a decoded payload of a trace with ``header``, or why it is not one."""
    if type(p) is not list or len(p) != 13:
        return "not a record array of 13 items"
    _, step, phase, kind, scope, name, call, role, dtype, shape, dig, sumsq, note = p
    if not _int(step, 0, (1 << 63) - 1):
        return f"step {step!r} is not an integer in [0, 2^63)"
    if phase not in PHASES:
        return f"phase {phase!r} is not one of {', '.join(PHASES)}"
    if kind not in KIND_LEVEL:
        return f"kind {kind!r} is not one of {', '.join(KIND_LEVEL)}"
    if LEVELS.index(KIND_LEVEL[kind]) > LEVELS.index(header.level):
        return (f"a record of kind {kind!r} in a trace of level {header.level!r} (a {kind!r} record is "
                f"recorded from level {KIND_LEVEL[kind]!r} on)")
    if kind == "optim" and header.state_every != 1 and (step + 1) % header.state_every:
        return (f"an optimizer state record of step {step} in a trace that records the optimizer state every "
                f"{header.state_every} steps (after steps {header.state_every - 1}, {2 * header.state_every - 1}, "
                "...)")
    for label, v in (("scope", scope), ("name", name), ("role", role), ("note", note)):
        if not _str(v):
            return f"{label} is not a text of at most {MAX_TEXT} characters"
    if not _int(call, 0, (1 << 63) - 1):
        return f"call index {call!r} is not an integer in [0, 2^63)"
    if dtype != TEXT_DTYPE and dtype not in BY_NAME:
        return f"dtype {dtype!r} is not a dtype name of docs/FORMAT.md or {TEXT_DTYPE!r}"
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(_int(d, 0, (1 << 63) - 1) for d in shape):
        return f"shape {shape!r} is not a list of at most {MAX_DIMS} sizes in [0, 2^63)"
    algorithm = header.algorithm
    if type(dig) is not bytes or len(dig) != digests.size(algorithm):
        return f"the digest is not {digests.size(algorithm)} bytes of {algorithm}"
    if type(sumsq) is not float or not (sumsq >= 0 or sumsq != sumsq):
        return f"sum of squares {sumsq!r} is not a float >= 0, inf or nan"
    if dtype == TEXT_DTYPE:
        if shape != [] or sumsq != 0.0:
            return f"a text record with shape {shape!r} and sum of squares {sumsq!r}, not [] and 0.0"
        if dig != text_digest(note, algorithm):
            return "a text record whose digest is not the digest of its note's UTF-8 bytes"
    return Record(step, phase, kind, scope, name, call, role, dtype, tuple(shape), dig, sumsq, note)


def _header(p: Any) -> Header | str:
    if (type(p) is not list or len(p) not in (7, 8) or not _int(p[0], TAG_HEADER, TAG_HEADER)
            or p[1] != FORMAT):
        return "the first frame is not a tensorcanon-trace header"
    version = p[2]
    if not _int(version, VERSION, VERSION_WINDOWS):  # (an int: msgpack's true or 1.0 is not the version 1)
        return (f"trace format version {version!r}; this tensorcanon reads versions {VERSION} and "
                f"{VERSION_WINDOWS} (upgrade it?)")
    if len(p) != (7 if version == VERSION else 8):
        return (f"a version {version} header of {len(p)} items, not {7 if version == VERSION else 8}: "
                "not a tensorcanon-trace header")
    _, _, version, level, algorithm, rank, world, *rest = p
    state_every = rest[0] if rest else 1
    if rest and not _int(state_every, 2, MAX_STATE_EVERY):
        return (f"state_every {state_every!r} is not an integer in [2, 2^31] (a version {VERSION_WINDOWS} "
                "header's eighth item)")
    if level not in LEVELS:
        return f"level {level!r} is not one of {', '.join(LEVELS)}"
    if algorithm not in digests.ALGORITHMS:
        return f"digest algorithm {algorithm!r} is not one of {sorted(digests.ALGORITHMS)}"
    if not _int(world, 1, MAX_WORLD) or not _int(rank, 0, world - 1):
        return f"rank {rank!r} of world size {world!r} is not a rank in [0, world size)"
    return Header(level, algorithm, rank, world, state_every)


ONE_RECORD_PER_CALL = frozenset({"batch", "rng", "loss", "param", "optim", "grad"})
"""The kinds whose every record is a call of its own (docs/TRACE.md, "The file"): within a step,
the records of one (phase, kind, scope, name) have the call indices 0, 1, 2, ... in file order."""


class Calls:
    """The call-index rule, checked by :func:`verify` and on the records a resume keeps: records
    are in step order (a step never goes back: else a step's calls could be counted from 0 twice,
    and the counters of every step would have to be kept), and for the kinds of
    ONE_RECORD_PER_CALL, the next call index of each (phase, kind, scope, name) of the current
    step. Memory: one entry per such name in one step (its xxh3-128, not its texts), never more
    than the step's records."""

    def __init__(self) -> None:
        self.step = -1
        self.next: dict[int, int] = {}

    def problem(self, r: Record) -> str:
        if r.step < self.step:
            return (f"a record of step {r.step} after one of step {self.step} (records are in step order: a "
                    "step's calls are counted once, from 0)")
        if r.step != self.step:
            self.step = r.step
            self.next.clear()
        if r.kind not in ONE_RECORD_PER_CALL:
            return ""
        key = xxhash.xxh3_128_intdigest(msgpack.packb((r.phase, r.kind, r.scope, r.name)))
        want = self.next.get(key, 0)
        if r.call != want:
            return (f"call index {r.call} of a {r.kind!r} record, where the records before it in step {r.step} make "
                    f"it {want} (each {r.kind!r} record is a call of its own: its call index counts the records "
                    "of the same step, phase, kind, scope and name before it)")
        self.next[key] = want + 1
        return ""


def trace_path(path: Any) -> str:
    """A trace argument as a path text: a ``str``, a path object or ``bytes`` (decoded as the file
    system does); anything else (an int, which ``open`` would take as a file descriptor, None, a
    list) or an empty path or one holding NUL is a :class:`UsageError`."""
    try:
        p = os.fspath(path) if not isinstance(path, (int, float)) else None
    except TypeError:
        p = None
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if type(p) is not str:
        raise UsageError(f"a trace path must be a path (a str, bytes or os.PathLike), not a {type(path).__name__}")
    if not p or "\0" in p:
        raise UsageError(f"{p!r} is not a trace path (an empty path, or one holding NUL)")
    return p


def is_trace(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a regular file that starts with the trace magic."""
    try:
        fd = open_fd(path, "read", "a tensorcanon trace")
    except (OSError, FormatError):
        return False
    try:
        return os.read(fd, len(MAGIC)) == MAGIC
    finally:
        os.close(fd)


class Reader:
    """Streams one trace file's records with bounded memory, checking every frame.

    ``header`` is read on opening. Iterating yields the records in order; afterwards ``tail`` says
    how the file ended. With ``strict``, a file without its end frame (a run that stopped) is an
    error at the record where it stops; without, it ends the iteration (``tail.complete`` False,
    ``tail.stopped`` says why): a crashed run's trace is its valid prefix. A frame whose check
    fails, or whose payload is not a record, is an error either way (a damaged file).
    """

    def __init__(self, path: str | os.PathLike[str], strict: bool = True,
                 start: tuple[int, int, int] | None = None, calls: bool = False) -> None:
        self.path = trace_path(path)
        self.calls = Calls() if calls else None
        self.strict = strict
        self.tail = Tail()
        fd = open_fd(self.path, "read", "a tensorcanon trace")  # a regular file: never a FIFO that blocks
        self.fh: BinaryIO = open(self.path, "rb", buffering=1 << 16, opener=lambda _n, _f: fd)
        try:
            magic = self.fh.read(len(MAGIC))
            if magic != MAGIC:
                raise FormatError(f"{self.path}: not a tensorcanon trace (it does not start with the trace "
                                  "magic bytes; docs/TRACE.md)", offset=0)
            self.offset = len(MAGIC)
            got = self._frame("header")
            if got is None:
                raise FormatError(f"{self.path}: the trace ends before its header ({self.tail.stopped})",
                                  offset=self.offset)
            header = _header(_unpack(got, self.path, "header", self.offset))
            if isinstance(header, str):
                raise _bad(self.path, "header", header, len(MAGIC))
            self.header = header
            if start is not None:  # (offset, check, records) that an earlier reading of this file gave
                self.offset, self.tail.check, self.tail.records = start
                self.tail.offset = self.offset
                self.fh.seek(self.offset)
        except BaseException:
            self.fh.close()
            raise

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.fh.close()

    def _frame(self, index: int | str) -> bytes | None:
        """The next frame's payload after its check, or None at the end of the file or of its
        complete frames (``tail.stopped`` says which)."""
        head = self.fh.read(4)
        if not head:
            self.tail.stopped = "the file ends without an end frame (the run stopped before closing the trace)"
            return None
        (n,) = _HEAD.unpack(head) if len(head) == 4 else (-1,)
        if n < 0:
            self.tail.stopped = f"the file ends inside record {index}'s length ({len(head)} of 4 bytes)"
            return None
        if n > MAX_PAYLOAD:
            raise _bad(self.path, index, f"a length of {n} bytes, more than the {MAX_PAYLOAD} a frame may have",
                       self.offset)
        body = self.fh.read(n + 8)
        if len(body) < n + 8:
            self.tail.stopped = (f"the file ends inside record {index} ({len(body)} of its {n + 8} bytes after "
                                 "the length)")
            return None
        payload = body[:n]
        check = xxhash.xxh3_64_intdigest(payload, seed=self.tail.check)
        if _CHECK.unpack_from(body, n)[0] != check:
            raise IntegrityError(path=f"trace record {index}", message=(
                                 f"{self.path}: trace record {index}: its check does not match its bytes "
                                 f"(at byte {self.offset}): the file was changed or damaged from here on; "
                                 f"the {self.tail.records} records before it are intact"))
        self.tail.check = check
        self.offset += 4 + n + 8
        self.tail.offset = self.offset
        return payload

    def __iter__(self) -> Iterator[Record]:
        header, path, tail = self.header, self.path, self.tail
        while True:
            index = tail.records
            start = self.offset
            payload = self._frame(index)
            if payload is None:
                if self.strict:
                    raise FormatError(f"{path}: incomplete trace: {tail.stopped}; its {index} records are "
                                      "intact (a crashed run's trace: `tensorcanon diverge` compares that prefix)",
                                      offset=self.offset)
                return
            p = _unpack(payload, path, index, start)
            if type(p) is list and p and _int(p[0], TAG_END, TAG_END):
                if len(p) != 2 or not _int(p[1], index, index):  # (an int: not false for 0, nor 0.0)
                    raise _bad(path, index, f"an end frame counting {p[1:]!r} records, not {index}", start)
                if self.fh.read(1):
                    raise _bad(path, index + 1, "bytes after the end frame", self.offset)
                tail.complete, tail.stopped = True, ""
                return
            if type(p) is not list or not p or not _int(p[0], TAG_RECORD, TAG_RECORD):
                raise _bad(path, index, "a frame that is neither a record nor the end frame", start)
            r = _record(p, header)
            if isinstance(r, str):
                raise _bad(path, index, r, start)
            if self.calls is not None:
                why = self.calls.problem(r)
                if why:
                    raise _bad(path, index, why, start)
            tail.records += 1
            yield r


def _unpack(payload: bytes, path: str, index: int | str, offset: int) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=MAX_PAYLOAD,
                               max_str_len=MAX_PAYLOAD, max_array_len=MAX_DIMS + 16, max_map_len=0,
                               max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise _bad(path, index, f"its payload is not valid msgpack ({e})", offset) from None


def verify(path: str | os.PathLike[str]) -> tuple[Header, int]:
    """Check every frame of a trace file, and the call indices (:class:`Calls`); ``(header,
    records)`` when it is complete and intact, else :class:`FormatError` / :class:`IntegrityError`
    naming the file and the record."""
    with Reader(path, strict=True, calls=True) as r:
        for _ in r:
            pass
        return r.header, r.tail.records
