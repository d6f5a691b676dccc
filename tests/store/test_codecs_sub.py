"""delta-sub (docs/STORE.md, "Blobs"): the zigzag-coded integer difference against a base, exact for
every element size it takes, chosen for drifting floats; the XOR delta of stores written before it
still decodes; planes that do not pay on the sample are stored untried."""

import numpy as np
import pytest
import torch
from test_compression import _Counting  # (the zstandard module counting what it compresses)

import tensorcanon as tc
from tensorcanon.store import compress, layout

K_DTYPE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64", 16: "complex128"}


def blob_of(enc, n, k, depth=1):
    is_delta = enc.codec in layout.DELTAS
    head = layout.header_bytes(enc.codec, depth if is_delta else 0, f"{K_DTYPE[k]}[{n // k}]".encode(), n,
                               b"\0" * 16 if is_delta else None, enc.planes)
    return head + b"".join(bytes(memoryview(p).cast("B")) for p in enc.pieces)


def decoded(blob, base):
    h = layout.parse_header(blob[: layout.HEAD], len(blob), "t")
    out = np.empty(h.size, np.uint8)
    compress.decode_into(h, blob, out.data, lambda: base, "t")
    return h, out


def reference_decode(grouped: bytes, base: bytes, k: int) -> bytes:
    """The spec's words, element by element in plain Python (an independent reader's)."""
    bits = 8 * k
    out = bytearray()
    for j in range(len(grouped) // k):
        g = int.from_bytes(grouped[j * k : (j + 1) * k], "little")
        b = int.from_bytes(base[j * k : (j + 1) * k], "little")
        d = g // 2 if g % 2 == 0 else -(g + 1) // 2
        out += ((b + d) % (1 << bits)).to_bytes(k, "little")
    return bytes(out)


def reference_encode(a: bytes, base: bytes, k: int) -> bytes:
    bits = 8 * k
    out = bytearray()
    for j in range(len(a) // k):
        x = int.from_bytes(a[j * k : (j + 1) * k], "little")
        b = int.from_bytes(base[j * k : (j + 1) * k], "little")
        d = (x - b) % (1 << bits)
        d = d - (1 << bits) if d >= 1 << (bits - 1) else d
        out += (2 * d if d >= 0 else -2 * d - 1).to_bytes(k, "little")
    return bytes(out)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_transform_is_the_specs_and_reverses_exactly(k):
    rng = np.random.default_rng(k)
    n = 3000 * k
    a = rng.integers(0, 256, n, dtype=np.uint8)
    base = a.copy()
    base[::7] = rng.integers(0, 256, len(base[::7]), dtype=np.uint8)    # large moves, wrapping both ways
    base[1::5] ^= 1                                                      # moves of one unit
    extremes = np.array([0, 0xFF] * (2 * k), dtype=np.uint8)            # 0 - (2^(8k) - 1) and back
    a[: len(extremes)] = extremes
    base[: len(extremes)] = extremes[::-1]
    g = compress.sub(a, base, k)
    assert g.tobytes() == reference_encode(a.tobytes(), base.tobytes(), k)
    assert reference_decode(g.tobytes(), base.tobytes(), k) == a.tobytes()
    tmp = np.empty(len(g), np.uint8)
    back = g.copy()
    compress._unsub(back, base, k, tmp)
    assert back.tobytes() == a.tobytes()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("n_elems", [700, 5000, 300_001])
def test_delta_sub_blobs_decode_to_the_exact_bytes(k, n_elems):
    rng = np.random.default_rng(n_elems + k)
    base = rng.integers(0, 256, n_elems * k, dtype=np.uint8)           # noise: only a delta pays
    w = compress.WORDS[k]
    a = base.view(w).copy()
    a[::3] += rng.integers(0, 3, len(a[::3])).astype(w)                # (wrapping where it overflows)
    a[1::3] -= rng.integers(0, 3, len(a[1::3])).astype(w)
    a = a.view(np.uint8)
    enc = compress.encode(a, k, base)
    assert enc.codec == layout.DELTA_SUB
    for pool in (False, True):
        blob = blob_of(enc, len(a), k)
        h = layout.parse_header(blob[: layout.HEAD], len(blob), "t")
        out = np.empty(h.size, np.uint8)
        compress.decode_into(h, blob, out.data, lambda: base, "t", pool=pool)
        assert out.tobytes() == a.tobytes()


def test_drifting_floats_are_stored_as_delta_sub_and_load_exact(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 16, generator=g)
    h16 = w.to(torch.bfloat16)
    store.save("a", {"w": w, "h": h16})
    w2 = w + 1e-4 * torch.randn(1 << 16, generator=g)
    h2 = (h16.float() + 1e-2 * torch.randn(1 << 16, generator=g)).to(torch.bfloat16)
    store.save("b", {"w": w2, "h": h2})
    from tensorcanon.format import digest

    for t in (w2, h2):
        hasher = digest.tensor_hasher(str(t.dtype).removeprefix("torch."), tuple(t.shape))
        hasher.update(t.view(torch.uint8).numpy().tobytes())
        data = _blob(root, hasher.digest())
        h = layout.parse_header(data[: layout.HEAD], len(data), "blob")
        assert h.codec == layout.DELTA_SUB and h.depth == 1
    fresh = tc.Store(root).load("b")
    assert torch.equal(fresh["w"], w2) and torch.equal(fresh["h"], h2)
    assert tc.Store(root).verify() and len(tc.Store(root).verify()) == 2


def test_xor_delta_blobs_still_decode(tmp_path, monkeypatch):
    # A store written before delta-sub holds XOR deltas: writing with the XOR codec (as the old
    # writer did), then reading with today's reader, gives the exact bytes.
    root = tmp_path / "s"
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1 << 15, generator=g)
    ws = [w + i * 1e-4 * torch.randn(1 << 15, generator=g) for i in range(3)]
    with monkeypatch.context() as m:
        m.setattr(compress, "_delta_codecs", lambda k: (layout.DELTA,))
        old = tc.Store(root)
        for i, x in enumerate(ws):
            old.save(f"t{i}", {"w": x})
    new = tc.Store(root)
    new.save("t3", {"w": ws[2] + 1e-4})   # a delta-sub on top of an XOR chain
    for i, x in enumerate(ws):
        assert torch.equal(tc.Store(root).load(f"t{i}")["w"], x)
    assert torch.equal(tc.Store(root).load("t3")["w"], ws[2] + 1e-4)
    stats = tc.Store(root).stats()
    assert stats["codecs"].get("delta", 0) == 2 and stats["codecs"].get("delta-sub", 0) == 1


def test_xor_delta_decodes_by_the_spec():
    rng = np.random.default_rng(2)
    base = rng.integers(0, 4, 1 << 14, dtype=np.uint8)
    a = base ^ (rng.integers(0, 2, 1 << 14, dtype=np.uint8))
    planes, pieces = compress._grouped(compress.zstd(), compress.xor(a, base), 4, False)
    enc = compress.Encoded(layout.DELTA, planes, pieces)
    _, out = decoded(blob_of(enc, len(a), 4), base)
    assert out.tobytes() == a.tobytes()


def test_complex128_deltas_are_xor():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 3, 16 * 4096, dtype=np.uint8)
    a = base.copy()
    a[::5] ^= 1
    enc = compress.encode(a, 16, base)
    assert enc.codec == layout.DELTA
    _, out = decoded(blob_of(enc, len(a), 16), base)
    assert out.tobytes() == a.tobytes()


