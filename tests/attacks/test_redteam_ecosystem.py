"""Red-team attacks on the ecosystem's data objects (docs/FORMAT.md §6.6, §6.9.5; docs/SECURITY.md
"The ecosystem's objects"), written from the documentation alone.

Each hostile file is made by tensorcanon's own writer: a throwaway class is registered, for the
time of one ``dumps``, under the name under attack with a codec whose state is whatever the attack
wants, so the file is well formed and sealed and only the state (or the name) is hostile.

What the documentation promises, checked for every file:

- a failure is a tensorcanon exception naming the path (``$``), never a foreign one;
- a file that verifies loads (§6.6 "Specified states"), in a process that imported the library;
- reading never imports a module the file names, nor any library (``sys.addaudithook`` on
  ``import``), and never opens a file because of the file's content (``open`` events);
- where the library is not imported (a fresh process, one spawn for all files), ``load`` fails
  naming the library to import, and ``verify`` still checks the documented structure of the
  *checked* names (BatchEncoding, PackedSequence, DictConfig/ListConfig, CfgNode).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorcanon
from tensorcanon import TensorCanonError

omegaconf = pytest.importorskip("omegaconf")
yacs_config = pytest.importorskip("yacs.config")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

OD = collections.OrderedDict
SRC = pathlib.Path(tensorcanon.__file__).resolve().parent.parent
LIBS = ("omegaconf", "yacs", "transformers", "tokenizers", "deepspeed", "accelerate", "antlr4")


class _Forged:
    def __init__(self, state):
        self.state = state


def forge(name: str, state) -> bytes:
    """A sealed file whose root is ``["obj", name, <state>]``, written by tensorcanon's writer."""
    from tensorcanon.format import registry

    old = registry.by_name(name)
    tensorcanon.register(_Forged, name=name, encode=lambda o: o.state, decode=_Forged, replace=True)
    try:
        return tensorcanon.dumps(_Forged(state))
    finally:
        tensorcanon.unregister(_Forged)
        if old is not None and registry.by_name(name) is None:  # an explicit registration: put it back
            tensorcanon.register(old.cls, name=old.name, encode=old.encode, decode=old.decode, replace=True)


# ------------------------------------------------------------------ audit: imports and opens

_AUDIT: dict = {"on": False, "events": []}


def _hook(event, args):
    if _AUDIT["on"] and event in ("import", "open"):
        _AUDIT["events"].append((event, str(args[0]) if args else ""))


sys.addaudithook(_hook)  # cannot be removed; it records only while a test turns it on

# the modules the hostile files name: none may be imported by reading them
NAMED = {"transformers.models.bert.modeling_bert", "transformers.trainer", "transformers.training_args_seq2seq",
         "transformers.training_args_tf", "deepspeed", "transformers.integrations.deepspeed", "os", "subprocess"}

PLANTED = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"redeco_planted_{os.getpid()}.json"


def _watched(fn, *args):
    """Run fn(*args) with the audit hook on; return (outcome, value or exception, events)."""
    _AUDIT["events"] = []
    before = {m.split(".")[0] for m in sys.modules}
    named_before = {m for m in NAMED if m in sys.modules}
    _AUDIT["on"] = True
    try:
        try:
            out = ("ok", fn(*args))
        except TensorCanonError as e:
            out = ("error", e)
    finally:
        _AUDIT["on"] = False
    # a package that was not imported before (a library's own lazy submodule, such as OmegaConf's
    # vendored parser, is the library's business; a new package is not)
    new_modules = {m.split(".")[0] for m in sys.modules} - before
    new_modules |= {m for m in NAMED if m in sys.modules and m not in named_before}
    return out, list(_AUDIT["events"]), new_modules


def _assert_clean(events, new_modules):
    opened = [a for e, a in events if e == "open" and "redeco_planted" in a]
    assert not opened, f"the file's content made the reader open {opened}"
    imported = [a for e, a in events if e == "import" and a in NAMED]
    assert not imported, f"reading imported {imported}"
    assert not new_modules, f"reading imported the modules {sorted(new_modules)}"


