"""tensorcanon for accelerate: a full training state saved and resumed with no pickle anywhere.

``accelerator.save_state`` writes the optimizer, scheduler, sampler, random
state and registered objects with ``torch.save`` whatever ``safe_serialization``
says, and ``accelerator.load_state`` carries on silently when the random state
cannot be restored. :func:`save_state` and :func:`load_state` take their place:

.. code-block:: text

    model.safetensors, model_1.safetensors, ...   each prepared model's state_dict, a plain
                                                  safetensors file (also read by safetensors,
                                                  transformers' from_pretrained, ...)
    training_state.safetensors                    optimizers, schedulers, GradScaler, objects
                                                  registered with register_for_checkpointing,
                                                  accelerator.step and the save counter
    process_0.safetensors, process_1.safetensors  per process: RngState (Python, numpy, torch
                                                  CPU and every device), DeterminismSettings,
                                                  and each prepared DataLoader's epoch and
                                                  ResumableSampler position

Every file is a canonical tensorcanon file: loading re-hashes every byte and
never unpickles. The random state is restored last, and a part that cannot be
restored raises :class:`tensorcanon.RngRestoreError` instead of being skipped.

Example::

    from tensorcanon.integrations import accelerate as tca

    sampler = tensorcanon.ResumableSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, generator=sampler.generator)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if resuming:
        tca.load_state(accelerator, "ckpt")
    for epoch in range(sampler.epoch, epochs):
        for batch in tca.track(loader):          # counts each batch in the sampler's position
            ...                                  # forward, backward, opt.step(), sched.step()
            if time_to_save:
                tca.save_state(accelerator, "ckpt")

Model-weight hooks registered with ``accelerator.register_save_state_pre_hook``
and ``register_load_state_pre_hook`` are called as ``save_state``/``load_state``
call them. docs/INTEGRATIONS.md lists what is supported and what is not.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

from .. import api
from ..format.digest import DEFAULT as _DEFAULT_ALGORITHM
from ..format.errors import FormatError, MissingFileError, UsageError
from ..format.limits import DEFAULT, Limits
from ..training.determinism import DeterminismSettings
from ..training.rng import RngState
from ._common import apply_settings, batch_size_of, framework_import, sampler_of

with framework_import("accelerate", "accelerate"):
    from accelerate import Accelerator
    from accelerate.data_loader import BatchSamplerShard
    from accelerate.utils import DistributedType

__all__ = ["save_state", "load_state", "track", "LAYOUT"]

LAYOUT = "tensorcanon.accelerate/1"
"""Recorded in ``training_state.safetensors``; :func:`load_state` refuses other layouts."""

TRAINING = "training_state.safetensors"
_UNSUPPORTED = {DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM,
                DistributedType.XLA}


def _model_file(i: int) -> str:
    return "model.safetensors" if i == 0 else f"model_{i}.safetensors"


def _process_file(i: int) -> str:
    return f"process_{i}.safetensors"


def _check_supported(accelerator: Accelerator) -> None:
    if not isinstance(accelerator, Accelerator):
        raise UsageError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.distributed_type in _UNSUPPORTED:
        raise UsageError(
            f"tensorcanon's accelerate integration does not support {accelerator.distributed_type.value}: "
            "its sharded model and optimizer states are written by that engine's own checkpointing")


def _auto_dir(accelerator: Accelerator) -> str:
    base = os.path.join(accelerator.project_dir, "checkpoints")
    return os.path.join(base, f"checkpoint_{accelerator.project_configuration.iteration}")


def _checkpoint_number(folder: str) -> int:
    m = re.search(r"(\d+)$", folder)
    return int(m.group(1)) if m else -1


def _prune(accelerator: Accelerator) -> None:
    """Keep at most ``total_limit - 1`` automatic checkpoints before writing a new one."""
    limit = accelerator.project_configuration.total_limit
    base = os.path.join(accelerator.project_dir, "checkpoints")
    if limit is None or not accelerator.is_main_process or not os.path.isdir(base):
        return
    folders = sorted((f for f in os.listdir(base) if _checkpoint_number(f) >= 0), key=_checkpoint_number)
    for f in folders[: max(0, len(folders) + 1 - limit)]:
        shutil.rmtree(os.path.join(base, f))


def save_state(accelerator: Accelerator, output_dir: str | os.PathLike[str] | None = None, *,
               algorithm: str = _DEFAULT_ALGORITHM) -> str:
    """Save everything ``accelerator.save_state`` saves, as tensorcanon files. Returns the folder.

    Call it on every process (as ``accelerator.save_state``): the main process
    writes the models and ``training_state.safetensors``, every process its
    own ``process_<index>.safetensors``, and all wait for each other at the end.
    With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` and no
    ``output_dir`` it writes ``<project_dir>/checkpoints/checkpoint_<n>`` and
    keeps at most ``total_limit`` of them. A value that cannot be saved (e.g. in
    a registered object's ``state_dict()``) raises
    :class:`tensorcanon.UnsupportedTypeError` naming its path.

    Example::

        tensorcanon.integrations.accelerate.save_state(accelerator, "checkpoints/step_100")
    """
    _check_supported(accelerator)
    auto = accelerator.project_configuration.automatic_checkpoint_naming
    if output_dir is None:
        if not auto:
            raise UsageError("save_state needs output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True))")
        _prune(accelerator)
        out = _auto_dir(accelerator)
        if os.path.exists(out):
            raise UsageError(f"checkpoint folder {out} already exists; set "
                             "accelerator.project_configuration.iteration to the next free number")
    else:
        out = os.path.expanduser(os.fspath(output_dir))
    accelerator.wait_for_everyone()
    os.makedirs(out, exist_ok=True)
    writer = accelerator.is_local_main_process if accelerator.project_configuration.save_on_each_node \
        else accelerator.is_main_process

    models = accelerator._models
    weights = [accelerator.get_state_dict(m) for m in models]
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(models, weights, out)  # a hook may save a model its own way and pop its weights
    if writer:
        for i, w in enumerate(weights):
            api.save(w, os.path.join(out, _model_file(i)), algorithm=algorithm)
        training = {
            "layout": LAYOUT,
            "models": len(weights),
            "optimizers": [opt.state_dict() for opt in accelerator._optimizers],
            "schedulers": [s.state_dict() for s in accelerator._schedulers],
            "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            "custom_objects": [obj.state_dict() for obj in accelerator._custom_objects],
            "step": accelerator.step,
            "save_iteration": accelerator.project_configuration.iteration + 1,
        }
        api.save(training, os.path.join(out, TRAINING), algorithm=algorithm)
    loaders = []
    for dl in accelerator._dataloaders:
        s = sampler_of(dl)
        loaders.append({"iteration": getattr(dl, "iteration", 0),
                        "sampler": s.state_dict() if s is not None else None})
    process = {"rng": RngState.capture(), "settings": DeterminismSettings.capture(), "dataloaders": loaders}
    api.save(process, os.path.join(out, _process_file(accelerator.process_index)), algorithm=algorithm)
    accelerator.project_configuration.iteration += 1
    accelerator.wait_for_everyone()
    return out


def _load(folder: str, name: str, verify: bool, limits: Limits, map_location: Any = "cpu") -> Any:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise MissingFileError(f"{path} does not exist: {folder} is not a complete checkpoint "
                               "written by tensorcanon.integrations.accelerate.save_state", filename=path)
    return api.load(path, map_location=map_location, verify=verify, limits=limits)


def _latest(accelerator: Accelerator) -> str:
    base = os.path.join(accelerator.project_dir, "checkpoints")
    folders = sorted((f for f in os.listdir(base) if _checkpoint_number(f) >= 0), key=_checkpoint_number) \
        if os.path.isdir(base) else []
    if not folders:
        raise MissingFileError(f"no checkpoint_<n> folder in {base} to resume from", filename=base)
    return os.path.join(base, folders[-1])


def _count(what: str, saved: int, now: int, hint: str) -> None:
    if saved != now:
        raise UsageError(f"the checkpoint holds {saved} {what}, this accelerator has {now}: {hint}")


def load_state(accelerator: Accelerator, input_dir: str | os.PathLike[str] | None = None, *,
               apply_settings: bool = True, strict_rng: bool = True, verify: bool = True,
               limits: Limits = DEFAULT) -> str:
    """Restore what :func:`save_state` wrote, without unpickling anything. Returns the folder.

    Call it after ``accelerator.prepare(...)`` and ``register_for_checkpointing``,
    with the same objects as when saving, on every process. Restores the models,
    optimizers, schedulers, GradScaler, registered objects, ``accelerator.step``,
    each prepared DataLoader's epoch and :class:`tensorcanon.ResumableSampler`
    position, then the determinism settings (``apply_settings=True`` puts the
    switches back; what still differs, such as versions, is reported as a
    :class:`~tensorcanon.training.determinism.DeterminismWarning`), and last every random
    generator (``strict_rng=True``: a part that cannot be restored raises
    :class:`tensorcanon.RngRestoreError` before anything changes). With no
    ``input_dir`` and automatic checkpoint naming, loads the latest checkpoint.

    Example::

        tensorcanon.integrations.accelerate.load_state(accelerator, "checkpoints/step_100")
    """
    _check_supported(accelerator)
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise UsageError("load_state needs input_dir (or ProjectConfiguration(automatic_checkpoint_naming=True))")
        folder = _latest(accelerator)
    else:
        folder = os.path.expanduser(os.fspath(input_dir))
    if not os.path.isdir(folder):
        raise MissingFileError(f"checkpoint folder {folder} does not exist", filename=folder)

    training = _load(folder, TRAINING, verify, limits)
    if type(training) is not dict or training.get("layout") != LAYOUT:
        raise FormatError(f"{os.path.join(folder, TRAINING)} is not a {LAYOUT} training state")
    process = _load(folder, _process_file(accelerator.process_index), verify, limits)
    if type(process) is not dict or set(process) != {"rng", "settings", "dataloaders"} \
            or not isinstance(process["rng"], RngState) or not isinstance(process["settings"], DeterminismSettings):
        raise FormatError(f"{os.path.join(folder, _process_file(accelerator.process_index))} is not a "
                          f"{LAYOUT} process state (an RngState, DeterminismSettings and DataLoader positions)")

    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, folder)  # a hook may load a model its own way and pop it
    _count("models", training["models"], len(models), "prepare the same models (and register the same hooks)")
    for i, m in enumerate(models):
        accelerator.unwrap_model(m).load_state_dict(_load(folder, _model_file(i), verify, limits))
    _count("optimizers", len(training["optimizers"]), len(accelerator._optimizers), "prepare the same optimizers")
    for opt, st in zip(accelerator._optimizers, training["optimizers"], strict=True):
        opt.load_state_dict(st)
    _count("schedulers", len(training["schedulers"]), len(accelerator._schedulers), "prepare the same schedulers")
    for sched, st in zip(accelerator._schedulers, training["schedulers"], strict=True):
        sched.load_state_dict(st)
    if (training["scaler"] is None) != (accelerator.scaler is None):
        raise UsageError("the checkpoint and this accelerator disagree on mixed precision: one has a "
                         "GradScaler state and the other none")
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(training["scaler"])
    _count("registered objects", len(training["custom_objects"]), len(accelerator._custom_objects),
           "call register_for_checkpointing with the same objects, in the same order")
    for obj, st in zip(accelerator._custom_objects, training["custom_objects"], strict=True):
        obj.load_state_dict(st)

    loaders = process["dataloaders"]
    _count("prepared DataLoaders", len(loaders), len(accelerator._dataloaders), "prepare the same DataLoaders")
    for dl, st in zip(accelerator._dataloaders, loaders, strict=True):
        s = sampler_of(dl)
        if (st["sampler"] is None) != (s is None):
            raise UsageError("a prepared DataLoader draws from a ResumableSampler now but did not when "
                             "saved, or the other way round")
        if s is not None:
            s.load_state_dict(st["sampler"])
        if hasattr(dl, "set_epoch"):
            # accelerate calls set_epoch(iteration) each time the loader is iterated: keep the two
            # in step, or a fresh loader's iteration 0 would send the sampler back to epoch 0.
            dl.set_epoch(s.epoch if s is not None else st["iteration"])
    accelerator.step = training["step"]
    accelerator.project_configuration.iteration = training["save_iteration"]

    _apply_settings(process["settings"], apply_settings)
    process["rng"].restore(strict=strict_rng)  # last: nothing may draw between this and training
    return folder


_apply_settings = apply_settings  # the keyword argument of load_state shadows the name


def track(dataloader: Any) -> Iterator[Any]:
    """Iterate a (prepared) DataLoader, counting each batch in its sampler's position.

    The DataLoader must draw from a :class:`tensorcanon.ResumableSampler` with
    a fixed batch size. Each batch is counted as it is handed to you, so a
    checkpoint saved after the optimizer step resumes at the next batch; when
    the loader is exhausted the epoch is finished (also with ``drop_last``) and
    the sampler moves to the next epoch.

    Example::

        for batch in tensorcanon.integrations.accelerate.track(loader):
            ...
    """
    sampler = sampler_of(dataloader)
    if sampler is None:
        raise UsageError("track(dataloader): the DataLoader must draw from a tensorcanon.ResumableSampler "
                         "(DataLoader(ds, sampler=sampler, generator=sampler.generator, ...))")
    bs = batch_size_of(dataloader)
    if bs is None:
        raise UsageError("track(dataloader) needs a DataLoader with a fixed batch_size")
    if isinstance(getattr(dataloader, "batch_sampler", None), BatchSamplerShard):
        raise UsageError(
            "track(dataloader): accelerate shards this DataLoader's batches across processes, so the "
            "sampler cannot count this process's samples. Do not prepare() it: build "
            "ResumableSampler(ds, num_replicas=accelerator.num_processes, rank=accelerator.process_index) "
            "and register it with accelerator.register_for_checkpointing(sampler)")
    # The epoch is read at the first batch: accelerate calls the sampler's set_epoch in __iter__.
    yield from sampler._count(dataloader, bs, None)
