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
from tensorcanon import digest
from tensorcanon.errors import TensorCanonError

DEADLINE_S = 10  # generous: CI cores are shared; a real hang never ends


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


# ----------------------------------------------------------------- the contract

def same(a, b) -> bool:
    """Deep equality that compares tensors and arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
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
