"""Traced runs of the three frameworks for tests/integrations/test_trace_integrations.py, in one
fresh process: ``python trace_frameworks_run.py OUT``. Each framework trains a tiny model for 3
steps twice (``OUT/<framework>.<1|2>.trace``); in the second Lightning run, step 1's batch is
changed, so that the traces diverge there."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch.utils.data import DataLoader, Dataset

from tensorcanon.integrations.tracing import accelerate_trace, lightning_callback, transformers_callback

torch.set_num_threads(1)
warnings.filterwarnings("ignore")


def seed() -> None:
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


class Pairs(Dataset):
    def __init__(self, changed_at: int | None = None) -> None:
        self.x = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
        if changed_at is not None:
            self.x[4 * changed_at] += 1  # a batch of 4: step ``changed_at``'s first sample
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def lightning(out: Path, changed_at: int | None) -> None:
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    seed()
    model = Model()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[lightning_callback(out, level="modules")])
    trainer.fit(model, DataLoader(Pairs(changed_at), batch_size=4))


def transformers(out: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

    from tensorcanon.integrations.transformers import CanonicalTrainer

    class Tokens(Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(3))

        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    set_seed(0)
    seed()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out) + ".out", per_device_train_batch_size=4, max_steps=3,
                             save_strategy="no", logging_strategy="no", report_to=[], seed=0, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    CanonicalTrainer(model=model, args=args, train_dataset=Tokens(),
                     callbacks=[transformers_callback(out, level="steps")]).train()


def accelerate(out: Path) -> None:
    from accelerate import Accelerator

    seed()
    acc = Accelerator(cpu=True)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt, loader = acc.prepare(net, opt, DataLoader(Pairs(), batch_size=4))
    with accelerate_trace(acc, out, level="modules", model=net, optimizer=opt) as tr:
        for x, y in loader:
            tr.step((x, y))
            acc.backward(torch.nn.functional.mse_loss(net(x), y))
            opt.step()
            opt.zero_grad()


def main(out: Path) -> None:
    for n in (1, 2):
        lightning(out / f"lightning.{n}.trace", 1 if n == 2 else None)
        transformers(out / f"transformers.{n}.trace")
        accelerate(out / f"accelerate.{n}.trace")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
