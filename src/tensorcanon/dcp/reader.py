"""Reader: DCP's StorageReader for canonical sharded checkpoints.

``read_metadata`` builds DCP's ``Metadata`` from the validated index (no
pickle): one tensor entry per tensor, with its chunks, so DCP's own resharding
plans the reads (views.py: the names DCP's flattening gives, which
:class:`LoadPlanner` replaces with tensorcanon's). ``read_data`` copies each
requested region out of a memory-mapped rank file after hashing the whole chunk
against its digest (once per chunk), so every byte that reaches the state dict
is verified.

Any planner may read tensors. Non-tensor values are never unpickled: a value
that DCP's own planner asks for (a "bytes" read) is decoded by tensorcanon from
the index (tensors inside it read and verified) and put where DCP's
``DefaultLoadPlanner.load_bytes`` would put it, without calling that method
(which would run ``torch.load(weights_only=False)``). A planner with a
``load_bytes`` of its own is refused when it asks for such a value.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner as _DCPLoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..format import tensorbytes
from ..format.errors import FormatError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..sharded import layout
from ..sharded.files import SubtreeDecoder, with_context
from ..sharded.read import RankFiles, bound_sizes, chunk_info, read_tensor
from . import _compat, store as dcp_store
from .store import StoreTag
from .views import CheckpointInfo, FailedIndex, NodeFinder, ValueRef, dcp_view

_OWN_LOAD_BYTES = (
    "tensorcanon.dcp.Reader cannot give {what} to {name}: that planner has a load_bytes of its own, which "
    "expects DCP's pickled bytes (tensorcanon checkpoints hold none). Load with "
    "planner=tensorcanon.dcp.LoadPlanner() (or tensorcanon.dcp.load), or with DCP's DefaultLoadPlanner"
)


class Reader(StorageReader):
    """Reads a checkpoint written by :class:`Writer`, verifying every chunk it uses.

    Works with :class:`LoadPlanner` (tensorcanon's names, containers and per-rank
    values) and with DCP's own ``DefaultLoadPlanner`` (DCP's flattened names;
    ``allow_partial_load`` as DCP defines it), which DCP's
    ``_load_state_dict_from_keys`` uses too.

    Example::

        dcp.load(state, storage_reader=tensorcanon.dcp.Reader("ckpt/step100"),
                 planner=tensorcanon.dcp.LoadPlanner())
    """

    def __init__(self, path: str | os.PathLike | StoreTag, *, limits: Limits = DEFAULT,
                 storage_options: dict | None = None, **dcp_options: Any) -> None:
        _compat.refuse_storage_options("Reader", dcp_options)
        super().__init__()
        self._storage_options = storage_options
        self.target: StoreTag | None = None  # a checkpoint in a tensorcanon.Store (dcp/store.py)
        self._at(path)
        self.limits = limits
        self.index: layout.Index | None = None
        self.storage: dict = {}

    def _at(self, path: Any) -> None:
        if isinstance(path, StoreTag):
            dcp_store.refuse_options(path, self._storage_options, "tensorcanon.dcp.Reader")
            self.target, self.path, self.options = path, str(path), None
        else:
            self.target = None
            self.path, self.options = layout.where(path, self._storage_options)  # options: None for a local dir

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self._at(checkpoint_id)
        self.index, self.storage = None, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike, StoreTag))

    @property
    def checkpoint_id(self) -> Any:
        return self.target if self.target is not None else self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            if self.target is not None:  # each rank file read from the store when first used
                index = dcp_store.store_index(self.target, self.limits)
            else:
                index = layout.read(self.path, self.limits, self.options)
            # DCP builds tensors of the shapes it is given (_load_state_dict_from_keys, its planners)
            # before it asks for any data: give it only shapes the rank files back
            bound_sizes(index, self.limits)
        except TensorCanonError as e:
            return Metadata({}, planner_data=FailedIndex(e))
        md, storage, info = dcp_view(index, self.limits)
        return Metadata(md, planner_data=info, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata.planner_data, FailedIndex):
            raise metadata.planner_data.error
        if not isinstance(metadata.planner_data, CheckpointInfo):
            raise UsageError("tensorcanon.dcp.Reader got metadata it did not read")
        info = metadata.planner_data
        if not info.canonical and info.dcp_error is not None:
            raise UsageError(
                f"DCP's own load planner cannot read {self.path}: DCP's flattening of its state failed "
                f"({info.dcp_error}); load with planner=tensorcanon.dcp.LoadPlanner() (or tensorcanon.dcp.load)")
        self.index = info.index
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: _DCPLoadPlanner) -> Future[None]:
        index = self.index
        if index is None:
            raise UsageError("tensorcanon.dcp.Reader.read_data was called before set_up_storage_reader")
        # Group by chunk, so each chunk is hashed once and its pages are read together.
        by_chunk: dict = defaultdict(list)
        values = []
        for req in plan.items:
            where = self.storage.get(req.storage_index)
            if req.type is LoadItemType.BYTE_IO and isinstance(where, ValueRef):
                if not isinstance(planner, DefaultLoadPlanner) or \
                        type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
                    raise UsageError(_OWN_LOAD_BYTES.format(what=repr(req.storage_index.fqn),
                                                            name=type(planner).__name__))
                values.append((req, where))
            elif req.type is not LoadItemType.BYTE_IO and isinstance(where, tuple):
                t, c = where
                by_chunk[(c.rank, t, c.offsets)].append((req, t, c))
            else:
                raise UsageError(f"{req.storage_index.fqn!r}: the load plan asks for something this checkpoint "
                                 "does not hold there (a tensor where it holds a value, or the reverse)")
        with RankFiles(index, self.limits) as files:
            find = NodeFinder(index, self.limits)  # (one finder and one decoder: linear in the values asked)
            subtrees = SubtreeDecoder(len(index.logical.tensors), self.limits)
            for req, ref in values:
                node = find(ref.path)
                try:
                    value = subtrees.decode(node, lambda t: read_tensor(index, files, t))
                except TensorCanonError as e:
                    raise with_context(e, f"index {layout.index_path(index.folder)}: the value "
                                          f"{req.storage_index.fqn!r} (its paths start at it): ") from None
                _compat.give_value(planner, req, value)
            for key in sorted(by_chunk, key=lambda k: (k[0], _offset(files, index, by_chunk[k][0]))):
                reqs = by_chunk[key]
                _, t, c = reqs[0]
                what = functools.partial(index.describe, t, c)
                try:
                    f, row = chunk_info(files, index, t, c)  # the row the index promises
                    src = f.tensor(row, what)
                except TensorCanonError as e:
                    raise with_context(e, f"{what()}: ") from None
                for req, _, _ in reqs:
                    region = src
                    for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                        region = region.narrow(d, o, n)
                    target = planner.resolve_tensor(req).detach()
                    if tuple(target.shape) != tuple(region.shape):
                        raise FormatError(f"{what()}: DCP asked for a region of shape "
                                          f"{list(region.shape)} into a target of shape {list(target.shape)}")
                    _copy(target, region)
                    planner.commit_tensor(req, target)
                del src, region
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _offset(files: RankFiles, index: layout.Index, req: tuple) -> int:
    """Where a chunk starts in its rank file: chunks are read in file order (a rank file in object
    storage is read ahead sequentially). -1 where it cannot be found: read_data then says why."""
    _, t, c = req
    try:
        return chunk_info(files, index, t, c)[1].begin
    except TensorCanonError:
        return -1


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for equal dtypes, through same-size ints so that every dtype
    (float8, sub-byte ints) has a copy kernel and no value is ever converted."""
    as_int = tensorbytes.SAME_SIZE_INT.get(source.element_size())
    if as_int is not None and source.dtype is not as_int:
        target.view(as_int).copy_(source.view(as_int))
    else:
        target.copy_(source)
