"""Sharded checkpoint directories: the on-disk layout and everything that reads it.

A sharded checkpoint (written by :mod:`tensorcanon.dcp`) is a directory of
ordinary tensorcanon files, one per rank, plus an index written last. This
package reads such directories in one process, with no process group and
without importing torch.distributed: validate and verify them, load them whole,
consolidate them into one file. docs/FORMAT.md §14 is the normative layout;
docs/DISTRIBUTED.md the user guide.
"""

from .errors import CheckpointError, CheckpointNotFoundError, ReplicaMismatchError
from .layout import INDEX_NAME, Index, is_checkpoint
from .read import consolidate, load_unsharded, logical_digest, verify

__all__ = [
    "verify", "consolidate", "load_unsharded", "logical_digest", "is_checkpoint", "Index", "INDEX_NAME",
    "CheckpointNotFoundError", "ReplicaMismatchError", "CheckpointError",
]
