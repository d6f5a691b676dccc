"""LoadPlanner: load a canonical checkpoint into a state dict, in place, without pickle.

The target state dict is walked side by side with the checkpoint's logical tree
(never flattened by DCP's rules, so int keys, tuples and OrderedDicts keep
their meaning):

- a tensor, DTensor, Parameter or numpy array in the target is filled in place
  by DCP (resharding as its placements require) from the tensor at the same path;
  its dtype and global shape must match exactly (no silent conversion);
- a :class:`PerRank` entry gets this rank's own value from this rank's file;
- any other value is replaced by the checkpoint's value at that path, decoded by
  tensorcanon from the index (tensors inside it, if any, are read whole);
- a target key the checkpoint lacks is an error naming it, unless
  ``allow_partial_load=True`` (then it keeps its value, as with DCP's planner);
  checkpoint keys the target lacks are not loaded (as in DCP), so a state dict
  holding only the model loads the model of a model + optimizer checkpoint.

DCP's ``load_bytes`` (which ends in ``torch.load(weights_only=False)``) is never
reached: no read item is of the BYTE_IO kind.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ..format import dtypes, packed, paths
from ..format.errors import TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.tree import Decoder, items, tag_of
from ..format.walk import METADATA
from ..sharded import layout
from ..sharded.files import decode_subtree, with_context
from ..sharded.read import RankFiles, read_tensor
from . import _compat
from ._compat import DTensor, object_coll_device
from .perrank import PerRank
from .views import CheckpointInfo, FailedIndex, canonical_view


class LoadPlanner(DefaultLoadPlanner):
    """Plans a verified, pickle-free load; use it with :class:`tensorcanon.dcp.Reader`.

    ``process_group`` must be the group passed to ``dcp.load`` (None: the default
    group); it gives this rank's number for per-rank values. With
    ``keep_per_rank_on_resize=True`` a load with another world size than the save
    keeps the target's per-rank values instead of raising. With
    ``allow_partial_load=True`` a key of the state dict that the checkpoint lacks
    keeps its value instead of raising.

    Example::

        dcp.load(state, storage_reader=tensorcanon.dcp.Reader(path),
                 planner=tensorcanon.dcp.LoadPlanner())
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None,
                 keep_per_rank_on_resize: bool = False, allow_partial_load: bool = False,
                 limits: Limits = DEFAULT) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=allow_partial_load)
        _compat.check_process_group(process_group, loading=True)  # before any collective, also for dcp.load
        self.process_group = process_group
        self.keep_per_rank_on_resize = keep_per_rank_on_resize
        self.limits = limits

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        info = getattr(metadata, "planner_data", None)
        if isinstance(info, FailedIndex):
            raise info.error
        if metadata is None or not isinstance(info, CheckpointInfo):
            raise UsageError("tensorcanon.dcp.LoadPlanner reads checkpoints through tensorcanon.dcp.Reader "
                             "(pass storage_reader=tensorcanon.dcp.Reader(path) to dcp.load)")
        index = info.index
        # The Reader described the checkpoint by DCP's flattened names; this planner asks by
        # tensorcanon's (and the Reader reads the storage map only after this).
        metadata.state_dict_metadata, metadata.storage_data = canonical_view(index)
        info.canonical = True
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        else:
            rank, world = 0, 1
        walk = _Walk(index, rank, world, self.keep_per_rank_on_resize, self.allow_partial_load, self.limits)
        try:
            walk.mapping(state_dict, index.logical.root, ())
            self.state_dict = walk.flat
            for alias, fqn in walk.aliases.items():
                md = metadata.state_dict_metadata[fqn]
                assert isinstance(md, TensorStorageMetadata)  # an alias names a tensor (Reader.read_metadata)
                metadata.state_dict_metadata[alias] = md
                for c in md.chunks:
                    loc = metadata.storage_data[MetadataIndex(fqn, c.offsets)]
                    metadata.storage_data[MetadataIndex(alias, c.offsets)] = loc
        finally:
            walk.close()
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise UsageError("tensorcanon.dcp.LoadPlanner was used before set_up_planner")
        return create_default_local_load_plan(self.state_dict, self.metadata, True)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UsageError("tensorcanon checkpoints hold no pickled values: there is nothing to load_bytes")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["process_group"] = None
        return state