def test_planes_that_do_not_pay_on_the_sample_are_stored_untried(monkeypatch):
    # float32 noise: the two low mantissa bytes never compress, the exponent byte does. Once the
    # sample says so, the whole tensor's low planes are stored without being handed to zstd.
    counting = _Counting(compress.zstd())
    monkeypatch.setattr(compress, "zstd", lambda: counting)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1 << 20, generator=g).numpy().view(np.uint8)   # 4 MiB
    enc = compress.encode(x, 4, None, pool=False)
    assert enc.codec == layout.GROUPED
    assert enc.planes is not None and enc.planes[0][0] == layout.STORED and enc.planes[3][0] == layout.PLANE_ZSTD
    trials = 3 * 3 * compress.WINDOW    # zstd and grouped on the sample, and room for one more
    assert counting.fed <= trials + 2 * len(x) // 4   # at most two of the four planes compressed whole
    _, out = decoded(b"".join([layout.header_bytes(enc.codec, 0, b"int32[1048576]", len(x), None, enc.planes),
                               *(bytes(memoryview(p).cast("B")) for p in enc.pieces)]), None)
    assert out.tobytes() == x.tobytes()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_delta_twos_is_the_plain_difference_and_reverses_exactly(k):
    rng = np.random.default_rng(10 + k)
    a = rng.integers(0, 256, 4000 * k, dtype=np.uint8)
    base = rng.integers(0, 256, 4000 * k, dtype=np.uint8)
    g = compress.twos(a, base, k)
    bits = 8 * k
    for j in range(0, 4000, 97):  # the spec's words: (a - b) mod 2^(8k), little-endian
        x = int.from_bytes(a[j * k : (j + 1) * k].tobytes(), "little")
        b = int.from_bytes(base[j * k : (j + 1) * k].tobytes(), "little")
        assert int.from_bytes(g[j * k : (j + 1) * k].tobytes(), "little") == (x - b) % (1 << bits)


