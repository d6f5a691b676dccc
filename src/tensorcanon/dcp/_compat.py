"""What differs between the torch releases ``tensorcanon.dcp`` supports (2.4 to today).

Everything version-dependent lives here, so the other modules import one name
whatever the torch:

- DTensor and its placements: public ``torch.distributed.tensor`` from torch
  2.5, ``torch.distributed._tensor`` in 2.4 (the same classes);
- ``dcp.save``/``load``/``async_save`` take ``no_dist`` from torch 2.7 (before, they
  derive it from whether a process group is initialized, which is what we pass);
- ``async_save`` runs in a thread only before torch 2.7, which brings
  ``AsyncCheckpointerType`` (``"process"`` is refused there, naming 2.7);
- ``DefaultSavePlanner._create_global_plan`` (planning without DCP's plan caching)
  exists from torch 2.7; before, ``create_global_plan`` is the same planning;
- ``distributed_c10d._get_object_coll_device`` (torch 2.6) replaced
  ``_get_pg_default_device``;
- before torch 2.8, DCP addresses its coordinator (the group's rank 0) as global
  rank 0 in some collectives, so it fails with a process group whose first rank is
  not global rank 0;
  before torch 2.5, ``dcp.load`` sizes a gather by the whole world, so it fails with
  a group smaller than the world (both refused up front by :func:`check_process_group`);
- before its ``DefaultStager`` (torch 2.9), DCP's ``async_save`` copies a state dict
  lossily (staging.py), so the Writer stages it itself.

Example::

    from ._compat import DTensor, Shard, Replicate
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ..errors import UsageError

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # torch 2.4 (mypy checks against the installed torch, which has the names above)
    from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed._tensor._utils import (  # type: ignore[import-not-found,no-redef]
        compute_local_shape_and_global_offset,
    )
    from torch.distributed._tensor.placement_types import Partial

try:  # the async executors (thread, process) and the response that splits staging from upload
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
except ImportError:
    AsyncCheckpointerType = None  # type: ignore[assignment,misc]
    AsyncSaveResponse = None  # type: ignore[assignment,misc]

try:  # DCP's own faithful staging for async_save (a deep copy, tensors' memory to the CPU)
    from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
    DCP_STAGES_FAITHFULLY = True
except ImportError:
    DCP_STAGES_FAITHFULLY = False

_version = re.match(r"(\d+)\.(\d+)", torch.__version__)
TORCH_VERSION: tuple[int, int] = (int(_version[1]), int(_version[2])) if _version else (0, 0)

# The release whose DCP first has AsyncCheckpointerType.PROCESS, the first whose DCP works with
# a process group that does not start at global rank 0, and the first whose dcp.load works with
# a group smaller than the world (each named in a refusal below).
PROCESS_EXECUTOR_SINCE = (2, 7)
SUBGROUPS_SINCE = (2, 8)
SMALLER_GROUP_LOAD_SINCE = (2, 5)

_NO_DIST = {fn: "no_dist" in inspect.signature(fn).parameters for fn in (dcp.save, dcp.load, dcp.async_save)}


def dist_kwargs(fn: Any, single: bool) -> dict:
    """``{"no_dist": single}`` for the DCP functions that take it, else nothing (torch 2.4 derives it)."""
    return {"no_dist": single} if _NO_DIST.get(fn) else {}


def check_process_group(process_group: Any, *, loading: bool = False) -> None:
    """Refuse, before any collective, a process group this torch's DCP cannot coordinate."""
    if TORCH_VERSION >= SUBGROUPS_SINCE or process_group is None or not dist.is_initialized():
        return
    first = dist.get_global_rank(process_group, 0)
    if first != 0:
        raise UsageError(
            f"this process group starts at global rank {first}; torch.distributed.checkpoint before torch "
            f"{_text(SUBGROUPS_SINCE)} works only with groups that contain global rank 0 (it addresses the "
            f"group's coordinator as global rank 0); this torch is {torch.__version__}: upgrade torch, or "
            "use a group that includes global rank 0"
        )
    size, world = dist.get_world_size(process_group), dist.get_world_size()
    if loading and TORCH_VERSION < SMALLER_GROUP_LOAD_SINCE and size != world:
        raise UsageError(
            f"this process group has {size} of the {world} ranks; torch.distributed.checkpoint's load before "
            f"torch {_text(SMALLER_GROUP_LOAD_SINCE)} works only with a group of every rank; this torch is "
            f"{torch.__version__}: upgrade torch, load with a group of every rank, or load in one process "
            "with tensorcanon.dcp.load_unsharded"
        )


def _text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def async_kwargs(executor: Any) -> dict:
    """DCP's ``async_checkpointer_type`` argument for ``executor`` ("thread" or "process")."""
    if AsyncCheckpointerType is None:
        if executor == "thread":
            return {}  # the only executor this DCP has
        if executor == "process":
            raise UsageError(
                f"executor='process' needs torch >= {_text(PROCESS_EXECUTOR_SINCE)} (DCP's process executor, "
                f"AsyncCheckpointerType.PROCESS); this torch is {torch.__version__}: upgrade torch, or "
                "use executor='thread'"
            )
        raise UsageError(f"executor must be 'thread' or 'process', not {executor!r}")
    kinds = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    kind = kinds.get(executor) if isinstance(executor, str) else executor
    if not isinstance(kind, AsyncCheckpointerType):
        raise UsageError(f"executor must be 'thread' or 'process', not {executor!r}")
    return {"async_checkpointer_type": kind}


def upload_future(started: Any) -> Any:
    """The future that completes when the save is written: ``async_save`` returns it directly,
    or (newer DCP, with a stager) inside an ``AsyncSaveResponse``."""
    if AsyncSaveResponse is not None and isinstance(started, AsyncSaveResponse):
        return started.upload_completion
    return started


def global_save_plan(planner: DefaultSavePlanner, plans: list) -> tuple[list, Any]:
    """DCP's default global save planning (deduplication, metadata, validation), without its
    plan caching; returns (global plan, metadata)."""
    own = getattr(DefaultSavePlanner, "_create_global_plan", None)
    if own is not None:
        return own(planner, plans)
    return DefaultSavePlanner.create_global_plan(planner, plans)


def object_coll_device(group: Any = None) -> torch.device:
    """The device the process group's object collectives use (for meta-device targets)."""
    fn = getattr(dist.distributed_c10d, "_get_object_coll_device", None) or \
        dist.distributed_c10d._get_pg_default_device
    return torch.device(fn(group))


__all__ = [
    "DTensor", "Partial", "Replicate", "Shard", "distribute_tensor", "compute_local_shape_and_global_offset",
    "AsyncCheckpointerType", "AsyncSaveResponse", "DCP_STAGES_FAITHFULLY", "TORCH_VERSION",
    "PROCESS_EXECUTOR_SINCE", "SUBGROUPS_SINCE", "SMALLER_GROUP_LOAD_SINCE",
    "check_process_group", "dist_kwargs", "async_kwargs", "upload_future", "global_save_plan", "object_coll_device",
]
