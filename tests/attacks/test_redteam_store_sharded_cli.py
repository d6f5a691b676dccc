"""Red team (rtsharded): the store's command line on tags saved by ``tensorcanon.dcp.save(state,
StoreTag(store, tag))`` (docs/CLI.md "store"; docs/STORE.md "Recipe: sharded checkpoints" and "Recipe:
`store verify` in CI"; docs/DISTRIBUTED.md "In a store"; FORMAT.md §14.10), attacked from those docs.

The promises: `store ls` prints such a tag's logical digest, its directory's bytes and its ranks; `store
verify` checks the record and its blobs, then the checkpoint, and exits 0 / 1 damaged / 2 error; `store
export ROOT TAG DIR` writes the directory into a new or empty local folder; `Store.stats()` counts the
directory's bytes. A dict of the record's five keys with `format` "tensorcanon-dcp-checkpoint" is a
sharded checkpoint, anything else a file. Every record here is forged through the public `Store.save`
(the record is an ordinary tag's object) from honest ones. Each answer: the documented exit status,
the tag named, no traceback, JSON that parses, no wrong "ok".
"""

from __future__ import annotations

import json
import os
import threading
import uuid

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon.tools import cli

from helpers import Shard, distribute_tensor, rank_files
from threaded import run_ranks

FULL = torch.arange(12, dtype=torch.float32).reshape(6, 2)


def small_state(world, rank, full=FULL):
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "step": 1, "rng": tcd.PerRank(rank)}


def save(root, tag, world=2, full=FULL):
    return run_ranks(world, lambda r: tcd.save(small_state(world, r, full), tcd.StoreTag(tc.Store(root), tag)))[0]


def save_dir(folder, world=2, full=FULL, **kw):
    return run_ranks(world, lambda r: tcd.save(small_state(world, r, full), str(folder), **kw))[0]


def folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


@pytest.fixture
def two(tmp_path):
    """A store holding "a" (2 ranks), "b" (2 ranks, other values) and "c" (3 ranks), all honest."""
    root = str(tmp_path / "store")
    digests = {"a": save(root, "a"), "b": save(root, "b", full=FULL + 100), "c": save(root, "c", world=3)}
    store = tc.Store(root)
    return store, {t: store.load(t) for t in "abc"}, digests


