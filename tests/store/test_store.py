"""tensorcanon.Store: save, load, verify, export (== tensorcanon.save byte for byte), tags, delete, gc,
stats, the hashing cache, and the command line (docs/STORE.md)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import tensorcanon as tc
from tensorcanon.store import layout
from tensorcanon.tools import cli

import vectors
from compare import assert_same

GOLDEN = pathlib.Path(vectors.__file__).parent


def blobs(root):
    """The store's data objects: loose blobs and packs."""
    return sorted(p for d in ("blobs", "packs") for p in (root / d).rglob("*") if p.is_file())


def packed(root):
    """Every blob digest the packs of ``root`` hold -> (pack path, offset, length)."""
    out = {}
    for path in sorted((root / "packs").glob("*.pack")):
        data = path.read_bytes()
        index_at, count = layout.pack_trailer(data, len(data), str(path))
        ix = layout.parse_pack_index(data[index_at : index_at + count * layout.ENTRY_SIZE], index_at, count,
                                     len(data), str(path))
        out.update({raw: (path, o, n) for raw, (o, n) in ix.entries.items()})
    return out


def model_state(seed=0, width=64):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(width, width, generator=g), "b": torch.randn(width, generator=g)},
            "step": seed, "ids": np.arange(10, dtype=np.int64)}


# ------------------------------------------------------------------ export == save, every node kind

@pytest.mark.parametrize("name", [n for n in sorted(vectors.VECTORS) if vectors.buildable(n)])
def test_export_is_the_file_save_writes_for_every_golden_vector(tmp_path, name):
    obj, meta = vectors.build(name)
    store = tc.Store(tmp_path / "s")
    digest = store.save("t", obj, metadata=meta)
    assert digest == tc.fingerprint(obj, metadata=meta)
    out = tmp_path / "out.safetensors"
    assert store.export("t", out) == digest
    assert out.read_bytes() == (GOLDEN / f"{name}.safetensors").read_bytes()  # the committed golden file
    assert out.read_bytes() == tc.dumps(obj, metadata=meta)
    assert store.verify("t") == digest
    back = store.load("t")
    assert tc.fingerprint(back, metadata=meta) == digest
    assert_same(back, tc.load(out))


def test_export_keeps_devices_and_memory_formats_of_the_saved_file(tmp_path):
    t = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    obj = {"x": t, "p": torch.nn.Parameter(torch.ones(3))}
    store = tc.Store(tmp_path / "s")
    store.save("t", obj)
    store.export("t", tmp_path / "o.safetensors")
    assert (tmp_path / "o.safetensors").read_bytes() == tc.dumps(obj)
    back = store.load("t")
    assert back["x"].is_contiguous(memory_format=torch.channels_last)
    assert isinstance(back["p"], torch.nn.Parameter)


# ------------------------------------------------------------------ dedup, tags, delete, gc, stats

