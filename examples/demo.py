"""Bit-exact training resumption with tensorcanon.

Trains a small MLP (dropout, a shuffled DataLoader with 2 persistent workers,
random augmentation drawn inside Dataset.__getitem__ with numpy, torch and
random, AdamW, a learning-rate schedule) three ways:

1. N steps without stopping;
2. k steps, then a tensorcanon checkpoint (model, optimizer, scheduler, the
   complete random state, the sampler position, settings);
3. a FRESH Python process loads that checkpoint and trains on to N.

tensorcanon.SeededDataset seeds each sample's random draws from
(seed, epoch, index), so the augmentation does not depend on which worker
loads a sample or on where the run was interrupted.

It prints both final weight digests, verifies the checkpoint from its file,
and exits with status 1 unless the digests are identical.

Run: python examples/demo.py   [--steps 60] [--k 25] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import tensorcanon

SAMPLES, FEATURES, CLASSES, BATCH = 512, 16, 4, 32  # 16 batches per epoch


class NoisyData(Dataset):
    """Synthetic samples, augmented in __getitem__ the ordinary way (global generators)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        level = np.random.uniform(0.0, 0.3)                     # numpy's global generator
        x = self.x[i] + level * torch.randn(FEATURES)           # torch's global generator
        if random.random() < 0.25:                              # Python's random
            x[random.randrange(FEATURES)] = 0.0
        return x, self.y[i]


class Trainer:
    def __init__(self, workers: int) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tensorcanon.seed_everything(0)
        self.notes = [str(w.message) for w in caught]
        data = torch.Generator().manual_seed(42)
        x = torch.randn(SAMPLES, FEATURES, generator=data)
        y = (x @ torch.randn(FEATURES, CLASSES, generator=data)).argmax(1)
        data = NoisyData(x, y)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
            torch.nn.Linear(64, CLASSES))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=20, gamma=0.5)
        # The sampler's order and the workers' base seed depend only on (seed, epoch);
        # its generator keeps the DataLoader away from the global torch RNG.
        self.sampler = tensorcanon.ResumableSampler(data, seed=1)
        # Each sample's augmentation is drawn from (seed, epoch, index), in whichever process
        # loads it; the loading process's own random streams are left as they were.
        seeded = tensorcanon.SeededDataset(data, self.sampler)
        self.loader = DataLoader(seeded, batch_size=BATCH, sampler=self.sampler, num_workers=workers,
                                 persistent_workers=workers > 0, generator=self.sampler.generator,
                                 worker_init_fn=tensorcanon.seed_worker)
        self.step = 0

    def train(self, until: int) -> None:
        while self.step < until:
            # track() yields the rest of the current epoch, then moves the sampler to the next
            for x, y in self.sampler.track(self.loader):
                self.opt.zero_grad()
                torch.nn.functional.cross_entropy(self.model(x), y).backward()
                self.opt.step()
                self.sched.step()
                self.step += 1
                if self.step >= until:
                    break

    def checkpoint(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "sampler": self.sampler.state_dict(),            # seed, epoch, position (+ sharding)
            "rng": tensorcanon.RngState.capture(),           # python, numpy, torch CPU (+ CUDA/MPS/XPU)
            "settings": tensorcanon.DeterminismSettings.capture(),
            "step": self.step,
        }

    def resume(self, ckpt: dict) -> list:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.sampler.load_state_dict(ckpt["sampler"])
        self.step = ckpt["step"]
        ckpt["rng"].restore()  # last: nothing after it may draw before training continues
        return [str(d) for d in ckpt["settings"].compare()]

    def digest(self) -> str:
        return tensorcanon.fingerprint(self.model.state_dict())


def child(path: str, steps: int, workers: int) -> int:
    """The fresh process: load, resume, train to the end, report as JSON."""
    t = Trainer(workers)
    differences = t.resume(tensorcanon.load(path))
    start = t.step
    t.train(steps)
    print(json.dumps({"pid": os.getpid(), "start": start, "digest": t.digest(), "differences": differences}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="total training steps N")
    ap.add_argument("--k", type=int, default=25, help="steps before the checkpoint (0 < k < N)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--resume", help=argparse.SUPPRESS)  # internal: the fresh-process half
    args = ap.parse_args()
    if args.resume:
        return child(args.resume, args.steps, args.workers)
    if not 0 < args.k < args.steps:
        ap.error("need 0 < k < steps")

    t0 = time.perf_counter()
    print(f"tensorcanon {tensorcanon.__version__}: bit-exact resume demo (torch {torch.__version__})")
    print(f"MLP with dropout, {SAMPLES} synthetic samples, shuffled DataLoader with {args.workers} workers,")
    print("augmentation in Dataset.__getitem__ (SeededDataset), AdamW + StepLR\n")

    full = Trainer(args.workers)
    for note in full.notes:
        print(f"note: {note}\n")
    full.train(args.steps)
    expected = full.digest()
    print(f"1. uninterrupted, {args.steps} steps          final weights {expected}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.safetensors")
        part = Trainer(args.workers)
        part.train(args.k)
        saved = tensorcanon.save(part.checkpoint(), path)
        epoch, pos = part.sampler.epoch, part.sampler.position
        print(f"2. stopped after {args.k} steps (epoch {epoch}, sample {pos}/{SAMPLES}); checkpoint "
              f"{os.path.getsize(path)} bytes")
        print(f"   checkpoint digest                 {saved}")
        checked = tensorcanon.verify(path, expect=saved)  # re-hashes every byte of the file
        print(f"   verified from the file            {checked}  ok")
        del part

        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--resume", path,
                               "--steps", str(args.steps), "--workers", str(args.workers)],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        print("the resumed process failed", file=sys.stderr)
        return 1
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    got = report["digest"]
    print(f"3. resumed in a fresh process (pid {report['pid']}), steps {report['start']}..{args.steps}")
    print(f"   settings that differ on resume:   {', '.join(report['differences']) or 'none'}")
    print(f"   final weights                     {got}\n")
    same = got == expected
    print(f"uninterrupted {expected}")
    print(f"resumed       {got}")
    print(f"identical: {'yes' if same else 'NO'}   ({time.perf_counter() - t0:.1f} s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
