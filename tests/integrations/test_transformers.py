"""tensorcanon with the real transformers (tiny models built from configs; nothing is downloaded).

- save_pretrained files are read by tensorcanon.load bit for bit, and a
  tensorcanon file of a plain dict[str, Tensor] named model.safetensors is read
  by from_pretrained bit for bit (GPT-2, BERT, Llama);
- CanonicalTrainer's checkpoints hold no pickle, and a Trainer run resumed from
  one in a fresh process (torch.load and pickle patched to raise) ends with the
  digest of a run that never stopped;
- so does a BERT trained with a random data collator (MLM masking), gradient
  accumulation and DataLoader workers, resumed mid-epoch: the same loss at every
  micro-batch, whatever the number of workers; and under DDP (2 processes, gloo),
  where each rank resumes its own random state;
- every tensor file of a CanonicalTrainer checkpoint, model.safetensors included,
  passes ``tensorcanon verify``, and from_pretrained reads the model back exactly.
"""

from __future__ import annotations

# First: importing integration_support sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE, which the
# Hugging Face libraries read when they are first imported. restore_determinism_settings is an
# autouse fixture: importing it is what applies it.
from integration_support import (  # noqa: F401 (a fixture)
    first_and_resume,
    first_and_resume_ranks,
    is_pickle_or_zip,
    restore_determinism_settings,
)

# isort: split

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModel,
    BertConfig,
    BertForMaskedLM,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

import tensorcanon
from tensorcanon.integrations import transformers as tt
from tensorcanon.tools.cli import main as tensorcanon_cli

import transformers_run

MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)),
    "bert": lambda: BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=16)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=1, max_position_embeddings=16)),
}


