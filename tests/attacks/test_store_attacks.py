"""A store's contents are untrusted input (docs/STORE.md, "What a reader checks"): blobs that claim
sizes they do not hold, delta bases that lie, delta chains that loop, names that point outside the
root, records moved between tags, packs whose index lies or whose name is not their digest. Each is
refused with the library's own error, naming the blob, pack or tag, before anything is allocated
for a claim.

The blob attacks write loose blobs (the ``loose`` fixture: every blob written loose, as layout 1
did); the pack attacks below build packs around honest or hostile blobs."""

import os
import struct
import tracemalloc

import pytest
import torch
import xxhash

import tensorcanon as tc
from tensorcanon.store import layout, store as store_module
from tensorcanon.tools import cli


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
def loose(monkeypatch):
    """Every blob is written as a loose object (no pack), as a store of layout 1 holds them."""
    monkeypatch.setattr(store_module, "PACK_BLOB_LIMIT", 0)


@pytest.fixture
def store3(tmp_path, loose):
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
    with pytest.raises(tc.FormatError, match="layout 1 or 2"):
        tc.Store(root).load("t0")
    with pytest.raises(tc.FormatError, match="layout 1 or 2"):
        tc.Store(root).save("t9", {"x": 1})


# ------------------------------------------------------------------ packs

def packed_store(tmp_path):
    """A store of two tags whose blobs are all in one pack each: ``a`` (three tensors), ``b``
    (a's first tensor drifted: a delta against a blob in a's pack)."""
    root = tmp_path / "p"
    g = torch.Generator().manual_seed(3)
    a = {"w": torch.randn(64, 64, generator=g), "z": torch.zeros(2000), "i": torch.arange(300)}
    b = {"w": a["w"] + 1e-6 * torch.randn(64, 64, generator=g), "z": a["z"]}
    tc.Store(root).save("a", a)
    (pack,) = (root / "packs").glob("*.pack")
    tc.Store(root).save("b", b)
    return root, pack, a, b


def parts(path):
    """A pack read from the spec: (its bytes up to the index, [(digest, offset, length)] in index order)."""
    data = path.read_bytes()
    index_at, count = struct.unpack_from("<QQ", data, len(data) - 32)
    return data[:index_at], [struct.unpack_from("<16sQQ", data, index_at + 32 * i) for i in range(count)]


def rewrite(path, body, entries, *, count=None, index_at=None, rename=True):
    """Replace pack ``path`` by ``body`` + an index of ``entries`` + a trailer (claiming ``count`` and
    ``index_at`` where given); named by its new digest (an honest name for lying contents) unless
    ``rename`` is false. Returns the new path."""
    tail = b"".join(struct.pack("<16sQQ", *e) for e in entries)
    tail += struct.pack("<QQ8x8s", len(body) if index_at is None else index_at,
                        len(entries) if count is None else count, b"tcspack\x02")
    data = body + tail
    path.unlink()
    new = path.with_name(xxhash.xxh3_128(data).hexdigest() + ".pack") if rename else path
    new.write_bytes(data)
    return new


def every_reader_refuses(root, tag, match=None):
    for call in (lambda: tc.Store(root).load(tag), lambda: tc.Store(root).verify(tag), lambda: tc.Store(root).verify(),
                 lambda: tc.Store(root).export(tag, str(root) + ".out")):
        with pytest.raises((tc.FormatError, tc.IntegrityError), match=match):
            call()
    assert not os.path.exists(str(root) + ".out")
    assert cli.main(["store", "verify", str(root)]) == 1


@pytest.mark.parametrize("how", ["offset_past_the_end", "length_past_the_index", "overlapping", "unaligned",
                                 "inside_the_header", "unsorted", "duplicate", "count_huge", "count_zero",
                                 "count_off_by_one", "index_at_lies", "trailer_magic", "trailer_reserved"])
def test_a_pack_whose_index_lies_is_refused(tmp_path, how):
    root, pack, a, b = packed_store(tmp_path)
    body, entries = parts(pack)
    e = sorted(entries, key=lambda x: x[1])
    kw = {}
    if how == "offset_past_the_end":
        entries = [(r, o + (1 << 40) if r == e[0][0] else o, n) for r, o, n in entries]
    elif how == "length_past_the_index":
        entries = [(r, o, n + 64 if r == e[-1][0] else n) for r, o, n in entries]
    elif how == "overlapping":
        entries = [(r, e[0][1] if r == e[1][0] else o, n) for r, o, n in entries]
    elif how == "unaligned":
        entries = [(r, o + 8 if r == e[1][0] else o, n) for r, o, n in entries]
    elif how == "inside_the_header":
        entries = [(r, 0 if r == e[0][0] else o, n) for r, o, n in entries]
    elif how == "unsorted":
        entries = entries[::-1]
    elif how == "duplicate":
        entries = [entries[0], *entries[:-1]]
    elif how == "count_huge":
        kw = {"count": (1 << 64) - 1}
    elif how == "count_zero":
        kw = {"count": 0}
    elif how == "count_off_by_one":
        kw = {"count": len(entries) + 1}
    elif how == "index_at_lies":
        kw = {"index_at": len(body) - 64}
    new = rewrite(pack, body, entries, **kw)
    if how in ("trailer_magic", "trailer_reserved"):
        data = bytearray(new.read_bytes())
        data[-1 if how == "trailer_magic" else -12] ^= 0x01
        new.unlink()
        new = new.with_name(xxhash.xxh3_128(bytes(data)).hexdigest() + ".pack")
        new.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        every_reader_refuses(root, "a")
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    with pytest.raises((tc.FormatError, tc.IntegrityError), match=new.name[:32]):
        tc.Store(root).verify()  # the pack is named


