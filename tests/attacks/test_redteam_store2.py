"""Red-team attacks on layout 2 of ``tensorcanon.Store``: packs (their header, index and trailer;
a blob found loose or in a pack; gc deleting, rewriting and merging packs; verify of packs) and the
``delta-sub`` codec, written from docs/STORE.md, docs/SECURITY.md and docs/CLI.md only.

Blobs and packs are built here from the Layout section by an independent encoder (struct + numpy +
xxhash + zstandard). Each attack asserts what the docs promise: the library's own error naming the
blob, pack or tag; no foreign exception; no allocation for a claim; ``store verify`` exit 1 on
damage; never a wrong tensor; gc never loses what a live tag needs. The layout-1 attacks (loose
blobs) are in test_redteam_store.py and test_store_attacks.py and are not repeated here."""

import os
import stat
import struct
import threading
import tracemalloc

import numpy as np
import pytest
import torch
import xxhash

import tensorcanon as tc
from tensorcanon.tools import cli

zstd = pytest.importorskip("zstandard")

MAGIC = b"tcstore\x01"
PACK_MAGIC = b"tcspack\x02"
RAW, ZSTD, GROUPED, DELTA, DELTA_SUB = 0, 1, 2, 3, 4


# ------------------------------------------------------------------ an independent encoder (Layout)

def prefix_of(t):
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(str(d) for d in t.shape)}]".encode()


def raw_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def digest_of(t):
    return xxhash.xxh3_128(prefix_of(t) + raw_bytes(t)).digest()


def head(codec, depth, prefix, size, base=b""):
    h = MAGIC + struct.pack("<BBHQ", codec, depth, len(prefix), size) + prefix + base
    return h + b"\x00" * (-len(h) % 64)


def planes(data, k):
    table, body = b"", b""
    for i in range(k):
        p = data[i::k]
        table += struct.pack("<B7xQ", 0, len(p))
        body += p
    return table + body


def raw_blob(t):
    return head(RAW, 0, prefix_of(t), t.numel() * t.element_size()) + raw_bytes(t)


UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def zigzag_diff(a, b, k):
    """The delta-sub grouped bytes of ``a`` against ``b`` (each the raw bytes of k-byte elements)."""
    u = UINT[k]
    x, y = np.frombuffer(a, u), np.frombuffer(b, u)
    d = (x - y).view(SINT[k])  # mod 2^(8k), read as two's complement
    g = (d << 1) ^ (d >> (8 * k - 1))  # an arithmetic shift; << wraps
    return g.view(u).tobytes()


def delta_sub_blob(t, base, depth=1, base_digest=None, prefix=None):
    k = t.element_size()
    g = zigzag_diff(raw_bytes(t), raw_bytes(base), k)
    return head(DELTA_SUB, depth, prefix or prefix_of(t), len(g), base_digest or digest_of(base)) + planes(g, k)


def xor_blob(t, base, depth=1, base_digest=None):
    x = bytes(p ^ q for p, q in zip(raw_bytes(t), raw_bytes(base), strict=True))
    k = t.element_size()
    return head(DELTA, depth, prefix_of(t), len(x), base_digest or digest_of(base)) + planes(x, k)


def pack_of(entries):
    """A pack (Layout, Packs) of ``[(digest, blob)]``; returns its bytes."""
    body = bytearray(PACK_MAGIC + bytes(56))
    index = []
    for d, blob in sorted(entries, key=lambda e: e[0]):
        body += bytes(-len(body) % 64)
        index.append((d, len(body), len(blob)))
        body += blob
    return bytes(body) + raw_index(index, len(body))


def raw_index(index, index_at, count=None):
    return b"".join(struct.pack("<16sQQ", *e) for e in index) + struct.pack(
        "<QQ8x8s", index_at, len(index) if count is None else count, PACK_MAGIC)


def put_pack(root, data, name=None):
    path = root / "packs" / f"{name or xxhash.xxh3_128(data).hexdigest()}.pack"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def read_pack(path):
    data = path.read_bytes()
    index_at, count = struct.unpack_from("<QQ", data, len(data) - 32)
    return {d: data[o : o + n] for d, o, n in (struct.unpack_from("<16sQQ", data, index_at + 32 * i)
                                               for i in range(count))}


def all_packed(root):
    out = {}
    for p in sorted((root / "packs").glob("*.pack")):
        for d, blob in read_pack(p).items():
            out.setdefault(d, (p, blob))
    return out


def loose_path(root, d):
    return root / "blobs" / "xxh3-128" / d.hex()[:2] / d.hex()


