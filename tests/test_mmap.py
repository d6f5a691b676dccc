"""load(path, mmap=True): tensors view a private map of the file, every byte hashed first.

Also: no file descriptor or mapping outlives what needs it, after success or error.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
import torch

import tensorcanon

from support import count_hashed_bytes

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _obj():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 5, generator=g)
    return {
        "model": {"w": w, "b": torch.nn.Parameter(torch.ones(5)), "view": w[2:]},
        "ints": torch.arange(11, dtype=torch.int8), "half": torch.randn(9, generator=g).half(),
        "bf16": torch.randn(4, generator=g).to(torch.bfloat16), "flags": torch.tensor([True, False, True]),
        "c128": torch.randn(3, dtype=torch.complex128, generator=g), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3), "arr": np.arange(7, dtype=np.int32), "grad": torch.ones(2).requires_grad_(),
        "big": torch.randn(300_000, generator=g), "step": 3,
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_same_object_as_an_eager_load(tmp_path, algorithm):
    p = tmp_path / "c.safetensors"
    tensorcanon.save(_obj(), p, algorithm=algorithm)
    assert _same(tensorcanon.load(p), tensorcanon.load(p, mmap=True))
    assert _same(tensorcanon.load(p, map_location="cpu"), tensorcanon.load(p, mmap=True, map_location="cpu"))


def test_plain_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "plain.safetensors"
    save_file({"a": torch.arange(5.0), "b": torch.ones(2, 2, dtype=torch.int64)}, str(p))
    assert _same(tensorcanon.load(p), tensorcanon.load(p, mmap=True))


@linux_only
def test_tensors_view_the_map_and_outlive_it(tmp_path):
    p = tmp_path / "c.safetensors"
    tensorcanon.save(_obj(), p)
    fds = _open_fds()
    x = tensorcanon.load(p, mmap=True)
    assert _open_fds() == fds  # nothing held open
    ranges = _mapped_ranges(str(p))
    assert len(ranges) == 1

    def inside(t):
        ptr = t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data
        return any(lo <= ptr < hi for lo, hi in ranges)

    viewing = [k for k in ("ints", "half", "bf16", "flags", "scalar", "arr", "grad", "big") if inside(x[k])]
    assert viewing == ["ints", "half", "bf16", "flags", "scalar", "arr", "grad", "big"]
    assert inside(x["model"]["w"]) and inside(x["model"]["b"])
    big = x["big"]
    expected = big.clone()
    del x
    gc.collect()
    assert len(_mapped_ranges(str(p))) == 1  # still mapped: `big` views it
    os.unlink(p)
    assert torch.equal(big, expected)  # the map outlives the file's name
    del big
    gc.collect()
    assert _mapped_ranges(str(p)) == []


def test_writes_copy_the_page_and_never_reach_the_file(tmp_path):
    p = tmp_path / "c.safetensors"
    digest = tensorcanon.save({"t": torch.zeros(1000)}, p)
    before = p.read_bytes()
    x = tensorcanon.load(p, mmap=True)
    x["t"] += 1
    assert torch.equal(x["t"], torch.ones(1000))
    assert p.read_bytes() == before
    assert tensorcanon.verify(p) == digest
    assert torch.equal(tensorcanon.load(p, mmap=True)["t"], torch.zeros(1000))


def test_every_byte_is_hashed_before_anything_is_returned(tmp_path, monkeypatch):
    p = tmp_path / "c.safetensors"
    obj = {f"t{i}": torch.full((50_000,), float(i)) for i in range(40)}  # 8 MB: the threaded path too
    obj["small"] = torch.ones(3)
    tensorcanon.save(obj, p)
    hashed = count_hashed_bytes(monkeypatch)
    tensorcanon.load(p, mmap=True)
    assert sum(hashed) == 40 * 200_000 + 12

    raw = bytearray(p.read_bytes())
    raw[-20_000] ^= 1  # inside one of the large tensors
    p.write_bytes(bytes(raw))
    with pytest.raises(tensorcanon.IntegrityError, match=r'\$\["t'):
        tensorcanon.load(p, mmap=True)


@pytest.mark.parametrize("size", [1 << 20, 60 << 20])  # one thread; two threads hash the map
def test_damage_is_named_by_its_path(tmp_path, size):
    p = tmp_path / "c.safetensors"
    n = size // 4 // 8
    tensorcanon.save({f"t{i}": torch.full((n,), float(i)) for i in range(8)}, p)
    raw = bytearray(p.read_bytes())
    raw[len(raw) - 3 * n * 4 + 5] ^= 1  # in t5: the third tensor from the end
    p.write_bytes(bytes(raw))
    with pytest.raises(tensorcanon.IntegrityError, match=r'\$\["t5"\]'):
        tensorcanon.load(p, mmap=True)


def test_damage_in_two_tensors_names_the_first_in_file_order(tmp_path):
    # Two threads hash the map, one from each end: the one that finishes first must not decide
    # which tensor is named.
    p = tmp_path / "c.safetensors"
    n = (48 << 20) // 4 // 8
    tensorcanon.save({f"t{i}": torch.full((n,), float(i)) for i in range(8)}, p)
    raw = bytearray(p.read_bytes())
    raw[len(raw) - 6 * n * 4 + 9] ^= 1  # in t2
    raw[len(raw) - 1 * n * 4 + 9] ^= 1  # in t7, which the thread from the back reaches first
    p.write_bytes(bytes(raw))
    with pytest.raises(tensorcanon.IntegrityError, match=r'\$\["t2"\]'):
        tensorcanon.load(p, mmap=True)


@pytest.mark.parametrize("where", [0, 0.5, 1])  # a byte at its start, middle, end
def test_one_large_tensor_is_hashed_whole_while_the_other_thread_maps_its_pages(tmp_path, where):
    p = tmp_path / "c.safetensors"
    big = torch.arange((40 << 20) // 4, dtype=torch.int32)
    tensorcanon.save({"big": big, "small": torch.ones(3)}, p)
    assert torch.equal(tensorcanon.load(p, mmap=True)["big"], big)
    raw = bytearray(p.read_bytes())
    end = len(raw) - 3 * 4  # "big" (element size 4, name order) comes before "small"
    raw[min(end - big.numel() * 4 + int(where * big.numel() * 4), end - 1)] ^= 0x40
    p.write_bytes(bytes(raw))
    with pytest.raises(tensorcanon.IntegrityError, match=r'\$\["big"\]'):
        tensorcanon.load(p, mmap=True)


@linux_only
def test_populate_maps_the_pages_of_a_range(tmp_path):
    from tensorcanon.io import source

    p = tmp_path / "c.bin"
    p.write_bytes(bytes(range(256)) * (1 << 16))  # 16 MiB
    src = source.map_file(str(p))
    try:
        def resident() -> int:  # kB of the file's map in this process's page tables
            with open("/proc/self/smaps") as fh:
                lines = fh.read().splitlines()
            real = os.path.realpath(p)
            for i, line in enumerate(lines):
                if line.rstrip().endswith(real):
                    return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
            raise AssertionError("the file is not mapped")

        before = resident()
        if not src.populate(3 << 20, 8 << 20):
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14 and later)")
        assert resident() - before >= 8 << 10
        assert not src.populate(15 << 20, 2 << 20)  # past the end: refused, nothing mapped
        assert bytes(src.data[(3 << 20) + 1 : (3 << 20) + 4]) == bytes([1, 2, 3])
    finally:
        src.release()


def test_map_location_and_errors(tmp_path):
    p = tmp_path / "c.safetensors"
    tensorcanon.save({"t": torch.arange(4.0)}, p)
    seen = []

    def to(t, recorded):
        seen.append(recorded)
        return t * 2

    assert torch.equal(tensorcanon.load(p, mmap=True, map_location=to)["t"], torch.arange(4.0) * 2)
    assert seen == ["cpu"]
    if not torch.cuda.is_available():
        with pytest.raises(tensorcanon.DeviceUnavailableError):
            tensorcanon.load(p, mmap=True, map_location="cuda")
    with open(p, "rb") as fh, pytest.raises(tensorcanon.UsageError, match="needs a path"):
        tensorcanon.load(fh, mmap=True)
    with pytest.raises(tensorcanon.UsageError):
        tensorcanon.load(p, mmap="yes")
    with pytest.raises(tensorcanon.MissingFileError):
        tensorcanon.load(tmp_path / "nope.safetensors", mmap=True)
    with pytest.raises(tensorcanon.FormatError, match="directory"):
        tensorcanon.load(tmp_path, mmap=True)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(tensorcanon.FormatError):
        tensorcanon.load(empty, mmap=True)


@linux_only
def test_nothing_leaks_after_errors(tmp_path):
    good = tmp_path / "good.safetensors"
    tensorcanon.save({"t": torch.arange(100.0), "u": torch.ones(7)}, good)
    data = good.read_bytes()
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-3])
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10" + bytes(100))
    gc.collect()
    fds = _open_fds()
    for _ in range(20):
        for bad in (damaged, truncated, junk):
            with pytest.raises(tensorcanon.TensorCanonError):
                tensorcanon.load(bad, mmap=True)
            with pytest.raises(tensorcanon.TensorCanonError):
                with tensorcanon.open(bad) as f:
                    for k in f.keys():
                        f[k]
        tensorcanon.load(good, mmap=True)
    gc.collect()
    assert _open_fds() == fds
    for path in (good, damaged, truncated, junk):
        assert _mapped_ranges(str(path)) == [], path


def test_atomic_save_over_a_mapped_file_leaves_its_tensors_alone(tmp_path):
    p = tmp_path / "c.safetensors"
    tensorcanon.save({"t": torch.zeros(10_000)}, p)
    x = tensorcanon.load(p, mmap=True)
    tensorcanon.save({"t": torch.ones(10_000)}, p)  # temp file + rename: a new inode
    assert torch.equal(x["t"], torch.zeros(10_000))
    assert torch.equal(tensorcanon.load(p, mmap=True)["t"], torch.ones(10_000))


@linux_only
def test_an_in_place_writer_changes_pages_not_yet_written(tmp_path):
    # What docs say the map cannot protect against: a writer that rewrites the file in place
    # (not by rename) changes what tensors read from pages this process has not written to.
    p = tmp_path / "c.safetensors"
    tensorcanon.save({"t": torch.zeros(4096)}, p)
    x = tensorcanon.load(p, mmap=True)
    with open(p, "r+b") as fh:
        fh.seek(-4, os.SEEK_END)
        fh.write(np.float32(5.0).tobytes())
    assert x["t"][-1].item() == 5.0
    with pytest.raises(tensorcanon.IntegrityError):
        tensorcanon.load(p, mmap=True)  # a new load hashes the changed bytes and refuses them
