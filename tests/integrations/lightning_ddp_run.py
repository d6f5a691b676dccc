"""A real Lightning DDP fit (2 CPU processes, gloo) for tests/integrations/test_lightning.py.

``python lightning_ddp_run.py first OUT`` fits once without stopping and writes
checkpoints every 3 steps on the way (ModelCheckpoint through CanonicalCheckpointIO;
writing one draws no random number, so this fit is also the uninterrupted one).
``python lightning_ddp_run.py resume OUT`` resumes, in fresh processes, from the
checkpoints of RESUME_FROM, one fit after the other. Lightning's launcher runs this
script once more for rank 1; each rank writes ``<mode>-rank<r>.json``: per fit, the
final weights/optimizer digest and its own per-step losses.

The random state depends on the rank on purpose: each rank reseeds its global torch
RNG with its rank in ``setup`` (as scripts that seed ``base + rank`` do), and the
model's dropout draws from it. A resume that gave every rank rank 0's random state
would change rank 1's losses after the checkpoint, and through the averaged
gradients, the weights of both.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from noisy_data import Noisy
from torch.utils.data import DataLoader, TensorDataset

import tensorcanon
from tensorcanon.integrations.lightning import CanonicalCheckpointIO, ExactResume

N, BATCH, EPOCHS, EVERY = 48, 4, 2, 3  # per rank: 24 samples, 6 steps per epoch, 12 in all
RESUME_FROM = {"step=6": 6, "step=9": 9}  # the end of epoch 0, and mid epoch 1


class Data(L.LightningDataModule):
    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(123)
        x = torch.randn(N, 8, generator=g)
        base = TensorDataset(x, x[:, :3].sum(1, keepdim=True).sin())
        self.sampler = tensorcanon.ResumableSampler(base, seed=7, num_replicas=self.trainer.world_size,
                                                    rank=self.trainer.global_rank)
        self.train_ds = tensorcanon.SeededDataset(Noisy(base), self.sampler)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=BATCH, sampler=self.sampler, generator=self.sampler.generator)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(32, 1))
        self.losses: dict[int, str] = {}

    def setup(self, stage: str) -> None:
        torch.manual_seed(1000 + self.global_rank)  # the rank-dependent random state

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item().hex()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(ckpt_dir: Path | None, ckpt_path: str | None) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensorcanon.seed_everything(0)
        model = Model()
        callbacks: list = [ExactResume()]
        if ckpt_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=EVERY, save_top_k=-1,
                                             filename="{step}"))
        trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=2, strategy="ddp",
                            use_distributed_sampler=False, deterministic=True, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=ckpt_dir is not None, num_sanity_val_steps=0,
                            plugins=[CanonicalCheckpointIO()], callbacks=callbacks)
        trainer.fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return {"rank": trainer.global_rank, "steps": trainer.global_step, "losses": model.losses,
            "digest": tensorcanon.fingerprint({"model": model.state_dict(),
                                               "optimizer": trainer.optimizers[0].state_dict()})}


def main(mode: str, out: Path) -> None:
    if mode == "first":
        results = {"full": fit(out / "ckpts", None)}
    else:
        results = {f: fit(None, str(out / "ckpts" / f"{f}.ckpt")) for f in RESUME_FROM}
    rank = results[next(iter(results))]["rank"]
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(results))


def wait_for_children() -> int:
    """Wait for every process this one started (rank 0: Lightning's launcher started rank 1 as its
    child, and nothing waits for it at exit); 1 if any of them failed, else 0."""
    failed = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # none left
            return failed
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"child process {pid} failed: exit status {os.waitstatus_to_exitcode(status)}", file=sys.stderr)
            failed = 1


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    # The results are written: leave without the interpreter's teardown, where gloo's threads can end
    # the process with "terminate called without an active exception" (seen once in CI with
    # transformers_ddp_run.py, after every result was written), which the test would take for a
    # failed run. Rank 0 first waits for rank 1 (its child), so it never leaves before rank 1 has
    # written its results, and reports a rank 1 that failed.
    code = wait_for_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
