"""tensorcanon for transformers: a ``Trainer`` whose checkpoints hold no pickle.

The stock ``Trainer`` checkpoint pickles the training state: ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt`` and ``rng_state.pth`` (``torch.save``), and
``training_args.bin`` (the whole ``TrainingArguments`` object).
:class:`CanonicalTrainer` writes them as tensorcanon files instead and reads
them back without ``torch.load``. It also rewrites the weights ``save_pretrained``
writes (``model.safetensors``, or its shards) as tensorcanon files of the same
tensors under the same names: a tensorcanon file of a plain ``dict[str, Tensor]``
is a safetensors file with those tensor names and ``format: pt``, which
``from_pretrained`` and the Trainer's resume read as before. Every tensor file of
a checkpoint then carries digests (``tensorcanon verify``); the rest is JSON:

.. code-block:: text

    checkpoint-<step>/
        model.safetensors                     save_pretrained's tensors, as a tensorcanon file
        config.json, tokenizer files, ...     as save_pretrained writes them (JSON)
        trainer_state.json                    as the Trainer writes it (JSON)
        training_args.json                    TrainingArguments.to_json_string(), not a pickle
        training_args.safetensors             the TrainingArguments (register_training_arguments)
        optimizer.safetensors                 optimizer state_dict
        scheduler.safetensors                 LR scheduler state_dict
        scaler.safetensors                    GradScaler state_dict (mixed precision only)
        rng_state.safetensors                 RngState + DeterminismSettings
                                              (rng_state_<process>.safetensors with several processes)

Example::

    from tensorcanon.integrations.transformers import CanonicalTrainer

    trainer = CanonicalTrainer(model=model, args=args, train_dataset=ds)   # same arguments as Trainer
    trainer.train(resume_from_checkpoint=True)

It also makes the training data's randomness resumable: the training set is
read through a :class:`tensorcanon.ResumableSampler` (seeded with ``data_seed``,
else ``seed``) and :class:`tensorcanon.SeededDataset`, and the data collator runs
under :class:`tensorcanon.SeededCollator`, so random masking in the collator
(``DataCollatorForLanguageModeling``) and augmentation in ``__getitem__`` draw
from a state derived from ``(seed, epoch, sample or batch position)`` and never
from the global generators. The stock Trainer, resuming mid-epoch, collates
the first ``gradient_accumulation_steps`` batches (and accelerate's one-batch
look-ahead) before it restores the random state, and in the run that never
stopped those batches were collated before the checkpoint was taken: no saved
state can reproduce both. With the data drawing nothing from the global
generators, the state restored is exactly the one dropout draws from next.
docs/INTEGRATIONS.md has the details.

Everything else is the Trainer's own logic: when to save, which batches to
skip on resume, when to restore the random state. Supported: one process or
DDP; FSDP, DeepSpeed, SageMaker model parallel and TPU keep their engines' own
checkpoint files and raise here.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .. import api
from ..format import ecosystem, registry
from ..format.errors import FormatError, MissingFileError, UsageError
from ..format.registry import register as api_register
from ..training.data import ResumableSampler
from ..training.determinism import DeterminismSettings
from ..training.rng import RngState
from ..training.seeded import SeededCollator, SeededDataset
from ._common import apply_settings, framework_import

with framework_import("transformers", "transformers", "accelerate", "safetensors"):
    from safetensors import safe_open  # installed with transformers
    from transformers import Trainer
    from transformers.trainer_utils import has_length

__all__ = ["CanonicalTrainer", "register_training_arguments", "load_training_arguments"]

OPTIMIZER = "optimizer.safetensors"
SCHEDULER = "scheduler.safetensors"
SCALER = "scaler.safetensors"
TRAINING_ARGS = "training_args.json"
TRAINING_ARGS_FILE = "training_args.safetensors"
_PICKLED_ARGS = "training_args.bin"


def register_training_arguments(cls: type | None = None) -> None:
    """Save ``TrainingArguments`` (or the subclass ``cls``, such as ``Seq2SeqTrainingArguments``)
    without pickle: as the dict of its ``__init__`` fields, Enum members by their values, the
    ``*_token`` fields (credentials) left out; it loads as ``cls(**fields)``, so ``__post_init__``
    derives the rest (devices, the distributed state) in the loading process, as for arguments
    built from a command line. Recorded as ``["obj", "transformers.<class name>", ...]``; call it in
    the saving and the loading process. Values of other classes (a subclass not registered) are
    refused. :class:`CanonicalTrainer` calls it for its ``args``' class. Loading runs the
    constructor's checks on the file's values, as on a command line's (it reads a DeepSpeed or
    FSDP config file that ``deepspeed`` or ``fsdp_config`` names).

    Example::

        register_training_arguments()
        tensorcanon.save({"args": trainer.args, "step": 10}, "state.safetensors")
        args = tensorcanon.load("state.safetensors")["args"]     # a TrainingArguments
    """
    from transformers import TrainingArguments

    cls = TrainingArguments if cls is None else cls
    if not (isinstance(cls, type) and issubclass(cls, TrainingArguments)):
        raise UsageError(f"register_training_arguments() takes TrainingArguments or a subclass, not {cls!r}")
    encode, decode = ecosystem.training_arguments_codec(cls)

    existing = registry.by_type(cls)
    if existing is not None and existing.cls is cls and existing.name == f"transformers.{cls.__name__}":
        return  # already registered (its state does not depend on the registration's functions)
    api_register(cls, name=f"transformers.{cls.__name__}", encode=encode, decode=decode, replace=True)


def load_training_arguments(checkpoint: str) -> Any:
    """The ``TrainingArguments`` a :class:`CanonicalTrainer` checkpoint holds (its
    ``training_args.safetensors``), for the class registered with :func:`register_training_arguments`
    (TrainingArguments itself is registered here)."""
    register_training_arguments()
    return api.load(os.path.join(checkpoint, TRAINING_ARGS_FILE))["args"]


def _is_hf_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset``, whose unused columns the Trainer removes itself
    (one exists only once the ``datasets`` package is imported)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(dataset, datasets.Dataset)


class _TrainingData(SeededDataset):
    """The training set as CanonicalTrainer reads it: a SeededDataset that also takes the Trainer's
    ``set_epoch`` to its sampler.

    accelerate's loader passes ``set_epoch`` on to the sampler only through the batch samplers it
    knows how to open, and with several processes, resumed mid-epoch, the loader that skips the
    done batches wraps it once more (``SkipBatchSampler`` around ``BatchSamplerShard``): the
    sampler would stay at epoch 0. The loader then calls the dataset's ``set_epoch``, which
    every loader copy keeps."""

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:  # None in a DataLoader worker's copy
            self.sampler.set_epoch(epoch)


def _weight_files(folder: str) -> list[str]:
    """The safetensors files of model weights ``save_pretrained`` writes in ``folder``: ``model.safetensors``
    (or ``adapter_model.safetensors``), or the shards an ``*.safetensors.index.json`` lists.

    Every file an index names must lie in ``folder`` (docs/SECURITY.md, "In-process integrations"):
    a stale or hostile index there would otherwise make a save rewrite a file anywhere."""
    names = {"model.safetensors", "adapter_model.safetensors"}
    for index in (n for n in os.listdir(folder) if n.endswith(".safetensors.index.json")):
        names.update(_index_shards(folder, index))
    root = os.path.realpath(folder)
    out = []
    for n in sorted(names):
        path = os.path.join(folder, n)
        if not os.path.isfile(path):
            continue
        if os.path.commonpath([root, os.path.realpath(path)]) != root:  # a link out of the folder
            raise FormatError(f"{path} is a link to {os.path.realpath(path)}, outside the output folder: "
                              "CanonicalTrainer rewrites the weight files in its output folder only; "
                              "remove the link")
        out.append(path)
    return out


def _index_shards(folder: str, index: str) -> set[str]:
    """The shard file names of ``folder/index`` (a ``weight_map``'s values), each checked to name a
    file inside ``folder``: relative, without ``..``, and not a link that leads out of it."""
    path = os.path.join(folder, index)

    def refuse(why: str) -> FormatError:
        return FormatError(f"{path}: {why}; CanonicalTrainer rewrites the shards a weight index lists in its "
                           "output folder, so it refuses to save: remove or fix this index (a stale one from "
                           "another run, or one that was tampered with)")

    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: the JSON is not an object
        raise refuse(f"is not a readable weight index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise refuse("its weight_map is not an object")
    root = os.path.realpath(folder)
    out = set()
    for name in weight_map.values():
        if type(name) is not str or not name or "\0" in name:
            raise refuse(f"its weight_map names {name!r}, which is not a file name")
        parts = name.replace("\\", "/").split("/")
        if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
            raise refuse(f"its weight_map names {name!r}, which is not a file inside the output folder")
        real = os.path.realpath(os.path.join(folder, name))
        if os.path.commonpath([root, real]) != root:
            raise refuse(f"its weight_map names {name!r}, which leads out of the output folder (to {real})")
        out.add(name)
    return out


def _make_weights_canonical(folder: str) -> None:
    """Rewrite the weight files ``save_pretrained`` has just written in ``folder`` as tensorcanon files.

    Same file names, same tensor names and bytes, ``format: pt`` recorded: ``from_pretrained`` and the
    Trainer's resume read them as before, and ``tensorcanon verify`` re-hashes them. A file whose
    safetensors metadata holds more than ``format`` (a quantizer's) is kept as written: tensorcanon
    would not carry that metadata where transformers reads it."""
    for path in _weight_files(folder):
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        if metadata == {"format": "pt"}:  # a tensorcanon file's metadata also holds its digests: not rewritten
            api.save(api.load(path, mmap=True), path)  # atomic: the map stays on the old file


def _rng_file(trainer: Trainer) -> str:
    if trainer.args.world_size <= 1:
        return "rng_state.safetensors"
    return f"rng_state_{trainer.args.process_index}.safetensors"


class CanonicalTrainer(Trainer):
    """A ``transformers.Trainer`` that saves and resumes its training state as tensorcanon files.

    Takes exactly the Trainer's arguments. Checkpoint folders hold no pickle
    (see the module docstring for the layout), and resuming
    (``train(resume_from_checkpoint=...)``) reads them without ``torch.load``;
    a resumed run is bit-identical to one that never stopped, at any step,
    mid-epoch included, with random data collators, dropout, gradient
    accumulation and DataLoader workers, in one process or under DDP, where
    each process saves and resumes its own random state (tested for a tiny
    GPT-2 and a BERT with ``DataCollatorForLanguageModeling``, the BERT also on
    2 processes with gloo). A random state that cannot be
    restored raises :class:`tensorcanon.RngRestoreError` instead of being
    skipped; determinism settings that differ from the saved run are reported
    as :class:`~tensorcanon.training.determinism.DeterminismWarning`.

    The training data is seeded as the module docstring says when the
    training set is map-style with a length and ``train_sampling_strategy`` is
    ``"random"`` (the default) or ``"sequential"``; the order of the samples is
    then :class:`tensorcanon.ResumableSampler`'s, not the stock Trainer's.
    Other strategies, and a subclass that overrides ``_get_train_sampler``,
    keep the Trainer's sampler and collate unseeded.
    """

    _seeding_collator = False  # True while get_train_dataloader builds the seeded training loader

    # ------------------------------------------------------------------ the training data

    def _training_sampler(self) -> ResumableSampler | None:
        """The sampler that seeds the training data, or None where the Trainer's own is kept."""
        ds = self.train_dataset
        if ds is None or isinstance(ds, IterableDataset) or not has_length(ds):
            return None
        if type(self)._get_train_sampler is not Trainer._get_train_sampler:
            return None  # a subclass chose its own sampler: keep it
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if strategy not in ("random", "sequential") or getattr(self.args, "group_by_length", False):
            return None
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return ResumableSampler(ds, shuffle=strategy == "random", seed=seed)

    def get_train_dataloader(self) -> DataLoader:
        """The Trainer's training DataLoader, reading the data through a ResumableSampler,
        SeededDataset and SeededCollator (see the class docstring)."""
        sampler = self._training_sampler()
        if sampler is None:
            return super().get_train_dataloader()
        dataset: Any = self.train_dataset
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")  # as the Trainer would
        self._seeding_collator = True
        try:
            loader = self._get_dataloader(dataset=_TrainingData(dataset, sampler), description="Training",
                                          batch_size=self._train_batch_size, sampler_fn=lambda _: sampler,
                                          is_training=True)
        finally:
            self._seeding_collator = False
        # Without a generator each iterator draws its workers' base seed from the global torch RNG:
        # a resumed run creates iterators where the uninterrupted one did not (persistent workers).
        base = getattr(loader, "base_dataloader", loader)
        if isinstance(base, DataLoader) and base.generator is None:
            base.generator = sampler.generator
        return loader

    def _get_collator_with_removed_columns(self, data_collator: Any, description: str | None = None) -> Any:
        collator = super()._get_collator_with_removed_columns(data_collator, description=description)
        # Outermost, so it receives the SeededBatch itself; a SeededCollator of the user's inside it
        # (wrapped by the Trainer's RemoveColumnsCollator) gets the batch's key from this one.
        return SeededCollator(collator) if self._seeding_collator else collator

    def _check_engine(self) -> None:
        engines = {"FSDP": getattr(self, "is_fsdp_enabled", False),
                   "DeepSpeed": getattr(self, "is_deepspeed_enabled", False)}
        for name, on in engines.items():
            if on:
                raise UsageError(f"CanonicalTrainer does not support {name}: its engine writes the sharded "
                                 "optimizer and model states itself; use transformers.Trainer")

    def _optimizer_and_scheduler(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The Trainer's optimizer and scheduler, which it creates before it saves or loads them."""
        if self.optimizer is None or self.lr_scheduler is None:
            raise UsageError("CanonicalTrainer saves and loads the optimizer and scheduler only once the "
                             "Trainer has created them (create_optimizer_and_scheduler)")
        return self.optimizer, self.lr_scheduler

    # ------------------------------------------------------------------ saving

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)
        out = output_dir if output_dir is not None else self.args.output_dir
        assert out is not None  # the Trainer's _save has just written the model there
        if self.args.should_save:
            pickled = os.path.join(out, _PICKLED_ARGS)
            if os.path.exists(pickled):
                os.remove(pickled)  # the Trainer pickles its TrainingArguments here; keep JSON instead
            with open(os.path.join(out, TRAINING_ARGS), "w", encoding="utf-8") as f:
                f.write(self.args.to_json_string())
            register_training_arguments(type(self.args))
            api.save({"args": self.args}, os.path.join(out, TRAINING_ARGS_FILE))
            _make_weights_canonical(out)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._check_engine()
        if self.args.should_save:
            optimizer, scheduler = self._optimizer_and_scheduler()
            api.save(optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "please also save the optimizer" note
                api.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _save_scaler(self, output_dir: str) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            api.save(scaler.state_dict(), os.path.join(output_dir, SCALER))

    def _save_rng_state(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        api.save({"rng": RngState.capture(), "settings": DeterminismSettings.capture()},
                 os.path.join(output_dir, _rng_file(self)))

    # ------------------------------------------------------------------ loading

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._check_engine()
        opt, sched = os.path.join(checkpoint, OPTIMIZER), os.path.join(checkpoint, SCHEDULER)
        if not (os.path.isfile(opt) and os.path.isfile(sched)):
            return  # as the Trainer does: a checkpoint saved with save_only_model has neither
        device = self.args.device if self.args.world_size > 1 and self.args.device.type != "cpu" else "cpu"
        optimizer, scheduler = self._optimizer_and_scheduler()
        optimizer.load_state_dict(api.load(opt, map_location=device))
        scheduler.load_state_dict(api.load(sched, map_location="cpu"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SCALER)
        if os.path.isfile(path):
            self.accelerator.scaler.load_state_dict(api.load(path, map_location="cpu"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, _rng_file(self))
        if not os.path.isfile(path):
            raise MissingFileError(
                f"{path} does not exist: the checkpoint has no random state for this process, so the "
                "resumed run would not be reproducible (was it written by CanonicalTrainer with the same "
                "number of processes?)", filename=path)
        state: Any = api.load(path)
        if type(state) is not dict or not isinstance(state.get("rng"), RngState) \
                or not isinstance(state.get("settings"), DeterminismSettings):
            raise FormatError(f"{path} does not hold an RngState and DeterminismSettings")
        apply_settings(state["settings"], apply=False)  # the Trainer sets its own switches; report only
        state["rng"].restore()