def ours(call, match=None):
    """``call`` raises a TensorCanonError (never a foreign one) whose text holds ``match``."""
    try:
        call()
    except tc.TensorCanonError as e:
        if match is not None:
            assert match in str(e), str(e)
        return str(e)
    except Exception as e:  # noqa: BLE001 — the attack's point: nothing foreign escapes
        pytest.fail(f"foreign exception {type(e).__name__}: {e}")
    pytest.fail("accepted hostile input")


def cli_run(capsys, *argv):
    code = cli.main(["store", *map(str, argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def fresh(tmp_path, obj, tag="a", name="s"):
    root = tmp_path / name
    tc.Store(root).save(tag, obj)
    return root


def drop_blob(root, d):
    """Remove every copy of blob ``d`` (loose, and its entry in every pack, rewritten honestly)."""
    lp = loose_path(root, d)
    if lp.exists():
        lp.unlink()
    for p in list((root / "packs").glob("*.pack")):
        blobs = read_pack(p)
        if d in blobs:
            p.unlink()
            del blobs[d]
            if blobs:
                put_pack(root, pack_of(list(blobs.items())))


def replace_blob(root, d, blob, where="pack"):
    """Make ``blob`` the only copy of ``d``: in a new pack of its own, or loose."""
    drop_blob(root, d)
    if where == "pack":
        return put_pack(root, pack_of([(d, blob)]))
    lp = loose_path(root, d)
    lp.parent.mkdir(parents=True, exist_ok=True)
    lp.write_bytes(blob)
    return lp


# ------------------------------------------------------------------ delta-sub, by hand, on every element size

def extremes(dtype, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    k = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).clone()
    if dtype.is_floating_point or dtype.is_complex:
        return t  # any bit pattern: NaN payloads, infinities, subnormals
    info = torch.iinfo(dtype)
    t[:4] = torch.tensor([info.min, info.max, 0, -1 if info.min < 0 else 1], dtype=dtype)
    return t


SUB_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.int16,
              torch.float16, torch.bfloat16, torch.int32, torch.float32, torch.int64, torch.float64,
              torch.complex64, torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("where", ["pack", "loose"])
@pytest.mark.parametrize("dtype", SUB_DTYPES, ids=str)
def test_a_handmade_delta_sub_of_every_element_size_loads_bit_exact(tmp_path, dtype, where):
    base = extremes(dtype, seed=1)
    t = extremes(dtype, seed=2)
    if dtype not in (torch.bool,) and not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype)
        base[:4] = torch.tensor([info.max, info.min, info.min if info.min < 0 else info.max, info.max],
                                dtype=dtype)  # min - max, max - min, 0 - min: every wrap, and zigzag(min)
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    replace_blob(root, digest_of(t), delta_sub_blob(t, base), where)
    got = tc.Store(root).load("a")["x"]
    assert raw_bytes(got) == raw_bytes(t)
    assert tc.Store(root).verify() == {"base": tc.fingerprint({"x": base}), "a": tc.fingerprint({"x": t})}


def test_the_zigzag_of_the_minimum_is_all_ones():
    # the spec's arithmetic: d = min of int64 -> g = -2d - 1 = 2^64 - 1 (the encoder above agrees)
    t = torch.tensor([torch.iinfo(torch.int64).min])
    b = torch.tensor([0])
    assert zigzag_diff(raw_bytes(t), raw_bytes(b), 8) == b"\xff" * 8


@pytest.mark.parametrize("dtype", SUB_DTYPES, ids=str)
def test_the_writer_round_trips_every_dtype_through_deltas(tmp_path, dtype):
    """Consecutive saves of slowly changing tensors of every dtype (the writer chooses delta-sub)."""
    root = tmp_path / "w"
    store = tc.Store(root)
    t = extremes(dtype, n=4096, seed=3)
    saved = []
    for step in range(4):
        t = t.clone()
        t.view(torch.uint8)[step :: 97] ^= 1  # a few elements move
        store.save(f"s{step}", {"x": t})
        saved.append(raw_bytes(t))
    for step in range(4):
        assert raw_bytes(tc.Store(root).load(f"s{step}")["x"]) == saved[step]
    assert cli.main(["store", "verify", str(root)]) == 0


def test_delta_sub_of_16_byte_elements_is_refused(tmp_path):
    base = torch.randn(8, dtype=torch.complex128)
    t = base + 1
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    # a delta-sub "of 16-byte integers" (all-zero differences), well formed but for k = 16
    blob = head(DELTA_SUB, 1, prefix_of(t), 16 * 8, digest_of(base)) + planes(bytes(16 * 8), 16)
    replace_blob(root, digest_of(t), blob)
    ours(lambda: tc.Store(root).load("a"), match=digest_of(t).hex())
    assert cli.main(["store", "verify", str(root)]) == 1


@pytest.mark.parametrize("how", ["missing", "other_dtype", "other_shape", "depth_not_one_less", "depth_0",
                                 "self", "base_is_grouped_not_raw_prefix", "base_damaged"])
def test_a_delta_sub_whose_base_lies_is_refused(tmp_path, how):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(32, 32, generator=g)
    t = base + 1e-6 * torch.randn(32, 32, generator=g)
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    kw = {}
    if how == "missing":
        kw["base_digest"] = b"\x42" * 16
    elif how == "other_dtype":  # same element size, another dtype: the bytes would decode
        other = base.view(torch.int32)
        tc.Store(root).save("o", {"x": other})
        kw["base_digest"] = digest_of(other)
    elif how == "other_shape":
        other = base.reshape(1024)
        tc.Store(root).save("o", {"x": other})
        kw["base_digest"] = digest_of(other)
    elif how == "depth_not_one_less":
        kw["depth"] = 2
    elif how == "depth_0":
        kw["depth"] = 0
    elif how == "self":
        kw["base_digest"] = digest_of(t)
    elif how == "base_is_grouped_not_raw_prefix":
        kw["prefix"] = b"float32[32,32]  "
    blob = delta_sub_blob(t, base, **kw)
    replace_blob(root, digest_of(t), blob)
    if how == "base_damaged":
        bad = bytearray(raw_blob(base))
        bad[-1] ^= 1
        replace_blob(root, digest_of(base), bytes(bad), "loose")
    before = tc.Store(root).tags()
    ours(lambda: tc.Store(root).load("a"))
    ours(lambda: tc.Store(root).verify("a"))
    assert cli.main(["store", "verify", str(root), "a"]) == 1
    assert tc.Store(root).tags() == before


def test_chains_mixing_xor_delta_and_delta_sub_across_packs_and_loose(tmp_path):
    g = torch.Generator().manual_seed(9)
    ts = [torch.randn(16, 16, generator=g)]
    for _ in range(5):
        ts.append(ts[-1] + 1e-5 * torch.randn(16, 16, generator=g))
    root = tmp_path / "c"
    for i, t in enumerate(ts):
        tc.Store(root).save(f"t{i}", {"x": t})  # a new object each time: no deltas of the writer's
    # t1 xor t0 (pack), t2 sub t1 (loose), t3 xor t2 (pack), t4 sub t3 (pack, with t3), t5 sub t4 (loose)
    blobs = [None, xor_blob(ts[1], ts[0], 1), delta_sub_blob(ts[2], ts[1], 2), xor_blob(ts[3], ts[2], 3),
             delta_sub_blob(ts[4], ts[3], 4), delta_sub_blob(ts[5], ts[4], 5)]
    for i in (1, 2, 3, 4, 5):
        drop_blob(root, digest_of(ts[i]))
    put_pack(root, pack_of([(digest_of(ts[1]), blobs[1])]))
    put_pack(root, pack_of([(digest_of(ts[3]), blobs[3]), (digest_of(ts[4]), blobs[4])]))
    for i in (2, 5):
        replace_blob(root, digest_of(ts[i]), blobs[i], "loose")
    for i, t in enumerate(ts):
        assert raw_bytes(tc.Store(root).load(f"t{i}")["x"]) == raw_bytes(t)
    assert cli.main(["store", "verify", str(root)]) == 0
    assert tc.Store(root).stats()["max_depth"] == 5
    tc.Store(root).delete("t4")
    tc.Store(root).delete("t0")
    tc.Store(root).gc()  # t5 needs t4 ... t0 as bases: nothing of the chain may go
    for i, t in enumerate(ts):
        if i not in (0, 4):
            assert raw_bytes(tc.Store(root).load(f"t{i}")["x"]) == raw_bytes(t)
    assert cli.main(["store", "verify", str(root)]) == 0


def test_a_delta_sub_plane_claiming_a_huge_size_allocates_nothing(tmp_path):
    base = torch.randn(256)
    t = base + 1
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    frame = zstd.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1 << 20))
    forged = head(DELTA_SUB, 1, prefix_of(t), 1024, digest_of(base))
    forged += b"".join(struct.pack("<B7xQ", 1, len(frame)) for _ in range(4)) + frame * 4
    replace_blob(root, digest_of(t), forged)
    tracemalloc.start()
    try:
        ours(lambda: tc.Store(root).load("a"), match=digest_of(t).hex())
        assert tracemalloc.get_traced_memory()[1] < 2 << 20
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ packs that lie

