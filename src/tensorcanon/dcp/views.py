"""What DCP is told about a checkpoint: its ``Metadata``, in the two views its planners need.

DCP's planners find the entries of a checkpoint by name. Two kinds of planner
read a tensorcanon checkpoint, and they name things differently:

- :class:`tensorcanon.dcp.LoadPlanner` walks the logical tree itself and asks
  for each tensor under its tensorcanon name (docs/FORMAT.md §3):
  :func:`canonical_view`;
- DCP's own planners (``DefaultLoadPlanner``, and the planner of DCP's
  ``_load_state_dict_from_keys``) flatten the state by DCP's rules (dotted
  names, keys turned into text, tuples and lists without tensors kept whole as
  one "bytes" value): :func:`dcp_view`, which flattens the checkpoint's logical
  tree with DCP's own function, so both sides agree on every name.

``Reader.read_metadata`` returns the DCP view, with a :class:`CheckpointInfo` as
``planner_data`` (the map DCP's planners expect there, plus the validated
index); :class:`LoadPlanner` replaces it with the canonical view when it plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format import packed, tensorbytes
from ..format.errors import UsageError
from ..format.limits import Limits
from ..format.tree import Decoder, items, tag_of
from ..sharded import layout


@dataclass
class FailedIndex:
    """What Reader.read_metadata returns when the index cannot be read: the error is raised by
    the next step, inside DCP's exception handling, so every rank gets it and none waits."""

    error: BaseException


@dataclass(frozen=True)
class ValueRef:
    """A value that DCP's flattening keeps whole (a DCP "bytes" entry): its DCP path (keys as
    text, list indices as ints) in the checkpoint's logical tree."""

    path: tuple


class CheckpointInfo(dict):
    """``Metadata.planner_data`` of a tensorcanon checkpoint.

    As a dict it is what DCP's own planners expect there: DCP's flattening map (each DCP
    name -> its path). ``index`` is the validated index, which :class:`LoadPlanner` uses
    (and then sets ``canonical``); ``dcp_error`` says why DCP's flattening could not describe
    the checkpoint, if it could not.
    """

    def __init__(self, mapping: dict, index: layout.Index, dcp_error: str | None = None) -> None:
        super().__init__(mapping)
        self.index = index
        self.dcp_error = dcp_error
        self.canonical = False  # set by LoadPlanner when it switches the metadata to canonical_view


def _tensor_entry(index: layout.Index, t: int) -> TensorStorageMetadata | None:
    info = index.logical.tensors[t]
    if info.dtype.torch is None:
        return None  # a dtype this torch lacks: no state dict can hold it
    chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in index.chunks[t]]
    return TensorStorageMetadata(TensorProperties(dtype=info.dtype.torch), torch.Size(info.shape), chunks)


def _add_tensor(index: layout.Index, t: int, name: str, md: dict, storage: dict) -> None:
    entry = _tensor_entry(index, t)
    if entry is None:
        return
    md[name] = entry
    for c in index.chunks[t]:
        storage[MetadataIndex(name, c.offsets)] = (t, c)


def canonical_view(index: layout.Index) -> tuple[dict, dict]:
    """(state_dict_metadata, storage_data): one entry per logical tensor, under its tensorcanon name."""
    md: dict = {}
    storage: dict = {}
    for t, info in enumerate(index.logical.tensors):
        _add_tensor(index, t, info.name, md, storage)
    return md, storage


