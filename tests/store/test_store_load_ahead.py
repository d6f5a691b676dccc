"""A load decodes several compressed blobs ahead on a small pool (store/tagfile.py, _TagFile): errors still
come in tensor order, a damaged base shared by two tensors names the first, memory stays bounded,
and reused decode buffers never show through."""

from __future__ import annotations

import threading

import pytest
import torch
from test_store import packed

import tensorcanon as tc
from tensorcanon.store import layout, store as store_module, tagfile


def _drifting(n, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = {f"w{i}": torch.randn(n, generator=g) for i in range(count)}
    b = {k: v + 1e-4 * torch.randn(n, generator=g) for k, v in a.items()}
    return a, b


def _flip(path, at):
    bad = bytearray(path.read_bytes())
    bad[at] ^= 0x40
    path.write_bytes(bytes(bad))


def test_several_blobs_decode_at_once(tmp_path, monkeypatch):
    # Two tensors decode into their memory at the same time (both read-ahead threads meet at the
    # barrier) while the loading thread waits for the first; with one decoding at a time, the
    # barrier breaks.
    a, b = _drifting(20000, 6)
    store = tc.Store(tmp_path / "s")
    store.save("a", a)
    store.save("b", b)
    meet = threading.Barrier(tagfile.AHEAD_THREADS, timeout=20)
    real = tagfile._TagFile._decode_into
    calls = []

    def decode_into(self, raw, out, pool):
        calls.append(raw)
        if not getattr(meet, "met", False) and not meet.broken:
            meet.wait()
            meet.met = True
        return real(self, raw, out, pool)

    monkeypatch.setattr(tagfile._TagFile, "_decode_into", decode_into)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert len(calls) == 6 and not meet.broken


def test_decoding_ahead_is_bounded(tmp_path, monkeypatch):
    # At most AHEAD blobs decode ahead, and no more than AHEAD_BYTES of them (one always may).
    a, b = _drifting(20000, 10)
    store = tc.Store(tmp_path / "s")
    store.save("a", a)
    store.save("b", b)
    seen: list[tuple[int, int]] = []
    real = tagfile._TagFile.values

    def values(self, *args):
        try:
            return real(self, *args)
        finally:
            seen.append(self.peak)

    monkeypatch.setattr(tagfile._TagFile, "values", values)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert seen == [(tagfile.AHEAD, tagfile.AHEAD * 20000 * 4)]
    seen.clear()
    monkeypatch.setattr(tagfile, "AHEAD_BYTES", 20000 * 4)  # one tensor's bytes
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert seen == [(1, 20000 * 4)]


def test_errors_come_in_tensor_order_with_several_ahead(tmp_path):
    # Blobs 1 and 3 (data order) damaged: the load names blob 1, though blob 3 decodes (and fails)
    # on another thread meanwhile, then blob 3 once blob 1 is repaired.
    ws = [torch.zeros(50000) + i for i in range(6)]  # compressible: zstd blobs
    store = tc.Store(tmp_path / "s")
    store.save("a", {"w": ws})
    where = sorted(packed(tmp_path / "s").items(), key=lambda e: e[1][1])
    assert len(where) == 6
    (raw1, (path, off1, len1)), (raw3, (_, off3, len3)) = where[1], where[3]
    good = path.read_bytes()
    _flip(path, off1 + len1 - 3)
    _flip(path, off3 + len3 - 3)
    for _ in range(3):
        with pytest.raises((tc.IntegrityError, tc.FormatError), match=raw1.hex()):
            tc.Store(tmp_path / "s").load("a")
    with pytest.raises((tc.IntegrityError, tc.FormatError), match=raw1.hex()):
        tc.Store(tmp_path / "s").verify("a")
    bad = bytearray(path.read_bytes())
    bad[off1 : off1 + len1] = good[off1 : off1 + len1]
    path.write_bytes(bytes(bad))
    with pytest.raises((tc.IntegrityError, tc.FormatError), match=raw3.hex()):
        tc.Store(tmp_path / "s").load("a")
    path.write_bytes(good)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("a")) == tc.fingerprint({"w": ws})


