"""Reading: :class:`CheckedFile`, the one object through which every file is read.

Nothing from a file is trusted until it is checked. Opening a CheckedFile
parses the header (every number against the file size) and, for a tensorcanon
file, the manifest (canonical form, the header rebuilt byte for byte, the
recorded file digest), with the algorithm the manifest names. Only then are
tensors read, in file order or one at a time, each hashed as it is read and
placed on its device; the object tree is rebuilt last, so no partial object is
ever returned. ``load``, ``verify``, ``read_metadata``, ``tensorcanon.open``,
``diff``, the command line and the distributed reader all go through it.

The reading of tensors itself is :class:`RowReader`, which CheckedFile extends:
it reads the tensor a proven table row describes and checks nothing else. Only
``tensorcanon.open`` uses it alone, for the rows lazyindex.py proves one at a
time before the whole file is checked.

docs/FORMAT.md §9 ("Reading") is the normative list of checks.
"""

from __future__ import annotations

import contextlib
import io
import operator
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..format import container, digest, dtypes, fastparse, manifest, optional, paths, tensorbytes, tensorkinds, tree
from ..format.errors import FormatError, IntegrityError, LimitError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.manifest import TensorInfo
from ..format.redact import redact
from ..format.tree import Decoder
from . import placement
from .source import Source, opened

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())

_CHUNK = 16 << 20       # verify's reusable buffer; bounded reads from streams of unknown size
_HASH_CHUNK = 1 << 20   # read-then-hash piece: small enough to stay in L2
_viewable_names = tensorbytes.numpy_viewable_names
_SMALL = 64 << 10       # tensors up to this size are read in runs (one read for many), then copied
_RUN = 1 << 20          # bytes per run of small tensors
_BIG_PIECE = 16 << 20   # hash a tensor in memory in pieces of this size (each call releases the GIL)
_THREAD_MIN = 1 << 20           # tensors from this size are hashed on the second thread ...
_THREADS_FROM = 16 << 20        # ... when this much data is to be hashed (else one thread)
_MAPPED_PIECE = 4 << 20  # hash a mapped tensor in pieces of this size, saying how far it has got
_POPULATE = 2 << 20      # map pages of a file in runs of this size (for another thread that hashes them)


_begin = operator.attrgetter("begin")  # (a sort key in C: no Python call per row)


