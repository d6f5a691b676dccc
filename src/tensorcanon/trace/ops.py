"""The ``ops`` level: a ``TorchDispatchMode`` that records every ATen operation of a step.

An op's tensor inputs are hashed before it runs (an in-place op changes them), its outputs after;
its arguments that are not tensors make one text record (role ``args``). An argument the op only
writes (an ``out=`` argument, the ``self`` of ``copy_``, ``zero_`` and ``fill_``, the output
buffers of a collective) is not an input: it is recorded after the op, as an output. Backward ops
are told apart by the autograd engine's current graph task (phase backward from the first one
on). The recorder's own torch calls are not recorded, nor the ops between an optimizer step's end
and the next ``step()`` (``Recorder.ops_recorded``).

Collectives (``c10d.*``, ``_c10d_functional.*``) may still be writing their outputs when the op
returns (gloo works on its own threads; ``async_op=True``): their outputs are recorded once the
work is complete, at the first later record that touches their memory (an op reading or writing
it, a module's output, a gradient), at the end of the optimizer step, or at the next ``step()``,
whichever comes first; a correct program waits before it reads, so recording then waits for
nothing. A collective's output records come after the records of ops that ran in between.

Memory that an ``empty`` op returns holds whatever was there: until an op writes it, a tensor
reading it is recorded by its dtype and shape (``uninitialized float32[4]``). What has been
written is kept per storage (by byte ranges), so a write through one view is seen by every other
view of the same memory; a tensor counts as written when every byte of its span was.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ..format import optional
from .values import args_have_text, args_text, is_tensor as _is_tensor, leaves as _leaves, op_leaves

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})
"""The namespaces of torch.distributed's ops (compare.py names a collective from them)."""

_FUNCTIONAL = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_permuted"})
_NOT_WRITING = frozenset({"resize_", "resize_as_", "set_", "_resize_output_", "resize_as_sparse_"})
"""In-place ops that change a tensor's size or storage without writing its values."""
_OVERWRITES = frozenset({"copy_", "zero_", "fill_"})
"""In-place ops that write every element of their ``self`` without reading it: its value before is
not an input (DDP's reducer copies into and zeroes buffers that hold whatever was in memory). The
other in-place ops (``add_``, ``mul_``, ``lerp_``...) read it: their ``self`` is an input; so is a
random fill's (``random_``, ``uniform_``...), as it always was (its value before is memory an empty
op returned, recorded as such, where a DataLoader draws its seed)."""


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _uninitialized(name: str) -> bool:
    """True for the ops whose outputs are uninitialized memory (``aten.empty.memory_format``,
    ``aten.empty_like.default``, ``aten.new_empty_strided.default``, ...)."""
    op = name.split(".")[1] if name.count(".") >= 1 else name
    return op in _UNINITIALIZED


def plain(t: Any) -> Any:
    """The plain tensor holding ``t``'s values on this process: a DTensor's local shard, an
    asynchronous collective's result tensor (``AsyncCollectiveTensor``); ``t`` itself otherwise."""
    kind = type(t).__name__
    if kind == "DTensor":
        inner = getattr(t, "_local_tensor", None)
        return t if inner is None else inner
    if kind == "AsyncCollectiveTensor":
        inner = getattr(t, "elem", None)
        return t if inner is None else inner
    return t


def _storage(t: Any) -> Any:
    """``t``'s untyped storage, or None (not a tensor, or one without storage)."""
    if not _is_tensor(t):
        return None
    try:
        return plain(t).untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _is_work(x: Any) -> bool:
    """Whether an op's output ``x`` is a collective's ``Work`` (a TorchScript object)."""
    script = getattr(torch, "ScriptObject", None)
    return not _is_tensor(x) and ((script is not None and isinstance(x, script)) or hasattr(x, "wait"))


def storage_key(t: Any) -> int | None:
    """The address of the memory ``t`` views (its storage's data pointer), or None for a tensor with
    none (no elements, meta, a subclass without storage)."""
    s = _storage(t)
    return (s.data_ptr() or None) if s is not None else None