def test_a_damaged_base_shared_by_two_tensors_names_the_first(tmp_path):
    # Two tensors of tag "a" hold the same bytes (one blob); in tag "b" both are deltas of it.
    # Damaging that base fails the load naming it, though both decode through it at once; a damaged
    # blob before them in data order is the one named instead.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(30000, generator=g)
    a = {"p": torch.zeros(30000) + 7, "x": w.clone(), "y": w.clone()}
    b = {"p": a["p"] + 1, "x": w + 1e-4 * torch.randn(30000, generator=g),
         "y": w + 1e-4 * torch.randn(30000, generator=g)}
    store = tc.Store(tmp_path / "s")
    store.save("a", a)
    store.save("b", b)
    assert store.stats()["codecs"].get("delta-sub", 0) + store.stats()["codecs"].get("delta-twos", 0) == 2
    where = packed(tmp_path / "s")
    rows_a = {r.name: r.digest for r in _rows(store, "a")}
    assert rows_a["x"] == rows_a["y"]
    path, offset, length = where[rows_a["x"]]
    good = path.read_bytes()
    _flip(path, offset + length - 3)
    for _ in range(3):  # (x and y decode at the same time, each through the damaged base)
        with pytest.raises((tc.IntegrityError, tc.FormatError), match=rows_a["x"].hex()):
            tc.Store(tmp_path / "s").load("b")
    rows_b = {r.name: r.digest for r in _rows(store, "b")}
    p_path, p_offset, p_length = where[rows_b["p"]]  # p comes first in data order: its damage is named
    p_good = p_path.read_bytes()
    _flip(p_path, p_offset + p_length - 3)
    for _ in range(3):
        with pytest.raises((tc.IntegrityError, tc.FormatError), match=rows_b["p"].hex()):
            tc.Store(tmp_path / "s").load("b")
    p_path.write_bytes(p_good)
    path.write_bytes(good)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)


def _rows(store, tag):
    with store._tag_file(tag, blobs=False) as cf:
        return sorted(cf.rows, key=lambda r: r.begin)


def test_reused_decode_buffers_never_show_through(tmp_path):
    # Many tensors of one size, deltas of deltas: each decode buffer is reused for later blobs; every
    # tensor loaded, and the export, are still exact, load after load (and with a blob read twice).
    a, b = _drifting(8192, 12, seed=5)
    c = {k: v + 1e-4 for k, v in b.items()}
    c["w9"] = c["w1"].clone()  # a blob read again, after others: decoded again, not ahead twice
    c["w10"] = c["w1"].clone()
    store = tc.Store(tmp_path / "s")
    for tag, obj in (("a", a), ("b", b), ("c", c)):
        store.save(tag, obj)
    for _ in range(2):
        got = tc.Store(tmp_path / "s").load("c")
        assert all(torch.equal(got[k], c[k]) for k in c)
    tc.save(c, tmp_path / "c.safetensors")
    tc.Store(tmp_path / "s").export("c", tmp_path / "x.safetensors")
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()


def _shared_base_store(tmp_path, n):
    # Tag "a" holds w twice (one blob) and q; in tag "b" x and y are two deltas of that one blob.
    g = torch.Generator().manual_seed(11)
    w = torch.randn(n, generator=g)
    a = {"q": torch.randn(n, generator=g), "x": w.clone(), "y": w.clone()}
    b = {"q": a["q"] + 1e-4 * torch.randn(n, generator=g), "x": w + 1e-4 * torch.randn(n, generator=g),
         "y": w + 1e-4 * torch.randn(n, generator=g)}
    store = tc.Store(tmp_path / "s")
    store.save("a", a)
    store.save("b", b)
    rows_a = {r.name: r.digest for r in _rows(store, "a")}
    assert rows_a["x"] == rows_a["y"]
    return store, a, b, rows_a


