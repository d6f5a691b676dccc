"""The public functions: save, load, dumps, loads, fingerprint, verify."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from typing import Any, BinaryIO, Union

from .format import (
    digest as _digest,
    stdkinds as _stdkinds,  # noqa: F401 - registers the tags of Counter, defaultdict, deque
)
from .format.errors import IntegrityError, UsageError
from .format.limits import DEFAULT, Limits
from .io import reader, storage, writer

PathOrFile = Union[str, "os.PathLike[str]", BinaryIO]
StorageOptions = Mapping[str, Any] | None  # credentials, endpoint_url...: passed to fsspec as they are


def save(obj: Any, f: PathOrFile, *, metadata: dict | None = None, limits: Limits = DEFAULT,
         algorithm: str = _digest.DEFAULT, storage_options: StorageOptions = None) -> str:
    """Write ``obj`` canonically to ``f`` and return its content digest.

    ``f`` is a path (written atomically: temp file, fsync, rename), a binary
    file object (written at its current position) or a URL of object storage
    (``s3://bucket/key``, any fsspec protocol; ``storage_options`` go to fsspec:
    credentials, ``endpoint_url``...). An object is written atomically too: it
    appears complete (one PUT, or one completed multipart upload sent in parallel
    parts) or not at all, and the same content gives the same bytes as a local
    save (docs/STORAGE.md). ``metadata`` is an optional
    dict of str keys to saveable non-tensor values, stored in the manifest and
    covered by the digest. ``algorithm`` is the digest algorithm recorded in the
    file: ``"xxh3-128"`` (default; fast, detects accidental damage) or
    ``"sha256"`` (cryptographic; for tamper-evidence when the digest is checked
    against one obtained out of band, see docs/SECURITY.md). Readers take the
    algorithm from the file. Inside ``torch.serialization.skip_data()`` it raises
    :class:`UsageError` before writing anything, as :func:`dumps` does: a tensorcanon file always
    holds every tensor's bytes (save meta tensors for a skeleton; docs/LIMITS.md).

    Example::

        digest = tensorcanon.save({"model": model.state_dict()}, "ckpt.safetensors")
        digest = tensorcanon.save(state, "ckpt.safetensors", algorithm="sha256")  # 'sha256:…'
        digest = tensorcanon.save(state, "s3://bucket/run1/step100.safetensors")
    """
    f = storage.resolve(f, storage_options)
    if not isinstance(f, storage.Location):
        writer.check_target(f, "tensorcanon.save")
    p = writer.plan(obj, metadata, limits, algorithm)
    writer.refuse_skip_data(p, "tensorcanon.save")
    if isinstance(f, storage.Location):
        from .io import remote

        return remote.save(p, f)
    if isinstance(f, (str, os.PathLike)):
        return writer.write_atomic(p, f)
    return writer.write(p, f)


def dumps(obj: Any, *, metadata: dict | None = None, limits: Limits = DEFAULT,
          algorithm: str = _digest.DEFAULT) -> bytes:
    """The canonical bytes of ``obj`` (what :func:`save` would write with the same ``algorithm``).

    Example::

        assert tensorcanon.dumps({"b": 1, "a": t}) == tensorcanon.dumps({"a": t, "b": 1})
    """
    p = writer.plan(obj, metadata, limits, algorithm)
    writer.refuse_skip_data(p, "tensorcanon.dumps")
    buf = io.BytesIO()
    writer.write(p, buf)
    return buf.getvalue()


def fingerprint(obj: Any, *, metadata: dict | None = None, limits: Limits = DEFAULT,
                algorithm: str = _digest.DEFAULT) -> str:
    """The digest :func:`save` would return for ``obj`` (with the same ``algorithm``), computed without writing.

    Example::

        tensorcanon.fingerprint(model.state_dict())  # 'xxh3-128:…'
        tensorcanon.fingerprint(model.state_dict(), algorithm="sha256")  # 'sha256:…'
    """
    return writer.fingerprint(writer.plan(obj, metadata, limits, algorithm))


def load(f: PathOrFile, *, map_location: Any = None, verify: bool = True, limits: Limits = DEFAULT,
         weights_only: bool | None = None, mmap: bool = False, storage_options: StorageOptions = None) -> Any:
    """Read an object saved by :func:`save` (or a plain safetensors file).

    ``map_location`` works as in ``torch.load``: None restores each tensor to
    its recorded device; a str or ``torch.device`` sends every tensor there; a
    dict remaps recorded devices (``{"cuda:1": "cuda:0"}``); a callable gets
    ``(cpu_tensor, recorded_device)`` and returns a tensor, or None for the
    default. With ``verify=True`` (the default) every tensor is re-hashed and
    checked against its digest, with the algorithm the file records. A plain
    safetensors file loads as a flat dict of CPU tensors (or mapped as above).
    A URL (``s3://bucket/key``...) is read with parallel ranged reads, with the
    ``storage_options`` given (see :func:`save`).

    ``mmap=True`` (a path only), as in ``torch.load(mmap=True)``: CPU tensors
    are views of a private, copy-on-write memory map of the file instead of
    copies, so loading allocates no memory for them and the page cache holds
    the data once. Every byte is still hashed, in place in the map, before any
    tensor is returned (use :func:`tensorcanon.open` to verify tensor by tensor
    on first access instead). Writing to such a tensor copies the page it
    touches; the file never changes. Tensors stay valid after the call returns,
    however long they live: the map is released with the last of them. Tensors
    sent to another device are copied there as usual. What the map cannot
    protect against: another process that rewrites the file *in place* (not
    tensorcanon's atomic save, which replaces it by a rename, leaving this map
    on the old file) changes the values of pages this process has not written
    to, after they were verified; one that truncates it makes touching the lost
    pages kill the process with SIGBUS, as with any memory-mapped file
    (``torch.load(mmap=True)`` and safetensors alike). The default stays
    ``mmap=False``: an eager load holds its own copy, which no later change to
    the file can alter (benchmarks/RESULTS.md compares the two).

    ``weights_only`` is accepted so that ``torch.load(path, weights_only=True)``
    calls convert by changing the function name: this loader never unpickles, so
    every load is at least as safe as ``weights_only=True``. ``False`` grants
    nothing more (a warning says so): types of your own load when registered
    with :func:`tensorcanon.register`.

    Example::

        ckpt = tensorcanon.load("ckpt.safetensors", map_location="cpu")
        ckpt = tensorcanon.load("ckpt.safetensors", mmap=True)  # tensors view the file's pages
    """
    _check_weights_only(weights_only)
    if mmap is not False and mmap is not True:
        raise UsageError(f"mmap must be True or False, not {mmap!r}")
    f = storage.resolve(f, storage_options)
    if mmap and isinstance(f, storage.Location):
        from .io import remote

        raise remote.refuse_mmap(f)
    if mmap and not isinstance(f, (str, os.PathLike)):
        raise UsageError(f"mmap=True needs a path to map, not {type(f).__name__}; pass the file's path, "
                         "or mmap=False to read from a file object")
    with reader.open_file(f, limits, use_mmap=mmap) as cf, reader.naming(cf.name):  # errors name the file
        return cf.load(map_location=map_location, verify=verify, share=mmap)


def _check_weights_only(weights_only: Any) -> None:
    if weights_only is None or weights_only is True:
        return
    if weights_only is False:
        warnings.warn(
            "load(weights_only=False) changes nothing: tensorcanon never unpickles, so it cannot "
            "load arbitrary objects; types of your own load when registered with "
            "tensorcanon.register(cls) in the loading process", UserWarning, stacklevel=3)
        return
    raise UsageError(f"weights_only must be True, False or None, not {weights_only!r}")


def loads(data: bytes | bytearray | memoryview, *, map_location: Any = None, verify: bool = True,
          limits: Limits = DEFAULT, weights_only: bool | None = None) -> Any:
    """:func:`load` from bytes. The bytes must hold exactly one file."""
    _check_weights_only(weights_only)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UsageError(f"loads() takes bytes, not {type(data).__name__}; use load() for paths and files")
    return reader.open_file(data, limits).load(map_location=map_location, verify=verify)


def verify(f: PathOrFile | bytes, *, expect: str | None = None, limits: Limits = DEFAULT,
           storage_options: StorageOptions = None) -> str:
    """Re-hash every byte of a file and return its digest, or raise.

    The file's own algorithm (``xxh3-128`` or ``sha256``, recorded in its
    manifest) is used. Raises :class:`IntegrityError` naming the first tensor
    (by its path in the object) whose bytes do not match, and when ``expect``
    is given and differs from the file's digest; ``expect`` must then use the
    file's algorithm (a digest of the other algorithm is an ``IntegrityError``
    saying so). A malformed ``expect`` (an argument mistake, not a damaged file)
    raises :class:`UsageError` before the file is read. Tensors are streamed, never loaded whole; an object in a store
    (a URL, with ``storage_options``) is streamed by ranged reads, with no local copy.

    A sharded checkpoint directory (tensorcanon.dcp) is verified whole: its
    index, every rank file and every chunk; the result is its logical digest.

    Example::

        tensorcanon.verify("ckpt.safetensors", expect="sha256:…")  # obtained out of band
    """
    if expect is not None and not _digest.is_text(expect):
        raise UsageError(f"expect={_digest.text_error(expect)}")
    f = storage.resolve(f, storage_options)
    if isinstance(f, (str, os.PathLike)) and os.path.isdir(f):
        from .sharded import verify as verify_checkpoint  # a sharded checkpoint (tensorcanon.dcp)

        return verify_checkpoint(f, expect=expect, limits=limits)
    if isinstance(f, storage.Location):  # the one decision; a URL naming an object and a checkpoint is refused
        if storage.names_checkpoint(f):
            from .sharded import verify as verify_checkpoint

            return verify_checkpoint(f.url, expect=expect, limits=limits, storage_options=f.options)
        f = f.but(is_object=True)
    with reader.open_file(f, limits) as cf, reader.naming(cf.name):
        result = cf.verify()
    if expect is not None and result != expect:
        have, want = _digest.algorithm_of(result), _digest.algorithm_of(expect)
        if have != want:
            raise IntegrityError(
                f"the file uses {have} digests but expect is a {want} digest ({expect}); its "
                f"{have} digest is {result}. Compare with a {have} digest of this file, or re-save "
                f"it with algorithm={want!r} to record {want} digests",
                expected=expect, actual=result,
            )
        raise IntegrityError(f"file digest is {result}, expected {expect}", expected=expect, actual=result)
    return result


def read_metadata(f: PathOrFile | bytes, *, limits: Limits = DEFAULT, storage_options: StorageOptions = None) -> Any:
    """The ``metadata`` dict a file was saved with (None if none), without reading tensors
    (of an object in a store: its header only). For a plain safetensors file, its
    ``__metadata__`` (``str -> str``, as ``safetensors.safe_open(...).metadata()`` gives it), or None."""
    f = storage.resolve(f, storage_options)
    if isinstance(f, storage.Location):
        f = f.but(sequential=False)
    with reader.open_file(f, limits) as cf, reader.naming(cf.name):
        if not cf.is_tensorcanon:
            return None if cf.header.metadata is None else dict(cf.header.metadata)
        return cf.metadata()
