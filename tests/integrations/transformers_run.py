"""Real transformers Trainer runs for tests/integrations/test_transformers.py, as fresh processes.

``python transformers_run.py first OUT`` trains a tiny GPT-2 (built from a
config: nothing is downloaded) with CanonicalTrainer, once without stopping and
once saving a checkpoint every 5 steps and crashing at step 16.
``python transformers_run.py resume OUT`` resumes from checkpoint-10 (end of
epoch 0) and checkpoint-15 (mid epoch 1) in a fresh process, with torch.load
and pickle patched to raise for the whole resumed run, and trains to the end.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed

import tensorcanon
from tensorcanon.integrations.transformers import CanonicalTrainer

N, BATCH, EPOCHS, EVERY, CRASH_AT = 40, 4, 3, 5, 16  # 10 steps per epoch
RESUME_FROM = (10, 15)


class Tokens(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (N, 12), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Crash(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == CRASH_AT:
            raise RuntimeError("simulated crash")


def trainer(out: Path, save: bool, crash: bool) -> CanonicalTrainer:
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)  # dropout 0.1
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=3, save_strategy="steps" if save else "no", save_steps=EVERY,
        logging_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True)
    return CanonicalTrainer(model=model, args=args, train_dataset=Tokens(),
                            callbacks=[Crash()] if crash else [])


def digest(t: CanonicalTrainer) -> str:
    return tensorcanon.fingerprint({"model": dict(t.model.state_dict()), "optimizer": t.optimizer.state_dict(),
                                    "scheduler": t.lr_scheduler.state_dict()})


def _refuse(*args, **kwargs):
    raise AssertionError("torch.load / pickle was called while resuming")


def main(mode: str, out: Path) -> None:
    if mode == "first":
        full = trainer(out / "full", save=False, crash=False)
        full.train()
        crashed = trainer(out / "crashed", save=True, crash=True)
        try:
            crashed.train()
        except RuntimeError as e:
            assert "simulated crash" in str(e)
        result = {"digest": digest(full), "steps": full.state.global_step}
    else:
        result = {}
        for step in RESUME_FROM:
            t = trainer(out / f"resumed{step}", save=False, crash=False)
            saved = torch.load, torch.serialization.load, pickle.load, pickle.loads, pickle.Unpickler
            torch.load = torch.serialization.load = pickle.load = pickle.loads = pickle.Unpickler = _refuse
            try:
                t.train(resume_from_checkpoint=str(out / "crashed" / f"checkpoint-{step}"))
            finally:
                torch.load, torch.serialization.load, pickle.load, pickle.loads, pickle.Unpickler = saved
            result[str(step)] = {"digest": digest(t), "steps": t.state.global_step}
    (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