def _is_tensorlike(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _holds_tensors(v: Any, depth: int = 0) -> bool:
    if _is_tensorlike(v):
        return True
    if depth > 256:
        return False
    if isinstance(v, dict):
        return any(_holds_tensors(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensors(x, depth + 1) for x in v)
    return False


def _materialize_meta(t: Any) -> Any:
    """A meta tensor (a model built on the meta device) replaced by an empty one to load into,
    on the process group's device, as DCP's default planner does; other values unchanged."""
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    if isinstance(t, DTensor):
        kind = t.device_mesh.device_type
        module = getattr(torch, kind, None)
        device = torch.device(kind, module.current_device()) if kind != "cpu" and module else torch.device(kind)
    elif dist.is_available() and dist.is_initialized():
        try:
            device = object_coll_device()
        except (RuntimeError, ValueError):
            device = torch.device("cpu")
    else:
        device = torch.device("cpu")
    if isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), device=device)
        return DTensor.from_local(local, device_mesh=t.device_mesh, placements=t.placements,
                                  shape=t.size(), stride=t.stride())
    out = torch.empty_like(t, device=device)
    return torch.nn.Parameter(out, requires_grad=t.requires_grad) if type(t) is torch.nn.Parameter else out


def _memory(t: Any) -> tuple:
    """What makes two target tensors one piece of memory (reading into one fills the other)."""
    if isinstance(t, np.ndarray):
        return ("ndarray", t.__array_interface__["data"][0], t.shape, t.strides, t.dtype.str)
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.numel() == 0:
        return ("id", id(t))
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device))


