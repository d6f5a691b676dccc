"""A load decodes several compressed blobs ahead on a small pool (store.py, _TagFile): errors still
come in tensor order, a damaged base shared by two tensors names the first, memory stays bounded,
and reused decode buffers never show through."""

from __future__ import annotations

import threading

import pytest
import torch
from test_store import packed

import tensorcanon as tc
from tensorcanon.store import store as store_module


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
    # The tensor being read and the next two decode at the same time (three callers meet at the
    # barrier): with one blob decoded ahead, as before, only two ever did and the barrier broke.
    a, b = _drifting(20000, 6)
    store = tc.Store(tmp_path / "s")
    store.save("a", a)
    store.save("b", b)
    meet = threading.Barrier(3, timeout=20)
    real = store_module.Store._decode

    def decode(self, raw, prefix=None, *args, **kwargs):
        if prefix is None and meet.n_waiting < 3 and not meet.broken and not getattr(meet, "met", False):
            meet.wait()
            meet.met = True
        return real(self, raw, prefix, *args, **kwargs)

    monkeypatch.setattr(store_module.Store, "_decode", decode)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert not meet.broken


def test_decoding_ahead_is_bounded(tmp_path, monkeypatch):
    # At most AHEAD blobs decode ahead, and no more than AHEAD_BYTES of them (one always may).
    a, b = _drifting(20000, 10)
    store = tc.Store(tmp_path / "s")
    store.save("a", a)
    store.save("b", b)
    seen: list[int] = []
    real = store_module._TagFile._top_up

    def top_up(self, i):
        real(self, i)
        seen.append(len(self._ahead))

    monkeypatch.setattr(store_module._TagFile, "_top_up", top_up)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert max(seen) == store_module.AHEAD
    seen.clear()
    monkeypatch.setattr(store_module, "AHEAD_BYTES", 20000 * 4)  # one tensor's bytes
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("b")) == tc.fingerprint(b)
    assert max(seen) == 1


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
