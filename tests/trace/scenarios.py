"""Training scenarios the trace tests run in fresh processes: ``python scenarios.py NAME OUT [ARGS]``.

Each writes its trace to OUT. A small transformer (2-4 layers, d=16) on a seeded synthetic
dataset, trained with AdamW; the scenarios change one thing each.
"""

from __future__ import annotations

import json
import os
import sys

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
    """Seeded token sequences; ``augment`` shifts each by a draw from numpy's global generator."""

    def __init__(self, n: int = 64, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.data[i]
        if self.augment:
            x = (x + int(np.random.randint(0, VOCAB))) % VOCAB
        return x


def setup(seed: int = 0, workers: int = 0, augment: bool = False, layers: int = LAYERS):
    tensorcanon.seed_everything(seed)
    model = Tiny(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Tokens(augment=augment), batch_size=8, shuffle=True,
                                         num_workers=workers, generator=torch.Generator().manual_seed(seed),
                                         worker_init_fn=tensorcanon.seed_worker if workers else None,
                                         persistent_workers=False)
    return model, opt, loader


def train_step(tr, model, opt, batch) -> torch.Tensor:
    tr.step(batch)
    logits = model(batch[:, :-1])
    loss = tr.loss(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def run(out: str, level: str, steps: int, *, workers: int = 0, noisy_step: int | None = None,
        augment: bool = False) -> None:
    model, opt, loader = setup(workers=workers, augment=augment)
    noise = model.layers[3].noise
    noise.gen = torch.Generator()
    noise.gen.seed()  # unseeded: another seed in every process
    with tensorcanon.trace(out, level=level, model=model, optimizer=opt) as tr:
        step = 0
        while step < steps:
            for batch in loader:
                if step == steps:
                    break
                noise.active = step == noisy_step
                train_step(tr, model, opt, batch)
                step += 1


def main(argv: list[str]) -> None:
    name, out = argv[0], argv[1]
    opts = json.loads(argv[2]) if len(argv) > 2 else {}
    if name == "run":
        run(out, **opts)
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("SCENARIO_THREADS", "1")))
    main(sys.argv[1:])
