"""tensorcanon.integrations.lightning against the real Lightning Trainer (no mocks).

The resumption claim is tested across processes: lightning_run.py fits and
crashes in one interpreter, and resumes in another; the resumed weights and
optimizer state must have the digest of a fit that never stopped.
"""

from __future__ import annotations

# First: importing integration_support sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE, which the
# Hugging Face libraries read when they are first imported. restore_determinism_settings is an
# autouse fixture: importing it is what applies it.
from integration_support import (  # noqa: F401 (fixtures: pytest finds them here by name)
    first_and_resume,
    first_and_resume_ranks,
    is_pickle_or_zip,
    restore_determinism_settings,
)

# isort: split

import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import tensorcanon
from tensorcanon.integrations.lightning import CanonicalCheckpointIO, ExactResume, load_from_checkpoint
from tensorcanon.training.determinism import DeterminismWarning

import lightning_ddp_run
import lightning_run

# ------------------------------------------------------------------ resumption across processes

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("lightning")
    return first_and_resume("lightning_run.py", out)


CASES = [(w, r, f) for w, r in lightning_run.CONFIGS for f in lightning_run.RESUME_FROM]


@pytest.mark.parametrize("workers,reload,ckpt", CASES, ids=[f"workers{w}-reload{r}-{f}" for w, r, f in CASES])
def test_fit_resumed_in_a_fresh_process_is_bit_identical(runs, workers, reload, ckpt):
    first, resumed = runs
    name = f"w{workers}-r{reload}"
    full, crashed, res = first[name]["full"], first[name]["crashed"], resumed[name][ckpt]
    step = lightning_run.RESUME_FROM[ckpt]
    per_epoch = lightning_run.N // lightning_run.BATCH
    epochs = [str(e) for e in range(lightning_run.EPOCHS)]
    # The uninterrupted fit ran every epoch in full; the crashed one stopped where it was told.
    assert full["batches"] == {e: per_epoch for e in epochs} and full["steps"] == 30
    assert crashed["steps"] == lightning_run.CRASH_AT
    # The resumed fit: same number of batches per epoch as the loop sees it, the rest of the
    # interrupted epoch, then full epochs, to the same final step.
    first_epoch = step // per_epoch
    assert res["limits"] == {e: per_epoch for e in epochs[first_epoch:]}
    expected = {e: per_epoch for e in epochs[first_epoch:]}
    expected[str(first_epoch)] = per_epoch - step % per_epoch
    assert res["batches"] == expected
    assert res["steps"] == full["steps"]
    # Every loss after the resume point, and the final weights and optimizer state, bit for bit.
    assert sorted(res["losses"], key=int) == [str(s) for s in range(step, 30)]
    assert {k: full["losses"][k] for k in res["losses"]} == res["losses"]
    assert res["digest"] == full["digest"]