def test_a_decaying_moment_is_stored_as_delta_twos_and_loads_exact(tmp_path):
    # Every element shrinks by up to 10% (as an AdamW second moment may between checkpoints): the
    # differences all have one sign, and their two's complement has one bit fewer than their
    # zigzag code.
    g = torch.Generator().manual_seed(5)
    v = torch.rand(1 << 16, generator=g) * 1e-3
    v2 = v * (1 - 0.1 * torch.rand(1 << 16, generator=g))
    root = tmp_path / "s"
    store = tc.Store(root)
    store.save("a", {"v": v})
    store.save("b", {"v": v2})
    from tensorcanon.format import digest

    hasher = digest.tensor_hasher("float32", (1 << 16,))
    hasher.update(v2.numpy().tobytes())
    data = _blob(root, hasher.digest())
    h = layout.parse_header(data[: layout.HEAD], len(data), "t")
    assert h.codec == layout.DELTA_TWOS
    assert torch.equal(tc.Store(root).load("b")["v"], v2)
    enc = compress.encode(v2.numpy().view(np.uint8), 4, v.numpy().view(np.uint8))
    _, out = decoded(blob_of(enc, 4 << 16, 4), v.numpy().view(np.uint8))
    assert out.tobytes() == v2.numpy().tobytes()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("n_elems", [700, 300_001])
def test_delta_twos_blobs_decode_to_the_exact_bytes(k, n_elems):
    rng = np.random.default_rng(20 + k + n_elems)
    base = rng.integers(0, 256, n_elems * k, dtype=np.uint8)
    a = rng.integers(0, 256, n_elems * k, dtype=np.uint8)
    a[: n_elems * k // 2] = base[: n_elems * k // 2]   # half unchanged, half anything (wrapping)
    planes, pieces = compress._grouped(compress.zstd(), compress.twos(a, base, k), k, False)
    enc = compress.Encoded(layout.DELTA_TWOS, planes, pieces)
    blob = blob_of(enc, len(a), k)
    h = layout.parse_header(blob[: layout.HEAD], len(blob), "t")
    for pool in (False, True):
        out = np.empty(h.size, np.uint8)
        compress.decode_into(h, blob, out.data, lambda: base, "t", pool=pool)
        assert out.tobytes() == a.tobytes()


def _blob(root, raw):
    """The stored bytes of blob ``raw``: a loose object, or its entry in a pack (layout 2)."""
    path = root / layout.blob_path(raw)
    if path.exists():
        return path.read_bytes()
    from test_store import packed

    pack, offset, length = packed(root)[raw]
    return pack.read_bytes()[offset:offset + length]
