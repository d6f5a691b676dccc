"""The store's lossless codecs: chosen per tensor by content, exact for every dtype, delta chains bounded."""

import numpy as np
import pytest
import torch

import tensorcanon as tc
from tensorcanon.store import compress, layout, store as store_module


def codec_of(root, t):
    from tensorcanon.format import digest

    h = digest.tensor_hasher(str(t.dtype).removeprefix("torch."), tuple(t.shape))
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype.itemsize else b"")
    blob, header = tc.Store(root)._open_blob(h.digest())  # (loose, or in a pack)
    blob.close()
    return header


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.uint8, torch.int8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_codec_gives_back_the_exact_bytes(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(300, 257, generator=g, dtype=torch.float64)
    values = [base, base + 1e-6 * torch.randn(300, 257, generator=g, dtype=torch.float64),
              torch.zeros(300, 257, dtype=torch.float64)]
    store = tc.Store(tmp_path / "s")
    for i, v in enumerate(values):
        t = (v > 0) if dtype is torch.bool else (v * 1000).to(dtype) if not dtype.is_floating_point and \
            not dtype.is_complex else v.to(dtype)
        assert store.save(f"t{i}", {"t": t}) == tc.fingerprint({"t": t})
    for i in range(3):
        back = store.load(f"t{i}")["t"]
        assert back.dtype == dtype
    assert store.verify() and len(store.verify()) == 3


def test_the_choice_follows_the_content(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)   # incompressible
    zeros = torch.zeros(1 << 16)                                                # zstd
    floats = torch.randn(1 << 16, generator=g)                                  # exponents compress: grouped
    tiny = torch.arange(3.0)                                                    # too small to pay
    store.save("a", {"noise": noise, "zeros": zeros, "floats": floats, "tiny": tiny})
    assert codec_of(root, noise).codec == layout.RAW
    assert codec_of(root, zeros).codec == layout.ZSTD
    assert codec_of(root, floats).codec == layout.GROUPED
    assert codec_of(root, tiny).codec == layout.RAW
    moved = floats + 1e-4 * torch.randn(1 << 16, generator=g)                   # close to the last tag's
    store.save("b", {"noise": noise, "zeros": zeros, "floats": moved, "tiny": tiny})
    h = codec_of(root, moved)
    assert h.codec in layout.DELTAS and h.depth == 1 and h.base is not None
    assert h.base == _digest_of(floats)
    unrelated = torch.randn(1 << 16, generator=g)                               # XOR would not pay
    store.save("c", {"noise": noise, "zeros": zeros, "floats": unrelated, "tiny": tiny})
    assert codec_of(root, unrelated).codec == layout.GROUPED


def _digest_of(t):
    from tensorcanon.format import digest

    h = digest.tensor_hasher(str(t.dtype).removeprefix("torch."), tuple(t.shape))
    h.update(t.numpy().tobytes())
    return h.digest()


def test_delta_chains_are_bounded(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 15, generator=g)
    saved = []
    for i in range(2 * store_module.CHAIN + 3):
        w = w + 1e-5 * torch.randn(1 << 15, generator=g)
        saved.append(w.clone())
        store.save(f"t{i:02d}", {"w": saved[-1]})
    depths = [codec_of(root, t).depth for t in saved]
    assert max(depths) == store_module.CHAIN
    assert depths[: store_module.CHAIN + 2] == list(range(store_module.CHAIN + 1)) + [0]  # a full copy
    fresh = tc.Store(root)  # another process's view: every tag decodes through its chain
    for i, t in enumerate(saved):
        assert torch.equal(fresh.load(f"t{i:02d}")["w"], t)


def test_a_new_store_object_takes_deltas_against_the_newest_tag(tmp_path):
    root = tmp_path / "s"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 15, generator=g)
    tc.Store(root).save("a", {"w": w})
    w2 = w + 1e-5 * torch.randn(1 << 15, generator=g)
    tc.Store(root).save("b", {"w": w2})  # a new object: the base is read back from the store
    assert codec_of(root, w2).codec in layout.DELTAS
    assert torch.equal(tc.Store(root).load("b")["w"], w2)


def test_without_zstandard_blobs_are_raw_and_compressed_ones_are_refused(tmp_path, monkeypatch):
    root = tmp_path / "s"
    tc.Store(root).save("z", {"w": torch.zeros(1 << 14)})
    monkeypatch.setattr(compress, "zstd", lambda: None)
    store = tc.Store(root)
    store.save("r", {"w": torch.ones(1 << 14)})
    assert codec_of(root, torch.ones(1 << 14)).codec == layout.RAW
    assert torch.equal(store.load("r")["w"], torch.ones(1 << 14))
    with pytest.raises(tc.MissingDependencyError, match="zstandard"):
        store.load("z")


