"""Saving: plan the file, then stream every tensor once through hash and write.

The plan (tree, names, layout, digest algorithm) is made before any tensor
byte is touched. Digests have a fixed size set by the algorithm (16 bytes for
xxh3-128, 32 for sha256), so the header's length is known from the plan:
a seekable target gets a reserved header, then one streaming pass in which
each tensor is hashed and written, then the real header in the reserved
space (the file's blocks are reserved first where the file system allows:
preallocate.py). A non-seekable target, or one opened for appending, gets a
hashing pass first, then the header and the data (each tensor re-hashed as it
is written, to catch a tensor that changed in between). At most two tensors at
a time are ever copied (a tensor that is not contiguous, or not on the CPU, is
copied to canonical bytes): the one being written, and one the hashing thread
of a large save has not finished.
"""

from __future__ import annotations

import io
import os
import queue
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from ..format import container, digest, dtypes, manifest, packed, paths
from ..format.errors import (
    FileAccessError,
    LimitError,
    MissingFileError,
    TensorCanonError,
    UnsupportedTypeError,
    UsageError,
)
from ..format.limits import DEFAULT, Limits, exceeds
from ..format.tensorbytes import host_bytes, host_view
from ..format.tree import Encoder, TensorSource
from . import preallocate

_T = TypeVar("_T")


@dataclass
class Plan:
    root: Any
    meta: Any
    tensors: list[TensorSource]       # table order
    ordered: list[TensorSource]       # data order
    starts: list[int]                 # where each of ``ordered`` starts in the data section
    data_size: int
    algorithm: str = digest.DEFAULT
    version: int = manifest.VERSION
    limits: Limits = DEFAULT  # what readers accept (the header's size is checked when it is built)

    _packed: manifest.Packed | None = None  # the manifest, packed once; only digests change
    _hashers: digest.Hashers | None = None

    @property
    def layout(self) -> list[container.Entry]:
        """The header entries, in data order."""
        return [container.Entry(s.name, s.dtype.st, dtypes.header_shape(s.dtype, s.shape), b, b + s.nbytes)
                for s, b in zip(self.ordered, self.starts, strict=True)]

    def manifest_bytes(self) -> bytes:
        if self._packed is None:
            self._packed = manifest.Packed(
                self.root, self.meta,
                [(s.name, s.dtype.name, s.shape, s.kind, s.requires_grad) for s in self.tensors],
                self.algorithm, self.version)
        zero = bytes(digest.size(self.algorithm))
        return self._packed([s.digest or zero for s in self.tensors])

    _first: tuple[bytes, dict] | None = None  # the first header built, and its __metadata__

    def header(self) -> tuple[bytes, bytes]:
        """(header bytes, manifest bytes) for the digests currently recorded."""
        raw = self.manifest_bytes()
        devices = [s.device for s in self.tensors]
        formats = [s.memory_format for s in self.tensors] if self.version >= 2 else None
        meta = manifest.header_metadata(raw, devices, self.algorithm, formats)
        if self._first is not None:
            spliced = _splice(*self._first, meta)
            if spliced is not None:
                return spliced, raw
        entry = container.entry_text
        members = {}
        for s, b in zip(self.ordered, self.starts, strict=True):
            members[s.name] = entry(s.name, s.dtype.st, dtypes.header_shape(s.dtype, s.shape), b, b + s.nbytes)
        built = container.assemble(members, meta)
        size = len(built) - container.LENGTH_SIZE
        limit = self.limits.max_header_bytes
        if exceeds(self.limits, "max_header_bytes", size):
            raise LimitError(
                f"the file's header would be {size} bytes (its manifest holds the object tree: bytes and "
                f"strings in the object count in full), more than max_header_bytes={limit} "
                "that readers accept; keep large byte strings in tensors (torch.frombuffer) or save with "
                "limits=tensorcanon.Limits(max_header_bytes=...) and load with the same",
                limit="max_header_bytes", path="$", saving=True)
        self._first = (built, meta)
        return built, raw

    def hasher(self, s: TensorSource) -> digest.Hasher:
        """A hasher for ``s``, fed its dtype and shape (each (dtype, shape) prefix built once)."""
        return self._hashers_now()(s.dtype.name, s.shape)  # shapes here are tuples of ints from torch or numpy

    def prefix(self, s: TensorSource) -> bytes:
        """What :meth:`hasher` feeds a hasher first for ``s``: ``hasher_new()(prefix(s))`` is ``hasher(s)``."""
        return self._hashers_now().prefix(s.dtype.name, s.shape)

    def hasher_new(self) -> Callable[[bytes], digest.Hasher]:
        """The constructor of this plan's hashers (see :meth:`prefix`)."""
        return self._hashers_now().new

    def _hashers_now(self) -> digest.Hashers:
        if self._hashers is None or self._hashers.algorithm != self.algorithm:
            self._hashers = digest.Hashers(self.algorithm)
        return self._hashers

    def file_digest(self, raw: bytes) -> str:
        """The file digest, as text, of manifest bytes ``raw``."""
        return digest.to_text(digest.manifest_digest(raw, self.algorithm), self.algorithm)


