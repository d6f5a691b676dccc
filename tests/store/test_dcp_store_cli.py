"""The store's own tools on a sharded checkpoint's tag (docs/STORE.md, "Recipe: sharded checkpoints").

`store ls` and `store verify` print the digest `tensorcanon.dcp.save` returned (the logical digest,
which `tensorcanon verify DIR` prints for the same checkpoint saved to a directory), not the digest
of the record the tag holds; `store export` writes the directory, byte for byte; `stats` counts the
directory's bytes. Each answer is checked against a directory save of the same state, over several
world sizes and states, and against a record whose index lies.
"""

import json
import os

import pytest
import torch

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon.tools import cli

from helpers import rank_files
from states import logical_digest, sharded_state
from threaded import run_ranks


def run(capsys, *argv):
    """``tensorcanon ARGV --json`` in this process: its exit status and its JSON."""
    capsys.readouterr()
    code = cli.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


@pytest.mark.parametrize("world, seed", [(1, 0), (2, 1), (3, 2)])
def test_the_store_tools_answer_with_the_checkpoint_s_digest(tmp_path, capsys, world, seed):
    root, folder = str(tmp_path / "store"), str(tmp_path / "dir")
    there = run_ranks(world, lambda r: tcd.save(sharded_state(world, r, seed), tcd.StoreTag(tc.Store(root), "ckpt")))
    here = run_ranks(world, lambda r: tcd.save(sharded_state(world, r, seed), folder))
    assert there == here == [logical_digest(seed)] * world
    store = tc.Store(root)
    store.save("plain", {"w": torch.arange(6.0)})       # a file's tag beside it: shown as before
    code, out = run(capsys, "verify", folder)            # the directory, as `tensorcanon verify` reads it
    assert code == 0 and out["files"][0]["digest"] == logical_digest(seed)

    code, out = run(capsys, "store", "ls", root)
    assert code == 0
    rows = {r["tag"]: r for r in out["tags"]}
    assert rows["ckpt"] == {"tag": "ckpt", "digest": logical_digest(seed), "logical_bytes": folder_bytes(folder),
                            "kind": "sharded", "ranks": world}
    assert rows["plain"]["kind"] == "file" and rows["plain"]["ranks"] is None
    assert rows["plain"]["digest"] == tc.fingerprint({"w": torch.arange(6.0)})
    assert rows["plain"]["logical_bytes"] == len(tc.dumps({"w": torch.arange(6.0)}))

    code, out = run(capsys, "store", "verify", root, "ckpt")
    assert code == 0 and out["results"] == [{"tag": "ckpt", "status": "ok", "digest": logical_digest(seed)}]
    code, out = run(capsys, "store", "verify", root)     # the whole store
    assert code == 0
    assert {r["tag"]: r["digest"] for r in out["results"] if "tag" in r} == \
        {"ckpt": logical_digest(seed), "plain": tc.fingerprint({"w": torch.arange(6.0)})}

    code, out = run(capsys, "store", "export", root, "ckpt", str(tmp_path / "exported"))
    assert code == 0 and out["digest"] == logical_digest(seed)
    assert rank_files(str(tmp_path / "exported")) == rank_files(folder)    # byte for byte, index included
    capsys.readouterr()
    assert cli.main(["store", "export", root, "ckpt", str(tmp_path / "exported")]) == 2   # not damage
    assert "already holds a checkpoint" in capsys.readouterr().err

    stats = store.stats()
    assert stats["logical_bytes"] == folder_bytes(folder) + len(tc.dumps({"w": torch.arange(6.0)}))


def test_a_record_whose_index_lies_is_damage_to_every_tool(tmp_path, capsys):
    """A record rewritten with another checkpoint's index (sound blobs, a sound record file):
    `store verify` of the record and its blobs alone would pass; the tools read the checkpoint and
    report it damaged (exit 1), naming the tag."""
    root = str(tmp_path / "store")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, 0), tcd.StoreTag(tc.Store(root), "a")))
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, 1), tcd.StoreTag(tc.Store(root), "b")))
    store = tc.Store(root)
    record = store.load("a")
    store.save("lie", dict(record, index=store.load("b")["index"]))
    assert isinstance(store.verify("lie"), str)          # the record and its blobs are sound as such
    for argv in (["store", "verify", root, "lie"], ["store", "verify", root], ["store", "ls", root]):
        capsys.readouterr()
        code = cli.main(argv)
        text = capsys.readouterr()
        assert code == 1, (argv, text)
        assert "'lie'" in text.out + text.err and "Traceback" not in text.err
    capsys.readouterr()
    assert cli.main(["store", "export", root, "lie", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out" / "index.safetensors").exists()


def test_an_object_that_only_looks_like_a_record_is_a_file(tmp_path, capsys):
    """The record's keys with another `format`: an ordinary object, shown and exported as a file."""
    root = str(tmp_path / "store")
    obj = {"blobs": [torch.ones(2)], "format": "mine", "index": b"x", "layout": 1, "ranks": [b"y"]}
    tc.Store(root).save("t", obj)
    code, out = run(capsys, "store", "ls", root)
    assert code == 0 and out["tags"][0]["kind"] == "file" and out["tags"][0]["digest"] == tc.fingerprint(obj)
    code, out = run(capsys, "store", "export", root, "t", str(tmp_path / "t.safetensors"))
    assert code == 0 and (tmp_path / "t.safetensors").read_bytes() == tc.dumps(obj)


def test_no_export_into_the_store_s_own_folder(tmp_path, capsys):
    """An export into the store's folder (an empty folder of it, or through a symlink) is refused
    before anything is written: gc deletes what is not the store's, so the export would vanish."""
    root = tmp_path / "store"
    run_ranks(1, lambda r: tcd.save(sharded_state(1, r, 0), tcd.StoreTag(tc.Store(str(root)), "ckpt")))
    tc.Store(str(root)).save("plain", {"w": torch.ones(3)})
    os.symlink(root, tmp_path / "link")
    for out in (root / "tmp", root / "new-folder", tmp_path / "link" / "gc"):
        capsys.readouterr()
        assert cli.main(["store", "export", str(root), "ckpt", str(out)]) == 2
        assert "inside the store's folder" in capsys.readouterr().err
    for out in (root / "tmp" / "plain.safetensors", tmp_path / "link" / "plain.safetensors"):
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tc.Store(str(root)).export("plain", str(out))
    assert not (root / "new-folder").exists() and not (root / "plain.safetensors").exists()
    assert os.listdir(root / "tmp") == []
    assert cli.main(["store", "verify", str(root)]) == 0
