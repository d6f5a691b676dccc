"""The logical state: what a sharded state dict would be if one process held all of it.

Every rank plans it from its own state dict without moving data: a DTensor
becomes the full tensor it stands for (global dtype and shape, its kind and
``requires_grad``), plain tensors, arrays and other values stay as they are,
and :class:`PerRank` values are taken out (they belong to their rank, not to
the logical state). An ``io.BytesIO`` (DCP's byte item) is a value like any
other: its bytes, through the built-in codec (docs/FORMAT.md §6.9), never a
pickle. The plan is the library's own (writer.plan, with an
encoder that knows DTensors), so its manifest, once the tensor digests are
filled in, is byte for byte the manifest of ``tensorcanon.dumps`` of the
unsharded state; its digest is the checkpoint's logical digest.

Each logical tensor is handed to DCP under its tensorcanon name (docs/FORMAT.md
§3: the dotted path, which for a module state dict is DCP's own fqn).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format import digest, dtypes, packed, paths, registry, tensorbytes, tensorkinds
from ..format.errors import TensorCanonError, UnsupportedTypeError
from ..format.limits import DEFAULT, Limits
from ..format.tree import Encoder
from ..format.walk import METADATA
from ..io import writer
from ._compat import DTensor, Replicate, Shard
from .perrank import PerRank

_SUPPORTED_PLACEMENTS = (Shard, Replicate)


class LogicalEncoder(Encoder):
    """An Encoder that plans DTensors by their global metadata and sets PerRank values aside."""

    def __init__(self, max_depth: int, max_string_bytes: int = DEFAULT.max_string_array_bytes) -> None:
        super().__init__(max_depth, max_string_bytes=max_string_bytes)
        self.per_rank: list[tuple[tuple, Any]] = []  # (path, value), in traversal order

    def encode(self, value: Any, depth: int = 0) -> Any:
        t = type(value)
        if isinstance(value, DTensor):
            return self._dtensor(value)
        if isinstance(value, torch.Tensor) and t is not torch.Tensor and t is not torch.nn.Parameter \
                and registry.by_type(t) is None and not tensorkinds.is_jagged(value):
            raise self.unsupported(subclass_refusal(t))  # (registered subclasses, jagged tensors: FORMAT.md §6.12)
        if t is PerRank:
            raise self.unsupported(
                "a PerRank value must be the value of a dict key (per-rank state is kept out of the "
                "logical state by removing its key)"
            )
        if (t is dict or t is collections.OrderedDict) and any(type(v) is PerRank for v in value.values()):
            here = self.current_path()
            kept = t((k, v) for k, v in value.items() if type(v) is not PerRank)
            if t is collections.OrderedDict and hasattr(value, METADATA):
                setattr(kept, METADATA, getattr(value, METADATA))
            for k, v in value.items():
                if type(v) is PerRank:
                    self.per_rank.append((here + (k,), v.value))
            return super().encode(kept, depth)
        return super().encode(value, depth)

    def written_list(self, out: list) -> list:
        # A dict that held a PerRank value is written without it: a list of such dicts may now be
        # one the format packs (FORMAT.md §6.13), which packed_list could not see in the values.
        if self.packs and len(out) > packed.MIN_RECORDS:
            node = packed.pack_written(out[1:])
            if node is not None:
                return node
        return out

    def _dtensor(self, v: DTensor) -> list:
        extra = sorted(k for k in vars(v) if k != "_is_param") if tensorbytes.has_attributes(v) else []
        if extra:  # never dropped silently (FORMAT.md §6.12.4 holds a plain tensor's); _is_param: Parameter's mark
            names = ", ".join(map(repr, extra[:5]))
            raise self.unsupported(
                f"attributes are set on this DTensor ({names}), which tensorcanon.dcp does not save: save "
                "their values next to it in the state dict (or delete them) before saving")
        for p in v.placements:
            if type(p) not in _SUPPORTED_PLACEMENTS:
                raise self.unsupported(
                    f"DTensor placement {p} is not supported (only Shard and Replicate: a Partial "
                    "tensor holds no value until it is reduced, and a _StridedShard chunk is not a "
                    "hyper-rectangle of the tensor); redistribute it before saving"
                )
        row = dtypes.BY_TORCH.get(v.dtype)
        if row is None:
            raise self.unsupported(f"tensors of dtype {v.dtype} are not supported")
        kind = "parameter" if isinstance(v, torch.nn.Parameter) else "tensor"
        shape = tuple(v.shape)
        view_key = None
        if v.numel():
            # Tied DTensors (two state dict entries detached from one parameter) share their
            # local storage; the storage's identity (not data_ptr, which is 0 for an empty
            # local shard) tells them apart from distinct tensors.
            local = v._local_tensor
            view_key = ("dtensor", local.untyped_storage()._cdata, local.storage_offset(),
                        tuple(local.shape), local.stride(), v.dtype, shape, tuple(v.placements),
                        id(v.device_mesh), kind, v.requires_grad)
        return self.add_tensor(v, kind=kind, dtype=row, shape=shape, requires_grad=v.requires_grad,
                               view_key=view_key)


def subclass_refusal(t: type) -> str:
    """Why tensorcanon.dcp refuses a tensor subclass other than DTensor, and what to save instead.

    Worded from the type alone: some subclasses (ShardedTensor) raise on any attribute access.
    """
    name = f"{t.__module__}.{t.__qualname__}"
    if t.__name__ == "ShardedTensor":
        return (f"{name} (torch's deprecated sharded tensor) is not supported by tensorcanon.dcp; save "
                "DTensors instead (torch.distributed.tensor: FSDP2's fully_shard and get_state_dict give them)")
    if "FakeTensor" in t.__name__:
        return f"fake tensors ({name}) hold no data and cannot be saved"
    hooks = (" (tensorcanon.dcp does not call DCP's __create_write_items__ hooks, which it defines)"
             if hasattr(t, "__create_write_items__") else "")
    if tensorkinds.implements_flatten(t):
        return (f"tensor subclass {name} is not registered: it implements __tensor_flatten__, so call "
                f"tensorcanon.register({t.__qualname__}) before saving and loading")
    return (f"tensor subclass {name} is not supported by tensorcanon.dcp{hooks}; save it as a DTensor "
            "(torch.distributed.tensor), or save the plain tensors it holds")


@dataclass
class LogicalState:
    """One rank's view of the logical state: its plan, its DCP entries, its per-rank values."""

    plan: writer.Plan
    per_rank: list[tuple[tuple, Any]]          # (path, value), sorted by path in canonical order
    flat: dict[str, Any] = field(default_factory=dict)   # DCP fqn (tensor name) -> tensor / DTensor

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.plan.tensors]

    def skeleton(self) -> tuple[bytes, str]:
        """Everything the ranks must agree on: the tree (non-tensor values, containers, ties) and
        the tensor table without digests, as manifest bytes; the paths of per-rank values."""
        zero = bytes(digest.size(self.plan.algorithm))
        from ..format import manifest

        rows = [manifest.table_row(s.name, s.dtype.name, s.shape, s.kind, s.requires_grad, zero)
                for s in self.plan.tensors]
        body = manifest.pack(self.plan.root, None, rows, self.plan.algorithm)
        return body, ", ".join(paths.join(p) for p, _ in self.per_rank)