def _splice(header: bytes, old: dict, new: dict) -> bytes | None:
    """``header`` with ``old``'s manifest and digest texts replaced by ``new``'s, or None.

    Between the header reserved before streaming and the final one only these two
    values change, and their lengths are fixed (digests have a fixed size), so
    re-serializing every tensor entry is unnecessary. Both are plain ASCII inside
    ``__metadata__``; a JSON string cannot contain an unescaped ``"``, so the
    ``"key":"value"`` byte pattern occurs only there. Anything unexpected returns
    None and the caller builds the header in full.
    """
    if old.keys() != new.keys():
        return None
    out = header
    for key in (manifest.KEY_MANIFEST, manifest.KEY_DIGEST):
        a = f'"{key}":"{old[key]}"'.encode("ascii")
        b = f'"{key}":"{new[key]}"'.encode("ascii")
        if len(a) != len(b) or out.count(a) != 1:
            return None
        out = out.replace(a, b)
    return out


def plan(obj: Any, metadata: Any = None, limits: Limits = DEFAULT, algorithm: str = digest.DEFAULT,
         *, version: int = manifest.VERSION, encoder: Encoder | None = None) -> Plan:
    """Encode ``obj`` and lay out its file, reading no tensor data.

    ``version`` other than the current one is only for computing what an older
    format recorded (lockfiles of format-1 fingerprints). ``encoder`` (default: a
    plain :class:`~tensorcanon.tree.Encoder`) may be a subclass that encodes more
    types; tensorcanon.dcp passes one that plans each DTensor as the full tensor
    it stands for, so the plan is that of the unsharded state.
    """
    algorithm = digest.check(algorithm)  # before any work: an unknown name fails fast
    if version not in manifest.READABLE_VERSIONS:
        raise ValueError(f"format version {version} is not one this tensorcanon knows")
    if encoder is not None and encoder.packs != (version >= packed.SINCE):
        raise ValueError(f"the encoder given writes lists as another format version than {version} does")
    enc = encoder if encoder is not None else Encoder(limits.max_depth, version, limits.max_string_array_bytes)
    try:
        root = enc.encode(obj)
    except RecursionError:
        raise LimitError(
            "the object is nested deeper than Python's recursion limit allows to encode",
            limit="max_depth", path="$",
            hint=f"lower limits.max_depth (now {limits.max_depth}; the default is 256) or flatten the object",
        ) from None
    meta = None
    if metadata is not None:
        if type(metadata) is not dict or not all(type(k) is str for k in metadata):
            raise UnsupportedTypeError("metadata must be a dict with str keys", path="metadata")
        menc = Encoder(limits.max_depth, version, limits.max_string_array_bytes)
        meta = menc.encode(metadata)
        if menc.tensors:
            raise UnsupportedTypeError(
                f"metadata cannot hold tensors or arrays (found one at metadata "
                f"{paths.join(menc.tensors[0].path)}); put them in the saved object instead",
                path="metadata",
            )
    if exceeds(limits, "max_tensors", len(enc.tensors)):
        raise LimitError(
            f"the object holds {len(enc.tensors)} tensors, more than max_tensors={limits.max_tensors} "
            "that readers accept", limit="max_tensors", path="$", saving=True,
        )
    enc.assign_names(version)
    ordered = container.in_data_order(enc.tensors, _name, _itemsize)
    for s in ordered:
        ndim = len(s.shape) + (not s.dtype.native)
        if exceeds(limits, "max_ndim", ndim):
            where = paths.join(s.path)
            raise LimitError(
                f"the tensor at {where} has {ndim} header dimensions (its {len(s.shape)} plus "
                f"one for a dtype stored as bytes, if any), more than max_ndim={limits.max_ndim} that "
                "readers accept", limit="max_ndim", path=where, saving=True,
            )
    starts, position = container.packed(s.nbytes for s in ordered)
    return Plan(root, meta, enc.tensors, ordered, starts, position, algorithm, version, limits)


