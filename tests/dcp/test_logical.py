"""The logical digest, consolidation, resharding and canonical bytes (threaded process groups)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.dcp import _compat
from tensorcanon.sharded import layout

from helpers import DTensor, rank_files, unsharded, zeros_like_state
from states import logical_digest, logical_state, sharded_state
from threaded import run_ranks


def _save(world, folder, seed=0, **kw):
    return run_ranks(world, lambda r: tcd.save(sharded_state(world, r, seed, **kw), folder))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_logical_digest_is_the_unsharded_fingerprint(world, tmp_path):
    folder = str(tmp_path / f"w{world}")
    digests = _save(world, folder)
    expected = logical_digest()
    assert digests == [expected] * world                      # the same string on every rank
    assert tcd.verify(folder) == expected                     # recomputed from every byte
    assert tcd.logical_digest(folder) == expected             # read from the index alone
    # the oracle derived from the sharded state itself agrees with the one built without DTensors
    oracle = run_ranks(world, lambda r: tensorcanon.fingerprint(unsharded(sharded_state(world, r))))
    assert oracle == [expected] * world


def test_two_d_mesh_gives_the_same_logical_digest(tmp_path):
    folder = str(tmp_path / "mesh")
    digests = _save(4, folder, mesh_shape=(2, 2))
    assert digests == [logical_digest()] * 4
    assert tcd.verify(folder) == logical_digest()
    index = layout.read(folder)
    row = index.logical.tensors[[i.name for i in index.logical.tensors].index("model.layer.weight")]
    assert row.shape == (10, 7)
    chunks = index.chunks[[i.name for i in index.logical.tensors].index("model.layer.weight")]
    assert len(chunks) == 4 and {c.sizes for c in chunks} == {(5, 4), (5, 3)}  # [Shard(0), Shard(1)]


def test_consolidate_equals_dumps_of_the_unsharded_state(tmp_path):
    folder = str(tmp_path / "c")
    _save(3, folder)
    out = tmp_path / "one.safetensors"
    assert tcd.consolidate(folder, out) == logical_digest()
    assert out.read_bytes() == tensorcanon.dumps(logical_state())
    assert tensorcanon.verify(str(out)) == logical_digest()


def test_load_unsharded_restores_types_keys_and_ties(tmp_path):
    folder = str(tmp_path / "u")
    _save(2, folder)
    full = tcd.load_unsharded(folder)
    assert not tensorcanon.diff(logical_state(), full)
    assert type(full["model"]) is type(logical_state()["model"])
    assert full["model"]._metadata == logical_state()["model"]._metadata
    assert full["model"]["head.weight"] is full["model"]["embed.weight"]     # tied
    assert 0 in full["optim"]["state"] and type(full["extra"]["pair"]) is tuple
    assert tensorcanon.fingerprint(full) == logical_digest()
    ranked = tcd.load_unsharded(folder, rank=1)
    assert ranked["rng"]["rank"] == 1 and torch.equal(ranked["rng"]["state"], torch.full((3,), 1, dtype=torch.uint8))


@pytest.mark.parametrize("saved, loaded", [(2, 3), (4, 3), (3, 2), (4, 1), (1, 4)])
def test_resharding_is_bitwise(saved, loaded, tmp_path):
    folder = str(tmp_path / "r")
    _save(saved, folder)

    def load(rank):
        target = zeros_like_state(sharded_state(loaded, rank, seed=1))
        tcd.load(target, folder, keep_per_rank_on_resize=True)
        return tensorcanon.fingerprint(unsharded(target))

    assert run_ranks(loaded, load) == [logical_digest()] * loaded


def test_load_fills_tensors_in_place_and_replaces_values(tmp_path):
    folder = str(tmp_path / "p")
    _save(2, folder)

    def load(rank):
        target = zeros_like_state(sharded_state(2, rank, seed=5))
        weight = target["model"]["layer.weight"]
        groups = target["optim"]["param_groups"]
        tcd.load(target, folder)
        return (target["model"]["layer.weight"] is weight,               # filled in place
                target["optim"]["param_groups"] is groups,               # the list kept, its items loaded
                groups[0]["betas"], target["step"], target["cfg"]["tags"], target["cfg"][7],
                type(target["extra"]["pair"]), target["rng"].value["rank"])

    for rank, got in enumerate(run_ranks(2, load)):
        assert got == (True, True, (0.9, 0.999), 42, {"a", "b"}, b"\x00\x01", tuple, rank)


@pytest.mark.parametrize("world", [2, 3])
def test_same_state_gives_identical_files_across_runs_and_directory_names(world, tmp_path):
    a, b = str(tmp_path / "first"), str(tmp_path / "second-name")
    _save(world, a)
    _save(world, b)
    files = rank_files(a)
    assert files == rank_files(b)
    assert len(files) == world + 1 and layout.INDEX_NAME in files
    for name in files:
        assert b"first" not in files[name] and str(tmp_path).encode() not in files[name]


def test_rank_files_are_ordinary_tensorcanon_and_safetensors_files(tmp_path):
    import safetensors.torch as safetensors
    folder = str(tmp_path / "s")
    _save(2, folder)
    index = layout.read(folder)
    for r in range(2):
        path = index.file_path(r)
        loaded = tensorcanon.load(path)
        flat = safetensors.load_file(path)
        assert "model.layer.weight@0,0" in loaded or "model.layer.weight@5,0" in loaded
        for key, value in flat.items():
            if "@rank" not in key:
                assert torch.equal(value, loaded[key])
        assert loaded["rng@rank"]["rank"] == r


def test_dcp_save_and_load_with_the_plugins_directly(tmp_path):
    """Property 1: DCP's own entry points, with the storage classes and planner subclasses."""
    folder = str(tmp_path / "direct")

    def save_and_load(rank):
        state = sharded_state(2, rank)
        md = dcp.save(state, storage_writer=tcd.Writer(folder), planner=tcd.SavePlanner())
        target = zeros_like_state(sharded_state(2, rank, seed=3))
        dcp.load(target, storage_reader=tcd.Reader(folder), planner=tcd.LoadPlanner())
        return md.storage_data["tensorcanon.logical_digest"], tensorcanon.fingerprint(unsharded(target))

    assert run_ranks(2, save_and_load) == [(logical_digest(), logical_digest())] * 2
    assert isinstance(tcd.SavePlanner(), dcp.DefaultSavePlanner)
    assert isinstance(tcd.LoadPlanner(), dcp.DefaultLoadPlanner)


