"""save, load, async_save: DCP's own functions with tensorcanon's storage and planners.

DCP reports a failure on any rank to every rank as a ``CheckpointException`` (a
``BaseException``, so ``except Exception`` misses it), holding each failing
rank's exception. These functions turn it back into the library's own error:
the first failing rank's tensorcanon error (or OSError) itself, else a
:class:`CheckpointError` carrying DCP's message. Every rank gets the same
failures, so every rank raises the same error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..format import digest as _digest
from ..format.errors import TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..sharded.errors import CheckpointError
from . import _compat
from .load_planner import LoadPlanner
from .reader import Reader
from .save_planner import SavePlanner
from .store import StoreTag
from .writer import LOGICAL_DIGEST, Writer

_T = TypeVar("_T")


def _distributed(process_group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized()


def unwrap(exc: BaseException) -> BaseException:
    """The library's error for a DCP failure (see the module docstring)."""
    if not isinstance(exc, CheckpointException):
        if isinstance(exc, (TensorCanonError, OSError)):
            return exc
        return CheckpointError(f"torch.distributed.checkpoint failed: {type(exc).__name__}: {exc}")
    failures = sorted(exc.failures.items())
    primary = [(r, e) for r, (e, _) in failures if not getattr(e, "secondary", False)] or \
              [(r, e) for r, (e, _) in failures]
    rank, first = primary[0]
    if isinstance(first, CheckpointException):
        return unwrap(first)
    if isinstance(first, (TensorCanonError, OSError)):
        return first
    return CheckpointError(
        f"torch.distributed.checkpoint failed on rank {rank}: {type(first).__name__}: {first}"
    )


def _run(fn: Callable[[], _T], saving: dict | None = None, limits: Limits = DEFAULT) -> _T:
    try:
        return fn()
    except CheckpointException as ce:
        raise unwrap(ce) from ce
    except (TensorCanonError, OSError):
        raise
    except Exception as e:  # DCP's own steps outside its collectives (arguments, backends, staging)
        ours = _refusal(saving, limits) if saving is not None else None
        raise (ours or unwrap(e)) from e


def _refusal(state_dict: dict, limits: Limits) -> TensorCanonError | None:
    """The library's own refusal of a state that DCP failed on before planning, or None.

    DCP's Stateful check (save) and its staging (async_save) touch values before our planner
    sees them; a ShardedTensor, or an object that raises when touched, fails there in torch's
    words, without a path. Planning the state here names the path instead.
    """
    from torch.distributed.checkpoint.stateful import Stateful

    from .logical import plan_state

    plain = {}
    for k, v in state_dict.items():
        try:
            plain[k] = v.state_dict() if isinstance(v, Stateful) else v
        except Exception:  # noqa: BLE001 - planning names it
            plain[k] = v
    try:
        plan_state(plain, limits)
    except TensorCanonError as e:
        return e
    except Exception:  # noqa: BLE001 - no better words than DCP's
        return None
    return None