def _same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k  # bits


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_files_load_bit_exactly(name, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.save_pretrained(tmp_path)
    loaded = tensorcanon.load(tmp_path / "model.safetensors")
    # transformers leaves tied weights (GPT-2's lm_head) out of the file; every tensor it wrote matches.
    state = {k: v for k, v in model.state_dict().items() if k in loaded}
    assert len(state) >= len(model.state_dict()) - 1
    _same_tensors(loaded, state)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_pretrained_reads_a_tensorcanon_file(name, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config.save_pretrained(tmp_path)
    tensorcanon.save(dict(model.state_dict()), tmp_path / "model.safetensors")
    again = AutoModel.from_pretrained(tmp_path) if name == "bert" else type(model).from_pretrained(tmp_path)
    _same_tensors(dict(again.state_dict()), dict(model.state_dict()))


# ------------------------------------------------------------------ CanonicalTrainer across processes

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict, object]:
    # One fresh process trains every scenario uninterrupted and crashed, another resumes them all.
    out = tmp_path_factory.mktemp("transformers")
    first, resume = first_and_resume("transformers_run.py", out)
    return first, resume, out


@pytest.mark.parametrize("step", transformers_run.RESUME_FROM)
def test_trainer_resumed_in_a_fresh_process_is_bit_identical(runs, step):
    first, resumed, _ = runs
    full, res = first["gpt2"]["full"], resumed["gpt2"][str(step)]
    assert full["steps"] == 30 and res["steps"] == 30
    assert res["digest"] == full["digest"]   # model, optimizer, scheduler


def _every_file_is_canonical_or_json(folder) -> None:
    """Every ``.safetensors`` file passes ``tensorcanon verify`` (the command line); every other file is JSON."""
    tensor_files = sorted(str(f) for f in folder.iterdir() if f.suffix == ".safetensors")
    assert tensor_files and tensorcanon_cli(["verify", *tensor_files]) == 0
    for f in folder.iterdir():
        assert not is_pickle_or_zip(f.read_bytes()) and not f.name.endswith((".pt", ".pth", ".bin")), f
        if f.suffix != ".safetensors":
            json.loads(f.read_text())


def test_trainer_checkpoint_holds_no_pickle(runs):
    _, _, out = runs
    folder = out / "crashed" / "checkpoint-15"
    names = sorted(os.listdir(folder))
    for expected in ("model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
                     "rng_state.safetensors", "trainer_state.json", "training_args.json",
                     "training_args.safetensors"):
        assert expected in names
    _every_file_is_canonical_or_json(folder)
    args = tt.load_training_arguments(str(folder))  # the TrainingArguments, without pickle (issue 30)
    assert type(args).__name__ == "TrainingArguments" and args.seed == json.loads(
        (folder / "training_args.json").read_text())["seed"]
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 15
    assert isinstance(tensorcanon.load(folder / "rng_state.safetensors")["rng"], tensorcanon.RngState)


def test_trainer_refuses_to_resume_without_the_random_state(runs, tmp_path):
    _, _, out = runs
    folder = tmp_path / "checkpoint-15"
    shutil.copytree(out / "crashed" / "checkpoint-15", folder)
    (folder / "rng_state.safetensors").unlink()
    trainer = transformers_run.trainer(tmp_path / "run", save=False, crash=False)
    with pytest.raises(tensorcanon.MissingFileError, match="rng_state.safetensors"):
        trainer.train(resume_from_checkpoint=str(folder))  # the stock Trainer logs and goes on


MLM_CASES = [(c, k) for c in transformers_run.MLM_CONFIGS for k in transformers_run.MLM_RESUME_FROM]


@pytest.mark.parametrize("config,step", MLM_CASES, ids=[f"{c}-from{k}" for c, k in MLM_CASES])
def test_trainer_with_a_random_collator_resumes_mid_epoch_bit_identical(runs, config, step):
    # The stock Trainer (and CanonicalTrainer before it seeded the data) fails from steps 4 and 8:
    # the first loss after the resume already differs.
    first, resumed, _ = runs
    full, crashed = first["mlm"][config]["full"], first["mlm"][config]["crashed"]
    res = resumed["mlm"][config][str(step)]
    assert full["steps"] == res["steps"] == 12 and crashed["steps"] == transformers_run.MLM_CRASH_AFTER
    assert len(full["losses"]) == 24  # 2 micro-batches per optimizer step
    # Every micro-batch's loss after the resume point, and the final model, optimizer and scheduler.
    assert res["losses"] == [entry for entry in full["losses"] if entry[0] >= step]
    assert res["digest"] == full["digest"]


def test_trainer_batches_do_not_depend_on_the_workers(runs):
    first, _, _ = runs
    digests = {c: first["mlm"][c]["full"]["digest"] for c in transformers_run.MLM_CONFIGS}
    assert len(set(digests.values())) == 1, digests  # workers 0, 2, persistent; seeded by the user or not


def test_no_checkpoint_of_the_random_collator_runs_holds_a_pickle(runs):
    _, _, out = runs
    folders = sorted((out / "mlm").glob("*/crashed/checkpoint-*"))
    assert len(folders) == 4 * len(transformers_run.MLM_CONFIGS)  # steps 2, 4, 6, 8
    for folder in folders:
        for f in folder.iterdir():
            assert not is_pickle_or_zip(f.read_bytes()) and not f.name.endswith((".pt", ".pth", ".bin")), f


def test_trainer_seeds_the_training_data_where_it_can(tmp_path):
    t = transformers_run.mlm_trainer("w0", tmp_path, save=False, crash=False)
    loader = t.get_train_dataloader()
    sampler = loader.batch_sampler.sampler
    assert isinstance(sampler, tensorcanon.ResumableSampler) and sampler.shuffle and sampler.seed == t.args.seed
    assert isinstance(loader.dataset, tensorcanon.SeededDataset)
    assert isinstance(loader.collate_fn, tensorcanon.SeededCollator)  # outermost: it gets the batch's key
    assert loader.base_dataloader.generator is sampler.generator       # no draw from the global generator
    t.args.train_sampling_strategy = "sequential"
    assert not t.get_train_dataloader().batch_sampler.sampler.shuffle
    t.args.train_sampling_strategy = "group_by_length"                 # the Trainer's own sampler, unseeded
    loader = t.get_train_dataloader()
    assert not isinstance(loader.dataset, tensorcanon.SeededDataset)
    assert not isinstance(loader.collate_fn, tensorcanon.SeededCollator)

    class OwnSampler(transformers_run.Recording):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    own = OwnSampler(model=t.model, args=transformers_run.mlm_trainer("w0", tmp_path, False, False).args,
                     train_dataset=t.train_dataset, data_collator=t.data_collator)
    assert isinstance(own.get_train_dataloader().batch_sampler.sampler, torch.utils.data.SequentialSampler)


# ------------------------------------------------------------------ the model files are tensorcanon files

TIED = {  # models whose output layer is tied to the input embeddings (transformers saves such weights once)
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)),
    "bert-mlm": lambda: BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, intermediate_size=64,
                                                   max_position_embeddings=16)),
}


