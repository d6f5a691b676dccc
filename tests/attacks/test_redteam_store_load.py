"""Red-team pass on `Store.load` (and `verify`, `export`) after the load changes: blobs decoded
straight into the returned tensors on two threads, shared delta bases decoded once, and a walk of
every delta chain's headers before decoding (docs/STORE.md "Threads", "Shared bases", "What a reader
checks", "Layout"). Every damaged store is built from real saves, edited as the layout describes."""

import base64
import contextlib
import io
import json
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

import tensorcanon as tc
from tensorcanon.tools import cli

from hostile_lib import deadline  # (a hang fails the test: tests/fuzz/hostile_lib.py)

MAGIC = b"tcstore\x01"
PACK_MAGIC = b"tcspack\x02"


# ---------------------------------------------------------------- helpers (layout only)

def run_threads(work, args):
    """``work(*a)`` for each ``a`` of ``args``, each on a thread of its own, all at once; a hang fails."""
    threads = [threading.Thread(target=work, args=a) for a in args]
    with deadline():
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def prefix_of(t):
    name = str(t.dtype).removeprefix("torch.")
    return f"{name}[{','.join(map(str, t.shape))}]".encode()


def digest_of(t):
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return xxhash.xxh3_128(prefix_of(t) + data).hexdigest()


def loose_path(root, hexd):
    return Path(root) / "blobs" / "xxh3-128" / hexd[:2] / hexd


def unpack_all(root):
    """Move every packed blob to its loose place and delete the packs (a blob may be held loose)."""
    for pack in sorted((Path(root) / "packs").glob("*.pack")):
        data = pack.read_bytes()
        index_at, count = struct.unpack_from("<QQ", data, len(data) - 32)
        for i in range(count):
            raw, off, length = struct.unpack_from("<16sQQ", data, index_at + 32 * i)
            p = loose_path(root, raw.hex())
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.exists():
                p.write_bytes(data[off:off + length])
        pack.unlink()


def write_pack(root, entries):
    """A pack per docs/STORE.md "Packs": entries are (digest hex, blob bytes, place) where place
    is None (its own bytes) or the digest hex of an earlier entry whose bytes it points at."""
    body = bytearray(PACK_MAGIC + bytes(56))
    where = {}
    index = []
    for hexd, blob, place in entries:
        if place is None:
            body += bytes(-len(body) % 64)
            where[hexd] = (len(body), len(blob))
            body += blob
        index.append((bytes.fromhex(hexd), *where[place or hexd]))
    body += bytes(-len(body) % 64)
    index_at = len(body)
    for raw, off, length in sorted(index):
        body += struct.pack("<16sQQ", raw, off, length)
    body += struct.pack("<QQ", index_at, len(index)) + bytes(8) + PACK_MAGIC
    (Path(root) / "packs").mkdir(exist_ok=True)
    name = xxhash.xxh3_128(bytes(body)).hexdigest()
    (Path(root) / "packs" / f"{name}.pack").write_bytes(bytes(body))


def header(blob):
    assert blob[:8] == MAGIC
    codec, depth, plen, size = struct.unpack_from("<BBHQ", blob, 8)
    prefix = blob[20:20 + plen]
    base = blob[20 + plen:36 + plen].hex() if codec in (3, 4, 5) else None
    return {"codec": codec, "depth": depth, "plen": plen, "size": size, "prefix": prefix, "base": base}


def set_base(blob, base_hex):
    h = header(blob)
    at = 20 + h["plen"]
    return blob[:at] + bytes.fromhex(base_hex) + blob[at + 16:]


def set_depth(blob, depth):
    return blob[:9] + bytes([depth]) + blob[10:]


def payload_at(blob):
    h = header(blob)
    end = 20 + h["plen"] + (16 if h["base"] else 0)
    return end + (-end % 64)


def flip(blob, at):
    b = bytearray(blob)
    b[at] ^= 0x5A
    return bytes(b)


def bumped(t, by):
    """`t` with every element moved by `by` units in the last place: a delta-sub's favourite."""
    return (t.view(torch.int32) + by).view(torch.float32)