class RowReader:
    """Reads tensors from a file's data section, each by a table row its caller has proven.

    It checks nothing about the file itself: :class:`CheckedFile`, which extends it,
    proves the header and the manifest first and reads the rows of its own table;
    ``tensorcanon.open`` reads the rows lazyindex.QuickIndex proves one at a time
    (lazy.py). ``data_start`` is where the data section starts in ``src``;
    ``algorithm`` the digest algorithm of the rows' digests (None: a plain
    safetensors file, nothing to hash). With ``verify``, a tensor's bytes are
    hashed against its row's digest as they are read, and one that differs is
    never returned.
    """

    def __init__(self, src: Source, limits: Limits, data_start: int, algorithm: str | None) -> None:
        self.src = src
        self.limits = limits
        self._data_start = data_start
        self._algorithm = algorithm
        self._hashers = digest.Hashers(algorithm) if algorithm is not None else None
        self._run_buf: bytearray | None = None
        self._run_view: memoryview | None = None
        self._run_addr = 0

    @property
    def name(self) -> str | None:
        """The path the file was opened from, when it was a path."""
        return self.src.name

    @property
    def data_start(self) -> int:
        return self._data_start

    def digest_text(self, raw: bytes) -> str:
        """A raw digest of this file's algorithm, as text."""
        assert self._algorithm is not None
        return digest.to_text(raw, self._algorithm)

    def _where(self, info: TensorInfo) -> str:
        """The tensor of ``info`` as errors name it (a CheckedFile names its path in the object)."""
        return repr(info.name)

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
        if not verify or self._hashers is None:
            return None
        return self._hashers(info.dtype.name, info.shape)  # validated ints: no (True,) posing as (1,)

    def _check(self, info: TensorInfo, hasher: Any) -> None:
        if hasher is None:
            return
        actual = hasher.digest()
        if actual != info.digest:
            raise self.integrity_error(info, actual)

    def _check_bytes(self, info: TensorInfo, data: memoryview) -> None:
        """Raise unless ``data`` (a tensor's bytes, in memory) hashes to the tensor's digest."""
        h = self._hasher(info, True)
        for lo in range(0, len(data), _BIG_PIECE):
            h.update(data[lo : lo + _BIG_PIECE])
        self._check(info, h)

    def integrity_error(self, info: TensorInfo, actual: bytes) -> IntegrityError:
        """The error for tensor ``info`` whose bytes hash to ``actual``: names its path and bytes."""
        where = self._where(info)
        recorded, computed = self.digest_text(info.digest), self.digest_text(actual)
        start = self.data_start
        file = f" of {self.name}" if self.name else ""
        return IntegrityError(
            f"tensor {where} (stored as {info.name!r}, bytes {start + info.begin}-{start + info.end}"
            f"{file}) does not match its digest: recorded {recorded}, computed {computed}; the file "
            "is damaged", path=where, expected=recorded, actual=computed)

    # ------------------------------------------------------------------ reading rows
    def _read_here(self, info: TensorInfo, map_location: Any, verify: bool) -> Any:
        """Read tensor ``info`` at the current position: verified, typed and placed."""
        what = f"data of tensor {info.name!r}"
        row = info.dtype  # a dtype this torch lacks is refused by tensorbytes.finish, after hashing
        h = self._hasher(info, verify)
        where: Callable[[], str] = lambda: self._where(info)  # noqa: E731
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
            buf, mv = ready  # read straight into the result
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

    def _simple(self, info: TensorInfo, cpu: set[str]) -> bool:
        """True for a small tensor read in a run: it stays on the CPU (its recorded device is in
        ``cpu``, see :meth:`_cpu_bound`) and is built by one copy."""
        return (0 < info.end - info.begin <= _SMALL and info.kind != "ndarray" and info.device in cpu
                and info.dtype.name in _viewable_names()
                and info.memory_format is None)

    def _cpu_bound(self, map_location: Any, devices: Iterable[str]) -> set[str]:
        """The recorded devices (of ``devices``, iterated only when ``map_location`` needs it) whose
        tensors ``map_location`` leaves on (or sends to) the CPU without a callable to consult."""
        if map_location is None:
            return {"cpu"}
        if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
            return set()
        return {d for d in set(devices) if (t := placement.target(d, map_location)) is not None and t.type == "cpu"}

    def _run(self, rows: list[TensorInfo], i: int, values: Any, verify: bool, cpu: set[str]) -> int:
        """Read the run of small tensors that starts at ``rows[i]`` with one read; the next index.

        Each tensor is hashed from the run buffer (private memory, so the bytes
        hashed are the bytes copied) and copied into a tensor of its own. If the
        file ends inside the run, the tensors before that point are checked
        first and the error names the tensor the file ends in, as one read per
        tensor would.
        """
        n, j, total = len(rows), i, 0
        while j < n and (m := rows[j].end - rows[j].begin) <= _RUN - total and self._simple(rows[j], cpu):
            total += m
            j += 1
        if self._run_buf is None or len(self._run_buf) < total:
            # The last run (or tensorcanon.open's one tensor) gets a buffer of its size: a MiB made
            # and zeroed for every file read cost a small file more than reading its tensors.
            self._run_buf = bytearray(total if j >= n else _RUN)
            self._run_view = memoryview(self._run_buf)  # also keeps the buffer from being resized
            self._run_addr = tensorbytes.address(self._run_buf)
        view, addr = self._run_view, self._run_addr
        assert view is not None
        start = self.src.pos
        got = self.src.fill(view[:total])
        hashers = self._hashers if verify else None
        # tensorbytes.copied, inline (one torch.empty and one memmove per tensor, with the torch
        # dtype from a plain dict): _simple admitted only the tensors it copies
        empty, memmove, pos = torch.empty, tensorbytes.memmove, 0
        torch_dtype = dtypes.TORCH_DTYPES_BY_NAME
        host = torch.device("cpu")  # (given: not the default device, which may be another)
        tensorbytes.host_empty(0, torch.uint8)  # once per run: refuses a mode that makes no real tensors
        new = hashers.new if hashers is not None else None
        last: tuple = (None, None)  # (dtype name, shape) of the prefix below: rows of one shape share both
        prefix = b""
        for k in range(i, j):
            info = rows[k]
            m = info.end - info.begin
            if pos + m > got:
                raise FormatError(f"file ends inside the data of tensor {info.name!r}: {pos + m - got} "
                                  "bytes missing", offset=start + got)
            name, shape = info.dtype.name, info.shape
            if new is not None:  # _check_bytes, inline: the hot loop of loading many small tensors
                if name is not last[0] or shape is not last[1]:
                    assert hashers is not None
                    prefix, last = hashers.prefix(name, shape), (name, shape)
                h = new(prefix)
                h.update(view[pos : pos + m])
                if h.digest() != info.digest:
                    raise self.integrity_error(info, h.digest())
            value = empty(*shape, dtype=torch_dtype[name], device=host) if shape \
                else empty((), dtype=torch_dtype[name], device=host)
            memmove(value.data_ptr(), addr + pos, m)
            if info.kind == "parameter":
                value = torch.nn.Parameter(value, requires_grad=info.requires_grad)
            elif info.requires_grad:
                value.requires_grad_(True)
            values[info.index] = value
            pos += m
        return j

    def _mapped(self, info: TensorInfo, map_location: Any, verify: bool) -> Any:
        """Tensor ``info`` as a view of the mapped file (no copy), or None where it must be copied."""
        start = self.data_start + info.begin
        n = info.end - info.begin
        if not placement.stays_on_cpu(info.kind, info.device, map_location):
            device = placement.target(info.device, map_location)
            if device is not None and device.type != "cpu":
                return None  # another device: copied there by the general path
        if info.dtype.torch is None:
            return None  # the general path refuses it, naming its dtype
        mapped = self.src.tensor(start, n)
        if mapped is None:
            return None
        if verify and self._hashers is not None:
            self._check_bytes(info, self.src.data[start : start + n])  # type: ignore[index]
        tensorbytes.check_bool(mapped, info.dtype, info.name)
        value = tensorbytes.viewed(mapped, info.dtype, info.shape, info.kind)
        if value is None:
            return None
        return placement.as_recorded(value, info, map_location, lambda: self._where(info))

    def read_row(self, info: TensorInfo, *, map_location: Any = None, verify: bool = True,
                 share: bool = False) -> Any:
        """The tensor a proven table row describes: verified, placed (see :meth:`CheckedFile.read`)."""
        placement.check_all([info], map_location, lambda _: self._where(info))
        if share:
            if self.src.mapped is None:
                raise UsageError("share=True needs a memory-mapped file (open_file(path, use_mmap=True))")
            value = self._mapped(info, map_location, verify)
            if value is not None:
                return value
        self.src.seek(self.data_start + info.begin)
        cpu = self._cpu_bound(map_location, {info.device})
        if self._simple(info, cpu):
            values: dict[int, Any] = {}
            self._run([info], 0, values, verify, cpu)
            return values[info.index]
        return self._read_here(info, map_location, verify)


