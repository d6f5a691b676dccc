"""tensorcanon in Lightning: canonical checkpoints, exact resumption, no ``torch.load``.

Three pieces, for ``lightning.pytorch`` (the ``lightning`` package, 2.x):

- :class:`CanonicalCheckpointIO`, a ``CheckpointIO`` plugin: every checkpoint
  the Trainer writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) is a
  tensorcanon file, and ``fit(ckpt_path=...)``, ``validate``/``test``/``predict``
  read it back without pickle.
- :class:`ExactResume`, a callback that stores the random state
  (:class:`tensorcanon.RngState`), the determinism settings
  (:class:`tensorcanon.DeterminismSettings`) and the position of the training
  :class:`tensorcanon.ResumableSampler` in each checkpoint, restores them at the
  right moments of a resumed fit, advances the sampler batch by batch, and
  checks at fit start that the run's checkpoints can be saved at all.
- :func:`load_from_checkpoint`, ``Model.load_from_checkpoint`` without
  ``torch.load``.

Example::

    import lightning.pytorch as L
    import tensorcanon
    from tensorcanon.integrations.lightning import CanonicalCheckpointIO, ExactResume, load_from_checkpoint

    class Data(L.LightningDataModule):
        def setup(self, stage):
            self.ds = ...
            self.sampler = tensorcanon.ResumableSampler(self.ds, seed=1)   # made once, reused
        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=32, sampler=self.sampler, num_workers=2,
                              generator=self.sampler.generator)

    trainer = L.Trainer(plugins=[CanonicalCheckpointIO()], callbacks=[ExactResume()], deterministic=True)
    trainer.fit(model, datamodule=Data(), ckpt_path=last_or_None)
    model = load_from_checkpoint(Model, "epoch=2-step=30.ckpt")

docs/INTEGRATIONS.md explains what is saved, the hook order it relies on and the limits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import api
from ..format.digest import DEFAULT as _DEFAULT_ALGORITHM
from ..format.errors import FormatError, UnsupportedTypeError, UsageError
from ..format.limits import DEFAULT, Limits
from ..training.data import ResumableSampler
from ..training.determinism import DeterminismSettings, DeterminismWarning
from ..training.rng import RngState
from ._common import apply_settings, batch_size_of, check_saveable, cpu_when_missing, framework_import, sampler_of

with framework_import("lightning", "lightning"):
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.trainer.states import TrainerFn

__all__ = ["CanonicalCheckpointIO", "ExactResume", "check_checkpoint", "load_from_checkpoint"]

_M = TypeVar("_M", bound=pl.LightningModule | pl.LightningDataModule)
SamplerSpec = ResumableSampler | Callable[[pl.Trainer], ResumableSampler] | None


def _local(path: Any, what: str) -> str:
    p = os.fspath(path)
    if "://" in p:
        raise UsageError(f"{what}: CanonicalCheckpointIO writes local paths only, got {p!r}")
    return p


class CanonicalCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes and reads tensorcanon files.

    The whole checkpoint dict (weights, optimizer and scheduler states, loop
    and callback states, hyper-parameters) is saved canonically: the same state
    gives the same bytes and digest, and loading never unpickles. A value
    tensorcanon cannot save raises :class:`tensorcanon.UnsupportedTypeError`
    naming its path (``$["hyper_parameters"]["fn"]``); :class:`ExactResume`
    finds such values at fit start instead of at the first checkpoint.

    ``algorithm`` is the digest algorithm (``"xxh3-128"`` or ``"sha256"``);
    ``verify`` re-hashes every tensor on load; ``limits`` bounds what a loaded
    file may hold. ``weights_only`` passed by Lightning is accepted and has no
    effect: nothing is ever unpickled.

    Example::

        trainer = Trainer(plugins=[CanonicalCheckpointIO()])
    """

    def __init__(self, *, algorithm: str = _DEFAULT_ALGORITHM, verify: bool = True,
                 limits: Limits = DEFAULT) -> None:
        self.algorithm = algorithm
        self.verify = verify
        self.limits = limits

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise UsageError("CanonicalCheckpointIO.save_checkpoint takes no storage_options")
        p = _local(path, "save_checkpoint")
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        api.save(checkpoint, p, algorithm=self.algorithm, limits=self.limits)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        p = _local(path, "load_checkpoint")
        ckpt = api.load(p, map_location=map_location, verify=self.verify, limits=self.limits)
        if type(ckpt) is not dict:
            raise FormatError(f"{p} holds a {type(ckpt).__name__}, not a Lightning checkpoint dict")
        return ckpt

    def remove_checkpoint(self, path: Any) -> None:
        p = _local(path, "remove_checkpoint")
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def _checkpoint_io(trainer: pl.Trainer) -> Any:
    io: Any = trainer.strategy.checkpoint_io  # or a wrapper of one: anything with .checkpoint_io
    while not isinstance(io, CanonicalCheckpointIO) and getattr(io, "checkpoint_io", None) not in (None, io):
        io = io.checkpoint_io  # a wrapper such as AsyncCheckpointIO
    return io