def test_an_index_entry_naming_another_digest_is_refused(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    body, entries = parts(pack)
    # two entries swap their blobs: each digest now locates the other tensor's blob
    (r1, o1, n1), (r2, o2, n2) = entries[0], entries[1]
    rewrite(pack, body, sorted([(r1, o2, n2), (r2, o1, n1), *entries[2:]]))
    every_reader_refuses(root, "a")


def test_a_truncated_pack_is_refused(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    data = pack.read_bytes()
    for cut in (1, 33, len(data) // 2, len(data) - 10):
        pack.write_bytes(data[:cut] if cut < len(data) - 10 else data[:-cut])
        every_reader_refuses(root, "a")
    pack.write_bytes(data)
    assert cli.main(["store", "verify", str(root)]) == 0


def test_a_pack_whose_name_is_not_its_digest_is_found_by_verify(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    body, entries = parts(pack)
    body = bytearray(body)
    body[20] ^= 0x01  # a reserved byte of the pack's header: no blob changes
    rewrite(pack, bytes(body), entries, rename=False)
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)  # every blob still checks
    with pytest.raises(tc.IntegrityError, match=f"not the xxh3-128:{pack.name[:32]}"):
        tc.Store(root).verify()
    assert cli.main(["store", "verify", str(root)]) == 1


def test_a_pack_with_a_bad_header_and_an_honest_name_is_found_by_verify(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    body, entries = parts(pack)
    rewrite(pack, b"tcspack\x09" + body[8:], entries)
    with pytest.raises(tc.FormatError, match="pack's header"):
        tc.Store(root).verify()


@pytest.mark.parametrize("how", ["raw_size_huge", "zstd_claims_a_terabyte", "other_tensor"])
def test_a_hostile_blob_inside_an_honest_pack_is_refused(tmp_path, how):
    root, pack, a, b = packed_store(tmp_path)
    body, entries = parts(pack)
    from tensorcanon.format import digest

    t = a["i"]
    raw = digest.tensor_hasher("int64", (300,))
    raw.update(t.numpy().tobytes())
    target = raw.digest()
    ((_, offset, length),) = [e for e in entries if e[0] == target]
    blob = body[offset : offset + length]
    if how == "raw_size_huge":
        forged = blob[:12] + struct.pack("<Q", 1 << 62) + blob[20:]
    elif how == "zstd_claims_a_terabyte":
        forged = layout.header_bytes(layout.ZSTD, 0, b"uint8[1099511627776]", 1 << 40, None, None) + b"\x28" * 40
    else:
        forged = layout.header_bytes(layout.RAW, 0, b"int64[300]", 2400, None, None) + bytes(2400)
    pad = -len(body) % 64  # the forged blob goes after the others; the entry points to it
    new_body = body + bytes(pad) + forged
    moved = [(r, len(body) + pad, len(forged)) if r == target else (r, o, n) for r, o, n in entries]
    rewrite(pack, new_body, moved)
    tracemalloc.start()
    try:
        every_reader_refuses(root, "a")
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_every_flipped_byte_of_a_pack_is_found_and_nothing_foreign_escapes(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    good = pack.read_bytes()
    for off in sorted({*range(0, 64, 7), *range(64, len(good), max(1, len(good) // 50)), *range(len(good) - 32,
                                                                                                   len(good))}):
        bad = bytearray(good)
        bad[off] ^= 0x01
        pack.write_bytes(bytes(bad))
        assert cli.main(["store", "verify", str(root)]) == 1, off
        for tag in ("a", "b"):
            try:
                tc.Store(root).load(tag)
            except tc.TensorCanonError:
                pass
    pack.write_bytes(good)
    assert cli.main(["store", "verify", str(root)]) == 0


def test_a_symlinked_packs_folder_is_refused_and_gc_deletes_nothing_through_it(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    os.rename(root / "packs", elsewhere)
    os.symlink(elsewhere, root / "packs")
    for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify(), lambda: tc.Store(root).gc(),
                 lambda: tc.Store(root).save("c", {"x": torch.randn(9)})):
        with pytest.raises(tc.FileAccessError, match="symbolic link|not a folder"):
            call()
    assert len(os.listdir(elsewhere)) == 2  # both packs, untouched


def test_names_under_packs_that_are_not_packs_are_ignored(tmp_path):
    root, pack, a, b = packed_store(tmp_path)
    (root / "packs" / "notes.txt").write_bytes(b"x")
    (root / "packs" / ("ab" * 16 + ".pack.tmp")).write_bytes(pack.read_bytes())
    (root / "packs" / ("AB" * 16 + ".pack")).write_bytes(b"junk")
    (root / "packs" / ("cd" * 16 + ".pack")).mkdir()
    assert tc.Store(root).verify() == {"a": tc.fingerprint(a), "b": tc.fingerprint(b)}
    tc.Store(root).gc()
    assert (root / "packs" / "notes.txt").exists()
