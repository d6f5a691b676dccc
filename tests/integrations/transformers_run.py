"""Real transformers Trainer runs for tests/integrations/test_transformers.py, as fresh processes.

Two scenarios, each run once without stopping and once saving checkpoints and
crashing (``python transformers_run.py first OUT``), then resumed in a fresh
process from several checkpoints, with torch.load and pickle patched to raise
for the whole resumed run (``python transformers_run.py resume OUT``):

- ``gpt2``: a tiny GPT-2 (built from a config: nothing is downloaded), 3 epochs
  of 10 steps, a checkpoint every 5 steps, a crash at step 16; resumed from
  checkpoint-10 (end of epoch 0) and checkpoint-15 (mid epoch 1).
- ``mlm``: a tiny BertForMaskedLM (the tokenizer from an in-memory vocabulary)
  with DataCollatorForLanguageModeling (masks drawn from torch's global
  generator in the collator), dropout, gradient_accumulation_steps=2 and a
  linear schedule with warm-up: 48 samples, batch 4, 2 epochs of 6 optimizer
  steps, a checkpoint every 2 steps, a crash inside the accumulation window
  after step 9; for every configuration of MLM_CONFIGS (workers 0 and 2,
  persistent workers, the collator as it is and wrapped in SeededCollator by the
  user), resumed from MLM_RESUME_FROM (mid epoch 0, the end of epoch 0, mid
  epoch 1). Each run records the loss of every micro-batch (as hex floats).

Every run records the digest of its final model, optimizer and scheduler.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, models
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

import tensorcanon
from tensorcanon.integrations.transformers import CanonicalTrainer

from support import no_unpickling

torch.set_num_threads(1)  # tiny models: more threads only wait on each other (and on other tests' processes)

# ------------------------------------------------------------------ gpt2: a plain Trainer run

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


# ------------------------------------------------------------------ mlm: a random collator

MLM_N, MLM_ACCUMULATE, MLM_EPOCHS, MLM_EVERY, MLM_CRASH_AFTER = 48, 2, 2, 2, 9  # 6 optimizer steps per epoch
MLM_RESUME_FROM = (4, 6, 8)
# name -> (dataloader_num_workers, persistent workers, collator wrapped in SeededCollator by the user)
MLM_CONFIGS = {"w0": (0, False, False), "w2": (2, False, False), "w2-persistent-seeded": (2, True, True)}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# transformers_ddp_run.py, the same BERT on 2 processes: 6 micro-batches per process and epoch, 3 optimizer
# steps; a crash inside the window after step 4; resumed from mid epoch 0, the end of epoch 0, mid epoch 1.
DDP_CRASH_AFTER, DDP_RESUME_FROM = 4, (1, 3, 4)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + [f"w{i}" for i in range(59)])}  # 64 tokens
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                   pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   mask_token="[MASK]")


class Sentences(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(len(SPECIAL), 64, (MLM_N, 10), generator=g)

    def __len__(self) -> int:
        return MLM_N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": [2, *self.ids[i].tolist(), 3]}  # [CLS] ... [SEP]


class Recording(CanonicalTrainer):
    """Records the loss of every micro-batch with the optimizer step it belongs to."""

    losses: list

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append([self.state.global_step, loss.item().hex()])
        return loss


class CrashInWindow(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):  # after a micro-batch inside a window
        if state.global_step == MLM_CRASH_AFTER:
            raise RuntimeError("simulated crash")


def mlm_trainer(config: str, out: Path, save: bool, crash: bool) -> Recording:
    workers, persistent, user_seeded = MLM_CONFIGS[config]
    set_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=16))  # dropout 0.1
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.3)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=MLM_ACCUMULATE,
        num_train_epochs=MLM_EPOCHS, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=3,
        save_strategy="steps" if save else "no", save_steps=MLM_EVERY, logging_strategy="no", report_to=[],
        seed=0, use_cpu=True, dataloader_num_workers=workers, dataloader_persistent_workers=persistent,
        disable_tqdm=True)
    t = Recording(model=model, args=args, train_dataset=Sentences(),
                  data_collator=tensorcanon.SeededCollator(collator) if user_seeded else collator,
                  callbacks=[CrashInWindow()] if crash else [])
    t.losses = []
    return t


# ------------------------------------------------------------------ running them

def digest(t: CanonicalTrainer) -> str:
    return tensorcanon.fingerprint({"model": dict(t.model.state_dict()), "optimizer": t.optimizer.state_dict(),
                                    "scheduler": t.lr_scheduler.state_dict()})


def _record(t: CanonicalTrainer) -> dict:
    return {"digest": digest(t), "steps": t.state.global_step, "losses": getattr(t, "losses", None)}


def _first(make, record=_record) -> dict:
    """The run that never stops and the one that crashes (saving checkpoints): ``record`` of each."""
    full = make(save=False, crash=False)
    full.train()
    crashed = make(save=True, crash=True)
    try:
        crashed.train()
    except RuntimeError as e:
        assert "simulated crash" in str(e)
    return {"full": record(full), "crashed": record(crashed)}


def _resume(t: CanonicalTrainer, checkpoint: Path) -> dict:
    with no_unpickling("while resuming"):
        t.train(resume_from_checkpoint=str(checkpoint))
    return _record(t)


def main(mode: str, out: Path) -> None:
    warnings.simplefilter("ignore")
    if mode == "first":
        result = {"gpt2": _first(lambda save, crash: trainer(out / ("crashed" if crash else "full"), save, crash)),
                  "mlm": {c: _first(lambda save, crash, c=c: mlm_trainer(c, out / "mlm" / c /
                                                                        ("crashed" if crash else "full"),
                                                                        save, crash))
                          for c in MLM_CONFIGS}}
    else:
        result = {"gpt2": {str(k): _resume(trainer(out / f"resumed{k}", save=False, crash=False),
                                           out / "crashed" / f"checkpoint-{k}") for k in RESUME_FROM},
                  "mlm": {c: {str(k): _resume(mlm_trainer(c, out / "mlm" / c / f"resumed{k}", save=False, crash=False),
                                              out / "mlm" / c / "crashed" / f"checkpoint-{k}")
                              for k in MLM_RESUME_FROM}
                          for c in MLM_CONFIGS}}
    (out / f"{mode}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