def check_checkpoint(trainer: pl.Trainer) -> None:
    """Build the checkpoint this trainer would write and raise now if any value in it
    cannot be saved: an :class:`~tensorcanon.UnsupportedTypeError` naming its path, such as
    ``$["hyper_parameters"]["fn"]``, and how to fix it.

    :class:`ExactResume` calls it at fit start. It uses Lightning's own checkpoint
    assembly, so every hook that adds to a checkpoint (``on_save_checkpoint`` of
    the module and the callbacks) runs once, on a throwaway dict. No tensor is
    hashed or copied.

    Example::

        class CheckSaveable(L.Callback):            # what ExactResume(validate=True) does
            def on_fit_start(self, trainer, pl_module):
                check_checkpoint(trainer)
    """
    ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    try:
        check_saveable(ckpt, "a checkpoint of this run")
    except UnsupportedTypeError as e:
        m = _HPARAM.match(e.path or "")
        if m is None:
            raise
        name = json.loads(m.group(1))
        raise UnsupportedTypeError(
            f"{e}. Found before training. To keep it out of checkpoints, call "
            f"self.save_hyperparameters(ignore=[{name!r}]) and pass it to the constructor yourself when "
            "loading", path=e.path) from None


_HPARAM = re.compile(r'^\$\["hyper_parameters"\]\[("(?:[^"\\]|\\.)*")\]')


_STATE_KEYS = {"rng", "settings", "sampler"}  # and "rng_by_rank" when several processes saved it


