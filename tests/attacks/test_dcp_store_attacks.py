"""Hostile records of sharded checkpoints in a store (tensorcanon.dcp.StoreTag; docs/DISTRIBUTED.md,
"In a store"). A store's contents are untrusted input: a record that lies about its index, its rank
files' headers or the blobs it keeps is refused with the library's own error naming the tag, by every
reader (verify, load_unsharded, export, logical_digest, and a load through DCP), never a foreign
exception, never a wrong state."""

import pytest
import torch

import tensorcanon as tc
import tensorcanon.dcp as tcd

from helpers import zeros_like_state
from states import sharded_state
from threaded import run_ranks


@pytest.fixture
def saved(tmp_path):
    root = str(tmp_path / "store")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), tcd.StoreTag(tc.Store(root), "good")))
    store = tc.Store(root)
    record = store.load("good")          # the record as an object: its blobs as tensors
    return store, record


def readers(store, tag, tmp_path):
    """Every way to read the tag; each returns the error it raised (or None)."""
    target = tcd.StoreTag(store, tag)

    def dcp_load():
        def load(rank):
            try:
                tcd.load(zeros_like_state(sharded_state(2, rank)), tcd.StoreTag(tc.Store(store.root), tag))
            except Exception as e:  # noqa: BLE001 - judged below
                return e
            return None

        return run_ranks(2, load)[0]

    calls = {
        "verify": lambda: tcd.verify(target),
        "load_unsharded": lambda: tcd.load_unsharded(target),
        "export": lambda: tcd.export(target, tmp_path / f"out-{tag}"),
        "consolidate": lambda: tcd.consolidate(target, tmp_path / f"{tag}.safetensors"),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - judged by the test
            out[name] = e
    out["load"] = dcp_load()
    return out


def refused(errors, cls=tc.TensorCanonError, words=None):
    for name, e in errors.items():
        assert isinstance(e, cls), (name, type(e), e)
        if words is not None:
            assert words in str(e), (name, str(e))


def test_a_record_that_lies_about_its_kept_blobs(saved, tmp_path):
    store, record = saved
    evil = dict(record, blobs=record["blobs"][1:])   # a blob a rank file names, which gc would not keep
    store.save("evil", evil)
    refused(readers(store, "evil", tmp_path), tc.FormatError, "gc would not keep")


def test_swapped_rank_headers(saved, tmp_path):
    store, record = saved
    store.save("swapped", dict(record, ranks=record["ranks"][::-1]))
    refused(readers(store, "swapped", tmp_path), tc.TensorCanonError)


def test_an_index_for_another_world(saved, tmp_path):
    store, record = saved
    store.save("short", dict(record, ranks=record["ranks"][:1]))
    refused(readers(store, "short", tmp_path), tc.TensorCanonError)


@pytest.mark.parametrize("field, value, words", [
    ("format", "something-else", "not a sharded checkpoint"),
    ("layout", 2, "upgrade"),
    ("layout", True, "must be an int"),      # (damage: no later layout is a bool)
    ("index", b"not an index", "tag 'bad'"),
    ("index", "text", "must be bytes"),
    ("ranks", [], "non-empty list"),
    ("ranks", [b"\x00" * 8], "tag"),
    ("ranks", [b"\xff" * 8 + b"{}", b"junk"], "tag"),
    ("blobs", "not a list", "list of tensors"),
    ("blobs", [torch.ones(3), "x"], "list of tensors"),
])
def test_malformed_fields(saved, tmp_path, field, value, words):
    store, record = saved
    store.save("bad", dict(record, **{field: value}))
    refused(readers(store, "bad", tmp_path), tc.TensorCanonError, words)


def test_records_that_are_not_checkpoints(saved, tmp_path):
    store, record = saved
    for obj in ({"w": torch.ones(2)}, [1, 2], {1: "int key"}, {("a",): 1}, dict(record, extra=1), 7):
        store.save("other", obj)
        refused(readers(store, "other", tmp_path), tc.FormatError, "not a sharded checkpoint")