def two_tensor_store(tmp_path):
    g = torch.Generator().manual_seed(11)
    a = {"w": torch.randn(40, 40, generator=g), "v": torch.randn(300, generator=g), "i": torch.arange(200)}
    root = fresh(tmp_path, a)
    return root, a


@pytest.mark.parametrize("how", ["nested", "offset_in_index", "offset_in_trailer", "zero_length_same_offset",
                                 "many_zero_entries", "length_huge", "offset_wraps"])
def test_a_pack_index_that_lies_in_new_ways_is_refused(tmp_path, how):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    blobs = read_pack(pack)
    pack.unlink()
    data = pack_of(list(blobs.items()))
    index_at, count = struct.unpack_from("<QQ", data, len(data) - 32)
    body = data[:index_at]
    index = [struct.unpack_from("<16sQQ", data, index_at + 32 * i) for i in range(count)]
    first = min(index, key=lambda e: e[1])
    if how == "nested":  # an entry inside another's bytes
        index = [(d, o + 64, 64) if d != first[0] and o != first[1] else (d, o, n) for d, o, n in index]
        index = [(d, first[1] + 64, 64) if (d, o, n) != first else (d, o, n) for d, o, n in index]
    elif how == "offset_in_index":
        index = [(d, index_at, n) if (d, o, n) == first else (d, o, n) for d, o, n in index]
    elif how == "offset_in_trailer":
        index = [(d, index_at + 32 * count, 32) if (d, o, n) == first else (d, o, n) for d, o, n in index]
    elif how == "zero_length_same_offset":
        index = [(d, 64, 0) for d, o, n in index]
    elif how == "many_zero_entries":  # a big count the pack's size does hold: 2,000 zero-length entries
        index = [(i.to_bytes(16, "big"), 64, 0) for i in range(2000)]
    elif how == "length_huge":
        index = [(d, o, (1 << 64) - 1) if (d, o, n) == first else (d, o, n) for d, o, n in index]
    elif how == "offset_wraps":  # offset + length wraps 2^64 to a small end
        index = [(d, (1 << 64) - 64, 128) if (d, o, n) == first else (d, o, n) for d, o, n in index]
    bad = put_pack(root, body + raw_index(index, len(body)))
    tracemalloc.start()
    try:
        for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify(),
                     lambda: tc.Store(root).export("a", str(root) + ".out")):
            ours(call)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    assert not os.path.exists(str(root) + ".out")
    assert cli.main(["store", "verify", str(root)]) == 1
    tc.Store(root).gc()  # a pack whose index it cannot read: never deleted
    assert bad.exists()


