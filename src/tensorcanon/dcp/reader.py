"""Reader: DCP's StorageReader for canonical sharded checkpoints.

``read_metadata`` builds DCP's ``Metadata`` from the validated index (no
pickle): one tensor entry per logical tensor, with its chunks, so DCP's own
resharding plans the reads. ``read_data`` copies each requested region out of
a memory-mapped rank file after hashing the whole chunk against its digest
(once per chunk), so every byte that reaches the state dict is verified.

It refuses to run with a planner that would unpickle: DCP's
``DefaultLoadPlanner`` loads non-tensor values with
``torch.load(weights_only=False)``; only :class:`LoadPlanner` (or a subclass
that keeps its ``load_bytes``) is accepted.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner as _DCPLoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import tensorbytes
from ..errors import FormatError, TensorCanonError, UsageError
from ..limits import DEFAULT, Limits
from ..sharded import layout
from ..sharded.files import RankFiles, with_context
from ..sharded.read import chunk_info
from .load_planner import FailedIndex, LoadMark, LoadPlanner

_REFUSED = (
    "tensorcanon.dcp.Reader refuses to run with {name}: DCP's default load planner loads non-tensor "
    "values with torch.load(weights_only=False), which runs pickle. Pass "
    "planner=tensorcanon.dcp.LoadPlanner() to dcp.load (or use tensorcanon.dcp.load)"
)


def _refuse_planner(planner: Any) -> None:
    if not isinstance(planner, LoadPlanner) or type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        raise UsageError(_REFUSED.format(name=type(planner).__name__))


class Reader(StorageReader):
    """Reads a checkpoint written by :class:`Writer`, verifying every chunk it uses.

    Example::

        dcp.load(state, storage_reader=tensorcanon.dcp.Reader("ckpt/step100"),
                 planner=tensorcanon.dcp.LoadPlanner())
    """

    def __init__(self, path: str | os.PathLike, *, limits: Limits = DEFAULT) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.limits = limits
        self.index: layout.Index | None = None
        self.storage: dict = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.index, self.storage = None, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            index = layout.read(self.path, self.limits)
        except TensorCanonError as e:
            return Metadata({}, planner_data=FailedIndex(e))
        md: dict = {}
        storage: dict = {}
        for t, info in enumerate(index.logical.tensors):
            if info.dtype.torch is None:
                continue  # a dtype this torch lacks: no state dict can hold it
            md[info.name] = TensorStorageMetadata(
                TensorProperties(dtype=info.dtype.torch), torch.Size(info.shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in index.chunks[t]],
            )
            for c in index.chunks[t]:
                storage[MetadataIndex(info.name, c.offsets)] = (t, c)
        _add_dcp_names(index, md, storage, self.limits)
        return Metadata(md, planner_data=index, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata.planner_data, FailedIndex):
            raise metadata.planner_data.error
        if not isinstance(metadata.planner_data, layout.Index):
            raise UsageError("tensorcanon.dcp.Reader got metadata it did not read")
        self.index = metadata.planner_data
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if not isinstance(plan.planner_data, LoadMark):
            raise UsageError(_REFUSED.format(name="a planner other than tensorcanon.dcp.LoadPlanner"))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: _DCPLoadPlanner) -> Future[None]:
        _refuse_planner(planner)
        index = self.index
        if index is None:
            raise UsageError("tensorcanon.dcp.Reader.read_data was called before set_up_storage_reader")
        # Group by chunk, so each chunk is hashed once and its pages are read together.
        by_chunk: dict = defaultdict(list)
        for req in plan.items:
            if req.type is not LoadItemType.TENSOR:
                raise UsageError(_REFUSED.format(name="a plan that reads pickled bytes"))
            t, c = self.storage[req.storage_index]
            by_chunk[(c.rank, t, c.offsets)].append((req, t, c))
        with RankFiles(index, self.limits) as files:
            for key in sorted(by_chunk):
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


def _add_dcp_names(index: layout.Index, md: dict, storage: dict, limits: Limits) -> None:
    """Also list every value under the name DCP's own flattening gives it.

    LoadPlanner does not need these entries. They let DCP's DefaultLoadPlanner (which
    flattens the state its own way) plan its reads and reach ``prepare_local_plan``,
    where it is refused with a clear message instead of failing on a "missing key".
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ..tree import Decoder

    placeholders = [torch.empty(0) for _ in index.logical.tensors]
    which = {id(p): t for t, p in enumerate(placeholders)}
    try:
        decoder = Decoder(placeholders, limits.max_depth)
        decoder.used = [True] * len(placeholders)
        flat, _ = flatten_state_dict(decoder.decode(index.logical.root))
    except Exception:  # noqa: BLE001 - unregistered types, keys DCP cannot flatten: skip the courtesy
        return
    for fqn, value in flat.items():
        if fqn in md:
            continue
        t = which.get(id(value))
        if t is None:
            md[fqn] = BytesStorageMetadata()
            continue
        name = index.logical.tensors[t].name
        if name in md:
            md[fqn] = md[name]
            for c in index.chunks[t]:
                storage[MetadataIndex(fqn, c.offsets)] = (t, c)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for equal dtypes, through same-size ints so that every dtype
    (float8, sub-byte ints) has a copy kernel and no value is ever converted."""
    as_int = tensorbytes.SAME_SIZE_INT.get(source.element_size())
    if as_int is not None and source.dtype is not as_int:
        target.view(as_int).copy_(source.view(as_int))
    else:
        target.copy_(source)
