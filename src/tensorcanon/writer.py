"""Saving: plan the file, then stream every tensor once through hash and write.

The plan (tree, names, layout) is made before any tensor byte is touched.
Digests have a fixed size, so the header's length is known from the plan:
a seekable target gets a reserved header, then one streaming pass in which
each tensor is hashed and written, then the real header in the reserved
space. A non-seekable target gets a hashing pass first, then the header and
the data (each tensor re-hashed as it is written, to catch a tensor that
changed in between). Only one tensor at a time is ever copied.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO

from . import container, digest, dtypes, manifest
from .errors import TensorCanonError, UnsupportedTypeError
from .limits import DEFAULT, Limits
from .tensorbytes import host_bytes
from .tree import Encoder, TensorSource


@dataclass
class Plan:
    root: Any
    meta: Any
    tensors: list[TensorSource]       # table order
    layout: list[container.Entry]     # data order, parallel to `ordered`
    ordered: list[TensorSource]

    def manifest_bytes(self) -> bytes:
        table = [
            manifest.table_row(s.name, s.dtype.name, s.shape, s.kind, s.requires_grad,
                               s.digest or bytes(digest.DIGEST_SIZE))
            for s in self.tensors
        ]
        return manifest.pack(self.root, self.meta, table)

    def header(self) -> tuple[bytes, bytes]:
        """(header bytes, manifest bytes) for the digests currently recorded."""
        raw = self.manifest_bytes()
        devices = [s.device for s in self.tensors]
        return container.build(self.layout, manifest.header_metadata(raw, devices)), raw

    @property
    def data_size(self) -> int:
        return self.layout[-1].end if self.layout else 0


def plan(obj: Any, metadata: Any = None, limits: Limits = DEFAULT) -> Plan:
    enc = Encoder(limits.max_depth)
    root = enc.encode(obj)
    meta = None
    if metadata is not None:
        if type(metadata) is not dict or not all(type(k) is str for k in metadata):
            raise UnsupportedTypeError("metadata must be a dict with str keys", path="metadata")
        menc = Encoder(limits.max_depth)
        meta = menc.encode(metadata)
        if menc.tensors:
            raise UnsupportedTypeError(
                f"metadata cannot hold tensors or arrays (found one at metadata{menc.tensors[0].path}); "
                "put them in the saved object instead", path="metadata",
            )
    enc.assign_names()
    ordered = sorted(enc.tensors, key=lambda s: container.data_order(s.name, s.dtype.itemsize))
    layout, position = [], 0
    for s in ordered:
        n = s.nbytes
        layout.append(container.Entry(s.name, s.dtype.st, tuple(dtypes.header_shape(s.dtype, s.shape)), position, position + n))
        position += n
    return Plan(root, meta, enc.tensors, layout, ordered)


def _hash(src: TensorSource) -> tuple[bytes, memoryview]:
    data = host_bytes(src.value, src.kind)
    h = digest.tensor_hasher(src.dtype.name, src.shape)
    h.update(data)
    return h.digest(), data


def fingerprint(p: Plan) -> str:
    """Hash every tensor (no writing) and return the file digest."""
    for src in p.ordered:
        src.digest, _ = _hash(src)
    return digest.to_text(digest.manifest_digest(p.manifest_bytes()))


def write(p: Plan, f: BinaryIO) -> str:
    """Write the planned file to ``f`` and return its digest."""
    seekable = False
    try:
        seekable = f.seekable()
    except (AttributeError, OSError):
        pass
    if seekable:
        start = f.tell()
        reserved = len(p.header()[0])
        f.write(bytes(reserved))
        for src in p.ordered:
            src.digest, data = _hash(src)
            f.write(data)
        header, raw = p.header()
        if len(header) != reserved:  # digests are fixed-size; this cannot change
            raise TensorCanonError("internal error: header size changed while saving")
        end = f.tell()
        f.seek(start)
        f.write(header)
        f.seek(end)
    else:
        fingerprint(p)
        header, raw = p.header()
        f.write(header)
        for src in p.ordered:
            expected = src.digest
            src.digest, data = _hash(src)
            if src.digest != expected:
                raise TensorCanonError(
                    f"tensor {src.name!r} changed while it was being saved; save again when no "
                    "other thread modifies it"
                )
            f.write(data)
    return digest.to_text(digest.manifest_digest(raw))


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


def write_atomic(p: Plan, path: str | os.PathLike) -> str:
    """Write to a temp file beside ``path``, fsync it, then rename it over ``path``.

    A crash at any point leaves the previous file at ``path`` untouched; at
    worst a ``.<name>.*.tensorcanon-tmp`` file remains beside it.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(p, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
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
