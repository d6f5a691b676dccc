"""Errors of sharded checkpoints, in addition to the library's own (tensorcanon.format.errors).

They derive from :class:`tensorcanon.TensorCanonError` and from the matching
built-in, like every tensorcanon error.
"""

from __future__ import annotations

from ..format.errors import MissingFileError, TensorCanonError

__all__ = ["CheckpointNotFoundError", "ReplicaMismatchError", "CheckpointError"]


class CheckpointNotFoundError(MissingFileError):
    """A checkpoint directory, its index or one of its rank files does not exist.

    A directory without an index is not a checkpoint: the index is written
    last, so its absence usually means a save was interrupted. Also a
    ``FileNotFoundError`` (through :class:`tensorcanon.MissingFileError`).
    """


class ReplicaMismatchError(TensorCanonError, ValueError):
    """A value saved once for all ranks (a replicated tensor, a step counter, a
    config) differs between ranks. ``path`` is where it sits in the state."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class CheckpointError(TensorCanonError, RuntimeError):
    """torch.distributed.checkpoint failed for a reason that is not a tensorcanon
    error (a planning or validation error of DCP itself); the message is DCP's."""

    secondary: bool = False  # True on a rank that fails because another rank did (that one names the cause)