class CheckedFile(RowReader):
    """A tensorcanon file (or a plain safetensors file) whose header and manifest passed every check.

    Make one with :func:`open_file`. Constructing one makes every check (docs/FORMAT.md
    §9.1-9.2: the tree is checked when first needed, :meth:`check_tree`), so no
    CheckedFile exists whose header, manifest or table rows are not fully checked.
    ``rows`` is the tensor table (table order;
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

    def __init__(self, src: Source, limits: Limits = DEFAULT, *, closer: contextlib.ExitStack | None = None,
                 raw_header: tuple[bytes, bytes] | None = None) -> None:
        """``raw_header``: the length prefix and header bytes already read from the start of ``src``
        (:func:`container.read_raw`, with these limits), for a caller that has them (lazy.py):
        every check is made on them, only the reading is not repeated. ``src`` must then be at
        the data section, where reading them left it, or allow random access."""
        with naming(src.name):
            prefix, raw = raw_header if raw_header is not None else container.read_raw(src.read, src.size, limits)
            header, m = _parse(prefix, raw, src.size, limits)
        super().__init__(src, limits, header.data_start, m.algorithm if m is not None else None)
        self._closer = closer
        self.header = header
        self.manifest = m
        self.rows: list[TensorInfo] = m.tensors if m is not None else manifest.plain_table(header)
        self._decoder: Decoder | None = None
        self._ordered: list[TensorInfo] | None = None

    def _where(self, info: TensorInfo) -> str:
        return self.tensor_path(info.index)

    # ------------------------------------------------------------------ what the file is
    @property
    def is_tensorcanon(self) -> bool:
        """False for a plain safetensors file, which records no digests."""
        return self.manifest is not None

    @property
    def digest(self) -> str | None:
        """The recorded file digest as text (checked against the manifest); None for plain safetensors."""
        return self.manifest.text() if self.manifest is not None else None

    @property
    def algorithm(self) -> str | None:
        """``"xxh3-128"`` or ``"sha256"``; None for plain safetensors."""
        return self.manifest.algorithm if self.manifest is not None else None

    # ------------------------------------------------------------------ structure
    def _structure(self, uses: bool = False) -> Decoder:
        """Check the whole tree (root and user metadata) and the table, building no objects;
        with ``uses``, also record every tensor use. (Only for the callers that need them: each
        is a path as long as the use is deep, 2 KB for a use that takes 9 bytes of the file.)"""
        if self._decoder is None or (uses and self._decoder.uses is None):
            self._decoder = self._decode(None, uses)[1]
        return self._decoder

    def _decode(self, values: list | None, uses: bool = False) -> tuple[Any, Decoder]:
        m = self.manifest
        assert m is not None
        return tree.decode_manifest(m.root, m.meta, [info.name for info in m.tensors], m.version,
                                    self.limits.max_depth, values, uses, m.tensors if values is None else None,
                                    self.limits.max_string_array_bytes)

    def check_tree(self) -> None:
        """Raise unless the object tree and the table follow every rule of docs/FORMAT.md §6."""
        if self.manifest is not None:
            self._structure()

    def check_values(self, *, verify: bool = True) -> list[int]:
        """Run the checks load makes on the values of parts (docs/FORMAT.md §6.12: sparse indices,
        jagged offsets) on those parts alone, read from the file (hashed against their digests
        unless ``verify`` is false); for a reader that checks the whole file without loading it
        (``tensorcanon.open``). Raises the FormatError load would raise; returns the table
        indices of the parts it read (and, with ``verify``, proved)."""
        checks = list(self._structure().deferred) if self.manifest is not None else []
        wanted = sorted({i for c in checks for i in c.indices})
        parts = {i: self.read(i, map_location="cpu", verify=verify) for i in wanted}
        tensorkinds.run_deferred(checks, self.rows, lambda i: parts[i].contiguous().numpy())
        return wanted

    def uses(self) -> list[tuple[tuple, int]]:
        """``(path, table index)`` for every place a tensor occurs, in canonical order.

        Paths are tuples of decoded keys and indices (render with
        :func:`tensorcanon.paths.join`). A plain safetensors file has one use
        per tensor, at its name.
        """
        if self.manifest is None:
            return [((r.name,), r.index) for r in self.rows]
        uses = self._structure(uses=True).uses
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
            return f"tensor {self.rows[index].name!r}" if index < len(self.rows) else f"tensor {index}"

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
    def read(self, index: int, *, map_location: Any = None, verify: bool = True, share: bool = False) -> Any:
        """Tensor (or array) ``index`` of :attr:`rows`, read alone, verified, placed.

        Needs random access: a path, bytes or a seekable file object. With
        ``share`` (a mapped file only) a CPU tensor views the map instead of
        holding a copy (see :meth:`load`).
        """
        return self.read_row(self.rows[index], map_location=map_location, verify=verify, share=share)

    def _file_order(self) -> list[TensorInfo]:
        if self._ordered is None:
            self._ordered = sorted(self.rows, key=_begin)
        return self._ordered

    def read_all(self, *, map_location: Any = None, verify: bool = True, share: bool = False) -> list:
        """Every tensor, read in file order (so streams work), verified; in table order.

        Every target device is checked before any data is read. With ``share``
        (a mapped file only) CPU tensors view the map (see :meth:`load`).
        """
        placement.check_all(self.rows, map_location, self.tensor_path)
        rows = self._file_order()
        values: list[Any] = [None] * len(self.rows)
        if share:
            if self.src.mapped is None:
                raise UsageError("share=True needs a memory-mapped file (open_file(path, use_mmap=True))")
            cpu = self._cpu_bound(map_location, (r.device for r in self.rows))
            shared = [r for r in rows if r.kind == "ndarray" or r.device in cpu
                      or (map_location is not None and not cpu and callable(map_location))]
            if verify and self.manifest is not None:
                self._verify_mapped(shared)  # every byte, before any tensor is made (two threads when large)
            for info in shared:
                values[info.index] = self._mapped(info, map_location, False)
            for info in rows:  # another device, or a view torch cannot make: copied (and hashed)
                if values[info.index] is None:
                    values[info.index] = self.read(info.index, map_location=map_location, verify=verify)
            return values
        filled = self._read_large(rows, map_location, verify)
        parallel = bool(filled)
        if self.src.random_access and self.src.pos != self.data_start:
            self.src.seek(self.data_start)
        cpu = self._cpu_bound(map_location, (r.device for r in self.rows))
        i, n = 0, len(rows)
        simple = self._simple
        while i < n:
            info = rows[i]
            if parallel:
                done = filled.pop(info.index, None)
                if done is not None:  # read (and hashed) on two threads: checked here, in file order
                    values[info.index] = self._finish_large(info, map_location, *done)
                    i += 1
                    continue
                if self.src.pos != self.data_start + info.begin:  # (after tensors read by position)
                    self.src.seek(self.data_start + info.begin)
            if simple(info, cpu):
                i = self._run(rows, i, values, verify, cpu)
            else:
                values[info.index] = self._read_here(info, map_location, verify)
                i += 1
        if parallel:  # where reading every tensor in order leaves the file
            self.src.seek(self.data_start + rows[-1].end)
        return values

    def _read_large(self, rows: list[TensorInfo], map_location: Any,
                    verify: bool) -> dict[int, tuple[Any, bool, bytes | None]]:
        """Read the large CPU tensors of ``rows`` (file order) on two threads, when the file is a
        regular file and there is much to read: ``{table index: (buffer, whether the buffer is
        the tensor, digest or None)}``; ``{}`` when it is read in order on one thread instead.

        Each thread reads its tensors with positional reads straight into their new buffers, a
        piece at a time, hashing each piece while it is still in the CPU cache (reading and
        hashing release the GIL): one thread from the front, the other from the back, until they
        meet; the two share nothing else until both are done. Nothing is checked or returned
        here: the caller checks each digest in file order, so the tensor an error names is the
        first damaged one in the file, as one thread reading in order would name.
        """
        if self.src.size is None or map_location is not None:
            return {}
        big = [r for r in rows if r.end - r.begin >= _THREAD_MIN and r.device == "cpu"]
        if len(big) < 2 or sum(r.end - r.begin for r in big) < _THREADS_FROM:
            return {}
        fd = self._os_file()
        if fd is None:
            return {}
        base = self.src.file_base + self.data_start
        slots: dict[int, tuple[Any, memoryview, bool]] = {}
        for info in big:  # made here, in file order; their pages are touched as they are read
            ready = tensorbytes.empty_tensor(info.dtype, info.shape, info.kind)
            buf, mv = ready if ready is not None else tensorbytes.empty_buffer(info.nbytes, info.kind)
            slots[info.index] = (buf, mv, ready is not None)
        digests: dict[int, bytes | None] = {}
        lock = threading.Lock()
        ends = [0, len(big)]  # big[ends[0] : ends[1]] are not taken yet
        failed: list[BaseException] = []

        def take(front: bool) -> TensorInfo | None:
            with lock:
                if ends[0] >= ends[1] or failed:
                    return None
                if front:
                    ends[0] += 1
                    return big[ends[0] - 1]
                ends[1] -= 1
                return big[ends[1]]

        def work(front: bool) -> None:
            try:
                while (info := take(front)) is not None:
                    mv = slots[info.index][1]
                    h = self._hasher(info, verify)
                    at = base + info.begin
                    for lo in range(0, len(mv), _HASH_CHUNK):
                        piece = mv[lo : lo + _HASH_CHUNK]
                        got = 0
                        while got < len(piece):
                            k = os.preadv(fd, [piece[got:]], at + lo + got)
                            if not k:
                                raise FormatError(f"file ends inside the data of tensor {info.name!r}: "
                                                  f"{len(mv) - lo - got} bytes missing",
                                                  offset=at + lo + got - self.src.file_base)
                            got += k
                        if h is not None:
                            h.update(piece)
                    digests[info.index] = h.digest() if h is not None else None
            except BaseException as e:  # noqa: BLE001 - raised by the calling thread below
                failed.append(e)

        with ThreadPoolExecutor(1, thread_name_prefix="tensorcanon-read") as pool:
            other = pool.submit(work, False)
            work(True)
            other.result()
        if failed:
            raise failed[0]
        return {i: (buf, is_tensor, digests[i]) for i, (buf, _, is_tensor) in slots.items()}

    def _finish_large(self, info: TensorInfo, map_location: Any, buf: Any, is_tensor: bool,
                      actual: bytes | None) -> Any:
        """The tensor :meth:`_read_large` read for ``info``: its digest checked, typed and placed."""
        if actual is not None and actual != info.digest:
            raise self.integrity_error(info, actual)
        value = buf if is_tensor else tensorbytes.finish(buf, info.dtype, info.shape, info.kind, info.name)
        return placement.as_recorded(value, info, map_location, lambda: self._where(info))

    def stored(self) -> dict[str, tensorbytes.Stored]:
        """A plain safetensors file's tensors as their bytes, by name in name order: what
        :meth:`load` gives, without torch (:class:`~tensorcanon.tensorbytes.Stored`; it plans and
        hashes as the tensor would). Read in file order and checked as :meth:`load` reads them."""
        if self.manifest is not None:
            raise UsageError("CheckedFile.stored() reads plain safetensors files; use load() for tensorcanon files")
        if self.src.random_access and self.src.pos != self.data_start:
            self.src.seek(self.data_start)
        values = {}
        for info in self._file_order():
            buf, mv = self._buffer(info.nbytes, "bytes", f"data of tensor {info.name!r}")
            tensorbytes.check_bool(buf, info.dtype, info.name)
            values[info.name] = tensorbytes.Stored(info.dtype, info.shape, mv)
        return dict(sorted(values.items()))

    def load(self, *, map_location: Any = None, verify: bool = True, share: bool = False) -> Any:
        """The saved object (a plain safetensors file: a dict of tensors by name, in name order).

        With ``share`` (a file opened with ``use_mmap=True``), CPU tensors view
        the file's private, copy-on-write map instead of holding copies; every
        byte is still hashed (in place) before any tensor is made.
        """
        values = self.read_all(map_location=map_location, verify=verify, share=share)
        if self.manifest is None:
            return {r.name: v for r, v in sorted(zip(self.rows, values, strict=True), key=lambda p: p[0].name)}
        return self._decode(values)[0]

    # ------------------------------------------------------------------ hashing every byte
    def _verify_mapped(self, rows: list[TensorInfo]) -> None:
        """Hash the bytes of ``rows`` (in file order) where they are: an in-memory or mapped file.

        When there is much to hash, two threads share the work (xxhash and hashlib
        release the GIL while they hash): this one takes tensors from the front,
        the other from the back. Hashing a mapped file is as much mapping its pages
        (the first read of each page faults) as hashing them, so when one thread
        runs out of tensors it maps the pages of the tensor the other is still
        hashing, from that tensor's end back toward where the other has got to
        (:meth:`Source.populate`): a file of one large tensor is hashed by one
        thread while the other maps its pages. Every digest is compared only
        once all are known; the first tensor in file order that differs is the
        one named.
        """
        data = self.src.data
        assert data is not None
        start = self.data_start
        big = [r for r in rows if r.end - r.begin >= _THREAD_MIN]
        if not big or (len(big) < 2 and self.src.span is None) \
                or sum(r.end - r.begin for r in big) < _THREADS_FROM:
            for info in rows:
                self._check_bytes(info, data[start + info.begin : start + info.end])
            return
        digests: dict[int, bytes] = {}
        lock = threading.Lock()
        ends = [0, len(rows)]  # rows[ends[0] : ends[1]] are not taken yet
        at: list[tuple[int, int] | None] = [None, None]  # per thread: (hashed up to, end of its tensor)

        def take(front: bool) -> TensorInfo | None:
            with lock:
                if ends[0] >= ends[1]:
                    return None
                if front:
                    ends[0] += 1
                    return rows[ends[0] - 1]
                ends[1] -= 1
                return rows[ends[1]]

        def hash_one(info: TensorInfo, me: int) -> None:
            h = self._hasher(info, True)
            lo, hi = start + info.begin, start + info.end
            for a in range(lo, hi, _MAPPED_PIECE):
                b = min(a + _MAPPED_PIECE, hi)
                at[me] = (b, hi)  # said before hashing [a, b): the other thread maps only pages past b
                h.update(data[a:b])
            at[me] = None
            digests[info.index] = h.digest()

        def map_ahead_of(other: int) -> None:
            hi = None
            while (now := at[other]) is not None:
                reached, end = now
                hi = end if hi is None or hi > end else hi
                lo = max(hi - _POPULATE, reached)
                if lo >= hi or not self.src.populate(lo, hi - lo):
                    return
                hi = lo

        def work(me: int) -> None:
            while (info := take(me == 0)) is not None:
                hash_one(info, me)
            if self.src.span is not None:
                map_ahead_of(1 - me)

        with ThreadPoolExecutor(1, thread_name_prefix="tensorcanon-hash") as pool:
            other = pool.submit(work, 1)
            work(0)
            other.result()
        for info in rows:
            if digests[info.index] != info.digest:
                raise self.integrity_error(info, digests[info.index])

    def _verify_stream(self, rows: list[TensorInfo], keep: dict[int, bytearray]) -> None:
        """Read and hash every tensor in file order, a piece at a time through one buffer; the
        bytes of the rows ``keep`` names are also copied there."""
        buf = memoryview(bytearray(min(_HASH_CHUNK, max((r.end - r.begin for r in rows), default=0))))
        for info in rows:
            h = self._hasher(info, True)
            left = info.end - info.begin
            kept = keep.get(info.index)
            while left:
                n = min(left, len(buf))
                self.src.readinto(buf[:n], f"data of tensor {info.name!r}")
                h.update(buf[:n])
                if kept is not None:
                    kept += buf[:n]
                left -= n
            self._check(info, h)

    def _os_file(self) -> int | None:
        """The descriptor of a regular file this Source reads unbuffered or buffered, else None."""
        f = self.src.f
        if f is None or type(f) not in (io.FileIO, io.BufferedReader, io.BufferedRandom) \
                or not hasattr(os, "preadv"):
            return None
        try:
            fd = f.fileno()
            return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
        except (OSError, ValueError):
            return None

    def _verify_file(self, rows: list[TensorInfo], fd: int, keep: dict[int, bytearray]) -> None:
        """Hash every tensor of a regular file on two threads, each reading its share of the
        tensors with positional reads (reading and hashing release the GIL); the first tensor
        in file order that differs is the one named. The bytes of the rows ``keep`` names are
        also copied there."""
        base = self.src.file_base + self.data_start
        total = sum(r.end - r.begin for r in rows)
        half, acc, cut = total // 2, 0, len(rows)
        for k, r in enumerate(rows):
            if acc >= half:
                cut = k
                break
            acc += r.end - r.begin
        digests: dict[int, bytes] = {}

        def work(group: list[TensorInfo]) -> None:
            buf = memoryview(bytearray(min(_HASH_CHUNK, max((r.end - r.begin for r in group), default=0))))
            for info in group:
                h = self._hasher(info, True)
                at, left = base + info.begin, info.end - info.begin
                kept = keep.get(info.index)
                while left:
                    n = os.preadv(fd, [buf[: min(left, len(buf))]], at)
                    if not n:
                        raise FormatError(f"file ends inside the data of tensor {info.name!r}: {left} bytes "
                                          "missing", offset=at - self.src.file_base)
                    h.update(buf[:n])
                    if kept is not None:
                        kept += buf[:n]
                    at += n
                    left -= n
                digests[info.index] = h.digest()

        with ThreadPoolExecutor(2, thread_name_prefix="tensorcanon-hash") as pool:
            futures = [pool.submit(work, rows[:cut]), pool.submit(work, rows[cut:])]
            for fut in futures:
                fut.result()
        for info in rows:
            if digests[info.index] != info.digest:
                raise self.integrity_error(info, digests[info.index])
        self.src.seek(self.data_start + total)  # where reading every tensor leaves the file

    def _value_checks(self) -> list[tensorkinds.Deferred]:
        """The checks on parts' values that the tree asks for (sparse indices, jagged offsets), from
        the structure, before the bytes are read; none when the structure is malformed (then
        :meth:`check_tree` raises after hashing, as it always has: a damaged tensor is named first)."""
        try:
            return list(self._structure().deferred)
        except TensorCanonError:
            return []

    def verify(self) -> str:
        """Hash every byte, check every tensor digest and the tree, and run on the verified bytes
        the checks load makes on values (docs/FORMAT.md §6.12: sparse indices, jagged offsets);
        return the file digest."""
        if self.manifest is None:
            raise FormatError(
                "this is a plain safetensors file with no tensorcanon manifest, so it records no "
                "digests to verify; convert it with tensorcanon.save(tensorcanon.load(path), out)")
        rows = self._file_order()
        checks = self._value_checks()
        keep = tensorkinds.kept_rows(checks)
        bools = [r for r in rows if r.dtype.name == "bool" and r.end > r.begin]  # (§9.3 item 2, as load)
        for r in bools:
            keep.setdefault(r.index, bytearray())
        fd = None
        if self.src.data is None and sum(r.end - r.begin for r in rows) >= _THREADS_FROM:
            fd = self._os_file()
        if self.src.data is not None:
            self._verify_mapped(rows)
        elif fd is not None:
            self._verify_file(rows, fd, keep)
        else:
            if self.src.random_access and self.src.pos != self.data_start:
                self.src.seek(self.data_start)
            self._verify_stream(rows, keep)
        for r in bools:
            held = keep[r.index] if self.src.data is None else \
                bytearray(self.src.data[self.data_start + r.begin : self.data_start + r.end])
            tensorbytes.check_bool(held, r.dtype, r.name)
        self.check_tree()  # the tree must also be well-formed and the table canonical
        if checks:
            data, start = self.src.data, self.data_start
            table = self.rows

            def data_of(i: int) -> Any:
                if data is not None:
                    return data[start + table[i].begin : start + table[i].end]
                return keep[i]

            tensorkinds.run_deferred(checks, table, data_of)
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


def _parse(prefix: bytes, raw: bytes, size: int | None,
           limits: Limits) -> tuple[container.Header, manifest.Manifest | None]:
    """The header and (for a tensorcanon file) the manifest of header bytes, every check made. A
    file that claims to be a tensorcanon file and fails a check no file tensorcanon wrote fails is
    reported damaged (:func:`_damaged`)."""
    parsed = fastparse.parse(prefix, raw, size, limits)  # a canonical file: one pass
    if parsed is not None:
        return parsed
    # every check in the order of docs/FORMAT.md §9, naming the first that fails
    try:
        header = container.parse_raw(prefix, raw, size, limits)
    except FormatError as e:
        if _CLAIM_MANIFEST in raw or _CLAIM_DIGEST in raw:  # (its header does not decode)
            _damaged(e)
        raise
    if not manifest.is_tensorcanon(header):
        return header, None
    try:
        return header, manifest.parse(header, limits)
    except FormatError as e:
        failure = e
    # Told apart outside the handler, once the failed parse's frames (and the manifest objects they
    # held) are freed: _manifest_damaged decodes the manifest again, and both at once doubled the
    # peak memory of reading a hostile manifest (tests/test_decoding_bounds.py).
    failure.__traceback__ = None
    if _manifest_damaged(header.metadata or {}, limits, failure):
        _damaged(failure)
    raise failure


# How a tensorcanon header names its manifest and file digest (FORMAT.md §2.4), as bytes: a header
# that holds either and does not decode is a tensorcanon file's, damaged.
_CLAIM_MANIFEST = f'"{manifest.KEY_MANIFEST}":"'.encode()
_CLAIM_DIGEST = f'"{manifest.KEY_DIGEST}":"'.encode()


def _manifest_damaged(meta: dict[str, str], limits: Limits, failure: FormatError | None = None) -> bool:
    """Whether a tensorcanon header whose manifest checks failed is damaged: its manifest does not
    decode or its digest does not vouch for it, or the manifest its digest vouches for is sound
    and the header around it does not match it. (A manifest its digest vouches for that fails a
    check itself is as its writer made it: malformed, not damaged.) ``failure``: the check that
    failed; one of the manifest's own (its message starts ``manifest:``) needs no second decoding
    of a manifest its digest vouches for, which would fail it again (and on msgpack 1.2.0 cost
    7.5 times the file once more)."""
    if not manifest.vouched(meta):
        return True
    if failure is not None and str(failure).startswith("manifest:"):
        return False
    try:
        manifest.read(meta, limits)
    except TensorCanonError:
        return False
    return True


def _damaged(e: FormatError) -> None:
    """Mark ``e`` (a check a tensorcanon file failed) as damage; a limit is not damage."""
    if isinstance(e, LimitError) or e.damaged:
        return
    e.damaged = True
    if e.args and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]}; the file is damaged (tensorcanon never writes a file that fails this check)",
                  *e.args[1:])


def is_damage(e: BaseException) -> bool:
    """Whether ``e`` says a file is damaged (bytes changed after it was written): an
    :class:`IntegrityError`, or a :class:`FormatError` marked ``damaged``. ``verify``, ``hash``
    and ``check`` report such a file corrupt (exit 1), not unreadable."""
    return isinstance(e, IntegrityError) or isinstance(e, FormatError) and e.damaged


@contextlib.contextmanager
def naming(name: str | None) -> Iterator[None]:
    """Errors about a file raised inside (:class:`FormatError` and its :class:`LimitError`,
    :class:`IntegrityError`) name it, ``name: message``, unless their message names it already
    (no name for bytes or a stream). ``load``, ``verify`` and ``read_metadata`` read through it,
    and so does every :class:`CheckedFile` as it checks its header."""
    try:
        yield
    except (FormatError, IntegrityError) as e:
        shown = redact(name) if name else None  # (a URL's secrets never reach a message)
        if shown and e.args and isinstance(e.args[0], str) and shown not in e.args[0]:
            e.args = (f"{shown}: {e.args[0]}", *e.args[1:])
        raise


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