@contextlib.contextmanager
def _quiet(single_process: bool) -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (that is the caller's intent)."""
    with warnings.catch_warnings():
        if single_process:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            warnings.filterwarnings("ignore", message="torch.distributed is unavailable")
        yield


def save(state_dict: dict, checkpoint_dir: str | os.PathLike | StoreTag, *,
         process_group: dist.ProcessGroup | None = None,
         algorithm: str = _digest.DEFAULT, overwrite: bool = True, limits: Limits = DEFAULT,
         storage_options: dict | None = None) -> str:
    """Save a (sharded) state dict as a canonical checkpoint directory; return its logical digest.

    Collective: every rank of ``process_group`` calls it with its own state dict
    (DTensors, FSDP2 state dicts, plain tensors, non-tensor values,
    :class:`PerRank` values). Without an initialized process group it saves in
    one process. The returned logical digest is the same string on every rank,
    for every world size and sharding of the same state, and equals
    ``tensorcanon.fingerprint`` of the state held unsharded (per-rank values
    excluded). Same world size and same state give byte-identical files.
    With ``overwrite=False``, a directory that already holds a checkpoint is refused
    (:class:`CheckpointExistsError`, on every rank, before any rank writes).
    ``checkpoint_dir`` may be a directory URL of object storage (``s3://bucket/run/step100``),
    reached with ``storage_options`` (docs/STORAGE.md); so may :func:`load`'s and :func:`async_save`'s.
    It may also be a :class:`StoreTag` (a tag of a ``tensorcanon.Store``): each rank's tensors are then
    stored as the store's blobs, each distinct one once (across ranks and steps), and the checkpoint
    as one tag, written last (docs/DISTRIBUTED.md, "In a store").

    Example::

        model_sd, optim_sd = get_state_dict(model, optim)
        digest = tensorcanon.dcp.save({"model": model_sd, "optim": optim_sd, "step": 100},
                                      "ckpt/step100")
    """
    single = not _distributed(process_group)
    writer = Writer(checkpoint_dir, process_group=process_group, algorithm=algorithm, overwrite=overwrite,
                    limits=limits, storage_options=storage_options)
    with _quiet(single):
        md = _run(lambda: dcp.save(state_dict, storage_writer=writer, planner=SavePlanner(limits=limits),
                                   process_group=process_group, **_compat.dist_kwargs(dcp.save, single)),
                  state_dict, limits)
    return md.storage_data[LOGICAL_DIGEST]


def async_save(state_dict: dict, checkpoint_dir: str | os.PathLike | StoreTag, *,
               process_group: dist.ProcessGroup | None = None, executor: str = "thread",
               algorithm: str = _digest.DEFAULT, overwrite: bool = True,
               limits: Limits = DEFAULT, storage_options: dict | None = None) -> concurrent.futures.Future:
    """:func:`save` in the background (``dcp.async_save``); the future's result is the logical digest.

    The state is first copied to CPU memory (DCP's staging), so tensors may be
    changed as soon as this returns. ``executor`` is ``"thread"`` or
    ``"process"`` (a background process with its own gloo group; DCP starts it on
    first use, with multiprocessing's spawn method, so the calling script must keep
    its code under ``if __name__ == "__main__":``; a call from an unguarded
    top-level statement is refused, as it would hang). A failure, ``overwrite=False``
    included, is raised by ``future.result()`` as the library's own error.

    Example::

        fut = tensorcanon.dcp.async_save(state, "ckpt/step100")
        ...  # train on
        digest = fut.result()
    """
    kind = _compat.async_kwargs(executor)
    if isinstance(checkpoint_dir, StoreTag) and executor == "process":
        raise UsageError("async_save(executor='process') cannot save into a store (the StoreTag's Store stays in "
                         "this process): use executor='thread'")
    if _compat.AsyncCheckpointerType is not None and \
            kind.get("async_checkpointer_type") is _compat.AsyncCheckpointerType.PROCESS:
        _compat.check_spawn_safe_main()
    single = not _distributed(process_group)
    writer = Writer(checkpoint_dir, process_group=process_group, algorithm=algorithm, overwrite=overwrite,
                    limits=limits, storage_options=storage_options)
    with _quiet(single):
        started = _run(lambda: dcp.async_save(
            state_dict, storage_writer=writer, planner=SavePlanner(limits=limits), process_group=process_group,
            **kind, **_compat.dist_kwargs(dcp.async_save, single),
        ), state_dict, limits)
    upload = _compat.upload_future(started)
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            md = f.result()
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException; handed on
            out.set_exception(unwrap(e))
        else:
            out.set_result(md.storage_data[LOGICAL_DIGEST])

    upload.add_done_callback(done)
    return out


def load(state_dict: dict, checkpoint_dir: str | os.PathLike | StoreTag, *,
         process_group: dist.ProcessGroup | None = None, keep_per_rank_on_resize: bool = False,
         allow_partial_load: bool = False, limits: Limits = DEFAULT, storage_options: dict | None = None) -> None:
    """Load a checkpoint into ``state_dict`` in place, verifying every chunk it reads.

    Collective, like ``dcp.load``: each rank passes its state dict, whose tensors
    (DTensors included) are filled in place and may be sharded differently, over
    another world size, than at save time. Non-tensor values are replaced by the
    saved ones, decoded by tensorcanon (no pickle). :class:`PerRank` entries get
    this rank's own value; with another world size that is an error naming the
    key, unless ``keep_per_rank_on_resize=True``. The state dict may hold a part of
    the checkpoint (only the model, say); a key of it that the checkpoint lacks is
    an error naming it, unless ``allow_partial_load=True`` (it then keeps its value).

    Example::

        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        tensorcanon.dcp.load(state, "ckpt/step100")
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    """
    single = not _distributed(process_group)
    reader = Reader(checkpoint_dir, limits=limits, storage_options=storage_options)
    planner = LoadPlanner(process_group=process_group, keep_per_rank_on_resize=keep_per_rank_on_resize,
                          allow_partial_load=allow_partial_load, limits=limits)
    with _quiet(single):
        _run(lambda: dcp.load(state_dict, storage_reader=reader, planner=planner,
                              process_group=process_group, **_compat.dist_kwargs(dcp.load, single)))


__all__ = ["save", "async_save", "load", "unwrap"]