def test_a_new_save_replaces_a_bigger_worlds_files(tmp_path):
    folder = str(tmp_path / "again")
    _save(4, folder)
    _save(2, folder, seed=0)
    names = sorted(os.listdir(folder))
    assert len(names) == 3 and all("-of-00002." in n for n in names if n.startswith("rank-"))
    assert tcd.verify(folder) == logical_digest()


def test_single_process_save_needs_no_process_group(tmp_path):
    folder = str(tmp_path / "solo")
    assert tcd.save(logical_state(), folder) == logical_digest()
    target = zeros_like_state(logical_state())
    tcd.load(target, folder)
    assert tensorcanon.fingerprint(target) == logical_digest()


def test_sha256_checkpoints(tmp_path):
    folder = str(tmp_path / "sha")
    got = run_ranks(2, lambda r: tcd.save(sharded_state(2, r), folder, algorithm="sha256"))
    expected = tensorcanon.fingerprint(logical_state(), algorithm="sha256")
    assert got == [expected] * 2 and expected.startswith("sha256:")
    assert tcd.verify(folder) == expected
    out = tmp_path / "sha.safetensors"
    tcd.consolidate(folder, out)
    assert out.read_bytes() == tensorcanon.dumps(logical_state(), algorithm="sha256")


def test_dtensor_parameters_and_requires_grad_are_logical_kinds(tmp_path):
    folder = str(tmp_path / "kinds")
    full = torch.arange(12.0).reshape(4, 3)

    def save(rank):
        from torch.distributed.device_mesh import init_device_mesh

        from helpers import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        p = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        return tcd.save({"p": p}, folder)

    digests = run_ranks(2, save)
    assert digests == [tensorcanon.fingerprint({"p": torch.nn.Parameter(full.clone())})] * 2
    loaded = tcd.load_unsharded(folder)
    assert type(loaded["p"]) is torch.nn.Parameter and loaded["p"].requires_grad
    assert isinstance(DTensor, type)


def test_a_process_group_that_is_not_the_default_one(tmp_path):
    """Two groups of 2 ranks in a world of 4, each saving and loading its own checkpoint."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from helpers import Shard, distribute_tensor

    full = torch.arange(20.0).reshape(5, 4)
    # Older DCP cannot coordinate every group: before torch 2.8 a group that does not start at
    # global rank 0 (ranks 2 and 3), before 2.5 a load with a group smaller than the world.
    # tensorcanon refuses those up front, naming the torch needed; this checks both sides.
    version = _compat.TORCH_VERSION
    save_ok = {0: True, 1: version >= _compat.SUBGROUPS_SINCE}
    load_ok = {0: version >= _compat.SMALLER_GROUP_LOAD_SINCE, 1: version >= _compat.SUBGROUPS_SINCE}

    def refusal(call, *args, **kwargs) -> str:
        with pytest.raises(tensorcanon.UsageError) as e:
            call(*args, **kwargs)
        return str(e.value)

    def run(rank):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        g = rank // 2
        mine = groups[g]
        mesh = DeviceMesh.from_group(mine, "cpu")
        folder = str(tmp_path / f"group{g}")
        state = {"w": distribute_tensor(full * (g + 1), mesh, [Shard(0)]), "g": g, "own": tcd.PerRank(rank)}
        target = zeros_like_state(state)
        if not save_ok[g]:
            calls = (tcd.save, tcd.async_save, tcd.load)
            return [refusal(call, state, folder, process_group=mine) for call in calls] + [
                refusal(tcd.Writer, folder, process_group=mine),  # also for dcp.save/load called directly
                refusal(tcd.LoadPlanner, process_group=mine)]
        digest = tcd.save(state, folder, process_group=mine)
        if not load_ok[g]:
            assert "has 2 of the 4 ranks" in refusal(tcd.LoadPlanner, process_group=mine)
            return digest, refusal(tcd.load, target, folder, process_group=mine)
        tcd.load(target, folder, process_group=mine)
        same = torch.equal(target["w"].full_tensor(), state["w"].full_tensor())
        return digest, target["g"], target["own"].value, same

    got = run_ranks(4, run)
    for rank, result in enumerate(got):
        g = rank // 2
        if not save_ok[g]:
            assert all("starts at global rank 2" in e and "before torch 2.8" in e for e in result), result
            assert not os.path.exists(tmp_path / "group1")
            continue
        assert result[0] == tensorcanon.fingerprint({"w": full * (g + 1), "g": g})
        if not load_ok[g]:
            assert "has 2 of the 4 ranks" in result[1] and "before torch 2.5" in result[1], result[1]
            continue
        assert result[1:] == (g, rank, True)
