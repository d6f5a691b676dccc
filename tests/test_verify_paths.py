"""verify() takes one of four routes (in-memory or mapped bytes hashed in place, a regular
file read on two threads, anything else read in order); every route gives the same answer."""

from __future__ import annotations

import io

import pytest
import torch

import tensorcanon
from tensorcanon.io import reader

import hostile_lib as h

MiB = 1 << 20


def _routes(path):
    data = path.read_bytes()

    def mapped():
        with reader.open_file(path, use_mmap=True) as cf:
            return cf.verify()

    def at_offset():  # a buffered file object whose file starts 3 bytes in
        p2 = path.with_suffix(".offset")
        p2.write_bytes(b"abc" + data)
        with open(p2, "rb") as fh:
            fh.read(3)
            return tensorcanon.verify(fh)

    return {"path": lambda: tensorcanon.verify(path), "bytes": lambda: tensorcanon.verify(data),
            "stream": lambda: tensorcanon.verify(h.Stream(data)), "mapped": mapped,
            "buffered at an offset": at_offset, "bytesio": lambda: tensorcanon.verify(io.BytesIO(data))}


@pytest.mark.parametrize("size", [MiB, 40 * MiB])  # below and above the two-thread threshold
def test_every_route_gives_the_same_digest(tmp_path, size):
    n = size // 4 // 10
    p = tmp_path / "v.safetensors"
    digest = tensorcanon.save({f"t{i}": torch.full((n,), float(i)) for i in range(10)} | {"z": torch.zeros(0)}, p)
    for name, route in _routes(p).items():
        assert route() == digest, name


@pytest.mark.parametrize("size", [MiB, 40 * MiB])
def test_every_route_names_the_first_damaged_tensor(tmp_path, size):
    n = size // 4 // 10
    p = tmp_path / "v.safetensors"
    tensorcanon.save({f"t{i}": torch.full((n,), float(i)) for i in range(10)}, p)
    raw = bytearray(p.read_bytes())
    raw[len(raw) - 8 * n * 4 + 9] ^= 1  # in t2
    raw[len(raw) - 1 * n * 4 + 9] ^= 1  # in t9, which the other thread hashes
    p.write_bytes(bytes(raw))
    for name, route in _routes(p).items():
        with pytest.raises(tensorcanon.IntegrityError) as info:
            route()
        assert '$["t2"]' in str(info.value), (name, str(info.value))


def test_a_file_object_is_left_after_the_data(tmp_path):
    p = tmp_path / "v.safetensors"
    tensorcanon.save({f"t{i}": torch.full((MiB,), float(i)) for i in range(5)}, p)  # 20 MiB
    with open(p, "rb") as fh:
        tensorcanon.verify(fh)
        assert fh.tell() == p.stat().st_size
