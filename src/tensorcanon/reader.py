"""Loading: validate the header and manifest, then read, verify and rebuild.

Nothing from the file is trusted until it is checked: the header's numbers
against the file size, the manifest against its canonical form, the header and
the recorded digest, with the algorithm the manifest names (xxh3-128 or
sha256; every digest in a file uses the one algorithm). Only then are tensors allocated (sizes are by then bounded
by the bytes present), read in file order, hashed, and placed on their device.
The object tree is rebuilt last, so no partial object is ever returned.
"""

from __future__ import annotations

import os
import sys
from typing import Any, BinaryIO, Callable

import torch

from . import container, digest, manifest, paths, tensorbytes
from .errors import DeviceUnavailableError, FormatError, IntegrityError, TensorCanonError, UsageError
from .limits import DEFAULT, Limits
from .tree import Decoder, find_tensor_path

_CHUNK = 16 << 20
_HASH_CHUNK = 1 << 20  # read-then-hash piece: small enough to stay in L2


class Source:
    """Exact reads from a file object or a bytes-like, with the offset kept for errors."""

    def __init__(self, f: BinaryIO | None = None, data: bytes | memoryview | None = None) -> None:
        self.f = f
        self.data = None if data is None else memoryview(data).cast("B")
        self.pos = 0
        self.size: int | None = None
        if self.data is not None:
            self.size = len(self.data)
        else:
            try:
                if f.seekable():
                    here = f.tell()
                    self.size = f.seek(0, os.SEEK_END) - here
                    f.seek(here)
            except (AttributeError, OSError):
                self.size = None

    def read(self, n: int, what: str) -> bytes:
        if self.data is not None:
            chunk = bytes(self.data[self.pos : self.pos + n])
        else:
            chunk = self.f.read(n)
            while chunk is not None and len(chunk) < n:
                more = self.f.read(n - len(chunk))
                if not more:
                    break
                chunk += more
        if chunk is None or len(chunk) != n:
            got = 0 if chunk is None else len(chunk)
            raise FormatError(f"file ends inside the {what}: needed {n} bytes, found {got}", offset=self.pos + got)
        self.pos += n
        return chunk

    def readinto(self, buf: memoryview, what: str) -> None:
        n = len(buf)
        if self.data is not None:
            if self.pos + n > len(self.data):
                raise FormatError(f"file ends inside the {what}", offset=len(self.data))
            buf[:] = self.data[self.pos : self.pos + n]
            self.pos += n
            return
        done = 0
        while done < n:
            got = self.f.readinto(buf[done:])
            if not got:
                raise FormatError(f"file ends inside the {what}: {n - done} bytes missing", offset=self.pos + done)
            done += got
        self.pos += n


def open_source(f, fn: Callable[[Source], Any]) -> Any:
    """Run ``fn`` on a Source for a path, a binary file object or bytes."""
    if isinstance(f, (bytes, bytearray, memoryview)):
        return fn(Source(data=f))
    if isinstance(f, (str, os.PathLike)):
        try:
            fh = open(f, "rb", buffering=0)
        except IsADirectoryError:
            raise FormatError(f"{os.fspath(f)!r} is a directory, not a tensorcanon file") from None
        with fh:
            return fn(Source(fh))
    if hasattr(f, "read"):
        return fn(Source(f))
    raise UsageError(f"expected a path, a binary file object or bytes, not {type(f).__name__}")


def _tensor_path(m: manifest.Manifest, info: manifest.TensorInfo) -> str:
    try:
        trail = find_tensor_path(m.root, info.index)
    except RecursionError:  # a hostile tree deeper than the stack: name the tensor instead
        trail = None
    return paths.join(trail) if trail is not None else f"tensor {info.name!r}"


def _integrity_error(m, info, actual: bytes, data_start: int) -> IntegrityError:
    where = _tensor_path(m, info)
    recorded, computed = m.text(info.digest), m.text(actual)
    return IntegrityError(
        f"tensor {where} (stored as {info.name!r}, bytes {data_start + info.begin}-"
        f"{data_start + info.end}) does not match its digest: recorded "
        f"{recorded}, computed {computed}; the file is damaged",
        path=where, expected=recorded, actual=computed,
    )


# ----------------------------------------------------------------- devices

def _check_device(device: torch.device, where: Callable[[], str]) -> None:
    kind = device.type
    if kind in ("cpu", "meta"):
        return
    if kind == "mps":
        available = torch.backends.mps.is_available()
        count = int(available)
    else:
        module = getattr(torch, kind, None)
        available = bool(module is not None and hasattr(module, "is_available") and module.is_available())
        count = module.device_count() if available and hasattr(module, "device_count") else int(available)
    if not available or (device.index or 0) >= count:
        have = f"{count} {kind} device(s)" if available else f"no {kind} support"
        path = where()
        raise DeviceUnavailableError(
            f"tensor {path} was saved on {device} but this machine has {have}; "
            f"pass map_location='cpu' (or a dict such as {{'{device}': 'cpu'}}) to load it elsewhere",
            path=path, device=str(device),
        )


