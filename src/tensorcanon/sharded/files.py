"""Every read of a checkpoint's files goes through this module, on the library's validated file.

An index or a rank file is a :class:`tensorcanon.io.reader.CheckedFile`: its header,
manifest and tree pass every check of docs/FORMAT.md §9 before anything in it
is used. A rank file is opened over a read-only memory map and extends
CheckedFile with what a distributed reader needs: a chunk's bytes in place
(no copy), hashed against their digest before their first use, and a
per-rank value decoded on its own.

A rank file that another process truncates while it is mapped: before each chunk
or per-rank value is read, the map is checked (:meth:`Source.shrunk`), and a file
found shorter is a :class:`FormatError` naming it. A file cut short *while* a
chunk's pages are being read kills the process with SIGBUS, as with any memory
map; tensorcanon's own saves never truncate a rank file (they write new files
and rename them), so only another program rewriting files in place can do this.
Positional reads would turn that into an error too, at a cost measured at 10-30%
more CPU time for reading a checkpoint in the page cache.

A rank file in object storage (a URL, docs/STORAGE.md) cannot be mapped: it is
read by ranged reads of one version of the object (remote.RemoteFile), each
chunk fetched into memory when it is used and hashed against its digest every
time it is fetched, with the same checks of its header and of its digest
against the index.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..format import digest as _digest, optional, tensorbytes
from ..format.errors import FormatError, IntegrityError, MissingFileError, TensorCanonError, UnsupportedTypeError
from ..format.limits import DEFAULT, Limits
from ..format.manifest import TensorInfo
from ..format.tree import Decoder, items, tag_of
from ..io import reader, storage
from ..io.source import opened
from .errors import CheckpointNotFoundError

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())  # imported on first use: verifying a checkpoint needs no torch


def with_context(e: TensorCanonError, prefix: str) -> TensorCanonError:
    """A copy of ``e`` (same class, same attributes) whose message starts with ``prefix``.

    Rebuilt as unpickling rebuilds it (:meth:`TensorCanonError.__reduce__`), without calling
    the class's ``__init__`` (whose signatures differ), so it works for every tensorcanon error
    and keeps an ``OSError``'s ``filename`` and ``errno``.
    """
    rebuild, (cls, _, state) = e.__reduce__()
    message = str(e)
    return rebuild(cls, (message if message.startswith(prefix) else prefix + message,), state)


def read_index_file(path: Any, limits: Limits = DEFAULT) -> tuple[Any, str, str]:
    """``(object, file digest, algorithm)`` of an index file. An index holds no tensors
    (everything is in its manifest), so decoding it reads no data."""
    with reader.open_file(path, limits) as cf:
        file_digest, algorithm = cf.digest, cf.algorithm
        if file_digest is None or algorithm is None:  # no tensorcanon manifest
            raise FormatError("is a plain safetensors file, not a tensorcanon index")
        if cf.rows:
            raise FormatError(f"an index holds no tensors, but this file holds {len(cf.rows)} (is it a rank file?)")
        return cf.load(), file_digest, algorithm


class RankFile(reader.CheckedFile):
    """A validated rank file whose tensors are used in place, from a memory map.

    Open with :meth:`open`. ``expected`` is the file digest the index records: a
    file with another digest (replaced, edited, from another save) is refused
    before any tensor is used. Chunks are addressed by their key in the file's
    flat dict.
    """

    path: str
    _verified: set[int]       # rows whose bytes were hashed against their digest
    _keys: dict[Any, Any]     # the flat dict's keys -> their tree nodes

    _remote = False           # read by ranged reads of an object (a URL), not mapped

    @classmethod
    def open(cls, path: str, expected: str | None = None, limits: Limits = DEFAULT,
             options: dict | None = None) -> RankFile:
        """``options``: the storage options of a rank file in object storage (``path`` a URL)."""
        stack = contextlib.ExitStack()
        remote = options is not None
        url, path = path, storage.redact(path) if remote else path  # (path: as shown, credentials hidden)
        try:
            if remote:
                # read ahead in parallel: readers take chunks in file order (dcp.Reader, W=1 verify)
                src = stack.enter_context(opened(storage.Location(url, options or {}, sequential=True, is_object=True)))
            else:
                # (its bytes, mapped without torch: hashed in place, copied out or viewed by RankFile.tensor)
                src = stack.enter_context(opened(path, use_mmap=True, tensors=False))
            return cls.over(src, path, expected, limits, stack, remote=remote)
        except MissingFileError:  # (as over() raised it, its prefix added; over() closed the stack)
            stack.close()
            raise CheckpointNotFoundError(
                f"rank file {path} is missing: the checkpoint is incomplete, or a newer save replaced it "
                "while it was being read", filename=path) from None
        except TensorCanonError as e:
            stack.close()
            raise with_context(e, f"rank file {path}: ") from None
        except BaseException:
            stack.close()
            raise

    @classmethod
    def over(cls, src: Any, path: str, expected: str | None, limits: Limits, closer: contextlib.ExitStack, *,
             remote: bool = True) -> RankFile:
        """A rank file read from ``src``, checked as :meth:`open` checks one; ``closer`` is closed with it
        (and at once if a check fails). ``remote``: read like a rank file in object storage (each chunk
        fetched and hashed when it is used), as any seekable file object is.
        (tensorcanon.dcp reads a checkpoint kept in a tensorcanon.Store so: each rank file is its header
        and the store's blobs.)"""
        try:
            f = cls(src, limits, closer=closer)
            if not f.is_tensorcanon:
                raise FormatError("is a plain safetensors file, not a tensorcanon rank file")
            f.check_tree()
        except TensorCanonError as e:
            closer.close()
            raise with_context(e, f"rank file {path}: ") from None
        except BaseException:
            closer.close()
            raise
        return f._opened(path, expected, remote)

    def _opened(self, path: str, expected: str | None, remote: bool) -> RankFile:
        f = self
        f.path = path
        f._verified = set()
        f._remote = remote
        if expected is not None and f.digest != expected:
            f.close()
            raise IntegrityError(
                f"rank file {path} has digest {f.digest} but the index records {expected}: it was "
                "replaced or edited after the checkpoint was saved", expected=expected, actual=f.digest)
        assert f.manifest is not None  # is_tensorcanon, checked above
        root = f.manifest.root  # a flat dict (the tree was checked): key -> node
        f._keys = dict(items(root)) if root[0] == "dict" else {}
        return f

    @property
    def algorithm(self) -> str:
        """``"xxh3-128"`` or ``"sha256"`` (a rank file is always a tensorcanon file)."""
        assert self.manifest is not None  # checked in open
        return self.manifest.algorithm

    # ------------------------------------------------------------------ contents
    def keys(self) -> list:
        """The keys of the file's flat dict, in canonical order."""
        return list(self._keys)

    def info(self, key: str, what: Callable[[], str]) -> TensorInfo:
        """The table row of the tensor stored under ``key``; ``what()`` names it in errors."""
        node = self._keys.get(key)
        if node is None or tag_of(node) != "tensor" or len(node) != 2:
            raise FormatError(f"rank file {self.path} holds no tensor {key!r}, needed for {what()}")
        return self.rows[node[1]]

    def raw(self, info: TensorInfo) -> memoryview:
        """The stored bytes of a tensor, in place and not verified (see :meth:`verified`)."""
        if not info.nbytes:
            return memoryview(b"")
        if self._remote:  # fetched now (ranged reads of one version), into memory
            buf = bytearray(info.nbytes)
            self.src.seek(self.data_start + info.begin)
            self.src.readinto(memoryview(buf), f"tensor {info.name!r}")
            return memoryview(buf)
        view = self.src.view(self.data_start + info.begin, info.nbytes)
        if view is None or self.src.shrunk():
            raise self._shrunk()
        return view

    def _shrunk(self) -> FormatError:
        return FormatError(f"rank file {self.path} is shorter than its header says: it changed while being read "
                           "(another program truncated it); read the checkpoint again once it is complete")

    def verified(self, info: TensorInfo, what: Callable[[], str]) -> memoryview:
        """The stored bytes of a tensor, hashed against its digest the first time."""
        view = self.raw(info)
        if info.index not in self._verified or self._remote:  # (fetched bytes: hashed every time)
            h = _digest.tensor_hasher(info.dtype.name, info.shape, self.algorithm)
            h.update(view)
            actual = h.digest()
            if actual != info.digest:
                recorded, computed = self.digest_text(info.digest), self.digest_text(actual)
                raise IntegrityError(
                    f"{what()} does not match its digest in rank file {self.path} (stored as "
                    f"{info.name!r}): recorded {recorded}, computed {computed}; the file is damaged",
                    path=info.name, expected=recorded, actual=computed)
            if info.dtype.name == "bool" and len(view) and np.frombuffer(view, np.uint8).max() > 1:
                raise FormatError(f"{what()} is bool but holds a byte other than 0 or 1 (rank file {self.path})")
            self._verified.add(info.index)
        return view

    def tensor(self, info: TensorInfo, what: Callable[[], str]) -> torch.Tensor:
        """A verified tensor of the stored dtype and shape that *views* the map (no copy).

        Read from it only (the map is read-only); it is valid until :meth:`close`.
        """
        view = self.verified(info, what)
        t = info.dtype.torch
        if t is None:
            raise UnsupportedTypeError(
                f"{what()} has dtype {info.dtype.name}, which this torch ({torch.__version__}) does not "
                f"have: read the checkpoint with a torch that has torch.{info.dtype.name}")
        if not len(view):
            return tensorbytes.host_empty(info.shape, t)
        with warnings.catch_warnings():  # "not writable": we only ever read from it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(view, dtype=torch.uint8)
        return flat.view(t).reshape(info.shape)

    def value(self, key: str, limits: Limits = DEFAULT) -> Any:
        """The value stored under ``key`` (any tree, e.g. a per-rank value), copied and verified."""
        node = self._keys.get(key)
        if key not in self._keys:
            raise FormatError(f"rank file {self.path} holds no value {key!r}")
        if self.src.shrunk():
            raise self._shrunk()
        try:
            return decode_subtree(node, len(self.rows), limits, lambda i: self.read(i))
        except TensorCanonError as e:  # (its paths start at the value: name the file and the key)
            raise with_context(e, f"rank file {self.path}: the value {key!r}: ") from None

    def close(self) -> None:
        try:
            super().close()
        except BufferError:  # a tensor still views the map: the map is unmapped when it goes
            pass


class SubtreeDecoder:
    """Decodes nodes of one already validated tree, each reading only the tensors it uses.

    (The whole tree's structure and table order were checked when its file was
    opened; a subtree may use tensors in any order.) Its decoders and tensor slots are
    made once, so decoding n small subtrees of a tree of m tensors costs time linear in
    n, not n times m.
    """

    def __init__(self, n_tensors: int, limits: Limits) -> None:
        self._probe = Decoder([None] * n_tensors, limits.max_depth, build_objects=False,
                              max_string_bytes=limits.max_string_array_bytes)
        self._probe.used = [True] * n_tensors
        self._values: list[Any] = [None] * n_tensors
        self._build = Decoder(self._values, limits.max_depth, max_string_bytes=limits.max_string_array_bytes)
        self._build.used = self._probe.used

    def decode(self, node: Any, read: Callable[[int], Any]) -> Any:
        probe, values = self._probe, self._values
        probe.uses = []
        probe.decode(node)
        wanted = {i for _, i in probe.uses}
        try:
            for i in wanted:
                values[i] = read(i)
            return self._build.decode(node)
        finally:
            for i in wanted:  # the values are the caller's now: hold none of them
                values[i] = None


def decode_subtree(node: Any, n_tensors: int, limits: Limits, read: Callable[[int], Any]) -> Any:
    """Decode one node of an already validated tree, reading only the tensors it uses
    (:class:`SubtreeDecoder`, for one node)."""
    return SubtreeDecoder(n_tensors, limits).decode(node, read)
