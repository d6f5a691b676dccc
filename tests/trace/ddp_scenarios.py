"""Traced training under torch.distributed, for tests/trace/test_trace_ddp.py:
``python ddp_scenarios.py RUN RANK FOLDER INIT``.

One process is one rank (of 2, gloo on the CPU, the process group joined through the file INIT) of
one run (RUN, a name). It runs every job of ``JOBS`` in order, each writing the trace
``FOLDER/RUN.JOB.rank{RANK}.trace``: DDP at every level, DDP with rank 1 fed another batch at
step 1, hand-written collectives (asynchronous ones among them), and FSDP2 at every level where
torch runs it on the CPU (2.6 and later). Starting a process group costs seconds: one launch of
two runs of two ranks (four processes) makes every trace the tests compare.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import tensorcanon

from scenarios import VOCAB, Tiny, Tokens, seed, train_step

STEPS = 2
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
FSDP2 = TORCH >= (2, 6)
"""FSDP2 (fully_shard) creates CUDA streams before torch 2.6; gloo has reduce_scatter from 2.6 on."""


def _batch(data: torch.Tensor, k: int, rank: int, other: int | None) -> torch.Tensor:
    batch = data[16 * k:16 * k + 16][rank::2]
    if other is not None and rank == 1 and k == other:
        batch = (batch + 1) % VOCAB  # rank 1 alone is fed another batch at this step
    return batch


def ddp(out: str, rank: int, level: str, other: int | None = None, bucket_view: bool = False,
        static: bool = False) -> None:
    seed(0)
    model = nn.parallel.DistributedDataParallel(Tiny(2), gradient_as_bucket_view=bucket_view, static_graph=static)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Tokens().data
    with tensorcanon.trace(out, level=level, model=model, optimizer=opt, rank=rank, world_size=2) as tr:
        for k in range(STEPS):
            train_step(tr, model, opt, _batch(data, k, rank, other))


def collectives(out: str, rank: int) -> None:
    """A step that averages the gradients by hand, asynchronously (every work issued, then waited
    for), and gathers, scatters and broadcasts into buffers from ``torch.empty``: the rows gathered
    asynchronously are 2 MiB, so that gloo still writes them when the op returns. (gloo has
    all_gather_into_tensor and reduce_scatter_tensor on the CPU in torch 2.6, maybe earlier.)"""
    from torch.distributed import _functional_collectives as funcol  # (torch 2.4 to 2.13)

    seed(0)
    model = Tiny(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Tokens().data
    with tensorcanon.trace(out, level="ops", model=model, optimizer=opt, rank=rank, world_size=2) as tr:
        for k in range(STEPS):
            batch = _batch(data, k, rank, None)
            tr.step(batch)
            logits = model(batch[:, :-1])
            loss = tr.loss(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)))
            loss.backward()
            works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
            rows = [torch.empty(1 << 18) for _ in range(2)]
            gathered = dist.all_gather(rows, torch.full((1 << 18,), float(rank + k)), async_op=True)
            told = torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.empty(3)
            dist.broadcast(told, 0)
            summed = torch.arange(2048.0) + rank   # c10d.reduce_ returns its Work alone
            reduced = dist.reduce(summed, 0, async_op=True)
            reduced.wait()
            summed.sum()
            if FSDP2:
                flat = torch.empty(8)
                dist.all_gather_into_tensor(flat, torch.arange(4.0) + rank)
                scattered = torch.empty(2)
                dist.reduce_scatter_tensor(scattered, torch.arange(4.0) * (rank + 1))
            total = funcol.all_reduce(loss.detach() * 0 + rank, "sum", dist.group.WORLD)
            for w in works:
                w.wait()
            gathered.wait()
            for p in model.parameters():
                p.grad.div_(2 + 0 * total)
            opt.step()
            opt.zero_grad()


def fsdp(out: str, rank: int, level: str, other: int | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seed(0)
    model = Tiny(2)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Tokens().data
    with tensorcanon.trace(out, level=level, model=model, optimizer=opt, rank=rank, world_size=2) as tr:
        for k in range(STEPS):
            train_step(tr, model, opt, _batch(data, k, rank, other))


JOBS: list[tuple[str, object, dict]] = [
    ("ddp-ops", ddp, {"level": "ops"}),
    ("ddp-modules", ddp, {"level": "modules"}),
    ("ddp-steps", ddp, {"level": "steps"}),
    ("ddp-ops-other", ddp, {"level": "ops", "other": 1}),
    ("ddp-modules-other", ddp, {"level": "modules", "other": 1}),
    ("ddp-ops-view", ddp, {"level": "ops", "bucket_view": True}),
    ("ddp-ops-static", ddp, {"level": "ops", "static": True}),  # its reducer copy_s into a buffer from empty
    ("collectives", collectives, {}),
]
if FSDP2:
    JOBS += [
        ("fsdp-ops", fsdp, {"level": "ops"}),
        ("fsdp-modules", fsdp, {"level": "modules"}),
        ("fsdp-steps", fsdp, {"level": "steps"}),
        ("fsdp-ops-other", fsdp, {"level": "ops", "other": 1}),
    ]


def main(run: str, rank: int, folder: str, init: str) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("TENSORCANON_TEST_STACKS_AFTER", "280")), exit=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    for name, job, kwargs in JOBS:
        job(os.path.join(folder, f"{run}.{name}.trace"), rank, **kwargs)  # type: ignore[operator]
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no destroy_process_group: with gloo on torch 2.4 it can hang (tests/dcp/spawn.py)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
