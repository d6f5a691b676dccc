"""The ecosystem's own data objects go through without ceremony (issue 40; docs/FORMAT.md §6.9.5).

Objects that training code hands to ``torch.save`` and that the user did not write: the Trainer's
``TrainingArguments``, ``ModelOutput`` subclasses, ``BatchEncoding`` (with a fast tokenizer's
encodings), torch's ``PackedSequence``, OmegaConf and yacs configs. Each round-trips exactly with no
``register`` call, in this process and in a fresh one that imports the library; a fresh process that
does not import it refuses with one line naming the library, and imports nothing a file names (an
audit hook watches). torchao's tensor subclasses: tests/test_ecosystem_torchao.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorcanon as tc
from tensorcanon.format import ecosystem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tokenizer():
    """A fast tokenizer built here (no hub): a word-level vocabulary, pairs, padding and truncation."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5, "again": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def objects() -> dict:
    """One of each object, as training code makes them (tensors shared where a checkpoint shares them)."""
    from omegaconf import OmegaConf
    from torch.nn.utils.rnn import pack_padded_sequence
    from transformers import Seq2SeqTrainingArguments, TrainingArguments
    from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutput
    from yacs.config import CfgNode

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, generator=gen)
    cfg = OmegaConf.create({"lr": 1e-3, "warmup": "${lr}", "data": {"root": "???", "sizes": [32, 64]},
                            "opt": {"name": "adamw", "betas": [0.9, 0.999]}})
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_readonly(cfg.data, True)
    node = CfgNode({"MODEL": {"DEPTH": 50}, "SOLVER": {"LR": 0.1, "STEPS": (10, 20)}}, new_allowed=True)
    node.register_renamed_key("SOLVER.OLD_LR", "SOLVER.LR", message="use SOLVER.LR")
    node.freeze()
    return {
        "training_args": TrainingArguments(output_dir="out", learning_rate=3e-4, num_train_epochs=2,
                                           lr_scheduler_type="cosine", report_to="none", seed=7),
        "seq2seq_args": Seq2SeqTrainingArguments(output_dir="out2", predict_with_generate=True, report_to="none"),
        "classifier_output": SequenceClassifierOutput(loss=torch.tensor(0.5), logits=logits),
        "lm_output": CausalLMOutputWithPast(logits=logits),  # the same tensor: a tie
        "batch": _tokenizer()(["hello world", "world"], ["again", "hello again world"], padding=True,
                              return_tensors="pt"),
        "packed": pack_padded_sequence(torch.randn(3, 4, 2, generator=gen), torch.tensor([2, 4, 1]),
                                       batch_first=True, enforce_sorted=False),
        "omegaconf": cfg,
        "listconfig": OmegaConf.create([1, "${0}", {"k": None}]),
        "yacs": node,
    }