def refuse_skip_data(p: Plan, call: str) -> None:
    """Refuse to write ``p`` inside ``torch.serialization.skip_data()`` (torch 2.5 and later) when it
    holds bytes of torch tensors: ``torch.save`` would leave them out, and a tensorcanon file always
    holds every byte of every tensor with its digest (docs/LIMITS.md). What holds no such bytes
    (meta tensors, numpy arrays, which torch.save writes whole there too) is written as always.
    ``skip_data`` is a setting of the calling thread (torch keeps it thread-local), as here."""
    torch = sys.modules.get("torch")  # (not imported: no skip_data can be active)
    tls = getattr(getattr(torch, "serialization", None), "_serialization_tls", None)
    if torch is None or not getattr(tls, "skip_data", False):
        return
    held = next((s for s in p.ordered if s.nbytes and isinstance(s.value, torch.Tensor)), None)
    if held is None:
        return
    raise UsageError(
        f"{call} was called inside torch.serialization.skip_data(), which makes torch.save write tensors "
        f"without their bytes; a tensorcanon file always holds every byte of every tensor and its digest, "
        f"so none is written without them (the tensor at {paths.join(held.path)} holds {held.nbytes} "
        "bytes). Save outside skip_data(); for a file of dtypes and shapes only (a skeleton), save meta "
        "tensors, which hold no bytes and are saved inside skip_data() too: "
        "{k: v.to('meta') for k, v in state_dict.items()} (docs/FORMAT.md §6.12.3)")


def _name(s: TensorSource) -> str:
    return s.name


def _itemsize(s: TensorSource) -> int:
    return s.dtype.itemsize


def _chunks(src: TensorSource) -> Iterable[memoryview]:
    """A tensor's canonical bytes as host buffers: one view for CPU data (no copy
    when contiguous); for CUDA, chunks staged through the pinned ring (cuda.py)."""
    if src.device.startswith("cuda"):
        from . import cuda
        return cuda.host_chunks(src.value)
    return (host_bytes(src.value, src.kind),)


def _write_all(f: BinaryIO, data: memoryview | bytes) -> None:
    """Write all of ``data``: an unbuffered file's ``write`` may take only part of it.

    (Linux's write(2) moves at most 2,147,479,552 bytes per call, so a larger tensor
    written to ``open(path, "wb", buffering=0)`` would otherwise lose its tail.)
    """
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    total = view.nbytes
    done = f.write(view)
    if done is None:  # a writer that reports no count writes everything or raises
        return
    while done < total:
        n = f.write(view[done:])
        if not n:
            raise TensorCanonError(
                f"the target file object accepted 0 of the last {total - done} bytes; "
                "nothing was lost from the object, save again to a writable target"
            )
        done += n


_PIECE = 1 << 20  # hash a piece, then write it while it is still in the CPU cache
_STAGED = 64 << 10  # tensors up to this size are copied into one buffer, written a MiB at a time


_NO_BUFFER = memoryview(bytearray())


class _Staging:
    """Small tensors' bytes gathered in one buffer: one write per MiB instead of one per tensor.

    :meth:`stage` copies bytes in and returns the copy, which is what gets
    hashed: the bytes hashed are exactly the bytes written.
    """

    def __init__(self, f: BinaryIO, size: int = _PIECE) -> None:
        """``size``: at least the largest tensor staged (at most :data:`_STAGED`); a MiB at most."""
        self.f = f
        # The buffer is made on first use, of the data's size when that is less than a MiB: a MiB
        # made (and zeroed) for every save cost a save of a small config more than its own bytes.
        self.size = min(size, _PIECE)
        self.view = _NO_BUFFER
        self.n = 0

    def stage(self, data: memoryview) -> memoryview:
        m = len(data)
        if self.n + m > len(self.view):
            self.flush()
            if m > len(self.view):
                self.view = memoryview(bytearray(max(self.size, m)))
        copy = self.view[self.n : self.n + m]
        copy[:] = data
        self.n += m
        return copy

    def flush(self) -> None:
        if self.n:
            _write_all(self.f, self.view[: self.n])
            self.n = 0


