"""Real Lightning fits for tests/integrations/test_lightning.py, run as fresh processes.

``python lightning_run.py first OUT`` runs, for every configuration (DataLoader
workers 0/2 x reload_dataloaders_every_n_epochs 0/1): a fit that never stops,
and a fit that writes checkpoints every 5 steps (ModelCheckpoint, through
CanonicalCheckpointIO) and crashes at step 16. ``python lightning_run.py resume
OUT`` resumes each configuration, in a fresh process, from the checkpoints
listed in RESUME_FROM, with torch.load and pickle patched to raise. Each run writes a JSON record of its final
weights/optimizer digest, its per-step losses and the batches it saw per epoch.

Every fit draws random numbers in __getitem__ (under SeededDataset), in a
random collate_fn (mixup, under SeededCollator) and in dropout. ACCUMULATE adds
one configuration with accumulate_grad_batches=2 (2 workers), a checkpoint
every 3 optimizer steps (mid epoch) and a crash inside an accumulation window.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from noisy_data import Noisy, mixup
from torch.utils.data import DataLoader, TensorDataset

import tensorcanon
from tensorcanon.integrations.lightning import CanonicalCheckpointIO, ExactResume

from support import no_unpickling

N, BATCH, EPOCHS, EVERY, CRASH_AT = 40, 4, 3, 5, 16  # 10 steps per epoch, 30 in all
CONFIGS = [(w, r) for w in (0, 2) for r in (0, 1)]
# checkpoint file -> the step it resumes at: the last batch of epoch 0 (ModelCheckpoint with
# every_n_train_steps), mid epoch 1, and the end of epoch 0 after validation (the default ModelCheckpoint)
RESUME_FROM = {"step=10": 10, "step=15": 15, "epoch=0": 10}
# accumulate_grad_batches=2: 5 optimizer steps per epoch, a checkpoint every 3, a crash after the first
# micro-batch of step 8's window; resumed from mid epoch 0 and mid epoch 1.
ACCUMULATE = {"name": "w2-r0-acc2", "workers": 2, "every": 3, "crash_at": 7, "resume_from": {"step=3": 3, "step=6": 6}}


class Data(L.LightningDataModule):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(123)
        x = torch.randn(N + 8, 8, generator=g)
        y = x[:, :3].sum(1, keepdim=True).sin()
        base = TensorDataset(x[:N], y[:N])
        self.sampler = tensorcanon.ResumableSampler(base, seed=7)
        # Noise drawn in __getitem__ resumes exactly in workers too: SeededDataset makes each
        # sample's random state a function of (seed, epoch, index).
        self.train_ds = tensorcanon.SeededDataset(Noisy(base), self.sampler)
        self.val_ds = TensorDataset(x[N:], y[N:])

    def train_dataloader(self) -> DataLoader:
        # The mixup collate_fn draws from the global generators too: SeededCollator seeds it per batch.
        return DataLoader(self.train_ds, batch_size=BATCH, sampler=self.sampler, num_workers=self.workers,
                          generator=self.sampler.generator, worker_init_fn=tensorcanon.seed_worker,
                          collate_fn=tensorcanon.SeededCollator(mixup))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=4)


class Model(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))
        self.losses: dict[int, str] = {}
        self.micro: list[str] = []  # every batch's loss (several per step when accumulating)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item().hex()
        self.micro.append(loss.item().hex())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(L.Callback):
    """Batches per epoch as the loop saw them; crashes at CRASH_AT when asked to."""

    def __init__(self, crash: bool, crash_at: int = CRASH_AT) -> None:
        self.crash, self.crash_at = crash, crash_at
        self.batches: dict[int, int] = {}
        self.limits: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.crash and trainer.global_step == self.crash_at and (
                trainer.accumulate_grad_batches == 1 or batch_idx % 2 == 1):  # inside a window
            raise RuntimeError("simulated crash")
        e = trainer.current_epoch
        self.batches[e] = self.batches.get(e, 0) + 1
        self.limits[e] = int(trainer.num_training_batches)


def fit(workers: int, reload: int, ckpt_dir: Path | None, ckpt_path: str | None, crash: bool,
        accumulate: int = 1) -> dict:
    every, crash_at = (EVERY, CRASH_AT) if accumulate == 1 else (ACCUMULATE["every"], ACCUMULATE["crash_at"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensorcanon.seed_everything(0)
        model, data, record = Model(), Data(workers), Record(crash, crash_at)
        callbacks = [ExactResume(), record]
        if ckpt_dir is not None:
            callbacks += [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1,
                                          filename="{step}"),
                          ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")]
        trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, deterministic=True,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=ckpt_dir is not None,
                            reload_dataloaders_every_n_epochs=reload, accumulate_grad_batches=accumulate,
                            plugins=[CanonicalCheckpointIO()], callbacks=callbacks)
        try:
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        except RuntimeError as e:
            if not crash or "simulated crash" not in str(e):
                raise
    opt = trainer.optimizers[0]
    return {"digest": tensorcanon.fingerprint({"model": model.state_dict(), "optimizer": opt.state_dict()}),
            "steps": trainer.global_step, "losses": model.losses, "micro": model.micro, "batches": record.batches,
            "limits": record.limits}


def main(mode: str, out: Path) -> None:
    results = {}
    for workers, reload in CONFIGS:
        name = f"w{workers}-r{reload}"
        if mode == "first":
            results[name] = {"full": fit(workers, reload, None, None, crash=False),
                             "crashed": fit(workers, reload, out / name, None, crash=True)}
        else:
            with no_unpickling("in a resumed fit"):
                results[name] = {f: fit(workers, reload, None, str(out / name / f"{f}.ckpt"), crash=False)
                                 for f in RESUME_FROM}
    name, workers = ACCUMULATE["name"], ACCUMULATE["workers"]
    if mode == "first":
        results[name] = {"full": fit(workers, 0, None, None, crash=False, accumulate=2),
                         "crashed": fit(workers, 0, out / name, None, crash=True, accumulate=2)}
    else:
        with no_unpickling("in a resumed fit"):
            results[name] = {f: fit(workers, 0, None, str(out / name / f"{f}.ckpt"), crash=False, accumulate=2)
                             for f in ACCUMULATE["resume_from"]}
    (out / f"{mode}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
