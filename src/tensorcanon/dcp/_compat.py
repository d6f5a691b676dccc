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
  lossily (staging.py), so the Writer stages it itself;
- ``state_dict_loader._load_state_dict_from_keys`` (a private DCP helper) may be
  missing from a release: :data:`load_state_dict_from_keys` is None then.

Also here, since they follow DCP's internals rather than a public API:
:func:`give_value` (what ``DefaultLoadPlanner.load_bytes`` does with a value,
the same from torch 2.4 to 2.13) and :func:`refuse_storage_options` (the options of
DCP's ``FileSystemWriter``/``FileSystemReader`` that tensorcanon's have no use for).

Example::

    from ._compat import DTensor, Shard, Replicate
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader as _loader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ..format.errors import UsageError

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

# DCP's helper that loads chosen keys of a checkpoint into a new state dict, in one process.
load_state_dict_from_keys = getattr(_loader, "_load_state_dict_from_keys", None)

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


def check_spawn_safe_main() -> None:
    """Refuse the process executor where its child would run the caller's script again.

    DCP starts the background process of ``AsyncCheckpointerType.PROCESS`` with
    multiprocessing's "spawn" method, which imports the main script in the new process
    (as ``__mp_main__``) before anything else: every top-level statement not under
    ``if __name__ == "__main__":`` runs again there. A script that calls ``async_save``
    from such a statement starts its training again in the child (``init_process_group``
    included), and the save waits for the child forever (DCP waits up to 30 minutes).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(getattr(main, "__spec__", None), "name", None)
    if main is None or not path or (spec is not None and (spec == "__main__" or spec.endswith(".__main__"))):
        return  # nothing for spawn to run again (python -c, a REPL, python -m pkg)
    frame: Any = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return  # not called from the main script's top level (a thread, a callback)
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    for stmt in tree.body:
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            if isinstance(stmt, ast.If) and _is_main_test(stmt.test) and stmt.body \
                    and stmt.body[0].lineno <= line <= (stmt.body[-1].end_lineno or line):
                return
            raise UsageError(
                f"executor='process' cannot run from {path}, line {line}: that statement is not under "
                "'if __name__ == \"__main__\":', and DCP starts the background process with multiprocessing's "
                "spawn method, which runs every such statement of the main script again in the new process "
                "(its training and init_process_group too), so the save would wait forever. Put the script's "
                "code in a function called under 'if __name__ == \"__main__\":', or use executor='thread'"
            )


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and texts == ["__main__"]


def give_value(planner: Any, read_item: Any, value: Any) -> None:
    """Put a decoded value where ``DefaultLoadPlanner.load_bytes`` puts the value it unpickles
    (torch 2.4 to 2.13: through its flattening map, else under the flat name), without pickle."""
    fqn = read_item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


# The options of DCP's FileSystemWriter / FileSystemReader, and why tensorcanon's have none.
_STORAGE_OPTIONS = {
    "single_file_per_rank": "each rank always writes exactly one file",
    "sync_files": "every file is always fsynced before the index commits it",
    "thread_count": "each rank writes its one file in one pass, from one thread",
    "per_thread_copy_ahead": "each rank writes its one file in one pass, from one thread",
    "cache_staged_state_dict": "async_save stages with DCP's own stager",
    "serialization_format": "the format is tensorcanon's (docs/FORMAT.md §14)",
    "_extensions": "stream transforms (compression) would change the canonical bytes and the digests",
    "_extension_registry": "tensorcanon checkpoints use no stream transforms",
}


def refuse_storage_options(kind: str, options: dict) -> None:
    """Refuse, naming it, an option of DCP's FileSystemWriter/Reader given to tensorcanon's."""
    for name in options:
        why = _STORAGE_OPTIONS.get(name)
        if why is None:
            raise UsageError(f"tensorcanon.dcp.{kind} got an unexpected option {name}=")
        raise UsageError(f"tensorcanon.dcp.{kind} has no {name}= option (DCP's FileSystem{kind} has): {why}; "
                         "remove it (docs/DISTRIBUTED.md, 'DCP's options and features')")


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
    "check_spawn_safe_main", "give_value", "refuse_storage_options", "load_state_dict_from_keys",
]
