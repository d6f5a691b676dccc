"""Sharded checkpoints on torch.distributed.checkpoint: canonical, pickle-free, verified.

``tensorcanon.dcp`` plugs into DCP (``dcp.save``, ``dcp.load``,
``dcp.async_save``) as a StorageWriter/StorageReader and planner subclasses, so
resharding, planning and async staging stay DCP's. A checkpoint is a directory
of ordinary tensorcanon files, one per rank, plus an index written last
(docs/FORMAT.md §14). Its *logical digest* is the same for every world size
and sharding, and equals ``tensorcanon.fingerprint`` of the same state held
unsharded in one process. docs/DISTRIBUTED.md is the guide.

Example::

    import tensorcanon.dcp as tcd
    model_sd, optim_sd = get_state_dict(model, optim)          # FSDP2: DTensors
    digest = tcd.save({"model": model_sd, "optim": optim_sd, "step": step}, "ckpt/step100")
    tcd.load(state, "ckpt/step100")                             # any world size
    full = tcd.load_unsharded("ckpt/step100")                   # one process, no group
    tcd.consolidate("ckpt/step100", "step100.safetensors")      # == tensorcanon.dumps(full)
"""

from ..sharded import CheckpointError, CheckpointNotFoundError, ReplicaMismatchError
from .api import async_save, load, save
from .load_planner import LoadPlanner
from .perrank import PerRank
from .reader import Reader
from .save_planner import SavePlanner
from .store import StoreTag, consolidate, export, load_unsharded, logical_digest, verify
from .writer import CheckpointExistsError, Writer

__all__ = [
    "save", "load", "async_save", "load_unsharded", "consolidate", "verify", "logical_digest",
    "StoreTag", "export",
    "PerRank", "Writer", "Reader", "SavePlanner", "LoadPlanner",
    "CheckpointNotFoundError", "ReplicaMismatchError", "CheckpointError", "CheckpointExistsError",
]
