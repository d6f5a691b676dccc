"""The augmented dataset and the random collate_fn the training scripts (accelerate_run.py,
lightning_run.py) share."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate


class Noisy(Dataset):
    """Samples with augmentation noise drawn from the global torch RNG in __getitem__ (so in the
    DataLoader worker processes, where torchvision transforms run)."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x + 0.1 * torch.randn_like(x), y


def mixup(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A random collate_fn, as mixup is: a Beta weight from numpy's global generator and a
    permutation from torch's. In DataLoader workers with num_workers > 0."""
    x, y = default_collate(samples)
    lam = float(np.random.beta(0.4, 0.4))
    perm = torch.randperm(len(x))
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]