def test_a_pack_with_an_honest_name_holding_another_tensor_under_a_digest(tmp_path):
    """The pack's name is its digest, but an entry's digest names a tensor its blob is not."""
    root, a = two_tensor_store(tmp_path)
    dv, dw = digest_of(a["v"]), digest_of(a["w"])
    other = torch.randn(300)
    drop_blob(root, dv)
    put_pack(root, pack_of([(dv, raw_blob(other))]))
    for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify("a"),
                 lambda: tc.Store(root).export("a", str(root) + ".out")):
        ours(call, match=dv.hex())
    assert cli.main(["store", "verify", str(root)]) == 1
    assert dw in all_packed(root)


def lying_twin(tmp_path):
    """A store where blob v is held twice: honestly in a's pack, and in a second pack, honestly named,
    whose entry for v holds another tensor's blob. The liar's name sorts first (a reader or collector
    that takes the first copy it lists takes the lie)."""
    root, a = two_tensor_store(tmp_path)
    (honest,) = (root / "packs").glob("*.pack")
    dv = digest_of(a["v"])
    for seed in range(1000):
        lie = pack_of([(dv, raw_blob(torch.randn(300, generator=torch.Generator().manual_seed(seed))))])
        if xxhash.xxh3_128(lie).hexdigest() < honest.stem:
            break
    liar = put_pack(root, lie)
    return root, a, dv, liar


def test_the_same_digest_in_two_packs_one_lying_never_loads_wrong(tmp_path):
    root, a, dv, liar = lying_twin(tmp_path)
    # the copy read first lies: the honest one is read instead (docs/STORE.md, "Copies")
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)
    assert tc.Store(root).verify("a") == tc.fingerprint(a)
    ours(lambda: tc.Store(root).verify(), match=liar.name)  # (the whole store's check names the liar's pack)
    assert cli.main(["store", "verify", str(root)]) == 1


def test_gc_never_replaces_an_honest_copy_by_a_lying_one(tmp_path):
    """gc merges small packs; the copy of v it keeps must be the honest one (the liar's pack hashes to
    its name, so that is no proof of its blobs)."""
    root, a, dv, liar = lying_twin(tmp_path)
    for i in range(8):  # small packs enough to merge
        tc.Store(root).save(f"n{i}", {"n": torch.randn(100) + i})
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass  # refusing to collect a store with a lying copy is fine too
    assert cli.main(["store", "verify", str(root)]) == 1  # the lie is still found
    if liar.exists():
        liar.unlink()  # what the user does once verify names it
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)  # the honest copy was kept
    assert cli.main(["store", "verify", str(root)]) == 0


