"""Real accelerate training loops for tests/integrations/test_accelerate.py, run as fresh processes.

``python accelerate_run.py first OUT`` trains, for DataLoader workers 0 and 2,
once without stopping and once saving with tensorcanon's ``save_state`` at
steps 10 (the end of epoch 0) and 15 (mid epoch 1), then stopping at step 16.
``python accelerate_run.py resume OUT`` resumes each saved state in a fresh
process with ``load_state``, with torch.load and pickle patched to raise while
it loads, and trains to the end. Every run writes the digest of its final
model, optimizer, scheduler and registered-object state, and the loss of every
batch, to a JSON file.

Every run draws random numbers in __getitem__ (under SeededDataset), in a
random collate_fn (mixup, under SeededCollator) and in dropout. The ``skip``
configuration (2 workers) uses ``gradient_accumulation_steps=2`` and resumes
the way accelerate's examples do: without ``track``, it skips the batches the
interrupted epoch had done with ``accelerator.skip_first_batches``; it saves
after batches 6 (mid epoch 0) and 14 (mid epoch 1) and stops inside an
accumulation window, after batch 17.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from noisy_data import Noisy, mixup
from torch.utils.data import DataLoader, TensorDataset

import tensorcanon
from tensorcanon.integrations import accelerate as tca

from support import no_unpickling

N, BATCH, EPOCHS, CRASH_AT = 40, 4, 3, 16  # 10 steps per epoch
TOTAL = EPOCHS * N // BATCH
SAVE_AT = (10, 15)
WORKERS = (0, 2)
SKIP = {"workers": 2, "accumulate": 2, "save_at": (6, 14), "crash_at": 17}
PER_EPOCH = N // BATCH


class Ema:
    """A user object registered for checkpointing: a tensor, a count and a numpy Generator."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.avg = [p.detach().clone() for p in model.parameters()]
        self.updates = 0
        self.rng = np.random.default_rng(11)

    def update(self, model: torch.nn.Module) -> None:
        decay = float(self.rng.uniform(0.8, 0.99))
        for a, p in zip(self.avg, model.parameters(), strict=True):
            a.mul_(decay).add_(p.detach(), alpha=1 - decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"avg": self.avg, "updates": self.updates, "rng": self.rng}

    def load_state_dict(self, state: dict) -> None:
        self.avg, self.updates, self.rng = state["avg"], state["updates"], state["rng"]


class Run:
    def __init__(self, workers: int, accumulate: int = 1) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tensorcanon.seed_everything(0)
        self.acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
        g = torch.Generator().manual_seed(123)
        x = torch.randn(N, 8, generator=g)
        base = TensorDataset(x, x[:, :3].sum(1, keepdim=True).sin())
        self.sampler = tensorcanon.ResumableSampler(base, seed=7)
        loader = DataLoader(tensorcanon.SeededDataset(Noisy(base), self.sampler), batch_size=BATCH,
                            sampler=self.sampler, num_workers=workers, generator=self.sampler.generator,
                            worker_init_fn=tensorcanon.seed_worker, collate_fn=tensorcanon.SeededCollator(mixup))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        self.model, self.opt, self.loader, self.sched = self.acc.prepare(model, opt, loader, sched)
        self.ema = Ema(self.model)
        self.acc.register_for_checkpointing(self.ema)
        self.losses: list[str] = []

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.acc.accumulate(self.model):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.acc.backward(loss)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
        self.ema.update(self.model)
        self.losses.append(loss.item().hex())

    def train(self, save_dir: Path | None = None, stop_at: int = TOTAL) -> None:
        for _epoch in range(self.sampler.epoch, EPOCHS):
            for x, y in tca.track(self.loader):
                self._step(x, y)
                if save_dir is not None and self.steps in SAVE_AT:
                    tca.save_state(self.acc, save_dir / f"step{self.steps}")
                if self.steps >= stop_at:
                    return

    def train_skipping(self, save_dir: Path | None = None, stop_at: int = TOTAL) -> None:
        """accelerate's own resume pattern: no track(); the interrupted epoch's first batches are
        skipped with skip_first_batches (the sampler's position stays 0), and the loader is told
        its epoch before each one."""
        start, done = divmod(self.steps, PER_EPOCH)
        for epoch in range(start, EPOCHS):
            self.loader.set_epoch(epoch)
            batches = self.acc.skip_first_batches(self.loader, done) if epoch == start and done else self.loader
            if batches is not self.loader:  # the new loader must be told its epoch too (accelerate 1.7
                batches.set_epoch(epoch)     # does not carry it over: the resumed epoch was drawn as epoch 0)
            for x, y in batches:
                self._step(x, y)
                if save_dir is not None and self.steps in SKIP["save_at"]:
                    tca.save_state(self.acc, save_dir / f"step{self.steps}")
                if self.steps >= stop_at:
                    return

    @property
    def steps(self) -> int:
        return self.ema.updates  # restored with the registered object

    def digest(self) -> str:
        return tensorcanon.fingerprint({
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(), "ema": self.ema.state_dict(), "step": self.acc.step,
            "sampler": self.sampler.state_dict()})


def load_without_unpickling(run: Run, folder: Path) -> None:
    with no_unpickling("while loading"):
        tca.load_state(run.acc, folder)


def main(mode: str, out: Path) -> None:
    results = {}
    configs = [(f"w{w}", w, 1, SAVE_AT, CRASH_AT, Run.train) for w in WORKERS]
    configs.append(("skip", SKIP["workers"], SKIP["accumulate"], SKIP["save_at"], SKIP["crash_at"], Run.train_skipping))
    for name, workers, accumulate, save_at, crash_at, train in configs:
        if mode == "first":
            full = Run(workers, accumulate)
            train(full)
            crashed = Run(workers, accumulate)
            train(crashed, save_dir=out / name, stop_at=crash_at)
            results[name] = {"full": full.digest(), "steps": full.steps, "crashed_at": crashed.steps,
                             "losses": full.losses}
        else:
            results[name] = {}
            for step in save_at:
                run = Run(workers, accumulate)
                load_without_unpickling(run, out / name / f"step{step}")
                resumed_at = run.steps
                train(run)
                results[name][str(step)] = {"digest": run.digest(), "resumed_at": resumed_at,
                                            "steps": run.steps, "losses": run.losses}
    (out / f"{mode}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
