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

Every tensor is hashed when it is met, while the thread that meets it waits, and never kept: an
in-place operation may change it the next moment (the records after an optimizer step are hashed
by the training thread and a helper thread together: :meth:`Recorder._put_all`).
"""

from __future__ import annotations

import json
import os
import platform
import random
import stat
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..format import digest as digests, optional
from ..format.errors import FileAccessError, FormatError, MissingFileError, TensorCanonError, UsageError
from . import capture as capture_module, layout
from .layout import Record
from .ops import _storages_kept, plain, storage_key
from .summary import contents, detached, same_bytes_key, summarize, summarize_text, summarize_with
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


MAX_FACTS = 16 << 20
"""The largest ``PATH.run.json`` a resumed run reads to add its facts to."""
MAX_RESUME_AT = 1 << 62
"""The largest ``resume_at``: the steps a resumed run writes stay in the trace's range [0, 2^63)."""
_MAX_DIGITS = 10
"""Digits of ``$RANK`` and ``$WORLD_SIZE``, checked before they are converted (a world size is at
most 2^31, layout.MAX_WORLD)."""


def _short(v: Any) -> str:
    """``v`` for a message: an int by its size past 30 digits (never a 4,300-digit conversion)."""
    if type(v) is int and v.bit_length() > 99:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v) if isinstance(v, (bool, int, float, str, bytes)) or v is None else f"a {type(v).__name__}"
    return text[:60] + ("..." if len(text) > 60 else "")


def _printable(text: str, limit: int = 200) -> str:
    """A text from a file for a message: cut to ``limit`` characters, what a terminal would act on
    (control characters, bidirectional overrides) escaped."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return out + ("..." if len(text) > limit else "")


def _integer(v: Any) -> int | None:
    """``v`` as an int when it is a whole number (an int or a numpy integer), never a bool; else
    None. Not anything with ``__index__``: a torch tensor has one, and a bool tensor's is 1 or 0."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return int(v)
    import numpy as np

    if isinstance(v, np.integer):  # (numpy's bool is not one)
        return int(v)
    return None


def _whole(arg: str, given: Any, env: str, default: int) -> int:
    """``rank``/``world_size``: the argument (an int, not a bool), else ``$RANK``/``$WORLD_SIZE``
    (ASCII digits, at most _MAX_DIGITS), else ``default``; a :class:`UsageError` naming where the
    value came from otherwise."""
    if given is not None:
        whole = _integer(given)
        if whole is None:
            raise UsageError(f"{arg}={_short(given)} is not a whole number (an int, not a bool or a float)")
        return whole
    text = os.environ.get(env)
    if text is None or text == "":
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS):
        raise UsageError(f"${env}={text[:40]!r}{'...' if len(text) > 40 else ''} is not a whole number of at "
                         f"most {_MAX_DIGITS} digits (torch.distributed's launchers set it; pass {arg}= "
                         "to tensorcanon.trace to give it yourself)")
    return int(text)


def _process_group() -> tuple[int, int] | None:
    """(rank, world size) of this process in torch.distributed's default process group when one is
    initialized, else None (torch is not imported for this: a process that has not imported it has
    no process group)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def _source(arg: str, given: Any, env: str) -> str:
    """Where a rank or world size came from, for a message."""
    if given is not None:
        return f"{arg}="
    return f"${env}" if os.environ.get(env) else "the default"


def _trace_path(path: Any, source: str) -> str:
    """The trace path as a text, or a :class:`UsageError` naming where it came from."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise UsageError(f"the trace path ({source}) is a {type(path).__name__}, not a path") from None
    if type(p) is not str or not p or "\0" in p:
        raise UsageError(f"the trace path ({source}) {_short(p)} is not a file path (a non-empty text)")
    return p


def _os_problem(e: OSError, path: str, doing: str) -> TensorCanonError:
    """A library error for an OSError met writing the trace's files."""
    if isinstance(e, TensorCanonError):
        return e
    if isinstance(e, FileNotFoundError):
        return MissingFileError(f"cannot {doing} {path!r}: the folder {os.path.dirname(os.path.abspath(path))!r} "
                                "does not exist; create it first", filename=path)
    if isinstance(e, IsADirectoryError):
        return UsageError(f"cannot {doing} {path!r}: it is a directory; give a file path (e.g. "
                          f"{os.path.join(path, 'run.trace')!r})")
    return FileAccessError(f"cannot {doing} {path!r}: {e.strerror or e}", filename=path, errno=e.errno)


