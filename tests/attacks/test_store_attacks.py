"""A store's contents are untrusted input (docs/STORE.md, "What a reader checks"): blobs that claim
sizes they do not hold, delta bases that lie, delta chains that loop, names that point outside the
root, records moved between tags. Each is refused with the library's own error, naming the blob or
tag, before anything is allocated for a claim."""

import os
import struct
import tracemalloc

import pytest
import torch

import tensorcanon as tc
from tensorcanon.store import layout


def blob_file(root, t):
    from tensorcanon.format import digest

    h = digest.tensor_hasher(str(t.dtype).removeprefix("torch."), tuple(t.shape))
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return root / layout.blob_path(h.digest()), h.digest()


def header_of(path):
    data = path.read_bytes()
    return layout.parse_header(data[: layout.HEAD], len(data), str(path)), data


def drifting(n=3, size=1 << 14, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(size, generator=g)
    out = []
    for _ in range(n):
        w = w + 1e-5 * torch.randn(size, generator=g)
        out.append(w.clone())
    return out


@pytest.fixture
def store3(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    ws = drifting()
    for i, w in enumerate(ws):
        store.save(f"t{i}", {"w": w})
    return root, ws


def refused(root, tag, *errors, match=None):
    for call in (lambda: tc.Store(root).load(tag), lambda: tc.Store(root).verify(tag), tc.Store(root).verify):
        with pytest.raises(errors or (tc.FormatError, tc.IntegrityError), match=match):
            call()


# ------------------------------------------------------------------ claimed sizes

def test_a_zstd_blob_claiming_a_terabyte_is_refused_before_allocating(store3):
    root, ws = store3
    path, _ = blob_file(root, ws[0])
    h, data = header_of(path)
    huge = b"uint8[1099511627776]"
    forged = layout.header_bytes(layout.ZSTD, 0, huge, 1 << 40, None, None) + data[h.payload : h.payload + 100]
    path.write_bytes(forged)
    tracemalloc.start()
    try:
        refused(root, "t0", match="cannot decode to|holds a uint8")
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("change", ["raw_size", "plane_length", "truncated", "trailing", "magic", "layout",
                                    "codec", "prefix", "padding"])
def test_a_blob_header_that_lies_is_refused(store3, change):
    root, ws = store3
    path, _ = blob_file(root, ws[0])
    h, data = header_of(path)
    assert h.codec == layout.GROUPED
    b = bytearray(data)
    if change == "raw_size":
        struct.pack_into("<Q", b, 12, h.size * 2)
    elif change == "plane_length":
        struct.pack_into("<Q", b, h.payload + 8, (1 << 62))
    elif change == "truncated":
        del b[-10:]
    elif change == "trailing":
        b += b"\0"
    elif change == "magic":
        b[0:7] = b"pkstore"
    elif change == "layout":
        b[7] = 2
    elif change == "codec":
        b[8] = 9
    elif change == "prefix":
        b[20:27] = b"int64[1"  # another dtype and shape, same length
    else:
        b[h.payload - 1] = 1
    path.write_bytes(bytes(b))
    refused(root, "t0")


def test_a_record_whose_blob_holds_another_shape_is_refused(store3, tmp_path):
    root, ws = store3
    store = tc.Store(root)
    store.save("small", {"w": torch.arange(4.0)})
    big_path, _ = blob_file(root, ws[0])
    small_path, _ = blob_file(root, torch.arange(4.0))
    small_path.write_bytes(big_path.read_bytes())
    with pytest.raises(tc.IntegrityError, match="holds a float32\\[16384\\] tensor, not float32\\[4\\]"):
        tc.Store(root).load("small")


def test_an_oversized_record_is_refused_unread(store3):
    root, _ = store3
    rec = root / "tags" / "big.safetensors"
    with open(rec, "wb") as f:
        f.truncate(200_000_000)
    with pytest.raises(tc.FormatError, match="more than the"):
        tc.Store(root).load("big")


# ------------------------------------------------------------------ delta bases and chains

def test_a_delta_whose_base_digest_names_another_tensor_is_refused(store3):
    root, ws = store3
    path, raw = blob_file(root, ws[1])
    h, data = header_of(path)
    assert h.codec in layout.DELTAS
    _, other = blob_file(root, ws[2])  # a real blob of the same dtype and shape, and depth
    other_h, _ = header_of(blob_file(root, ws[2])[0])
    b = bytearray(data)
    at = 20 + len(h.prefix)
    b[at : at + 16] = blob_file(root, ws[0])[1]  # (the real base) -> unchanged, then a lie:
    assert bytes(b) == data
    lie = blob_file(root, drifting(1, seed=5)[0])
    tc.Store(root).save("x", {"w": drifting(1, seed=5)[0]})
    b[at : at + 16] = lie[1]
    path.write_bytes(bytes(b))
    refused(root, "t1", tc.IntegrityError, match="delta against")
    assert other_h is not None and other


def test_a_damaged_base_is_named(store3):
    root, ws = store3
    base_path, _ = blob_file(root, ws[0])
    b = bytearray(base_path.read_bytes())
    b[-3] ^= 0xFF
    base_path.write_bytes(bytes(b))
    with pytest.raises((tc.IntegrityError, tc.FormatError), match=base_path.name):
        tc.Store(root).load("t1")


def test_a_missing_base_is_named(store3):
    root, ws = store3
    base_path, raw = blob_file(root, ws[0])
    base_path.unlink()
    with pytest.raises(tc.IntegrityError, match="does not hold"):
        tc.Store(root).load("t1")


@pytest.mark.parametrize("how", ["itself", "two_cycle", "too_deep", "depth_skips"])
def test_a_delta_chain_that_loops_or_lies_about_its_depth_is_refused(store3, how):
    root, ws = store3
    p1, d1 = blob_file(root, ws[1])
    p2, d2 = blob_file(root, ws[2])
    h1, data1 = header_of(p1)
    h2, data2 = header_of(p2)
    assert h1.depth == 1 and h2.depth == 2
    at = 20 + len(h1.prefix)
    b1, b2 = bytearray(data1), bytearray(data2)
    if how == "itself":
        b1[at : at + 16] = d1
    elif how == "two_cycle":
        b1[at : at + 16] = d2
        b1[9] = 3  # depth 3 against d2 (depth 2)...
        b2[9] = 2
        b2[at : at + 16] = d1  # ...and d2 against d1: each says the other is one less deep
    elif how == "too_deep":
        b2[9] = layout.MAX_DEPTH + 1
    else:
        b2[9] = 5  # its base (depth 1) is not depth 4
    p1.write_bytes(bytes(b1))
    p2.write_bytes(bytes(b2))
    with pytest.raises((tc.IntegrityError, tc.FormatError), match="depth|decodes to"):
        tc.Store(root).load("t2")


# ------------------------------------------------------------------ paths and records

def test_symlinks_in_a_store_are_never_followed(store3, tmp_path):
    root, ws = store3
    secret = tmp_path / "secret.safetensors"
    tc.save({"w": torch.ones(2)}, secret)
    os.symlink(secret, root / "tags" / "evil.safetensors")
    assert "evil" not in tc.Store(root).tags()
    with pytest.raises(tc.FileAccessError, match="symbolic link"):
        tc.Store(root).load("evil")
    path, _ = blob_file(root, ws[0])
    target = tmp_path / "outside"
    target.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(target, path)
    with pytest.raises(tc.FileAccessError, match="symbolic link"):
        tc.Store(root).load("t0")


def test_a_record_renamed_to_another_tag_is_refused(store3):
    root, _ = store3
    (root / "tags" / "t0.safetensors").replace(root / "tags" / "t1.safetensors")
    with pytest.raises(tc.FormatError, match="the record is of tag 't0', not 't1'"):
        tc.Store(root).load("t1")


def test_a_record_that_is_not_a_record_is_refused(store3):
    root, _ = store3
    tc.save({"format": "tensorcanon-store-tag", "layout": 2, "header": b"x" * 20, "tag": "t0"},
            root / "tags" / "t0.safetensors")
    with pytest.raises(tc.FormatError, match="layout 2"):
        tc.Store(root).load("t0")
    tc.save({"w": torch.ones(2)}, root / "tags" / "t0.safetensors")
    with pytest.raises(tc.FormatError, match="not a tag record"):
        tc.Store(root).load("t0")
    (root / "tags" / "t0.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}      ")
    with pytest.raises(tc.FormatError):
        tc.Store(root).load("t0")


def test_a_marker_of_another_layout_is_refused(store3):
    root, _ = store3
    (root / "tensorcanon-store").write_bytes(b"tensorcanon-store layout 9\n")
    with pytest.raises(tc.FormatError, match="layout 1"):
        tc.Store(root).load("t0")
    with pytest.raises(tc.FormatError, match="layout 1"):
        tc.Store(root).save("t9", {"x": 1})
