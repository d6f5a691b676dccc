"""A rank (or a lone saver) of tests/store/test_dcp_store_processes.py: ``python dcp_store_child.py MODE FOLDER``.

Modes:

- ``ranks``: a rank of a gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)
  that runs every scenario below in order and writes ``FOLDER/ranks.rank<r>.json``;
- ``killed``: a rank of a 2-rank gloo group; rank 1 is SIGKILLed by itself as soon as its blobs are
  in the store, rank 0 writes what its save raised to ``FOLDER/killed.rank0.json``;
- ``saver``: one process without a process group saving tags ``step-<n>`` into ``FOLDER/store``
  for ever (the parent kills it at random moments).
"""

import json
import os
import signal
import sys
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, TESTS, os.path.join(TESTS, "dcp")]

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon.dcp import store as dcp_store

from helpers import Shard, distribute_tensor, unsharded, zeros_like_state
from states import sharded_state


def steps_state(world, rank, step):
    """A state whose "frozen" shards and zeros repeat across steps and ranks; "moving" changes."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    frozen = torch.randn(256, 64, generator=g)
    moving = torch.randn(256, 64, generator=g) * (step + 1)
    return {"frozen": distribute_tensor(frozen, mesh, [Shard(0)]),
            "moving": distribute_tensor(moving, mesh, [Shard(1)]),      # split along dim 1: a digest pass
            "zeros": distribute_tensor(torch.zeros(128, 64), mesh, [Shard(0)]),
            "step": step, "rng": tcd.PerRank(torch.full((4,), rank, dtype=torch.uint8))}


def scenario_local(rank, world, folder):
    root = os.path.join(folder, "store")
    out = {}
    out["state"] = tcd.save(sharded_state(world, rank), tcd.StoreTag(tc.Store(root), "state"))
    tcd.save(sharded_state(world, rank), os.path.join(folder, "state-dir"))
    store = tc.Store(root)   # one Store object for the run, as a training job keeps it
    for step in range(3):
        out[f"step-{step}"] = tcd.save(steps_state(world, rank, step), tcd.StoreTag(store, f"step-{step}"))
        tcd.save(steps_state(world, rank, step), os.path.join(folder, f"step-{step}-dir"))
        dist.barrier()
        if rank == 0:
            out[f"stats-{step}"] = store.stats()
    target = zeros_like_state(sharded_state(world, rank))
    tcd.load(target, tcd.StoreTag(tc.Store(root), "state"))
    out["loaded"] = [tc.fingerprint(unsharded(target)), int(target["rng"].value["rank"])]
    return out


def scenario_s3(rank, world, folder):
    options = json.loads(os.environ.get("TC_TEST_S3_OPTIONS", "null"))
    if options is None:
        return None
    url = os.environ["TC_TEST_S3_URL"]
    out = {}
    for step in range(2):
        out[f"step-{step}"] = tcd.save(steps_state(world, rank, step),
                                       tcd.StoreTag(tc.Store(url, storage_options=options), f"step-{step}"))
    target = zeros_like_state(steps_state(world, rank, 1))
    tcd.load(target, tcd.StoreTag(url, "step-1", storage_options=options))
    out["loaded"] = tc.fingerprint(unsharded(target))
    return out


SCENARIOS = [("local", scenario_local), ("s3", scenario_s3)]


def _error(e):
    return {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()[-2000:]}


def ranks(folder):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, fn in SCENARIOS:
        try:
            out[name] = fn(rank, world, folder)
        except Exception as e:  # noqa: BLE001 - for the test to judge
            out[name] = _error(e)
        dist.barrier()
    _write(folder, f"ranks.rank{rank}.json", out)


def killed(folder):
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(folder, "store")
    out = {"before": tcd.save(sharded_state(world, rank), tcd.StoreTag(tc.Store(root), "before"))}
    real = dcp_store.write_rank

    def then_die(*args):
        written = real(*args)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)   # its blobs are durable, the coordinator has no record yet
        return written

    dcp_store.write_rank = then_die
    try:
        out["after"] = tcd.save(sharded_state(world, rank, seed=9), tcd.StoreTag(tc.Store(root), "after"))
    except BaseException as e:  # noqa: BLE001 - the survivor reports what it got
        out["after"] = _error(e)
    _write(folder, f"killed.rank{rank}.json", out)


def saver(folder):
    root = os.path.join(folder, "store")
    store = tc.Store(root)
    start = len(store.tags())
    n = start
    while True:
        g = torch.Generator().manual_seed(n)
        state = {"w": torch.randn(512, 256, generator=g), "frozen": torch.ones(256, 256), "n": n}
        digest = tcd.save(state, tcd.StoreTag(store, f"step-{n:04d}"))
        said = os.path.join(folder, f"step-{n:04d}.digest")
        with open(said + ".tmp", "w") as fh:   # (renamed once written: a kill between the file's creation
            fh.write(digest)                   # and its write would leave an empty digest to compare)
        os.replace(said + ".tmp", said)
        n += 1


def _write(folder, name, obj):
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    os._exit(0)   # (no process group teardown: tests/dcp/spawn.py says why)


if __name__ == "__main__":
    {"ranks": ranks, "killed": killed, "saver": saver}[sys.argv[1]](sys.argv[2])