def _check_writable(path: str, doing: str) -> None:
    """Refuse, before anything is written, a trace path that is a directory, in a missing folder,
    or an existing file that is not a regular one (a FIFO would block, a device never end)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise MissingFileError(f"cannot {doing} {path!r}: the folder {folder!r} does not exist; create it first",
                               filename=path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise _os_problem(e, path, doing) from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"cannot {doing} {path!r}: it is a directory; give a file path (e.g. "
                         f"{os.path.join(path, 'run.trace')!r})")
    if not stat.S_ISREG(mode):
        raise UsageError(f"cannot {doing} {path!r}: it exists and is not a regular file (a FIFO, socket or device)")


def _every(h: layout.Header) -> str:
    return f", the optimizer state every {h.state_every} steps" if h.state_every != 1 else ""


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
                 off_thread: bool = False, state_every: int = 1) -> None:
        # Every argument and environment variable is checked here, before any file is touched.
        # `tensorcanon repro --trace LEVEL` sends each run's trace to a file of its own, at its level
        path_from = f"${ENV_PATH}" if os.environ.get(ENV_PATH) else "path"
        path = os.environ.get(ENV_PATH) or path
        level_from = f"${ENV_LEVEL}" if os.environ.get(ENV_LEVEL) else "level"
        level = os.environ.get(ENV_LEVEL) or level
        if type(level) is not str or level not in layout.LEVELS:
            raise UsageError(f"trace level {level!r} ({level_from}) is not one of {', '.join(layout.LEVELS)}")
        if level != "steps" and model is None:
            raise UsageError(f"trace level {level!r} records the modules of a model: pass model=")
        self.level = level
        self.kinds = layout.kinds_of(level)
        self.algorithm = digests.check(algorithm)
        group = _process_group()
        world = _whole("world_size", world_size, "WORLD_SIZE", 1)
        self.rank = _whole("rank", rank, "RANK", 0)
        if not (1 <= world <= layout.MAX_WORLD and 0 <= self.rank < world):
            raise UsageError(f"rank {self.rank} is not a rank of world size {world} (a world size is in "
                             f"[1, {layout.MAX_WORLD}], a rank in [0, world size); from rank=/world_size= or "
                             "$RANK/$WORLD_SIZE)")
        # a rank or world size given (rank=/world_size=, $RANK/$WORLD_SIZE) must be this process's
        # place in an initialized process group: else two ranks write one file. Nothing given keeps
        # rank 0 of 1 (a process may trace a run of its own under a live group; docs/TRACE.md)
        told = (rank, world_size) != (None, None) or bool(os.environ.get("RANK") or os.environ.get("WORLD_SIZE"))
        if group is not None and told and (self.rank, world) != group:
            said = " and ".join(_source(arg, given, env) for arg, given, env, mine, theirs in (
                ("rank", rank, "RANK", self.rank, group[0]), ("world_size", world_size, "WORLD_SIZE", world, group[1]))
                if mine != theirs)
            raise UsageError(f"rank {self.rank} of world size {world} (from {said}) is not this process's place in "
                             f"torch.distributed's default process group, rank {group[0]} of {group[1]}: two ranks "
                             "would write one trace file; give the group's values (torch.distributed's "
                             "get_rank() and get_world_size())")
        self.world_size = world
        self.path = rank_path(_trace_path(path, path_from), self.rank, world)
        if resume_at is not None:
            k = _integer(resume_at)
            if k is None or not 0 <= k <= MAX_RESUME_AT:
                raise UsageError(f"resume_at={_short(resume_at)} is not a step: give the whole number k >= 0 (at "
                                 "most 2^62) of the first step the resumed run records (not a bool, a float or a "
                                 f"text); nothing was changed in {self.path}")
            resume_at = k
        every = _integer(state_every)
        if every is None or not 1 <= every <= layout.MAX_STATE_EVERY:
            raise UsageError(f"state_every={_short(state_every)} is not a whole number of steps in [1, 2^31] (the "
                             "optimizer state is recorded after every state_every-th step; 1, the default, "
                             "records it after every step)")
        self.state_every = every
        self.model = model
        self.optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) \
            else [optimizer]
        self.resume_at = resume_at
        self.capture: tuple[int, str, str, str, int] | None = None
        if os.environ.get(capture_module.ENV):
            try:
                self.capture = capture_module.parse(os.environ[capture_module.ENV])
            except UsageError as e:
                raise UsageError(f"${capture_module.ENV}: {e}") from None
        elif capture is not None and capture != "":
            self.capture = capture_module.parse(capture)
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
        self._seen_at: dict[int, set[int]] = {}  # level ops: storage address -> the ids in _seen on it
        self.generation = 0  # counts forget()
        # level ops: storage address -> {(offset, elements, dtype): (weak ref to the storage, sum of squares)}
        self._sums: dict[int, dict[tuple[int, int, Any], tuple[Any, float]]] = {}
        # the resume check: where the trace's records of step resume_at - 1 are (read again at the first
        # step, never held: a trace's records can be many), see _resume_point
        self._expected: dict[str, tuple[int, int, int, int]] = {}
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
        """Open the trace (a new one, or the stopped run's with ``resume_at``). Everything that can be
        checked is checked before a byte of it changes: the paths, and for a resume the whole
        prefix that is kept, its header against this process's level, algorithm, rank and world
        size."""
        header = layout.Header(self.level, self.algorithm, self.rank, self.world_size, self.state_every)
        side = self.path + ".run.json"
        _check_writable(side, "write the run's facts to")
        if self.capture is not None:
            _check_writable(capture_module.capture_path(self.path), "write the capture to")
        if self.resume_at is None:
            _check_writable(self.path, "write the trace")
            try:
                fh = open(self.path, "wb", buffering=1 << 20)
            except OSError as e:
                raise _os_problem(e, self.path, "write the trace") from None
            try:
                fh.write(layout.MAGIC)
                self._writer = layout.Writer(fh)
                self._writer.frame(__import__("msgpack").packb(header.payload()))
            except BaseException:
                fh.close()
                raise
        else:
            offset, check, count = self._resume_point(header)
            try:
                fh = open(self.path, "r+b", buffering=1 << 20)
            except OSError as e:
                raise _os_problem(e, self.path, "continue the trace") from None
            try:
                fh.truncate(offset)
                fh.seek(offset)
            except BaseException:
                fh.close()
                raise
            self._writer = layout.Writer(fh, previous=check, count=count)
        try:
            self._writer.fh.flush()
            self._write_facts()
        except BaseException:
            w, self._writer = self._writer, None
            w.fh.close()
            raise
        if self.off_thread:
            self._worker = Worker(self._write_now, self._flush_now, self.algorithm)

    def _resume_point(self, header: layout.Header) -> tuple[int, int, int]:
        """Where the records of steps before ``resume_at`` end in the existing trace: (offset, check
        of the frame before, records before). Streams the file (memory does not grow with it): the
        records of step ``resume_at - 1`` are not kept, only where they start, for the resume check
        of the first step (:meth:`_check_resumed_state`)."""
        assert self.resume_at is not None
        k = self.resume_at
        if not os.path.lexists(self.path):
            raise UsageError(f"resume_at={k}: there is no trace at {self.path} to continue; "
                             "resume_at continues the trace of the run that was stopped")
        _check_writable(self.path, "continue the trace")
        with layout.Reader(self.path, strict=False) as r:
            h = r.header
            if h != header:
                raise UsageError(
                    f"{self.path} is the trace of rank {h.rank} of world size {h.world_size}, level {h.level}, with "
                    f"{h.algorithm} digests{_every(h)}; this process is rank {header.rank} of {header.world_size}, "
                    f"level {header.level}, with {header.algorithm} digests{_every(header)}: it cannot continue that "
                    "trace (a resumed run continues its own rank's trace, at the level, with the algorithm and the "
                    "state_every it was started with); nothing was changed")
            offset, check, count = r.offset, r.tail.check, 0
            before: tuple[int, int, int] | None = None
            last = -1
            calls = layout.Calls()  # a kept record is checked as `verify` checks it: the resumed trace verifies
            for rec in r:
                if rec.step >= k:
                    break
                why = calls.problem(rec)
                if why:
                    raise FormatError(f"{self.path}: trace record {count}: {why}; the trace cannot be continued "
                                      "(`tensorcanon verify` checks it); nothing was changed", offset=offset)
                if rec.step == k - 1 and before is None:
                    before = (offset, check, count)
                last = max(last, rec.step)
                offset, check, count = r.offset, r.tail.check, count + 1
        if before is not None:
            self._expected = {"from": (*before, count)}
        elif k > 0:
            warnings.warn(f"{self.path}: resume_at={k}, but the trace holds no record of step {k - 1} ("
                          + (f"its last step is {last}" if last >= 0 else "it holds no records")
                          + f"): the resumed trace will lack the steps before {k} that it does not hold, and "
                          "the state this run resumes with cannot be checked against it", ResumeWarning,
                          stacklevel=4)
        return offset, check, count

    def _check_resumed_state(self) -> None:
        """On the first step after ``resume_at``: the parameters and optimizer state this process
        holds against those the trace recorded after the step before (a resume check; what differs
        is said in a :class:`ResumeWarning` and kept in ``PATH.run.json``). The trace's records of
        that step are read again from where they start, one at a time: the memory is this
        process's own state's digests, whatever the trace holds."""
        expected, self._expected = self._expected, {}
        if not expected:
            return
        assert self.resume_at is not None
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
        offset, check, first, end = expected["from"]
        problems: list[str] = []
        n = 0
        try:
            with layout.Reader(self.path, strict=False, start=(offset, check, first)) as r:
                for rec in r:
                    if r.tail.records > end:
                        break
                    if rec.step != self.resume_at - 1 or rec.kind not in ("param", "optim") or rec.kind not in kinds:
                        continue
                    got = now.get((rec.kind, rec.name, rec.role))
                    what = "optimizer state" if rec.kind == "optim" else "parameter"
                    if got is None or got != rec.digest:
                        n += 1
                        if len(problems) < 5:
                            problems.append(f"{what} {_printable(rec.name)} {_printable(rec.role)} "
                                            f"{'is missing' if got is None else 'differs'}")
        except (TensorCanonError, OSError) as e:
            warnings.warn(f"{self.path}: resumed at step {self.resume_at}, the state could not be checked against "
                          f"the trace's records of step {self.resume_at - 1}: {e}", ResumeWarning, stacklevel=3)
            return
        if problems:
            shown = "; ".join(problems) + (f"; and {n - len(problems)} more" if n > len(problems) else "")
            warnings.warn(f"{self.path}: resumed at step {self.resume_at}, this process's state is not what the "
                          f"trace recorded after step {self.resume_at - 1}: {shown} (the checkpoint does not hold "
                          "the run's state, or it was not restored)", ResumeWarning, stacklevel=3)

    def _write_facts(self) -> None:
        """The run's facts, kept beside the trace (never compared): ``PATH.run.json``, written
        atomically. A resumed run adds its facts to those of the runs before (an earlier file that
        is not such a list, or larger than MAX_FACTS bytes, is started again)."""
        from ..io.regular import open_path
        from ..io.writer import replace_atomically
        from ..training.determinism import DeterminismSettings

        settings = DeterminismSettings.capture()
        facts = {"pid": os.getpid(), "argv": sys.argv, "python": sys.version.split()[0],
                 "host": platform.node(), "resume_at": self.resume_at,
                 "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(settings).items()}}
        side = self.path + ".run.json"
        runs: list[Any] = []
        if self.resume_at is not None and os.path.lexists(side):
            try:
                with open_path(side, "read", "the run's facts (JSON)") as f:
                    raw = f.read(MAX_FACTS + 1)
                old = json.loads(raw) if len(raw) <= MAX_FACTS else None
                runs = list(old["runs"]) if isinstance(old, dict) and isinstance(old.get("runs"), list) else []
            except (TensorCanonError, OSError, ValueError, RecursionError):
                runs = []
        text = json.dumps({"trace": os.path.basename(self.path), "runs": [*runs, facts]}, indent=1,
                          default=str).encode("utf-8")
        try:
            replace_atomically(side, lambda f, _tmp: f.write(text))
        except OSError as e:
            raise _os_problem(e, side, "write the run's facts to") from None

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
            spec = capture_module.format_spec(*self.capture)
            captured, texts = self._captured, self._captured_texts
            self._captured, self._captured_texts = {}, {}
            capture_module.save(self.path, spec, captured, texts)

    def _close(self, clean: bool) -> None:
        """Remove the hooks and the dispatch mode, write what waits, end the trace (``clean``) or
        leave it a crashed run's valid prefix. Everything is undone even when a step fails (a
        collective that cannot be waited for, a capture that cannot be written, the worker's error):
        the first error is raised after."""
        error: BaseException | None = None
        try:
            with self._busy():
                if self._mode is not None:  # collectives not yet recorded (a failed run waits for none)
                    try:
                        self._mode.flush(wait=clean)
                    except BaseException:
                        self._mode.flush(wait=False)
                        raise
                self._save_capture()
        except BaseException as e:  # noqa: BLE001 (raised below, once everything is undone)
            error, clean = e, False
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
            except BaseException as e:  # noqa: BLE001
                error, clean = error or e, False
        if self._writer is not None:
            w, self._writer = self._writer, None
            try:
                if clean:
                    w.end()
                else:
                    w.fh.flush()
            except BaseException as e:  # noqa: BLE001
                error = error or e
            finally:
                w.fh.close()
        if error is not None:
            raise error

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
            self.forget()
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
             call: int | None = None, written: bool = False) -> None:
        mode = self._mode
        if _is_tensor(value):
            value = plain(value)  # a DTensor: its local shard
            if mode is not None and mode.pending:  # a collective writing it: recorded first, once complete
                mode.settle((value,))
        if call is None:
            call = self.call_index(phase, kind, scope, name)
        if self.capture is not None and (self.step_index, kind, scope, name, call) == self.capture:
            self._capture(role, value)
        if _is_tensor(value):
            worker = self._worker
            if worker is not None and value.numel() * value.element_size() >= OFF_THREAD:
                job = detached(value)
                if job is not None:
                    worker.put_job((self.step_index, phase, kind, scope, name, call, role), job)
                    return
        self.write(Record(self.step_index, phase, kind, scope, name, call, role,
                          *self._content(kind, role, value, written)))

    def _content(self, kind: str, role: str, value: Any, written: bool = False) -> Any:
        """The record content of ``value`` (a tensor, hashed: :meth:`_summary`; else its text)."""
        if _is_tensor(value):
            return self._summary(value, self._reuses(kind, role), written)
        text = value if isinstance(value, str) else args_text(value)
        return summarize_text(text[:layout.MAX_TEXT], self.algorithm)

    def _reuses(self, kind: str, role: str) -> bool:
        """Whether a record may reuse the content of its tensor met before in this step, unchanged
        (:meth:`_summary`): an input, and the records after an optimizer step only at level ops,
        where every write through another tensor on the same memory is seen."""
        return role.startswith("in") or (self._mode is not None and kind in ("param", "optim"))

    def _capture(self, role: str, value: Any) -> None:
        if _is_tensor(value):
            kept = capture_module.kept(value)  # a copy, or a text saying why not (never raises)
            if isinstance(kept, str):
                self._captured_texts[role] = kept
            else:
                self._captured[role] = kept
        else:
            self._captured_texts[role] = value if isinstance(value, str) else args_text(value)

    def _put_all(self, records: list[tuple[str, str, str, str, Any]]) -> None:
        """:meth:`_put` of each ``(phase, kind, name, role, value)`` (scope ""), in order: the same
        records, the same bytes. At levels steps and modules, their tensors (the gradients,
        parameters and optimizer state after an optimizer step, which nothing changes while the
        recorder holds the training thread) are hashed on this thread and the helper thread
        together (summary.contents), and the records written in order once all are done."""
        if self._mode is not None or self._worker is not None:
            for phase, kind, name, role, value in records:
                self._put(phase, kind, "", name, role, value)
            return
        ready: list[tuple[str, str, str, int, str, Any]] = []
        sizes: list[int] = []
        for phase, kind, name, role, value in records:
            if _is_tensor(value):
                value = plain(value)
                sizes.append(value.numel() * value.element_size())
            else:
                sizes.append(0)
            call = self.call_index(phase, kind, "", name)
            if self.capture is not None and (self.step_index, kind, "", name, call) == self.capture:
                self._capture(role, value)
            ready.append((phase, kind, name, call, role, value))
        def content(item: tuple[str, str, str, int, str, Any]) -> Any:
            return self._content(item[1], item[4], item[5])

        step = self.step_index
        for (phase, kind, name, call, role, _), got in zip(ready, contents(content, ready, sizes), strict=True):
            self.write(Record(step, phase, kind, "", name, call, role, *got))

    def _summary(self, t: Any, reuse: bool, written: bool = False) -> tuple[str, tuple[int, ...], bytes, float, str]:
        """The record content of ``t``. Within a step, a tensor met again unchanged (the same
        object, the same version counter: an op's output as the next op's input, a weight used by
        several ops, at level ops a parameter or optimizer state value the optimizer step wrote and
        the record after it) is not hashed again (``reuse``: inputs, and the records after an
        optimizer step). What that relies on, and what is hashed again (docs/TRACE.md "Recording"):

        - an in-place op bumps the version counter of the tensor it writes (and of every view of
          it: views share the counter), under ``no_grad`` too; ``set_()`` is one too;
        - at level ops, an op that writes memory (in place, ``out=``, through ``.data`` or another
          tensor made on the same storage, whose counters are their own) forgets what was hashed
          of every tensor on that storage (:meth:`forget_storage`), as a collective's completion
          and a storage that is resized do;
        - an in-place op's output is met before torch bumps its counter (the dispatch mode runs
          inside the op): it is kept only once the next op on that thread finds the counter bumped
          by exactly one (``written``, ops.py ``confirm``);
        - a tensor object is never taken for another: the entry holds a weak reference to it.

        Not seen: memory written outside torch's ops (through a numpy array or a pointer) in the
        middle of a step; everything is hashed again from the next ``step()``."""
        try:
            version = t._version
        except (RuntimeError, AttributeError):  # inference tensors have no version counter
            return summarize(t, self.algorithm)
        seen = self._seen.get(id(t)) if reuse else None
        if seen is not None and seen[1] == version and seen[0]() is t:
            return seen[2]
        same = self._same_bytes(t) if self._mode is not None else None
        if same is not None:  # another tensor on these bytes had its squares summed: the digest alone
            content = summarize_with(t, self.algorithm, same)
        else:
            content = summarize(t, self.algorithm)
            if not written and self._mode is not None and t.numel() >= 1024:
                self._keep_sum(t, content)
        if t.numel() >= 1024:
            if written:  # an op's output written in place: kept once its counter is bumped
                mode = self._mode
                if mode is not None:
                    self._seen.pop(id(t), None)
                    mode.unconfirmed(t, version, content)
            else:
                self.remember(t, version, content)
        return content

    def _same_bytes(self, t: Any) -> float | None:
        """At level ops, the sum of squares of a tensor on the same bytes (same storage, offset,
        elements and dtype, both contiguous) hashed before in this step, its memory not written
        since (every op that writes it forgets it: :meth:`forget_storage`), else None. The storage
        is held weakly and compared by identity (torch keeps one object per storage), so memory
        freed and given to another tensor at the same address is never taken for it."""
        if self._mode is None or not self._sums or t.numel() < 1024:
            return None
        key = same_bytes_key(t)
        if key is None:
            return None
        storage, offset, n, dtype = key
        got = self._sums.get(storage.data_ptr(), {}).get((offset, n, dtype))
        if got is not None and got[0]() is storage:
            return got[1]
        return None

    def _keep_sum(self, t: Any, content: Any) -> None:
        if content[4] or not _storages_kept():
            return
        key = same_bytes_key(t)
        if key is None:
            return
        storage, offset, n, dtype = key
        address = storage.data_ptr()
        if address:
            try:
                self._sums.setdefault(address, {})[(offset, n, dtype)] = (weakref.ref(storage), content[3])
            except TypeError:
                pass

    def remember(self, t: Any, version: int, content: Any) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:
            return
        self._seen[id(t)] = (ref, version, content)
        if self._mode is not None:
            key = storage_key(t)
            if key is not None:
                self._seen_at.setdefault(key, set()).add(id(t))

    def forget_storage(self, key: int | None) -> None:
        """Forget what was hashed of the tensors on the storage at address ``key`` (it was written)."""
        for i in self._seen_at.pop(key, ()) if key is not None else ():
            self._seen.pop(i, None)
        self._sums.pop(key, None)  # type: ignore[arg-type]

    def forget(self) -> None:
        """Forget every content kept (a new step; ops that ran unrecorded)."""
        self._seen.clear()
        self._seen_at.clear()
        self._sums.clear()
        self.generation += 1  # (and the outputs written in place not yet confirmed: ops.py)

    def write(self, r: Record) -> None:
        if self._worker is not None:
            self._worker.put_record(r)
            return
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
        if _is_tensor(value):  # (a module's usual input or output: what the walk below gives, without it)
            yield root, value
            return
        if type(value) is tuple and all(_is_tensor(v) for v in value):
            yield from ((f"{root}.{i}", v) for i, v in enumerate(value))
            return
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
            if not self._ops_on:  # ops ran unrecorded since the last optimizer step: they may have written anything
                self.forget()
            self._ops_on = True  # another optimizer's step in this step: its ops are the step's
            if not closure:
                self.phase = "optimizer"

    def _after_optimizer(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The gradients the step used (level modules), then every parameter and optimizer state value."""
        if not self._in_step or self.busy():
            return
        with self._busy():
            if self._mode is not None:  # collectives of the step not yet recorded
                self._mode.confirm()
                self._mode.flush()
            records: list[tuple[str, str, str, str, Any]] = []
            if "grad" in self.kinds:
                for name, p in self._names(opt):
                    if p.grad is not None:
                        records.append(("backward", "grad", name, "grad", p.grad))
            for name, p in self._names(opt):
                records.append(("optimizer", "param", name, "value", p))
            every = self.state_every
            for name, p in self._names(opt) if every == 1 or (self.step_index + 1) % every == 0 else ():
                state = opt.state.get(p)
                if not state:
                    continue
                for key in sorted(state, key=str):
                    v = state[key]
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        v = torch.tensor(float(v), dtype=torch.float64)
                    records.append(("optimizer", "optim", name, str(key), v))
            self._put_all(records)
            self.phase = "optimizer"
            self._ops_on = False  # until the next step() (or another optimizer's step)


def trace(path: str | os.PathLike[str], level: str = "steps", *, model: Any = None, optimizer: Any = None,
          algorithm: str = digests.DEFAULT, rank: int | None = None, world_size: int | None = None,
          resume_at: int | None = None, capture: str | None = None, off_thread: bool = False,
          state_every: int = 1) -> Recorder:
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
    is hashed on the training thread, copying nothing. ``state_every=k``: the optimizer state is
    recorded after the optimizer steps of every k-th step only (steps k-1, 2k-1, ...; the
    parameters after every step), so a step hashes the parameters and 1/k of the optimizer state;
    k > 1 writes a trace of format version 2, whose header gives k (docs/TRACE.md "Cost"). The
    run's facts (determinism settings, versions, host, pid) go to ``PATH.run.json``, never into
    the compared trace.
    """
    optional.load()
    return Recorder(path, level, model=model, optimizer=optimizer, algorithm=algorithm, rank=rank,
                    world_size=world_size, resume_at=resume_at, capture=capture, off_thread=off_thread,
                    state_every=state_every)


__all__ = ["trace", "Recorder", "FormatError"]