class ExactResume(pl.Callback):
    """Saves and restores what a bit-exact resume needs beyond the weights.

    Each checkpoint gets, under this callback's state key: the random state of
    every generator (:class:`tensorcanon.RngState`), the determinism settings
    (:class:`tensorcanon.DeterminismSettings`) and the training sampler's
    position (:meth:`tensorcanon.ResumableSampler.state_dict`); with several
    processes, every rank's random state too (gathered from all ranks: every rank
    must build each checkpoint, as Lightning's own saving does), and each rank
    resumes its own. On resume:

    - the sampler position is restored when the checkpoint is loaded, before
      Lightning builds the training iterator (which reads the sampler ahead
      when the DataLoader has workers);
    - the settings are applied then too, with a
      :class:`~tensorcanon.training.determinism.DeterminismWarning` for each one that still
      differs (versions, hardware);
    - the random state is restored in ``on_train_start``, the last hook before
      the first batch is fetched.

    During training the sampler counts each batch in ``on_train_batch_start``
    (the epoch's last batch moves it to the next epoch), so a checkpoint taken
    at any batch resumes at the next one. At fit start it checks that the
    Trainer uses :class:`CanonicalCheckpointIO`, that the training DataLoader
    draws from the sampler and its ``generator``, and (``validate=True``) that
    the checkpoint can be saved, so a bad hyper-parameter fails in seconds.

    ``sampler`` is the :class:`~tensorcanon.ResumableSampler` (or a callable
    ``trainer -> sampler``). When None, the one attribute of the DataModule or
    the LightningModule holding a ResumableSampler is used: it must exist
    before ``train_dataloader()`` is called on resume, so create it once (in
    ``__init__`` or ``setup``) and reuse it in ``train_dataloader()``.

    Example::

        trainer = Trainer(plugins=[CanonicalCheckpointIO()], callbacks=[ExactResume()])
    """

    def __init__(self, sampler: SamplerSpec = None, *, apply_settings: bool = True,
                 validate: bool = True) -> None:
        if sampler is not None and not isinstance(sampler, ResumableSampler) and not callable(sampler):
            raise UsageError(f"ExactResume(sampler=...) takes a tensorcanon.ResumableSampler or a callable "
                             f"trainer -> sampler, not {type(sampler).__name__}")
        self._spec = sampler
        self.apply_settings = apply_settings
        self.validate = validate
        self._sampler: ResumableSampler | None = None
        self._batch_size: int | None = None
        self._pending_rng: RngState | None = None

    # ------------------------------------------------------------ finding the sampler

    def _find(self, trainer: pl.Trainer) -> ResumableSampler | None:
        if isinstance(self._spec, ResumableSampler):
            return self._spec
        if self._spec is not None:
            s = self._spec(trainer)
            if not isinstance(s, ResumableSampler):
                raise UsageError(f"ExactResume(sampler=callable) returned {type(s).__name__}, "
                                 "not a tensorcanon.ResumableSampler")
            return s
        found: dict[int, tuple[str, ResumableSampler]] = {}
        # (Lightning's data connector sets trainer.datamodule; the Trainer class does not declare it.)
        for owner in (getattr(trainer, "datamodule", None), trainer.lightning_module):
            for name, v in vars(owner).items() if owner is not None else ():
                if isinstance(v, ResumableSampler):
                    found.setdefault(id(v), (f"{type(owner).__name__}.{name}", v))
        if len(found) > 1:
            names = ", ".join(n for n, _ in found.values())
            raise UsageError(f"ExactResume found several ResumableSamplers ({names}); pass the training one "
                             "as ExactResume(sampler=...)")
        return next(iter(found.values()))[1] if found else None

    def _attach(self, trainer: pl.Trainer) -> None:
        """Check the training DataLoader and remember its sampler and batch size."""
        loader = trainer.train_dataloader
        used = sampler_of(loader)
        if used is None:
            raise UsageError(
                "ExactResume needs the training DataLoader to draw from a tensorcanon.ResumableSampler "
                "(DataLoader(ds, sampler=sampler, generator=sampler.generator, ...)); found "
                f"{type(getattr(loader, 'sampler', loader)).__name__}")
        expected = self._find(trainer)
        if expected is None:
            raise UsageError(
                "ExactResume: the training sampler is not reachable when a checkpoint is loaded (that "
                "happens before train_dataloader() runs). Create the ResumableSampler once, as an attribute "
                "of your LightningDataModule or LightningModule (in __init__ or setup), and reuse it in "
                "train_dataloader(); or pass ExactResume(sampler=...)")
        if used is not expected:
            raise UsageError(
                "ExactResume: the training DataLoader uses another ResumableSampler than the one restored "
                "from checkpoints (a new one made in train_dataloader()?). Reuse one sampler object")
        if getattr(loader, "generator", None) is not used.generator:
            raise UsageError(
                "ExactResume: pass generator=sampler.generator to the training DataLoader; otherwise each "
                "iterator draws its worker seed from the global torch RNG, and a resumed run gets other "
                "worker seeds")
        bs = batch_size_of(loader)
        if bs is None:
            raise UsageError("ExactResume needs a training DataLoader with a fixed batch_size")
        if trainer.world_size > 1 and getattr(used, "num_replicas", 1) != trainer.world_size:
            raise UsageError(
                f"ExactResume: {trainer.world_size} processes train, but the sampler is not sharded for "
                "them: build it with ResumableSampler(ds, num_replicas=trainer.world_size, "
                "rank=trainer.global_rank) and Trainer(use_distributed_sampler=False)")
        self._sampler, self._batch_size = used, bs

    # ------------------------------------------------------------ hooks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(_checkpoint_io(trainer), CanonicalCheckpointIO):
            raise UsageError("ExactResume saves values only tensorcanon can write: add "
                             "plugins=[CanonicalCheckpointIO()] to the Trainer")
        if self.validate:
            check_checkpoint(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer)
        if self._pending_rng is not None:
            rng, self._pending_rng = self._pending_rng, None
            if self._sampler is not None and self._sampler.position > 0:
                self._mark_resumable(trainer.train_dataloader)
            rng.restore()

    # Resumed mid-epoch, Lightning warns "your dataloader is not resumable" unless the training DataLoader
    # has state_dict and load_state_dict (it checks after on_train_start, before the first batch). Here it
    # is resumable: the sampler restored its position. So the DataLoader gets the two methods until that
    # first batch, and only then: a DataLoader holding them when a checkpoint is saved would have its
    # (empty) state saved, and a resumed fit, whose new DataLoader lacks them, would refuse that state.
    _marked: Any = None

    def _mark_resumable(self, loader: Any) -> None:
        if not hasattr(loader, "state_dict") and not hasattr(loader, "load_state_dict"):
            loader.state_dict, loader.load_state_dict = dict, _load_nothing
            self._marked = loader

    def _unmark(self) -> None:
        loader, self._marked = self._marked, None
        if loader is not None:
            del loader.state_dict, loader.load_state_dict

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer)  # the loader may be new (reload_dataloaders_every_n_epochs)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._unmark()
        sampler = self._sampler
        if sampler is None or self._batch_size is None:
            return
        epoch = sampler.epoch
        sampler.advance(self._batch_size)  # counting the epoch's last sample moves to the next epoch
        if sampler.epoch == epoch and batch_idx + 1 >= trainer.num_training_batches:
            # Lightning ends the epoch after this batch with samples left (drop_last, limit_train_batches)
            sampler.finish_epoch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is not None:
            # Normally the last batch has moved the sampler on already; when the fit stops
            # mid-epoch (max_steps) Lightning counts the epoch as done, and so does the sampler.
            # Doing it here, not in Lightning's set_epoch at the next epoch start, matters with
            # reload_dataloaders_every_n_epochs: the next loader's iterator (and its workers, which
            # read the sampler ahead) is made before that call.
            self._sampler.set_epoch(trainer.current_epoch + 1)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        rng = RngState.capture()
        state = {"rng": rng, "settings": DeterminismSettings.capture(),
                 "sampler": self._sampler.state_dict() if self._sampler is not None else None}
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:
            state["rng_by_rank"] = _every_rank(trainer, rng)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if type(state_dict) is not dict or not _STATE_KEYS <= set(state_dict) <= _STATE_KEYS | {"rng_by_rank"}:
            raise FormatError("ExactResume state in the checkpoint must be a dict with the keys "
                              "'rng', 'settings' and 'sampler' (and 'rng_by_rank' when several "
                              "processes saved it)")
        rng, settings, sampler_state = state_dict["rng"], state_dict["settings"], state_dict["sampler"]
        by_rank = state_dict.get("rng_by_rank")
        if not isinstance(rng, RngState) or not isinstance(settings, DeterminismSettings):
            raise FormatError("ExactResume state: 'rng' must be an RngState and 'settings' "
                              "DeterminismSettings")
        if by_rank is not None and (type(by_rank) is not list or len(by_rank) < 2
                                    or not all(isinstance(r, RngState) for r in by_rank)):
            raise FormatError("ExactResume state: 'rng_by_rank' must be a list of an RngState per rank")
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # validate/test/predict from a checkpoint: nothing to resume
        apply_settings(settings, self.apply_settings)
        rng = _rank_state(rng, by_rank, trainer.world_size, trainer.global_rank)
        if sampler_state is not None:
            sampler = self._find(trainer)
            if sampler is None:
                raise UsageError(
                    "the checkpoint holds a sampler position, but ExactResume cannot find the "
                    "ResumableSampler at checkpoint-load time (before train_dataloader() runs): make it "
                    "an attribute of your LightningDataModule or LightningModule (in __init__ or setup), "
                    "or pass ExactResume(sampler=...)")
            sampler.load_state_dict(sampler_state)
            self._sampler = sampler
        self._pending_rng = rng

    # Lightning gives load_state_dict no trainer: remember it when the Trainer sets us up.
    _trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unmark()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unmark()
        self._trainer = None
        self._pending_rng = None


