"""CanonicalTrainer under DDP (2 CPU processes, gloo) for tests/integrations/test_transformers.py.

``python transformers_ddp_run.py first OUT`` starts 2 processes (WORLD_SIZE, RANK,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, as ``torch.distributed.run`` sets them;
the Trainer then runs DDP with ``ddp_backend="gloo"``). Each trains a tiny
BertForMaskedLM with DataCollatorForLanguageModeling (random masks), dropout,
gradient_accumulation_steps=2 and a warm-up schedule, once without stopping and
once saving a checkpoint at every optimizer step and crashing inside the
accumulation window after step ``DDP_CRASH_AFTER`` (constants in transformers_run.py,
which the tests import). ``python transformers_ddp_run.py resume OUT`` starts 2
fresh processes that resume, one run after the other, from the checkpoints of
``DDP_RESUME_FROM``, with torch.load and pickle patched to raise. Each rank writes
``<mode>-rank<r>.json``: per run, the loss of its every micro-batch and the digest
of its final model, optimizer and scheduler. A launch that fails or outlives
TIMEOUT ends both processes and exits with their output.

The random state depends on the rank on purpose: each rank reseeds its global torch
generator with its rank when training begins (as scripts that seed ``base + rank`` do),
and dropout draws from it. A resume that gave every rank the same random state would
change rank 1's losses after the checkpoint, and through the averaged gradients, the
weights of both.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from support import free_port, run_processes

WORLD, EPOCHS = 2, 2
TIMEOUT = 150  # seconds for a whole launch: a rank that hangs in a collective must not hang the tests


def launch(mode: str, out: Path) -> None:
    """Run this script as ``WORLD`` ranks of one process group; raise with their output if any fails."""
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    codes = run_processes([([sys.executable, __file__, "rank", mode, str(out)],
                            {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, out / f"{mode}-rank{rank}.log")
                           for rank in range(WORLD)], TIMEOUT)
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        logs = "\n".join((out / f"{mode}-rank{r}.log").read_text()[-4000:] for r in failed)
        raise SystemExit(f"ranks {failed} of '{mode}' failed or timed out:\n{logs}")


def rank_main(mode: str, out: Path) -> None:
    import torch
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    import transformers_run as tr

    class RankSeed(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            torch.manual_seed(1000 + args.process_index)  # restored over on resume

    class CrashInWindow(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):  # after a micro-batch inside a window
            if state.global_step == tr.DDP_CRASH_AFTER:
                raise RuntimeError("simulated crash")

    def trainer(run: str, save: bool, crash: bool) -> tr.Recording:
        set_seed(0)
        model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, max_position_embeddings=16))  # dropout 0.1
        args = TrainingArguments(
            output_dir=str(out / run), per_device_train_batch_size=tr.BATCH, gradient_accumulation_steps=2,
            num_train_epochs=EPOCHS, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2,
            save_strategy="steps" if save else "no", save_steps=1, logging_strategy="no", report_to=[], seed=0,
            use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True)
        t = tr.Recording(model=model, args=args, train_dataset=tr.Sentences(),
                         data_collator=DataCollatorForLanguageModeling(tr.tokenizer(), mlm_probability=0.3),
                         callbacks=[RankSeed()] + ([CrashInWindow()] if crash else []))
        t.losses = []
        return t

    def record(t: tr.Recording) -> dict:
        return {"digest": tr.digest(t), "steps": t.state.global_step, "losses": t.losses,
                "world_size": t.args.world_size}

    warnings.simplefilter("ignore")
    if mode == "first":
        result = tr._first(lambda save, crash: trainer("crashed" if crash else "full", save, crash), record)
    else:
        result = {}
        for k in tr.DDP_RESUME_FROM:
            t = trainer(f"resumed{k}", save=False, crash=False)
            result[str(k)] = tr._resume(t, out / "crashed" / f"checkpoint-{k}")
            result[str(k)]["world_size"] = t.args.world_size
    (out / f"{mode}-rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(sys.argv[2], Path(sys.argv[3]))
        # The results are written: leave without the interpreter's teardown, where gloo's threads can
        # end the process with "terminate called without an active exception" (seen once in CI,
        # after every result was written), which the launch would take for a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        launch(sys.argv[1], Path(sys.argv[2]))
