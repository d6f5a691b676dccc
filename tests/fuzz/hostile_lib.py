"""Shared machinery for the hostile-input tests: sample files, mutators, the checker.

``check(data)`` runs every read path (load, verify, read_metadata, from bytes,
from a non-seekable stream, and from a file: memory-mapped, ``load(mmap=True)``,
and lazily, ``tensorcanon.open``) on one candidate file under a deadline and
asserts the loader's contract: only tensorcanon exceptions, no hang, and when a
file is accepted it is complete and canonical (saving the loaded object gives
back the same bytes), so no partial or altered object can come out.
"""

from __future__ import annotations

import atexit
import base64
import io
import itertools
import json
import os
import shutil
import signal
import struct
import tempfile
from contextlib import contextmanager

import msgpack
import numpy as np
import torch

import tensorcanon
from tensorcanon.format import digest
from tensorcanon.format.errors import TensorCanonError

DEADLINE_S = 120  # a hang guard, not a timing: generous for a loaded machine (each check takes well under
# a second alone); what it catches, a read that never ends or is quadratic, takes far longer


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: float = DEADLINE_S):
    def fire(signum, frame):
        raise Hang(f"a read did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Stream(io.RawIOBase):
    """A non-seekable binary stream (like a pipe or socket) over some bytes."""

    def __init__(self, data: bytes, step: int = 1 << 20) -> None:
        self._data = memoryview(data)
        self._pos = 0
        self._step = step

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b) -> int:
        n = min(len(b), self._step, len(self._data) - self._pos)
        b[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def sample_objects() -> list:
    """Small objects covering every node kind the format has."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    return [
        {"w": w, "b": torch.arange(5, dtype=torch.int64), "flag": torch.tensor([True, False])},
        {
            "model": {"fc.weight": torch.nn.Parameter(torch.ones(2, 2)),
                      "fc.bias": torch.zeros(2, dtype=torch.float16)},
            "step": 7, "lr": 0.5, "name": "run", "tags": {"a", "b"}, "t": (1, 2.5, None, b"x"),
            "big": 2**70, "c": 1 + 2j, "np": np.arange(3, dtype=np.int32), "shape": torch.Size([2, 3]),
            "dt": torch.float32, "dev": torch.device("cpu"), "view": w[1:],
        },
        [torch.tensor(1.5, dtype=torch.bfloat16), [], {}, torch.empty(0, 3)],
    ]


def sample_files() -> list[bytes]:
    files = [tensorcanon.dumps(o) for o in sample_objects()]
    files.append(tensorcanon.dumps({"x": torch.ones(2)}, metadata={"epoch": 3, "note": "hi"}))
    return files


# ----------------------------------------------------------------- structure

def split(data: bytes):
    """(header JSON object, data section) of a well-formed file."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def boundaries(data: bytes) -> list[int]:
    """Every structural boundary: length prefix, header, padding, each tensor's bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n]
    out = {0, 1, 4, 7, 8, 9, 8 + len(text.rstrip(b" ")), 8 + n - 1, 8 + n, len(data) - 1, len(data)}
    header, _ = split(data)
    for k, v in header.items():
        if k != "__metadata__":
            b, e = v["data_offsets"]
            out.update({8 + n + b, 8 + n + e, 8 + n + b + 1, 8 + n + e - 1})
    return sorted(p for p in out if 0 <= p <= len(data))


def with_header(obj: dict, body: bytes, canonical: bool = True) -> bytes:
    """A file with ``obj`` as its header JSON (padded, correct length prefix) and ``body``."""
    if canonical:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    else:
        text = json.dumps(obj).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def with_header_text(text: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text + body


def manifest_of(data: bytes):
    header, body = split(data)
    raw = base64.b64decode(header["__metadata__"]["tensorcanon.manifest"])
    return msgpack.unpackb(raw, raw=False, strict_map_key=False), header, body


def rebuild(data: bytes, m_raw: bytes, header: dict | None = None, body: bytes | None = None) -> bytes:
    """Replace a file's manifest bytes, keeping the digest and header consistent with them.

    The hostile manifest then passes the file-digest check, so validation goes
    all the way into the manifest and the tree.
    """
    h0, b0 = split(data)
    header = h0 if header is None else header
    body = b0 if body is None else body
    meta = dict(header["__metadata__"])
    meta["tensorcanon.manifest"] = base64.b64encode(m_raw).decode()
    meta["tensorcanon.digest"] = digest.to_text(digest.manifest_digest(m_raw))
    header = dict(header)
    header["__metadata__"] = meta
    return with_header(header, body)


def repack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def with_manifest(data: bytes, edit) -> bytes:
    """``data`` with its decoded manifest changed in place by ``edit(manifest)``, re-encoded, and
    the file digest recomputed (:func:`rebuild`): only the edit is wrong."""
    m, header, body = manifest_of(data)
    edit(m)
    return rebuild(data, repack(m), header, body)


def rerooted(data: bytes, root) -> bytes:
    """``data`` with its manifest's tree replaced by ``root``, a decoded node (:func:`with_manifest`;
    :func:`with_root` builds a file around raw msgpack bytes instead)."""
    return with_manifest(data, lambda m: m.__setitem__("root", root))


def renamed(data: bytes, old: str, new: str) -> bytes:
    """``data`` with tensor ``old`` named ``new`` in the manifest's table and in the header (the
    file stays self-consistent safetensors; the tree still gives the old name)."""
    m, header, body = manifest_of(data)
    for row in m["tensors"]:
        if row["name"] == old:
            row["name"] = new
    header = dict(header)
    header[new] = header.pop(old)
    return rebuild(data, repack(m), header=header, body=body)


# ----------------------------------------------------------------- the contract

def _parts(t: torch.Tensor) -> list:
    """A sparse or nested tensor's components, compared by ``same`` (docs/FORMAT.md §6.12)."""
    t = t.detach()
    if t.is_meta:
        return []
    if t.is_nested:
        return [(p.dtype, p.shape, bytes(p.contiguous().reshape(-1).view(torch.uint8).numpy())) for p in t.unbind()]
    if t.layout is torch.sparse_coo:
        t = t.coalesce()
        parts = [t._indices(), t._values()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    else:
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    return [(p.dtype, p.shape, bytes(p.contiguous().reshape(-1).view(torch.uint8).numpy())) for p in parts]


def same(a, b) -> bool:
    """Deep equality that compares tensors and arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) and not a.is_nested \
            and callable(getattr(type(a), "__tensor_flatten__", None)):  # a registered subclass (§6.12.5)
        (names_a, ctx_a), (names_b, ctx_b) = a.__tensor_flatten__(), b.__tensor_flatten__()
        return (list(names_a) == list(names_b) and same(ctx_a, ctx_b) and a.shape == b.shape
                and a.stride() == b.stride() and a.requires_grad == b.requires_grad
                and all(same(getattr(a, n), getattr(b, n)) for n in names_a))
    if isinstance(a, torch.Tensor) and (a.layout is not torch.strided or a.is_nested or a.is_meta):
        return (a.layout == b.layout and a.is_nested == b.is_nested and a.is_meta == b.is_meta
                and a.dtype == b.dtype and (a.is_nested or a.shape == b.shape) and _parts(a) == _parts(b))
    if isinstance(a, torch.Tensor):
        def raw(t: torch.Tensor) -> bytes:
            same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.dtype.itemsize)
            t = t.detach() if same is None else t.detach().view(same)  # (sub-byte dtypes have no copy kernel)
            return bytes(t.reshape(-1).view(torch.uint8).numpy())

        return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def _roundtrips(value, data: bytes, strict: bool) -> None:
    again = tensorcanon.dumps(value, metadata=tensorcanon.read_metadata(data))
    if strict and manifest_of(data)[0]["version"] != tensorcanon.FORMAT_VERSION:
        # An older version's file is re-saved in the current version: same content, and
        # the new file is itself a fixed point.
        assert same(tensorcanon.loads(again), value)
        assert tensorcanon.dumps(tensorcanon.loads(again), metadata=tensorcanon.read_metadata(again)) == again
    elif strict:
        assert again == data, "a file was accepted but saving what it loaded gives different bytes"
    else:  # the value must at least be complete and self-consistent
        assert same(tensorcanon.loads(again), value)


ENVIRONMENT_REFUSALS = ("UnsupportedTypeError", "DeviceUnavailableError")


def check(data: bytes, *, stream: bool = True, strict: bool = True, mapped: bool = True) -> str:
    """Run every read path on ``data``; return "ok" or the error class name seen by load.

    A non-seekable stream cannot know where the file ends, so it may stop at the
    end of a valid prefix where the bytes path (which knows the size) refuses
    trailing bytes; then that prefix must itself load.
    """
    outcome = None
    with deadline():
        for how in ("bytes", "stream") if stream else ("bytes",):
            src = Stream(data, step=257)
            try:
                value = tensorcanon.load(src) if how == "stream" else tensorcanon.loads(data)
            except TensorCanonError as e:
                seen = type(e).__name__
            except Exception as e:
                raise AssertionError(f"load via {how} raised a non-tensorcanon {type(e).__name__}: {e}") from e
            else:
                seen = "ok"
                body = data if how == "bytes" else data[: src._pos]
                if _is_tensorcanon(body):
                    _roundtrips(value, body, strict)
                else:
                    assert isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values())
            if outcome is None:
                outcome = seen
            elif outcome == "ok":
                assert seen == "ok", f"bytes load succeeded but the stream load raised {seen}"
    # verify and read_metadata must also raise nothing but tensorcanon errors
        for fn in (tensorcanon.verify, tensorcanon.read_metadata):
            try:
                fn(data)
            except TensorCanonError:
                pass
            except Exception as e:
                raise AssertionError(f"{fn.__name__} raised a non-tensorcanon {type(e).__name__}: {e}") from e
            else:
                # a file that verifies loads (issue 29); only this process may lack what a valid value
                # needs (a registered type, a device, a dtype)
                assert fn is not tensorcanon.verify or outcome in ("ok", *ENVIRONMENT_REFUSALS), (
                    f"verify passed, then load raised {outcome}")
        if mapped:
            check_mapped(data, outcome)
    return outcome


# ----------------------------------------------------------------- the paths that read a file

_DIR = tempfile.mkdtemp(prefix="tc-hostile-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
atexit.register(shutil.rmtree, _DIR, True)
_names = itertools.count()


@contextmanager
def as_file(data: bytes):
    """``data`` in a file of its own (a fresh name each time: a mapped earlier file stays intact)."""
    path = os.path.join(_DIR, f"f{next(_names)}.safetensors")
    with open(path, "wb") as fh:
        fh.write(data)
    try:
        yield path
    finally:
        os.unlink(path)


def header_names(data: bytes) -> list[str]:
    """Tensor names a header seems to hold (best effort, for trying lookups on hostile files)."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        return sorted(k for k in header if isinstance(k, str) and k != "__metadata__")[:50]
    except Exception:  # noqa: BLE001 - a best-effort peek at a hostile header
        return []


def lazy_read_all(path: str, names: list[str]) -> dict:
    """Everything ``tensorcanon.open`` gives: lookups by name first (each proven on its own),
    then every path, which checks the whole file. ``{key: value}``."""
    out = {}
    with tensorcanon.open(path) as f:
        for name in names:
            try:
                out[name] = f[name]
            except KeyError:
                pass
        for key in f.keys():
            out[key] = f[key]
    return out


def check_mapped(data: bytes, outcome: str) -> None:
    """load(mmap=True) decides exactly as load from bytes; tensorcanon.open refuses what load
    refuses and, on a file load accepts, gives what the whole-file path gives."""
    with as_file(data) as path:
        value = None
        try:
            value = tensorcanon.load(path, mmap=True)
            seen = "ok"
        except TensorCanonError as e:
            seen = type(e).__name__
        except Exception as e:
            raise AssertionError(f"load(mmap=True) raised a non-tensorcanon {type(e).__name__}: {e}") from e
        assert seen == outcome, f"load from bytes: {outcome}, load(mmap=True): {seen}"
        if seen == "ok":
            assert same(value, tensorcanon.loads(data)), "load(mmap=True) gave another object"
        del value
        try:
            lazy = lazy_read_all(path, header_names(data))
            seen = "ok"
        except TensorCanonError as e:
            seen = type(e).__name__
        except KeyError:
            raise
        except Exception as e:
            raise AssertionError(f"tensorcanon.open raised a non-tensorcanon {type(e).__name__}: {e}") from e
        assert (seen == "ok") == (outcome == "ok"), f"load: {outcome}, tensorcanon.open: {seen}"
        if seen == "ok":
            with tensorcanon.open(path) as full:
                full.check()  # every read below takes the whole-file path
                for key, v in lazy.items():
                    assert same(v, full[key]), f"tensorcanon.open gave another value at {key}"


def _is_tensorcanon(data: bytes) -> bool:
    try:
        header, _ = split(data)
        return any(k.startswith("tensorcanon.") for k in header.get("__metadata__", {}))
    except Exception:  # noqa: BLE001 - a best-effort peek at a hostile header
        return False


# ----------------------------------------------------------------- decoding bounds (issue 19)
# Files whose keys share one Python hash, maps where none may be, and shapes too large for any
# tensor: tests/test_decoding_bounds.py, tests/attacks/generate.py and the fuzzers build them here.

P = 2**61 - 1  # Python hashes an int n to n % P (keeping its sign): every multiple of P hashes to 0


def with_root(root: bytes) -> bytes:
    """A file without tensors whose manifest has ``root`` (msgpack bytes) as its tree, its digest matching."""
    p = msgpack.Packer(use_bin_type=True)
    raw = b"".join([p.pack_map_header(5), p.pack("algorithm"), p.pack("xxh3-128"), p.pack("meta"), p.pack(None),
                    p.pack("root"), root, p.pack("tensors"), p.pack([]), p.pack("version"),
                    p.pack(tensorcanon.FORMAT_VERSION)])
    return rebuild(tensorcanon.dumps({"x": 0}), raw)


def colliding_keys(n: int, tag: str = "dict") -> bytes:
    """A ``dict`` (or ``odict``, ``set``, ``frozenset``, or ``tuple_keys``: a dict of 1-tuples) of
    ``n`` big-int keys that all hash to 0, in canonical order: 1.5 MB for 100,000 keys."""
    from tensorcanon.format.tree import bigint_bytes

    keys: list = [msgpack.ExtType(1, bigint_bytes(k * P)) for k in range(9, 9 + n)]  # > 2**64: ext type 1
    if tag == "tuple_keys":
        keys = [["tuple", k] for k in keys]
    if tag in ("set", "frozenset"):
        node: list = [tag, *keys]
    else:
        node = ["odict", None] if tag == "odict" else ["dict"]
        for k in keys:
            node += [k, None]
    return with_root(msgpack.packb(node, use_bin_type=True))


def empty_maps(size: int) -> bytes:
    """A tree that is an array of ``size`` empty maps (one byte each), where no map may be."""
    return with_root(msgpack.Packer().pack_array_header(size) + b"\x80" * size)


_M64 = (1 << 64) - 1
_XXP1, _XXP2, _XXP5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _rotl31(x: int) -> int:
    return ((x << 31) | (x >> 33)) & _M64


def tuple_state(items: tuple[int, ...]) -> int:
    """CPython's (64-bit, 3.8+) tuple hash state after the hashes ``items`` (before the length is mixed in)."""
    acc = _XXP5
    for lane in items:
        acc = _rotl31((acc + lane * _XXP2) & _M64) * _XXP1 & _M64
    return acc


_INV1, _INV2 = pow(_XXP1, -1, 1 << 64), pow(_XXP2, -1, 1 << 64)


def _undo(acc: int, lane: int) -> int:
    """The tuple hash state before ``lane`` was mixed into the state ``acc``."""
    x = acc * _INV1 & _M64
    return (((x >> 31) | (x << 33)) - lane * _XXP2) & _M64


def tuple_hash_inverse(target: int, tail: tuple[int, ...]) -> int:
    """The hash a tuple's first item must have for ``(first, *tail)`` to reach the state ``target``."""
    acc = target
    for lane in reversed(tail):
        acc = _undo(acc, lane)
    return ((_undo(acc, 0) - _XXP5) * _INV2) & _M64


def colliding_shape_list(n: int) -> list[tuple[int, ...]]:
    """``n`` distinct shapes ``(x, b1, ..., bk, 0)`` (each ``b`` 0 or 1, ``x < 2**61 - 1``; k = 17
    for 10,000 shapes) that share one Python hash. Each has no elements, and its non-zero dimensions
    multiply to ``x``, so torch makes them and the format allows them for any dtype of up to 4 bytes
    (docs/FORMAT.md §5.3). About one ``x`` in 8 is below 2**61 - 1."""
    bits = (12 * n).bit_length()
    first = (5,) + (0,) * bits + (0,)
    target = tuple_state(first)
    # the states before the trailing 0, then before each bit from the last: one undo per tree node
    level = [((0,), _undo(target, 0))]
    for _ in range(bits):
        level = [((b, *tail), _undo(acc, b)) for tail, acc in level for b in (0, 1)]
    shapes = [first]
    for tail, acc in level:
        x = ((_undo(acc, 0) - _XXP5) * _INV2) & _M64
        if x < P and tail != first[1:]:  # an int below P hashes to itself
            shapes.append((x, *tail))
            if len(shapes) == n:
                return shapes
    raise AssertionError("no more patterns (about one x in 8 is below P)")


def colliding_shapes(n: int, damaged: bool = False) -> bytes:
    """A valid file of ``n`` empty float32 tensors (``t0``, ``t1``...) whose shapes all share one
    Python hash (:func:`colliding_shape_list`), written by tensorcanon itself; 2.8 MB for 10,000.
    ``damaged``: the digest of the tensor stored last (every other one is hashed before it) is wrong."""
    shapes = colliding_shape_list(n)
    data = tensorcanon.dumps({f"t{i}": torch.empty(s) for i, s in enumerate(shapes)})
    if not damaged:
        return data
    m, header, body = manifest_of(data)
    last = max(m["tensors"], key=lambda r: r["name"])  # all float32: stored by name
    last["digest"] = bytes(b ^ 1 for b in last["digest"])
    return rebuild(data, repack(m), header, body)


def with_shape(shape: list[int], dtype: torch.dtype = torch.float32) -> bytes:
    """A tensorcanon file of one tensor ``t`` of ``shape`` (and ``dtype``), its header entry, table
    row, tensor digest and file digest all consistent: made for shapes no writer writes."""
    data = tensorcanon.dumps({"t": torch.empty(0, dtype=dtype)})
    m, header, body = manifest_of(data)
    row = m["tensors"][0]
    row["shape"] = list(shape)
    row["digest"] = digest.Hashers(m["algorithm"])(row["dtype"], tuple(shape)).digest()
    extra = header["t"]["shape"][1:]  # a dtype stored as U8 has the element size as an extra dimension
    header["t"]["shape"] = list(shape) + extra
    return rebuild(data, repack(m), header, body)