def _load_nothing(state: dict) -> None:
    """The training DataLoader's ``load_state_dict`` while :class:`ExactResume` marks it resumable."""


def _every_rank(trainer: pl.Trainer, rng: RngState) -> list[RngState]:
    """Every rank's random state, in rank order, gathered to each rank.

    A collective: every rank must call it, as every rank builds each checkpoint in
    Lightning (``trainer.save_checkpoint`` runs on all of them; rank 0 writes). The
    states travel as tensorcanon bytes (no pickle) in uint8 tensors, padded to one size.
    """
    data = torch.frombuffer(bytearray(api.dumps(rng)), dtype=torch.uint8)
    device = trainer.strategy.root_device
    counts = trainer.strategy.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=device))
    sizes = [int(n) for n in counts.reshape(-1).tolist()]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    gathered = trainer.strategy.all_gather(padded).reshape(len(sizes), -1).cpu()
    states = [api.loads(gathered[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]
    if not all(isinstance(r, RngState) for r in states):
        raise FormatError("ExactResume: a rank sent something other than its random state")
    return states


def _rank_state(rng: RngState, by_rank: list[RngState] | None, world_size: int, rank: int) -> RngState:
    """The random state this rank resumes: its own when the checkpoint holds one per rank of
    the same world size; else the one state it holds, with a warning when that is not exact."""
    if by_rank is not None and len(by_rank) == world_size:
        return by_rank[rank]
    if by_rank is not None:
        warnings.warn(f"ExactResume: the checkpoint was saved by {len(by_rank)} processes and is resumed "
                      f"by {world_size}; every process resumes rank 0's random state, so the resume is not "
                      "bit-exact", DeterminismWarning, stacklevel=3)
    elif world_size > 1:
        warnings.warn(f"ExactResume: the checkpoint holds one random state (saved by one process, or "
                      f"by an earlier tensorcanon); all {world_size} processes resume it, so the resume "
                      "is not bit-exact if the ranks drew random numbers differently",
                      DeterminismWarning, stacklevel=3)
    return rng


def load_from_checkpoint(cls: type[_M], checkpoint_path: str | os.PathLike[str], *,
                         map_location: Any = None, strict: bool | None = None, verify: bool = True,
                         limits: Limits = DEFAULT, **kwargs: Any) -> _M:
    """``cls.load_from_checkpoint(path)`` for a tensorcanon checkpoint, without ``torch.load``.

    Builds the LightningModule (or LightningDataModule) from the saved
    hyper-parameters, overridden by ``kwargs``, calls its
    ``on_load_checkpoint`` and loads the weights, as Lightning's own
    ``load_from_checkpoint`` does; only the file reading differs. By default
    tensors saved on a device this machine lacks are loaded on the CPU, and the
    model is moved to the device of its first tensor.

    Example::

        model = load_from_checkpoint(LitModel, "checkpoints/last.ckpt", map_location="cpu")
    """
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    if not isinstance(cls, type) or not issubclass(cls, (pl.LightningModule, pl.LightningDataModule)):
        raise UsageError(f"load_from_checkpoint takes a LightningModule or LightningDataModule class, "
                         f"not {cls!r}")
    path = os.fspath(checkpoint_path)
    ckpt = api.load(path, map_location=cpu_when_missing if map_location is None else map_location,
                    verify=verify, limits=limits)
    if type(ckpt) is not dict or (issubclass(cls, pl.LightningModule) and "state_dict" not in ckpt):
        raise FormatError(f"{path} is not a Lightning checkpoint (a dict with a 'state_dict' entry)")
    ckpt = _pl_migrate_checkpoint(ckpt, checkpoint_path=path)
    hp = ckpt.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    hp.update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        data = _load_state(cls, ckpt, **kwargs)
        assert isinstance(data, cls)  # _load_state builds a cls
        return data
    model = _load_state(cls, ckpt, strict=strict, **kwargs)
    assert isinstance(model, cls) and isinstance(model, pl.LightningModule)  # _load_state builds a cls
    import torch

    first = next((t for t in ckpt["state_dict"].values() if isinstance(t, torch.Tensor)), None)
    if first is not None:
        model.to(first.device)  # in place (a Module's to() returns the module itself)
    return model
