"""The copy of a state dict that ``async_save`` writes while training goes on (its staging).

Newer DCP stages faithfully on its own (its ``DefaultStager`` deep-copies the
state, tensors' memory to the CPU). Older DCP (no ``DefaultStager``) copies a
state dict lossily: an ``OrderedDict`` becomes a plain dict (its ``_metadata``
lost, so the checkpoint would differ from a ``save`` of the same state) and a
CPU tensor is not copied at all (so a change made after ``async_save`` returns
may be saved). With such a DCP, :class:`tensorcanon.dcp.Writer` is DCP's
stager itself and stages with :func:`staged_copy`.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

from ..format import tensorbytes, tensorkinds
from ..format.walk import METADATA
from ._compat import DTensor
from .perrank import PerRank


def staged_copy(state: Any) -> Any:
    """A copy of ``state`` that later changes to ``state`` do not reach.

    Every tensor's memory is copied to the CPU once per storage, so views of one
    storage (tied weights) stay views of one storage; DTensors keep their mesh
    and placements, Parameters their class, tensors their ``requires_grad``;
    containers keep their types (an OrderedDict its ``_metadata``); every other
    value is deep-copied. One object at two paths stays one object.

    Example::

        staged = staged_copy({"w": torch.ones(2)})   # staged["w"] is a new CPU tensor
    """
    storages: dict[int, Any] = {}
    memo: dict[int, Any] = {}

    def memory(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        new = storages.get(st._cdata)
        if new is None:
            new = storages[st._cdata] = st.clone() if st.device.type == "cpu" else st.cpu()
        return tensorbytes.host_empty(0, t.dtype).set_(new, t.storage_offset(), t.size(), t.stride())

    def walk(v: Any) -> Any:
        if id(v) in memo:
            return memo[id(v)]
        t = type(v)
        out: Any
        if isinstance(v, DTensor):
            out = DTensor.from_local(memory(v._local_tensor), v.device_mesh, v.placements, run_check=False,
                                     shape=v.shape, stride=v.stride())
        elif t is torch.Tensor or t is torch.nn.Parameter:
            if tensorbytes.unsaveable(v) is not None:  # sparse, nested, meta (FORMAT.md §6.12): a copy of their own
                out = _own_copy(v)
                memo[id(v)] = out
                return out
            elif v.is_conj() or v.is_neg() or v._is_zerotensor():
                # its storage holds other values than it reads (an efficient zero tensor has none):
                # stage what it reads (alias_key never lets such a tensor share a stored tensor's storage)
                out = tensorbytes.resolved(v).cpu()
            else:
                out = memory(v)
        elif isinstance(v, torch.Tensor):
            # a jagged nested tensor is copied; another subclass: saving refuses it (or a registered
            # codec writes it), with the same words as without staging
            out = _own_copy(v) if tensorkinds.is_jagged(v) else v
        elif t is dict or t is collections.OrderedDict:
            out = t((k, walk(x)) for k, x in v.items())
            if hasattr(v, METADATA):
                setattr(out, METADATA, copy.deepcopy(getattr(v, METADATA)))
        elif t is list:
            out = [walk(x) for x in v]
        elif t is tuple:
            out = tuple(walk(x) for x in v)
        elif t is PerRank:
            out = PerRank(walk(v.value))
        else:
            out = copy.deepcopy(v)
        if isinstance(v, torch.Tensor) and out is not v:
            if isinstance(v, torch.nn.Parameter):
                out = torch.nn.Parameter(out, requires_grad=v.requires_grad)
            elif v.requires_grad:
                out.requires_grad_(True)
            attrs = tensorkinds.attributes(v) if tensorbytes.has_attributes(v) else None
            if attrs:  # attributes set on the tensor are saved too (FORMAT.md §6.12.4)
                out.__dict__.update({k: walk(x) for k, x in attrs.items()})
        memo[id(v)] = out
        return out

    return walk(state)


def _own_copy(v: torch.Tensor) -> torch.Tensor:
    """A sparse, nested or meta tensor's own copy (its parts' memory and its attributes); a tensor
    torch cannot copy (a quantized one, which saving refuses) as it is."""
    try:
        return copy.deepcopy(v)
    except (RuntimeError, TypeError, NotImplementedError):
        return v


__all__ = ["staged_copy"]
