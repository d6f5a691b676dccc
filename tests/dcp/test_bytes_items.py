"""Byte items (``io.BytesIO`` values, DCP's BYTE_IO): saved as their bytes, never pickled (threaded tier).

A BytesIO is a value like any other (docs/FORMAT.md §6.9.4): replicated ones are compared between
ranks and saved once in the logical state (so the logical digest covers them and equals
``tensorcanon.fingerprint`` of the unsharded state at every world size), per-rank ones go into their
rank's file; each comes back as a new ``io.BytesIO`` at position 0, through tensorcanon's planner and
through DCP's own. test_spawned.py runs the same state on gloo processes (2 ranks save, 3 load).
"""

from __future__ import annotations

import base64
import io
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.sharded import layout

import hostile_lib as h
from states import SAMPLER, TrainState, bytes_logical, bytes_state, bytes_target, loader_bytes
from threaded import run_ranks

DIGEST = tensorcanon.fingerprint(bytes_logical())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bytes") / "ckpt")
    assert run_ranks(2, lambda r: tcd.save(bytes_state(2, r), folder)) == [DIGEST] * 2
    return folder


def _load(world, folder, **kw):
    """Load on ``world`` ranks into a fresh target; each rank's (losses, sampler, loader) or error."""
    def load(rank):
        target = bytes_target(world)
        train = target["train"]  # (torch 2.4's dcp.load puts its state_dict in its place)
        try:
            tcd.load(target, folder, **kw)
        except tensorcanon.TensorCanonError as e:
            return e
        sampler, loader = target["data"]["sampler"], target["data"]["loader"].value
        assert type(sampler) is io.BytesIO and sampler.tell() == 0
        assert torch.equal(target["model"]["w"].full_tensor(), torch.arange(24.0).reshape(8, 3))
        return (train.step, train.losses, sampler.getvalue(),
                None if loader is None else (loader.tell(), loader.getvalue()))
    return run_ranks(world, load)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_logical_digest_covers_byte_items_at_every_world_size(world, tmp_path):
    folder = str(tmp_path / f"w{world}")
    assert run_ranks(world, lambda r: tcd.save(bytes_state(world, r), folder)) == [DIGEST] * world
    assert tcd.verify(folder) == tcd.logical_digest(folder) == DIGEST
    full = tcd.load_unsharded(folder, rank=world - 1)
    assert full["data"]["loader"].getvalue() == loader_bytes(world - 1)          # the per-rank one, its own
    assert tensorcanon.fingerprint(tcd.load_unsharded(folder)) == DIGEST
    out = str(tmp_path / f"w{world}.safetensors")
    tcd.consolidate(folder, out)
    with open(out, "rb") as fh:
        assert fh.read() == tensorcanon.dumps(bytes_logical())


def test_byte_items_come_back_without_pickle_same_world_and_resharded(saved, no_unpickling):
    losses = list(TrainState(3, (2.5, 1.25, 0.625, 0.3125)).losses)
    got = _load(2, saved)
    assert got == [(3, losses, SAMPLER, (0, loader_bytes(r))) for r in range(2)]
    got = _load(3, saved, keep_per_rank_on_resize=True)                          # 2 -> 3: DCP reshards w
    assert got == [(3, losses, SAMPLER, None)] * 3
    errors = _load(3, saved)
    assert all(isinstance(e, tensorcanon.UsageError) and '$["data"]["loader"]' in str(e) for e in errors)
    assert tcd.verify(saved) == DIGEST


def test_dcps_own_load_planner_gets_byte_items_without_pickle(saved, no_unpickling):
    """DefaultLoadPlanner.load_bytes would torch.load them; the Reader decodes them itself."""
    def load(rank):
        target = {"data": {"sampler": io.BytesIO(), "epoch": None}, "train": {"losses": None, "step": torch.tensor(0)}}
        dcp.load(target, storage_reader=tcd.Reader(saved))
        sampler, losses = target["data"]["sampler"], target["train"]["losses"]
        return type(sampler), sampler.tell(), sampler.getvalue(), losses.getvalue(), target["data"]["epoch"]
    expected = (io.BytesIO, 0, SAMPLER, TrainState(3, (2.5, 1.25, 0.625, 0.3125)).state_dict()["losses"].getvalue(), 2)
    assert run_ranks(3, load) == [expected] * 3


def test_byte_items_that_differ_between_ranks_are_refused_naming_the_path(tmp_path):
    def save(rank):
        state = bytes_state(2, rank)
        state["data"]["sampler"] = io.BytesIO(SAMPLER[:-1] + bytes([rank]))
        try:
            tcd.save(state, str(tmp_path / "x"))
        except tensorcanon.TensorCanonError as e:
            return e
        return None

    errors = run_ranks(2, save)
    assert all(isinstance(e, tcd.ReplicaMismatchError) for e in errors), errors
    assert '$["data"]["sampler"]' in str(errors[0]) and "io.BytesIO of 283 bytes" in str(errors[0])
    assert f"first differ at byte {len(SAMPLER) - 1}" in str(errors[0])
    assert not os.path.exists(os.path.join(str(tmp_path / "x"), layout.INDEX_NAME))


