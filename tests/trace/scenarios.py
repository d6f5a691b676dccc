"""Training scenarios the trace tests run in fresh processes: ``python scenarios.py NAME OUT [ARGS]``.

Each writes its trace to OUT. A small transformer (2-4 layers, d=16) on a seeded synthetic
dataset, trained with AdamW; the scenarios change one thing each.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np
import torch
from torch import nn

import tensorcanon

D, LAYERS, VOCAB, SEQ = 16, 4, 32, 8


class Noise(nn.Module):
    """Adds noise from its own generator, at one step only, when ``unseeded``: a nondeterministic module."""

    def __init__(self) -> None:
        super().__init__()
        self.gen: torch.Generator | None = None
        self.active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.active and self.gen is not None:
            return x + 1e-3 * torch.rand(x.shape, generator=self.gen)
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.noise = Noise()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return self.noise(x + self.ff(self.ln2(x)))


class Tiny(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


class Tokens(torch.utils.data.Dataset):
    """Seeded token sequences; ``augment`` shifts each by a draw from numpy's global generator;
    ``jitter`` delays each item by up to 4 ms drawn from the OS (not seeded), so that DataLoader
    workers answer in another order in every run while the data stays the same."""

    def __init__(self, n: int = 64, augment: bool = False, jitter: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.augment = augment
        self.jitter = jitter

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.data[i]
        if self.jitter:
            time.sleep(os.urandom(1)[0] / 255 * 0.004)
        if self.augment:
            x = (x + int(np.random.randint(0, VOCAB))) % VOCAB
        return x


def seed(n: int = 0) -> None:
    """What a fresh process does first (tensorcanon.seed_everything without its determinism switch,
    whose import of torch's compiler costs seconds)."""
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def setup(workers: int = 0, augment: bool = False, layers: int = LAYERS, jitter: bool = False):
    seed(0)
    model = Tiny(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Tokens(augment=augment, jitter=jitter), batch_size=8, shuffle=True,
                                         num_workers=workers, generator=torch.Generator().manual_seed(0),
                                         worker_init_fn=tensorcanon.seed_worker if workers else None)
    return model, opt, loader


def train_step(tr, model, opt, batch) -> torch.Tensor:
    tr.step(batch)
    logits = model(batch[:, :-1])
    loss = tr.loss(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def run(out: str, level: str, steps: int, workers: int = 0, noisy_step: int | None = None,
        capture: str | None = None, jitter: bool = False) -> None:
    """Train ``steps`` steps; the noise module of layer 3 draws from an unseeded generator at ``noisy_step``."""
    model, opt, loader = setup(workers=workers, jitter=jitter)
    noise = model.layers[3].noise
    noise.gen = torch.Generator()
    noise.gen.seed()  # unseeded: another seed in every process
    with tensorcanon.trace(out, level=level, model=model, optimizer=opt, capture=capture) as tr:
        step = 0
        for batch in loader:
            if step == steps:
                break
            noise.active = step == noisy_step
            train_step(tr, model, opt, batch)
            step += 1


class Reduce(nn.Module):
    """A matmul (the same bits on 1 or 2 threads) and the float32 sum of 4 million elements (not)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(2)))

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return (m @ self.w).sum() + x.sum()


def reduce(out: str, capture: str | None = None) -> None:
    seed(0)
    g = torch.Generator().manual_seed(3)
    x, m = torch.randn(4_000_000, generator=g), torch.randn(64, 64, generator=g)
    model = Reduce()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensorcanon.trace(out, level="ops", model=model, optimizer=opt, capture=capture) as tr:
        tr.step({"x": x, "m": m})
        tr.loss(model(x, m)).backward()
        opt.step()


# --------------------------------------------------------------------------- resume


def _batch(ds: Tokens, perm: torch.Tensor, k: int) -> torch.Tensor:
    return torch.stack([ds[int(i)] for i in perm[8 * k:8 * k + 8]])


def resume_first(uninterrupted: str, prefix: str, ckpt: str, steps: int, kill_at: int) -> None:
    """An uninterrupted run of ``steps`` steps; then a run that saves a checkpoint after ``kill_at``
    steps and dies (its trace left without an end frame)."""
    for out, last in ((uninterrupted, steps), (prefix, kill_at)):
        model, opt, _ = setup()
        ds = Tokens(augment=True)
        perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(5))
        try:
            with tensorcanon.trace(out, level="steps", model=model, optimizer=opt) as tr:
                for k in range(last):
                    train_step(tr, model, opt, _batch(ds, perm, k))
                if out == prefix:
                    tensorcanon.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                      "numpy": list(np.random.get_state())}, ckpt)
                    raise KeyboardInterrupt  # killed: the trace keeps what it wrote, with no end frame
        except KeyboardInterrupt:
            pass


def resume(prefix: str, ckpt: str, steps: int, kill_at: int, numpy: bool, optimizer: bool) -> None:
    """A fresh start that resumes from the checkpoint at ``kill_at``, restoring numpy's random state
    and the optimizer state only if told."""
    model, opt, _ = setup()
    state = tensorcanon.load(ckpt)
    model.load_state_dict(state["model"])
    if optimizer:
        opt.load_state_dict(state["opt"])
    if numpy:
        np.random.set_state(tuple(state["numpy"]))
    ds = Tokens(augment=True)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(5))
    with tensorcanon.trace(prefix, level="steps", model=model, optimizer=opt, resume_at=kill_at) as tr:
        for k in range(kill_at, steps):
            train_step(tr, model, opt, _batch(ds, perm, k))


# --------------------------------------------------------------------------- DDP


def ddp(out: str, rank: int, init: str, steps: int) -> None:
    """Two ranks (gloo), each tracing its own file; each rank trains on its own half of the batch."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        seed(0)
        model = nn.parallel.DistributedDataParallel(Tiny(2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = Tokens().data
        with tensorcanon.trace(out, level="modules", model=model, optimizer=opt, rank=rank, world_size=2) as tr:
            for k in range(steps):
                batch = data[16 * k:16 * k + 16][rank::2]
                train_step(tr, model, opt, batch)
        dist.barrier()
    finally:  # no destroy_process_group: with gloo on torch 2.4 it can hang (tests/dcp/spawn.py)
        pass


JOBS = {"run": run, "reduce": reduce, "resume_first": resume_first, "resume": resume, "ddp": ddp}


def main(jobs: list[dict]) -> None:
    for job in jobs:
        job = dict(job)
        torch.set_num_threads(job.pop("threads", 1))
        JOBS[job.pop("job")](**job)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a gloo process group is never torn down (see ddp)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
