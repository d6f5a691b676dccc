"""Sharded checkpoints in a tensorcanon.Store (tensorcanon.dcp.StoreTag; docs/DISTRIBUTED.md, "In a store").

Ranks are threads of one process (tests/dcp/threaded.py); tests/store/test_dcp_store_processes.py
runs the same on 2 gloo processes and against S3. Each test compares the store against the same
save to a directory: the same logical digest, and an export that is the directory byte for byte.
"""

import os
import pathlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon import testing
from tensorcanon.dcp import store as dcp_store

from helpers import Shard, distribute_tensor, rank_files, unsharded, zeros_like_state
from states import logical_digest, logical_state, sharded_state
from threaded import run_ranks


def raised(world, fn):
    """Each rank's exception (None where ``fn`` returned): the library's own error, on every rank."""
    def run(rank):
        try:
            fn(rank)
        except Exception as e:  # noqa: BLE001 - for the test to judge
            return e
        return None

    return run_ranks(world, run)



def save_both(world, root, folder, tag="step-100", state=sharded_state):
    """Save the same state to a directory and into a store (each rank its own Store object, as
    separate processes have); return both digests per rank."""
    here = run_ranks(world, lambda r: tcd.save(state(world, r), folder))
    there = run_ranks(world, lambda r: tcd.save(state(world, r), tcd.StoreTag(tc.Store(root), tag)))
    return here, there


@pytest.mark.parametrize("world", [1, 2, 3, 4])   # 4: "tiny" has a rank that holds no row
def test_a_store_tag_is_the_directory_checkpoint(tmp_path, world):
    root, folder = str(tmp_path / "store"), str(tmp_path / "dir")
    here, there = save_both(world, root, folder)
    assert here == there == [logical_digest()] * world       # == tensorcanon.fingerprint of the unsharded state
    store = tc.Store(root)
    assert store.tags() == ["step-100"]                       # one tag: no rank's piece is listed
    target = tcd.StoreTag(store, "step-100")
    assert tcd.export(target, tmp_path / "exported") == logical_digest()
    assert rank_files(str(tmp_path / "exported")) == rank_files(folder)   # byte for byte, index included
    assert tcd.logical_digest(target) == tcd.verify(target) == logical_digest()
    testing.assert_identical(tcd.load_unsharded(target), logical_state())
    assert tcd.load_unsharded(target, rank=world - 1)["rng"]["rank"] == world - 1
    assert tcd.consolidate(target, tmp_path / "one.safetensors") == logical_digest()
    tcd.consolidate(folder, tmp_path / "two.safetensors")
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    # the store's own tools see one ordinary tag, every blob of it
    assert isinstance(store.verify("step-100"), str)
    assert list(store.verify()) == ["step-100"]


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 2), (2, 3), (2, 1), (3, 2)])
def test_load_with_any_world_size(tmp_path, saved_on, loaded_on):
    root = str(tmp_path / "store")
    run_ranks(saved_on, lambda r: tcd.save(sharded_state(saved_on, r), tcd.StoreTag(tc.Store(root), "s")))

    def load(rank):
        target = zeros_like_state(sharded_state(loaded_on, rank))
        tcd.load(target, tcd.StoreTag(tc.Store(root), "s"), keep_per_rank_on_resize=saved_on != loaded_on)
        return unsharded(target), target["rng"].value

    for rank, (got, rng) in enumerate(run_ranks(loaded_on, load)):
        testing.assert_identical(got, logical_state())
        if saved_on == loaded_on:
            assert rng["rank"] == rank                       # each rank its own per-rank value back
        else:
            assert rng is None                               # kept, as from a directory


