"""The manifest: everything in a file that is not tensor bytes.

It is one canonical msgpack map, base64-encoded into the header's
``__metadata__["tensorcanon.manifest"]``::

    {"algorithm": "xxh3-128", "meta": <tree>, "root": <tree>,
     "tensors": [<entry>, ...], "version": 1}

``"algorithm"`` is ``"xxh3-128"`` (the default) or ``"sha256"``; it fixes the
size of every tensor digest and the algorithm of the recorded file digest.

Each entry is ``{"digest", "dtype", "kind", "name", "requires_grad", "shape"}``
(keys in that order). Readers accept only the canonical encoding: the bytes are
decoded, packed again, and must come out identical.

Devices are placement, not content: they live outside the manifest, in
``__metadata__["tensorcanon.devices"]`` (present only when some tensor is not on
the CPU), so the same values on cpu and on cuda:0 have the same file digest.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from . import container, digest, dtypes
from .errors import FormatError, IntegrityError, LimitError
from .limits import Limits

VERSION = 1
KEY_MANIFEST = "tensorcanon.manifest"
KEY_DIGEST = "tensorcanon.digest"
KEY_FORMAT = "format"
KINDS = ("tensor", "parameter", "ndarray")
_TOP_KEYS = ["algorithm", "meta", "root", "tensors", "version"]
_ENTRY_KEYS = ["digest", "dtype", "kind", "name", "requires_grad", "shape"]
KEY_DEVICES = "tensorcanon.devices"
_DEFAULT_ALGORITHM = digest.DEFAULT  # (inside Manifest, the name ``digest`` is a field)


@dataclass
class TensorInfo:
    """One row of the tensor table, validated and matched to its header entry."""

    index: int
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    kind: str
    requires_grad: bool
    digest: bytes
    device: str = "cpu"
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Manifest:
    raw: bytes
    root: Any
    meta: Any
    tensors: list[TensorInfo]   # table order (indices used by the tree)
    digest: bytes
    algorithm: str = _DEFAULT_ALGORITHM

    def text(self, raw: bytes | None = None) -> str:
        """A digest of this file (the file digest if ``raw`` is None) as text."""
        return digest.to_text(self.digest if raw is None else raw, self.algorithm)


def pack(root: Any, meta: Any, table: list[dict], algorithm: str = digest.DEFAULT) -> bytes:
    """Canonical manifest bytes. ``table`` rows must already have sorted keys."""
    obj = {"algorithm": digest.check(algorithm), "meta": meta, "root": root, "tensors": table, "version": VERSION}
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # depth beyond msgpack's own limit
        raise LimitError(
            f"the object cannot be encoded as msgpack ({e}); it is nested deeper than msgpack allows",
            limit="max_depth", path="$", hint="keep limits.max_depth at or below 256",
        ) from e


def table_row(name, dtype_name, shape, kind, requires_grad, digest_raw) -> dict:
    return {
        "digest": digest_raw, "dtype": dtype_name, "kind": kind,
        "name": name, "requires_grad": requires_grad, "shape": list(shape),
    }


def devices_text(devices: list[str]) -> str:
    """``"3:cuda:0,7:cuda:1"``: table index and device of every tensor not on the CPU."""
    return ",".join(f"{i}:{d}" for i, d in enumerate(devices) if d != "cpu")


def header_metadata(manifest_raw: bytes, devices: list[str], algorithm: str = digest.DEFAULT) -> dict[str, str]:
    meta = {
        KEY_FORMAT: "pt",
        KEY_DIGEST: digest.to_text(digest.manifest_digest(manifest_raw, algorithm), algorithm),
        KEY_MANIFEST: base64.b64encode(manifest_raw).decode("ascii"),
    }
    text = devices_text(devices)
    if text:
        meta[KEY_DEVICES] = text
    return meta


def _parse_devices(text: str, infos: list["TensorInfo"]) -> None:
    """Apply ``__metadata__["tensorcanon.devices"]`` to the table, accepting only canonical text."""
    if not text:
        raise _bad(f"__metadata__[{KEY_DEVICES!r}] is empty (omit it when every tensor is on the CPU)")
    for item in text.split(","):
        index, sep, device = item.partition(":")
        if not sep or not index.isdigit() or not index.isascii() or not 0 <= int(index) < len(infos):
            raise _bad(f"__metadata__[{KEY_DEVICES!r}] has a malformed entry {item[:80]!r}")
        info = infos[int(index)]
        if len(device) > 64:
            raise _bad(f"tensor {info.name!r} has an over-long device name")
        try:
            info.device = str(torch.device(device))
        except (RuntimeError, ValueError):
            raise _bad(f"tensor {info.name!r} has invalid device {device!r}") from None
        if info.kind == "ndarray":
            raise _bad(f"tensor {info.name!r} is a numpy array but is given device {device!r}")
    if devices_text([i.device for i in infos]) != text:
        raise _bad(f"__metadata__[{KEY_DEVICES!r}] is not in canonical form (ascending indices, "
                   "canonical device names, no 'cpu' entries)")


def _bad(message: str) -> FormatError:
    return FormatError(f"manifest: {message}")


def is_tensorcanon(header: container.Header) -> bool:
    """True if the header claims to be tensorcanon (else: plain safetensors).

    Any ``tensorcanon.*`` key in ``__metadata__`` makes the claim, so damage to
    one key's name (a flipped bit in "tensorcanon.manifest") is caught by
    :func:`parse` instead of the file silently loading as plain safetensors.
    """
    return header.metadata is not None and any(k.startswith("tensorcanon.") for k in header.metadata)


def parse(header: container.Header, limits: Limits) -> Manifest:
    """Decode, validate and cross-check the manifest of a tensorcanon file.

    Checks that the manifest is canonical, that its tensor table and the
    header describe the same tensors, that the header itself is byte-for-byte
    what a writer would produce, and that the recorded file digest matches.
    """
    meta = header.metadata or {}
    if not {KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST} <= set(meta) <= {KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST, KEY_DEVICES} \
            or meta[KEY_FORMAT] != "pt":
        raise _bad(
            f"__metadata__ must hold {sorted([KEY_FORMAT, KEY_DIGEST, KEY_MANIFEST])} (and "
            f"{KEY_DEVICES!r} when a tensor is not on the CPU), with format 'pt'"
        )
    text = meta[KEY_MANIFEST]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("is not valid base64") from None
    if base64.b64encode(raw).decode("ascii") != text:  # e.g. "AS==" decodes like "AQ=="
        raise _bad("base64 is not in canonical form (non-zero padding bits)")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types for bad input
        raise _bad(f"is not valid msgpack ({type(e).__name__}: {e})") from None
    try:
        canonical = msgpack.packb(obj, use_bin_type=True) == raw
    except Exception:
        canonical = False
    if not canonical:
        raise _bad("is not in canonical form (non-shortest numbers, repeated keys or float32)")
    if type(obj) is not dict or list(obj) != _TOP_KEYS:
        raise _bad(f"must be a map with exactly the keys {_TOP_KEYS} in that order")
    if type(obj["version"]) is not int or obj["version"] != VERSION:  # 1.0 and True equal 1
        raise _bad(
            f"format version {obj['version']!r} is not supported by this tensorcanon "
            f"(it reads version {VERSION}); upgrade tensorcanon to read this file"
        )
    algorithm = obj["algorithm"]
    if type(algorithm) is not str or algorithm not in digest.ALGORITHMS:
        raise _bad(
            f"digest algorithm {algorithm!r} is not supported (this tensorcanon knows "
            f"{sorted(digest.ALGORITHMS)}); upgrade tensorcanon if the file is newer"
        )

    recorded = meta.get(KEY_DIGEST)
    if not digest.is_text(recorded):
        raise _bad(f"__metadata__[{KEY_DIGEST!r}] is missing or malformed")
    recorded_algorithm, recorded_raw = digest.parse_text(recorded)
    if recorded_algorithm != algorithm:
        raise _bad(
            f"__metadata__[{KEY_DIGEST!r}] is a {recorded_algorithm} digest but the manifest "
            f"says the file uses {algorithm}"
        )
    actual = digest.manifest_digest(raw, algorithm)
    if recorded_raw != actual:
        raise IntegrityError(
            f"the manifest does not match the file digest: recorded {recorded}, "
            f"computed {digest.to_text(actual, algorithm)}; the file is damaged",
            expected=recorded, actual=digest.to_text(actual, algorithm),
        )

    table = obj["tensors"]
    if type(table) is not list:
        raise _bad("'tensors' must be a list")
    if len(table) > limits.max_tensors:
        raise LimitError(f"manifest lists {len(table)} tensors, over max_tensors={limits.max_tensors}", limit="max_tensors")
    by_name = {e.name: e for e in header.entries}
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    for i, row in enumerate(table):
        info = _row(i, row, algorithm)
        if info.name in seen:
            raise _bad(f"tensor name {info.name!r} appears twice")
        seen.add(info.name)
        entry = by_name.get(info.name)
        if entry is None:
            raise _bad(f"tensor {info.name!r} is not in the header")
        want = dtypes.header_shape(info.dtype, info.shape)
        if entry.dtype != info.dtype.st or list(entry.shape) != want:
            raise _bad(
                f"tensor {info.name!r} is {info.dtype.name}{list(info.shape)} here but the header says "
                f"{entry.dtype}{list(entry.shape)}"
            )
        info.begin, info.end = entry.begin, entry.end
        infos.append(info)
    if KEY_DEVICES in meta:
        _parse_devices(meta[KEY_DEVICES], infos)
    if len(seen) != len(by_name):
        extra = sorted(set(by_name) - seen)[:3]
        raise _bad(f"the header holds tensors the manifest does not list: {extra}")

    expected = container.build(_canonical_entries(infos), header.metadata)
    if expected != header.raw:
        raise FormatError(
            "header is not in canonical form (tensor order, offsets, key order, spacing or "
            "__metadata__ keys differ from what tensorcanon writes)", offset=container.LENGTH_SIZE,
        )
    return Manifest(raw=raw, root=obj["root"], meta=obj["meta"], tensors=infos, digest=actual,
                    algorithm=algorithm)


def _canonical_entries(infos) -> list[container.Entry]:
    out, position = [], 0
    for info in sorted(infos, key=lambda t: container.data_order(t.name, t.dtype.itemsize)):
        out.append(container.Entry(info.name, info.dtype.st, tuple(dtypes.header_shape(info.dtype, info.shape)), position, position + info.nbytes))
        position += info.nbytes
    return out


def _row(i: int, row: Any, algorithm: str) -> TensorInfo:
    if type(row) is not dict or list(row) != _ENTRY_KEYS:
        raise _bad(f"tensor table row {i} must have exactly the keys {_ENTRY_KEYS} in that order")
    name, dt, shape = row["name"], row["dtype"], row["shape"]
    kind, rg, dg = row["kind"], row["requires_grad"], row["digest"]
    if type(name) is not str:
        raise _bad(f"tensor table row {i}: name must be a str")
    where = f"tensor {name!r}"
    dtype = dtypes.BY_NAME.get(dt) if type(dt) is str else None
    if dtype is None:
        raise _bad(f"{where} has unknown dtype {dt!r}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"{where} shape must be a list of non-negative ints")
    if kind not in KINDS:
        raise _bad(f"{where} has unknown kind {kind!r}")
    if type(rg) is not bool or (rg and kind == "ndarray"):
        raise _bad(f"{where} has an invalid requires_grad {rg!r}")
    if kind == "ndarray" and dtype.numpy is None:
        raise _bad(f"{where} is a numpy array of dtype {dtype.name}, which numpy lacks")
    want = digest.ALGORITHMS[algorithm]
    if type(dg) is not bytes or len(dg) != want:
        got = f"{len(dg)} bytes" if type(dg) is bytes else f"a {type(dg).__name__}"
        raise _bad(f"{where} digest must be {want} bytes for algorithm {algorithm!r}, not {got}")
    return TensorInfo(i, name, dtype, tuple(shape), kind, rg, dg)
