"""Helpers shared by both test tiers (no pytest, no torch.testing import)."""

from __future__ import annotations

import collections
import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tensorcanon.dcp import PerRank


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
