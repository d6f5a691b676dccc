"""Packs (docs/STORE.md, "Packs"): a save writes its new small blobs as one pack object and one
record; readers find blobs in packs or loose; gc deletes and rewrites packs, with saves and loads
under way; a store of layout 1 (no packs) is read, and upgraded by the first pack written into it."""

import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from test_store_processes import _paused  # (a function that waits, the first time, for the test to let it go)

import tensorcanon as tc
from tensorcanon.store import layout, store as store_module

DATA = Path(__file__).parent / "data"


def packs(root):
    return sorted((root / "packs").glob("*.pack"))


def loose(root):
    return sorted(p for p in (root / "blobs").rglob("*") if p.is_file())


def read_pack(path):
    """The pack at ``path`` read from the spec alone: (bytes, index offset, [(digest, offset, length)])."""
    data = path.read_bytes()
    index_at, count, zero, magic = struct.unpack_from("<QQ8s8s", data, len(data) - 32)
    assert magic == b"tcspack\x02" and zero == bytes(8)
    assert index_at == len(data) - 32 - 32 * count
    entries = [struct.unpack_from("<16sQQ", data, index_at + 32 * i) for i in range(count)]
    return data, index_at, entries


def small_state(seed, n=40):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(16 + i, generator=g) for i in range(n)}


# ------------------------------------------------------------------ what a save writes

def test_a_save_writes_its_new_blobs_as_one_pack_and_one_record(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    frozen = {f"base{i}": torch.randn(64, 64) for i in range(20)}
    store.save("a", {"base": frozen, "head": small_state(0)})
    assert len(packs(root)) == 1 and loose(root) == []
    state = {"base": frozen, "head": small_state(1)}
    store.save("b", state)
    assert len(packs(root)) == 2 and loose(root) == []  # the second save: one more object, and its record
    assert sorted(p.name for p in (root / "tags").iterdir()) == ["a.safetensors", "b.safetensors"]
    stats = store.stats()
    assert stats["packs"] == 2 and stats["loose_blobs"] == 0 and stats["blobs"] == 20 + 80
    assert stats["stored_bytes"] == sum(p.stat().st_size for p in packs(root)) + \
        sum(p.stat().st_size for p in (root / "tags").iterdir())
    fresh = tc.Store(root)
    assert tc.fingerprint(fresh.load("b")) == tc.fingerprint(state)
    fresh.export("b", tmp_path / "b.safetensors")
    assert (tmp_path / "b.safetensors").read_bytes() == tc.dumps(state)
    assert set(fresh.verify()) == {"a", "b"}
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 2\n"


def test_a_pack_is_what_the_layout_says(tmp_path):
    root = tmp_path / "s"
    state = small_state(3, n=10)
    tc.Store(root).save("a", state)
    (path,) = packs(root)
    data, index_at, entries = read_pack(path)
    assert path.name == xxhash.xxh3_128(data).hexdigest() + ".pack"
    assert data[:64] == b"tcspack\x02" + bytes(56)
    assert [e[0] for e in entries] == sorted(e[0] for e in entries)
    expected = set()
    for t in state.values():
        h = xxhash.xxh3_128(f"float32[{t.shape[0]}]".encode() + t.numpy().tobytes())
        expected.add(h.digest())
    assert {e[0] for e in entries} == expected
    end = 64
    for raw, offset, length in sorted(entries, key=lambda e: e[1]):
        assert offset % 64 == 0 and offset >= end and offset + length <= index_at
        assert data[end:offset] == bytes(offset - end)  # zero bytes between blobs
        blob = data[offset : offset + length]
        h = layout.parse_header(blob[: layout.HEAD], len(blob), "blob")  # each exactly a blob
        assert blob[:8] == b"tcstore\x01" and h.codec == layout.RAW
        assert xxhash.xxh3_128(h.prefix + blob[h.payload :]).digest() == raw
        end = offset + length


def test_large_blobs_stay_loose_and_small_ones_are_packed(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "PACK_BLOB_LIMIT", 8192)
    root = tmp_path / "s"
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(4096, generator=g), "small": torch.randn(100, generator=g)}
    store = tc.Store(root)
    store.save("a", state)
    assert len(loose(root)) == 1 and len(packs(root)) == 1
    assert len(read_pack(packs(root)[0])[2]) == 1
    assert tc.fingerprint(tc.Store(root).load("a", mmap=True)) == tc.fingerprint(state)
    assert tc.Store(root).verify() == {"a": tc.fingerprint(state)}