def base_tensor(seed=0, n=4096):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def chain_store(tmp_path, steps=3):
    """Tags t0..t{steps-1} of one tensor `w`, each one ulp from the last: a chain of deltas."""
    root = tmp_path / "chain"
    st = tc.Store(root)
    ws = [bumped(base_tensor(), i) for i in range(steps)]
    for i, w in enumerate(ws):
        st.save(f"t{i}", {"w": w})
    unpack_all(root)
    ds = [digest_of(w) for w in ws]
    heads = [header(loose_path(root, d).read_bytes()) for d in ds]
    assert heads[0]["depth"] == 0
    for i in range(1, steps):
        assert heads[i]["codec"] in (3, 4, 5) and heads[i]["base"] == ds[i - 1], heads[i]
        assert heads[i]["depth"] == i
    return root, ws, ds


def shared_store(tmp_path, b_shape=(4096,)):
    """Tag `old` holds X twice (as `a`, and as `b` of shape `b_shape`); tag `new` holds X+1 and
    X+2: two distinct deltas, both naming a base of `old` (the same one where the shapes agree)."""
    root = tmp_path / "shared"
    st = tc.Store(root)
    x = base_tensor(1)
    st.save("old", {"a": x, "b": x.clone().reshape(b_shape)})
    new = {"a": bumped(x, 1), "b": bumped(x, 2).reshape(b_shape)}
    st.save("new", new)
    unpack_all(root)
    da, db = digest_of(new["a"]), digest_of(new["b"])
    ha, hb = (header(loose_path(root, d).read_bytes()) for d in (da, db))
    assert ha["base"] == digest_of(x) and hb["base"] == digest_of(x.reshape(b_shape)), (ha, hb)
    return root, x, new, da, db


def rewrite(root, hexd, fn):
    p = loose_path(root, hexd)
    p.write_bytes(fn(p.read_bytes()))


def verify_code(root, *tag):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return cli.main(["store", "verify", str(root), *tag])


def left_behind(before):
    """Threads started since ``before`` still alive after a short wait, except the workers of the
    store's process-wide pools (started once, idle between loads: close() waits for its jobs)."""
    for _ in range(100):
        left = [t for t in threading.enumerate() if t not in before
                and not t.name.startswith(("tensorcanon-store-load", "tensorcanon-store-save"))]
        if not left:
            break
        time.sleep(0.02)
    return left


def refused(root, tag, path=None, exc=tc.TensorCanonError):
    """load, verify and export of `tag` all refuse, naming the tag (and the tensor's path); the
    CLI's verify exits 1 (damage) for the tag and for the whole store; no thread is left behind."""
    before = set(threading.enumerate())
    st = tc.Store(root)
    with deadline():
        with pytest.raises(exc) as e:
            st.load(tag, map_location="cpu")
        msg = str(e.value)
        assert tag in msg, msg
        if path is not None:
            assert path in msg, msg
        for how in ({"map_location": "meta"}, {"mmap": True}):  # (meta: read through the file's reader)
            with pytest.raises(exc) as e:
                st.load(tag, **how)
            assert tag in str(e.value) and (path is None or path in str(e.value)), (how, str(e.value))
        with pytest.raises(exc) as e:
            st.verify(tag)
        assert tag in str(e.value), str(e.value)
        with pytest.raises(exc) as e:
            st.export(tag, Path(root).parent / "out.safetensors")
        assert tag in str(e.value) and (path is None or path in str(e.value)), str(e.value)
        assert not (Path(root).parent / "out.safetensors").exists()
        assert verify_code(root, tag) == 1
        assert verify_code(root) == 1
    assert not left_behind(before)
    return msg


# ---------------------------------------------------------------- sound stores first

def test_the_helpers_read_a_sound_chain(tmp_path):
    root, ws, ds = chain_store(tmp_path)
    st = tc.Store(root)
    for i, w in enumerate(ws):
        assert torch.equal(st.load(f"t{i}")["w"], w)
    assert verify_code(root) == 0


def test_a_sound_shared_base_loads_both_users(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    got = tc.Store(root).load("new")
    assert torch.equal(got["a"], new["a"]) and torch.equal(got["b"], new["b"])
    assert got["a"].data_ptr() != got["b"].data_ptr()
    assert verify_code(root) == 0


# ---------------------------------------------------------------- chains that loop or lie

def test_a_delta_naming_itself_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    rewrite(root, ds[1], lambda b: set_base(b, ds[1]))
    refused(root, "t1", '["w"]')


def test_a_delta_naming_itself_with_any_depth_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    rewrite(root, ds[1], lambda b: set_depth(set_base(b, ds[1]), 64))
    refused(root, "t1", '["w"]')


def test_two_deltas_naming_each_other_are_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 3)
    # t1's delta now names t2's delta, which names t1's: A -> B -> A
    rewrite(root, ds[1], lambda b: set_base(b, ds[2]))
    refused(root, "t2", '["w"]')
    refused(root, "t1", '["w"]')


