"""Scenarios run by every rank of a real gloo process group (spawn.py); results are JSON.

Each scenario is ``fn(rank, world, folder) -> JSON value``; ``folder`` is shared by
all launches of one test session, so a later launch reads what an earlier one wrote.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tensorcanon
import tensorcanon.dcp as tcd
from tensorcanon.sharded import layout

from helpers import FSDP2_ON_CPU, flip_byte, unsharded, zeros_like_state
from models import batch, build, train_state
from states import LOSSES, SAMPLER, bytes_state, bytes_target, loader_bytes, logical_digest, sharded_state
from support import no_unpickling


def _files(folder: str) -> dict:
    def digest(name: str) -> str:
        with open(os.path.join(folder, name), "rb") as f:
            return tensorcanon.format.digest.to_text(__import__("xxhash").xxh3_128_digest(f.read()))

    return {n: digest(n) for n in sorted(os.listdir(folder))}


# ------------------------------------------------------------------ two ranks

def fsdp2_save(rank, world, folder):
    _, _, state = train_state(world)
    digest = tcd.save(state, os.path.join(folder, "fsdp2"))
    # FSDP2 averages fp32 gradients with a ReduceOp.AVG reduce-scatter, which some torch
    # releases' gloo silently sums (pytorch issue 162338): there the training itself differs
    # from one process's, whatever the checkpoint does. Report which this torch is.
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, torch.ones(world), op=dist.ReduceOp.AVG)
    return [digest, tensorcanon.fingerprint(unsharded(state)), out.item() == 1.0]


def state_save_twice(rank, world, folder):
    a = tcd.save(sharded_state(world, rank), os.path.join(folder, "state-a"))
    b = tcd.save(sharded_state(world, rank), os.path.join(folder, "a-second-name"))
    return [a, b, _files(os.path.join(folder, "state-a")) == _files(os.path.join(folder, "a-second-name"))]


def _async(rank, world, folder, executor):
    target = os.path.join(folder, f"async-{executor}")
    state = sharded_state(world, rank)
    fut = tcd.async_save(state, target, executor=executor)
    state["model"]["layer.weight"].to_local().fill_(7.0)   # after staging: must not reach the files
    state["extra"]["plain"].fill_(7.0)
    state["step"] = 7
    digest = fut.result(timeout=120)
    dist.barrier()
    return [digest, _files(target) == _files(os.path.join(folder, "state-a"))]


def async_thread(rank, world, folder):
    return _async(rank, world, folder, "thread")


def async_process(rank, world, folder):
    return _async(rank, world, folder, "process")


def rng_per_rank(rank, world, folder):
    tensorcanon.seed_everything(100 + rank)
    target = os.path.join(folder, "rng")
    tcd.save({"model": {"w": torch.zeros(3)}, "rng": tcd.PerRank(tensorcanon.RngState.capture())}, target)
    expected = [torch.rand(3).tolist(), __import__("random").random()]
    tensorcanon.seed_everything(0)
    state = {"model": {"w": torch.ones(3)}, "rng": tcd.PerRank(None)}
    tcd.load(state, target)
    state["rng"].value.restore()
    return [expected == [torch.rand(3).tolist(), __import__("random").random()], state["model"]["w"].tolist()]


def _load_error(folder, world, rank, **kw):
    target = zeros_like_state(sharded_state(world, rank, seed=3))
    try:
        tcd.load(target, folder, **kw)
    except tensorcanon.TensorCanonError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"fingerprint": tensorcanon.fingerprint(unsharded(target))}


def damaged_chunk(rank, world, folder):
    target = os.path.join(folder, "damaged")
    if rank == 0:
        shutil.copytree(os.path.join(folder, "state-a"), target)
        flip_byte(layout.read(target).file_path(1), -5, 1)
    dist.barrier()
    return _load_error(target, world, rank)


def missing_index(rank, world, folder):
    target = os.path.join(folder, "no-index")
    if rank == 0:
        shutil.copytree(os.path.join(folder, "state-a"), target)
        os.unlink(os.path.join(target, layout.INDEX_NAME))
    dist.barrier()
    return _load_error(target, world, rank)


def replica_mismatch(rank, world, folder):
    try:
        tcd.save({"step": 10 + rank, "w": torch.zeros(2)}, os.path.join(folder, "mismatch"))
    except tensorcanon.TensorCanonError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return "saved"


def no_pickle_load(rank, world, folder):
    return _refusing_pickle(lambda: _load_error(os.path.join(folder, "state-a"), world, rank))


def _refusing_pickle(fn):
    with no_unpickling():
        return fn()


def _as_error(fn):
    try:
        fn()
    except tensorcanon.TensorCanonError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return None


def partial_loads(rank, world, folder):
    """The model of a model + optim checkpoint, through tcd.load and through DCP's own planner."""
    import torch.distributed.checkpoint as dcp

    source = os.path.join(folder, "state-a")
    zero = zeros_like_state(sharded_state(world, rank))
    model = {"model": zero["model"]}
    _refusing_pickle(lambda: tcd.load(model, source))
    extra = {"model": zeros_like_state(sharded_state(world, rank))["model"], "lr": 0.5}
    missing = _as_error(lambda: tcd.load(extra, source))
    tcd.load(extra, source, allow_partial_load=True)
    by_dcp = {"model": zeros_like_state(sharded_state(world, rank))["model"], "step": None, "not_saved": 3}
    _refusing_pickle(lambda: dcp.load(by_dcp, storage_reader=tcd.Reader(source),
                                      planner=dcp.DefaultLoadPlanner(allow_partial_load=True)))
    return {"model": tensorcanon.fingerprint(unsharded(model)), "missing": missing, "kept": extra["lr"],
            "dcp_model": tensorcanon.fingerprint(dict(unsharded(by_dcp["model"]))),
            "dcp_values": [by_dcp["step"], by_dcp["not_saved"]]}