def test_a_big_save_writes_several_packs(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "PACK_SIZE", 3000)
    root = tmp_path / "s"
    state = small_state(4, n=30)  # about 30 blobs of 128-300 bytes
    tc.Store(root).save("a", state)
    assert len(packs(root)) > 2
    assert sum(len(read_pack(p)[2]) for p in packs(root)) == 30
    assert tc.fingerprint(tc.Store(root).load("a")) == tc.fingerprint(state)


def test_mmap_views_a_raw_blob_inside_its_pack(tmp_path):
    root = tmp_path / "s"
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (64, 4096), dtype=torch.uint8, generator=g).view(torch.int32)  # raw
    tc.Store(root).save("t", {"w": w, "x": torch.randn(300)})
    back = tc.Store(root).load("t", mmap=True)["w"]
    assert torch.equal(back, w)
    _, _, entries = read_pack(packs(root)[0])
    h = xxhash.xxh3_128(b"int32[64,1024]" + w.numpy().tobytes()).digest()
    (offset,) = [o for r, o, _ in entries if r == h]
    storage_ptr = back.untyped_storage().data_ptr()
    assert back.data_ptr() - storage_ptr == offset + layout.header_room(b"int32[64,1024]", False)


def test_a_delta_against_a_blob_in_a_pack(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    w = torch.randn(128, 128)
    states = []
    for i in range(4):
        w = w + 1e-4 * torch.randn(128, 128)
        states.append({"w": w.clone()})
        store.save(f"t{i}", states[-1])
    assert _deltas(store.stats()) == 3 and loose(root) == []
    fresh = tc.Store(root)
    for i, s in enumerate(states):
        assert tc.fingerprint(fresh.load(f"t{i}")) == tc.fingerprint(s)


def test_a_store_in_memory_writes_packs():
    import fsspec

    url = "memory://tc-pack-test/run"
    store = tc.Store(url)
    states = [small_state(i, n=12) for i in range(3)]
    for i, s in enumerate(states):
        store.save(f"t{i}", s)
    fs = fsspec.filesystem("memory")
    assert len(fs.find("/tc-pack-test/run/packs")) == 3 and not fs.find("/tc-pack-test/run/blobs")
    fresh = tc.Store(url)
    assert [tc.fingerprint(fresh.load(f"t{i}")) for i in range(3)] == [tc.fingerprint(s) for s in states]
    fresh.delete("t0")
    fresh.gc()
    assert set(tc.Store(url).verify()) == {"t1", "t2"}
    fs.rm("/tc-pack-test", recursive=True)


# ------------------------------------------------------------------ gc

def test_gc_deletes_a_dead_pack_and_rewrites_a_mostly_dead_one(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    keep = torch.randn(100)
    store.save("gone", {"x": torch.randn(2000)})  # a pack no tag will need
    store.save("mixed", {"keep": keep, "junk": torch.randn(5000)})  # mostly junk once "mixed" goes
    store.save("keeper", {"keep": keep})  # writes no pack: keep is in mixed's
    assert len(packs(root)) == 2
    mixed = [p for p in packs(root) if len(read_pack(p)[2]) == 2]
    store.delete("gone")
    store.delete("mixed")
    found = store.gc()
    assert found["deleted_packs"] == 2 and found["written_packs"] == 1 and found["deleted_blobs"] == 2
    (new,) = packs(root)
    assert new not in mixed and [e[0] for e in read_pack(new)[2]] == [
        xxhash.xxh3_128(b"float32[100]" + keep.numpy().tobytes()).digest()]
    assert torch.equal(tc.Store(root).load("keeper")["keep"], keep)
    assert set(tc.Store(root).verify()) == {"keeper"}
    assert store.gc()["written_packs"] == 0  # nothing left to rewrite


def test_gc_leaves_a_small_pack_whose_blobs_all_live_as_it_is(tmp_path):
    """A pack of a few small blobs weighs mostly its header and index: its live bytes are under
    REPACK_LIVE of its size with nothing dead in it. gc rewrote it into the same bytes at every run
    (a keep-last-n loop runs gc after every save); it now rewrites a pack only to drop dead blobs,
    or to merge many small packs."""
    root = tmp_path / "s"
    store = tc.Store(root)
    store.save("tiny", {"w": torch.zeros(10), "b": torch.ones(3)})
    (pack,) = packs(root)
    before = (pack.read_bytes(), pack.stat().st_mtime_ns)
    for s in (store, tc.Store(root)):
        assert s.gc() == {"deleted_blobs": 0, "freed_bytes": 0, "kept_blobs": 2, "deleted_packs": 0,
                          "written_packs": 0}
    assert packs(root) == [pack] and (pack.read_bytes(), pack.stat().st_mtime_ns) == before
    assert tc.Store(root).verify() == {"tiny": tc.fingerprint({"w": torch.zeros(10), "b": torch.ones(3)})}


def test_gc_merges_many_small_packs(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    states = [small_state(i, n=5) for i in range(store_module.MERGE_AT + 1)]
    for i, s in enumerate(states):
        store.save(f"t{i}", s)
    assert len(packs(root)) == len(states)
    found = store.gc()
    assert len(packs(root)) == 1 and found["written_packs"] == 1 and found["deleted_packs"] == len(states)
    fresh = tc.Store(root)
    assert fresh.verify() == {f"t{i}": tc.fingerprint(s) for i, s in enumerate(states)}
    assert fresh.stats()["blobs"] == 5 * len(states)


def test_a_pack_rewritten_under_a_reader_is_found_in_its_new_place(tmp_path, monkeypatch):
    root = tmp_path / "s"
    store = tc.Store(root)
    keep = small_state(7, n=6)
    store.save("junk", {"j": torch.randn(20000)})
    store.save("a", {**keep, "j": torch.randn(20000)})
    store.save("b", keep)
    reader = tc.Store(root)
    assert tc.fingerprint(reader.load("b")) == tc.fingerprint(keep)  # its packs listed, its map made
    before = set(packs(root))
    store.delete("a")
    store.delete("junk")
    store.gc()  # keep's blobs move to a new pack; the old ones are deleted
    assert not set(packs(root)) & before
    listings = []
    real = store_module.Store._refresh_packs

    def counted(self):
        listings.append(1)
        return real(self)

    monkeypatch.setattr(store_module.Store, "_refresh_packs", counted)
    assert tc.fingerprint(reader.load("b")) == tc.fingerprint(keep)  # its map is stale: listed again, once
    assert len(listings) == 1
    shutil.rmtree(root / "packs")
    (root / "packs").mkdir()
    with pytest.raises(tc.IntegrityError, match="missing from the store"):
        reader.load("b")


def test_a_save_under_way_keeps_the_packed_blob_it_counted_on(tmp_path, monkeypatch):
    # The save finds `reused` in a pack a collection would otherwise rewrite without it; the
    # collection waits for the save, then keeps the blob, moved to a new pack.
    from tensorcanon.store import compress

    root = tmp_path / "s"
    reused = torch.randn(300)
    tc.Store(root).save("old", {"reused": reused, "junk": torch.randn(20000)})
    tc.Store(root).delete("old")
    entered, go = _paused(monkeypatch, compress, "encode")
    saved = {}
    new = {"reused": reused, "x": torch.randn(300)}
    saver = threading.Thread(target=lambda: saved.setdefault("d", tc.Store(root).save("new", new)))
    saver.start()
    assert entered.wait(30)  # it found `reused` present, and is encoding x
    counts = {}
    collector = threading.Thread(target=lambda: counts.update(tc.Store(root).gc()))
    collector.start()
    time.sleep(0.5)
    assert collector.is_alive()
    go.set()
    saver.join(30)
    collector.join(30)
    assert not saver.is_alive() and not collector.is_alive()
    assert counts["written_packs"] == 1 and counts["deleted_packs"] == 1
    assert tc.Store(root).verify() == {"new": saved["d"]}
    assert tc.fingerprint(tc.Store(root).load("new")) == tc.fingerprint(new)


def test_a_save_waits_for_a_collection_that_rewrites_packs(tmp_path, monkeypatch):
    root = tmp_path / "s"
    garbage = {"g": torch.randn(300)}
    writer = tc.Store(root)
    writer.save("old", {**garbage, "junk": torch.randn(20000)})  # this object has seen g's pack
    writer.delete("old")
    k = torch.randn(50)
    tc.Store(root).save("mix", {"k": k, "junk2": torch.randn(20000)})
    tc.Store(root).save("keep", {"k": k})
    tc.Store(root).delete("mix")  # mix's pack: mostly garbage, rewritten; old's: all garbage, deleted
    entered, go = _paused(monkeypatch, store_module.Store, "_repack")
    collector = threading.Thread(target=lambda: tc.Store(root).gc())
    collector.start()
    assert entered.wait(30)  # the collection has deleted old's pack and is rewriting mix's
    saved = {}
    saver = threading.Thread(target=lambda: saved.setdefault("d", writer.save("new", garbage)))
    saver.start()
    time.sleep(0.5)
    assert saver.is_alive() and not list((root / "pending").iterdir())  # stepped back, waiting
    go.set()
    collector.join(30)
    saver.join(30)
    assert not saver.is_alive() and not collector.is_alive()
    assert tc.fingerprint(tc.Store(root).load("new")) == tc.fingerprint(garbage)  # g written again
    assert torch.equal(tc.Store(root).load("keep")["k"], k)
    assert set(tc.Store(root).verify()) == {"new", "keep"}


# ------------------------------------------------------------------ layout 1

def test_a_layout_1_store_is_read_and_upgraded_by_the_first_pack(tmp_path):
    # tests/store/data/layout1: a store written by tensorcanon at 3874f3a (layout 1: loose blobs only)
    # by data/make_layout1.py; the objects are rebuilt here the same way.
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_layout1", DATA / "make_layout1.py")
    make_layout1 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_layout1)
    root = tmp_path / "old"
    shutil.copytree(DATA / "layout1", root)
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 1\n"
    states = make_layout1.states()
    store = tc.Store(root)
    assert store.tags() == sorted(states)
    assert store.verify() == {t: tc.fingerprint(s) for t, s in states.items()}
    for t, s in states.items():
        assert tc.fingerprint(store.load(t)) == tc.fingerprint(s)
        store.export(t, tmp_path / "o.safetensors")
        assert (tmp_path / "o.safetensors").read_bytes() == tc.dumps(s)
    assert _deltas(store.stats()) >= 1 and store.stats()["packs"] == 0
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 1\n"  # reading changes nothing
    store.save("again", states["step-1"])  # every blob is there already: no pack, the marker stays
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 1\n" and not packs(root)
    new = {"w": states["step-2"]["w"] + 1e-4, "n": torch.arange(5)}
    store.save("new", new)  # a delta against a loose blob, written into a pack
    assert (root / "tensorcanon-store").read_bytes() == b"tensorcanon-store layout 2\n" and len(packs(root)) == 1
    fresh = tc.Store(root)
    assert tc.fingerprint(fresh.load("new")) == tc.fingerprint(new)
    assert set(fresh.verify()) == set(states) | {"again", "new"}
    fresh.delete("step-1")
    fresh.gc()
    assert set(tc.Store(root).verify()) == set(states) - {"step-1"} | {"again", "new"}


@pytest.mark.parametrize("text", [b"tensorcanon-store layout 3\n", b"tensorcanon-store layout 2", b"layout 2\n"])
def test_another_marker_is_refused(tmp_path, text):
    root = tmp_path / "s"
    tc.Store(root).save("a", {"x": torch.ones(3)})
    (root / "tensorcanon-store").write_bytes(text)
    with pytest.raises(tc.FormatError, match="not a store of layout 1 or 2"):
        tc.Store(root).load("a")
    assert os.path.exists(root / "tags" / "a.safetensors")


def test_gc_copies_no_blob_that_stays_elsewhere(tmp_path):
    # A blob both in a pack being rewritten and in a pack kept whole is not copied a third time.
    root = tmp_path / "s"
    store = tc.Store(root)
    shared = torch.randn(100)
    store.save("mixed", {"shared": shared, "junk": torch.randn(20000)})
    other = tc.Store(root)  # (another object: it has not seen mixed's pack, so writes shared again)
    other._listed = True
    other._refresh_packs = lambda: False  # its listing sees no pack
    other.save("whole", {"shared": shared, "own": torch.randn(200)})
    assert len(packs(root)) == 2
    store.delete("mixed")
    found = tc.Store(root).gc()
    assert found["deleted_packs"] == 1 and found["written_packs"] == 0  # nothing left to copy
    assert len(packs(root)) == 1 and len(read_pack(packs(root)[0])[2]) == 2
    assert torch.equal(tc.Store(root).load("whole")["shared"], shared)


def _deltas(stats):
    """Blobs stored as a delta of a base, by any delta codec (XOR, or the integer difference)."""
    return sum(stats["codecs"].get(c, 0) for c in ("delta", "delta-sub", "delta-twos"))