@pytest.mark.parametrize("ckpt", list(lightning_run.ACCUMULATE["resume_from"]))
def test_fit_with_gradient_accumulation_resumed_mid_epoch_is_bit_identical(runs, ckpt):
    # accumulate_grad_batches=2, 2 workers, a random collate_fn; crashed inside a window after step 7.
    first, resumed = runs
    name = lightning_run.ACCUMULATE["name"]
    full, crashed, res = first[name]["full"], first[name]["crashed"], resumed[name][ckpt]
    step = lightning_run.ACCUMULATE["resume_from"][ckpt]
    batches = lightning_run.EPOCHS * lightning_run.N // lightning_run.BATCH
    assert full["steps"] == batches // 2 and len(full["micro"]) == batches
    assert crashed["steps"] == lightning_run.ACCUMULATE["crash_at"] and len(crashed["micro"]) % 2 == 1
    assert res["steps"] == full["steps"]
    # Every batch's loss after the resume point (2 per optimizer step), and the final state.
    assert res["micro"] == full["micro"][2 * step:]
    assert res["digest"] == full["digest"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[dict, dict, Path]:
    # Two launches of 2 DDP processes each (Lightning starts rank 1 by running the script again):
    # the fit that never stops (and writes the checkpoints), then the resumed fits.
    out = tmp_path_factory.mktemp("lightning_ddp")
    first, resumed = first_and_resume_ranks("lightning_ddp_run.py", out)
    return {r: first[r]["full"] for r in first}, resumed, out


@pytest.mark.parametrize("ckpt", list(lightning_ddp_run.RESUME_FROM))
def test_ddp_fit_with_rank_dependent_random_state_resumes_bit_identical(ddp_runs, ckpt):
    full, resumed, out = ddp_runs
    step = lightning_ddp_run.RESUME_FROM[ckpt]
    steps = [str(s) for s in range(step, full[0]["steps"])]
    # The ranks drew differently (each reseeds with its rank), and the checkpoint holds each rank's state.
    assert full[0]["losses"] != full[1]["losses"]
    state = tensorcanon.load(out / "ckpts" / f"{ckpt}.ckpt")["callbacks"]["ExactResume"]
    by_rank = state["rng_by_rank"]
    assert len(by_rank) == 2 and tensorcanon.dumps(by_rank[0]) != tensorcanon.dumps(by_rank[1])
    for rank in (0, 1):
        res = resumed[rank][ckpt]
        # Each rank's every loss after the resume point, and the final weights and optimizer state.
        assert sorted(res["losses"], key=int) == steps
        assert res["losses"] == {k: full[rank]["losses"][k] for k in steps}, f"rank {rank}"
        assert res["digest"] == full[rank]["digest"]


def test_a_multi_process_resume_from_one_random_state_warns():
    # A checkpoint with one state (one process saved it, or an earlier tensorcanon), resumed by two
    # processes; or one saved by 3 processes resumed by 2: rank 0's state, with a warning.
    from tensorcanon.integrations import lightning as tl

    one, other = tensorcanon.RngState.capture(), tensorcanon.RngState.capture()
    with pytest.warns(DeterminismWarning, match="all 2 processes resume it"):
        assert tl._rank_state(one, None, 2, 1) is one
    with pytest.warns(DeterminismWarning, match="saved by 3 processes and is resumed by 2"):
        assert tl._rank_state(one, [one, other, other], 2, 1) is one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tl._rank_state(one, [one, other], 2, 1) is other
        assert tl._rank_state(one, None, 1, 0) is one


@pytest.mark.parametrize("extra", [{"rng_by_rank": "not a list"}, {"rng_by_rank": []},
                                   {"rng_by_rank": [1, 2]}, {"surprise": 1}])
def test_a_malformed_exact_resume_state_is_refused(extra):
    state = {"rng": tensorcanon.RngState.capture(), "settings": tensorcanon.DeterminismSettings.capture(),
             "sampler": None, **extra}
    with pytest.raises(tensorcanon.FormatError, match="ExactResume state"):
        ExactResume().load_state_dict(state)


# ------------------------------------------------------------------ in-process checks

class FnModel(lightning_run.Model):
    """A model whose hyper-parameters hold a function: torch.save would pickle it by name."""

    def __init__(self, lr: float = 1e-2, fn=None) -> None:
        super().__init__(lr)
        self.save_hyperparameters()


def _trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    kw = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
              plugins=[CanonicalCheckpointIO()], callbacks=[ExactResume()], num_sanity_val_steps=0)
    kw.update(kwargs)
    return L.Trainer(**kw)


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def activation(x):
    return x


def test_unsaveable_hyperparameter_fails_at_fit_start(tmp_path, quiet):
    # A module-level function: Lightning keeps it in hparams (it drops what cannot be
    # pickled), torch.save would pickle it by reference, tensorcanon refuses it.
    model = FnModel(fn=activation)
    trainer = _trainer(tmp_path, enable_checkpointing=True)
    with pytest.raises(tensorcanon.UnsupportedTypeError) as info:
        trainer.fit(model, datamodule=lightning_run.Data(0))
    assert info.value.path == '$["hyper_parameters"]["fn"]'
    assert "save_hyperparameters(ignore=['fn'])" in str(info.value)
    assert isinstance(info.value, TypeError)
    assert model.losses == {}                     # not one training step ran
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.usefixtures("no_unpickling")
def test_checkpoint_is_a_canonical_file_and_loads_without_unpickling(tmp_path, quiet):
    tensorcanon.seed_everything(0)
    model = lightning_run.Model(lr=3e-3)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer = _trainer(tmp_path, max_steps=4, callbacks=[ExactResume(), every], enable_checkpointing=True)
    trainer.fit(model, datamodule=lightning_run.Data(0))
    path = tmp_path / "step=3.ckpt"

    data = path.read_bytes()
    assert not is_pickle_or_zip(data)
    tensorcanon.verify(path)                      # every byte re-hashed
    ckpt = tensorcanon.load(path)
    assert isinstance(ckpt["callbacks"]["ExactResume"]["rng"], tensorcanon.RngState)
    assert ckpt["callbacks"]["ExactResume"]["sampler"]["position"] == 3 * lightning_run.BATCH
    assert ckpt["hyper_parameters"] == {"lr": 3e-3}

    loaded = load_from_checkpoint(lightning_run.Model, path)   # torch.load and pickle raise here
    assert type(loaded) is lightning_run.Model and loaded.hparams.lr == 3e-3
    assert tensorcanon.fingerprint(loaded.state_dict()) == tensorcanon.fingerprint(ckpt["state_dict"])
    assert load_from_checkpoint(lightning_run.Model, path, lr=0.5).hparams.lr == 0.5

    # Trainer.fit(ckpt_path=...) reads through the plugin: no unpickling either.
    trainer2 = _trainer(tmp_path, max_steps=6)
    trainer2.fit(lightning_run.Model(lr=3e-3), datamodule=lightning_run.Data(0), ckpt_path=path)
    assert trainer2.global_step == 6
    # validate(ckpt_path=...) with ExactResume: nothing to resume, no sampler needed.
    metrics = _trainer(tmp_path).validate(lightning_run.Model(), datamodule=ValOnlyData(0), ckpt_path=path)
    assert "val" in metrics[0]