def overwrite_refused(rank, world, folder):
    target = os.path.join(folder, "state-a")
    before = _files(target)
    errors = [_as_error(lambda: tcd.save(sharded_state(world, rank, seed=5), target, overwrite=False)),
              _as_error(lambda: tcd.async_save(sharded_state(world, rank, seed=5), target,
                                               overwrite=False).result(timeout=60))]
    dist.barrier()
    return [errors, _files(target) == before]


def sharded_tensor_refused(rank, world, folder):
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    state = {"model": {"st": empty(spec, 4, 2)}, "step": 1}
    target = os.path.join(folder, "sharded-tensor")
    return [_as_error(lambda: tcd.save(state, target)),
            _as_error(lambda: tcd.async_save(state, target).result(timeout=60)),
            os.path.exists(os.path.join(target, layout.INDEX_NAME))]


def _byte_items_back(folder, world, **kw):
    """Load the byte-items checkpoint with pickle refused; what came back, as JSON."""
    target = bytes_target(world)
    train = target["train"]  # (torch 2.4's dcp.load puts its state_dict in its place)
    _refusing_pickle(lambda: tcd.load(target, folder, **kw))
    sampler, loader = target["data"]["sampler"], target["data"]["loader"].value
    return {"train": [train.step, train.losses == list(LOSSES)],
            "sampler": [type(sampler).__name__, sampler.tell(), sampler.getvalue() == SAMPLER],
            "loader": None if loader is None else [loader.tell(), loader.getvalue().decode()],
            "w": target["model"]["w"].full_tensor().tolist() == torch.arange(24.0).reshape(8, 3).tolist()}


def byte_items_save(rank, world, folder):
    """io.BytesIO values (a Stateful's, a replicated one, a PerRank one) saved and loaded back."""
    target = os.path.join(folder, "bytes-2")
    digest = tcd.save(bytes_state(world, rank), target)
    return [digest, tcd.verify(target), _byte_items_back(target, world)]


