"""The augmented dataset the training scripts (accelerate_run.py, lightning_run.py) share."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset


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
