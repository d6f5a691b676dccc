"""tensorcanon with the real transformers (tiny models built from configs; nothing is downloaded).

- save_pretrained files are read by tensorcanon.load bit for bit, and a
  tensorcanon file of a plain dict[str, Tensor] named model.safetensors is read
  by from_pretrained bit for bit (GPT-2, BERT, Llama);
- CanonicalTrainer's checkpoints hold no pickle, and a Trainer run resumed from
  one in a fresh process (torch.load and pickle patched to raise) ends with the
  digest of a run that never stopped.
"""

from __future__ import annotations

# First: importing integration_support sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE, which the
# Hugging Face libraries read when they are first imported. restore_determinism_settings is an
# autouse fixture: importing it is what applies it.
from integration_support import first_and_resume, is_pickle_or_zip, restore_determinism_settings  # noqa: F401 (a fixture)

# isort: split

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModel, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tensorcanon

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
    out = tmp_path_factory.mktemp("transformers")
    first, resume = first_and_resume("transformers_run.py", out)
    return first, resume, out


@pytest.mark.parametrize("step", transformers_run.RESUME_FROM)
def test_trainer_resumed_in_a_fresh_process_is_bit_identical(runs, step):
    first, resumed, _ = runs
    assert first["steps"] == 30 and resumed[str(step)]["steps"] == 30
    assert resumed[str(step)]["digest"] == first["digest"]   # model, optimizer, scheduler


def test_trainer_checkpoint_holds_no_pickle(runs):
    _, _, out = runs
    folder = out / "crashed" / "checkpoint-15"
    names = sorted(os.listdir(folder))
    for expected in ("model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
                     "rng_state.safetensors", "trainer_state.json", "training_args.json"):
        assert expected in names
    for name in names:
        assert not is_pickle_or_zip((folder / name).read_bytes()), name
        assert not name.endswith((".pt", ".pth", ".bin")), name
    for name in ("optimizer.safetensors", "scheduler.safetensors", "rng_state.safetensors"):
        tensorcanon.verify(folder / name)
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