def _check_same(a, b, path="$"):
    """Type, fields and tensors bit-exact, and the flags each library keeps."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from transformers import BatchEncoding, TrainingArguments
    from yacs.config import CfgNode

    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), path
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist(), path
    elif isinstance(a, TrainingArguments):
        fields = [f.name for f in dataclasses.fields(a) if f.init and not f.name.endswith("_token")]
        for f in fields:
            assert getattr(a, f) == getattr(b, f), f"{path}.{f}"
    elif isinstance(a, BatchEncoding):
        _check_same(dict(a), dict(b), f"{path}.data")
        assert a._n_sequences == b._n_sequences, path
        assert (a.encodings is None) == (b.encodings is None), path
        for i, (x, y) in enumerate(zip(a.encodings or (), b.encodings or (), strict=True)):
            for attr in ("ids", "type_ids", "tokens", "offsets", "attention_mask", "special_tokens_mask",
                         "word_ids", "sequence_ids", "n_sequences"):
                assert getattr(x, attr) == getattr(y, attr), f"{path}.encodings[{i}].{attr}"
        assert a.word_ids(1) == b.word_ids(1) and a.sequence_ids(0) == b.sequence_ids(0), path
    elif isinstance(a, (DictConfig, ListConfig)):
        assert OmegaConf.to_container(a, resolve=False) == OmegaConf.to_container(b, resolve=False), path
        for flag in ("readonly", "struct"):
            for x, y in zip(ecosystem._omegaconf_nodes(a, [], sys.modules["omegaconf"]),
                            ecosystem._omegaconf_nodes(b, [], sys.modules["omegaconf"]), strict=True):
                assert x[0] == y[0] and x[1]._get_flag(flag) == y[1]._get_flag(flag), f"{path}{x[0]}: {flag}"
        if isinstance(a, DictConfig) and "warmup" in a:
            assert b.warmup == a.warmup  # the interpolation still resolves
    elif isinstance(a, CfgNode):
        assert a.is_frozen() == b.is_frozen() and a.is_new_allowed() == b.is_new_allowed(), path
        assert vars(a) == vars(b), path
        assert sorted(a) == sorted(b), path
        for k in a:
            _check_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, tuple) and hasattr(a, "_fields"):
        for f in a._fields:
            _check_same(getattr(a, f), getattr(b, f), f"{path}.{f}")
    elif isinstance(a, dict):  # a plain dict loads in canonical key order (README, "What comes back")
        order = sorted if type(a) is dict else list
        assert order(a) == order(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            _check_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _check_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", sorted(objects()))
def test_each_object_round_trips_with_no_register_call(name):
    value = objects()[name]
    back = tc.loads(tc.dumps({"v": value}))["v"]
    _check_same(value, back)


def test_ties_between_ecosystem_objects_and_tensors_are_kept():
    objs = objects()
    back = tc.loads(tc.dumps({"a": objs["classifier_output"], "b": objs["lm_output"],
                              "sd": {"logits": objs["lm_output"].logits}}))
    assert back["a"].logits is back["b"].logits is back["sd"]["logits"]


def test_encodings_are_written_in_one_canonical_order():
    """A pair's encoding holds a map (sequence ranges) that tokenizers serializes in the order of a
    Rust hash map; the state is the parsed object, so its keys are written in canonical order: the
    bytes do not depend on that order (the fresh processes below check the same across processes)."""
    batch = objects()["batch"]
    state = json.loads(batch._encodings[0].__getstate__())
    assert len(state["sequence_ranges"]) == 2
    reordered = dict(reversed(list(state["sequence_ranges"].items())))
    assert list(reordered) != list(state["sequence_ranges"])
    a = tc.dumps({"e": state})
    b = tc.dumps({"e": {**state, "sequence_ranges": reordered}})
    assert a == b


def test_values_that_would_not_come_back_are_refused_by_path():
    from omegaconf import OmegaConf
    from transformers.modeling_outputs import SequenceClassifierOutput

    @dataclasses.dataclass
    class Structured:
        lr: float = 0.1

    out = SequenceClassifierOutput(logits=torch.ones(1))
    out.extra = 1
    for value, words in ((OmegaConf.structured(Structured), "structured config"),
                         (out, "other than its fields")):
        with pytest.raises(tc.UnsupportedTypeError, match=words) as info:
            tc.dumps({"run": [value]})
        assert '$["run"][0]' in str(info.value)


def test_a_subclass_of_training_arguments_is_saved_as_itself():
    from transformers import TrainingArguments

    @dataclasses.dataclass
    class MyArgs(TrainingArguments):
        my_flag: bool = False

    args = MyArgs(output_dir="x", my_flag=True, report_to="none")
    back = tc.loads(tc.dumps(args))
    assert type(back) is MyArgs and back.my_flag is True


def test_states_that_break_the_spec_are_refused_by_verify_without_the_libraries():
    """verify builds no objects: it checks each specified state's structure (§6.9.5), library or not."""
    from tensorcanon.format import registry

    good = tc.dumps(objects()["yacs"])
    assert tc.verify(good)
    for name, state in ((ecosystem.CFG_NODE, {"items": {}, "immutable": 1, "new_allowed": False,
                                              "deprecated_keys": [], "renamed_keys": {}}),
                        (ecosystem.PACKED_SEQUENCE, [1, 2, 3]),
                        (ecosystem.DICT_CONFIG, {"content": {}, "flags": [["x", {}]]}),
                        (ecosystem.BATCH_ENCODING, {"data": {1: 2}, "encodings": None, "n_sequences": None})):
        with pytest.raises(ValueError):
            registry.specified(name)(state)