def test_gc_with_a_damaged_needed_blob_in_a_small_pack_does_not_hide_the_damage(tmp_path):
    root, a = two_tensor_store(tmp_path)
    for i in range(8):
        tc.Store(root).save(f"n{i}", {"n": torch.randn(100) + i})
    dv = digest_of(a["v"])
    p, blob = all_packed(root)[dv]
    data = bytearray(p.read_bytes())
    at = bytes(data).index(blob) + len(blob) - 1
    data[at] ^= 1  # v's last byte: the pack no longer hashes to its name, v no longer to its digest
    p.write_bytes(bytes(data))
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    # whatever gc did, the damage is still reported, and the other tensors of a are still there
    assert cli.main(["store", "verify", str(root)]) == 1
    ours(lambda: tc.Store(root).load("a"), match=dv.hex())
    for name in ("w", "i"):
        d = digest_of(a[name])
        assert d in all_packed(root) or loose_path(root, d).exists(), name


def test_gc_keeps_a_pack_whose_trailer_is_damaged_among_many_small_ones(tmp_path):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    for i in range(9):
        tc.Store(root).save(f"n{i}", {"n": torch.randn(100) + i})
    data = bytearray(pack.read_bytes())
    data[-1] ^= 1
    pack.write_bytes(bytes(data))
    tc.Store(root).gc()
    assert pack.exists() and pack.read_bytes() == bytes(data)
    data[-1] ^= 1
    pack.write_bytes(bytes(data))
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)


# ------------------------------------------------------------------ things under packs/ that are not packs

def test_a_symlinked_pack_is_not_followed(tmp_path):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    outside = tmp_path / "outside.pack"
    os.rename(pack, outside)
    os.symlink(outside, pack)
    for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify()):
        ours(call)
    assert cli.main(["store", "verify", str(root)]) == 1
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    assert outside.exists()


def test_a_fifo_named_as_a_pack_never_blocks(tmp_path, capsys):
    root, a = two_tensor_store(tmp_path)
    fifo = root / "packs" / ("ab" * 16 + ".pack")
    os.mkfifo(fifo)
    import signal

    def alarm(*_):
        raise AssertionError("blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    try:
        assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)
        # not a regular file: ignored, as a folder named like a pack is (test_store_attacks.py), or
        # reported as damage; either way without opening it
        try:
            tc.Store(root).verify()
        except tc.TensorCanonError as e:
            assert "ab" * 16 in str(e)
        code, _ = cli_run(capsys, "verify", root)
        assert code in (0, 1)
        try:
            tc.Store(root).gc()
        except tc.TensorCanonError:
            pass
        code, _ = cli_run(capsys, "stats", root)
        assert code in (0, 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_huge_sparse_pack_is_refused_without_reading_it_into_memory(tmp_path):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    blobs = read_pack(pack)
    # an honest index and trailer, after 1 GiB of holes: every entry valid, the pack's name a lie
    size = 1 << 30
    index = []
    at = 64
    body_blobs = []
    for d, blob in sorted(blobs.items()):
        index.append((d, at, len(blob)))
        body_blobs.append((at, blob))
        at += len(blob) + (-len(blob) % 64)
    tail = raw_index(index, size)
    sparse = root / "packs" / ("cd" * 16 + ".pack")
    with open(sparse, "wb") as f:
        f.write(PACK_MAGIC + bytes(56))
        for o, blob in body_blobs:
            f.seek(o)
            f.write(blob)
        f.seek(size)
        f.write(tail)
    pack.unlink()
    tracemalloc.start()
    try:
        assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)  # every blob checks
        ours(lambda: tc.Store(root).verify(), match="cd" * 16)  # the name does not
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ markers, races, memory://

def test_two_writers_upgrading_a_layout_1_store_at_once(tmp_path):
    root = tmp_path / "u"
    old = torch.randn(100)
    tc.Store(root).save("old", {"x": old})
    for p in list((root / "packs").glob("*.pack")):  # make it a layout-1 store: loose blobs only
        for d, blob in read_pack(p).items():
            replace_blob(root, d, blob, "loose")
    if (root / "packs").exists():
        os.rmdir(root / "packs")
    (root / "tensorcanon-store").write_bytes(b"tensorcanon-store layout 1\n")
    assert tc.fingerprint(tc.Store(root).load("old")) == tc.fingerprint({"x": old})
    objs = {f"t{i}": {"x": torch.randn(200) + i} for i in range(6)}
    errors = []

    def writer(names):
        try:
            for n in names:
                tc.Store(root).save(n, objs[n])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=writer, args=(["t0", "t2", "t4"],)),
           threading.Thread(target=writer, args=(["t1", "t3", "t5"],))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, errors
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 2\n"
    assert tc.Store(root).verify() == {**{n: tc.fingerprint(o) for n, o in objs.items()},
                                       "old": tc.fingerprint({"x": old})}


