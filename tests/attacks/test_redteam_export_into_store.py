"""Red team (rtexport): no export writes inside the store's own folder (docs/STORE.md, "Recipe: sharded
checkpoints"; docs/CLI.md "store"; CHANGELOG "Unreleased"). `Store.export`, `store export` (exit 2) and
`tensorcanon.dcp.export` refuse a destination inside the store's folder with UsageError (symlinks
resolved) before writing anything; a destination outside it works as before. Attacked from the docs:
relative paths, `..`, symlinks both ways, a symlinked or URL-named root, odd bytes, loops, NUL."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon.tools import cli

from states import logical_digest, sharded_state
from threaded import run_ranks

OBJ = {"w": torch.arange(5.0)}


def tree(root) -> dict:
    """Every entry under ``root`` (links not followed) with its size: what 'nothing written' compares."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = os.lstat(p).st_size if n in filenames else -1
    return out


@pytest.fixture()
def store(tmp_path):
    root = tmp_path / "store"
    run_ranks(1, lambda r: tcd.save(sharded_state(1, r, 0), tcd.StoreTag(tc.Store(str(root)), "ckpt")))
    tc.Store(str(root)).save("plain", OBJ)
    return root


def refused_everywhere(root, store_arg, dests, capsys):
    """Each destination is refused by all three entry points, naming it; nothing is written."""
    before = tree(root)
    for dest in dests:
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tc.Store(store_arg).export("plain", dest)
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tcd.export(tcd.StoreTag(tc.Store(store_arg), "ckpt"), dest)
        for tag in ("plain", "ckpt"):
            capsys.readouterr()
            assert cli.main(["store", "export", store_arg, tag, dest]) == 2, dest
            err = capsys.readouterr().err
            assert "inside the store's folder" in err and "Traceback" not in err
        assert tree(root) == before, dest
    capsys.readouterr()
    assert cli.main(["store", "verify", str(root)]) == 0


