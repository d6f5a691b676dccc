"""Red-team scenarios for traces under torch.distributed, for
tests/attacks/test_redteam_distributed_trace.py: ``python redddp_scenarios.py RUN RANK FOLDER INIT``.

One process is one rank (of 2, gloo on the CPU) of one run. It runs every job of ``JOBS``, each
writing ``FOLDER/RUN.JOB.rank{RANK}.trace``; run "b" feeds rank 1 another batch in the jobs whose
name ends in "-other" (run "a" never does). Patterns docs/TRACE.md does not show: an all-reduce
waited late, all_gather_into_tensor, reduce_scatter_tensor, broadcast and barrier by hand, in-place
ops on views of a flat bucket, out= ops into a bucket's views, DDP with no_sync() accumulation and
DDP with a frozen layer. The last jobs (ENV_JOBS) give trace() a rank or world size inconsistent with
the process group ($RANK 0 on both ranks, rank=0 on both...) and record what it does.
"""

from __future__ import annotations

import faulthandler
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import tensorcanon

STEPS = 2


def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _model() -> nn.Module:
    _seed()
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(k: int, rank: int, other: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + 10 * k + rank)
    x = torch.randn(4, 8, generator=g)
    if other and rank == 1 and k == 1:
        x = x + 1.0  # rank 1 alone is fed another batch at step 1
    return x


def by_hand(out: str, rank: int, other: bool = False) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    with tensorcanon.trace(out, level="ops", model=model, optimizer=opt, rank=rank, world_size=2) as tr:
        for k in range(STEPS):
            tr.step(_batch(k, rank, other))
            loss = tr.loss(model(_batch(k, rank, other)).square().mean())
            loss.backward()
            # a flat bucket from empty, written through views by out= ops and in-place ops
            bucket = torch.empty(sum(sizes))
            views = bucket.split(sizes)
            for v, p in zip(views, params, strict=True):
                torch.mul(p.grad.reshape(-1), 1.0, out=v)
            views[0].mul_(1.0)
            work = dist.all_reduce(bucket, async_op=True)
            # unrelated work between issue and wait (the wait comes late)
            side = torch.arange(64.0).reshape(8, 8) @ torch.ones(8, 8)
            side.sum()
            gathered = torch.empty(2 * 32)
            g_work = dist.all_gather_into_tensor(gathered, torch.arange(32.0) * (rank + 1), async_op=True)
            part = torch.empty(16)
            s_work = dist.reduce_scatter_tensor(part, torch.arange(32.0) + rank, async_op=True)
            told = torch.arange(5.0) if rank == 0 else torch.empty(5)
            dist.broadcast(told, 0)
            dist.barrier()
            work.wait()
            for v in views:
                v.div_(2)              # in place on the bucket's views, after the wait
            for v, p in zip(views, params, strict=True):
                p.grad.copy_(v.view_as(p.grad))
            g_work.wait()
            s_work.wait()
            (gathered.sum() + part.sum() + told.sum()).item()
            opt.step()
            opt.zero_grad()


def ddp_no_sync(out: str, rank: int, level: str, other: bool = False) -> None:
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensorcanon.trace(out, level=level, model=model, optimizer=opt, rank=rank, world_size=2) as tr:
        for k in range(STEPS):
            batch = _batch(k, rank, other)
            tr.step(batch)
            with model.no_sync():               # accumulate locally, no all-reduce
                model(batch[:2]).square().mean().backward()
            tr.loss(model(batch[2:]).square().mean()).backward()   # this one all-reduces
            opt.step()
            opt.zero_grad()


def ddp_frozen(out: str, rank: int, level: str, other: bool = False) -> None:
    inner = _model()
    inner[0].weight.requires_grad_(False)        # a frozen layer (its bias still trains)
    model = nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with tensorcanon.trace(out, level=level, model=model, optimizer=opt, rank=rank, world_size=2) as tr:
        for k in range(STEPS):
            batch = _batch(k, rank, other)
            tr.step(batch)
            tr.loss(model(batch).square().mean()).backward()
            opt.step()
            opt.zero_grad()


def env_rank(out: str, me: int, env: dict, **kwargs) -> None:
    """trace() with ``env`` as $RANK/$WORLD_SIZE and ``kwargs``, under a process group of 2 where
    this process is ``me``. Writes what trace() did to ``out.rank{me}.result``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    os.environ.update(env)
    try:
        with tensorcanon.trace(out + ".trace", level="steps", model=model, optimizer=opt, **kwargs) as tr:
            tr.step(_batch(0, me, False))
            tr.loss(model(_batch(0, me, False)).sum()).backward()
            opt.step()
        result = "ok"
    except tensorcanon.TensorCanonError as e:
        result = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - what escaped is the finding
        result = f"FOREIGN {type(e).__name__}: {e}"
    finally:
        for v in env:
            del os.environ[v]
    with open(f"{out}.rank{me}.result", "w") as f:
        f.write(result)


JOBS: list = [
    ("hand", by_hand, {}),
    ("hand-other", by_hand, {"other": True}),
]
for _level in ("steps", "modules", "ops"):
    JOBS += [
        (f"nosync-{_level}", ddp_no_sync, {"level": _level}),
        (f"nosync-{_level}-other", ddp_no_sync, {"level": _level, "other": True}),
        (f"frozen-{_level}", ddp_frozen, {"level": _level}),
    ]
JOBS.append(("frozen-ops-other", ddp_frozen, {"level": "ops", "other": True}))
ENV_JOBS: list = [
    ("env-rank0", {"RANK": "0", "WORLD_SIZE": "2"}, {}),   # $RANK 0 on both ranks
    ("env-world1", {"RANK": "0", "WORLD_SIZE": "1"}, {}),  # a world of 1 under a group of 2
    ("env-none", {}, {}),                                  # nothing said: the process group's
    ("arg-rank0", {}, {"rank": 0, "world_size": 2}),       # rank=0 passed on both ranks
]


def main(run: str, rank: int, folder: str, init: str) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("TENSORCANON_TEST_STACKS_AFTER", "280")), exit=False)
    torch.set_num_threads(1)
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(v, None)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    for name, job, given in JOBS:
        kwargs = dict(given)
        other = kwargs.pop("other", False) and run == "b"
        if job is by_hand or other:
            kwargs["other"] = other
        job(os.path.join(folder, f"{run}.{name}.trace"), rank, **kwargs)
        dist.barrier()
    for name, env, kwargs in ENV_JOBS:
        env_rank(os.path.join(folder, f"{run}.{name}"), rank, env, **kwargs)
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no destroy_process_group: with gloo it can hang at exit (tests/dcp/spawn.py)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
