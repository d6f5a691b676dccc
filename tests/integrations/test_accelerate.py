"""tensorcanon.integrations.accelerate against the real accelerate (no mocks).

accelerate_run.py trains and saves in one interpreter and resumes in another
(with torch.load and pickle patched to raise while it loads); the resumed
state must have the digest of a run that never stopped.
"""

from __future__ import annotations

# First: importing integration_support sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE, which the
# Hugging Face libraries read when they are first imported. restore_determinism_settings is an
# autouse fixture: importing it is what applies it.
from integration_support import first_and_resume, is_pickle_or_zip, restore_determinism_settings  # noqa: F401 (a fixture)

# isort: split

import os

import pytest
import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

import tensorcanon
from tensorcanon.integrations import accelerate as tca

import accelerate_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict, object]:
    out = tmp_path_factory.mktemp("accelerate")
    first, resume = first_and_resume("accelerate_run.py", out)
    return first, resume, out


CASES = [(w, s) for w in accelerate_run.WORKERS for s in accelerate_run.SAVE_AT]


@pytest.mark.parametrize("workers,step", CASES, ids=[f"workers{w}-step{s}" for w, s in CASES])
def test_resume_in_a_fresh_process_is_bit_identical(runs, workers, step):
    first, resumed, _ = runs
    full, res = first[f"w{workers}"], resumed[f"w{workers}"][str(step)]
    assert full["steps"] == accelerate_run.TOTAL and full["crashed_at"] == accelerate_run.CRASH_AT
    assert res["resumed_at"] == step and res["steps"] == accelerate_run.TOTAL
    assert res["losses"] == full["losses"][step:]  # every batch after the resume point
    assert res["digest"] == full["full"]  # model, optimizer, scheduler, registered object, sampler


@pytest.mark.parametrize("step", accelerate_run.SKIP["save_at"])
def test_resume_through_skip_first_batches_with_gradient_accumulation_is_bit_identical(runs, step):
    # accelerate's own resume pattern (skip_first_batches, no track), a random collate_fn in 2
    # workers, gradient_accumulation_steps=2; the crashed run stopped inside an accumulation window.
    first, resumed, _ = runs
    full, res = first["skip"], resumed["skip"][str(step)]
    assert full["steps"] == accelerate_run.TOTAL and full["crashed_at"] == accelerate_run.SKIP["crash_at"]
    assert res["resumed_at"] == step and res["steps"] == accelerate_run.TOTAL
    assert res["losses"] == full["losses"][step:]
    assert res["digest"] == full["full"]


def test_saved_folder_holds_only_canonical_files(runs):
    _, _, out = runs
    folder = out / "w2" / "step15"
    assert sorted(os.listdir(folder)) == ["model.safetensors", "process_0.safetensors", "training_state.safetensors"]
    for name in os.listdir(folder):
        assert not is_pickle_or_zip((folder / name).read_bytes()), name
        tensorcanon.verify(folder / name)
    # The weights file is a plain safetensors file with the model's own parameter names.
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    assert sorted(weights) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    state = tensorcanon.load(folder / "training_state.safetensors")
    assert state["layout"] == tca.LAYOUT and state["custom_objects"][0]["updates"] == 15
    process = tensorcanon.load(folder / "process_0.safetensors")
    assert isinstance(process["rng"], tensorcanon.RngState)
    assert process["dataloaders"][0]["sampler"]["epoch"] == 1
    assert process["dataloaders"][0]["sampler"]["position"] == 5 * accelerate_run.BATCH


# ------------------------------------------------------------------ in-process checks

@pytest.fixture
def run() -> accelerate_run.Run:
    return accelerate_run.Run(workers=0)


def test_damaged_random_state_is_an_error_not_a_silent_skip(run, tmp_path):
    run.train(stop_at=3)
    tca.save_state(run.acc, tmp_path)
    path = tmp_path / "process_0.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b'"tensorcanon.manifest":"') + 4000   # inside the saved generator states
    data[at] = ord("A") if data[at] != ord("A") else ord("B")
    path.write_bytes(bytes(data))
    with pytest.raises(tensorcanon.IntegrityError):
        tca.load_state(run.acc, tmp_path)
    path.unlink()
    with pytest.raises(tensorcanon.MissingFileError, match="process_0.safetensors") as info:
        tca.load_state(run.acc, tmp_path)
    assert isinstance(info.value, FileNotFoundError)


def test_a_process_state_of_the_wrong_kind_is_refused_before_anything_loads(run, tmp_path):
    run.train(stop_at=3)
    tca.save_state(run.acc, tmp_path)
    path = tmp_path / "process_0.safetensors"
    process = tensorcanon.load(path)
    tensorcanon.save({**process, "settings": {"deterministic": True}}, path)  # not DeterminismSettings
    before = {k: v.clone() for k, v in run.acc.unwrap_model(run.acc._models[0]).state_dict().items()}
    run.train(stop_at=5)  # the model moves on: a load that started would put the saved weights back
    moved = {k: v.clone() for k, v in run.acc.unwrap_model(run.acc._models[0]).state_dict().items()}
    assert any(not torch.equal(before[k], moved[k]) for k in before)
    with pytest.raises(tensorcanon.FormatError, match="process_0.safetensors is not a"):
        tca.load_state(run.acc, tmp_path)
    after = run.acc.unwrap_model(run.acc._models[0]).state_dict()
    assert all(torch.equal(moved[k], after[k]) for k in moved)


def test_load_needs_the_same_registered_objects(run, tmp_path):
    tca.save_state(run.acc, tmp_path)
    other = accelerate_run.Run(workers=0)
    other.acc._custom_objects.clear()               # as if register_for_checkpointing was forgotten
    with pytest.raises(tensorcanon.UsageError, match="1 registered objects, this accelerator has 0"):
        tca.load_state(other.acc, tmp_path)


class Unsaveable:
    def state_dict(self):
        return {"schedule": len}

    def load_state_dict(self, state):
        pass


def test_unsaveable_registered_object_names_its_path(run, tmp_path):
    run.acc.register_for_checkpointing(Unsaveable())
    with pytest.raises(tensorcanon.UnsupportedTypeError) as info:
        tca.save_state(run.acc, tmp_path)
    assert info.value.path == '$["custom_objects"][1]["schedule"]'


def test_automatic_naming_keeps_total_limit_and_loads_the_latest(tmp_path):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    model = acc.prepare(torch.nn.Linear(2, 2))
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1)
        tca.save_state(acc)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    acc.project_configuration.iteration = 0
    assert tca.load_state(acc).endswith("checkpoint_2")
    assert torch.equal(model.weight, expected)
    assert acc.project_configuration.iteration == 3   # the next save goes to checkpoint_3


def test_track_needs_a_resumable_sampler():
    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    with pytest.raises(tensorcanon.UsageError, match="ResumableSampler"):
        next(tca.track(loader))


def test_save_pre_hook_can_take_over_a_model(run, tmp_path):
    seen = []

    def hook(models, weights, output_dir):
        seen.append((len(models), output_dir))
        weights.pop()                               # this hook saves the model its own way

    handle = run.acc.register_save_state_pre_hook(hook)
    try:
        tca.save_state(run.acc, tmp_path)
    finally:
        handle.remove()
    assert seen == [(1, str(tmp_path))]
    assert not (tmp_path / "model.safetensors").exists()
    assert tensorcanon.load(tmp_path / "training_state.safetensors")["models"] == 0