def call(capsys, *argv):
    """``tensorcanon ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, (argv, out.err)
    return code, out.out, out.err


def call_json(capsys, *argv):
    """With --json: stdout holds JSON, or nothing where the command stopped on an error (the
    error on stderr, docs/CLI.md: "errors ... go to stderr"); then ``None``."""
    code, out, err = call(capsys, *argv, "--json")
    if code != 0 and not out:
        assert err.startswith("tensorcanon: "), (argv, err)
        return code, None, err
    try:
        doc = json.loads(out)
    except ValueError:
        raise AssertionError(f"{argv} --json printed no JSON (exit {code}): {out!r} / {err!r}") from None
    return code, doc, err


def assert_damaged(capsys, store, tag, tmp_path, *, ls=True, stats=None):
    """Every action of the store's command line on a damaged sharded tag: exit 1, the tag named, no
    traceback, JSON that parses; ``ls`` must be 1 where the record cannot give a digest (``ls=True``),
    else 0 or 1; ``stats`` likewise (None: 0 or 1, True: 1)."""
    root = store.root
    name = f"'{tag}'"

    def named(text):
        return name in text or f"tag {tag}:" in text or f"tag {tag} " in text
    for argv in (["store", "verify", root, tag], ["store", "verify", root]):
        code, out, err = call(capsys, *argv)
        assert code == 1, (argv, code, out, err)
        assert named(out + err), (argv, out, err)
        code, doc, err = call_json(capsys, *argv)
        assert code == 1, (argv, doc, err)
        assert doc is not None, (argv, err)          # verify reports damage as results
        rows = [r for r in doc["results"] if r.get("tag") == tag]
        assert rows and all(r["status"] != "ok" for r in rows), (argv, doc)
    for action, strict in (("ls", ls), ("stats", stats)):   # (strict: the damage is theirs to report)
        code, out, err = call(capsys, "store", action, root)
        assert (code == 1 and named(out + err)) if strict else code in (0, 1), (action, code, out, err)
        code, doc, err = call_json(capsys, "store", action, root)
        assert code in ((1,) if strict else (0, 1)), (action, doc, err)
    out_dir = tmp_path / f"exported-{tag}-{uuid.uuid4().hex[:6]}"
    code, out, err = call(capsys, "store", "export", root, tag, str(out_dir))
    assert code == 1 and named(out + err), (code, out, err)
    assert not out_dir.exists() or os.listdir(out_dir) == [], os.listdir(out_dir)   # nothing half-written
    code, doc, err = call_json(capsys, "store", "export", root, tag, str(tmp_path / f"j-{uuid.uuid4().hex[:6]}"))
    assert code == 1, (doc, err)
    if stats:
        with pytest.raises(tc.TensorCanonError, match=name):
            store.stats()


def forge(store, tag, record, **changes):
    store.save(tag, dict(record, **changes))


# ----------------------------------------------------------------- honest tags

def test_honest_tags_in_a_memory_store(capsys, tmp_path):
    """memory:// store: ls/verify/export/stats answer with the checkpoint, as for a folder."""
    root = f"memory://rtsharded-{uuid.uuid4().hex}"
    digest = save(root, "m")
    folder = tmp_path / "dir"
    assert save_dir(folder) == digest
    code, doc, _ = call_json(capsys, "store", "ls", root)
    assert code == 0 and doc["tags"] == [{"tag": "m", "digest": digest, "logical_bytes": folder_bytes(folder),
                                          "kind": "sharded", "ranks": 2}]
    code, doc, _ = call_json(capsys, "store", "verify", root, "m")
    assert code == 0 and doc["results"] == [{"tag": "m", "status": "ok", "digest": digest}]
    code, doc, _ = call_json(capsys, "store", "export", root, "m", str(tmp_path / "out"))
    assert code == 0 and doc["digest"] == digest
    assert rank_files(str(tmp_path / "out")) == rank_files(str(folder))
    assert tc.Store(root).stats()["logical_bytes"] == folder_bytes(folder)
    code, doc, _ = call_json(capsys, "store", "stats", root)
    assert code == 0 and doc["logical_bytes"] == folder_bytes(folder)


def test_an_honest_copy_under_another_tag(two, capsys):
    store, rec, digests = two
    forge(store, "copy", rec["b"])
    code, doc, _ = call_json(capsys, "store", "verify", store.root, "copy")
    assert code == 0 and doc["results"][0]["digest"] == digests["b"]


# ----------------------------------------------------------------- ranks

@pytest.mark.parametrize("what", ["swapped", "truncated", "header-only-8", "empty-bytes", "duplicated",
                                  "empty-list", "one-of-two", "three-of-two", "whole-file", "other-ckpt"])
def test_rank_headers_that_lie(two, capsys, tmp_path, what):
    store, rec, _ = two
    r0, r1 = rec["a"]["ranks"]
    ranks = {"swapped": [r1, r0], "truncated": [r0[:-1], r1], "header-only-8": [r0[:8], r1],
             "empty-bytes": [b"", r1], "duplicated": [r0, r0], "empty-list": [], "one-of-two": [r0],
             "three-of-two": [r0, r1, r1], "whole-file": [r0 + b"\0" * 64, r1],
             "other-ckpt": list(rec["b"]["ranks"])}[what]
    forge(store, "x", rec["a"], ranks=ranks)
    assert_damaged(capsys, store, "x", tmp_path)


@pytest.mark.parametrize("field, value", [
    *[("ranks", v) for v in ([b"x"] * 10**6, ["s", "t"], [1, 2], [None, None],
                             [torch.zeros(3, dtype=torch.uint8)] * 2, b"joined", "text", 2, None, {"0": b"x"},
                             [[b"x"], [b"y"]])],
    *[("index", v) for v in ("text", 1, None, [b"x"], torch.zeros(4, dtype=torch.uint8))],
], ids=lambda v: repr(v)[:40])
def test_fields_of_the_wrong_type_or_count(two, capsys, tmp_path, field, value):
    """``ranks`` and ``index`` of every wrong type, and a million rank headers (under the bound of
    2^20 ranks, each one a few bytes): damage, stats included."""
    store, rec, _ = two
    forge(store, "x", rec["a"], **{field: value})
    assert_damaged(capsys, store, "x", tmp_path, stats=True)