def plan_state(state: Any, limits: Limits = DEFAULT) -> LogicalState:
    """Plan the logical state of ``state`` (this rank's state dict) and its DCP entries."""
    enc = LogicalEncoder(limits.max_depth, limits.max_string_array_bytes)
    try:
        plan = writer.plan(state, None, limits, digest.DEFAULT, encoder=enc)
    except TensorCanonError:
        raise
    except Exception as e:  # an object whose attribute access raises, found while encoding it
        raise UnsupportedTypeError(f"cannot save the value at {enc.path()}: {type(e).__name__}: {e}",
                                   path=enc.path()) from e
    from ..format.ordering import sort_key

    per_rank = sorted(enc.per_rank, key=lambda pv: sort_key(pv[0]))
    for path, _ in per_rank:
        _check_per_rank_path(state, path)
    out = LogicalState(plan, per_rank)
    for src in plan.tensors:
        out.flat[src.name] = dcp_value(src.value)
    return out


def dcp_value(value: Any) -> Any:
    """The tensor DCP reads or writes for a value of the state: a DTensor as it is, a tensor
    detached, a numpy array as the tensor that shares its memory."""
    if isinstance(value, DTensor):
        return value
    if isinstance(value, np.ndarray):
        a = value
        if a.dtype.byteorder == ">" or not a.flags.c_contiguous or not a.flags.writeable:
            a = np.array(a, dtype=a.dtype.newbyteorder("<"), order="C")  # a native copy
        return torch.from_numpy(a)
    return value.detach()


def _check_per_rank_path(state: Any, path: tuple) -> None:
    node = state
    for i, k in enumerate(path[:-1]):
        if type(node) in (dict, collections.OrderedDict) and k in node:
            node = node[k]
        elif type(node) is list and type(k) is int and 0 <= k < len(node):
            node = node[k]
        else:
            raise UnsupportedTypeError(
                f"the PerRank value at {paths.join(path)} is not reached through dicts and lists "
                f"only (at {paths.join(path[:i + 1])}); keep per-rank state in plain dicts",
                path=paths.join(path),
            )