def test_gc_racing_saves_in_threads_loses_nothing(tmp_path):
    root = tmp_path / "r"
    tc.Store(root).save("seed", {"x": torch.randn(10)})
    objs = {}
    errors = []
    done = threading.Event()

    def saver():
        try:
            s = tc.Store(root)
            w = torch.randn(2000)
            for i in range(12):
                w = w + 1e-4 * torch.randn(2000)
                o = {"w": w.clone(), "b": torch.randn(50), "i": i}
                s.save(f"s{i:02d}", o)
                objs[f"s{i:02d}"] = o
                if i >= 3:
                    s.delete(f"s{i - 3:02d}")
                    objs.pop(f"s{i - 3:02d}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done.set()

    def collector():
        try:
            while not done.is_set():
                tc.Store(root).gc()
                done.wait(0.05)  # (back to back, collections starve the saver: it waits for each)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=saver), threading.Thread(target=collector)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, errors
    tc.Store(root).gc()
    expect = {n: tc.fingerprint(o) for n, o in objs.items()}
    expect["seed"] = tc.Store(root).verify("seed")
    assert tc.Store(root).verify() == expect
    for n, o in objs.items():
        assert tc.fingerprint(tc.Store(root).load(n)) == tc.fingerprint(o)


def test_memory_store_with_lying_packs(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    url = "memory://redstore2-packs"
    g = torch.Generator().manual_seed(4)
    a = {"w": torch.randn(40, 40, generator=g), "v": torch.randn(300, generator=g)}
    tc.Store(url).save("a", a)
    (name,) = [p for p in fs.ls("/redstore2-packs/packs", detail=False) if p.endswith(".pack")]
    good = fs.cat(name)
    dv = digest_of(a["v"])
    # 1: the entry for v holds another tensor's blob (honest name)
    blobs = {}
    index_at, count = struct.unpack_from("<QQ", good, len(good) - 32)
    for i in range(count):
        d, o, n = struct.unpack_from("<16sQQ", good, index_at + 32 * i)
        blobs[d] = good[o : o + n]
    lying = pack_of([*((d, b) for d, b in blobs.items() if d != dv), (dv, raw_blob(torch.randn(300)))])
    fs.rm(name)
    fs.pipe(f"/redstore2-packs/packs/{xxhash.xxh3_128(lying).hexdigest()}.pack", lying)
    ours(lambda: tc.Store(url).load("a"), match=dv.hex())
    assert cli.main(["store", "verify", url]) == 1
    # 2: a trailer that lies (count huge): refused, kept by gc
    fs.rm(fs.ls("/redstore2-packs/packs", detail=False))
    bad = good[:-32] + struct.pack("<QQ8x8s", index_at, 1 << 40, PACK_MAGIC)
    bad_name = f"/redstore2-packs/packs/{xxhash.xxh3_128(bad).hexdigest()}.pack"
    fs.pipe(bad_name, bad)
    ours(lambda: tc.Store(url).load("a"))
    assert cli.main(["store", "verify", url]) == 1
    tc.Store(url).gc()
    assert fs.exists(bad_name)
    fs.rm("/redstore2-packs", recursive=True)


@pytest.mark.parametrize("damage", ["trailer", "blob_byte", "liar_twin", "missing_pack"])
def test_cli_on_a_store_with_a_damaged_pack(tmp_path, capsys, damage):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    dv = digest_of(a["v"])
    if damage == "trailer":
        data = bytearray(pack.read_bytes())
        data[-20] ^= 0xFF
        pack.write_bytes(bytes(data))
    elif damage == "blob_byte":
        data = bytearray(pack.read_bytes())
        blob = read_pack(pack)[dv]
        data[bytes(data).index(blob) + len(blob) - 3] ^= 1
        pack.write_bytes(bytes(data))
    elif damage == "liar_twin":
        drop_blob(root, dv)
        put_pack(root, pack_of([(dv, raw_blob(torch.randn(300)))]))
    else:
        pack.unlink()
    code, text = cli_run(capsys, "verify", root)
    assert code == 1, text
    code, text = cli_run(capsys, "verify", root, "a")
    assert code == 1, text
    out = tmp_path / "out.safetensors"
    code, text = cli_run(capsys, "export", root, "a", out)
    assert code in (1, 2) and not out.exists(), text
    code, text = cli_run(capsys, "ls", root)
    assert code in (0, 1), text
    code, text = cli_run(capsys, "stats", root)  # (a pack it cannot read: an error naming it)
    assert code in (0, 1, 2), text
    code, text = cli_run(capsys, "gc", root)
    assert code in (0, 1, 2), text
    code, text = cli_run(capsys, "verify", root)
    assert code == 1, text  # gc hid nothing


# ------------------------------------------------------------------ more readers: mmap, cached indexes, re-saves

@pytest.mark.parametrize("how", ["other_tensor", "delta_sub"])
def test_mmap_load_of_a_lying_or_delta_blob_in_a_pack(tmp_path, how):
    g = torch.Generator().manual_seed(21)
    base = torch.randn(30, 30, generator=g)
    t = base + 1e-6 * torch.randn(30, 30, generator=g)
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    if how == "other_tensor":
        replace_blob(root, digest_of(t), raw_blob(torch.randn(30, 30)))
        ours(lambda: tc.Store(root).load("a", mmap=True), match=digest_of(t).hex())
    else:
        replace_blob(root, digest_of(t), delta_sub_blob(t, base))
        assert raw_bytes(tc.Store(root).load("a", mmap=True)["x"]) == raw_bytes(t)


def test_a_pack_truncated_or_replaced_under_a_store_object_that_read_its_index(tmp_path):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    good = pack.read_bytes()
    s = tc.Store(root)
    assert tc.fingerprint(s.load("a")) == tc.fingerprint(a)  # the index is now known to s
    pack.write_bytes(good[: len(good) // 2])
    ours(lambda: s.load("a"))
    # same size, other bytes: every blob a lie to the cached index
    pack.write_bytes(bytes(64) + good[64:][::-1][: len(good) - 64])
    ours(lambda: s.load("a"))
    ours(lambda: s.verify())
    pack.write_bytes(good)
    assert tc.fingerprint(s.load("a")) == tc.fingerprint(a)


def test_blobs_of_a_refused_pack_are_written_again_by_a_save(tmp_path):
    root, a = two_tensor_store(tmp_path)
    (pack,) = (root / "packs").glob("*.pack")
    data = bytearray(pack.read_bytes())
    data[-9] ^= 1  # the trailer's magic
    pack.write_bytes(bytes(data))
    ours(lambda: tc.Store(root).load("a"))
    a2 = {**a, "extra": torch.randn(77)}  # (the same blobs and one more: a pack of another name)
    tc.Store(root).save("a2", a2)  # a's blobs count as absent: written again
    assert tc.fingerprint(tc.Store(root).load("a2")) == tc.fingerprint(a2)
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)  # a's rows find the new copies
    assert cli.main(["store", "verify", str(root)]) == 1  # the refused pack is still reported
    tc.Store(root).gc()
    assert pack.exists()


def test_the_writer_never_takes_a_base_of_another_dtype_or_shape(tmp_path):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(64, 64, generator=g)
    objs = [{"x": w}, {"x": (w + 1e-6).view(torch.int32)}, {"x": (w + 2e-6).reshape(4096)},
            {"x": (w + 3e-6).to(torch.float16).view(torch.int16).reshape(64, 64)}, {"x": w + 4e-6}]
    root = tmp_path / "d"
    s = tc.Store(root)
    for i, o in enumerate(objs):
        s.save(f"t{i}", o)
    for i, o in enumerate(objs):
        got = tc.Store(root).load(f"t{i}")["x"]
        assert got.dtype == o["x"].dtype and got.shape == o["x"].shape
        assert raw_bytes(got) == raw_bytes(o["x"])
    assert cli.main(["store", "verify", str(root)]) == 0


def test_a_layout_1_marker_over_packs_is_still_read_and_upgraded_by_a_save(tmp_path):
    root, a = two_tensor_store(tmp_path)
    (root / "tensorcanon-store").write_bytes(b"tensorcanon-store layout 1\n")
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)
    tc.Store(root).save("b", {"y": torch.randn(500)})
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 2\n"


@pytest.mark.parametrize("text", [b"tensorcanon-store layout 2", b"tensorcanon-store layout 2\n\n",
                                  b"tensorcanon-store layout 3\n", b"tensorcanon-store layout 0\n",
                                  b"tensorcanon-store layout 2\r\n", b"\xef\xbb\xbftensorcanon-store layout 2\n",
                                  b"tensorcanon-store layout \x00\n", b""])
def test_markers_that_are_almost_layout_2(tmp_path, text, capsys):
    root, a = two_tensor_store(tmp_path)
    (root / "tensorcanon-store").write_bytes(text)
    for call in (lambda: tc.Store(root).load("a"), lambda: tc.Store(root).verify(), lambda: tc.Store(root).gc(),
                 lambda: tc.Store(root).save("c", {"x": torch.randn(99)}), lambda: tc.Store(root).tags()):
        ours(call)
    assert (root / "tensorcanon-store").read_bytes() == text  # nobody "repaired" it
    assert len(list((root / "packs").glob("*.pack"))) == 1
    for action in ("verify", "gc", "ls", "stats"):
        code, _ = cli_run(capsys, action, root)
        assert code == 2, action


def test_a_tensor_that_changes_dtype_but_not_size_is_still_loadable(tmp_path):
    """float32 -> int32 of the same shape: a delta against the float32 blob would be a blob whose base
    has another prefix, which every reader refuses (the writer must not write it)."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    root = tmp_path / "d"
    s = tc.Store(root)
    s.save("f", {"x": w})
    s.save("i", {"x": (w + 1e-6).view(torch.int32)})
    assert raw_bytes(tc.Store(root).load("i")["x"]) == raw_bytes((w + 1e-6).view(torch.int32))
    assert cli.main(["store", "verify", str(root)]) == 0


def test_gc_keeps_the_base_of_an_honest_delta_when_a_lying_copy_names_none(tmp_path):
    """Blob x1 (a delta against x0) is held honestly, and by a second, lying copy (a raw blob of
    another tensor, under x1's digest) that sorts first. gc must keep the bases every copy needs:
    following the liar's header alone, it deletes x0, and the honest x1 can never load again."""
    g = torch.Generator().manual_seed(31)
    x0 = torch.randn(64, 64, generator=g)
    x1 = x0 + 1e-6 * torch.randn(64, 64, generator=g)
    root = tmp_path / "k"
    s = tc.Store(root)
    s.save("t0", {"x": x0})
    s.save("t1", {"x": x1})
    d1 = digest_of(x1)
    (honest,) = [p for p, _ in [all_packed(root)[d1]]]
    assert struct.unpack_from("<B", all_packed(root)[d1][1], 8)[0] in (DELTA, DELTA_SUB)
    for seed in range(1000):
        lie = pack_of([(d1, raw_blob(torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))))])
        if xxhash.xxh3_128(lie).hexdigest() < honest.stem:
            break
    liar = put_pack(root, lie)
    tc.Store(root).delete("t0")
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    assert cli.main(["store", "verify", str(root)]) == 1  # the liar is reported
    liar.unlink()
    assert raw_bytes(tc.Store(root).load("t1")["x"]) == raw_bytes(x1)
    assert cli.main(["store", "verify", str(root)]) == 0


def test_gc_never_drops_an_honest_packed_copy_for_a_lying_loose_one(tmp_path):
    """Blob v is held honestly in a small pack that gc merges, and by a lying loose copy: gc must not
    count the loose copy as the one that stays without checking it."""
    root, a = two_tensor_store(tmp_path)
    dv = digest_of(a["v"])
    lp = loose_path(root, dv)
    lp.parent.mkdir(parents=True, exist_ok=True)
    lp.write_bytes(raw_blob(torch.randn(300)))
    for i in range(8):
        tc.Store(root).save(f"n{i}", {"n": torch.randn(100) + i})
    try:
        tc.Store(root).gc()
    except tc.TensorCanonError:
        pass
    assert cli.main(["store", "verify", str(root)]) == 1  # the liar is reported
    lp.unlink()
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(a)
    assert cli.main(["store", "verify", str(root)]) == 0


@pytest.mark.parametrize("how", ["plane_short", "plane_long", "plane_codec_7", "table_reserved", "blob_short",
                                 "blob_long"])
def test_a_delta_sub_blob_whose_planes_lie(tmp_path, how):
    base = torch.randn(100)
    t = base + 1e-6
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    good = delta_sub_blob(t, base)
    h = len(head(DELTA_SUB, 1, prefix_of(t), 400, digest_of(base)))
    blob = bytearray(good)
    if how == "plane_short":
        struct.pack_into("<Q", blob, h + 8, 99)
    elif how == "plane_long":
        struct.pack_into("<Q", blob, h + 8, 101)
    elif how == "plane_codec_7":
        blob[h] = 7
    elif how == "table_reserved":
        blob[h + 3] = 1
    elif how == "blob_short":
        blob = blob[:-1]
    else:
        blob += b"\x00"
    replace_blob(root, digest_of(t), bytes(blob))
    ours(lambda: tc.Store(root).load("a"), match=digest_of(t).hex())
    assert cli.main(["store", "verify", str(root), "a"]) == 1


def test_a_delta_sub_whose_base_is_only_in_a_refused_pack_names_the_pack(tmp_path):
    base = torch.randn(100)
    t = base + 1e-6
    root = fresh(tmp_path, {"x": base}, "base")
    tc.Store(root).save("a", {"x": t})
    replace_blob(root, digest_of(t), delta_sub_blob(t, base), "loose")
    db = digest_of(base)
    drop_blob(root, db)
    bad = put_pack(root, pack_of([(db, raw_blob(base))]))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    text = ours(lambda: tc.Store(root).load("a"), match=db.hex())
    assert bad.name in text  # the pack that may hold it, and why it could not be read