def test_compress_round_trip_on_odd_sizes():
    rng = np.random.default_rng(0)
    for k in (1, 2, 4, 8, 16):
        for n in (k, 7 * k, 4096 * k + k):
            data = rng.integers(0, 4, n, dtype=np.uint8)  # compressible
            base = data.copy()
            base[::3] ^= 1
            enc = compress.encode(data, k, base)
            if enc.codec == layout.RAW:
                continue
            dtype = {1: "uint8", 2: "int16", 4: "int32", 8: "int64", 16: "complex128"}[k]
            prefix = f"{dtype}[{n // k}]".encode()
            head = layout.header_bytes(enc.codec, 1 if enc.codec in layout.DELTAS else 0, prefix, n,
                                       b"\0" * 16 if enc.codec in layout.DELTAS else None, enc.planes)
            blob = head + b"".join(bytes(memoryview(p).cast("B")) for p in enc.pieces)
            h = layout.parse_header(blob[: layout.HEAD], len(blob), "t")
            out = np.empty(n, np.uint8)
            compress.decode_into(h, blob, out.data, lambda b=base: b, "t")
            assert bytes(out) == bytes(data)


class _Counting:
    """The zstandard module with its compressor counting the bytes it is given."""

    def __init__(self, z):
        self._z = z
        self.fed = 0
        outer = self

        class Compressor:
            def __init__(self, level):
                self._c = z.ZstdCompressor(level=level)

            def compress(self, data):
                outer.fed += len(memoryview(data).cast("B"))
                return self._c.compress(data)

        self.ZstdCompressor = Compressor

    def __getattr__(self, name):
        return getattr(self._z, name)


def test_a_small_tensor_is_compressed_once_and_a_large_one_sampled(monkeypatch):
    # Choosing a codec compresses a sample with every candidate; where the sample is the whole
    # tensor, the winner's output is the blob's (it used to be compressed again). A large tensor is
    # compressed on a sample (a few windows) and once whole.
    counting = _Counting(compress.zstd())
    monkeypatch.setattr(compress, "zstd", lambda: counting)
    g = torch.Generator().manual_seed(3)
    small = torch.randn(4096, generator=g).numpy().view(np.uint8)   # 16 KiB: its own sample
    base = (torch.from_numpy(small.view(np.float32).copy()) + 1e-4).numpy().view(np.uint8)
    enc = compress.encode(small, 4, base)
    assert enc.codec != layout.RAW
    # two candidates only (a tensor of at most compress.SMALL bytes): grouped and delta-sub, each
    # fed the 16 KiB once
    assert enc.codec == layout.DELTA_SUB
    assert counting.fed == 2 * len(small)
    out = np.empty(len(small), dtype=np.uint8)
    blob = b"".join([layout.header_bytes(enc.codec, 1 if enc.codec in layout.DELTAS else 0, b"float32[4096]",
                                         len(small), b"\0" * 16 if enc.codec in layout.DELTAS else None, enc.planes),
                     *enc.pieces])
    h = layout.parse_header(blob[: layout.HEAD], len(blob), "t")
    compress.decode_into(h, blob, out.data, lambda: base, "t")
    assert out.tobytes() == small.tobytes()
    counting.fed = 0
    large = torch.randn(1 << 20, generator=g).numpy().view(np.uint8)  # 4 MiB
    compress.encode(large, 4, None)
    assert counting.fed <= len(large) + 2 * 3 * compress.WINDOW


def test_a_small_tensor_saved_again_tries_its_last_codec_alone(monkeypatch, tmp_path):
    # compress.encode's hint: the codec the tensor's previous blob won with, and the fraction of
    # the bytes it stored. A small tensor (at most compress.SMALL bytes; here 32 KiB, whose
    # unhinted trial is a 3-window sample plus the whole) is compressed once, with that codec;
    # where that stores more than HINT_SLACK more than last time, every candidate is tried again.
    counting = _Counting(compress.zstd())
    monkeypatch.setattr(compress, "zstd", lambda: counting)
    g = torch.Generator().manual_seed(9)
    a = torch.randn(8192, generator=g)
    base = a.numpy().view(np.uint8)
    moved = (a + 1e-4 * torch.randn(8192, generator=g)).numpy().view(np.uint8)
    full = compress.encode(moved, 4, base)
    unhinted = counting.fed
    assert full.codec == layout.DELTA_SUB and unhinted > len(moved)
    counting.fed = 0
    hinted = compress.encode(moved, 4, base, hint=(full.codec, full.payload_size / len(moved)))
    assert counting.fed == len(moved)  # (one candidate, each plane once: the blob's own frames)
    assert (hinted.codec, hinted.planes) == (full.codec, full.planes)
    assert b"".join(map(bytes, hinted.pieces)) == b"".join(map(bytes, full.pieces))
    # re-initialized: the delta stores far more than last time, so every candidate is tried, and
    # grouped (which ties the blob to no base) wins as it would have without the hint
    counting.fed = 0
    fresh = torch.randn(8192, generator=g).numpy().view(np.uint8)
    again = compress.encode(fresh, 4, base, hint=(full.codec, full.payload_size / len(moved)))
    assert again.codec == compress.encode(fresh, 4, base).codec == layout.GROUPED
    assert counting.fed > 2 * len(fresh)
    # raw last time: grouped alone is tried, and raw kept where it does not pay
    noise = np.frombuffer(np.random.default_rng(0).bytes(len(fresh)), dtype=np.uint8)
    counting.fed = 0
    assert compress.encode(noise, 4, None, hint=(layout.RAW, 1.0)).codec == layout.RAW
    assert counting.fed == len(noise)
    # through a store: the second save of the moved adapter tries delta-sub alone; every tag exact
    monkeypatch.undo()
    store = tc.Store(tmp_path / "s")
    t = torch.from_numpy(base.view(np.float32).copy())
    store.save("a", {"w": t})
    for i in range(3):
        t = t + 1e-4 * torch.randn(8192, generator=g)
        store.save(f"m{i}", {"w": t})
        if i:
            assert store._codec_of[("w", b"float32[8192]")][0] == layout.DELTA_SUB
    assert codec_of(tmp_path / "s", t).codec == layout.DELTA_SUB
    assert len(tc.Store(tmp_path / "s").verify()) == 4


