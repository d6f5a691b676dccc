"""States used by the sharded checkpoint tests: one logical content, sharded many ways."""

from __future__ import annotations

import collections
import io
import struct

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon
from tensorcanon.dcp import PerRank

from helpers import Replicate, Shard, distribute_tensor


def full_tensors(seed: int = 0) -> dict:
    """The full values; every DTensor in :func:`sharded_state` is one of these, sharded."""
    g = torch.Generator().manual_seed(seed)
    return {
        "row": torch.randn(10, 7, generator=g),            # Shard(0): uneven over 3 and 4 ranks
        "col": torch.randn(5, 13, generator=g),            # Shard(1): a run per row and chunk
        "rep": torch.randn(4, 4, generator=g),             # Replicate
        "tiny": torch.randn(3, 5, generator=g),            # Shard(0) over 4 ranks: rank 3 holds no row
        "ints": torch.arange(11, dtype=torch.int64) * 3,   # Shard(0)
        "half": torch.randn(6, 2, generator=g).to(torch.bfloat16),
        "flags": torch.rand(9, generator=g) > 0.5,         # bool, Shard(0)
        "cube": torch.randn(4, 3, 5, generator=g),         # Shard(2)
        "tied": torch.randn(6, 3, generator=g),            # one DTensor at two paths
        "plain": torch.randn(3, generator=g),              # a replicated plain tensor
        "scalar": torch.tensor(2.5),                       # a 0-d plain tensor
        "nothing": torch.empty(0, 3),                      # a zero-size DTensor
    }


def sharded_state(world: int, rank: int, seed: int = 0, *, mesh_shape: tuple | None = None,
                  per_rank: bool = True) -> dict:
    """A state dict as a training job holds it: DTensors of several placements (on a 1-D mesh,
    or on a 2-D mesh when ``mesh_shape`` is given), containers, non-tensor values, ties."""
    full = full_tensors(seed)
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,))
        place = {"row": [Shard(0)], "col": [Shard(1)], "rep": [Replicate()], "tiny": [Shard(0)],
                 "ints": [Shard(0)], "half": [Shard(0)], "flags": [Shard(0)], "cube": [Shard(2)],
                 "tied": [Shard(0)], "nothing": [Shard(0)]}
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
        place = {"row": [Shard(0), Shard(1)], "col": [Replicate(), Shard(1)], "rep": [Replicate(), Replicate()],
                 "tiny": [Shard(1), Shard(0)], "ints": [Shard(0), Replicate()], "half": [Shard(0), Shard(0)],
                 "flags": [Replicate(), Shard(0)], "cube": [Shard(2), Shard(0)], "tied": [Shard(1), Shard(0)],
                 "nothing": [Shard(0), Shard(1)]}
    d = {k: distribute_tensor(full[k], mesh, place[k]) for k in place}
    model = collections.OrderedDict([("layer.weight", d["row"]), ("layer.bias", d["ints"]),
                                     ("head.weight", d["tied"]), ("embed.weight", d["tied"])])
    model._metadata = collections.OrderedDict([("", {"version": 1}), ("layer", {"version": 2})])
    state = {
        "model": model,
        "optim": {
            "state": {0: {"exp_avg": d["col"], "exp_avg_sq": d["cube"], "step": full["scalar"].clone()},
                      1: {"momentum": d["half"], "mask": d["flags"]}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "name": None}],
        },
        "extra": {"rep": d["rep"], "tiny": d["tiny"], "nothing": d["nothing"], "plain": full["plain"].clone(),
                  "pair": (full["plain"][:2].clone(), "text"), "array": np.arange(5, dtype=np.float32)},
        "step": 42,
        "cfg": {"name": "run-7", "tags": {"a", "b"}, "ratio": 0.25, 7: b"\x00\x01", "big": 2**70,
                "dtype": torch.float16, "shape": torch.Size([2, 3])},
    }
    if per_rank:
        state["rng"] = PerRank({"rank": rank, "state": torch.full((3,), rank, dtype=torch.uint8)})
    return state


def logical_state(seed: int = 0) -> dict:
    """The same content held in one process, without per-rank values: the oracle built
    independently of any sharding (no DTensor involved)."""
    full = full_tensors(seed)
    model = collections.OrderedDict([("layer.weight", full["row"]), ("layer.bias", full["ints"]),
                                     ("head.weight", full["tied"]), ("embed.weight", full["tied"])])
    model._metadata = collections.OrderedDict([("", {"version": 1}), ("layer", {"version": 2})])
    return {
        "model": model,
        "optim": {
            "state": {0: {"exp_avg": full["col"], "exp_avg_sq": full["cube"], "step": full["scalar"].clone()},
                      1: {"momentum": full["half"], "mask": full["flags"]}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "name": None}],
        },
        "extra": {"rep": full["rep"], "tiny": full["tiny"], "nothing": full["nothing"],
                  "plain": full["plain"].clone(), "pair": (full["plain"][:2].clone(), "text"),
                  "array": np.arange(5, dtype=np.float32)},
        "step": 42,
        "cfg": {"name": "run-7", "tags": {"a", "b"}, "ratio": 0.25, 7: b"\x00\x01", "big": 2**70,
                "dtype": torch.float16, "shape": torch.Size([2, 3])},
    }


def logical_digest(seed: int = 0) -> str:
    return tensorcanon.fingerprint(logical_state(seed))


# ------------------------------------------------------------------ byte items (io.BytesIO values)

class TrainState:
    """Training state kept the way DCP's own end-to-end test keeps it: a Stateful whose
    ``state_dict()`` holds its loss history as an ``io.BytesIO`` (here packed floats, not a pickle)."""

    def __init__(self, step: int = 0, losses: tuple = ()) -> None:
        self.step, self.losses = step, list(losses)

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        buf.write(struct.pack(f"<{len(self.losses)}d", *self.losses))   # left at its end, as torch.save leaves it
        return {"step": torch.tensor(self.step), "losses": buf}

    def load_state_dict(self, state: dict) -> None:
        buf = state["losses"]
        assert type(buf) is io.BytesIO and buf.tell() == 0, buf     # given back at position 0
        data = buf.read()
        self.step, self.losses = int(state["step"]), list(struct.unpack(f"<{len(data) // 8}d", data))


LOSSES = (2.5, 1.25, 0.625, 0.3125)
SAMPLER = b"sampler: seed 7, step 123; " + bytes(range(256))


def loader_bytes(rank: int) -> bytes:
    return f"rank {rank}: shard position 640, epoch 2".encode()


def bytes_state(world: int, rank: int) -> dict:
    """A state with byte items: a Stateful's BytesIO, a replicated BytesIO, a per-rank one."""
    mesh = init_device_mesh("cpu", (world,))
    return {"model": {"w": distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])},
            "train": TrainState(3, LOSSES),
            "data": {"epoch": 2, "sampler": io.BytesIO(SAMPLER),
                     "loader": PerRank(io.BytesIO(loader_bytes(rank)))}}


def bytes_target(world: int) -> dict:
    """What a fresh run loads :func:`bytes_state` into."""
    mesh = init_device_mesh("cpu", (world,))
    return {"model": {"w": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])}, "train": TrainState(),
            "data": {"epoch": 0, "sampler": io.BytesIO(b"stale"), "loader": PerRank(None)}}


def bytes_logical() -> dict:
    """:func:`bytes_state` held in one process, without its per-rank value: the logical state."""
    return {"model": {"w": torch.arange(24.0).reshape(8, 3)}, "train": TrainState(3, LOSSES).state_dict(),
            "data": {"epoch": 2, "sampler": io.BytesIO(SAMPLER)}}
