"""Harness for the sharded checkpoint tests.

Fast tier: every rank of a process group is a thread of this process, through
torch's threaded in-process process group
(``torch.testing._internal.distributed.multi_threaded_pg``). It is a private
torch API, so the tier is skipped (importorskip) if it moves. DCP, DTensor and
FSDP2 run on it unchanged; a 4-rank save takes a few hundredths of a second.

Real tier (test_spawned.py): separate processes on gloo, see spawn.py.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Callable

import pytest
import torch

mtpg = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tensorcanon.dcp import PerRank  # noqa: E402

_lock = threading.Lock()  # one threaded world at a time


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 120.0) -> list:
    """Run ``fn(rank)`` as ``world`` ranks of a threaded process group; return each rank's result.

    An exception escaping ``fn`` on any rank wakes the other ranks (they leave their
    collectives) and is re-raised here, naming the rank. A rank still running after
    ``timeout`` seconds fails the test (a hang is a failure, never a stuck run).
    """
    with _lock:
        world_obj = mtpg._install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        store = dist.HashStore()
        results: list = [None] * world
        errors: list = [None] * world

        def worker(rank: int) -> None:
            dist.init_process_group(backend="threaded", rank=rank, world_size=world, store=store)
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[rank] = e
                mtpg.ProcessLocalGroup.exception_handle(e)
            finally:
                if dist.distributed_c10d._world is world_obj:
                    dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            mtpg._uninstall_threaded_pg()
            mtpg.ProcessLocalGroup.reset()
        if hung:
            pytest.fail(f"ranks {hung} of {world} did not finish within {timeout} s (a hang)")
        for rank, e in enumerate(errors):
            if e is not None and not isinstance(e, SystemExit):
                raise AssertionError(f"rank {rank} of {world} raised {type(e).__name__}: {e}") from e
        for rank, e in enumerate(errors):
            if e is not None:
                raise AssertionError(f"rank {rank} of {world} was stopped: {e}")
        return results


def unsharded(state: Any, memo: dict | None = None) -> Any:
    """The test oracle for the logical state: every DTensor replaced by its full tensor (tied
    DTensors, which share their local storage, by one full tensor), PerRank keys removed."""
    memo = {} if memo is None else memo
    if isinstance(state, DTensor):
        local = state._local_tensor
        key = (local.untyped_storage()._cdata, local.storage_offset(), tuple(local.shape), tuple(state.shape))
        if key not in memo or not state.numel():
            full = state.full_tensor()
            memo[key] = torch.nn.Parameter(full, requires_grad=state.requires_grad) \
                if isinstance(state, torch.nn.Parameter) else full
        return memo[key]
    if type(state) in (dict, collections.OrderedDict):
        out = type(state)((k, unsharded(v, memo)) for k, v in state.items() if type(v) is not PerRank)
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata
        return out
    if type(state) in (list, tuple):
        return type(state)(unsharded(v, memo) for v in state)
    return state


def zeros_like_state(state: Any, memo: dict | None = None) -> Any:
    """A state of the same structure with every tensor zeroed (a DTensor keeps its placements;
    one object at two paths stays one object) and every non-tensor value replaced by None:
    what a fresh run would load into."""
    memo = {} if memo is None else memo
    if isinstance(state, torch.Tensor):
        if id(state) not in memo:
            if isinstance(state, DTensor):
                memo[id(state)] = DTensor.from_local(torch.zeros_like(state.to_local()), state.device_mesh,
                                                     state.placements, shape=state.shape, stride=state.stride())
            else:
                memo[id(state)] = torch.zeros_like(state.detach())
        return memo[id(state)]
    if type(state) is PerRank:
        return PerRank(None)
    if type(state) in (dict, collections.OrderedDict):
        out = type(state)((k, zeros_like_state(v, memo)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = None
        return out
    if type(state) is list:
        return [zeros_like_state(v, memo) for v in state]
    if type(state) is tuple:
        return tuple(zeros_like_state(v, memo) for v in state)
    return None


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh checkpoint directory path (not created: saving creates it)."""
    return str(tmp_path / "ckpt")


def rank_files(folder: str) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def pytest_configure(config):
    import logging

    # DCP logs every step (and every expected failure, with tracebacks) on its own logger
    logging.getLogger("dcp_logger").setLevel(logging.CRITICAL)
    logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.CRITICAL)