def dcp_view(index: layout.Index, limits: Limits) -> tuple[dict, dict, CheckpointInfo]:
    """(state_dict_metadata, storage_data, planner_data) under the names DCP's flattening gives.

    A tensor is a tensor entry; every other value DCP keeps whole (numpy arrays
    included: DCP's flattening sees no tensor in them) is a bytes entry whose storage is
    a :class:`ValueRef` (the Reader decodes it from the index, and reads the tensors
    inside it, verified, without pickle).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    placeholders = [tensorbytes.host_empty(0, torch.float32) for _ in index.logical.tensors]
    which = {id(p): t for t, p in enumerate(placeholders)}
    try:
        decoder = Decoder(placeholders, limits.max_depth)
        decoder.used = [True] * len(placeholders)
        flat, mapping = flatten_state_dict(decoder.decode(_kept_whole(index.logical.root)))
    except Exception as e:  # noqa: BLE001 - a registered type this process lacks, keys DCP cannot flatten
        return {}, {}, CheckpointInfo({}, index, f"{type(e).__name__}: {e}")
    md: dict = {}
    storage: dict = {}
    for fqn, value in flat.items():
        t = which.get(id(value))
        if t is not None and index.logical.tensors[t].kind != "ndarray":
            _add_tensor(index, t, fqn, md, storage)
        else:
            md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = ValueRef(tuple(mapping[fqn]))
    return md, storage, CheckpointInfo({k: v for k, v in mapping.items() if k in md}, index)


_MISSING = object()

# Tensors built from other tensors' values, or from none (docs/FORMAT.md §6.12): DCP cannot read into
# them chunk by chunk, and the placeholders above have no values to build them from. DCP is shown
# each as a value it keeps whole (a bytes entry), which the Reader decodes from the index, reading
# and checking its parts; never as a tensor DCP would allocate (a meta tensor's size is no claim of
# bytes, and no rank file bounds it).
_BUILT = ("sparse", "nested", "meta")
_KEPT_WHOLE = "<a sparse, nested or meta tensor, decoded from the checkpoint's index>"


def _kept_whole(node: Any) -> Any:
    """``node`` with every sparse, nested or meta tensor node (with the ``tensor.attrs`` around one)
    replaced by a str leaf, which DCP's flattening keeps whole, at the same path."""
    if type(node) not in (list, tuple) or not node:
        return node
    tag = node[0]
    if tag in _BUILT or (tag == "tensor.attrs" and len(node) == 3 and tag_of(node[1]) in _BUILT):
        return _KEPT_WHOLE
    return [tag, *(_kept_whole(child) for child in node[1:])]


class NodeFinder:
    """The logical tree's nodes by DCP path (dict keys as DCP writes them: ``str(key)``).

    Each dict of the tree is indexed by those names the first time a path goes through it, so
    finding the nodes of n values costs time linear in n: DCP's own planner asks for every
    non-tensor value by its own path, and scanning a dict of n values for each was quadratic.
    """

    def __init__(self, index: layout.Index, limits: Limits) -> None:
        self._root = index.logical.root
        self._keys = Decoder([], limits.max_depth)
        self._children: dict[int, dict[str, Any]] = {}  # id of a dict node -> its values by DCP name
        self._lists: dict[int, Any] = {}  # id of a packed list node -> the list node it holds (packed.as_list)

    def _named(self, node: Any) -> dict[str, Any]:
        children = self._children.get(id(node))
        if children is None:
            children = {}
            for key, value in items(node):
                try:
                    name = str(self._keys.decode(key))
                except ValueError:  # an int too long for str(): DCP cannot name it either
                    continue
                children.setdefault(name, value)  # the first key of a name, as a scan in order finds it
            self._children[id(node)] = children
        return children

    def __call__(self, path: tuple) -> Any:
        node = self._root
        for step in path:
            node = packed.as_list(node, self._lists)  # DCP's flattening goes into lists of dicts
            tag = tag_of(node)
            found: Any = _MISSING
            if tag in ("dict", "odict") and isinstance(step, str):
                found = self._named(node).get(step, _MISSING)
            elif tag == "list" and type(step) is int and 0 <= step < len(node) - 1:
                found = node[step + 1]
            if found is _MISSING:
                raise UsageError(f"{'.'.join(map(str, path))}: not found in the checkpoint's tree the way DCP's "
                                 "flattening names it; load it with tensorcanon.dcp.LoadPlanner")
            node = found
        return node


def node_at(index: layout.Index, path: tuple, limits: Limits) -> Any:
    """The logical tree's node at a DCP path (one lookup; :class:`NodeFinder` for many)."""
    return NodeFinder(index, limits)(path)


__all__ = ["FailedIndex", "ValueRef", "CheckpointInfo", "canonical_view", "dcp_view", "node_at", "NodeFinder"]