def test_a_second_tag_writes_only_what_changed(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    frozen = torch.randn(256, 256)
    store.save("a", {"base": frozen, "head": torch.randn(8)})
    before = set(packed(root))
    store.save("b", {"base": frozen, "head": torch.randn(8)})
    new = set(packed(root)) - before
    assert len(new) == 1  # the head only: the base's blob is the one the first tag wrote
    assert store.tags() == ["a", "b"]
    stats = store.stats()
    assert stats["tags"] == 2 and stats["blobs"] == 3
    assert stats["logical_bytes"] == len(tc.dumps({"base": frozen, "head": torch.randn(8)})) * 2
    assert stats["stored_bytes"] == sum(p.stat().st_size for p in blobs(root)) + \
        sum(p.stat().st_size for p in (root / "tags").iterdir())
    assert stats["stored_bytes"] < 0.6 * stats["logical_bytes"]


def test_delete_then_gc_removes_only_what_no_tag_needs(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    states = [model_state(i) for i in range(3)]
    for i, s in enumerate(states):
        store.save(f"t{i}", s)
    store.delete("t0")
    assert store.tags() == ["t1", "t2"]
    found = store.gc()
    assert found["deleted_blobs"] >= 1
    for i in (1, 2):
        assert tc.fingerprint(store.load(f"t{i}")) == tc.fingerprint(states[i])
    assert store.verify() == {"t1": tc.fingerprint(states[1]), "t2": tc.fingerprint(states[2])}
    with pytest.raises(tc.MissingFileError, match="no tag 't0'"):
        store.load("t0")
    with pytest.raises(tc.MissingFileError, match="no tag 't0'"):
        store.delete("t0")


def test_gc_keeps_the_delta_bases_of_live_tags(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    w = torch.randn(128, 128)
    states = []
    for i in range(4):
        w = w + 1e-4 * torch.randn(128, 128)
        states.append({"w": w.clone()})
        store.save(f"t{i}", states[-1])
    assert _deltas(store.stats()) >= 1
    for i in range(3):
        store.delete(f"t{i}")
    store.gc()
    assert tc.fingerprint(store.load("t3")) == tc.fingerprint(states[3])
    assert store.verify()["t3"] == tc.fingerprint(states[3])


def test_saving_a_tag_again_replaces_it(tmp_path):
    store = tc.Store(tmp_path / "s")
    store.save("t", {"x": torch.ones(3)})
    store.save("t", {"x": torch.zeros(3)})
    assert torch.equal(store.load("t")["x"], torch.zeros(3))
    assert store.tags() == ["t"]


def test_a_tag_is_a_name_not_a_path(tmp_path):
    store = tc.Store(tmp_path / "s")
    for bad in ["", "../x", "a/b", ".hidden", "x" * 201, "é", 3, None, "a\x00"]:
        with pytest.raises(tc.UsageError, match="not a tag name"):
            store.save(bad, {"x": 1})
    assert not (tmp_path / "x").exists()


def test_a_folder_that_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(tc.UsageError, match="not empty and not a tensorcanon store"):
        tc.Store(tmp_path).save("t", {"x": 1})
    with pytest.raises(tc.MissingFileError, match="no store"):
        tc.Store(tmp_path / "nothing").load("t")
    assert tc.Store(tmp_path / "nothing").tags() == []


# ------------------------------------------------------------------ load

def test_load_map_location_and_mmap(tmp_path):
    store = tc.Store(tmp_path / "s")
    obj = {"w": torch.arange(4096, dtype=torch.float32), "i": torch.arange(7), "n": np.ones(3)}
    store.save("t", obj)
    back = store.load("t", map_location="cpu", mmap=True)
    assert_same(back, obj)
    back["w"][0] = 5  # a private map: the blob is not changed
    assert store.verify("t") == tc.fingerprint(obj)
    assert_same(store.load("t", map_location=lambda t, d: t.double() if t.dtype == torch.float32 else None)["w"],
                obj["w"].double())
    with pytest.raises(tc.UsageError, match="mmap"):
        store.load("t", mmap="yes")


def test_mmap_views_a_raw_blob(tmp_path):
    store = tc.Store(tmp_path / "s")
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (64, 4096), dtype=torch.uint8, generator=g).view(torch.int32)  # incompressible: raw
    store.save("t", {"w": w})
    assert store.stats()["codecs"] == {"raw": 1}
    back = store.load("t", mmap=True)["w"]
    assert torch.equal(back, w)
    ((_, offset, _),) = packed(tmp_path / "s").values()
    storage_ptr = back.untyped_storage().data_ptr()
    assert back.data_ptr() - storage_ptr == offset + layout.header_room(b"int32[64,1024]", False)  # a view of the map


# ------------------------------------------------------------------ the hashing cache

class CountingHasher:
    def __init__(self, monkeypatch):
        from tensorcanon.format import digest

        self.bytes = 0
        real = digest.constructor

        def counted(algorithm):
            new = real(algorithm)

            def make(prefix):
                h = new(prefix)
                outer = self

                class H:
                    def update(self, data):
                        outer.bytes += memoryview(data).nbytes
                        h.update(data)

                    def digest(self):
                        return h.digest()

                return H()

            return make

        monkeypatch.setattr(digest, "constructor", counted)


def test_unchanged_tensors_are_not_hashed_again(tmp_path, monkeypatch):
    model = torch.nn.Linear(256, 256)
    for p in model.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(256, 2)
    store = tc.Store(tmp_path / "s")
    store.save("a", {"base": model.state_dict(), "head": head.state_dict()})
    counter = CountingHasher(monkeypatch)
    with torch.no_grad():
        head.weight.add_(1.0)
    store.save("b", {"base": model.state_dict(), "head": head.state_dict()})
    head_bytes = head.weight.numel() * 4
    # the head's weight is hashed (when saved, and checked as its blob is written); the base is not
    assert head_bytes <= counter.bytes <= 3 * head_bytes + 4 * 2
    assert tc.fingerprint(store.load("b")) == tc.fingerprint({"base": model.state_dict(), "head": head.state_dict()})


def test_an_in_place_change_is_seen_by_the_version_counter(tmp_path):
    w = torch.zeros(1000)
    store = tc.Store(tmp_path / "s")
    store.save("a", {"w": w})
    w.add_(1)  # in place: the version counter moves
    digest = store.save("b", {"w": w})
    assert digest == tc.fingerprint({"w": torch.ones(1000)})
    assert torch.equal(store.load("b")["w"], torch.ones(1000))


def test_a_new_tensor_at_a_freed_tensors_address_is_hashed(tmp_path):
    store = tc.Store(tmp_path / "s")
    for i in range(5):  # clones freed and allocated again (often at the same address, version 0)
        state = {"w": torch.full((4096,), float(i)).clone()}
        assert store.save(f"t{i}", state) == tc.fingerprint(state)
    for i in range(5):
        assert torch.equal(store.load(f"t{i}")["w"], torch.full((4096,), float(i)))


def test_a_change_behind_the_version_counter_is_refused_not_stored(tmp_path):
    # `.data` writes do not move the tensor's version counter: the cache cannot see them. The blob
    # written is hashed again, so the save fails instead of storing wrong bytes under a digest.
    store = tc.Store(tmp_path / "s")
    w = torch.zeros(1000)
    store.save("a", {"w": w})
    store.delete("a")
    store.gc()  # the blob of zeros is gone: the next save must write it
    w.data.add_(1)
    with pytest.raises(tc.IntegrityError, match="changed while it was being saved|version counter"):
        store.save("b", {"w": w})
    assert store.tags() == []


# ------------------------------------------------------------------ damage

def test_a_flipped_byte_anywhere_is_found_by_verify_and_refused_by_load(tmp_path):
    root = tmp_path / "s"
    store = tc.Store(root)
    obj = {"w": torch.randn(300, 300), "i": torch.arange(50000), "s": "x"}
    store.save("a", obj)
    w2 = {"w": obj["w"] + 1e-3, "i": obj["i"], "s": "x"}
    store.save("b", w2)
    files = blobs(root) + sorted((root / "tags").iterdir())
    where = packed(root)
    rng = np.random.default_rng(0)
    for path in files:
        data = path.read_bytes()
        for at in sorted({0, 9, 20, len(data) // 2, len(data) - 1, int(rng.integers(len(data)))}):
            damaged = bytearray(data)
            damaged[at] ^= 0x10
            path.write_bytes(bytes(damaged))
            try:
                with pytest.raises((tc.IntegrityError, tc.FormatError)):
                    tc.Store(root).verify()
                code = cli.main(["store", "verify", str(root)])
                assert code == 1, (path, at)
                failed = 0
                for tag in ("a", "b"):
                    try:
                        tc.Store(root).load(tag)
                    except (tc.IntegrityError, tc.FormatError):
                        failed += 1
                # (a byte of a pack outside its blobs and index, its padding, is found by verify only)
                uses = path.parent.name == "tags" or path.parent.name != "packs" or _in_a_blob(where, path, at)
                assert failed >= (1 if uses else 0), (path, at)
            finally:
                path.write_bytes(data)
    assert tc.Store(root).verify() == {"a": tc.fingerprint(obj), "b": tc.fingerprint(w2)}


def _in_a_blob(where, path, at):
    return any(p == path and o <= at < o + n for p, o, n in where.values())


# ------------------------------------------------------------------ the command line

def test_the_command_line(tmp_path, capsys):
    root = tmp_path / "s"
    store = tc.Store(root)
    d1 = store.save("step-1", model_state(1))
    store.save("step-2", model_state(2))
    assert cli.main(["store", "ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step-1" in out and d1 in out
    assert cli.main(["store", "verify", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in report["results"]] == ["ok"] * 4
    assert [sorted(r) for r in report["results"]][2:] == [["pack", "status"]] * 2  # one pack per save
    assert cli.main(["store", "verify", str(root), "step-1"]) == 0
    assert cli.main(["store", "export", str(root), "step-1", str(tmp_path / "o.safetensors")]) == 0
    assert (tmp_path / "o.safetensors").read_bytes() == tc.dumps(model_state(1))
    capsys.readouterr()
    assert cli.main(["store", "stats", str(root), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tags"] == 2 and stats["stored_bytes"] > 0 and stats["packs"] == 2 and stats["loose_blobs"] == 0
    assert cli.main(["store", "stats", str(root)]) == 0
    assert "packs          2  (" in capsys.readouterr().out
    store.delete("step-1")
    assert cli.main(["store", "gc", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted_blobs"] >= 1
    assert cli.main(["store", "verify", str(root), "no-such-tag"]) == 2
    assert "no tag 'no-such-tag'" in capsys.readouterr().err
    assert cli.main(["store", "ls", str(tmp_path / "nothing")]) == 2
    assert cli.main(["store", "export", str(root), "../x", str(tmp_path / "x")]) == 2
    assert "not a tag name" in capsys.readouterr().err


def test_verify_needs_no_torch_in_a_subprocess(tmp_path):
    store = tc.Store(tmp_path / "s")
    store.save("t", {"w": torch.randn(100)})
    code = ("import sys, tensorcanon; r = tensorcanon.Store(sys.argv[1]).verify(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(r)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "xxh3-128:" in proc.stdout


def test_new_blobs_written_on_workers_fail_in_order_and_list_no_tag(tmp_path):
    # A save encodes and writes its new blobs on worker threads: the first tensor that fails (in
    # the order of the tensors) is the error raised, and no tag is listed; the blobs that were
    # written are sound (each named by the digest of its bytes) and a later save uses them.
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(20000, generator=g) for _ in range(6)]
    store = tc.Store(tmp_path / "s")
    store.save("a", {"w": ws})
    store.delete("a")
    store.gc()
    ws[2].data.add_(1)  # behind the version counter: the cached digests of 2 and 4 are stale
    ws[4].data.add_(1)
    with pytest.raises(tc.IntegrityError, match=r"\$\[\"w\"\]\[2\]"):
        store.save("b", {"w": ws})
    assert store.tags() == []
    fresh = tc.Store(tmp_path / "s")
    assert fresh.save("c", {"w": ws}) == tc.fingerprint({"w": ws})
    assert tc.fingerprint(fresh.load("c")) == tc.fingerprint({"w": ws})
    assert fresh.verify() == {"c": tc.fingerprint({"w": ws})}


def test_a_damaged_blob_is_named_though_the_next_is_decoded_ahead(tmp_path):
    # Loading decodes the next compressed blob on another thread; a damaged blob is still the one
    # named, whichever is damaged, and a load after the damage is repaired gives the exact tensors.
    ws = [torch.zeros(50000) + i for i in range(4)]  # compressible: zstd blobs
    store = tc.Store(tmp_path / "s")
    store.save("a", {"w": ws})
    where = packed(tmp_path / "s")
    assert len(where) == 4
    for raw, (path, offset, length) in where.items():
        good = path.read_bytes()
        bad = bytearray(good)
        bad[offset + length - 3] ^= 0x40
        path.write_bytes(bytes(bad))
        with pytest.raises((tc.IntegrityError, tc.FormatError), match=raw.hex()):
            tc.Store(tmp_path / "s").load("a")
        path.write_bytes(good)
    assert tc.fingerprint(tc.Store(tmp_path / "s").load("a")) == tc.fingerprint({"w": ws})


def _deltas(stats):
    """Blobs stored as a delta of a base, by any delta codec (XOR, or the integer difference)."""
    return sum(stats["codecs"].get(c, 0) for c in ("delta", "delta-sub", "delta-twos"))


def test_the_command_line_exits_1_on_damage_every_action_finds(tmp_path, capsys):
    """Exit status as ``verify`` for every ``store`` action (docs/STORE.md): damage a command meets
    in the store's records, packs or blobs exits 1, naming it; an error (no such tag, a bad name) 2.
    (A pack whose index is damaged made ``stats`` exit 2, as if the command had been misused.)"""
    root = tmp_path / "s"
    store = tc.Store(root)
    store.save("step-1", model_state(1))
    pack = next((root / "packs").iterdir())
    data = pack.read_bytes()
    pack.write_bytes(data[:-8] + bytes(8))  # (its trailer: where the index is, how many entries)
    assert cli.main(["store", "verify", str(root)]) == 1
    damaged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("DAMAGED  ")]
    assert damaged and all(line.count(pack.name) == 1 for line in damaged), damaged  # (named once a line)
    for action in (["stats", str(root)], ["gc", str(root)], ["verify", str(root)],
                   ["export", str(root), "step-1", str(tmp_path / "o.safetensors")]):
        assert cli.main(["store", *action]) == 1, action
        got = capsys.readouterr()
        assert pack.name in got.out + got.err, (action, got)
    pack.write_bytes(data)
    record = root / "tags" / "step-1.safetensors"
    record.write_bytes(record.read_bytes()[:-1] + b"x")
    for action in (["ls", str(root)], ["export", str(root), "step-1", str(tmp_path / "o.safetensors")]):
        assert cli.main(["store", *action]) == 1, action
        assert "'step-1'" in capsys.readouterr().err
    assert cli.main(["store", "export", str(root), "no-such-tag", str(tmp_path / "x")]) == 2  # (errors: 2)
    assert cli.main(["store", "export", str(root), "../x", str(tmp_path / "x")]) == 2
