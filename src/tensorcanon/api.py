"""The public functions: save, load, dumps, loads, fingerprint, verify."""

from __future__ import annotations

import io
import os
from typing import Any, BinaryIO, Union

from . import reader, writer
from .limits import DEFAULT, Limits

PathOrFile = Union[str, "os.PathLike[str]", BinaryIO]


def save(obj: Any, f: PathOrFile, *, metadata: dict | None = None, limits: Limits = DEFAULT) -> str:
    """Write ``obj`` canonically to ``f`` and return its content digest.

    ``f`` is a path (written atomically: temp file, fsync, rename) or a binary
    file object (written at its current position). ``metadata`` is an optional
    dict of str keys to saveable non-tensor values, stored in the manifest and
    covered by the digest.

    Example::

        digest = tensorcanon.save({"model": model.state_dict()}, "ckpt.safetensors")
    """
    p = writer.plan(obj, metadata, limits)
    if isinstance(f, (str, os.PathLike)):
        return writer.write_atomic(p, f)
    return writer.write(p, f)


def dumps(obj: Any, *, metadata: dict | None = None, limits: Limits = DEFAULT) -> bytes:
    """The canonical bytes of ``obj`` (what :func:`save` would write).

    Example::

        assert tensorcanon.dumps({"b": 1, "a": t}) == tensorcanon.dumps({"a": t, "b": 1})
    """
    buf = io.BytesIO()
    writer.write(writer.plan(obj, metadata, limits), buf)
    return buf.getvalue()


def fingerprint(obj: Any, *, metadata: dict | None = None, limits: Limits = DEFAULT) -> str:
    """The digest :func:`save` would return for ``obj``, computed without writing.

    Example::

        tensorcanon.fingerprint(model.state_dict())  # 'xxh3-128:…'
    """
    return writer.fingerprint(writer.plan(obj, metadata, limits))


def load(f: PathOrFile, *, map_location: Any = None, verify: bool = True, limits: Limits = DEFAULT) -> Any:
    """Read an object saved by :func:`save` (or a plain safetensors file).

    ``map_location`` works as in ``torch.load``: None restores each tensor to
    its recorded device; a str or ``torch.device`` sends every tensor there; a
    dict remaps recorded devices (``{"cuda:1": "cuda:0"}``); a callable gets
    ``(cpu_tensor, recorded_device)`` and returns a tensor, or None for the
    default. With ``verify=True`` (the default) every tensor is re-hashed and
    checked against its digest. A plain safetensors file loads as a flat dict
    of CPU tensors (or mapped as above).

    Example::

        ckpt = tensorcanon.load("ckpt.safetensors", map_location="cpu")
    """
    return reader.open_source(f, lambda src: reader.load_from(src, map_location, verify, limits))


def loads(data: bytes | bytearray | memoryview, *, map_location: Any = None, verify: bool = True,
          limits: Limits = DEFAULT) -> Any:
    """:func:`load` from bytes. The bytes must hold exactly one file."""
    return reader.load_from(reader.Source(data=data), map_location, verify, limits)


def verify(f: PathOrFile | bytes, *, expect: str | None = None, limits: Limits = DEFAULT) -> str:
    """Re-hash every byte of a file and return its digest, or raise.

    Raises :class:`IntegrityError` naming the first tensor (by its path in the
    object) whose bytes do not match, and when ``expect`` is given and differs
    from the file's digest. Tensors are streamed, never loaded whole.

    Example::

        tensorcanon.verify("ckpt.safetensors", expect="xxh3-128:…")
    """
    from .errors import IntegrityError

    result = reader.open_source(f, lambda src: reader.verify_from(src, limits))
    if expect is not None and result != expect:
        raise IntegrityError(f"file digest is {result}, expected {expect}", expected=expect, actual=result)
    return result


def read_metadata(f: PathOrFile | bytes, *, limits: Limits = DEFAULT) -> Any:
    """The ``metadata`` dict a file was saved with (None if none), without reading tensors."""
    return reader.open_source(f, lambda src: reader.read_metadata(src, limits))