def _span(t: Any) -> tuple[int, int, bool] | None:
    """The bytes of its storage that ``t`` spans, ``(start, end, dense)``: ``dense`` when its
    elements are every byte of that span (a contiguous tensor in any dimension order); None when
    it cannot be told (a negative stride)."""
    es = t.element_size()
    start = t.storage_offset()
    if t.numel() == 0:
        return start * es, start * es, True
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    extent, expected, dense = 1, 1, True
    for st, n in dims:
        if st < 0:
            return None
        if st != expected:
            dense = False
        expected *= n
        extent += (n - 1) * st
    return start * es, (start + extent) * es, dense


@functools.cache
def _storages_kept() -> bool:
    """Whether torch keeps one Python object per storage for as long as the storage lives (torch
    2.2 and later do), so that a weak reference to it says when the memory is freed."""
    t = torch.empty(1)
    try:
        ref = weakref.ref(t.untyped_storage())
    except TypeError:
        return False
    return ref() is not None and ref() is t[0:].untyped_storage()


class _Fresh:
    """Memory an ``empty`` op returned: its storage (weakly: when it is freed, the address may be
    reused; the tensor the op returned where torch keeps no object per storage), and what has been
    written since (byte ranges, and the exact layouts of strided writes)."""

    __slots__ = ("ref", "ranges", "layouts")

    def __init__(self, t: Any) -> None:
        owner = t if isinstance(t, torch.UntypedStorage) or not _storages_kept() else t.untyped_storage()
        self.ref = weakref.ref(owner)
        self.ranges: list[tuple[int, int]] = []
        self.layouts: set[tuple[Any, ...]] = set()

    def covers(self, start: int, end: int) -> bool:
        at = start
        for lo, hi in self.ranges:  # sorted, disjoint
            if lo > at:
                break
            at = max(at, hi)
            if at >= end:
                return True
        return at >= end

    def add(self, start: int, end: int) -> None:
        merged: list[tuple[int, int]] = []
        for lo, hi in self.ranges:
            if hi < start or lo > end:
                merged.append((lo, hi))
            else:
                start, end = min(lo, start), max(hi, end)
        merged.append((start, end))
        merged.sort()
        self.ranges = merged


def _grown(rec: Any, storage: Any, before: int) -> None:
    """``storage`` grew from ``before`` bytes: what lies beyond them is whatever was in memory."""
    key = storage.data_ptr()
    if key:
        entry = rec._fresh[key] = _Fresh(storage)
        if before:
            entry.add(0, before)


_ACTIVE: list[Any] = []
"""The recorders at level ops (weak references), told of storages that grow (:func:`_resize`)."""
_SAVED: list[tuple[Any, str, Any]] = []
"""What :func:`_activate` replaced: (class, attribute, what its own dict held there or None)."""


def _recording() -> list[Any]:
    return [rec for rec in (ref() for ref in _ACTIVE) if rec is not None and rec.ops_recorded()]


def _resize(self: Any, size: int) -> Any:
    """``torch.UntypedStorage.resize_`` while a recorder records ops: a storage that grows holds
    memory no op wrote, and no ATen op says so (FSDP2 allocates every unsharded parameter this
    way, then views it before the all-gather's copy writes it)."""
    before = self.nbytes()
    for rec in _recording():  # what was hashed of this memory is not kept past it
        rec.forget_storage(self.data_ptr() or None)
    out = _ORIGINAL["resize_"](self, size)
    if size > before:
        for rec in _recording():
            _grown(rec, self, before)
    return out