# ------------------------------------------------------------------ the hostile states

def _deep_odict(n):
    node = OD(x=1)
    for _ in range(n):
        node = OD(x=node)
    return node


def _args(**fields):
    """A valid TrainingArguments state (the documented one), with fields replaced."""
    return dict(_TA_STATE, **fields)


def _ta_state():
    args = transformers.TrainingArguments(output_dir="out", report_to="none")
    captured = {}
    # the documented state: the __init__ fields but *_token, Enum members as values
    import dataclasses
    import enum

    for f in dataclasses.fields(args):
        if not f.init or f.name.endswith("_token"):
            continue
        v = getattr(args, f.name)
        if isinstance(v, enum.Enum):
            v = v.value
        if dataclasses.is_dataclass(v):
            v = dataclasses.asdict(v)
        captured[f.name] = v
    return captured


_TA_STATE = _ta_state()


def _encoding_json():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    enc = tok.encode("a b")
    return json.loads(enc.__getstate__())


# (id, name, state factory, expected in a process with the library):
#   "reject": load and verify reject it (the documented structure of a *checked* name, §6.9.5);
#   "load_rejects": load rejects it; verify may pass it (an unchecked name, or the library's own
#       check, which §6.9.5 leaves to a reader that builds the value; §6.6 lets a verifying reader
#       that builds no objects pass a name it does not know);
#   "load": both accept it; "either": any outcome, as long as the rules above hold.
CASES = [
    # OmegaConf
    ("dictconfig_state_int", "omegaconf.DictConfig", lambda: 1, "reject"),
    ("dictconfig_missing_flags", "omegaconf.DictConfig", lambda: {"content": OD()}, "reject"),
    ("dictconfig_extra_key", "omegaconf.DictConfig", lambda: {"content": OD(), "flags": [], "x": 1}, "reject"),
    ("dictconfig_content_int", "omegaconf.DictConfig", lambda: {"content": 1, "flags": []}, "reject"),
    ("dictconfig_content_plain_dict", "omegaconf.DictConfig", lambda: {"content": {"a": 1}, "flags": []}, "reject"),
    ("dictconfig_content_list", "omegaconf.DictConfig", lambda: {"content": [1], "flags": []}, "reject"),
    ("listconfig_content_odict", "omegaconf.ListConfig", lambda: {"content": OD(a=1), "flags": []}, "reject"),
    ("dictconfig_flags_not_list", "omegaconf.DictConfig", lambda: {"content": OD(), "flags": 7}, "reject"),
    ("dictconfig_flags_path_missing", "omegaconf.DictConfig",
     lambda: {"content": OD(a=1), "flags": [[["nope", "deeper"], {"readonly": True}]]}, "reject"),
    ("dictconfig_flags_item_shape", "omegaconf.DictConfig",
     lambda: {"content": OD(a=1), "flags": [["a"]]}, "reject"),
    ("dictconfig_flag_value_str", "omegaconf.DictConfig",
     lambda: {"content": OD(a=1), "flags": [[[], {"readonly": "yes"}]]}, "reject"),
    ("dictconfig_flag_name_not_str", "omegaconf.DictConfig",
     lambda: {"content": OD(a=1), "flags": [[[], {1: True}]]}, "reject"),
    ("dictconfig_key_bytes", "omegaconf.DictConfig", lambda: {"content": OD([(b"k", 1)]), "flags": []}, "either"),
    ("dictconfig_value_tensor", "omegaconf.DictConfig",
     lambda: {"content": OD(t=torch.zeros(2)), "flags": []}, "load_rejects"),
    ("dictconfig_value_set", "omegaconf.DictConfig", lambda: {"content": OD(s={1, 2}), "flags": []}, "load_rejects"),
    ("dictconfig_deep", "omegaconf.DictConfig", lambda: {"content": _deep_odict(240), "flags": []}, "load_rejects"),
    ("dictconfig_env_interpolation", "omegaconf.DictConfig",
     lambda: {"content": OD(secret="${oc.env:REDECO_SECRET}"), "flags": []}, "load"),
    ("dictconfig_spy_resolver", "omegaconf.DictConfig",
     lambda: {"content": OD(a="${redeco_spy:1}", b=OD(c="${redeco_spy:2}")), "flags": []}, "load"),
    ("dictconfig_bad_interpolation_grammar", "omegaconf.DictConfig",
     lambda: {"content": OD(a="${"), "flags": []}, "load_rejects"),
    ("dictconfig_missing_value", "omegaconf.DictConfig", lambda: {"content": OD(a="???"), "flags": []}, "load"),
    ("listconfig_ok_readonly", "omegaconf.ListConfig",
     lambda: {"content": [1, "${0}"], "flags": [[[], {"readonly": True}]]}, "load"),
    ("dictconfig_nested_plain_dict", "omegaconf.DictConfig",
     lambda: {"content": OD(a={"b": 1}), "flags": []}, "reject"),
    ("listconfig_nested_plain_dict", "omegaconf.ListConfig",
     lambda: {"content": [[{"b": 1}]], "flags": []}, "reject"),
    ("listconfig_flags_index_out_of_range", "omegaconf.ListConfig",
     lambda: {"content": [1], "flags": [[[1], {"readonly": True}]]}, "reject"),
    ("listconfig_flags_index_str", "omegaconf.ListConfig",
     lambda: {"content": [1], "flags": [[["0"], {"readonly": True}]]}, "reject"),
    ("dictconfig_flags_through_a_leaf", "omegaconf.DictConfig",
     lambda: {"content": OD(a="${b}", b=OD(c=1)), "flags": [[["a", "c"], {"readonly": True}]]}, "reject"),
    ("dictconfig_real_with_flags", "omegaconf.DictConfig", lambda: _real(_flagged_config()), "load"),
    ("listconfig_real_with_flags", "omegaconf.ListConfig",
     lambda: _real(_flagged_config().lst), "load"),
    # yacs
    ("cfgnode_state_list", "yacs.CfgNode", lambda: [1], "reject"),
    ("cfgnode_item_int_key", "yacs.CfgNode",
     lambda: {"items": {1: 2}, "immutable": False, "new_allowed": False, "deprecated_keys": [],
              "renamed_keys": {}}, "reject"),
    ("cfgnode_immutable_int", "yacs.CfgNode",
     lambda: {"items": {}, "immutable": 1, "new_allowed": False, "deprecated_keys": [], "renamed_keys": {}},
     "reject"),
    ("cfgnode_deprecated_unsorted", "yacs.CfgNode",
     lambda: {"items": {}, "immutable": False, "new_allowed": False, "deprecated_keys": ["b", "a"],
              "renamed_keys": {}}, "reject"),
    ("cfgnode_deprecated_repeat", "yacs.CfgNode",
     lambda: {"items": {}, "immutable": False, "new_allowed": False, "deprecated_keys": ["a", "a"],
              "renamed_keys": {}}, "reject"),
    ("cfgnode_deprecated_not_str", "yacs.CfgNode",
     lambda: {"items": {}, "immutable": False, "new_allowed": False, "deprecated_keys": [1],
              "renamed_keys": {}}, "reject"),
    ("cfgnode_renamed_int_key", "yacs.CfgNode",
     lambda: {"items": {}, "immutable": False, "new_allowed": False, "deprecated_keys": [],
              "renamed_keys": {1: "x"}}, "reject"),
    ("cfgnode_missing_key", "yacs.CfgNode",
     lambda: {"items": {}, "immutable": False, "new_allowed": False, "deprecated_keys": []}, "reject"),
    ("cfgnode_value_tensor", "yacs.CfgNode",
     lambda: {"items": {"t": torch.zeros(1)}, "immutable": False, "new_allowed": False,
              "deprecated_keys": [], "renamed_keys": {}}, "either"),
    ("cfgnode_value_set", "yacs.CfgNode",
     lambda: {"items": {"t": {1}}, "immutable": False, "new_allowed": False,
              "deprecated_keys": [], "renamed_keys": {}}, "either"),
    ("cfgnode_item_plain_dict", "yacs.CfgNode",
     lambda: {"items": {"sub": {"a": 1}}, "immutable": False, "new_allowed": False,
              "deprecated_keys": [], "renamed_keys": {}}, "either"),
    ("cfgnode_dunder_keys", "yacs.CfgNode",
     lambda: {"items": {"__immutable__": True, "__class__": 1}, "immutable": False, "new_allowed": False,
              "deprecated_keys": [], "renamed_keys": {}}, "either"),
    # BatchEncoding
    ("batch_state_int", "transformers.BatchEncoding", lambda: 3, "reject"),
    ("batch_data_int_key", "transformers.BatchEncoding",
     lambda: {"data": {1: [1]}, "encodings": None, "n_sequences": None}, "reject"),
    ("batch_data_not_dict", "transformers.BatchEncoding",
     lambda: {"data": [1], "encodings": None, "n_sequences": None}, "reject"),
    ("batch_encodings_not_list", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": {"a": 1}, "n_sequences": None}, "reject"),
    ("batch_encodings_item_int", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": [1], "n_sequences": None}, "reject"),
    ("batch_encodings_wrong_fields", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": [{"ids": "not a list"}], "n_sequences": None}, "load_rejects"),
    ("batch_encodings_item_int_key", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": [{1: 2}], "n_sequences": None}, "load_rejects"),
    ("batch_encodings_item_tensor", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": [{"ids": torch.zeros(2)}], "n_sequences": None}, "load_rejects"),
    ("batch_encodings_huge_ids", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": [dict(_encoding_json(), ids=[2**70])], "n_sequences": None}, "load_rejects"),
    ("batch_encodings_deep_overflowing", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": [_deep_overflowing(100)], "n_sequences": None}, "either"),
    ("batch_n_sequences_negative", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": None, "n_sequences": -1}, "reject"),
    ("batch_n_sequences_bool", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": None, "n_sequences": True}, "reject"),
    ("batch_n_sequences_float", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": None, "n_sequences": 1.0}, "reject"),
    ("batch_extra_key", "transformers.BatchEncoding",
     lambda: {"data": {}, "encodings": None, "n_sequences": None, "x": 1}, "reject"),
    ("batch_valid_encoding", "transformers.BatchEncoding",
     lambda: {"data": {"input_ids": [[0, 1]]}, "encodings": [_encoding_json()], "n_sequences": 1}, "load"),
    # PackedSequence
    ("packed_state_dict", "torch.nn.utils.rnn.PackedSequence", lambda: {"data": 1}, "reject"),
    ("packed_three_items", "torch.nn.utils.rnn.PackedSequence",
     lambda: [torch.zeros(2), torch.tensor([2]), None], "reject"),
    ("packed_data_int", "torch.nn.utils.rnn.PackedSequence", lambda: [1, torch.tensor([1]), None, None], "reject"),
    ("packed_batch_sizes_str", "torch.nn.utils.rnn.PackedSequence",
     lambda: [torch.zeros(2), "x", None, None], "reject"),
    ("packed_indices_list", "torch.nn.utils.rnn.PackedSequence",
     lambda: [torch.zeros(2), torch.tensor([2]), [0], None], "reject"),
    ("packed_real", "torch.nn.utils.rnn.PackedSequence",
     lambda: _real(torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])), "load"),
    ("packed_real_sparse_data", "torch.nn.utils.rnn.PackedSequence",
     lambda: [torch.zeros(3).to_sparse(), torch.tensor([1, 1, 1]), None, None], "load"),
    # TrainingArguments: fields whose constructor reads files or imports packages
    ("args_deepspeed_path", "transformers.TrainingArguments", lambda: _args(deepspeed=str(PLANTED)), "load_rejects"),
    ("args_deepspeed_dict", "transformers.TrainingArguments",
     lambda: _args(deepspeed={"train_batch_size": 1}), "load_rejects"),
    ("args_deepspeed_json", "transformers.TrainingArguments",
     lambda: _args(deepspeed='{"train_batch_size": 1}'), "load_rejects"),
    ("args_accelerator_config_path", "transformers.TrainingArguments",
     lambda: _args(accelerator_config=str(PLANTED)), "load_rejects"),
    ("args_fsdp_config_path", "transformers.TrainingArguments",
     lambda: _args(fsdp="full_shard", fsdp_config=str(PLANTED)), "load_rejects"),
    ("args_fsdp_config_path_fsdp_off", "transformers.TrainingArguments",
     lambda: _args(fsdp_config=str(PLANTED)), "load_rejects"),
    ("args_lr_scheduler_kwargs_path", "transformers.TrainingArguments",
     lambda: _args(lr_scheduler_kwargs=str(PLANTED)), "load_rejects"),
    ("args_fsdp_config_deep_json", "transformers.TrainingArguments",
     lambda: _args(fsdp_config="{" + '"a":[' * 100000), "load_rejects"),
    ("args_fsdp_xla_dtype_names", "transformers.TrainingArguments",
     lambda: _args(fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_settings": {"compute_dtype": "save"}}),
     "load_rejects"),
    ("args_fsdp_xla_dtype_names_json", "transformers.TrainingArguments",
     lambda: _args(fsdp="full_shard",
                   fsdp_config='{"fsdp_xla": true, "fsdp_xla_fsdp_settings": {"buffer_dtype": "_inductor"}}'),
     "load_rejects"),
    ("args_fsdp_sets_environment", "transformers.TrainingArguments",
     lambda: _args(fsdp="full_shard", fsdp_config={"cpu_ram_efficient_loading": "true"}), "either"),
    ("args_unknown_field", "transformers.TrainingArguments", lambda: _args(redeco_field=1), "load_rejects"),
    ("args_state_list", "transformers.TrainingArguments", lambda: [1], "load_rejects"),
    ("args_token_field", "transformers.TrainingArguments", lambda: _args(hub_token="stolen"), "load_rejects"),
    ("args_fp16_on_cpu", "transformers.TrainingArguments", lambda: _args(fp16=True), "either"),
    ("args_bad_enum", "transformers.TrainingArguments", lambda: _args(save_strategy="sometimes"), "load_rejects"),
    ("args_report_to_all", "transformers.TrainingArguments", lambda: _args(report_to="all"), "either"),
    # names
    ("name_matches_no_class", "transformers.RedecoNoSuchArguments", lambda: {"a": 1}, "load_rejects"),
    ("name_lazy_seq2seq_args", "transformers.Seq2SeqTrainingArguments", lambda: _args(), "either"),
    ("name_lazy_trainer", "transformers.Trainer", lambda: {"a": 1}, "load_rejects"),
    ("name_tf_args", "transformers.TFTrainingArguments", lambda: {"a": 1}, "load_rejects"),
    ("name_unimported_model_output", "transformers.models.bert.modeling_bert.BertForPreTrainingOutput",
     lambda: {"loss": None}, "load_rejects"),
    ("name_os_system", "os.system", lambda: {"command": "true"}, "load_rejects"),
    ("name_model_output_base", "transformers.utils.generic.ModelOutput", lambda: {"a": 1}, "load_rejects"),
    ("model_output_unknown_field", "transformers.modeling_outputs.BaseModelOutput",
     lambda: {"redeco": 1}, "load_rejects"),
    ("model_output_state_list", "transformers.modeling_outputs.BaseModelOutput", lambda: [1], "load_rejects"),
    ("model_output_key_int", "transformers.modeling_outputs.BaseModelOutput", lambda: {1: 1}, "load_rejects"),
]

CHECKED = ("omegaconf.", "yacs.", "transformers.BatchEncoding", "torch.nn.utils.rnn.PackedSequence")


def _real(value):
    """The state the library's own codec writes for a real value."""
    from tensorcanon.format import registry

    return registry.by_type(type(value)).encode(value)


def _flagged_config():
    cfg = omegaconf.OmegaConf.create({"a": {"b": 1, "c": [1, {"d": 2}]}, "lst": [0, [1, 2]], "i": "${a.b}"})
    omegaconf.OmegaConf.set_readonly(cfg.a.c, True)
    omegaconf.OmegaConf.set_struct(cfg.a, True)
    omegaconf.OmegaConf.set_readonly(cfg.lst[1], True)
    return cfg


def _deep_overflowing(n):
    enc = _encoding_json()
    node = dict(enc)
    for _ in range(n):
        node = dict(enc, overflowing=[node])
    return node


@pytest.fixture(scope="module")
def files():
    import transformers.modeling_outputs  # noqa: F401 (the ModelOutput names under attack are defined)

    PLANTED.write_text('{"train_batch_size": 1, "split_batches": true}')
    built = {}
    for case_id, name, make, expect in CASES:
        built[case_id] = (name, forge(name, make()), expect)
    yield built
    PLANTED.unlink(missing_ok=True)


@pytest.fixture
def spy_resolver():
    calls = []
    omegaconf.OmegaConf.register_new_resolver("redeco_spy", lambda x: calls.append(x) or x, replace=True)
    yield calls
    omegaconf.OmegaConf.clear_resolver("redeco_spy")


def _must_name_path(exc):
    assert "$" in str(exc), f"the error does not name the path: {exc}"


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_with_the_libraries_imported(case_id, files, spy_resolver, monkeypatch):
    monkeypatch.setenv("REDECO_SECRET", "s3cret")
    name, data, expect = files[case_id]
    (loaded, loaded_v), events, new = _watched(tensorcanon.loads, data)
    _assert_clean(events, new)
    (verified, verified_v), events, new = _watched(tensorcanon.verify, data)
    _assert_clean(events, new)
    if loaded == "error":
        _must_name_path(loaded_v)
    if verified == "error":
        _must_name_path(verified_v)
    if expect in ("reject", "load_rejects"):
        assert loaded == "error", f"{name} loaded from a hostile state: {loaded_v!r}"
    if expect == "reject":  # a file that verifies loads (§6.6, §6.9.5 "checked")
        assert verified == "error", f"verify passed a state that loading rejects: {loaded_v}"
    elif expect == "load":
        assert loaded == "ok", loaded_v
        assert verified == "ok", verified_v
    assert not spy_resolver, "an interpolation was resolved while reading the file"


def test_loading_training_arguments_leaves_the_environment_as_it_was(files, monkeypatch):
    """TrainingArguments(fsdp=..., fsdp_config=...) sets FSDP_CPU_RAM_EFFICIENT_LOADING from the config:
    a file must not change the loading process's environment (it steers later model loading)."""
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    before = dict(os.environ)
    args = tensorcanon.loads(files["args_fsdp_sets_environment"][1])
    assert args.fsdp_config["cpu_ram_efficient_loading"] == "true"
    assert dict(os.environ) == before


def test_training_arguments_naming_xla_dtypes_are_refused_when_saving(files):
    """The writer refuses what the reader refuses (the dtype names would be looked up on torch)."""
    cfg = {"xla": True, "xla_fsdp_settings": {"compute_dtype": "bfloat16"}}
    args = transformers.TrainingArguments(output_dir="out", report_to="none", fsdp="full_shard", fsdp_config=cfg)
    with pytest.raises(tensorcanon.UnsupportedTypeError, match="xla_fsdp_settings"):
        tensorcanon.dumps(args)


def test_interpolations_resolve_only_on_access(files, spy_resolver, monkeypatch):
    """Documented: interpolations stay text until the program reads the value."""
    monkeypatch.setenv("REDECO_SECRET", "s3cret")
    cfg = tensorcanon.loads(files["dictconfig_env_interpolation"][1])
    assert omegaconf.OmegaConf.to_container(cfg, resolve=False) == {"secret": "${oc.env:REDECO_SECRET}"}
    assert cfg.secret == "s3cret"  # the documented behaviour on access
    cfg = tensorcanon.loads(files["dictconfig_spy_resolver"][1])
    assert spy_resolver == []
    assert cfg.b.c == 2 and spy_resolver == [2]


# ------------------------------------------------------------------ without the libraries

_CHILD = textwrap.dedent(r"""
    import json, sys
    events = []
    def hook(event, args):
        if event in ("import", "open"):
            events.append((event, str(args[0]) if args else ""))
    import tensorcanon
    sys.addaudithook(hook)
    out = {}
    for path in sys.argv[2:]:
        data = open(path, "rb").read()
        events.clear()
        row = {}
        for fn in ("loads", "verify"):
            try:
                getattr(tensorcanon, fn)(data)
                row[fn] = ["ok", ""]
            except tensorcanon.TensorCanonError as e:
                row[fn] = ["error", str(e)]
            except BaseException as e:
                row[fn] = ["foreign", type(e).__name__ + ": " + str(e)[:300]]
        row["events"] = [e for e in events if (e[0] == "open" and "redeco_planted" in e[1])
                         or (e[0] == "import" and e[1].split(".")[0] in sys.argv[1].split(","))]
        out[path.rsplit("/", 1)[-1]] = row
    row = {"modules": sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[1].split(","))}
    out["__modules__"] = row
    print("@@" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def fresh(files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("redeco")
    paths = []
    for case_id, (_, data, _) in files.items():
        p = folder / case_id
        p.write_bytes(data)
        paths.append(str(p))
    env = dict(os.environ, PYTHONPATH=str(SRC), REDECO_SECRET="s3cret")
    proc = subprocess.run([sys.executable, "-c", _CHILD, ",".join(LIBS), *paths], capture_output=True,
                          text=True, env=env, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert line, proc.stderr[-3000:]
    return json.loads(line[0][2:])


def test_no_library_is_imported_in_a_fresh_process(fresh):
    assert fresh["__modules__"]["modules"] == []


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_without_the_libraries_in_a_fresh_process(case_id, fresh, files):
    name, _, expect = files[case_id]
    row = fresh[case_id]
    assert row["events"] == [], row["events"]
    for fn in ("loads", "verify"):
        assert row[fn][0] != "foreign", f"{fn}: {row[fn][1]}"
        if row[fn][0] == "error":
            assert "$" in row[fn][1], row[fn][1]
    if name.startswith(("torch.",)):  # torch is imported by the loader itself: same as above
        if expect == "reject":
            assert row["loads"][0] == "error"
    else:
        assert row["loads"][0] == "error", "loaded without the library"
    checked = name.startswith(CHECKED)
    if checked and expect == "reject":  # the documented structure, checked without the library
        assert row["verify"][0] == "error", "verify without the library passed a state the docs forbid"
    if expect == "load":  # and no false alarm: what loads where the library is imported verifies here
        assert row["verify"][0] == "ok", row["verify"][1]
    if name in ("omegaconf.DictConfig", "yacs.CfgNode", "transformers.BatchEncoding") and row["loads"][0] == "error":
        lib = name.split(".")[0]
        assert f"import {lib}" in row["loads"][1], row["loads"][1]