def test_a_load_reads_from_the_store_only_the_chunks_it_needs(tmp_path, monkeypatch):
    from tensorcanon.sharded.files import RankFile

    root = str(tmp_path / "store")
    run_ranks(3, lambda r: tcd.save(sharded_state(3, r), tcd.StoreTag(tc.Store(root), "s")))
    read = []
    real = RankFile.raw
    monkeypatch.setattr(RankFile, "raw", lambda self, info: (read.append(info.name), real(self, info))[1])
    part = {"model": {"layer.weight": torch.zeros(10, 7)}}
    run_ranks(1, lambda r: tcd.load(part, tcd.StoreTag(tc.Store(root), "s"), allow_partial_load=True))
    testing.assert_identical(part["model"]["layer.weight"], logical_state()["model"]["layer.weight"])
    assert sorted(read) == ["model.layer.weight@0,0", "model.layer.weight@4,0", "model.layer.weight@8,0"]
    read.clear()
    part = {"step": 0}                                       # a value: from the index, no chunk read
    run_ranks(1, lambda r: tcd.load(part, tcd.StoreTag(tc.Store(root), "s"), allow_partial_load=True))
    assert part["step"] == 42 and read == []


def _zeros_state(world, rank, step=0, changed=False):
    """Shards whose bytes repeat across ranks (zeros) and across steps (all but ``moving``)."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    frozen = torch.randn(64, 32, generator=g)
    moving = torch.randn(64, 32, generator=g) + (step if changed else 0)
    return {"zeros": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)]),     # 2 equal chunks: 1 blob
            "frozen": distribute_tensor(frozen, mesh, [Shard(0)]),
            "moving": distribute_tensor(moving, mesh, [Shard(0)]),
            "same": tcd.PerRank(torch.ones(16)),                                   # equal on every rank: 1 blob
            "step": step}


def test_dedup_across_ranks_and_steps(tmp_path):
    root = str(tmp_path / "store")
    store = tc.Store(root)

    def save(tag, step, changed):
        return run_ranks(2, lambda r: tcd.save(_zeros_state(2, r, step, changed), tcd.StoreTag(tc.Store(root), tag)))

    save("step-1", 1, False)
    first = store.stats()
    # 2 ranks x (zeros, frozen, moving, same) = 8 chunks; zeros and "same" are one blob each
    assert first["blobs"] == 6
    save("step-2", 2, False)                                  # the same tensors again: no new blob
    second = store.stats()
    assert second["blobs"] == first["blobs"] and second["blob_bytes"] == first["blob_bytes"]
    assert second["tags"] == 2 and second["logical_bytes"] == 2 * first["logical_bytes"]
    save("step-3", 3, True)                                   # one tensor moved: its two chunks only
    third = store.stats()
    assert third["blobs"] == first["blobs"] + 2
    chunk = 32 * 32 * 4
    assert third["blob_bytes"] - second["blob_bytes"] <= 2 * (chunk + 4096)
    for tag, step, changed in [("step-1", 1, False), ("step-2", 2, False), ("step-3", 3, True)]:
        folder = str(tmp_path / f"dir-{tag}")
        digests = run_ranks(2, lambda r, s=step, c=changed, f=folder: tcd.save(_zeros_state(2, r, s, c), f))
        assert tcd.verify(tcd.StoreTag(store, tag)) == digests[0]
        tcd.export(tcd.StoreTag(store, tag), tmp_path / f"out-{tag}")
        assert rank_files(str(tmp_path / f"out-{tag}")) == rank_files(folder)


def _blob_file_holding(root, data: bytes) -> tuple[pathlib.Path, int]:
    """The file of the store holding ``data`` (a raw blob's bytes) and where; layout-independent."""
    for p in sorted(pathlib.Path(root).rglob("*")):
        if p.is_file():
            at = p.read_bytes().find(data)
            if at >= 0:
                return p, at
    raise AssertionError("no file of the store holds those bytes")


def test_a_flipped_byte_is_found_and_named(tmp_path):
    root = str(tmp_path / "store")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, seed=5), tcd.StoreTag(tc.Store(root), "s")))
    # rank 1's chunk of model.layer.weight (random floats: stored raw, as they are)
    chunk = logical_state(5)["model"]["layer.weight"][5:].contiguous().numpy().tobytes()
    path, at = _blob_file_holding(root, chunk)
    data = bytearray(path.read_bytes())
    data[at + len(chunk) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    target = tcd.StoreTag(tc.Store(root), "s")
    with pytest.raises(tc.IntegrityError, match=r"model\.layer\.weight"):
        tcd.verify(target)
    with pytest.raises(tc.IntegrityError):
        tc.Store(root).verify("s")
    with pytest.raises(tc.IntegrityError, match=r"model\.layer\.weight"):
        tcd.export(target, tmp_path / "out")
    with pytest.raises(tc.IntegrityError):
        tcd.load_unsharded(target)

    def load(rank):
        tcd.load(zeros_like_state(sharded_state(2, rank)), tcd.StoreTag(tc.Store(root), "s"))

    assert all(isinstance(e, tc.IntegrityError) and "model.layer.weight" in str(e) for e in raised(2, load))


def test_a_damaged_compressed_blob_is_named_by_its_chunk(tmp_path):
    root = tmp_path / "store"
    tcd.save({"zeros": torch.zeros(4096), "noise": torch.randn(100)}, tcd.StoreTag(tc.Store(root), "t"))
    magic = b"\x28\xb5\x2f\xfd"                              # a zstd frame: the zeros' blob (noise stays raw)
    hits = [p for p in sorted(root.rglob("*")) if p.is_file() and "tags" not in p.parts and magic in p.read_bytes()]
    assert len(hits) == 1
    data = bytearray(hits[0].read_bytes())
    data[data.find(magic) + 8] ^= 0xFF
    hits[0].write_bytes(bytes(data))
    target = tcd.StoreTag(tc.Store(root), "t")
    for call in (lambda: tcd.verify(target), lambda: tcd.load_unsharded(target),
                 lambda: tcd.export(target, tmp_path / "out"), lambda: tcd.consolidate(target, tmp_path / "one")):
        with pytest.raises(tc.TensorCanonError, match=r"chunk 'zeros@0' \(tensor 'zeros'\)"):
            call()


def test_no_tag_until_every_rank_is_done_and_gc_takes_the_orphans(tmp_path, monkeypatch):
    root = str(tmp_path / "store")
    real = dcp_store.write_rank

    def failing(target, obj, algorithm, limits):
        if any(k.endswith("@rank") and obj[k]["rank"] == 1 for k in obj):
            raise tc.FormatError("rank 1 fails after rank 0 stored its blobs")
        return real(target, obj, algorithm, limits)

    monkeypatch.setattr(dcp_store, "write_rank", failing)
    errors = raised(2, lambda r: tcd.save(sharded_state(2, r), tcd.StoreTag(tc.Store(root), "s")))
    assert all(isinstance(e, tc.TensorCanonError) and "rank 1 fails" in str(e) for e in errors)
    store = tc.Store(root)
    assert store.tags() == [] and store.stats()["blobs"] > 0  # rank 0's blobs, named by no tag
    with pytest.raises(tcd.CheckpointNotFoundError):
        tcd.verify(tcd.StoreTag(store, "s"))
    assert store.gc()["deleted_blobs"] > 0
    assert store.stats()["blobs"] == 0


def test_gc_keeps_what_a_tag_needs_and_delete_frees_it(tmp_path):
    root = str(tmp_path / "store")
    for step in (1, 2):
        run_ranks(2, lambda r, s=step: tcd.save(_zeros_state(2, r, s, True), tcd.StoreTag(tc.Store(root), f"step-{s}")))
    store = tc.Store(root)
    before = store.stats()
    assert store.gc()["deleted_blobs"] == 0 and store.stats()["blobs"] == before["blobs"]
    digest = tcd.verify(tcd.StoreTag(store, "step-2"))
    store.delete("step-1")
    assert store.gc()["deleted_blobs"] == 2                   # step 1's chunks of "moving", no other
    assert tcd.verify(tcd.StoreTag(store, "step-2")) == digest
    assert store.tags() == ["step-2"]


def test_refusals(tmp_path):
    root = str(tmp_path / "store")
    store = tc.Store(root)
    store.save("plain", {"w": torch.ones(3)})
    with pytest.raises(tc.FormatError, match="not a sharded checkpoint"):
        tcd.verify(tcd.StoreTag(store, "plain"))
    with pytest.raises(tcd.CheckpointNotFoundError, match="nope"):
        tcd.load_unsharded(tcd.StoreTag(store, "nope"))
    with pytest.raises(tc.UsageError):
        tcd.StoreTag(store, "../escape")
    with pytest.raises(tc.UsageError, match="storage_options"):
        tcd.save({"w": torch.ones(2)}, tcd.StoreTag(store, "t"), storage_options={"anon": True})
    with pytest.raises(tc.UsageError, match="xxh3-128"):
        tcd.save({"w": torch.ones(2)}, tcd.StoreTag(store, "t"), algorithm="sha256")
    with pytest.raises(tc.UsageError, match="thread"):
        tcd.async_save({"w": torch.ones(2)}, tcd.StoreTag(store, "t"), executor="process")
    assert tcd.save({"w": torch.ones(2)}, tcd.StoreTag(store, "t")) == tc.fingerprint({"w": torch.ones(2)})
    with pytest.raises(tcd.CheckpointExistsError, match="already holds the tag 't'"):
        tcd.save({"w": torch.zeros(2)}, tcd.StoreTag(store, "t"), overwrite=False)
    testing.assert_identical(tcd.load_unsharded(tcd.StoreTag(store, "t")), {"w": torch.ones(2)})
    os.makedirs(tmp_path / "full")
    tcd.export(tcd.StoreTag(store, "t"), tmp_path / "full")
    with pytest.raises(tc.FileAccessError, match="already holds a checkpoint"):  # (no damage: exit 2 in the CLI)
        tcd.export(tcd.StoreTag(store, "t"), tmp_path / "full")


def test_async_save_in_one_process(tmp_path):
    """One process (the threaded group has no CPU device type, which async_save requires)."""
    root = str(tmp_path / "store")
    state = logical_state()
    fut = tcd.async_save(state, tcd.StoreTag(tc.Store(root), "async"))
    state["model"]["layer.weight"].fill_(7.0)               # after staging: not saved
    assert fut.result(timeout=60) == logical_digest()
    assert tcd.verify(tcd.StoreTag(tc.Store(root), "async")) == logical_digest()


def test_dcp_directly(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    root = str(tmp_path / "store")

    def run(rank):
        state = sharded_state(2, rank)
        target = tcd.StoreTag(tc.Store(root), "direct")
        dcp.save(state, storage_writer=tcd.Writer(target), planner=tcd.SavePlanner())
        back = zeros_like_state(sharded_state(2, rank))
        dcp.load({"model": back["model"]}, storage_reader=tcd.Reader(target), planner=DefaultLoadPlanner())
        back_id = zeros_like_state(sharded_state(2, rank))   # the StoreTag as DCP's checkpoint_id
        dcp.load({"model": back_id["model"]}, checkpoint_id=target, storage_reader=tcd.Reader(target),
                 planner=tcd.LoadPlanner())
        return unsharded(back["model"]), unsharded(back_id["model"])

    for model, again in run_ranks(2, run):
        testing.assert_identical(dict(model), dict(logical_state()["model"]))   # (DCP's planner: no _metadata)
        testing.assert_identical(again, logical_state()["model"])
    assert tcd.verify(tcd.StoreTag(tc.Store(root), "direct")) == logical_digest()


def test_a_collection_between_the_ranks_blobs_and_the_record_refuses_the_record(tmp_path, monkeypatch):
    """gc may run after the ranks stored their blobs and before the coordinator's record names
    them (no marker is held in between): the coordinator then looks for every blob, and refuses a
    record that would name a deleted one (docs/DISTRIBUTED.md, "In a store")."""
    root = str(tmp_path / "store")
    real = dcp_store.commit

    def collected_first(*args, **kw):
        tc.Store(root).gc()                                    # deletes the blobs no tag names yet
        return real(*args, **kw)

    monkeypatch.setattr(dcp_store, "commit", collected_first)
    errors = raised(2, lambda r: tcd.save(sharded_state(2, r), tcd.StoreTag(tc.Store(root), "s")))
    assert all(isinstance(e, tc.IntegrityError) and "gc" in str(e) for e in errors), errors
    assert tc.Store(root).tags() == []
    # the same, when an earlier tag keeps every blob: the record is written, and whole
    monkeypatch.setattr(dcp_store, "commit", real)
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), tcd.StoreTag(tc.Store(root), "first")))
    monkeypatch.setattr(dcp_store, "commit", collected_first)
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), tcd.StoreTag(tc.Store(root), "second")))
    assert tc.Store(root).tags() == ["first", "second"]
    assert tcd.verify(tcd.StoreTag(tc.Store(root), "second")) == logical_digest()
