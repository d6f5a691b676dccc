"""Traces (docs/TRACE.md) where the training loop belongs to a framework: Lightning, accelerate,
the transformers ``Trainer`` (``CanonicalTrainer`` included). Importing this module imports no
framework; each factory imports its own when called.

- :func:`lightning_callback`: a Lightning callback that traces ``fit``: the batch of every
  training step, the random state, and (global optimizer hooks) every optimizer step; each rank
  its own file.
- :func:`transformers_callback`: a ``TrainerCallback`` doing the same for a ``Trainer``; the
  batch is what the model's forward receives first in each step.
- :func:`accelerate_trace`: ``tensorcanon.trace`` with the accelerator's rank and world size and
  the unwrapped model; the loop calls ``tr.step(batch)`` as in a plain loop.

Example::

    trainer = L.Trainer(callbacks=[lightning_callback("run.trace", level="modules")])
    trainer.fit(model, loader)                 # run.trace, or run.rank1.trace on rank 1
"""

from __future__ import annotations

import os
from typing import Any

from ..format import digest as digests
from ..trace.recorder import Recorder
from ._common import framework_import

__all__ = ["lightning_callback", "transformers_callback", "accelerate_trace"]


class _Session:
    """One traced run: the recorder, entered when training starts and left when it ends."""

    def __init__(self, path: str | os.PathLike[str], level: str, algorithm: str) -> None:
        self.path, self.level, self.algorithm = os.fspath(path), level, algorithm
        self.recorder: Recorder | None = None

    def start(self, model: Any, rank: int, world_size: int) -> None:
        self.stop(clean=False)
        self.recorder = Recorder(self.path, self.level, model=model, algorithm=self.algorithm, rank=rank,
                                 world_size=world_size).__enter__()

    def step(self, batch: Any) -> None:
        if self.recorder is not None:
            self.recorder.step(batch)

    def stop(self, clean: bool = True) -> None:
        if self.recorder is not None:
            r, self.recorder = self.recorder, None
            r.__exit__(None if clean else RuntimeError, None, None)


def lightning_callback(path: str | os.PathLike[str], level: str = "steps", *,
                       algorithm: str = digests.DEFAULT) -> Any:
    """A ``lightning.pytorch.Callback`` tracing ``fit`` to ``path`` (``model`` is the LightningModule)."""
    with framework_import("lightning", "lightning"):
        import lightning.pytorch as pl

    class TraceCallback(pl.Callback):
        def __init__(self) -> None:
            self.session = _Session(path, level, algorithm)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.session.start(pl_module, trainer.global_rank, trainer.world_size)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.session.step(batch)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self.session.stop()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self.session.stop(clean=False)  # the trace keeps what it wrote, with no end frame

    return TraceCallback()


def transformers_callback(path: str | os.PathLike[str], level: str = "steps", *,
                          algorithm: str = digests.DEFAULT) -> Any:
    """A ``transformers.TrainerCallback`` tracing ``train`` to ``path``. A step's batch is the
    keyword arguments of the model's first forward call in that step (what the Trainer feeds it)."""
    with framework_import("transformers", "transformers"):
        from transformers import TrainerCallback

    class TraceCallback(TrainerCallback):
        def __init__(self) -> None:
            self.session = _Session(path, level, algorithm)
            self.pending = False
            self.handle: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.session.start(model, args.process_index, args.world_size)

            def first_forward(module: Any, fargs: Any, fkwargs: Any) -> None:
                if self.pending:
                    self.pending = False
                    self.session.step({"args": list(fargs), **fkwargs} if fargs else fkwargs)

            self.handle = model.register_forward_pre_hook(first_forward, with_kwargs=True, prepend=True)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.pending = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.handle is not None:
                self.handle.remove()
                self.handle = None
            self.session.stop()

    return TraceCallback()


def accelerate_trace(accelerator: Any, path: str | os.PathLike[str], level: str = "steps", *, model: Any = None,
                     optimizer: Any = None, algorithm: str = digests.DEFAULT) -> Recorder:
    """``tensorcanon.trace`` for an accelerate loop: this process's rank and the world size come from
    ``accelerator``, ``model`` is unwrapped (DDP), ``optimizer`` the prepared one's inner optimizer."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return Recorder(path, level, model=None if model is None else accelerator.unwrap_model(model),
                    optimizer=inner, algorithm=algorithm, rank=accelerator.process_index,
                    world_size=accelerator.num_processes)
