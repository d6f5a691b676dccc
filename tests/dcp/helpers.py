"""Helpers shared by both test tiers (no pytest, no torch.testing import), and the torch names
the tests use, from wherever the installed torch keeps them.

The library's own differences between torch releases are in ``tensorcanon.dcp._compat``; this
adds what only the tests use: FSDP2's ``fully_shard`` (public ``torch.distributed.fsdp`` from
torch 2.6, the ``_composable`` one before; it runs on the CPU, as these tests need, from torch
2.6: before, it creates CUDA streams unconditionally) and ``_StridedShard`` (torch >= 2.5; None
before, so its test skips, naming the version).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import torch

from tensorcanon.dcp import PerRank
from tensorcanon.dcp._compat import (  # noqa: F401 - re-exported for the tests
    TORCH_VERSION,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]  # noqa: F401

FSDP2_ON_CPU = TORCH_VERSION >= (2, 6)
NO_FSDP2_ON_CPU = ("FSDP2 (fully_shard) runs only on CUDA before torch 2.6 (it creates CUDA streams); "
                   "these tests run it on the CPU")

try:  # torch >= 2.5
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:
    _StridedShard = None  # type: ignore[assignment,misc]


def unsharded(state: Any, memo: dict | None = None) -> Any:
    """The test oracle for the logical state: every DTensor replaced by its full tensor (tied
    DTensors, which share their local storage, by one full tensor), PerRank keys removed."""
    memo = {} if memo is None else memo
    if isinstance(state, DTensor):
        local = state._local_tensor
        key = (local.untyped_storage()._cdata, local.storage_offset(), tuple(local.shape), tuple(state.shape))
        if key not in memo or not state.numel():
            full = state.full_tensor()
            memo[key] = torch.nn.Parameter(full, requires_grad=state.requires_grad) \
                if isinstance(state, torch.nn.Parameter) else full
        return memo[key]
    if type(state) in (dict, collections.OrderedDict):
        out = type(state)((k, unsharded(v, memo)) for k, v in state.items() if type(v) is not PerRank)
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata
        return out
    if type(state) in (list, tuple):
        return type(state)(unsharded(v, memo) for v in state)
    return state


def zeros_like_state(state: Any, memo: dict | None = None) -> Any:
    """A state of the same structure with every tensor zeroed (a DTensor keeps its placements;
    one object at two paths stays one object) and every non-tensor value replaced by None:
    what a fresh run would load into."""
    memo = {} if memo is None else memo
    if isinstance(state, torch.Tensor):
        if id(state) not in memo:
            if isinstance(state, DTensor):
                memo[id(state)] = DTensor.from_local(torch.zeros_like(state.to_local()), state.device_mesh,
                                                     state.placements, shape=state.shape, stride=state.stride())
            else:
                memo[id(state)] = torch.zeros_like(state.detach())
        return memo[id(state)]
    if type(state) is PerRank:
        return PerRank(None)
    if type(state) in (dict, collections.OrderedDict):
        out = type(state)((k, zeros_like_state(v, memo)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = None
        return out
    if type(state) is list:
        return [zeros_like_state(v, memo) for v in state]
    if type(state) is tuple:
        return tuple(zeros_like_state(v, memo) for v in state)
    return None


def rank_files(folder: str) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def flip_byte(path: str, offset: int, mask: int = 0x10) -> None:
    """Damage a file in place: XOR the byte at ``offset`` (negative: from the end) with ``mask``."""
    with open(path, "r+b") as fh:
        fh.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ mask]))