# ------------------------------------------------------------------ three ranks

def fsdp2_reshard_and_save(rank, world, folder):
    model, optim = build(world, steps=0)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": 0, "cfg": None}
    tcd.load(state, os.path.join(folder, "fsdp2"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, optim)
    again = {"model": model_sd, "optim": optim_sd, "step": state["step"], "cfg": state["cfg"]}
    return [tensorcanon.fingerprint(unsharded(again)), tcd.save(again, os.path.join(folder, "fsdp3"))]


def state_reshard_2_to_3(rank, world, folder):
    return _load_error(os.path.join(folder, "state-a"), world, rank, keep_per_rank_on_resize=True)


def per_rank_resize_refused(rank, world, folder):
    return _load_error(os.path.join(folder, "state-a"), world, rank)


def byte_items_reshard_2_to_3(rank, world, folder):
    source = os.path.join(folder, "bytes-2")
    back = _byte_items_back(source, world, keep_per_rank_on_resize=True)
    return [back, tcd.save(bytes_state(world, rank), os.path.join(folder, "bytes-3"))]


def state_save_three(rank, world, folder):
    return tcd.save(sharded_state(world, rank), os.path.join(folder, "state-3"))


# ------------------------------------------------------------------ NCCL (one GPU per rank)

def nccl_save_load(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import Shard, distribute_tensor
    from states import full_tensors

    full = full_tensors()
    mesh = init_device_mesh("cuda", (world,))
    state = {"row": distribute_tensor(full["row"].cuda(), mesh, [Shard(0)]),
             "col": distribute_tensor(full["col"].cuda(), mesh, [Shard(1)]),
             "plain": full["plain"].cuda(), "step": 5}
    expected = tensorcanon.fingerprint({"row": full["row"], "col": full["col"], "plain": full["plain"], "step": 5})
    target_dir = os.path.join(folder, "nccl")
    digest = tcd.save(state, target_dir)
    fut = tcd.async_save(state, target_dir + "-async")
    async_digest = fut.result(timeout=120)
    target = zeros_like_state(state)
    tcd.load(target, target_dir)
    loaded = {k: v.full_tensor().cpu() if hasattr(v, "full_tensor") else v for k, v in target.items()}
    loaded["plain"] = target["plain"].cpu()
    return [digest == expected, async_digest == expected, tensorcanon.fingerprint(loaded) == expected,
            target["row"].device.type]


BATCHES = {
    "two": [
        ("fsdp2_save", fsdp2_save),
        ("state_save_twice", state_save_twice),
        ("async_thread", async_thread),
        ("async_process", async_process),
        ("rng_per_rank", rng_per_rank),
        ("damaged_chunk", damaged_chunk),
        ("missing_index", missing_index),
        ("replica_mismatch", replica_mismatch),
        ("no_pickle_load", no_pickle_load),
        ("partial_loads", partial_loads),
        ("overwrite_refused", overwrite_refused),
        ("sharded_tensor_refused", sharded_tensor_refused),
        ("byte_items_save", byte_items_save),
    ],
    "three": [
        ("fsdp2_reshard_and_save", fsdp2_reshard_and_save),
        ("state_reshard_2_to_3", state_reshard_2_to_3),
        ("per_rank_resize_refused", per_rank_resize_refused),
        ("state_save_three", state_save_three),
        ("byte_items_reshard_2_to_3", byte_items_reshard_2_to_3),
    ],
    "nccl": [("nccl_save_load", nccl_save_load)],
}
if not FSDP2_ON_CPU:  # test_spawned.py skips their test (naming the torch needed)
    for _batch in ("two", "three"):
        BATCHES[_batch] = [(n, f) for n, f in BATCHES[_batch] if not n.startswith("fsdp2_")]

__all__ = ["BATCHES", "logical_digest", "batch", "loader_bytes"]