def _same_model(loaded, model) -> None:
    _same_tensors(dict(loaded.state_dict()), dict(model.state_dict()))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    loaded.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("name", sorted(TIED))
def test_trainer_writes_the_model_as_a_tensorcanon_file_from_pretrained_reads(name, tmp_path):
    torch.manual_seed(0)
    model = TIED[name]()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    tt.CanonicalTrainer(model=model, args=args).save_model(str(tmp_path / "saved"))
    folder = tmp_path / "saved"
    _every_file_is_canonical_or_json(folder)
    _same_model(type(model).from_pretrained(folder), model)
    assert torch.equal(tensorcanon.load(folder / "model.safetensors")[next(iter(model.state_dict()))],
                       next(iter(model.state_dict().values())))


def test_sharded_weights_become_tensorcanon_files_from_pretrained_reads(tmp_path):
    torch.manual_seed(0)
    model = TIED["gpt2"]()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    tt._make_weights_canonical(str(tmp_path))
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and tensorcanon_cli(["verify", *map(str, shards)]) == 0
    _same_model(GPT2LMHeadModel.from_pretrained(tmp_path), model)


def test_weights_with_more_metadata_than_the_format_are_kept_as_written(tmp_path):
    # A quantizer's metadata would be lost in a tensorcanon file: such a file stays plain safetensors.
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(path), metadata={"format": "pt", "quant_method": "x"})
    before = path.read_bytes()
    tt._make_weights_canonical(str(tmp_path))
    assert path.read_bytes() == before


# ------------------------------------------------------------------ CanonicalTrainer under DDP

@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[dict, dict, object]:
    # Two launches of 2 processes (gloo): the runs that never stop and crash, then the resumed runs.
    out = tmp_path_factory.mktemp("transformers_ddp")
    return (*first_and_resume_ranks("transformers_ddp_run.py", out), out)


@pytest.mark.parametrize("step", transformers_run.DDP_RESUME_FROM)
def test_ddp_trainer_with_a_random_collator_resumes_every_rank_bit_identical(ddp_runs, step):
    # Resumed from mid epoch 1, the Trainer's skipping loader did not pass set_epoch on to the sampler
    # (SkipBatchSampler around BatchSamplerShard): both ranks read epoch 0's batches, and the first loss differed.
    first, resumed, out = ddp_runs
    full = {r: first[r]["full"] for r in (0, 1)}
    assert full[0]["losses"] != full[1]["losses"]            # the ranks drew differently
    assert full[0]["digest"] == full[1]["digest"]            # DDP keeps the replicas equal
    folder = out / "crashed" / f"checkpoint-{step}"
    assert tensorcanon.dumps(tensorcanon.load(folder / "rng_state_0.safetensors")["rng"]) != \
        tensorcanon.dumps(tensorcanon.load(folder / "rng_state_1.safetensors")["rng"])
    for rank in (0, 1):
        res = resumed[rank][str(step)]
        assert full[rank]["world_size"] == res["world_size"] == 2
        assert full[rank]["steps"] == res["steps"] == 6 and len(full[rank]["losses"]) == 12
        assert first[rank]["crashed"]["steps"] == transformers_run.DDP_CRASH_AFTER
        # Every micro-batch's loss after the resume point, and the final model, optimizer and scheduler.
        assert res["losses"] == [e for e in full[rank]["losses"] if e[0] >= step], f"rank {rank}"
        assert res["digest"] == full[rank]["digest"], f"rank {rank}"


def test_ddp_checkpoint_holds_tensorcanon_files_and_json_only(ddp_runs):
    _, _, out = ddp_runs
    for step in transformers_run.DDP_RESUME_FROM:
        _every_file_is_canonical_or_json(out / "crashed" / f"checkpoint-{step}")