class ValOnlyData(lightning_run.Data):
    """Builds no sampler: the checkpoint's sampler position is only wanted when fitting."""

    def setup(self, stage):
        super().setup(stage)
        del self.sampler


def test_load_from_checkpoint_refuses_what_is_not_a_lightning_checkpoint(tmp_path):
    tensorcanon.save({"weights": torch.zeros(2)}, tmp_path / "x.ckpt")
    with pytest.raises(tensorcanon.FormatError, match="not a Lightning checkpoint"):
        load_from_checkpoint(lightning_run.Model, tmp_path / "x.ckpt")
    with pytest.raises(tensorcanon.UsageError):
        load_from_checkpoint(torch.nn.Linear, tmp_path / "x.ckpt")


def test_exact_resume_needs_the_canonical_plugin(tmp_path, quiet):
    trainer = _trainer(tmp_path, plugins=[])
    with pytest.raises(tensorcanon.UsageError, match="CanonicalCheckpointIO"):
        trainer.fit(lightning_run.Model(), datamodule=lightning_run.Data(0))


class FreshSamplerData(lightning_run.Data):
    """Builds a new sampler in every train_dataloader() call: it cannot be restored in time."""

    def train_dataloader(self):
        ds = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
        s = tensorcanon.ResumableSampler(ds, seed=1)
        return DataLoader(ds, batch_size=4, sampler=s, generator=s.generator)

    def setup(self, stage):
        super().setup(stage)
        del self.sampler


def test_sampler_made_in_train_dataloader_fails_at_train_start(tmp_path, quiet):
    model = lightning_run.Model()
    with pytest.raises(tensorcanon.UsageError, match="not reachable when a checkpoint is loaded"):
        _trainer(tmp_path).fit(model, datamodule=FreshSamplerData(0))
    assert model.losses == {}


class NoGeneratorData(lightning_run.Data):
    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=4, sampler=self.sampler)


def test_loader_without_the_sampler_generator_is_refused(tmp_path, quiet):
    with pytest.raises(tensorcanon.UsageError, match="generator=sampler.generator"):
        _trainer(tmp_path).fit(lightning_run.Model(), datamodule=NoGeneratorData(0))


NOT_RESUMABLE = "your dataloader is not resumable"  # Lightning's warning on a mid-epoch resume


def _resume_mid_epoch(tmp_path: Path, callbacks: list) -> tuple[L.Trainer, list[str]]:
    """Resume from the step-3 checkpoint (mid epoch 0) to step 5; the warnings about resumability."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(tmp_path, max_steps=5, callbacks=callbacks, enable_checkpointing=True)
        trainer.fit(lightning_run.Model(), datamodule=lightning_run.Data(0), ckpt_path=tmp_path / "step=3.ckpt")
    return trainer, [str(w.message) for w in caught if NOT_RESUMABLE in str(w.message)]


def test_a_mid_epoch_resume_with_exact_resume_does_not_warn_that_the_loader_is_not_resumable(tmp_path, quiet):
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _trainer(tmp_path, max_steps=3, callbacks=[ExactResume(), every], enable_checkpointing=True).fit(
        lightning_run.Model(), datamodule=lightning_run.Data(0))
    after = ModelCheckpoint(dirpath=tmp_path / "after", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer, warned = _resume_mid_epoch(tmp_path, [ExactResume(), after])
    assert warned == []
    # The DataLoader looked resumable to Lightning's check only: it has no state_dict now, and the
    # checkpoints saved after the resume hold no DataLoader state (which a new DataLoader could not load).
    assert not hasattr(trainer.train_dataloader, "state_dict")
    for step in (4, 5):
        loop = tensorcanon.load(tmp_path / "after" / f"step={step}.ckpt")["loops"]["fit_loop"]["state_dict"]
        assert "combined_loader" not in loop
    _, warned = _resume_mid_epoch(tmp_path, [])  # the control: Lightning's own resume warns
    assert len(warned) == 1
