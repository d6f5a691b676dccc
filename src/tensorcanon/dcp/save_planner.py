"""SavePlanner: DCP's default save planning, on the logical state, with replicas compared.

Differences from ``DefaultSavePlanner`` (whose planning, deduplication and
validation it reuses):

- the state is not flattened by DCP's rules (which turn every key into a
  string and every tuple into a pickled blob) but planned by tensorcanon
  (logical.py): DCP sees one entry per distinct tensor, under its tensorcanon
  name, and never a non-tensor value, so nothing goes through ``torch.save``;
- every rank sends the coordinator its skeleton (tree, table, per-rank paths)
  and the digests of what it holds replicated (plain tensors, replicated DTensor
  chunks); the coordinator refuses the save, naming the path, when ranks differ
  (DCP would keep one rank's copy without looking);
- :class:`PerRank` values stay on their rank; the Writer puts them in that rank's file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan

from ..format import digest, packed, paths, tensorbytes
from ..format.errors import UsageError
from ..format.limits import DEFAULT, Limits
from ..format.tree import items
from ..sharded.errors import ReplicaMismatchError
from ._compat import DTensor, Replicate, compute_local_shape_and_global_offset, global_save_plan
from .logical import LogicalState, plan_state


@dataclass
class LocalInfo:
    """What one rank tells the coordinator about its state (the local plan's planner_data)."""

    skeleton: tuple[bytes, str]
    replicas: dict[Any, bytes] = field(default_factory=dict)  # (name, offsets) -> digest of a replicated piece


class SavePlanner(DefaultSavePlanner):
    """Plans a canonical save; use it with :class:`tensorcanon.dcp.Writer`.

    ``check_replicas=False`` skips hashing replicated values at planning time (each
    rank then no longer checks that it holds the same replicated tensors as the
    others; the non-tensor values are still compared).

    Example::

        dcp.save(state, storage_writer=tensorcanon.dcp.Writer(path),
                 planner=tensorcanon.dcp.SavePlanner())
    """

    def __init__(self, *, check_replicas: bool = True, limits: Limits = DEFAULT) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.check_replicas = check_replicas
        self.limits = limits
        self.logical: LogicalState | None = None

    def planned(self) -> LogicalState:
        """The logical state :meth:`set_up_planner` planned (DCP calls it before anything else)."""
        if self.logical is None:
            raise UsageError("tensorcanon.dcp.SavePlanner was used before set_up_planner planned a save")
        return self.logical

    def set_up_planner(self, state_dict: dict, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self.logical = plan_state(state_dict, self.limits)
        self.state_dict = self.logical.flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        info = LocalInfo(self.planned().skeleton())
        if self.check_replicas:
            info.replicas = self._replica_digests()
        self.plan = dataclasses.replace(plan, planner_data=info)
        return self.plan

    def _replica_digests(self) -> dict:
        out = {}
        for src in self.planned().plan.tensors:
            value = self.state_dict[src.name]
            if isinstance(value, DTensor):
                mesh = value.device_mesh
                if mesh.get_coordinate() is None or not any(
                        isinstance(p, Replicate) and mesh.size(d) > 1 for d, p in enumerate(value.placements)):
                    continue
                local = value.to_local()
                key: tuple[str, tuple[int, ...] | None]
                _, offsets = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
                key = (src.name, tuple(offsets))
            else:
                local, key = value, (src.name, None)
            h = digest.tensor_hasher(src.dtype.name, tuple(local.shape), digest.DEFAULT)
            h.update(tensorbytes.host_bytes(local, "tensor"))
            out[key] = h.digest()
        return out

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        infos = [p.planner_data for p in all_plans]
        if not all(isinstance(i, LocalInfo) for i in infos):
            raise UsageError("every rank must save with tensorcanon.dcp.SavePlanner")
        compare_ranks(infos, self.planned())
        plans = [dataclasses.replace(p, planner_data=None) for p in all_plans]
        self.global_plan, self.metadata = global_save_plan(self, plans)
        return self.global_plan, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def __getstate__(self) -> dict:
        # async_save's process executor pickles the planner before it plans: nothing to drop,
        # but never send a planned state (it holds the rank's tensors) through a pipe.
        state = dict(self.__dict__)
        state.pop("logical", None)
        state.pop("state_dict", None)
        return state


def compare_ranks(infos: list[LocalInfo], mine: LogicalState) -> None:
    """Raise :class:`ReplicaMismatchError` naming the first path where ranks disagree."""
    base = infos[0]
    for r, info in enumerate(infos[1:], start=1):
        if info.skeleton != base.skeleton:
            message, where = _skeleton_difference(base.skeleton, info.skeleton, r)
            raise ReplicaMismatchError(message, path=where)
    holders: dict = {}
    for r, info in enumerate(infos):
        for key, d in info.replicas.items():
            first = holders.setdefault(key, (r, d))
            if first[1] != d:
                name, offsets = key
                where = _path_of(mine, name)
                piece = "" if offsets is None else f" (its replicated chunk at offsets {list(offsets)})"
                raise ReplicaMismatchError(
                    f"{where}{piece} is saved once for all ranks but differs between rank {first[0]} and "
                    f"rank {r} (digests {digest.to_text(first[1])} and {digest.to_text(d)}); make the "
                    "ranks agree (broadcast it), or wrap it in tensorcanon.dcp.PerRank if each rank "
                    "should keep its own", path=where,
                )


def _path_of(state: LogicalState, name: str) -> str:
    for src in state.plan.tensors:
        if src.name == name:
            return paths.join(src.path)
    return repr(name)


def _skeleton_difference(a: tuple[bytes, str], b: tuple[bytes, str], rank: int) -> tuple[str, str | None]:
    """Words for the first difference between rank 0's skeleton and ``rank``'s, and its path."""
    head = f"rank {rank}'s state differs from rank 0's"
    tail = ("; every value not wrapped in tensorcanon.dcp.PerRank is saved once for all ranks and "
            "must be equal on all of them")
    (ma, pa), (mb, pb) = a, b
    if ma != mb:
        try:
            ta, tb = msgpack.unpackb(ma), msgpack.unpackb(mb)
        except Exception:  # noqa: BLE001 - only for a better message; msgpack raises many types
            return head + tail, None
        where, va, vb = _first_difference(ta["root"], tb["root"], ())
        if where is not None:
            at = paths.join(where)
            return (f"{head} at {at}: rank 0 has {_short(va)}, rank {rank} has {_short(vb)}{_first_byte(va, vb)}"
                    f"{tail}"), at
        for row_a, row_b in zip(ta["tensors"], tb["tensors"], strict=False):  # lengths may differ
            if row_a != row_b:
                return (f"{head}: tensor {row_a['name']!r} is {row_a['dtype']}{row_a['shape']} on rank 0 and "
                        f"{row_b['dtype']}{row_b['shape']} ({row_b['name']!r}) on rank {rank}{tail}"), None
        return f"{head} (its tensors, or which of them are tied){tail}", None
    return (f"{head}: per-rank values sit at {pa or 'no path'} on rank 0 but at {pb or 'no path'} on "
            f"rank {rank}; every rank must mark the same keys PerRank"), None


def _first_difference(a: Any, b: Any, where: tuple) -> tuple[tuple | None, Any, Any]:
    """(path, a's node, b's node) of the first difference between two tree nodes, or (None, ...)."""
    a, b = packed.expand(a), packed.expand(b)  # a packed list (FORMAT.md §6.13): by item, as the list it holds
    if a == b:
        return None, None, None
    if type(a) in (list, tuple) and type(b) in (list, tuple) and a and b and a[0] == b[0] and type(a[0]) is str:
        tag = a[0]
        if tag in ("dict", "odict") and len(a) == len(b):
            if tag == "odict" and a[1] != b[1]:
                return where + ("_metadata",), a[1], b[1]
            for (ka, va), (kb, vb) in zip(items(a), items(b), strict=True):
                if ka != kb:
                    return where + (_key(ka),), va, vb
                found = _first_difference(va, vb, where + (_key(ka),))
                if found[0] is not None:
                    return found
        elif tag in ("list", "tuple") and len(a) == len(b):
            for i in range(1, len(a)):
                found = _first_difference(a[i], b[i], where + (i - 1,))
                if found[0] is not None:
                    return found
    return where, a, b


def _key(node: Any) -> Any:
    return node if type(node) in (str, int, float, bool, bytes) or node is None else repr(node)


def _byte_value(node: Any) -> bytes | None:
    """The bytes of a bytes leaf or of a registered value stored as bytes (an io.BytesIO), else None."""
    if type(node) is bytes:
        return node
    if type(node) is list and len(node) == 3 and node[0] == "obj" and type(node[2]) is bytes:
        return node[2]
    return None


def _short(node: Any) -> str:
    if type(node) is list and node and node[0] == "tensor":
        return f"a tensor (index {node[1]})"
    data = _byte_value(node)
    if data is not None and len(data) > 32:  # a byte item (a pickled loss history, a loader's state)
        what = f"an {node[1]}" if type(node) is list else "bytes"
        return f"{what} of {len(data)} bytes ({data[:16]!r}...)"
    text = repr(node)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_byte(a: Any, b: Any) -> str:
    """Where two byte values first differ (their short forms may not show it)."""
    da, db = _byte_value(a), _byte_value(b)
    if da is None or db is None or type(a) is not type(b):
        return ""
    at = next((i for i, (x, y) in enumerate(zip(da, db, strict=False)) if x != y), min(len(da), len(db)))
    return f" (they first differ at byte {at})"