def _stays_on_cpu(info: manifest.TensorInfo, map_location) -> bool:
    """True when a tensor needs no device handling at all (the common case, kept cheap)."""
    return info.kind == "ndarray" or (map_location is None and info.device == "cpu")


def _target(recorded: str, map_location) -> torch.device | None:
    """The device a tensor recorded on ``recorded`` goes to; None: ask the callable."""
    if map_location is None:
        target = recorded
    elif isinstance(map_location, dict):
        target = map_location.get(recorded, recorded)
    elif isinstance(map_location, (str, torch.device)):
        target = map_location
    elif callable(map_location):
        return None
    else:
        raise UsageError(f"map_location must be None, a str, a torch.device, a dict or a callable, not {type(map_location).__name__}")
    try:
        return torch.device(target)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"map_location gave an invalid device {target!r}: {e}") from None


def as_recorded(value: Any, info: manifest.TensorInfo, map_location, where: Callable[[], str]) -> Any:
    """A freshly read tensor or array, placed and typed as its table row says: on its device
    (or where ``map_location`` sends it), a Parameter or not, with its requires_grad."""
    if info.kind == "ndarray":
        return value
    if not _stays_on_cpu(info, map_location):
        value = _place(value, info.device, map_location, where)
    if info.kind == "parameter":
        return torch.nn.Parameter(value, requires_grad=info.requires_grad)
    if info.requires_grad:
        value.requires_grad_(True)
    return value


def _place(t: torch.Tensor, recorded: str, map_location, where: Callable[[], str]) -> torch.Tensor:
    """Move a freshly read CPU tensor where ``map_location`` says, as torch.load would."""
    device = _target(recorded, map_location)
    if device is None:
        moved = map_location(t, recorded)
        if isinstance(moved, torch.Tensor):
            return moved
        if moved is not None:
            raise UsageError(f"map_location callable returned {type(moved).__name__}, expected a tensor or None")
        device = torch.device(recorded)
    _check_device(device, where)
    return t if device.type == "cpu" else t.to(device)


# ----------------------------------------------------------------- reading

def _read_plain(src: Source, header: container.Header, map_location) -> dict:
    """A safetensors file without a manifest: a flat dict of CPU tensors by name."""
    from .dtypes import from_safetensors

    out = {}
    for e in header.entries:
        row = from_safetensors(e.dtype)
        if row is None or row.torch is None:
            raise FormatError(f"tensor {e.name!r} has dtype {e.dtype}, which torch cannot hold")
        buf, mv = _read_buffer(src, e.end - e.begin, "tensor", f"data of tensor {e.name!r}")
        t = tensorbytes.finish(buf, row, e.shape, "tensor", e.name)
        out[e.name] = _place(t, "cpu", map_location, lambda: paths.join((e.name,)))
    return {k: out[k] for k in sorted(out)}


def _read_buffer(src: Source, nbytes: int, kind: str, what: str):
    """A buffer holding the next ``nbytes`` of ``src``, allocated only once they exist.

    When the source's size is unknown (a non-seekable stream), the header's
    sizes could not be checked against the file, so a lying header could ask
    for a terabyte. Such data is read in bounded chunks first: memory grows
    only with bytes actually received, and a short stream fails before the
    full buffer is allocated.
    """
    if src.size is None and nbytes > _CHUNK:
        chunks, left = [], nbytes
        while left:
            n = min(left, _CHUNK)
            chunks.append(src.read(n, what))
            left -= n
        buf, mv = tensorbytes.empty_buffer(nbytes, kind)
        pos = 0
        chunks.reverse()
        while chunks:
            c = chunks.pop()
            mv[pos : pos + len(c)] = c
            pos += len(c)
        return buf, mv
    buf, mv = tensorbytes.empty_buffer(nbytes, kind)
    src.readinto(mv, what)
    return buf, mv


def _read_header(src: Source, limits: Limits):
    header = container.parse(src.read, src.size, limits)
    m = manifest.parse(header, limits) if manifest.is_tensorcanon(header) else None
    return header, m


