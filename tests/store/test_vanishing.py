"""stats() and the whole store's verify while another writer deletes tags and collects blobs: an
object removed between the listing and its reading is left out, not reported as damage (nor raised
as a missing file); one that is still listed and fails is still damage (docs/STORE.md, "gc and
readers")."""

import pytest
import torch

import tensorcanon as tc
from tensorcanon.store import layout


def _store(tmp_path):
    """A store with two tags, each holding a loose blob (2 MiB, stored raw) and packed small ones."""
    root = tmp_path / "s"
    store = tc.Store(root)
    g = torch.Generator().manual_seed(5)
    for name in ("a", "b"):
        store.save(name, {"big": torch.randn(512, 1024, generator=g), "small": torch.randn(64, generator=g)})
    return root


def _remove_after_listing(store, folder, remove):
    """The store object's backend runs ``remove()`` right after its first listing of ``folder``: as
    if another writer deleted something between this reader's listing and its reading."""
    real = store._b.listing
    done = []

    def listing(prefix):
        out = real(prefix)
        if prefix == folder and not done:
            done.append(True)
            remove()
        return out

    store._b.listing = listing


def test_stats_leaves_out_a_loose_blob_collected_after_it_was_listed(tmp_path):
    root = _store(tmp_path)
    whole = tc.Store(root).stats()
    store = tc.Store(root)
    loose = sorted((root / "blobs").rglob("*"))
    victim = [p for p in loose if p.is_file()][0]
    _remove_after_listing(store, layout.BLOBS, victim.unlink)
    got = store.stats()
    assert got["blobs"] == whole["blobs"] - 1 and got["loose_blobs"] == whole["loose_blobs"] - 1


@pytest.mark.parametrize("what", ["tag", "loose blob"])
def test_the_whole_store_verify_leaves_out_what_vanished_after_it_was_listed(tmp_path, what):
    root = _store(tmp_path)
    store = tc.Store(root)
    if what == "tag":  # deleted, then its blobs collected, while the check runs
        other = tc.Store(root)

        def remove():
            other.delete("b")
            other.gc()
        _remove_after_listing(store, layout.TAGS, remove)
        expected = {"a"}
    else:
        tc.Store(root).delete("b")  # (its blobs dead: checked as loose blobs no tag uses)
        dead = {p for p in (root / "blobs").rglob("*") if p.is_file()} - _blobs_of(root, "a")
        _remove_after_listing(store, layout.BLOBS, lambda: [p.unlink() for p in dead])
        expected = {"a"}
    found = {kind: [n for k, n, r in store.checks() if k == kind and isinstance(r, BaseException)]
             for kind in ("tag", "blob", "pack")}
    assert not any(found.values()), found
    assert set(tc.Store(root).verify()) == expected


def test_a_listed_tag_whose_blob_is_missing_is_still_damage(tmp_path):
    root = _store(tmp_path)
    for p in (root / "blobs").rglob("*"):
        if p.is_file():
            p.unlink()
    with pytest.raises((tc.IntegrityError, tc.MissingFileError)):
        tc.Store(root).verify()


def _blobs_of(root, tag):
    store = tc.Store(root)
    with store._tag_file(tag, blobs=False) as cf:
        digests = {r.digest for r in cf.rows}
    return {root / layout.blob_path(d) for d in digests if (root / layout.blob_path(d)).is_file()}


def test_gc_leaves_out_a_tag_deleted_after_it_was_listed(tmp_path):
    root = _store(tmp_path)
    store = tc.Store(root)
    _remove_after_listing(store, layout.TAGS, lambda: tc.Store(root).delete("b"))
    store.gc()  # (it raised MissingFileError for "b")
    assert tc.Store(root).verify() == {"a": tc.Store(root).verify("a")}
    assert tc.Store(root).tags() == ["a"]
