"""TrainingArguments without pickle (issue 30 item 6): the documented codec, with the real transformers."""

from __future__ import annotations

# First: importing integration_support sets HF_HUB_OFFLINE before the Hugging Face libraries are
# imported; restore_determinism_settings is an autouse fixture.
from integration_support import restore_determinism_settings  # noqa: F401 (a fixture)

# isort: split

import dataclasses

import pytest
from transformers import Seq2SeqTrainingArguments, TrainingArguments

import tensorcanon
from tensorcanon.integrations.transformers import register_training_arguments


@pytest.fixture
def registered():
    register_training_arguments()
    yield
    tensorcanon.unregister(TrainingArguments)
    tensorcanon.unregister(Seq2SeqTrainingArguments)


def _args(cls=TrainingArguments, **kw):
    return cls(output_dir="out", report_to=[], learning_rate=3e-4, lr_scheduler_type="cosine",
               eval_strategy="steps", eval_steps=5, seed=7, **kw)


def test_training_arguments_in_user_state_round_trip(registered):
    args = _args()
    data = tensorcanon.dumps({"args": args, "step": 3})
    back = tensorcanon.loads(data)["args"]
    assert type(back) is TrainingArguments and back == args
    assert back.lr_scheduler_type == args.lr_scheduler_type and back.eval_steps == 5
    assert tensorcanon.dumps({"args": back, "step": 3}) == data  # canonical: saved again, the same bytes


def test_credentials_are_not_saved(registered):
    args = _args(hub_token="hf_secret")
    data = tensorcanon.dumps(args)
    assert b"hf_secret" not in data
    back = tensorcanon.loads(data)
    assert back.hub_token is None
    assert dataclasses.replace(back, hub_token="hf_secret") == args


def test_training_arguments_and_subclasses_need_no_call():
    """Issue 40: TrainingArguments and every subclass are saved by the ecosystem codec (FORMAT.md §6.9.5)
    with no call; register_training_arguments() still works, and names the same state."""
    plain = tensorcanon.dumps(_args())
    seq = _args(Seq2SeqTrainingArguments, predict_with_generate=True)
    back = tensorcanon.loads(tensorcanon.dumps(seq))
    assert type(back) is Seq2SeqTrainingArguments and back == seq and back.predict_with_generate
    register_training_arguments()
    try:
        assert tensorcanon.dumps(_args()) == plain
    finally:
        tensorcanon.unregister(TrainingArguments)


def test_register_training_arguments_takes_only_training_arguments_classes():
    with pytest.raises(tensorcanon.UsageError, match="TrainingArguments or a subclass"):
        register_training_arguments(dict)
