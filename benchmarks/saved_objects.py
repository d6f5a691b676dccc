"""What training code saves: which objects round-trip through tensorcanon, which are refused and why,
and what torch.save / torch.load do with the same object (issue 40, item 4).

    python benchmarks/saved_objects.py            # the Markdown table README.md shows

Each row is made here, in code (no hub, no files from elsewhere), then:

- tensorcanon: ``loads(dumps(obj))`` in this process, with no ``register`` call; "round-trips" when the
  value that comes back has the same type and the same digest (``fingerprint``: every tensor's bytes,
  every field), else "refused" with the first clause of tensorcanon's own error;
- torch: ``torch.save`` to memory, then ``torch.load`` with its default (``weights_only=True`` since
  torch 2.6): "loads" when that gives the value back, "needs weights_only=False (pickle)" when the
  default loader refuses it (``weights_only=False`` runs the pickle, so it can run code), or what failed.

tests/test_saved_objects.py checks that README.md holds exactly what this prints.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import pathlib
import random
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tensorcanon as tc


@dataclasses.dataclass
class RunConfig:
    lr: float
    steps: int


class Split(enum.Enum):
    TRAIN = "train"


class Custom:
    def __init__(self) -> None:
        self.x = 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def _optimizer(kind: type = torch.optim.AdamW) -> torch.optim.Optimizer:
    model = _model()
    opt = kind(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return opt


def _scheduler() -> Any:
    opt = _optimizer()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    opt.step()
    sched.step()
    return sched


def _packed() -> Any:
    from torch.nn.utils.rnn import pack_padded_sequence
    return pack_padded_sequence(torch.randn(3, 4, 2), torch.tensor([2, 4, 1]), batch_first=True, enforce_sorted=False)


def _tokenizer_batch() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    return fast(["hello world", "world"], padding=True, return_tensors="pt")


def _training_args() -> Any:
    from transformers import TrainingArguments
    return TrainingArguments(output_dir="out", learning_rate=3e-4, report_to="none")


def _model_output() -> Any:
    from transformers.modeling_outputs import SequenceClassifierOutput
    return SequenceClassifierOutput(loss=torch.tensor(0.5), logits=torch.randn(2, 3))


def _dictconfig() -> Any:
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"lr": 0.001, "warmup": "${lr}", "data": {"root": "???"}})
    OmegaConf.set_struct(cfg, True)
    return cfg


def _cfgnode() -> Any:
    from yacs.config import CfgNode
    node = CfgNode({"MODEL": {"DEPTH": 50}})
    node.freeze()
    return node


def _lazy() -> Any:
    return torch.nn.LazyLinear(4).state_dict()


def _quantized() -> Any:
    return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


#: (what, how it is made): in README order
ROWS: list[tuple[str, Callable[[], Any]]] = [
    ("model `state_dict()`", lambda: _model().state_dict()),
    ("tied weights (`{'emb': w, 'head': w}`)", lambda: (lambda w: {"emb": w, "head": w})(torch.randn(4, 4))),
    ("AdamW `state_dict()`", lambda: _optimizer().state_dict()),
    ("SGD with momentum `state_dict()`", lambda: _optimizer(torch.optim.SGD).state_dict()),
    ("OneCycleLR `state_dict()`", lambda: _scheduler().state_dict()),
    ("GradScaler `state_dict()`", lambda: torch.amp.GradScaler("cpu").state_dict()),
    ("`torch.get_rng_state()`", torch.get_rng_state),
    ("`torch.Generator`", lambda: torch.Generator().manual_seed(1)),
    ("`np.random.get_state()`", lambda: np.random.RandomState(0).get_state()),
    ("`np.random.default_rng(0)`", lambda: np.random.default_rng(0)),
    ("`random.getstate()`", lambda: random.Random(0).getstate()),
    ("`tensorcanon.RngState.capture()`", tc.RngState.capture),
    ("training info (epoch, step, losses)", lambda: {"epoch": 3, "step": 1200, "losses": [0.5, 0.25, 0.125]}),
    ("`argparse.Namespace`", lambda: argparse.Namespace(lr=0.1, epochs=3, name="run")),
    ("`pathlib.Path`", lambda: pathlib.Path("/data/train")),
    ("`collections.Counter`", lambda: collections.Counter({"cat": 3, "dog": 1})),
    ("numpy array", lambda: np.arange(6, dtype=np.float32).reshape(2, 3)),
    ("numpy `object` array", lambda: np.array(["a", 1], dtype=object)),
    ("sparse COO tensor", lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))),
    ("jagged nested tensor", lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)],
                                                                layout=torch.jagged)),
    ("`transformers.TrainingArguments`", _training_args),
    ("`transformers` `ModelOutput`", _model_output),
    ("`transformers.BatchEncoding` (fast tokenizer)", _tokenizer_batch),
    ("`torch.nn.utils.rnn.PackedSequence`", _packed),
    ("OmegaConf `DictConfig`", _dictconfig),
    ("yacs `CfgNode` (frozen)", _cfgnode),
    ("your dataclass", lambda: RunConfig(0.1, 3)),
    ("your Enum member", lambda: Split.TRAIN),
    ("your class (a codec: `encode=`, `decode=`)", Custom),
    ("lazy module's `state_dict()`", _lazy),
    ("`torch.ao` quantized tensor", _quantized),
    ("`defaultdict(lambda: 0)`", lambda: collections.defaultdict(lambda: 0)),
    ("a function or lambda", lambda: (lambda x: x)),
    ("`nn.Module`", _model),
    ("optimizer object", _optimizer),
]


def _short(text: str, limit: int = 110) -> str:
    text = " ".join(text.split())
    for stop in (" (at $", "; tensorcanon saves None"):
        text = text.split(stop)[0]
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


#: (a phrase of tensorcanon's error, the remedy it states, shortened for the table)
_REMEDIES = [
    ("register_builtin_codecs()", "opt-in: `tensorcanon.register_builtin_codecs()`"),
    ("save its state_dict() instead", "refused: save its `state_dict()`"),
    ("run one forward pass", "refused: run one forward pass first"),
    ("dequantize()", "refused: save `t.dequantize()`, scale and zero point"),
    ("save dict(value)", "refused: save `dict(value)`"),
    ("functions, lambdas, classes and modules are code", "refused: code (save a name)"),
    ("arr.astype(str)", "refused: save `arr.astype(str)` or `arr.tolist()`"),
]


def _refusal(message: str) -> str:
    """The remedy a refusal states, as the table shows it (the message's own words, shortened)."""
    for phrase, shown in _REMEDIES:
        if phrase in message:
            return shown
    found = re.search(r"call (tensorcanon\.register\(\w+\)) first", message)
    if found:
        return f"once registered: `{found.group(1)}`"
    return f"refused: {_short(message, 70)}"


def tensorcanon_outcome(value: Any) -> str:
    try:
        data = tc.dumps({"v": value})
    except tc.TensorCanonError as e:
        return _refusal(str(e))
    back = tc.loads(data)["v"]
    if type(back) is not type(value):
        return f"comes back as `{type(back).__name__}`"
    return "round-trips" if tc.fingerprint({"v": back}) == tc.fingerprint({"v": value}) else "changes"


def torch_outcome(value: Any) -> str:
    buf = io.BytesIO()
    try:
        torch.save({"v": value}, buf)
    except Exception as e:  # noqa: BLE001 - what torch.save raises is the finding
        return f"save fails: {type(e).__name__}"
    buf.seek(0)
    try:
        back = torch.load(buf, weights_only=True)["v"]
    except Exception as e:  # noqa: BLE001 - what torch.load raises is the finding
        return "needs `weights_only=False` (pickle)" if "weights_only" in str(e) or "Weights only" in str(e) \
            else f"load fails: {type(e).__name__}"
    return "loads" if type(back) is type(value) else f"loads as `{type(back).__name__}`"


def table() -> str:
    import warnings

    lines = ["| Object | tensorcanon (no `register` call) | `torch.save` + `torch.load` (default) |",
             "|---|---|---|"]
    import omegaconf  # noqa: F401 - the libraries a training script has imported
    import transformers  # noqa: F401
    import yacs.config  # noqa: F401
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for what, make in ROWS:
            lines.append(f"| {what} | {tensorcanon_outcome(make())} | {torch_outcome(make())} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