def test_async_save_stages_byte_items(tmp_path):
    """One process (the threaded group has no CPU device type, which async_save requires)."""
    state = bytes_logical()
    fut = tcd.async_save(state, str(tmp_path / "a"), executor="thread")
    state["data"]["sampler"].seek(0)
    state["data"]["sampler"].write(b"CHANGED")                  # after staging: must not be saved
    assert fut.result(timeout=60) == DIGEST


# ------------------------------------------------------------------ tampering


def _edit(path: str, old: bytes, new: bytes, *, attacker: bool) -> None:
    """Replace ``old`` by ``new`` (same length) in a file's manifest; an attacker also records the
    file's new digest, so the file passes its own check."""
    assert len(old) == len(new)
    with open(path, "rb") as fh:
        data = fh.read()
    _, header, _ = h.manifest_of(data)
    raw = base64.b64decode(header["__metadata__"]["tensorcanon.manifest"])
    assert raw.count(old) == 1, (old, raw.count(old))
    recorded = header["__metadata__"]["tensorcanon.digest"].encode()
    changed = h.rebuild(data, raw.replace(old, new))
    if not attacker:  # the file still records the digest of its old manifest
        changed = changed.replace(h.manifest_of(changed)[1]["__metadata__"]["tensorcanon.digest"].encode(), recorded)
    data = changed
    with open(path, "wb") as fh:
        fh.write(data)


def _every_reader(folder: str) -> list:
    """What verify, load_unsharded and a 2-rank load do with ``folder``: each one's exception or None."""
    out = []
    for call in (lambda: tcd.verify(folder), lambda: tcd.load_unsharded(folder, rank=1)):
        try:
            call()
            out.append(None)
        except tensorcanon.TensorCanonError as e:
            out.append(e)
    return out + [e if isinstance(e, BaseException) else None for e in _load(2, folder)]


def test_a_changed_byte_item_in_the_index_is_an_error(copy):
    _edit(layout.index_path(copy), b"seed 7", b"seed 8", attacker=False)
    errors = _every_reader(copy)
    assert all(isinstance(e, tensorcanon.IntegrityError) and layout.INDEX_NAME in str(e) for e in errors), errors


def test_a_byte_item_changed_by_an_attacker_changes_the_logical_digest(copy):
    """The index passes its own check: the logical digest (which covers every byte of the byte
    item) is then another one, and a verify against the known digest fails."""
    _edit(layout.index_path(copy), b"seed 7", b"seed 8", attacker=True)
    assert tcd.logical_digest(copy) != DIGEST
    with pytest.raises(tensorcanon.IntegrityError, match=f"expected {DIGEST}"):
        tcd.verify(copy, expect=DIGEST)
    assert tcd.verify(copy) == tensorcanon.fingerprint(
        dict(bytes_logical(), data={"epoch": 2, "sampler": io.BytesIO(SAMPLER.replace(b"seed 7", b"seed 8"))}))


def test_a_byte_item_state_that_is_not_bytes_is_refused_naming_the_path(copy):
    """An attacker writes a str where the BytesIO's bin was (same length): the index is a valid
    tensorcanon file, but decoding the value fails, naming it."""
    import msgpack

    path = layout.index_path(copy)
    index = tensorcanon.load(path)
    logical = index["logical"]
    old = msgpack.packb(SAMPLER, use_bin_type=True)               # bin 16: 0xc5, length, bytes
    new = b"\xda" + old[1:3] + b"x" * len(SAMPLER)                # str 16 of the same length
    assert logical.count(old) == 1
    index["logical"] = logical.replace(old, new)
    tensorcanon.save(index, path)
    words = """could not rebuild 'io.BytesIO' at $["data"]["sampler"]"""
    with pytest.raises(tensorcanon.FormatError, match=re.escape(words)):
        tcd.load_unsharded(copy)
    errors = _load(2, copy)
    # the index's logical manifest is refused when it is read, as verify refuses it (the format
    # specifies a BytesIO's state: docs/FORMAT.md §6.6), before any rank plans a read
    assert all(isinstance(e, tensorcanon.FormatError) and "logical manifest" in str(e) and words in str(e)
               for e in errors), errors
    with pytest.raises(tensorcanon.FormatError, match=re.escape(words)):
        tcd.verify(copy)

    def by_dcp(rank):
        try:
            dcp.load({"data": {"sampler": None}}, storage_reader=tcd.Reader(copy))
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException
            return tcd.api.unwrap(e)
        return None
    errors = run_ranks(2, by_dcp)  # the Reader decodes the whole tree to give DCP its flattened names
    assert all(isinstance(e, tensorcanon.TensorCanonError) and
               """could not rebuild 'io.BytesIO' at $["data"]["sampler"]""" in str(e) for e in errors), errors


@pytest.mark.parametrize("attacker", [False, True])
def test_a_changed_per_rank_byte_item_is_an_error_naming_the_rank_file(copy, attacker):
    path = layout.read(copy).file_path(1)
    _edit(path, b"position 640", b"position 999", attacker=attacker)
    errors = _every_reader(copy)
    assert all(isinstance(e, tensorcanon.IntegrityError) and os.path.basename(path) in str(e)
               for e in errors), errors
    if attacker:  # the file is valid on its own; the index records another digest for it
        assert "the index records" in str(errors[0])