class _Walk:
    """Matches a target state dict with the checkpoint's logical tree (see the module docstring)."""

    def __init__(self, index: layout.Index, rank: int, world: int, keep_per_rank: bool, partial: bool,
                 limits: Limits):
        self.index = index
        self.rank, self.world = rank, world
        self.keep_per_rank = keep_per_rank
        self.partial = partial
        self.limits = limits
        self.infos = index.logical.tensors
        self.flat: dict[str, Any] = {}
        self.aliases: dict[str, str] = {}
        self._memory: dict[str, Any] = {}
        self.per_rank = dict(zip(index.per_rank, index.per_rank_keys, strict=True))
        self.keys = Decoder([], limits.max_depth)
        self._files: RankFiles | None = None

    @property
    def files(self) -> RankFiles:
        if self._files is None:
            self._files = RankFiles(self.index, self.limits)
        return self._files

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

    # -------------------------------------------------------------- values
    def value(self, target: Any, node: Any, path: tuple) -> tuple[Any, bool]:
        """(the value to put at ``path``, whether it replaces ``target``)."""
        if type(target) is list:  # a packed list (FORMAT.md §6.13) is loaded into as the list node it holds
            node = packed.expand(node)
        tag = tag_of(node)
        if type(target) is PerRank:
            raise UsageError(f"{paths.join(path)} was saved for all ranks, not per rank (PerRank): load it "
                             "without the PerRank wrapper")
        if _is_tensorlike(target):
            if tag != "tensor":
                raise UsageError(f"{paths.join(path)} is a tensor in the state dict but the checkpoint holds "
                                 f"{self._describe(node)} there")
            real = _materialize_meta(target)
            self.tensor(real, node[1], path)
            return real, real is not target
        if isinstance(target, dict) and tag in ("dict", "odict"):
            self.mapping(target, node, path)
            return target, False
        if type(target) in (list, tuple) and tag == type(target).__name__ and len(node) - 1 == len(target):
            items, changed = [], False
            for i, (t, n) in enumerate(zip(target, node[1:], strict=True)):
                v, c = self.value(t, n, path + (i,))
                items.append(v)
                changed |= c
                if c and type(target) is list:
                    target[i] = v
            if type(target) is tuple and changed:
                return tuple(items), True
            return target, False
        if _holds_tensors(target):
            raise UsageError(f"{paths.join(path)} holds tensors in the state dict but the checkpoint holds "
                             f"{self._describe(node)} there: the structures differ")
        return self.materialize(node, path), True

    def mapping(self, target: dict, node: Any, path: tuple) -> None:
        tag = tag_of(node)
        if tag not in ("dict", "odict"):
            raise UsageError(f"{paths.join(path) or 'the state dict'} is a dict but the checkpoint holds "
                             f"{self._describe(node)} there")
        if tag == "odict" and isinstance(target, collections.OrderedDict):
            meta = self.materialize(node[1], path + ("_metadata",))  # a value like any other
            if meta is not None:
                setattr(target, METADATA, meta)
            elif hasattr(target, METADATA):
                delattr(target, METADATA)
        saved = {}
        for key, value in items(node):
            saved[self.keys.decode(key)] = value
        for k in list(target.keys()):
            where = path + (k,)
            if where in self.per_rank:
                self.per_rank_value(target, k, where)
            elif k in saved:
                v, changed = self.value(target[k], saved[k], where)
                if changed:
                    target[k] = v
            elif not self.partial:
                shown = sorted(map(paths.show, saved))  # each key shown once, as repr shows it: 'model'
                held = ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
                raise UsageError(
                    f"{paths.join(where)} is in the state dict but not in the checkpoint (which holds "
                    f"{held or 'no keys'} there); remove it from the state dict to load the rest, "
                    "or pass allow_partial_load=True to keep its value"
                )

    def per_rank_value(self, target: dict, k: Any, where: tuple) -> None:
        if self.world != self.index.world_size:
            if self.keep_per_rank:
                return
            raise UsageError(
                f"{paths.join(where)} holds per-rank state saved by {self.index.world_size} ranks, but this "
                f"load runs on {self.world}: no rank's value is this rank's. Pass "
                "keep_per_rank_on_resize=True to keep the values already in the state dict"
            )
        f = self.files.get(self.rank)
        value = f.value(self.per_rank[where], self.limits)
        if type(target[k]) is PerRank:
            target[k].value = value
        else:
            target[k] = value

    def tensor(self, target: Any, t: int, path: tuple) -> None:
        info = self.infos[t]
        if isinstance(target, np.ndarray):
            row = dtypes.BY_NUMPY.get(target.dtype.newbyteorder("<")) if target.dtype.fields is None else None
            if target.dtype.byteorder == ">" or not target.flags.writeable:
                raise UsageError(f"{paths.join(path)}: cannot load into a read-only or big-endian numpy array")
            dest = torch.from_numpy(target)
        else:
            row = dtypes.BY_TORCH.get(target.dtype)
            dest = target
        if row is not info.dtype or tuple(target.shape) != tuple(info.shape):
            have = f"{row.name if row else target.dtype}{list(target.shape)}"
            raise UsageError(f"{paths.join(path)} is {have} in the state dict but "
                             f"{info.dtype.name}{list(info.shape)} in the checkpoint; load into a tensor of "
                             "the saved dtype and shape (tensorcanon never converts silently)")
        fqn = info.name
        memory = _memory(target)
        if fqn not in self.flat:
            self.flat[fqn] = dest
            self._memory[fqn] = memory
            return
        if memory == self._memory[fqn]:
            return  # the same memory as the first target of this tensor (tied weights): filled once
        alias = f"{fqn}@tie{len(self.aliases)}"
        self.aliases[alias] = fqn
        self.flat[alias] = dest

    def materialize(self, node: Any, path: tuple) -> Any:
        """The checkpoint's value for ``node`` at ``path``, tensors included (read whole and verified);
        an error decoding it (a registered type this process lacks, a byte item's state that is not
        bytes) names ``path``."""
        try:
            return decode_subtree(node, len(self.infos), self.limits,
                                  lambda t: read_tensor(self.index, self.files, t))
        except TensorCanonError as e:
            raise with_context(e, f"{paths.join(path)}: ") from None

    def _describe(self, node: Any) -> str:
        if tag_of(node) is not None:
            if node[0] == "tensor":
                info = self.infos[node[1]]
                return f"a tensor {info.dtype.name}{list(info.shape)}"
            return f"a {node[0]}"
        return f"the value {paths.show(node)}"