def test_a_small_tensor_tries_few_codecs_and_a_large_one_every_one(tmp_path):
    # At most compress.SMALL bytes: grouped (zstd for 1-byte elements, or where grouped shrinks it
    # 4x) and, where there is a base, the delta that usually wins (delta-sub; delta for 16-byte
    # elements); every one exact.
    root = tmp_path / "s"
    store = tc.Store(root)
    g = torch.Generator().manual_seed(5)
    n = compress.SMALL // 8  # (fp32: half of SMALL bytes; the complex128 tensor: a quarter)
    state = {"zeros": torch.zeros(n), "bytes": torch.zeros(n, dtype=torch.uint8),
             "c128": torch.randn(n // 8, generator=g, dtype=torch.complex128),
             "w": torch.randn(n, generator=g), "big_zeros": torch.zeros(compress.SMALL)}
    store.save("a", state)
    # random floats: grouped, zstd not tried (counted in the test above); zeros: grouped shrinks
    # them more than REPETITIVE times, so zstd is tried too, and wins
    assert codec_of(root, state["w"]).codec == layout.GROUPED
    assert codec_of(root, state["zeros"]).codec == layout.ZSTD
    assert codec_of(root, state["bytes"]).codec == layout.ZSTD
    assert codec_of(root, state["big_zeros"]).codec == layout.ZSTD  # (4 * SMALL bytes: every candidate)
    moved = {"w": state["w"] + 1e-4 * torch.randn(n, generator=g),
             "c128": state["c128"] + 1e-9 * torch.randn(n // 8, generator=g, dtype=torch.complex128)}
    store.save("b", {**state, **moved})
    assert codec_of(root, moved["w"]).codec == layout.DELTA_SUB
    assert codec_of(root, moved["c128"]).codec == layout.DELTA
    unrelated = torch.randn(n, generator=g)  # (re-initialized: a delta would not pay as grouped does)
    store.save("c", {**state, **moved, "w": unrelated})
    assert codec_of(root, unrelated).codec == layout.GROUPED
    fresh = tc.Store(root)
    for tag, want in (("a", state), ("b", {**state, **moved}), ("c", {**state, **moved, "w": unrelated})):
        assert tc.fingerprint(fresh.load(tag)) == tc.fingerprint(want)
    assert len(fresh.verify()) == 3


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_byte_planes_are_the_spec_s_across_block_and_chunk_edges(k):
    """Plane i holds byte i of every element (STORE.md, "Blobs"), whichever way the writer cuts
    them (words for 2 and 4 bytes, a transposed copy otherwise) and wherever a block ends; the
    reader's interleaving, a chunk at a time, gives every element back, a delta's too."""
    rng = np.random.default_rng(k)
    for n in (1, compress._BLOCK - 1, compress._BLOCK + 3, compress._CHUNK + 5):
        a = rng.integers(0, 256, n * k, dtype=np.uint8)
        grid = a.reshape(-1, k)
        planes = compress.split(a, k)
        assert [bytes(p) for p in planes] == [bytes(grid[:, i]) for i in range(k)]
        if k in compress.WORDS and k > 1:
            base = rng.integers(0, 256, n * k, dtype=np.uint8)
            for codec in (layout.DELTA_SUB, layout.DELTA_TWOS, layout.DELTA):
                want = compress._transform(codec, a, base, k).reshape(-1, k)
                got = compress._split_transformed(codec, a, base, k)
                assert [bytes(p) for p in got] == [bytes(want[:, i]) for i in range(k)]
        out = np.empty(n * k, np.uint8)
        for s in range(0, n, compress._CHUNK):
            e = min(n, s + compress._CHUNK)
            compress._interleave(out[s * k : e * k], planes, s, k, compress._words(k, e - s))
        assert bytes(out) == bytes(a)