def test_a_rank_header_claiming_a_terabyte(two, capsys, tmp_path):
    """Rank 0's header JSON rewritten so its last tensor ends 1 TiB past the start: the directory's
    claimed bytes must not be reported, nor written by export (no 1 TiB sparse file)."""
    store, rec, _ = two
    r0, r1 = rec["a"]["ranks"]
    n = int.from_bytes(r0[:8], "little")
    header = json.loads(r0[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    last = max(names, key=lambda k: header[k]["data_offsets"][1])
    start = header[last]["data_offsets"][0]
    header[last]["data_offsets"] = [start, start + 2**40]
    header[last]["shape"] = [2**38]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    forge(store, "x", rec["a"], ranks=[len(text).to_bytes(8, "little") + text, r1])
    assert_damaged(capsys, store, "x", tmp_path)
    code, doc, _ = call_json(capsys, "store", "ls", store.root)
    assert doc is None or all(r.get("logical_bytes") is None or r["logical_bytes"] < 2**30 for r in doc["tags"])
    for dirpath, _, files in os.walk(tmp_path):
        for f in files:
            assert os.path.getsize(os.path.join(dirpath, f)) < 2**30, (dirpath, f)


# ----------------------------------------------------------------- index

@pytest.mark.parametrize("what", ["garbage", "empty", "truncated", "plain-file", "other-ckpt", "world-3",
                                  "record-as-index"])
def test_indexes_that_are_not_this_checkpoint_s(two, capsys, tmp_path, what):
    store, rec, _ = two
    index = {"garbage": b"\xff" * 100, "empty": b"", "truncated": rec["a"]["index"][:-9],
             "plain-file": tc.dumps({"files": [1, 2]}), "other-ckpt": rec["b"]["index"],
             "world-3": rec["c"]["index"], "record-as-index": tc.dumps(rec["a"])}[what]
    forge(store, "x", rec["a"], index=index)
    assert_damaged(capsys, store, "x", tmp_path)


def test_an_index_of_sha256(two, capsys, tmp_path):
    """The index of the same checkpoint saved to a directory with sha256 digests."""
    store, rec, _ = two
    save_dir(tmp_path / "sha", algorithm="sha256")
    index = (tmp_path / "sha" / "index.safetensors").read_bytes()
    forge(store, "x", rec["a"], index=index)
    assert_damaged(capsys, store, "x", tmp_path)


def test_a_huge_index(two, capsys, tmp_path):
    store, rec, _ = two
    forge(store, "x", rec["a"], index=rec["a"]["index"] + b"\0" * 4_000_000)
    assert_damaged(capsys, store, "x", tmp_path)


def test_index_and_ranks_of_a_3_rank_checkpoint_with_this_blob_list(two, capsys, tmp_path):
    store, rec, _ = two
    forge(store, "x", rec["a"], index=rec["c"]["index"], ranks=rec["c"]["ranks"])
    assert_damaged(capsys, store, "x", tmp_path)


# ----------------------------------------------------------------- layout, format, blobs

@pytest.mark.parametrize("layout", [2, 0, -1, True, 1.0, "1", None, 2**70], ids=repr)
def test_layouts_other_than_the_int_1(two, capsys, tmp_path, layout):
    store, rec, _ = two
    forge(store, "x", rec["a"], layout=layout)
    assert_damaged(capsys, store, "x", tmp_path)


@pytest.mark.parametrize("what", ["missing-one", "extra-one", "empty", "twice", "reversed"])
def test_blob_lists_that_lie(two, capsys, tmp_path, what):
    store, rec, _ = two
    blobs = list(rec["a"]["blobs"])
    blobs = {"missing-one": blobs[:-1], "extra-one": blobs + [torch.full((9,), 3.5)], "empty": [],
             "twice": blobs + blobs[-1:], "reversed": blobs[::-1]}[what]
    if what == "reversed" and len(blobs) < 2:
        pytest.skip("one blob")
    forge(store, "x", rec["a"], blobs=blobs)
    assert_damaged(capsys, store, "x", tmp_path)


@pytest.mark.parametrize("blobs", ["text", [1, 2], None, b"x", {"a": torch.ones(2)}], ids=repr)
def test_blob_lists_of_the_wrong_type(two, capsys, tmp_path, blobs):
    store, rec, _ = two
    forge(store, "x", rec["a"], blobs=blobs)
    assert_damaged(capsys, store, "x", tmp_path)


def test_headers_naming_blobs_the_store_no_longer_has(two, capsys, tmp_path):
    """ranks and index of "b", blob list of "a"; "b" deleted and collected: the headers name blobs
    that are gone (the record's own blob list is still sound as a store's)."""
    store, rec, _ = two
    forge(store, "x", rec["a"], index=rec["b"]["index"], ranks=rec["b"]["ranks"])
    store.delete("b")
    call(capsys, "store", "gc", store.root)
    assert_damaged(capsys, store, "x", tmp_path)


@pytest.mark.parametrize("obj", [
    {"blobs": [], "format": "x", "index": b"", "layout": 1, "ranks": [b""]},
    {"blobs": [], "format": b"tensorcanon-dcp-checkpoint", "index": b"", "layout": 1, "ranks": [b""]},
    {"blobs": [], "format": "tensorcanon-dcp-checkpoint", "index": b"", "layout": 1, "ranks": [b""], "more": 1},
    {"blobs": [], "format": "tensorcanon-dcp-checkpoint", "index": b"", "layout": 1},
    {"blob": [], "format": "tensorcanon-dcp-checkpoint", "index": b"", "layout": 1, "ranks": [b""]},
    [{"blobs": [], "format": "tensorcanon-dcp-checkpoint", "index": b"", "layout": 1, "ranks": [b""]}],
    "tensorcanon-dcp-checkpoint",
], ids=["format-x", "format-bytes", "six-keys", "four-keys", "other-key", "in-a-list", "the-string"])
def test_objects_that_are_files(tmp_path, capsys, obj):
    root = str(tmp_path / "store")
    tc.Store(root).save("t", obj)
    code, doc, _ = call_json(capsys, "store", "ls", root)
    assert code == 0 and doc["tags"] == [{"tag": "t", "digest": tc.fingerprint(obj),
                                          "logical_bytes": len(tc.dumps(obj)), "kind": "file", "ranks": None}]
    code, doc, _ = call_json(capsys, "store", "verify", root)
    assert code == 0
    code, doc, _ = call_json(capsys, "store", "export", root, "t", str(tmp_path / "t.safetensors"))
    assert code == 0 and (tmp_path / "t.safetensors").read_bytes() == tc.dumps(obj)
    assert tc.Store(root).stats()["logical_bytes"] == len(tc.dumps(obj))


def test_the_record_s_keys_all_of_the_wrong_type(tmp_path, capsys):
    """format right, the other four keys anything: a sharded checkpoint, damaged; never a file, never ok."""
    root = str(tmp_path / "store")
    store = tc.Store(root)
    store.save("x", {"blobs": "b", "format": "tensorcanon-dcp-checkpoint", "index": 3, "layout": "1", "ranks": 4.5})
    assert_damaged(capsys, store, "x", tmp_path, stats=True)


# ----------------------------------------------------------------- export targets

@pytest.fixture
def one(tmp_path):
    root = str(tmp_path / "store")
    digest = save(root, "a")
    return root, digest


def test_export_into_a_path_that_is_a_file(one, tmp_path, capsys):
    root, _ = one
    (tmp_path / "f").write_bytes(b"mine")
    code, out, err = call(capsys, "store", "export", root, "a", str(tmp_path / "f"))
    assert code == 2 and str(tmp_path / "f") in err, (code, out, err)
    assert (tmp_path / "f").read_bytes() == b"mine"
    code, out, err = call(capsys, "store", "export", root, "a", str(tmp_path / "f" / "sub"))
    assert code == 2 and "a" in err, (code, out, err)


def test_export_into_a_folder_holding_other_files(one, tmp_path, capsys):
    root, _ = one
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_bytes(b"mine")
    code, out, err = call(capsys, "store", "export", root, "a", str(tmp_path / "full"))
    assert code == 2 and str(tmp_path / "full") in err, (code, out, err)
    assert os.listdir(tmp_path / "full") == ["notes.txt"]


def test_export_into_a_folder_holding_a_partial_checkpoint(one, tmp_path, capsys):
    """Rank files without an index (a directory save that died): not new, not empty: exit 2."""
    root, _ = one
    save_dir(tmp_path / "d")
    os.remove(tmp_path / "d" / "index.safetensors")
    before = rank_files(str(tmp_path / "d"))
    code, out, err = call(capsys, "store", "export", root, "a", str(tmp_path / "d"))
    assert code == 2, (code, out, err)
    assert rank_files(str(tmp_path / "d")) == before


def test_export_into_the_store_itself(one, capsys):
    root, _ = one
    code, out, err = call(capsys, "store", "export", root, "a", root)
    assert code == 2, (code, out, err)
    code, doc, _ = call_json(capsys, "store", "verify", root)
    assert code == 0


def test_export_into_a_memory_url(one, capsys):
    root, _ = one
    code, out, err = call(capsys, "store", "export", root, "a", f"memory://rtsharded-{uuid.uuid4().hex}/d")
    assert code == 2 and "memory://" in err, (code, out, err)


def test_export_through_a_symlink_to_an_empty_folder(one, tmp_path, capsys):
    root, digest = one
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    code, out, err = call(capsys, "store", "export", root, "a", str(tmp_path / "link"))
    assert code in (0, 2), (code, out, err)
    if code == 0:
        assert tcd.verify(str(tmp_path / "real")) == digest


def test_export_into_new_nested_folders_and_an_empty_one(one, tmp_path, capsys):
    root, digest = one
    save_dir(tmp_path / "ref")
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        code, doc, err = call_json(capsys, "store", "export", root, "a", str(target))
        assert code in (0, 2), (code, doc, err)
        if code == 0:
            assert doc["digest"] == digest and rank_files(str(target)) == rank_files(str(tmp_path / "ref"))
    assert rank_files(str(tmp_path / "empty")) == rank_files(str(tmp_path / "ref"))


def test_export_of_a_sharded_tag_twice_with_json(one, tmp_path, capsys):
    root, _ = one
    assert call_json(capsys, "store", "export", root, "a", str(tmp_path / "o"))[0] == 0
    code, doc, err = call_json(capsys, "store", "export", root, "a", str(tmp_path / "o"))
    assert code == 2, (doc, err)


# ----------------------------------------------------------------- tags and errors

def test_verify_a_missing_tag_beside_a_sharded_one(one, capsys):
    root, digest = one
    code, out, err = call(capsys, "store", "verify", root, "a", "nope")
    assert code == 2 and "'nope'" in out + err, (code, out, err)
    code, doc, err = call_json(capsys, "store", "export", root, "nope", "/nonexistent-dir-rtsharded")
    assert code == 2 and "'nope'" in err


def test_verify_a_good_and_a_damaged_sharded_tag(two, capsys):
    store, rec, digests = two
    forge(store, "x", rec["a"], ranks=rec["a"]["ranks"][::-1])
    code, doc, _ = call_json(capsys, "store", "verify", store.root, "a", "x")
    assert code == 1
    rows = {r["tag"]: r for r in doc["results"] if "tag" in r}
    assert rows["a"] == {"tag": "a", "status": "ok", "digest": digests["a"]}
    assert rows["x"]["status"] != "ok"


def test_gc_keeps_a_damaged_sharded_tag_s_blobs(two, capsys, tmp_path):
    """A record whose checkpoint lies is still a record: gc keeps every blob it names (b's, here,
    after b is deleted), and neither crashes nor says more than 0/1."""
    store, rec, digests = two
    forge(store, "x", rec["b"], index=rec["a"]["index"])
    store.delete("b")
    code, out, err = call(capsys, "store", "gc", store.root)
    assert code in (0, 1), (code, out, err)
    forge(store, "b2", rec["b"])
    code, doc, _ = call_json(capsys, "store", "verify", store.root, "b2")
    assert code == 0 and doc["results"][0]["digest"] == digests["b"]


@pytest.mark.parametrize("action, where", [
    ("ls", "_tags"),                   # deleted once listed
    ("verify", "_tags"),
    ("stats", "_tags"),
    ("verify", "claims"),              # deleted after the store's check of its record, before the checkpoint's
    ("stats", "claims_header"),        # deleted after its record was read, before its directory was sized
    ("verify", "store_index"),         # deleted and its blobs collected after its record was read
])
def test_a_tag_deleted_while_the_tools_read_the_store(two, capsys, monkeypatch, action, where):
    """Another writer deletes the sharded tag "c" while a whole-store action runs: the tools skip it
    (it is not a tag any more), as they do a file's tag; they never report damage nor stop with an
    error (`ls` said "has no tag 'c'", exit 2)."""
    from tensorcanon.store import sharded

    store, rec, _ = two
    deleted = []
    owner = tc.Store if where == "_tags" else sharded
    real = getattr(owner, where)

    def delete_c(*a, **k):
        out = real(*a, **k)
        if where == "store_index" and a[0].tag == "c":
            deleted.append(True)
            tc.Store(store.root).delete("c")
            tc.Store(store.root).gc()
            return out
        if not deleted and ("c" in out if where == "_tags" else "c" in a):
            deleted.append(True)
            tc.Store(store.root).delete("c")
        return out

    monkeypatch.setattr(owner, where, delete_c)
    code, doc, err = call_json(capsys, "store", action, store.root)
    assert deleted, f"'c' was not read through {where}"
    assert code == 0, (code, doc, err)
    if action == "ls":
        assert [r["tag"] for r in doc["tags"]] == ["a", "b"]
    if action == "verify":
        assert [r["tag"] for r in doc["results"] if "tag" in r] == ["a", "b"]
    if action == "stats":
        assert doc["tags"] == 2


def test_sharded_tags_deleted_by_a_thread_while_the_tools_run(two, capsys):
    """A thread deletes 30 sharded tags one by one while ls, verify and stats run: each tag is
    there or gone, never an error, never damage (deleted only: a tag saved again meanwhile is
    another question)."""
    store, rec, _ = two
    names = [f"copy{i}" for i in range(30)]
    for n in names:
        store.save(n, rec["c"])
    done = threading.Event()

    def delete():
        s = tc.Store(store.root)
        for n in names:
            s.delete(n)
            done.wait(0.01)

    t = threading.Thread(target=delete, daemon=True)
    t.start()
    try:
        while t.is_alive():
            for argv in (["store", "ls", store.root], ["store", "verify", store.root], ["store", "stats", store.root]):
                code, out, err = call(capsys, *argv)
                assert code == 0, (argv, code, out, err)
    finally:
        done.set()
        t.join(30)
    assert not t.is_alive()


def test_a_flipped_blob_byte_of_the_last_rank(tmp_path, capsys):
    """Sound record, damaged blob of rank 1 (found only while export writes rank 1's file): every
    action reports it (exit 1, the tag named), and export leaves nothing behind, so the same command
    works once the store is repaired (export takes only a new or empty folder)."""
    root = str(tmp_path / "store")
    full = torch.randn(6, 2, generator=torch.Generator().manual_seed(3))
    save(root, "r", full=full)
    chunk = full[3:].contiguous().numpy().tobytes()
    hits = [p for p in sorted((tmp_path / "store").rglob("*")) if p.is_file() and chunk in p.read_bytes()]
    assert len(hits) == 1
    data = bytearray(hits[0].read_bytes())
    data[data.find(chunk) + 5] ^= 0x10
    hits[0].write_bytes(bytes(data))
    store = tc.Store(root)
    assert_damaged(capsys, store, "r", tmp_path, ls=False)


@pytest.mark.parametrize("layout", [True, 1.0, "1", None], ids=repr)
def test_a_layout_that_is_not_an_int_is_damage_not_a_newer_layout(two, capsys, layout):
    """`True == 1` and `1.0 == 1` in Python: refused, and as damage (no "upgrade tensorcanon": no
    later writer writes such a record)."""
    store, rec, _ = two
    forge(store, "x", rec["a"], layout=layout)
    code, out, err = call(capsys, "store", "verify", store.root, "x")
    assert code == 1 and "'layout' must be an int" in out and "upgrade" not in out, out


def test_an_index_that_is_no_file_is_named_once(two, capsys):
    store, rec, _ = two
    forge(store, "x", rec["a"], index=b"\xff" * 100)
    code, out, err = call(capsys, "store", "verify", store.root, "x")
    assert code == 1 and "its index: not a safetensors or tensorcanon file" in out, out
    assert "its index: its index" not in out and "tensorcanon-dcp-" not in out, out


def test_damaged_records_in_a_memory_store(capsys, tmp_path):
    root = f"memory://rtsharded-{uuid.uuid4().hex}"
    save(root, "a")
    store = tc.Store(root)
    rec = store.load("a")
    forge(store, "x", rec, ranks=rec["ranks"][::-1])
    assert_damaged(capsys, store, "x", tmp_path)
    store.delete("x")
    forge(store, "y", rec, ranks="no")
    assert_damaged(capsys, store, "y", tmp_path, stats=True)


def test_plain_files_headers_under_a_consistent_index(two, capsys, tmp_path):
    """Every field agrees with every other (the index's `files` are the rank headers' digests, the
    blob list is what they name, the blobs are in the store) but the rank "files" are plain saves of
    other objects: not the checkpoint's rank files."""
    store, rec, _ = two
    objs = [{"w": torch.arange(6.0)}, {"w": torch.arange(6.0) + 1}]
    heads, blobs = [], {}
    for i, obj in enumerate(objs):
        store.save(f"plain{i}", obj)                  # (their blobs, in the store)
        data = tc.dumps(obj)
        n = int.from_bytes(data[:8], "little")
        heads.append(data[:8 + n])
        for row in tc.open(data).manifest.tensors:
            blobs[row.digest] = obj["w"]
    index = tc.loads(rec["a"]["index"])
    index["files"] = [tc.fingerprint(o) for o in objs]
    forge(store, "x", rec["a"], index=tc.dumps(index), ranks=heads, blobs=[blobs[k] for k in sorted(blobs)])
    assert_damaged(capsys, store, "x", tmp_path, ls=False)


def test_a_record_file_flipped_on_disk(two, capsys, tmp_path):
    store, rec, _ = two
    forge(store, "x", rec["a"])
    path = tmp_path / "store" / "tags" / "x.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert_damaged(capsys, store, "x", tmp_path)


def test_the_cli_on_damaged_sharded_tags_in_a_subprocess(two, tmp_path):
    """One real process per command (no in-process state): exit codes, the tag named, no traceback."""
    import subprocess
    import sys

    store, rec, _ = two
    forge(store, "x", rec["a"], ranks=rec["a"]["ranks"][::-1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(tc.__path__[0]),
                                                                   os.environ.get("PYTHONPATH")) if p))
    script = ("import sys; from tensorcanon.tools import cli; "
              "sys.exit(cli.main(sys.argv[1:]))")
    for argv, want in ((["store", "verify", store.root, "x"], 1), (["store", "ls", store.root], 1),
                       (["store", "export", store.root, "x", str(tmp_path / "o")], 1),
                       (["store", "export", store.root, "a", str(tmp_path / "store")], 2),
                       (["store", "verify", store.root, "a"], 0)):
        p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == want, (argv, p.returncode, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr, (argv, p.stderr)
        if want:
            assert "'x'" in p.stdout + p.stderr or "tag x" in p.stdout or "store" in p.stderr, (argv, p.stderr)