_LANE_FROM = 16 << 20  # bytes of data from which a save to a file hashes on a second thread


def _hash(src: TensorSource, p: Plan, out: _Staging | None = None) -> bytes:
    """Hash one tensor's canonical bytes, writing them through ``out`` as well when given.

    A large tensor is hashed and written a piece at a time, each piece written
    while it is still in the CPU cache. (CUDA chunks come from a reused staging
    ring, so each is hashed before its slot is refilled.)
    """
    h = p.hasher(src)
    chunks = _chunks(src)
    try:
        for chunk in chunks:
            if out is None:
                h.update(chunk)
            elif len(chunk) <= _STAGED:
                h.update(out.stage(chunk))
            else:
                out.flush()
                for lo in range(0, len(chunk), _PIECE):
                    piece = chunk[lo : lo + _PIECE]
                    h.update(piece)
                    _write_all(out.f, piece)
    finally:
        close = getattr(chunks, "close", None)  # a CUDA stream of chunks frees its staging ring
        if close is not None:
            close()
    return h.digest()


class _Lane:
    """A second thread that hashes large CPU tensors while the saving thread writes them.

    Hashing and writing both release the GIL, so a save costs about what the
    write alone costs. The tensors whose bytes are their own memory (contiguous
    CPU tensors, the common case) are handed over all at once before the first
    is written (:meth:`lead`): the lane hashes them in order while the writer
    writes, and neither waits for the other until :meth:`close`. Handing them
    over one at a time cost a wake-up of the lane per tensor, each a switch of
    threads that a busy machine (other processes on the cores) made cost up to a
    millisecond. The others (copies: non-contiguous, lazily conjugated) are handed
    over one at a time (:meth:`hash`, a queue put; a future per tensor, waited
    for at the end of each, made large saves about 5% slower), at most ``ahead``
    of them handed over and not yet hashed: with a hash slower than the write
    (sha256 on a fast disk) the writer waits for the lane, and no more than
    ``ahead`` copies are kept alive for it.
    """

    def __init__(self, ahead: int = 2) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Semaphore(ahead)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tensorcanon-hash", daemon=True)
        self._thread.start()

    def reserve(self) -> None:
        """Wait for room on the lane: call before making the bytes that :meth:`hash` hands over,
        so that no more than ``ahead`` copies exist at once."""
        self._room.acquire()

    def hash(self, src: TensorSource, h: digest.Hasher, data: memoryview) -> None:
        """Feed ``data`` to ``h`` on the lane and record the digest as ``src.digest`` (after
        :meth:`reserve`)."""
        self._work.put((src, h, data))

    def lead(self, new: Callable[[bytes], digest.Hasher], views: list[tuple[TensorSource, bytes, memoryview]]) -> None:
        """Hash every ``(src, prefix, data)`` of ``views`` (bytes that are the tensor's own memory,
        :func:`host_view`), in order, as ``new(prefix)`` fed ``data``, recording ``src.digest``; they
        take no room (no copy is held for them)."""
        if views:
            self._work.put((new, views))

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if len(item) == 2:  # lead(): every tensor that is its own memory, in one hand-over
                new, views = item
                for src, prefix, data in views:
                    if self._error is not None:
                        break
                    try:
                        h = new(prefix)
                        h.update(data)
                        src.digest = h.digest()
                    except BaseException as e:  # noqa: BLE001 - handed to the saving thread by close()
                        self._error = e
                item = views = src = data = None
                continue
            try:
                if self._error is None:  # after an error the rest is skipped: the save fails anyway
                    src, h, data = item
                    h.update(data)
                    src.digest = h.digest()
            except BaseException as e:  # noqa: BLE001 - handed to the saving thread by close()
                self._error = e
            finally:
                item = src = h = data = None  # a tensor's bytes are not kept alive while waiting
                self._room.release()

    def release(self) -> None:
        """Give back a :meth:`reserve` that no :meth:`hash` followed."""
        self._room.release()

    def close(self) -> BaseException | None:
        """Wait until every tensor handed over is hashed (and no longer read); return the first
        error the lane met, if any."""
        self._work.put(None)
        self._thread.join()
        return self._error