def _work_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Work.wait`` while a recorder records ops: the ops a backend runs to finish its collective
    (gloo's reduce-scatter splits its buffer and copies a part into the output in ``wait()``) are
    the collective's own, not the program's: not recorded."""
    with contextlib.ExitStack() as busy:
        for rec in _recording():
            busy.enter_context(rec._busy())
        return _ORIGINAL["wait"](self, *args, **kwargs)


_ORIGINAL: dict[str, Any] = {}


def _activate(rec: Any) -> None:
    if not _ACTIVE:
        patches = [(torch.UntypedStorage, "resize_", _resize)]
        c10d = getattr(torch._C, "_distributed_c10d", None) if "torch.distributed" in sys.modules else None
        if c10d is not None and hasattr(getattr(c10d, "Work", None), "wait"):
            patches.append((c10d.Work, "wait", _work_wait))
        for cls, attr, wrapper in patches:
            try:
                original = getattr(cls, attr)
                own = cls.__dict__.get(attr)
                setattr(cls, attr, wrapper)
            except (AttributeError, TypeError):  # a torch where it cannot be replaced: not replaced
                continue
            _ORIGINAL[attr] = original
            _SAVED.append((cls, attr, own))
    _ACTIVE.append(weakref.ref(rec))


def _deactivate(rec: Any) -> None:
    _ACTIVE[:] = [r for r in _ACTIVE if r() is not None and r() is not rec]
    if not _ACTIVE:
        while _SAVED:
            cls, attr, own = _SAVED.pop()
            if own is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, own)
        _ORIGINAL.clear()


def _layout(t: Any) -> tuple[Any, ...]:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.element_size())


def _fresh_entry(rec: Any, t: Any) -> tuple[int, _Fresh] | None:
    fresh = rec._fresh
    if not fresh or not _is_tensor(t):
        return None
    key = storage_key(t)
    if key is None:
        return None
    entry = fresh.get(key)
    if entry is None:
        return None
    owner = entry.ref()
    if owner is None or (owner.data_ptr() if isinstance(owner, torch.UntypedStorage) else storage_key(owner)) != key:
        del fresh[key]  # freed, and the address taken by other memory
        return None
    return key, entry


def uninitialized_text(rec: Any, t: Any) -> str | None:
    """``uninitialized float32[4]`` when some byte of ``t`` is memory an empty op returned and no op
    has written since; else None."""
    found = _fresh_entry(rec, t)
    if found is None:
        return None
    entry = found[1]
    t = plain(t)
    span = _span(t)
    if span is not None and (span[0] == span[1] or entry.covers(span[0], span[1]) or _layout(t) in entry.layouts):
        return None
    return f"uninitialized {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _made_fresh(rec: Any, t: Any) -> None:
    key = storage_key(t)
    if key is not None:
        rec._fresh[key] = _Fresh(plain(t))


def written(rec: Any, t: Any) -> None:
    """An op wrote every element of ``t``."""
    found = _fresh_entry(rec, t)
    if found is None:
        return
    key, entry = found
    t = plain(t)
    span = _span(t)
    if span is None:
        return
    if span[2]:
        entry.add(span[0], span[1])
        if entry.covers(0, t.untyped_storage().nbytes()):
            del rec._fresh[key]  # every byte of that memory written: no longer tracked
    else:
        entry.layouts.add(_layout(t))


class _OpInfo:
    """What recording needs to know of one op overload, from its schema (cached per overload)."""

    __slots__ = ("name", "namespace", "write_only", "writes", "collective", "functional", "uninitialized",
                 "resizes")

    def __init__(self, func: Any) -> None:
        self.name = str(func)
        schema = func._schema
        namespace, _, base = schema.name.partition("::")
        self.namespace = namespace
        self.collective = namespace in COLLECTIVE_NAMESPACES and base not in ("wait_tensor", "barrier",
                                                                                "monitored_barrier_", "send")
        self.functional = namespace in _FUNCTIONAL
        self.uninitialized = base in _UNINITIALIZED
        self.resizes = namespace == "aten" and base in ("resize_", "resize_as_")
        write_only: set[Any] = set()
        writes: set[Any] = set()
        for i, a in enumerate(schema.arguments):
            key: Any = a.name if a.kwarg_only else i
            alias = a.alias_info
            is_write = alias is not None and alias.is_write
            if namespace == "c10d":
                # c10d's schemas carry no alias annotations: its output buffers are the arguments
                # named output*, and recv's tensors; allreduce_, broadcast_ and reduce_ read and
                # write their tensors
                if a.name.startswith("output") or (base.startswith("recv") and a.name == "tensors"):
                    write_only.add(key)
                    writes.add(key)
                elif a.name == "tensors" and base.endswith("_") and not base.startswith("send"):
                    writes.add(key)
            elif is_write:
                if base not in _NOT_WRITING:
                    writes.add(key)
                if a.kwarg_only or (i == 0 and base in _OVERWRITES):  # out=, copy_'s self: written, not read
                    write_only.add(key)
        self.write_only = frozenset(write_only)
        self.writes = frozenset(writes)


def _key(path: str, positional: int) -> Any:
    """The schema argument a leaf's path starts at: its index, or the keyword's name."""
    head, _, rest = path.partition(".")
    index = int(head)
    if index < positional:
        return index
    return rest.partition(".")[0]


class _Pending:
    """A collective whose outputs are recorded once its work is complete."""

    __slots__ = ("phase", "scope", "name", "call", "records", "written", "work", "namespace", "keys")

    def __init__(self, phase: str, scope: str, name: str, call: int, records: list[tuple[str, Any]],
                 written: list[Any], work: Any, namespace: str) -> None:
        self.phase, self.scope, self.name, self.call = phase, scope, name, call
        self.records, self.written, self.work, self.namespace = records, written, work, namespace
        self.keys = {k for k in (storage_key(t) for _, t in records) if k is not None}
        self.keys.update(k for k in (storage_key(t) for t in written) if k is not None)


def _wait(p: _Pending) -> None:
    """Wait until ``p``'s work is complete: its ``Work`` (as the op returned it, a TorchScript
    object), or, for a functional collective, ``wait_tensor`` on each output."""
    work = p.work
    if work is not None:
        wait = getattr(work, "wait", None)
        if wait is None:  # a torch whose TorchScript Work has no wait: the Python one
            unbox = getattr(getattr(getattr(torch._C, "_distributed_c10d", None), "Work", None), "unbox", None)
            wait = None if unbox is None else unbox(work).wait
        if wait is not None:
            wait()
        return
    if p.namespace in _FUNCTIONAL:
        for space in dict.fromkeys((p.namespace, "_c10d_functional", "c10d_functional")):
            wait_tensor = getattr(getattr(torch.ops, space, None), "wait_tensor", None)
            if wait_tensor is not None:
                for _, t in p.records:
                    wait_tensor(plain(t))
                return


def make_mode(rec: Any) -> Any:
    """The dispatch mode recording every op into recorder ``rec`` (entered and left by it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    infos: dict[Any, _OpInfo] = {}
    local = threading.local()
    current_task = getattr(torch._C, "_current_graph_task_id", None)

    class Mode(TorchDispatchMode):
        pending: list[_Pending] = []

        def unconfirmed(self, t: Any, version: int, content: Any) -> None:
            """The content of ``t``, an op's output it wrote in place at ``version`` (torch bumps the
            counter once the dispatch mode has returned): kept by :meth:`confirm`."""
            got = getattr(local, "unconfirmed", None)
            if got is None:
                got = local.unconfirmed = []
            try:
                got.append((weakref.ref(t), version, content, rec.generation))
            except TypeError:
                pass

        def confirm(self) -> None:
            """At this thread's next op (or the end of an optimizer step): keep the contents of the
            outputs written in place whose counter is now bumped by exactly one (written by that
            op and nothing since); forget the others."""
            got = getattr(local, "unconfirmed", None)
            if not got:
                return
            local.unconfirmed = []
            for ref, version, content, generation in got:
                t = ref()
                if t is not None and t._version == version + 1 and generation == rec.generation:
                    rec.remember(t, version + 1, content)

        def __enter__(self) -> Any:
            _activate(rec)
            try:
                return super().__enter__()
            except BaseException:
                _deactivate(rec)
                raise

        def __exit__(self, *exc: Any) -> Any:
            try:
                return super().__exit__(*exc)
            finally:
                _deactivate(rec)

        def settle(self, tensors: Any) -> None:
            """Record the collectives still pending whose memory one of ``tensors`` touches (and
            those issued before them), once their work is complete."""
            pending = self.pending
            if not pending:
                return
            keys = {k for k in (storage_key(t) for t in tensors) if k is not None}
            last = -1
            for i, p in enumerate(pending):
                if p.keys & keys:
                    last = i
            if last >= 0:
                self.flush(last + 1)

        def flush(self, n: int | None = None, wait: bool = True) -> None:
            """Record the first ``n`` pending collectives (all by default) once complete; with
            ``wait=False`` (a run that failed), forget them."""
            with rec._lock:
                done = self.pending[:n] if n is not None else self.pending[:]
                del self.pending[:len(done)]
            if not wait:
                return
            with rec._busy():
                self._record(done)

        def _record(self, done: list[_Pending]) -> None:
            for p in done:
                _wait(p)
                keys = p.keys
                for t in p.written:
                    written(rec, t)
                # the collective wrote without bumping version counters: what was hashed of that
                # memory before is stale
                for k in [k for k, (ref, _, _) in rec._seen.items() if ref() is None or storage_key(ref()) in keys]:
                    rec._seen.pop(k, None)
                for k in keys:
                    rec.forget_storage(k)
                for role, t in p.records:
                    text = uninitialized_text(rec, t)
                    rec._put(p.phase, "op", p.scope, p.name, role, t if text is None else text, p.call)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if getattr(local, "unconfirmed", None):
                self.confirm()
            if not rec.ops_recorded():
                return func(*args, **kwargs)
            info = infos.get(func)
            if info is None:
                info = infos[func] = _OpInfo(func)
            with rec._busy():
                if rec.phase == "forward" and current_task is not None and current_task() != -1:
                    rec.phase = "backward"
                phase = rec.phase
                scope = rec.scope() if phase == "forward" else ""
                name = info.name
                call = rec.call_index(phase, "op", scope, name)
                leaves: list[tuple[str, Any]] = []
                op_leaves(args, kwargs, leaves)
                tensors = [(path, leaf) for path, leaf in leaves if _is_tensor(leaf)]
                if self.pending:
                    self.settle([leaf for _, leaf in tensors])
                positional = len(args)
                for path, leaf in tensors:
                    if info.write_only and _key(path, positional) in info.write_only:
                        continue  # written, not read: recorded after the op, as an output
                    text = uninitialized_text(rec, leaf)
                    rec._put(phase, "op", scope, name, f"in.{path}", leaf if text is None else text, call)
                if args_have_text(args, kwargs):  # (tensors and lists of them alone make no text record)
                    text = args_text(list(args) + ([kwargs] if kwargs else []))
                    if text.strip("[T, ]"):
                        rec._put(phase, "op", scope, name, "args", text, call)
            resized = _storage(args[0]) if info.resizes and args else None  # aten.resize_: may grow
            before = resized.nbytes() if resized is not None else None
            out = func(*args, **kwargs)
            with rec._busy():
                if before is not None:
                    storage = _storage(args[0])
                    if storage is not None and storage.nbytes() > before:
                        _grown(rec, storage, before)
                outs: list[tuple[str, Any]] = []
                _leaves(out, "", outs)
                records = [(f"out.{path}" if path else "out", leaf) for path, leaf in outs if _is_tensor(leaf)]
                writes = [leaf for path, leaf in tensors if info.writes and _key(path, positional) in info.writes]
                for leaf in writes:  # what was hashed of the memory it wrote is stale, on every tensor viewing it
                    rec.forget_storage(storage_key(leaf))
                written_ids = {id(leaf) for leaf in writes}
                # arguments written and not returned are outputs too: an op's out= arguments, and
                # every tensor a collective writes (c10d.reduce_ returns its Work alone)
                also = info.writes if info.collective else info.write_only
                if also:
                    returned = {id(leaf) for _, leaf in records}
                    records += [(f"out.arg.{path}", leaf) for path, leaf in tensors
                                if _key(path, positional) in also and id(leaf) not in returned]
                if info.collective and records:
                    work = next((x for _, x in outs if _is_work(x)), None)
                    written_too = writes + [leaf for _, leaf in records]
                    with rec._lock:
                        self.pending.append(_Pending(phase, scope, name, call, records, written_too, work,
                                                     info.namespace))
                    return out
                if info.uninitialized:
                    for _, leaf in records:
                        _made_fresh(rec, leaf)
                elif rec._fresh:
                    for leaf in writes:
                        written(rec, leaf)
                    inputs = {storage_key(leaf) for _, leaf in tensors}
                    for _, leaf in records:
                        key = storage_key(leaf)
                        if key is not None and key not in inputs and not getattr(func, "is_view", False):
                            rec._fresh.pop(key, None)  # new memory, every byte written by the op
                for role, leaf in records:
                    text = uninitialized_text(rec, leaf)
                    rec._put(phase, "op", scope, name, role, leaf if text is None else text, call,
                             id(leaf) in written_ids)
            return out

    mode = Mode()
    mode.pending = []
    return mode
