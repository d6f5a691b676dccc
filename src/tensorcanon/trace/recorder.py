"""The recorder: ``tensorcanon.trace(path, level=...)``, a context manager with a ``step`` marker.

It writes one record per tensor a training step touches (layout.py), in execution order:

- ``steps``: at ``step(batch)``, the batch's tensors (phase data) and the random state of torch,
  numpy, ``random`` and initialized CUDA devices (phase rng); ``loss(value)``; after each optimizer
  step, every parameter and every optimizer state tensor (phase optimizer).
- ``modules``: also each module's forward inputs and outputs (forward pre-hooks and hooks on every
  module of ``model``), by module path and call index, and every parameter's gradient that the
  optimizer step used (phase backward, recorded after the step).
- ``ops``: also every ATen operation of a step's forward, backward and optimizer step (a
  ``TorchDispatchMode``; from ``step()`` until an optimizer step ends, never between it and the
  next ``step()``, where a loop fetches its next batch): its tensor inputs before it runs, its
  outputs after, and its arguments that are not tensors as a text record.

Every tensor is hashed when it is met, on the thread that meets it, and never kept: an in-place
operation may change it the next moment.
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..format import digest as digests, optional
from ..format.errors import FormatError, UsageError
from . import capture as capture_module, layout
from .layout import Record
from .ops import plain
from .summary import detached, summarize, summarize_text
from .values import args_text, is_tensor as _is_tensor, leaves as _leaves
from .worker import Worker

OFF_THREAD = 64 << 10
"""Tensors of this many bytes or more are copied and hashed on the worker thread (worker.py)."""

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = optional.torch_module(globals())
    np = optional.numpy_module(globals())

def rank_path(path: str, rank: int, world_size: int) -> str:
    """The trace path of ``rank``: ``{rank}`` in ``path`` replaced, else (several ranks)
    ``run.trace`` -> ``run.rank1.trace``."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


class ResumeWarning(UserWarning):
    """A run resumed with ``resume_at`` holds other parameters or optimizer state than its trace
    recorded after the step before."""


ENV_PATH, ENV_LEVEL = "TENSORCANON_TRACE", "TENSORCANON_TRACE_LEVEL"
"""Environment variables that, when set, replace the path and the level given to :func:`trace`."""