def test_a_loop_whose_depths_fall_then_wrap_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 3)
    rewrite(root, ds[1], lambda b: set_depth(set_base(b, ds[2]), 3))
    refused(root, "t2", '["w"]')


@pytest.mark.parametrize("depth", [0, 2, 65, 255])
def test_a_depth_that_does_not_match_the_chain_is_refused(tmp_path, depth):
    root, ws, ds = chain_store(tmp_path, 2)
    rewrite(root, ds[1], lambda b: set_depth(b, depth))
    refused(root, "t1", '["w"]')


def test_a_base_whose_prefix_differs_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    st = tc.Store(root)
    other = ws[0].view(torch.int32).clone()  # same bytes, other dtype: a sound blob of int32[4096]
    st.save("other", {"o": other})
    unpack_all(root)
    # put the int32 blob in the place of t1's base
    loose_path(root, ds[0]).write_bytes(loose_path(root, digest_of(other)).read_bytes())
    refused(root, "t1", '["w"]')


def test_a_base_of_another_shape_named_by_a_delta_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    st = tc.Store(root)
    other = ws[0].reshape(64, 64).clone()
    st.save("other", {"o": other})
    unpack_all(root)
    rewrite(root, ds[1], lambda b: set_base(b, digest_of(other)))
    refused(root, "t1", '["w"]')


def test_a_missing_base_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    loose_path(root, ds[0]).unlink()
    refused(root, "t1", '["w"]')


# ---------------------------------------------------------------- shared bases