def test_a_base_two_blobs_name_is_decoded_once_per_load(tmp_path, monkeypatch):
    # x and y of tag "b" are deltas of one base: one load decodes it once (before: once per delta),
    # shares it between the two decodes, and frees it; the next load decodes it once again.
    store, _, b, rows_a = _shared_base_store(tmp_path, 30000)
    decoded: list[bytes] = []
    real = store_module.Store._decode

    def decode(self, raw, *args, **kwargs):
        decoded.append(raw)
        return real(self, raw, *args, **kwargs)

    monkeypatch.setattr(store_module.Store, "_decode", decode)
    for _ in range(2):
        decoded.clear()
        got = tc.Store(tmp_path / "s").load("b")
        assert all(torch.equal(got[k], b[k]) for k in b)
        assert decoded.count(rows_a["x"]) == 1 and decoded.count(rows_a["q"]) == 1
    monkeypatch.setattr(tagfile, "SHARED_BASES", 30000 * 4 - 1)  # no room: decoded by each delta
    decoded.clear()
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert decoded.count(rows_a["x"]) == 2


def test_a_shared_base_that_lies_is_refused(tmp_path):
    # The shared base's loose blob replaced by another sound blob of the same dtype and shape (q's):
    # its header and frames are fine, its bytes are not those its name says. Every load of "b"
    # refuses it, naming it, though x and y share one decoding of it; verify refuses it too.
    n = 400_000  # (random floats: loose blobs of about 1.4 MB)
    store, _, b, rows_a = _shared_base_store(tmp_path, n)
    base = tmp_path / "s" / layout.blob_path(rows_a["x"])
    other = tmp_path / "s" / layout.blob_path(rows_a["q"])
    assert base.is_file() and other.is_file()
    good = base.read_bytes()
    base.write_bytes(other.read_bytes())
    for _ in range(3):
        with pytest.raises(tc.IntegrityError, match=f"not the xxh3-128:{rows_a['x'].hex()}"):
            tc.Store(tmp_path / "s").load("b")
    with pytest.raises(tc.IntegrityError, match=rows_a["x"].hex()):
        tc.Store(tmp_path / "s").verify("b")
    base.write_bytes(good)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)


def test_a_shared_base_asked_for_more_often_than_counted(tmp_path, monkeypatch):
    # Room for one shared base: A (under z's delta C, and under B) is shared; B, named by x and y of
    # tag "c", finds no room and is decoded twice, so A is asked for three times where two users
    # were counted. Every load is still exact (A's bytes are never handed to another decode while
    # a user may still read them), and a damaged A is still refused.
    n = 30000
    g = torch.Generator().manual_seed(12)
    w = torch.randn(n, generator=g)
    n1, n2 = 1e-4 * torch.randn(n, generator=g), 1e-4 * torch.randn(n, generator=g)
    a = {"z": w.clone(), "x": w.clone(), "y": w.clone()}
    b = {"z": w + n2, "x": w + n1, "y": w + n1}
    c = {"z": w + n2 + 1e-4, "x": w + n1 + 1e-4 * torch.randn(n, generator=g),
         "y": w + n1 + 1e-4 * torch.randn(n, generator=g)}
    store = tc.Store(tmp_path / "s")
    for tag, obj in (("a", a), ("b", b), ("c", c)):
        store.save(tag, obj)
    rows_a = {r.name: r.digest for r in _rows(store, "a")}
    monkeypatch.setattr(tagfile, "SHARED_BASES", n * 4)
    for _ in range(5):
        got = tc.Store(tmp_path / "s").load("c")
        assert all(torch.equal(got[k], c[k]) for k in c)
    path, offset, length = packed(tmp_path / "s")[rows_a["x"]]
    _flip(path, offset + length - 3)
    with pytest.raises((tc.IntegrityError, tc.FormatError), match=rows_a["x"].hex()):
        tc.Store(tmp_path / "s").load("c")