def _lane_for(p: Plan, f: BinaryIO) -> _Lane | None:
    """A :class:`_Lane` to hash on while writing to ``f``, when that pays: much data and a real
    file, whose writes release the GIL (an in-memory buffer's do not)."""
    if p.data_size < _LANE_FROM or type(f) not in (io.FileIO, io.BufferedWriter, io.BufferedRandom):
        return None
    return _Lane()


def _stream(p: Plan, out: _Staging, lane: _Lane | None) -> None:
    """Write every tensor in data order through ``out`` and record its digest: large CPU
    tensors hashed on ``lane`` (when given) while this thread writes them, the others here."""
    error = None
    try:
        led: dict[int, memoryview] = {}  # id(src) -> its bytes, for the tensors the lane leads on
        if lane is not None:
            views = []
            for src in p.ordered:
                if src.nbytes > _STAGED and src.device == "cpu" \
                        and (view := host_view(src.value, src.kind)) is not None:
                    views.append((src, p.prefix(src), view))
                    led[id(src)] = view
            lane.lead(p.hasher_new(), views)
            del views
        for src in p.ordered:
            view = led.pop(id(src), None) if led else None
            if view is not None:  # hashed by the lane, in its own time
                out.flush()
                _write_all(out.f, view)
                del view
                continue
            if lane is None or src.nbytes <= _STAGED or src.device != "cpu":
                src.digest = _hash(src, p, out)
                continue
            lane.reserve()
            try:
                data = host_bytes(src.value, src.kind)
            except BaseException:
                lane.release()
                raise
            lane.hash(src, p.hasher(src), data)
            out.flush()
            _write_all(out.f, data)
            del data
    finally:
        if lane is not None:  # also after an error here: nothing reads the tensors once this returns
            error = lane.close()
    if error is not None:
        raise error


def fingerprint(p: Plan) -> str:
    """Hash every tensor (no writing) and return the file digest."""
    for src in p.ordered:
        src.digest = _hash(src, p)
    return p.file_digest(p.manifest_bytes())


def _appends(f: BinaryIO) -> bool:
    """True when ``f`` writes everything at its end (opened with ``"a"``, or ``O_APPEND``):
    a header written back over its placeholder would land after the data instead."""
    mode = getattr(f, "mode", None)
    if isinstance(mode, str) and "a" in mode:
        return True
    if fcntl is None:
        return False
    try:
        return bool(fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_APPEND)
    except (AttributeError, OSError, ValueError):
        return False


def check_target(f: Any, what: str) -> None:
    """Raise :class:`UsageError` unless ``f`` (what ``what`` was given, resolved: a URL is a
    Location by now) is a path or a binary file object open for writing."""
    if isinstance(f, (str, os.PathLike)):
        return
    writable = getattr(f, "writable", None)
    try:
        ok = callable(getattr(f, "write", None)) and (writable is None or bool(writable()))
    except (OSError, ValueError, NotImplementedError):  # (a closed file: its writable() raises ValueError)
        ok = False
    if not ok:
        hint = (": bytes are no place to write to (tensorcanon.dumps(obj) returns the file's bytes; a path "
                "in bytes: os.fsdecode(path))" if isinstance(f, (bytes, bytearray, memoryview)) else
                " (a file object must be open for writing, in binary mode)")
        raise UsageError(f"{what} writes to a path, a URL or a binary file object open for writing, not "
                         f"{type(f).__name__}{hint}")


