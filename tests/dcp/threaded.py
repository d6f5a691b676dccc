"""The fast tier's process group: every rank is a thread of this process.

torch's threaded in-process process group
(``torch.testing._internal.distributed.multi_threaded_pg``) is a private torch
API: if a torch release moves it, the tests fail here (they never skip).
DCP, DTensor and FSDP2 run on it unchanged; a 4-rank save takes a few
hundredths of a second. The real tier (test_spawned.py) uses gloo processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

_lock = threading.Lock()  # one threaded world at a time


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 120.0) -> list:
    """Run ``fn(rank)`` as ``world`` ranks of a threaded process group; return each rank's result.

    An exception escaping ``fn`` on any rank wakes the other ranks (they leave their
    collectives) and is re-raised here, naming the rank. A rank still running after
    ``timeout`` seconds fails the test (a hang is a failure, never a stuck run).
    """
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg
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