class Recorder:
    """Records a run's tensors to a trace file; made by :func:`trace` (see it for the arguments)."""

    def __init__(self, path: str | os.PathLike[str], level: str = "steps", *, model: Any = None,
                 optimizer: Any = None, algorithm: str = digests.DEFAULT, rank: int | None = None,
                 world_size: int | None = None, resume_at: int | None = None, capture: str | None = None,
                 off_thread: bool = False) -> None:
        # `tensorcanon repro --trace LEVEL` sends each run's trace to a file of its own, at its level
        path = os.environ.get(ENV_PATH) or path
        level = os.environ.get(ENV_LEVEL) or level
        if level not in layout.LEVELS:
            raise UsageError(f"trace level {level!r} is not one of {', '.join(layout.LEVELS)}")
        if level != "steps" and model is None:
            raise UsageError(f"trace level {level!r} records the modules of a model: pass model=")
        self.level = level
        self.kinds = layout.kinds_of(level)
        self.algorithm = digests.check(algorithm)
        world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if not (world >= 1 and 0 <= self.rank < world):
            raise UsageError(f"rank {self.rank} is not a rank of world size {world}")
        self.world_size = world
        self.path = rank_path(os.fspath(path), self.rank, world)
        self.model = model
        self.optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) \
            else [optimizer]
        self.resume_at = resume_at
        capture = os.environ.get(capture_module.ENV) or capture
        self.capture = capture_module.parse(capture) if capture else None
        self._captured: dict[str, Any] = {}
        self._captured_texts: dict[str, str] = {}
        self.step_index = -1 if resume_at is None else resume_at - 1
        self.phase = "forward"
        self._in_step = False
        self._ops_on = False  # level ops: from step() until an optimizer step ends (see ops_recorded)
        self._calls: dict[tuple[Any, ...], int] = {}
        self._scope: list[str] = []
        self._local = threading.local()
        self._pid = os.getpid()
        self._fresh: dict[int, Any] = {}  # ops.py: tensors an empty op made, not written since
        self._seen: dict[int, tuple[Any, int, Any]] = {}  # id -> (weak reference, version, content), this step
        self._expected: dict[tuple[str, str, str], bytes] = {}  # resume check: the state after step resume_at - 1
        self._lock = threading.RLock()
        self._handles: list[Any] = []
        self._mode: Any = None
        self._writer: layout.Writer | None = None
        self._worker: Worker | None = None
        self.off_thread = off_thread
        self._param_names: dict[int, str] = {}
        self._opt_index: dict[int, int] = {}

    # ------------------------------------------------------------------ opening and closing

    def __enter__(self) -> Recorder:
        self._open()
        try:
            self._install()
        except BaseException:
            self._close(clean=False)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._close(clean=exc_type is None)

    def _open(self) -> None:
        header = layout.Header(self.level, self.algorithm, self.rank, self.world_size)
        if self.resume_at is None:
            fh = open(self.path, "wb", buffering=1 << 20)
            fh.write(layout.MAGIC)
            self._writer = layout.Writer(fh)
            self._writer.frame(__import__("msgpack").packb(header.payload()))
        else:
            offset, check, count = self._resume_point(header)
            fh = open(self.path, "r+b", buffering=1 << 20)
            fh.truncate(offset)
            fh.seek(offset)
            self._writer = layout.Writer(fh, previous=check, count=count)
        self._writer.fh.flush()
        self._write_facts()
        if self.off_thread:
            self._worker = Worker(self._write_now, self._flush_now, self.algorithm)

    def _resume_point(self, header: layout.Header) -> tuple[int, int, int]:
        """Where the records of steps before ``resume_at`` end in the existing trace: (offset, check
        of the frame before, records before)."""
        assert self.resume_at is not None
        if not os.path.exists(self.path):
            raise UsageError(f"resume_at={self.resume_at}: there is no trace at {self.path} to continue; "
                             "resume_at continues the trace of the run that was stopped")
        with layout.Reader(self.path, strict=False) as r:
            if (r.header.level, r.header.algorithm) != (header.level, header.algorithm):
                raise UsageError(f"{self.path} is a {r.header.level} trace with {r.header.algorithm} digests; "
                                 f"it cannot be continued at level {header.level} with {header.algorithm}")
            offset, check, count = r.offset, r.tail.check, 0
            for rec in r:
                if rec.step >= self.resume_at:
                    break
                offset, check, count = r.offset, r.tail.check, count + 1
                if rec.step == self.resume_at - 1 and rec.kind in ("param", "optim"):
                    self._expected[(rec.kind, rec.name, rec.role)] = rec.digest
        return offset, check, count

    def _check_resumed_state(self) -> None:
        """On the first step after ``resume_at``: the parameters and optimizer state this process
        holds against those the trace recorded after the step before (a resume check; what differs
        is said in a :class:`ResumeWarning` and kept in ``PATH.run.json``)."""
        expected, self._expected = self._expected, {}
        if not expected:
            return
        now: dict[tuple[str, str, str], bytes] = {}
        opts = self.optimizers
        for opt in opts:
            for name, p in self._names(opt):
                now[("param", name, "value")] = summarize(p, self.algorithm)[2]
                for key, v in (opt.state.get(p) or {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        v = torch.tensor(float(v), dtype=torch.float64)
                    if _is_tensor(v):
                        now[("optim", name, str(key))] = summarize(v, self.algorithm)[2]
        if not opts and self.model is not None:
            for name, p in self.model.named_parameters():
                now[("param", name, "value")] = summarize(p, self.algorithm)[2]
        kinds = {k for k, _, _ in now} | ({"optim"} if opts else set())
        problems = []
        for key, digest in sorted(expected.items()):
            if key[0] not in kinds:
                continue
            got = now.get(key)
            if got is None:
                problems.append(f"{'optimizer state' if key[0] == 'optim' else 'parameter'} {key[1]} "
                                f"{key[2]} is missing")
            elif got != digest:
                problems.append(f"{'optimizer state' if key[0] == 'optim' else 'parameter'} {key[1]} {key[2]} "
                                "differs")
        if problems:
            assert self.resume_at is not None
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            warnings.warn(f"{self.path}: resumed at step {self.resume_at}, this process's state is not what the "
                          f"trace recorded after step {self.resume_at - 1}: {shown} (the checkpoint does not hold "
                          "the run's state, or it was not restored)", ResumeWarning, stacklevel=3)

    def _write_facts(self) -> None:
        """The run's facts, kept beside the trace (never compared): ``PATH.run.json``."""
        from ..training.determinism import DeterminismSettings

        settings = DeterminismSettings.capture()
        facts = {"pid": os.getpid(), "argv": sys.argv, "python": sys.version.split()[0],
                 "host": platform.node(), "resume_at": self.resume_at,
                 "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(settings).items()}}
        side = self.path + ".run.json"
        runs: list[Any] = []
        if self.resume_at is not None and os.path.exists(side):
            try:
                with open(side, encoding="utf-8") as f:
                    old = json.load(f)
                runs = list(old["runs"]) if isinstance(old, dict) and isinstance(old.get("runs"), list) else []
            except (OSError, ValueError):
                runs = []
        with open(side, "w", encoding="utf-8") as f:
            json.dump({"trace": os.path.basename(self.path), "runs": [*runs, facts]}, f, indent=1, default=str)

    def _install(self) -> None:
        if self.model is not None:
            for name, p in self.model.named_parameters():
                self._param_names.setdefault(id(p), name)
        if self.optimizers:
            for opt in self.optimizers:
                self._handles.append(opt.register_step_pre_hook(self._before_optimizer))
                self._handles.append(opt.register_step_post_hook(self._after_optimizer))
        else:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer))
            self._handles.append(register_optimizer_step_post_hook(self._after_optimizer))
        if "module" in self.kinds:
            for path, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._module_pre(path), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._module_post(path), with_kwargs=True))
        if "op" in self.kinds:
            from .ops import make_mode

            self._mode = make_mode(self)
            self._mode.__enter__()

    def _save_capture(self) -> None:
        if self.capture is not None and (self._captured or self._captured_texts):
            spec = "|".join(map(str, self.capture))
            capture_module.save(self.path, spec, self._captured, self._captured_texts)
            self._captured, self._captured_texts = {}, {}

    def _close(self, clean: bool) -> None:
        failed: BaseException | None = None
        with self._busy():
            if self._mode is not None:  # collectives not yet recorded (a failed run waits for none)
                try:
                    self._mode.flush(wait=clean)
                except BaseException as e:  # noqa: BLE001 (raised once the mode and the hooks are gone)
                    self._mode.flush(wait=False)
                    failed, clean = e, False
            self._save_capture()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._worker is not None:
            worker, self._worker = self._worker, None
            try:
                worker.stop()
            except BaseException:
                clean = False
                if self._writer is not None:
                    self._writer.fh.close()
                    self._writer = None
                raise
        if self._writer is not None:
            w, self._writer = self._writer, None
            try:
                if clean:
                    w.end()
                else:
                    w.fh.flush()
            finally:
                w.fh.close()
        if failed is not None:
            raise failed

    # ------------------------------------------------------------------ the markers

    def step(self, batch: Any = None) -> None:
        """Mark the start of a training step, with its batch (recorded, phase data), then the random
        state (phase rng). Call it once per step, before the forward pass."""
        if self._writer is None:
            raise UsageError("trace.step() is called outside its `with tensorcanon.trace(...)` block")
        with self._busy():
            if self._worker is not None:  # what the steps before wrote becomes a valid prefix on disk
                self._worker.put_flush()
            else:
                self._writer.fh.flush()
            if self._mode is not None:  # the step before: collectives not yet recorded
                self._mode.flush()
            self._save_capture()
            self.step_index += 1
            self._calls.clear()
            self._fresh.clear()
            self._seen.clear()
            self._in_step = True
            self._ops_on = True
            if batch is not None:
                for path, leaf in self._tensor_leaves(batch, "batch"):
                    self._put("data", "batch", "", "batch", path, leaf)
            for name, value in self._rng_states():
                self._put("rng", "rng", "", name, "state", value)
            if self._expected:
                self._check_resumed_state()
            self.phase = "forward"

    def loss(self, value: Any) -> Any:
        """Record the step's loss (kind loss), and return it."""
        if self._in_step:
            with self._busy():
                self._put(self.phase, "loss", "", "loss", "value", value)
        return value

    # ------------------------------------------------------------------ recording

    class _Busy:
        __slots__ = ("local",)

        def __init__(self, local: threading.local) -> None:
            self.local = local

        def __enter__(self) -> None:
            self.local.busy = getattr(self.local, "busy", 0) + 1

        def __exit__(self, *exc: object) -> None:
            self.local.busy -= 1

    def _busy(self) -> Recorder._Busy:
        """While recording, the recorder's own torch calls are not recorded as ops."""
        return Recorder._Busy(self._local)

    def busy(self) -> bool:
        """True while the recorder records (its own torch calls are not ops), and always in a
        process forked from the one that traces (a DataLoader worker): a child records nothing and
        never writes to the parent's trace."""
        return self._pid != os.getpid() or bool(getattr(self._local, "busy", 0))

    def ops_recorded(self) -> bool:
        """Whether an op dispatched now is recorded (level ops): from ``step()`` until the end of an
        optimizer step, and again from the start of another optimizer step until its end. The ops
        between an optimizer step and the next ``step()`` are the loop's own (fetching the next
        batch: with DataLoader workers, in the order they answer), not the step's."""
        return self._in_step and self._ops_on and not self.busy()

    def call_index(self, phase: str, kind: str, scope: str, name: str) -> int:
        key = (phase, kind, scope, name)
        with self._lock:
            n = self._calls.get(key, 0)
            self._calls[key] = n + 1
        return n

    def _put(self, phase: str, kind: str, scope: str, name: str, role: str, value: Any,
             call: int | None = None) -> None:
        if _is_tensor(value):
            value = plain(value)  # a DTensor: its local shard
            mode = self._mode
            if mode is not None and mode.pending:  # a collective writing it: recorded first, once complete
                mode.settle((value,))
        if call is None:
            call = self.call_index(phase, kind, scope, name)
        if self.capture is not None and (self.step_index, kind, scope, name, call) == self.capture:
            if _is_tensor(value):
                self._captured[role] = value.detach().to("cpu", copy=True)
            else:
                self._captured_texts[role] = value if isinstance(value, str) else args_text(value)
        if _is_tensor(value):
            worker = self._worker
            if worker is not None and value.numel() * value.element_size() >= OFF_THREAD:
                job = detached(value)
                if job is not None:
                    worker.put_job((self.step_index, phase, kind, scope, name, call, role), job)
                    return
            content = self._summary(value, role.startswith("in"))
        else:
            text = value if isinstance(value, str) else args_text(value)
            content = summarize_text(text[:layout.MAX_TEXT], self.algorithm)
        self.write(Record(self.step_index, phase, kind, scope, name, call, role, *content))

    def _summary(self, t: Any, reuse: bool) -> tuple[str, tuple[int, ...], bytes, float, str]:
        """The record content of ``t``. Within a step, an input met again unchanged (the same
        object, the same version counter: an op's output as the next op's input, a weight used by
        several ops) is not hashed again (``reuse``). Outputs are always hashed: an in-place op's
        version counter is bumped only after the dispatch mode has seen its output."""
        try:
            version = t._version
        except (RuntimeError, AttributeError):  # inference tensors have no version counter
            return summarize(t, self.algorithm)
        seen = self._seen.get(id(t)) if reuse else None
        if seen is not None and seen[1] == version and seen[0]() is t:
            return seen[2]
        content = summarize(t, self.algorithm)
        if t.numel() >= 1024:
            try:
                self._seen[id(t)] = (weakref.ref(t), version, content)
            except TypeError:
                pass
        return content

    def write(self, r: Record) -> None:
        if self._worker is not None:
            self._worker.put_record(r)
        else:
            self._write_now(r)

    def _write_now(self, r: Record) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.record(r)

    def _flush_now(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.fh.flush()

    def _tensor_leaves(self, value: Any, root: str) -> Iterator[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        _leaves(value, "", out)
        for path, leaf in out:
            if isinstance(leaf, np.ndarray):
                leaf = torch.from_numpy(np.ascontiguousarray(leaf))
            yield (f"{root}.{path}" if path else root), leaf

    def _rng_states(self) -> Iterator[tuple[str, Any]]:
        yield "torch", torch.get_rng_state()
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        extra = np.array([pos, has_gauss], dtype="<i8").view(np.uint8)
        yield "numpy", torch.from_numpy(np.concatenate([np.asarray(keys, dtype="<u4").view(np.uint8), extra,
                                                        np.array([gauss], dtype="<f8").view(np.uint8)]))
        version, internal, gauss_next = random.getstate()
        yield "random", torch.tensor(list(internal), dtype=torch.int64)
        yield "random.gauss_next", gauss_next
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                yield f"cuda:{i}", s

    # ------------------------------------------------------------------ modules

    def _module_pre(self, path: str) -> Any:
        def pre(module: Any, args: Any, kwargs: Any) -> None:
            if not self._in_step or self.busy():
                return
            with self._busy():
                phase = self.phase
                call = self.call_index(phase, "module", "", path)
                self._scope.append(path)
                self._local.stack = [*getattr(self._local, "stack", []), call]
                for role, leaf in self._tensor_leaves((args, kwargs) if kwargs else args, "in"):
                    if _is_tensor(leaf):
                        self._put(phase, "module", "", path, role, leaf, call)
        return pre

    def _module_post(self, path: str) -> Any:
        def post(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            if not self._in_step or self.busy():
                return
            stack = getattr(self._local, "stack", [])
            if not stack or not self._scope:
                return
            with self._busy():
                call = stack[-1]
                self._local.stack = stack[:-1]
                self._scope.pop()
                for role, leaf in self._tensor_leaves(output, "out"):
                    if _is_tensor(leaf):
                        self._put(self.phase, "module", "", path, role, leaf, call)
        return post

    def scope(self) -> str:
        return self._scope[-1] if self._scope else ""

    # ------------------------------------------------------------------ the optimizer

    def _names(self, opt: Any) -> Iterator[tuple[str, Any]]:
        index = self._opt_index.setdefault(id(opt), len(self._opt_index))
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                yield self._param_names.get(id(p), f"optimizer{index}.group{g}.{i}"), p

    def _before_optimizer(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.busy():
            return
        # With a closure (Lightning's automatic optimization), the forward and backward passes run
        # inside the optimizer's step: their records keep their own phases.
        closure = (args and callable(args[0])) or callable((kwargs or {}).get("closure"))
        if self._in_step:
            self._ops_on = True  # another optimizer's step in this step: its ops are the step's
            if not closure:
                self.phase = "optimizer"

    def _after_optimizer(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The gradients the step used (level modules), then every parameter and optimizer state value."""
        if not self._in_step or self.busy():
            return
        with self._busy():
            if self._mode is not None:  # collectives of the step not yet recorded
                self._mode.flush()
            if "grad" in self.kinds:
                for name, p in self._names(opt):
                    if p.grad is not None:
                        self._put("backward", "grad", "", name, "grad", p.grad)
            for name, p in self._names(opt):
                self._put("optimizer", "param", "", name, "value", p)
            for name, p in self._names(opt):
                state = opt.state.get(p)
                if not state:
                    continue
                for key in sorted(state, key=str):
                    v = state[key]
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        v = torch.tensor(float(v), dtype=torch.float64)
                    self._put("optimizer", "optim", "", name, str(key), v)
            self.phase = "optimizer"
            self._ops_on = False  # until the next step() (or another optimizer's step)


def trace(path: str | os.PathLike[str], level: str = "steps", *, model: Any = None, optimizer: Any = None,
          algorithm: str = digests.DEFAULT, rank: int | None = None, world_size: int | None = None,
          resume_at: int | None = None, capture: str | None = None, off_thread: bool = False) -> Recorder:
    """Record a training run to the trace file ``path`` (docs/TRACE.md)::

        with tensorcanon.trace("run.trace", level="modules", model=model, optimizer=opt) as tr:
            for batch in loader:
                tr.step(batch)
                ...

    ``level``: ``"steps"``, ``"modules"`` (needs ``model``) or ``"ops"`` (needs ``model``).
    ``optimizer``: the optimizer (or a list) whose steps are recorded; by default every
    optimizer's (torch's global optimizer hooks). ``rank``/``world_size``: default ``$RANK`` and
    ``$WORLD_SIZE``; with several ranks each writes its own file (``{rank}`` in ``path``, or
    ``run.rank1.trace``). ``resume_at=k`` continues the trace of a stopped run at step k: the
    records of step k and later are cut off and the new records appended, so the trace of a
    resumed run compares with an uninterrupted one. ``capture="step|kind|scope|name|call"`` (as
    ``diverge`` prints it; or ``$TENSORCANON_TRACE_CAPTURE``) also saves that op's or module's
    inputs and outputs to ``PATH.capture.safetensors`` (trace/capture.py). ``off_thread=True``:
    tensors of 64 KiB or more are copied and hashed on a worker thread (at most 32 MiB of copies
    waiting), which helps only with a core to spare (benchmarks/RESULTS.md); by default everything
    is hashed on the training thread, copying nothing. The run's facts (determinism settings,
    versions, host, pid) go to ``PATH.run.json``, never into the compared trace.
    """
    optional.load()
    return Recorder(path, level, model=model, optimizer=optimizer, algorithm=algorithm, rank=rank,
                    world_size=world_size, resume_at=resume_at, capture=capture, off_thread=off_thread)


__all__ = ["trace", "Recorder", "FormatError"]
