"""Reading: :class:`CheckedFile`, the one object through which every file is read.

Nothing from a file is trusted until it is checked. Opening a CheckedFile
parses the header (every number against the file size) and, for a tensorcanon
file, the manifest (canonical form, the header rebuilt byte for byte, the
recorded file digest), with the algorithm the manifest names. Only then are
tensors read, in file order or one at a time, each hashed as it is read and
placed on its device; the object tree is rebuilt last, so no partial object is
ever returned. ``load``, ``verify``, ``read_metadata``, ``tensorcanon.open``,
``diff``, the command line and the distributed reader all go through it.

docs/FORMAT.md §9 ("Reading") is the normative list of checks.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

from . import container, digest, dtypes, manifest, paths, placement, tensorbytes
from .errors import FormatError, IntegrityError, TensorCanonError
from .limits import DEFAULT, Limits
from .manifest import TensorInfo
from .source import Source, opened
from .tree import Decoder

_CHUNK = 16 << 20       # verify's reusable buffer; bounded reads from streams of unknown size
_HASH_CHUNK = 1 << 20   # read-then-hash piece: small enough to stay in L2


def _plain_rows(header: container.Header) -> list[TensorInfo]:
    """Table rows for a plain safetensors file (no manifest): CPU tensors, no digests.

    ``dtype`` is None where the header dtype has no torch type (``F4``...); such a
    tensor is refused when it is read.
    """
    return [TensorInfo(i, e.name, dtypes.from_safetensors(e.dtype), e.shape, "tensor", False, b"",
                       "cpu", e.begin, e.end)
            for i, e in enumerate(header.entries)]


class CheckedFile:
    """A tensorcanon file (or a plain safetensors file) whose header and manifest passed every check.

    Make one with :func:`open_file`. ``rows`` is the tensor table (table order;
    for a plain file, one row per header entry in file order, without digests).
    Reading methods: :meth:`load` (the whole object), :meth:`read_all` (every
    tensor, in file order: works on streams), :meth:`read` (one tensor: needs a
    path, bytes or a seekable file), :meth:`verify` (hash every byte, return the
    digest), :meth:`metadata`. Structure: :meth:`uses` (every place a tensor
    occurs, by path), :meth:`tensor_path`, :meth:`devices`.

    Example::

        with reader.open_file("ckpt.safetensors") as cf:
            cf.digest, [r.name for r in cf.rows]
            w = cf.read(0)
    """

    def __init__(self, src: Source, limits: Limits = DEFAULT, *,
                 closer: contextlib.ExitStack | None = None) -> None:
        self.src = src
        self.limits = limits
        self._closer = closer
        self.header = container.parse(src.read, src.size, limits)
        self.manifest: manifest.Manifest | None = (
            manifest.parse(self.header, limits) if manifest.is_tensorcanon(self.header) else None)
        self.rows: list[TensorInfo] = (
            self.manifest.tensors if self.manifest is not None else _plain_rows(self.header))
        self._decoder: Decoder | None = None

    # ------------------------------------------------------------------ what the file is
    @property
    def is_tensorcanon(self) -> bool:
        """False for a plain safetensors file, which records no digests."""
        return self.manifest is not None

    @property
    def name(self) -> str | None:
        """The path the file was opened from, when it was a path."""
        return self.src.name

    @property
    def digest(self) -> str | None:
        """The recorded file digest as text (checked against the manifest); None for plain safetensors."""
        return self.manifest.text() if self.manifest is not None else None

    @property
    def algorithm(self) -> str | None:
        """``"xxh3-128"`` or ``"sha256"``; None for plain safetensors."""
        return self.manifest.algorithm if self.manifest is not None else None

    @property
    def data_start(self) -> int:
        return self.header.data_start

    def digest_text(self, raw: bytes) -> str:
        """A raw digest of this file's algorithm, as text."""
        assert self.manifest is not None
        return self.manifest.text(raw)

    # ------------------------------------------------------------------ structure
    def _structure(self) -> Decoder:
        """Check the whole tree (root and user metadata) and the table, building no objects."""
        if self._decoder is None:
            self._decoder = self._decode(None)[1]
        return self._decoder

    def _decode(self, values: list | None) -> tuple[Any, Decoder]:
        m = self.manifest
        assert m is not None
        build = values is not None
        decoder = Decoder(values if build else [None] * len(m.tensors), self.limits.max_depth,
                          build_objects=build)
        if not build:
            decoder.uses = []
        try:
            root = decoder.decode(m.root)
        except RecursionError:
            raise FormatError(
                "manifest: the object tree is nested deeper than Python's recursion limit "
                f"({sys.getrecursionlimit()}) allows to decode, although within max_depth="
                f"{self.limits.max_depth}; files saved with the default limits never are") from None
        decoder.check_table([info.name for info in m.tensors])
        if m.meta is not None:
            Decoder([], self.limits.max_depth, build_objects=False).decode_metadata(m.meta)
        return root, decoder

    def check_tree(self) -> None:
        """Raise unless the object tree and the table follow every rule of docs/FORMAT.md §6."""
        if self.manifest is not None:
            self._structure()

    def uses(self) -> list[tuple[tuple, int]]:
        """``(path, table index)`` for every place a tensor occurs, in canonical order.

        Paths are tuples of decoded keys and indices (render with
        :func:`tensorcanon.paths.join`). A plain safetensors file has one use
        per tensor, at its name.
        """
        if self.manifest is None:
            return [((r.name,), r.index) for r in self.rows]
        uses = self._structure().uses
        assert uses is not None
        return uses

    def tensor_path(self, index: int) -> str:
        """Where tensor ``index`` first occurs in the object, e.g. ``$["model"]["fc.weight"]``.

        For error messages: if the tree itself is malformed the tensor is named
        by its stored name instead.
        """
        if self.manifest is None:
            return paths.join((self.rows[index].name,))
        try:
            return paths.join(self._structure().first_paths[index])
        except (TensorCanonError, RecursionError, IndexError):
            return f"tensor {self.rows[index].name!r}"

    def devices(self) -> dict[str, str]:
        """Path of every tensor use recorded on a device other than the CPU, and that device."""
        if all(r.device == "cpu" for r in self.rows):
            return {}
        return {paths.join(trail): self.rows[i].device for trail, i in self.uses()
                if self.rows[i].device != "cpu"}

    def metadata(self) -> Any:
        """The ``metadata`` dict the file was saved with (None if none, or for plain safetensors)."""
        if self.manifest is None or self.manifest.meta is None:
            return None
        return Decoder([], self.limits.max_depth).decode_metadata(self.manifest.meta)

    # ------------------------------------------------------------------ data
    def _fill(self, view: memoryview, hasher: Any, what: str) -> None:
        """Read ``len(view)`` bytes at the current position into ``view``, hashing as they come."""
        if hasher is None:
            self.src.readinto(view, what)
            return
        for lo in range(0, len(view), _HASH_CHUNK):  # hash each piece while it is in the cache
            piece = view[lo : lo + _HASH_CHUNK]
            self.src.readinto(piece, what)
            hasher.update(piece)

    def _buffer(self, nbytes: int, kind: str, what: str) -> tuple[Any, memoryview]:
        """A buffer holding the next ``nbytes``, allocated only once they are known to exist.

        When the size of the source is unknown (a pipe) the header's sizes could
        not be checked against the file, so a lying header could ask for a
        terabyte: such data is read in bounded chunks first, so memory grows
        only with bytes actually received.
        """
        if self.src.size is not None or nbytes <= _CHUNK:
            buf, mv = tensorbytes.empty_buffer(nbytes, kind)
            self.src.readinto(mv, what)
            return buf, mv
        chunks, left = [], nbytes
        while left:
            n = min(left, _CHUNK)
            chunks.append(self.src.read(n, what))
            left -= n
        buf, mv = tensorbytes.empty_buffer(nbytes, kind)
        pos = 0
        for c in chunks:
            mv[pos : pos + len(c)] = c
            pos += len(c)
        return buf, mv

    def _hasher(self, info: TensorInfo, verify: bool) -> Any:
        if not verify or self.manifest is None:
            return None
        return digest.tensor_hasher(info.dtype.name, info.shape, self.manifest.algorithm)

    def _check(self, info: TensorInfo, hasher: Any) -> None:
        if hasher is None:
            return
        actual = hasher.digest()
        if actual != info.digest:
            raise self.integrity_error(info, actual)

    def integrity_error(self, info: TensorInfo, actual: bytes) -> IntegrityError:
        """The error for tensor ``info`` whose bytes hash to ``actual``: names its path and bytes."""
        where = self.tensor_path(info.index)
        recorded, computed = self.digest_text(info.digest), self.digest_text(actual)
        start = self.data_start
        file = f" of {self.name}" if self.name else ""
        return IntegrityError(
            f"tensor {where} (stored as {info.name!r}, bytes {start + info.begin}-{start + info.end}"
            f"{file}) does not match its digest: recorded {recorded}, computed {computed}; the file "
            "is damaged", path=where, expected=recorded, actual=computed)

    def _read_here(self, info: TensorInfo, map_location: Any, verify: bool) -> Any:
        """Read tensor ``info`` at the current position: verified, typed and placed."""
        what = f"data of tensor {info.name!r}"
        row = info.dtype  # a dtype this torch lacks is refused by tensorbytes.finish, after hashing
        h = self._hasher(info, verify)
        where: Callable[[], str] = lambda: self.tensor_path(info.index)  # noqa: E731
        device = (None if placement.stays_on_cpu(info.kind, info.device, map_location)
                  else placement.target(info.device, map_location))
        ready = None
        if device is not None and device.type == "cuda" and self.src.size is not None:
            # Straight to the GPU through pinned buffers (sizes already checked against the file).
            from . import cuda
            buf = cuda.read_to_device(lambda v: self.src.readinto(v, what), info.nbytes, device,
                                      h.update if h is not None else None)
        elif self.src.size is not None and (h is None or info.nbytes <= _HASH_CHUNK) \
                and (ready := tensorbytes.empty_tensor(row, info.shape, info.kind)) is not None:
            buf, mv = ready  # the common small-tensor case: read straight into the result
            self._fill(mv, h, what)
        elif self.src.size is not None:
            buf, mv = tensorbytes.empty_buffer(info.nbytes, info.kind)
            self._fill(mv, h, what)
        else:
            buf, mv = self._buffer(info.nbytes, info.kind, what)
            if h is not None:
                h.update(mv)
        self._check(info, h)
        value = buf if ready is not None else tensorbytes.finish(buf, row, info.shape, info.kind, info.name)
        return placement.as_recorded(value, info, map_location, where)

    def read(self, index: int, *, map_location: Any = None, verify: bool = True) -> Any:
        """Tensor (or array) ``index`` of :attr:`rows`, read alone, verified, placed.

        Needs random access: a path, bytes or a seekable file object.
        """
        info = self.rows[index]
        placement.check_all([info], map_location, self.tensor_path)
        self.src.seek(self.data_start + info.begin)
        return self._read_here(info, map_location, verify)

    def read_all(self, *, map_location: Any = None, verify: bool = True) -> list:
        """Every tensor, read in file order (so streams work), verified; in table order.

        Every target device is checked before any data is read.
        """
        placement.check_all(self.rows, map_location, self.tensor_path)
        if self.src.random_access and self.src.pos != self.data_start:
            self.src.seek(self.data_start)
        values: list[Any] = [None] * len(self.rows)
        for info in sorted(self.rows, key=lambda r: r.begin):
            values[info.index] = self._read_here(info, map_location, verify)
        return values

    def load(self, *, map_location: Any = None, verify: bool = True) -> Any:
        """The saved object (a plain safetensors file: a dict of tensors by name, in name order)."""
        values = self.read_all(map_location=map_location, verify=verify)
        if self.manifest is None:
            return {r.name: v for r, v in sorted(zip(self.rows, values), key=lambda p: p[0].name)}
        return self._decode(values)[0]

    def verify(self) -> str:
        """Hash every byte, check every tensor digest and the tree; return the file digest."""
        if self.manifest is None:
            raise FormatError(
                "this is a plain safetensors file with no tensorcanon manifest, so it records no "
                "digests to verify; convert it with tensorcanon.save(tensorcanon.load(path), out)")
        if self.src.random_access and self.src.pos != self.data_start:
            self.src.seek(self.data_start)
        buf = memoryview(bytearray(min(_CHUNK, max((r.nbytes for r in self.rows), default=0))))
        for info in sorted(self.rows, key=lambda r: r.begin):
            h = self._hasher(info, True)
            left = info.nbytes
            while left:
                n = min(left, len(buf))
                self._fill(buf[:n], h, f"data of tensor {info.name!r}")
                left -= n
            self._check(info, h)
        self.check_tree()  # the tree must also be well-formed and the table canonical
        return self.manifest.text()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the file this object opened (nothing happens for a caller's file object or bytes)."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer.close()

    def __enter__(self) -> CheckedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_file(f: Any, limits: Limits = DEFAULT, *, use_mmap: bool = False) -> CheckedFile:
    """Open and check a path, a binary file object or bytes; see :class:`CheckedFile`.

    A path is opened by the CheckedFile and closed by its :meth:`~CheckedFile.close`
    (use it as a context manager). With ``use_mmap`` a path is memory-mapped.
    """
    stack = contextlib.ExitStack()
    try:
        src = stack.enter_context(opened(f, use_mmap=use_mmap))
        return CheckedFile(src, limits, closer=stack)
    except BaseException:
        stack.close()
        raise


__all__ = ["CheckedFile", "open_file"]