def load_from(src: Source, map_location=None, verify: bool = True, limits: Limits = DEFAULT) -> Any:
    header, m = _read_header(src, limits)
    if m is None:
        return _read_plain(src, header, map_location)
    by_begin = sorted(m.tensors, key=lambda i: (i.begin, i.end))
    for info in by_begin:  # fail on a missing device before reading any data
        if _stays_on_cpu(info, map_location):
            continue
        device = _target(info.device, map_location)
        if device is not None:
            _check_device(device, lambda: _tensor_path(m, info))
    values: list[Any] = [None] * len(m.tensors)
    for info in by_begin:
        what = f"data of tensor {info.name!r}"
        ready = None
        h = digest.tensor_hasher(info.dtype.name, info.shape, m.algorithm) if verify else None
        device = None if _stays_on_cpu(info, map_location) else _target(info.device, map_location)
        if device is not None and device.type == "cuda" and src.size is not None:
            # Straight to the GPU through pinned buffers (sizes already checked against the file).
            from . import cuda
            buf = cuda.read_to_device(lambda v: src.readinto(v, what), info.nbytes, device,
                                      h.update if h is not None else None)
        elif h is not None and src.size is not None and info.nbytes > _HASH_CHUNK:
            # Hash each piece right after reading it, while it is still in the CPU cache.
            buf, mv = tensorbytes.empty_buffer(info.nbytes, info.kind)
            for lo in range(0, info.nbytes, _HASH_CHUNK):
                piece = mv[lo : lo + _HASH_CHUNK]
                src.readinto(piece, what)
                h.update(piece)
        else:
            ready = tensorbytes.empty_tensor(info.dtype, info.shape, info.kind) if src.size is not None else None
            if ready is not None:  # the common small-tensor case: read straight into the result
                buf, mv = ready
                src.readinto(mv, what)
            else:
                buf, mv = _read_buffer(src, info.nbytes, info.kind, what)
            if h is not None:
                h.update(mv)
        if h is not None:
            actual = h.digest()
            if actual != info.digest:
                raise _integrity_error(m, info, actual, header.data_start)
        value = buf if ready is not None else tensorbytes.finish(buf, info.dtype, info.shape, info.kind, info.name)
        values[info.index] = as_recorded(value, info, map_location, lambda: _tensor_path(m, info))
    return decode_tree(m, limits, values)


def decode_tree(m: manifest.Manifest, limits: Limits, values: list | None = None,
                uses: list | None = None) -> Any:
    """Check the whole tree (root and user metadata) and the tensor table; return the root.

    With ``values`` (the loaded tensors, in table order) the root is built; without,
    only its structure is checked (registered types are not rebuilt). ``uses``, if
    given, receives ``(path, table index)`` for every place a tensor occurs.
    """
    build = values is not None
    decoder = Decoder(values if build else [None] * len(m.tensors), limits.max_depth, build_objects=build)
    decoder.uses = uses
    try:
        root = decoder.decode(m.root)
    except RecursionError:
        raise FormatError(
            "manifest: the object tree is nested deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}) allows to decode, although within max_depth="
            f"{limits.max_depth}; files saved with the default limits never are"
        ) from None
    decoder.check_table([info.name for info in m.tensors])
    if m.meta is not None:
        Decoder([], limits.max_depth, build_objects=False).decode_metadata(m.meta)
    return root


def verify_from(src: Source, limits: Limits = DEFAULT) -> str:
    header, m = _read_header(src, limits)
    if m is None:
        raise FormatError(
            "this is a plain safetensors file with no tensorcanon manifest, so it records no "
            "digests to verify; convert it with tensorcanon.save(tensorcanon.load(path), out)"
        )
    buf = memoryview(bytearray(min(_CHUNK, max((i.nbytes for i in m.tensors), default=0))))
    for info in sorted(m.tensors, key=lambda i: (i.begin, i.end)):
        h = digest.tensor_hasher(info.dtype.name, info.shape, m.algorithm)
        left = info.nbytes
        while left:
            n = min(left, len(buf))
            src.readinto(buf[:n], f"data of tensor {info.name!r}")
            h.update(buf[:n])
            left -= n
        actual = h.digest()
        if actual != info.digest:
            raise _integrity_error(m, info, actual, header.data_start)
    decode_tree(m, limits)  # the tree must also be well-formed and the table canonical
    return m.text()


def read_digest(src: Source, limits: Limits = DEFAULT) -> str:
    """The recorded file digest, checked against the manifest but not the data."""
    header, m = _read_header(src, limits)
    if m is None:
        raise FormatError("this is a plain safetensors file with no tensorcanon manifest or digest")
    return m.text()


def read_metadata(src: Source, limits: Limits = DEFAULT) -> Any:
    header, m = _read_header(src, limits)
    if m is None:
        return None
    return Decoder([], limits.max_depth).decode_metadata(m.meta) if m.meta is not None else None


__all__ = ["Source", "open_source", "load_from", "verify_from", "read_digest", "read_metadata", "TensorCanonError"]