def write(p: Plan, f: BinaryIO) -> str:
    """Write the planned file to ``f`` and return its digest."""
    seekable = False
    try:
        seekable = f.seekable() and not _appends(f)
    except (AttributeError, OSError):
        pass
    out = _Staging(f, p.data_size)
    if not p.ordered:  # no tensor data, so no digest to wait for: the header is final, written once
        header, raw = p.header()
        _write_all(f, header)
    elif seekable:
        start = f.tell()
        reserved = len(p.header()[0])
        preallocate.reserve(f, start, reserved + p.data_size)
        _write_all(f, bytes(reserved))
        _stream(p, out, _lane_for(p, f))
        out.flush()
        header, raw = p.header()
        if len(header) != reserved:  # digests are fixed-size; this cannot change
            raise TensorCanonError("internal error: header size changed while saving")
        end = f.tell()
        f.seek(start)
        _write_all(f, header)
        f.seek(end)
    else:
        fingerprint(p)
        header, raw = p.header()
        _write_all(f, header)
        for src in p.ordered:
            expected = src.digest
            src.digest = _hash(src, p, out)
            if src.digest != expected:
                raise TensorCanonError(
                    f"tensor {src.name!r} changed while it was being saved; save again when no "
                    "other thread modifies it"
                )
        out.flush()
    return p.file_digest(raw)


def _umask() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


TEMP_SUFFIX = ".tensorcanon-tmp"
_TEMP_RE = re.compile(r"(\d+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX) + r"\Z")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # exists but is not ours, or not a pid: leave it alone
    return True


def remove_stale_temps(folder: str, base: str) -> list[str]:
    """Delete temp files of ``base`` left in ``folder`` by processes that died mid-save.

    Temp names are ``.<base>.<pid>.<random>.tensorcanon-tmp``; a file is removed
    only when no process with that pid exists on this machine. A live writer's
    temp file (this process's included) is never touched.
    """
    prefix = f".{base}."
    return remove_files(folder, lambda name: stale_temp(name, prefix))


def stale_temp(name: str, prefix: str) -> bool:
    """True for a temp file named ``<prefix><pid>.<random>.tensorcanon-tmp`` whose process no
    longer exists on this machine."""
    m = _TEMP_RE.fullmatch(name[len(prefix):]) if name.startswith(prefix) else None
    return m is not None and not _pid_alive(int(m.group(1)))


def remove_files(folder: str, which: Callable[[str], bool]) -> list[str]:
    """Delete the files of ``folder`` whose names ``which`` accepts; the names deleted.

    Best effort: a folder that cannot be listed or a file that cannot be deleted
    (gone already, no permission) is left as it is.
    """
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if which(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def replace_atomically(path: str | os.PathLike, fill: Callable[[BinaryIO, str], _T],
                       named: Callable[[_T], str] | None = None) -> _T:
    """Create the file at ``path`` all at once and return what ``fill`` returns.

    ``fill(f, tmp)`` writes a temp file beside ``path``, through the open binary
    file ``f`` or by its path ``tmp``; the temp file is then flushed, fsynced,
    given the usual permissions and renamed over ``path``, and the folder is
    fsynced last. With ``named``, the file is renamed to ``named(result)`` in
    the same folder instead (a name known only once the file is written, such
    as one made from its digest); ``path`` then only names the temp file.

    A crash at any point leaves the previous file at ``path`` untouched; at
    worst a ``.<name>.<pid>.*.tensorcanon-tmp`` file remains beside it, which
    the next write to ``path`` removes once that pid no longer exists.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    if os.path.isdir(path):
        raise FileAccessError(f"cannot save to {path!r}: it is a directory; give a file path inside it",
                              filename=path)
    if not os.path.isdir(folder):
        raise MissingFileError(
            f"cannot save to {path!r}: the folder {folder!r} does not exist; create it first "
            "(os.makedirs(folder, exist_ok=True))", filename=path)
    remove_stale_temps(folder, base)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=folder)
    except OSError as e:
        raise FileAccessError(f"cannot save to {path!r}: cannot create a file in {folder!r} "
                              f"({e.strerror or e}); check the folder's permissions",
                              filename=path, errno=e.errno) from None
    try:
        with os.fdopen(fd, "wb") as f:
            result = fill(f, tmp)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path if named is None else os.path.join(folder, named(result)))
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and not isinstance(e, TensorCanonError):
            raise FileAccessError(f"cannot save to {path!r}: {e.strerror or e}; the previous file "
                                  "there, if any, is unchanged", filename=path, errno=e.errno) from e
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return result
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return result


def write_atomic(p: Plan, path: str | os.PathLike) -> str:
    """Write the planned file to ``path`` atomically (:func:`replace_atomically`)."""
    return replace_atomically(path, lambda f, tmp: write(p, f))
