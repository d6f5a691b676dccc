"""A tiny training run used by tests/test_resume.py, in-process and as a fresh process.

Run as a script: ``python resume_helper.py WORKERS TOTAL CKPT...`` resumes each
checkpoint in this (fresh) process, trains to TOTAL steps and prints one JSON
line ``{ckpt: final weight digest}``.
"""

from __future__ import annotations

import json
import random
import sys
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import tensorcanon

N_SAMPLES, BATCH = 40, 8  # 5 batches per epoch


class NoisyData(Dataset):
    """Augments in __getitem__ with numpy's, torch's and Python's global generators."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + float(np.random.uniform(0.05, 0.2)) * torch.randn(self.x.shape[1])
        if random.random() < 0.3:
            x[random.randrange(len(x))] = 0.0
        return x, self.y[i]


class Run:
    def __init__(self, workers: int, seeded: bool = True) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the PYTHONHASHSEED note
            tensorcanon.seed_everything(0)
        g = torch.Generator().manual_seed(123)
        x = torch.randn(N_SAMPLES, 6, generator=g)
        y = (x[:, :2] * 2).sin()
        data = NoisyData(x, y)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=4, gamma=0.5)
        self.sampler = tensorcanon.ResumableSampler(data, seed=7)
        # seeded=False is the control: the same augmentation without per-sample seeding
        self.ds = tensorcanon.SeededDataset(data, self.sampler) if seeded else data
        self.loader = DataLoader(
            self.ds, batch_size=BATCH, sampler=self.sampler, num_workers=workers,
            persistent_workers=workers > 0, generator=self.sampler.generator,
            worker_init_fn=tensorcanon.seed_worker)
        self.step = 0

    def checkpoint(self) -> dict:
        return {
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(), "rng": tensorcanon.RngState.capture(),
            "sampler": self.sampler.state_dict(), "step": self.step,
            "settings": tensorcanon.DeterminismSettings.capture(),
        }

    def resume(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.sampler.load_state_dict(ckpt["sampler"])
        self.step = ckpt["step"]
        ckpt["rng"].restore()  # last, after everything that might draw

    def train(self, until: int) -> None:
        while self.step < until:
            for xb, yb in self.sampler.track(self.loader):  # the rest of the epoch; then the next
                self.opt.zero_grad()
                torch.nn.functional.mse_loss(self.model(xb), yb).backward()
                self.opt.step()
                self.sched.step()
                self.step += 1
                if self.step >= until:
                    break

    def digest(self) -> str:
        return tensorcanon.fingerprint(self.model.state_dict())


def main(argv: list[str]) -> int:
    workers, total, paths = int(argv[0]), int(argv[1]), argv[2:]
    out = {}
    for path in paths:
        run = Run(workers)
        run.resume(tensorcanon.load(path))
        run.train(total)
        out[path] = run.digest()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