def test_relative_paths_from_inside_the_store(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(store)
    refused_everywhere(store, str(store), ["x", "./x", "tmp/x", "./new/deep/x"], capsys)
    (tmp_path / "side").mkdir()
    monkeypatch.chdir(tmp_path / "side")
    refused_everywhere(store, str(store), ["../store/tmp/x", "../store/x", "../side/../store/y"], capsys)


def test_dotdot_components_and_trailing_slashes(store, tmp_path, capsys):
    s = str(store)
    refused_everywhere(store, s, [s + "/tmp/../x", str(tmp_path) + "/other/../store/x", s + "/tmp/x/",
                                  s + "//tmp//x", s + "/./x"], capsys)


def test_the_store_root_itself(store, capsys):
    s = str(store)
    refused_everywhere(store, s, [s, s + "/", s + "/.", s + "/tmp/.."], capsys)


def test_a_relative_store_root(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    refused_everywhere(store, "store", [str(store / "x"), "store/x", "./store/tmp/x"], capsys)
    refused_everywhere(store, "./store/", [str(store / "x"), "store/x"], capsys)
    refused_everywhere(store, str(tmp_path / "z" / ".." / "store"), [str(store / "x")], capsys)


def test_symlinked_store_root(store, tmp_path, capsys):
    os.symlink(store, tmp_path / "alias")
    alias = str(tmp_path / "alias")
    refused_everywhere(store, alias, [str(store / "x"), alias + "/x", alias + "/new/x"], capsys)
    refused_everywhere(store, str(store), [alias + "/x", alias], capsys)


def test_dangling_and_chained_symlinks_into_the_store(store, tmp_path, capsys):
    os.symlink(store / "not-yet", tmp_path / "dangling")          # the final component, not there yet
    os.symlink(tmp_path / "dangling", tmp_path / "chain")
    os.symlink(store / "gone" / "deeper", tmp_path / "deep-dangling")
    refused_everywhere(store, str(store), [str(tmp_path / "dangling"), str(tmp_path / "chain"),
                                           str(tmp_path / "deep-dangling" / "x")], capsys)
    assert not (store / "not-yet").exists() and not (store / "gone").exists()


def test_non_utf8_names(store, tmp_path, capsys):
    odd = os.fsdecode(b"\xff\xfe-x")
    refused_everywhere(store, str(store), [os.path.join(str(store), odd), os.path.join(str(store), odd, "y")],
                       capsys)
    out = os.path.join(str(tmp_path), odd)                         # outside: works
    assert tc.Store(str(store)).export("plain", out) == tc.fingerprint(OBJ)
    assert tcd.export(tcd.StoreTag(tc.Store(str(store)), "ckpt"), out + "-dir") == logical_digest(0)


def test_file_url_into_the_store(store, capsys):
    before = tree(store)
    for dest in ("file://" + str(store / "x.safetensors"), "file://" + str(store / "tmp" / "x")):
        with pytest.raises(tc.TensorCanonError):
            tc.Store(str(store)).export("plain", dest)
        with pytest.raises(tc.TensorCanonError):
            tcd.export(tcd.StoreTag(tc.Store(str(store)), "ckpt"), dest)
        capsys.readouterr()
        assert cli.main(["store", "export", str(store), "plain", dest]) == 2
        assert "Traceback" not in capsys.readouterr().err
    assert tree(store) == before


def test_a_file_url_store_root(store, capsys):
    """The store named as a file:// URL is the same folder: a plain path into it is refused."""
    refused_everywhere(store, "file://" + str(store), [str(store / "x"), str(store / "tmp" / "x")], capsys)


def test_siblings_with_the_store_s_name_as_prefix_and_the_parent_work(store, tmp_path):
    s = tc.Store(str(store))
    for name in ("store-other", "storex", "store.d"):
        assert s.export("plain", str(tmp_path / name)) == tc.fingerprint(OBJ)
        assert tcd.export(tcd.StoreTag(s, "ckpt"), str(tmp_path / (name + "-dir"))) == logical_digest(0)
    assert s.export("plain", str(tmp_path / "p.safetensors")) == tc.fingerprint(OBJ)
    assert tc.load(str(tmp_path / "p.safetensors"))["w"].equal(OBJ["w"])
    assert tcd.export(tcd.StoreTag(s, "ckpt"), str(tmp_path / "d")) == logical_digest(0)


def test_a_symlink_inside_the_store_pointing_out_resolves_outside(store, tmp_path):
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", store / "out-link")
    s = tc.Store(str(store))
    assert s.export("plain", str(store / "out-link" / "p.safetensors")) == tc.fingerprint(OBJ)
    assert (tmp_path / "outside" / "p.safetensors").read_bytes() == tc.dumps(OBJ)


def test_memory_store_to_a_local_path_and_local_store_to_memory(store, tmp_path, capsys):
    url = f"memory://rtexport-{uuid.uuid4().hex}"
    run_ranks(1, lambda r: tcd.save(sharded_state(1, r, 0), tcd.StoreTag(tc.Store(url), "ckpt")))
    mem = tc.Store(url)
    mem.save("plain", OBJ)
    assert mem.export("plain", str(tmp_path / "m.safetensors")) == tc.fingerprint(OBJ)
    assert tcd.export(tcd.StoreTag(mem, "ckpt"), str(tmp_path / "m-dir")) == logical_digest(0)
    # a memory store whose path looks like the local one's: still outside it
    mem2 = tc.Store("memory://" + str(store))
    mem2.save("plain", OBJ)
    assert mem2.export("plain", str(store.parent / "m2.safetensors")) == tc.fingerprint(OBJ)
    dest = f"memory://rtexport-out-{uuid.uuid4().hex}/p.safetensors"
    assert tc.Store(str(store)).export("plain", dest) == tc.fingerprint(OBJ)
    capsys.readouterr()
    assert cli.main(["store", "export", str(store), "plain", dest + "2"]) == 0


def test_a_local_path_shaped_like_a_memory_store_is_outside_it(tmp_path, monkeypatch):
    """A memory:// store holds no local folder: a local path that spells its name is not inside it."""
    name = f"rtexport-{uuid.uuid4().hex}"
    mem = tc.Store(f"memory://{name}")
    mem.save("plain", OBJ)
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir()
    assert mem.export("plain", f"{name}/p.safetensors") == tc.fingerprint(OBJ)
    assert (tmp_path / name / "p.safetensors").read_bytes() == tc.dumps(OBJ)


def test_symlink_loops_are_tensorcanon_errors(store, tmp_path, capsys):
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    os.symlink(store / "inner-b", store / "inner-a")
    os.symlink(store / "inner-a", store / "inner-b")
    before = tree(store)
    for dest in (store / "inner-a", store / "inner-a" / "x"):      # inside: refused, whatever the loop
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tc.Store(str(store)).export("plain", str(dest))
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tcd.export(tcd.StoreTag(tc.Store(str(store)), "ckpt"), str(dest))
    for dest in (tmp_path / "loop-a" / "x", tmp_path / "loop-a"):  # outside: the library's error, or written
        for fn in (lambda d: tc.Store(str(store)).export("plain", d),
                   lambda d: tcd.export(tcd.StoreTag(tc.Store(str(store)), "ckpt"), d)):
            try:
                fn(str(dest))
            except tc.TensorCanonError:
                pass
        capsys.readouterr()
        assert cli.main(["store", "export", str(store), "plain", str(dest)]) in (0, 2)
        assert "Traceback" not in capsys.readouterr().err
    assert tree(store) == before
    assert cli.main(["store", "verify", str(store)]) == 0


def test_a_looping_store_root_is_a_tensorcanon_error(tmp_path):
    os.symlink(tmp_path / "r-b", tmp_path / "r-a")
    os.symlink(tmp_path / "r-a", tmp_path / "r-b")
    with pytest.raises(tc.TensorCanonError):
        tc.Store(str(tmp_path / "r-a")).export("plain", str(tmp_path / "x"))


def test_nul_bytes_and_overlong_names_are_tensorcanon_errors(store, tmp_path, capsys):
    before = tree(store)
    for dest in (str(store) + "/x\0y", str(tmp_path) + "/x\0y", str(tmp_path / ("n" * 300)),
                 str(store / ("n" * 300))):
        with pytest.raises(tc.TensorCanonError):
            tc.Store(str(store)).export("plain", dest)
        with pytest.raises(tc.TensorCanonError):
            tcd.export(tcd.StoreTag(tc.Store(str(store)), "ckpt"), dest)
    assert tree(store) == before


def test_pathlike_destinations(store, tmp_path):
    with pytest.raises(tc.TensorCanonError):
        tc.Store(str(store)).export("plain", store / "x")        # type: ignore[arg-type]
    with pytest.raises(tc.TensorCanonError):
        tcd.export(tcd.StoreTag(tc.Store(str(store)), "ckpt"), store / "x")   # type: ignore[arg-type]
    assert not (store / "x").exists()


def test_fsspec_local_urls_into_the_store(store, capsys):
    """`local://` and a chain ending in `file://` are local files as much as a plain `file://` URL:
    the store's folder is refused through them too (they wrote into it)."""
    s = str(store)
    before = tree(store)
    for dest in ("local://" + s + "/x.safetensors", "simplecache::file://" + s + "/x.safetensors",
                 "local://" + s + "/tmp/y"):
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tc.Store(s).export("plain", dest)
        capsys.readouterr()
        assert cli.main(["store", "export", s, "plain", dest]) == 2
        assert "inside the store's folder" in capsys.readouterr().err
    assert tree(store) == before
    out = "local://" + str(store.parent / "ok.safetensors")               # outside: works
    assert tc.Store(s).export("plain", out) == tc.fingerprint(OBJ)


def test_a_store_named_by_a_local_fsspec_url(tmp_path, capsys):
    root = tmp_path / "lstore"
    url = "local://" + str(root)
    root.mkdir()
    opts = {"auto_mkdir": True}                                       # (fsspec's local files make no folders)
    tc.Store(url, storage_options=opts).save("plain", OBJ)
    before = tree(root)
    for dest in (str(root / "x.safetensors"), "local://" + str(root / "y"), str(root / "tmp" / "z")):
        with pytest.raises(tc.UsageError, match="inside the store's folder"):
            tc.Store(url, storage_options=opts).export("plain", dest)
    assert tree(root) == before
    assert tc.Store(url, storage_options=opts).export("plain", str(tmp_path / "lstore-other")) == tc.fingerprint(OBJ)