def test_the_module_advice_works_as_written():
    """Saving a whole nn.Module is refused; the advice (save its state_dict(), rebuild the module in
    code, load_state_dict()) gives back the same model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with pytest.raises(tc.UnsupportedTypeError) as info:
        tc.dumps({"model": model})
    message = str(info.value)
    assert "save its state_dict() instead" in message and "load_state_dict()" in message
    # as written: model.state_dict(), then a freshly built module, then load_state_dict()
    data = tc.dumps({"model": model.state_dict()})
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh.load_state_dict(tc.loads(data)["model"])
    x = torch.randn(5, 4)
    assert torch.equal(fresh(x), model(x))


def test_the_lazy_parameter_advice_works_as_written():
    lazy = torch.nn.LazyLinear(3)
    with pytest.raises(tc.UnsupportedTypeError, match="run one forward pass") as info:
        tc.dumps(lazy.state_dict())
    assert "initialize_parameters" in str(info.value)
    lazy(torch.randn(2, 5))  # as the advice says
    back = tc.loads(tc.dumps(lazy.state_dict()))
    assert torch.equal(back["weight"], lazy.weight)


# ------------------------------------------------------------------ fresh processes

_CHILD = textwrap.dedent('''
    import json, sys
    IMPORTED = []
    LIBS = ("transformers", "omegaconf", "yacs", "tokenizers", "torchao")
    mode, folder = sys.argv[1], sys.argv[2]
    import torch, tensorcanon as tc
    if mode == "with":
        import omegaconf, transformers, yacs.config  # the program's own imports
        import test_ecosystem as t
        out = {}
        for name in sorted(t.objects()):
            path = f"{folder}/{name}.safetensors"
            t._check_same(t.objects()[name], tc.load(path)["v"])
            out[name] = tc.dumps({"v": t.objects()[name]}) == open(path, "rb").read()
        print(json.dumps(out))
    else:
        sys.addaudithook(lambda event, args: event == "import" and args[0].split(".")[0] in LIBS
                         and IMPORTED.append(args[0]))
        out = {}
        import os
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            assert tc.verify(path)  # verify needs none of the libraries
            try:
                tc.load(path)
                out[entry] = "loaded"
            except tc.UnsupportedTypeError as e:
                out[entry] = str(e)
        print(json.dumps({"imported": IMPORTED, "errors": out}))
''')


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ecosystem")
    for name, value in objects().items():
        tc.save({"v": value}, folder / f"{name}.safetensors")
    return folder


def _child(mode: str, folder) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"),
                                                         os.environ.get("PYTHONPATH", "")]),
           "PYTHONHASHSEED": "random"}
    done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(folder)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_object_loads_in_a_fresh_process_that_imports_its_library(saved):
    same_bytes = _child("with", saved)
    assert sorted(same_bytes) == sorted(objects())
    assert all(same_bytes.values()), f"another process wrote other bytes: {same_bytes}"


def test_a_fresh_process_without_the_library_says_which_to_import(saved):
    got = _child("without", saved)
    assert got["imported"] == [], f"loading imported {got['imported']}"
    libraries = {"training_args": "transformers", "seq2seq_args": "transformers",
                 "classifier_output": "transformers", "lm_output": "transformers", "batch": "transformers",
                 "omegaconf": "omegaconf", "listconfig": "omegaconf", "yacs": "yacs"}
    for name, library in libraries.items():
        message = got["errors"][f"{name}.safetensors"]
        assert "\n" not in message and f"import {library} before loading it" in message, message
    assert got["errors"]["packed.safetensors"] == "loaded"  # torch is imported by every tensor load


def test_training_arguments_that_would_read_a_file_or_import_deepspeed_are_refused_both_ways(tmp_path):
    """TrainingArguments' constructor reads a file named by accelerator_config or fsdp_config, and imports
    deepspeed when deepspeed is set: a file must not make the loader do either (docs/SECURITY.md)."""
    from transformers import TrainingArguments

    config = tmp_path / "accelerator.json"
    config.write_text('{"split_batches": true}')
    args = TrainingArguments(output_dir="o", report_to="none", accelerator_config=str(config))
    good = tc.dumps({"args": args})  # the config the constructor read, as a dict: no file name is saved
    config.unlink()
    from tensorcanon.format import registry

    decode = registry.by_name("transformers.TrainingArguments").decode
    for field, value in (("accelerator_config", str(config)), ("fsdp_config", "/etc/passwd"),
                         ("deepspeed", {"zero_optimization": {"stage": 2}}), ("deepspeed", "/etc/passwd")):
        with pytest.raises(ValueError, match="building it would"):
            decode({"output_dir": "o", field: value})
    back = tc.loads(good)["args"]
    assert type(back) is TrainingArguments and back.accelerator_config.split_batches is True