def test_a_damaged_shared_base_is_refused_by_both_users(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    base = digest_of(x)
    rewrite(root, base, lambda b: flip(b, len(b) - 7))
    msg = refused(root, "new", '["a"]')
    assert '["b"]' not in msg or msg.index('["a"]') < msg.index('["b"]')
    refused(root, "old", '["a"]')


def test_a_shared_base_that_lies_is_refused(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    st = tc.Store(root)
    liar = bumped(x, 7)  # same dtype and shape, other bytes: a sound blob of another tensor
    st.save("liar", {"l": liar})
    unpack_all(root)
    loose_path(root, digest_of(x)).write_bytes(loose_path(root, digest_of(liar)).read_bytes())
    refused(root, "new", '["a"]')


def test_a_pack_pointing_the_shared_base_at_another_blob_is_refused(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    base = digest_of(x)
    liar = bumped(x, 7)
    tc.Store(root).save("liar", {"l": liar})
    unpack_all(root)
    liar_blob = loose_path(root, digest_of(liar)).read_bytes()
    loose_path(root, base).unlink()
    # a pack whose index names the liar's bytes as the base (a blob placed once, named twice)
    write_pack(root, [(digest_of(liar), liar_blob, None), (base, None, digest_of(liar))])
    refused(root, "new", '["a"]')
    # and a pack holding the liar's bytes, sound and alone, under the base's name
    for p in (root / "packs").glob("*.pack"):
        p.unlink()
    write_pack(root, [(base, liar_blob, None)])
    refused(root, "new", '["a"]')


def test_a_shared_base_named_by_users_of_another_shape_is_refused(tmp_path):
    """`b` is float32[64,64] in both tags; its delta is made to name `a`'s base (float32[4096]),
    which `a`'s delta names too: decoded once for `a`, it must not be handed to `b`."""
    root, x, new, da, db = shared_store(tmp_path, b_shape=(64, 64))
    rewrite(root, db, lambda b: set_base(b, digest_of(x)))
    refused(root, "new", '["b"]')


def test_a_shared_base_whose_users_claim_other_sizes_is_refused(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)

    def shrink(b):
        h = header(b)
        return b[:12] + struct.pack("<Q", h["size"] // 2) + b[20:]
    rewrite(root, db, shrink)
    refused(root, "new", '["b"]')


def test_a_shared_base_damaged_in_its_payload_after_a_sound_header(tmp_path):
    """The chain walk reads only headers: they read fine, the bytes below do not decode."""
    root, x, new, da, db = shared_store(tmp_path)
    base = digest_of(x)
    rewrite(root, base, lambda b: flip(b, payload_at(b) + 3))
    refused(root, "new", '["a"]')


def test_a_delta_damaged_in_its_payload_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 3)
    rewrite(root, ds[2], lambda b: flip(b, len(b) - 1))
    refused(root, "t2", '["w"]')
    rewrite(root, ds[2], lambda b: flip(b, len(b) - 1))  # restored
    rewrite(root, ds[1], lambda b: flip(b, payload_at(b) + 1))
    refused(root, "t2", '["w"]')


def test_a_truncated_base_is_refused(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    rewrite(root, digest_of(x), lambda b: b[: len(b) - 10])
    refused(root, "new", '["a"]')


def test_many_users_of_one_damaged_base_all_refuse_and_order_holds(tmp_path):
    root = tmp_path / "many"
    st = tc.Store(root)
    x = base_tensor(3)
    st.save("old", {f"k{i}": x.clone() for i in range(8)})
    st.save("new", {f"k{i}": bumped(x, i + 1) for i in range(8)})
    unpack_all(root)
    rewrite(root, digest_of(x), lambda b: flip(b, len(b) - 3))
    for _ in range(5):
        msg = refused(root, "new", '["k0"]')
        assert '["k1"]' not in msg


# ---------------------------------------------------------------- sizes claimed

def test_a_raw_blob_claiming_a_huge_size_is_refused_before_allocation(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    n = 1 << 40
    prefix = f"float32[{n}]".encode()
    blob = MAGIC + struct.pack("<BBHQ", 0, 0, len(prefix), 4 * n) + prefix
    blob += bytes(-len(blob) % 64) + bytes(64)
    loose_path(root, ds[0]).write_bytes(blob)
    refused(root, "t1", '["w"]')
    refused(root, "t0", '["w"]')


def test_a_zstd_blob_claiming_a_huge_size_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    zstd = pytest.importorskip("zstandard")
    n = 1 << 34
    prefix = b"float32[4096]"
    frame = zstd.ZstdCompressor(level=1).compress(bytes(16384))
    # the frame's own content size says 16384; the header says 4 * 2**34
    blob = MAGIC + struct.pack("<BBHQ", 1, 0, len(prefix), 4 * n) + prefix
    blob += bytes(-len(blob) % 64) + frame
    loose_path(root, ds[0]).write_bytes(blob)
    refused(root, "t1", '["w"]')


def test_a_delta_plane_claiming_a_huge_length_is_refused(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)

    def lie(b):
        at = payload_at(b)
        return b[:at + 8] + struct.pack("<Q", 1 << 60) + b[at + 16:]
    rewrite(root, ds[1], lie)
    refused(root, "t1", '["w"]')


# ---------------------------------------------------------------- errors in tensor order

def test_errors_come_in_tensor_order(tmp_path):
    root = tmp_path / "order"
    st = tc.Store(root)
    ts = {f"t{i}": base_tensor(10 + i) * (i + 1) for i in range(6)}
    st.save("tag", ts)
    unpack_all(root)
    for name in ("t5", "t3", "t2"):
        rewrite(root, digest_of(ts[name]), lambda b: flip(b, len(b) - 2))
    for _ in range(5):
        msg = refused(root, "tag", '["t2"]')
        assert '["t3"]' not in msg and '["t5"]' not in msg


# ---------------------------------------------------------------- kinds of tensors

def kinds(step):
    g = torch.Generator().manual_seed(5)
    big = torch.randn(64, 96, generator=g)
    return {
        "bf16": (torch.randn(4096, generator=g) + step).to(torch.bfloat16),
        "bool": torch.rand(5000, generator=g) > 0.5,
        "c64": torch.randn(1024, dtype=torch.complex64, generator=g) + step,
        "c128": torch.randn(512, dtype=torch.complex128, generator=g) + step,
        "empty": torch.zeros(0, 7),
        "t": (big + step).t(),                # saved non-contiguous
        "i8": torch.arange(3000, dtype=torch.int8) + step,
        "f64": torch.randn(2000, dtype=torch.float64, generator=g) + step,
        "scalar": torch.tensor(3.5 + step),
    }


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("how", [{}, {"map_location": "cpu"}, {"mmap": True}, {"map_location": "cpu", "mmap": True}])
def test_kinds_of_tensors_load_through_deltas(tmp_path, how):
    root = tmp_path / "kinds"
    st = tc.Store(root)
    for step in range(3):
        st.save(f"s{step}", kinds(step))
    st = tc.Store(root)
    for step in range(3):
        got = st.load(f"s{step}", **how)
        want = kinds(step)
        assert got.keys() == want.keys()
        for k in want:
            assert same(got[k], want[k]), k
        out = tmp_path / f"s{step}.safetensors"
        st.export(f"s{step}", out)
        ref = tmp_path / f"ref{step}.safetensors"
        tc.save(want, ref)
        assert out.read_bytes() == ref.read_bytes()
    assert verify_code(root) == 0


def test_kinds_of_tensors_load_to_meta(tmp_path):
    root = tmp_path / "kinds"
    st = tc.Store(root)
    for step in range(2):
        st.save(f"s{step}", kinds(step))
    got = tc.Store(root).load("s1", map_location="meta")
    for k, v in kinds(1).items():
        assert got[k].device.type == "meta" and got[k].dtype == v.dtype and got[k].shape == v.shape, k


def test_a_damaged_blob_under_meta_or_mmap_is_refused(tmp_path):
    root = tmp_path / "kinds"
    st = tc.Store(root)
    for step in range(2):
        st.save(f"s{step}", kinds(step))
    unpack_all(root)
    k0, k1 = kinds(0), kinds(1)
    rewrite(root, digest_of(k1["bf16"]), lambda b: flip(b, len(b) - 1))
    st = tc.Store(root)
    for how in ({"mmap": True}, {"map_location": "cpu", "mmap": True}):
        with deadline(), pytest.raises(tc.TensorCanonError, match=r"s1"):
            st.load("s1", **how)
    # a raw blob viewed in place is hashed first
    rewrite(root, digest_of(k0["bool"]), lambda b: flip(b, len(b) - 1))
    with deadline(), pytest.raises(tc.TensorCanonError, match=r"s0"):
        st.load("s0", mmap=True)


def test_a_device_string_the_machine_lacks_is_a_usage_error(tmp_path):
    root, ws, ds = chain_store(tmp_path, 2)
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has the device")
    before = set(threading.enumerate())
    with deadline(), pytest.raises(tc.TensorCanonError):
        tc.Store(root).load("t1", map_location="cuda:0")
    assert not left_behind(before)


# ---------------------------------------------------------------- threads

def test_concurrent_loads_of_one_store_object(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    st = tc.Store(root)
    results, errors = [], []

    def work():
        try:
            for _ in range(10):
                results.append(st.load("new"))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    run_threads(work, [(), ()])
    assert not errors, errors
    assert len(results) == 20
    for r in results:
        assert torch.equal(r["a"], new["a"]) and torch.equal(r["b"], new["b"])


def test_concurrent_loads_of_a_damaged_store_both_refuse(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    rewrite(root, digest_of(x), lambda b: flip(b, len(b) - 7))
    st = tc.Store(root)
    errors = []

    def work():
        for _ in range(5):
            try:
                st.load("new")
                errors.append("loaded")
            except tc.TensorCanonError as e:
                errors.append(e)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(("foreign", e))
    run_threads(work, [(), ()])
    assert len(errors) == 10 and all(isinstance(e, tc.TensorCanonError) for e in errors), errors


# ---------------------------------------------------------------- no wrong answer

def test_returned_tensors_never_share_memory(tmp_path):
    """Blobs decode straight into the returned tensors, delta bases into reused buffers: no two
    tensors of a load (nor of two loads) may alias, or writing one would change another."""
    root = tmp_path / "alias"
    st = tc.Store(root)
    x = base_tensor(4)
    st.save("old", {"a": x, "b": x.clone(), "c": x.clone()})
    st.save("new", {"a": bumped(x, 1), "b": bumped(x, 1), "c": bumped(x, 2), "d": bumped(x, 1)})
    st = tc.Store(root)
    one, two = st.load("new"), st.load("new")
    got = list(one.values()) + list(two.values())
    ptrs = [t.untyped_storage().data_ptr() for t in got]
    assert len(set(ptrs)) == len(ptrs)
    for t in got:
        t.add_(1)
    again = st.load("new")
    assert torch.equal(again["a"], bumped(x, 1)) and torch.equal(again["c"], bumped(x, 2))


def test_a_lying_packed_copy_beside_a_sound_loose_one_is_never_loaded(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    liar = bumped(x, 9)
    tc.Store(root).save("liar", {"l": liar})
    unpack_all(root)
    liar_blob = loose_path(root, digest_of(liar)).read_bytes()
    write_pack(root, [(digest_of(x), liar_blob, None)])  # the base held twice: loose (sound), packed (lying)
    with deadline():
        try:
            got = tc.Store(root).load("new")
        except tc.TensorCanonError as e:
            assert "new" in str(e)
        else:
            assert torch.equal(got["a"], new["a"]) and torch.equal(got["b"], new["b"])
        assert verify_code(root) == 1


def test_concurrent_load_verify_and_export_of_one_store_object(tmp_path):
    root, ws, ds = chain_store(tmp_path, 4)
    st = tc.Store(root)
    errors = []

    def work(k):
        try:
            for i in range(4):
                if k == 0:
                    assert torch.equal(st.load(f"t{i}")["w"], ws[i])
                elif k == 1:
                    assert st.verify(f"t{i}") == tc.fingerprint({"w": ws[i]})
                else:
                    st.export(f"t{i}", tmp_path / f"e{i}.safetensors")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    run_threads(work, [(k,) for k in range(3)])
    assert not errors, errors
    for i in range(4):
        assert tc.verify(tmp_path / f"e{i}.safetensors") == tc.fingerprint({"w": ws[i]})


def forged_bool_store(tmp_path, codec):
    """Tag `b` of a store whose bool tensor `m` has a blob (of `codec`: 1 zstd, 0 raw) holding a
    byte 2, named by the digest of those bytes, which its record (edited) names."""
    zstd = pytest.importorskip("zstandard")
    root = tmp_path / "bool"
    st = tc.Store(root)
    m = torch.zeros(5000, dtype=torch.bool)
    st.save("b", {"m": m, "z": torch.zeros(10)})
    rec_path = root / "tags" / "b.safetensors"
    rec = tc.load(rec_path)
    bad = bytearray(5000)
    bad[17] = 2
    old_hex = digest_of(m)
    new_hex = xxhash.xxh3_128(b"bool[5000]" + bytes(bad)).hexdigest()
    # the manifest (base64 of msgpack, FORMAT.md §5) holds the raw tensor digest; the file digest
    # (§7.2) is that of the manifest bytes: both rewritten, as a liar would
    head = rec["header"]
    text = json.loads(head[8:])["__metadata__"]
    manifest = base64.b64decode(text["tensorcanon.manifest"])
    assert manifest.count(bytes.fromhex(old_hex)) == 1
    forged = manifest.replace(bytes.fromhex(old_hex), bytes.fromhex(new_hex))
    new_text = base64.b64encode(forged).decode()
    assert len(new_text) == len(text["tensorcanon.manifest"])
    head = head.replace(text["tensorcanon.manifest"].encode(), new_text.encode())
    head = head.replace(text["tensorcanon.digest"].encode(), f"xxh3-128:{xxhash.xxh3_128(forged).hexdigest()}".encode())
    rec["header"] = head
    rec_path.unlink()
    tc.save(rec, rec_path)
    prefix = b"bool[5000]"
    blob = MAGIC + struct.pack("<BBHQ", codec, 0, len(prefix), 5000) + prefix
    blob += bytes(-len(blob) % 64) + (zstd.ZstdCompressor(level=1).compress(bytes(bad)) if codec else bytes(bad))
    p = loose_path(root, new_hex)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(blob)
    return root


@pytest.mark.parametrize("codec", [1, 0])
def test_a_bool_blob_holding_a_2_is_refused_by_load(tmp_path, codec):
    """The digest holds; the bool check must not be skipped by decoding into the tensor (zstd) or
    by viewing the blob in place (raw, mmap)."""
    root = forged_bool_store(tmp_path, codec)
    for how in ({}, {"map_location": "cpu"}, {"mmap": True}):
        with deadline(), pytest.raises(tc.TensorCanonError) as e:
            tc.Store(root).load("b", **how)
        assert "other than 0 or 1" in str(e.value) and "$[\"m\"]" in str(e.value), str(e.value)


@pytest.mark.parametrize("codec", [1, 0])
def test_a_forged_bool_blob_is_refused_by_verify_and_export(tmp_path, codec):
    """A store that `load` refuses must not verify (FORMAT.md §9.3 item 2: bool bytes are 0 or 1),
    and `export` must not write a file that `tensorcanon.load` refuses (zstd and raw blobs)."""
    root = forged_bool_store(tmp_path, codec)
    with pytest.raises(tc.FormatError, match=r"tag 'b'.*other than 0 or 1"):
        tc.Store(root).verify("b")
    with pytest.raises(tc.FormatError, match=r"tag 'b', tensor \$\[\"m\"\].*other than 0 or 1"):
        tc.Store(root).export("b", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert verify_code(root) == 1


@pytest.mark.parametrize("big", [False, True])
def test_a_file_whose_bool_tensor_holds_a_2_does_not_verify(tmp_path, big):
    """The tag's file (its record's header, then its tensors' bytes): `tensorcanon.verify` must
    refuse it as `tensorcanon.load` does, read from a path, mapped, or streamed; small and large
    (a large file is hashed on two threads)."""
    n = (64 << 20) if big else 5000
    m = torch.zeros(n, dtype=torch.bool)
    tc.save({"m": m}, tmp_path / "good.safetensors")
    raw = bytearray((tmp_path / "good.safetensors").read_bytes())
    head = bytes(raw[: 8 + struct.unpack_from("<Q", raw)[0]])
    bad = bytearray(n)
    bad[n // 3] = 2
    meta = json.loads(head[8:])["__metadata__"]
    manifest = base64.b64decode(meta["tensorcanon.manifest"])
    forged = manifest.replace(bytes.fromhex(digest_of(m)),
                              xxhash.xxh3_128(f"bool[{n}]".encode() + bytes(bad)).digest())
    head = head.replace(meta["tensorcanon.manifest"].encode(), base64.b64encode(forged))
    head = head.replace(meta["tensorcanon.digest"].encode(),
                        f"xxh3-128:{xxhash.xxh3_128(forged).hexdigest()}".encode())
    path = tmp_path / "bad.safetensors"
    path.write_bytes(head + bytes(bad))
    del raw, bad
    with pytest.raises(tc.FormatError, match="other than 0 or 1"):
        tc.load(path)
    with pytest.raises(tc.FormatError, match="other than 0 or 1"):
        tc.verify(path)
    with pytest.raises(tc.FormatError, match="other than 0 or 1"):
        tc.verify(path.read_bytes())
    with open(path, "rb") as f, pytest.raises(tc.FormatError, match="other than 0 or 1"):
        tc.verify(io.BufferedReader(io.BytesIO(f.read())))


def test_a_missing_shared_base_is_refused(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    loose_path(root, digest_of(x)).unlink()
    refused(root, "new", '["a"]')


def test_a_shared_base_whose_second_user_claims_another_depth_is_refused(tmp_path):
    root, x, new, da, db = shared_store(tmp_path)
    rewrite(root, db, lambda b: set_depth(b, 2))
    refused(root, "new", '["b"]')
    rewrite(root, db, lambda b: set_depth(b, 1))
    rewrite(root, da, lambda b: set_depth(b, 2))
    refused(root, "new", '["a"]')


@pytest.mark.parametrize("damaged", [False, True])
def test_shared_bases_over_their_budget_are_decoded_by_each_user(tmp_path, monkeypatch, damaged):
    """docs/STORE.md: beyond the bound on shared bases each user decodes its base on its own
    (the bound lowered here so that a small store reaches it)."""
    from tensorcanon.store import tagfile
    monkeypatch.setattr(tagfile, "SHARED_BASES", 1)
    root, x, new, da, db = shared_store(tmp_path)
    if damaged:
        rewrite(root, digest_of(x), lambda b: flip(b, len(b) - 7))
        refused(root, "new", '["a"]')
    else:
        got = tc.Store(root).load("new")
        assert torch.equal(got["a"], new["a"]) and torch.equal(got["b"], new["b"])


# ---------------------------------------------------------------- zstd frames that lie about their size

def forged_frame(payload, claim):
    """A zstd frame of `payload` whose header states `claim` as its content size (2-byte field)."""
    zstd = pytest.importorskip("zstandard")
    frame = bytearray(zstd.ZstdCompressor(level=1, write_checksum=False).compress(payload))
    fhd = frame[4]
    assert fhd >> 6 == 1 and fhd & 0x20 and not fhd & 0x03, hex(fhd)  # 2-byte size, single segment
    struct.pack_into("<H", frame, 5, claim - 256)
    return bytes(frame)


@pytest.mark.parametrize("actual", [20000, 10000])
def test_a_zstd_blob_whose_frame_decodes_to_another_size_is_refused(tmp_path, actual):
    """The frame states the size the blob's header claims, but decodes to more (or fewer) bytes:
    decoded straight into the tensor's memory, it must neither overrun it nor leave it half-filled."""
    root, ws, ds = chain_store(tmp_path, 1)
    prefix = b"float32[4096]"
    payload = bytes(range(256)) * (actual // 256) + bytes(actual % 256)
    blob = MAGIC + struct.pack("<BBHQ", 1, 0, len(prefix), 16384) + prefix
    blob += bytes(-len(blob) % 64) + forged_frame(payload, 16384)
    loose_path(root, ds[0]).write_bytes(blob)
    refused(root, "t0", '["w"]')


@pytest.mark.parametrize("actual", [5000, 3000])
def test_a_zstd_plane_that_decodes_to_another_size_is_refused(tmp_path, actual):
    root, ws, ds = chain_store(tmp_path, 1)
    prefix = b"float32[4096]"
    planes = [forged_frame(bytes([i]) * 7 + bytes(actual - 7), 4096) for i in range(4)]
    blob = MAGIC + struct.pack("<BBHQ", 2, 0, len(prefix), 16384) + prefix
    blob += bytes(-len(blob) % 64)
    for p in planes:
        blob += struct.pack("<B7xQ", 1, len(p))
    blob += b"".join(planes)
    loose_path(root, ds[0]).write_bytes(blob)
    refused(root, "t0", '["w"]')


def test_many_compressed_tensors_with_one_bad_at_either_end(tmp_path):
    """More tensors than the load decodes ahead: a bad last one is reached after the window moved
    on; a bad first one fails while the others are in flight; both name the tensor."""
    root = tmp_path / "many"
    st = tc.Store(root)
    ts = {f"p{i:02d}": base_tensor(100 + i) for i in range(24)}
    st.save("tag", ts)
    unpack_all(root)
    for name in ("p23", "p00"):
        rewrite(root, digest_of(ts[name]), lambda b: flip(b, len(b) - 5))
        refused(root, "tag", f'["{name}"]')
        rewrite(root, digest_of(ts[name]), lambda b: flip(b, len(b) - 5))
    got = tc.Store(root).load("tag")
    assert all(torch.equal(got[k], v) for k, v in ts.items())


def test_a_damaged_raw_blob_inside_a_pack_is_refused_under_mmap(tmp_path):
    """A raw blob of a local pack is viewed in place under `mmap=True`: hashed first."""
    root = tmp_path / "rawpack"
    st = tc.Store(root)
    r = torch.randint(0, 256, (20000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    st.save("r", {"r": r, "s": torch.arange(300)})
    (pack,) = (root / "packs").glob("*.pack")
    data = pack.read_bytes()
    index_at, count = struct.unpack_from("<QQ", data, len(data) - 32)
    entries = {struct.unpack_from("<16s", data, index_at + 32 * i)[0].hex():
               struct.unpack_from("<QQ", data, index_at + 32 * i + 16) for i in range(count)}
    off, length = entries[digest_of(r)]
    assert header(data[off:off + length])["codec"] == 0  # raw: random bytes
    pack.write_bytes(flip(data, off + length - 100))
    got = tc.Store(root)
    with deadline(), pytest.raises(tc.IntegrityError, match=r"tag 'r'"):
        got.load("r", mmap=True)
    assert verify_code(root) == 1


def test_verify_exit_2_on_what_is_not_a_store(tmp_path):
    assert verify_code(tmp_path / "nothing") == 2
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "tensorcanon-store").write_bytes(b"tensorcanon-store layout 9\n")
    assert verify_code(tmp_path / "notastore") == 2
