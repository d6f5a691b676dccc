"""A small model trained with FSDP2 (fully_shard) and AdamW, used by both test tiers."""

from __future__ import annotations

import torch
from torch import nn


class TiedMLP(nn.Module):
    """Shapes chosen so that 4 ranks shard unevenly and one rank holds an empty shard
    (``out.bias`` has 3 rows), with an embedding tied to the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 7)
        self.out = nn.Linear(7, 6)
        self.proj = nn.Linear(6, 10, bias=False)
        self.proj.weight = self.embed.weight  # tied
        self.head_bias = nn.Parameter(torch.zeros(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(self.embed(idx)))
        return self.proj(self.out(h)) + self.head_bias.sum()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)


def build(world: int | None, steps: int = 1):
    """(model, optimizer) after ``steps`` AdamW steps; sharded with fully_shard when ``world``
    is given (every rank uses the same batch, so gradients are exact averages for 1, 2, 4 ranks)."""
    model = TiedMLP()
    # Initialize from a generator of our own: in the threaded tier, ranks are threads that
    # share torch's global generator, so its draws would interleave between ranks.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh

        from helpers import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = batch()
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def train_state(world: int | None, steps: int = 1) -> tuple:
    """(model, optim, state dict to save) with DCP's get_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = build(world, steps)
    model_sd, optim_sd = get_state_dict(model, optim)
    return model, optim, {"model": model_sd, "optim": optim_sd, "step": steps, "cfg": {"lr": 0.01, "arch": "tied"}}
