"""Writer: DCP's StorageWriter for canonical sharded checkpoints (docs/FORMAT.md §14).

What each step of ``dcp.save`` does here:

1. ``prepare_global_plan`` (coordinator): with ``overwrite=False``, refuses a
   directory that already holds a checkpoint (before any rank writes anything);
   for every tensor stored in more than one chunk, picks the rank that will
   compute its logical digest (the largest first, each to the least loaded rank).
2. ``write_data`` (every rank): writes the rank's chunks and per-rank values as
   one ordinary tensorcanon file under a temporary name, then renames it to
   ``rank-<r>-of-<w>.<its digest>.safetensors``. If some tensor is split into
   several chunks, the ranks then exchange their file names (one small
   ``all_gather_object``, which every rank reaches even when its own write
   failed, so nobody waits forever) and each hashes the tensors assigned to it
   in C order across the chunks: its own from memory, the others' from the
   files just written. A tensor held whole in one chunk needs no second pass:
   its chunk digest is its tensor digest.
3. ``finish`` (coordinator): fills the digests into the logical manifest,
   writes the index atomically (the commit marker), then removes rank files no
   index references any more (an older save's, a bigger world's).

The checkpoint directory must be visible to every rank (a shared file system),
as it must be for loading with another world size. It may also be a directory URL
of object storage (``s3://bucket/run/step100``, with ``storage_options``;
docs/STORAGE.md): each rank file is then hashed first (its name is its digest)
and written as one object (one PUT, or one multipart upload completed last and
aborted on error), the index last as one object, and the cleanup deletes the
rank-file objects the new index does not name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner as _DCPSavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format import digest as _digest, tensorbytes
from ..format.errors import FileAccessError, TensorCanonError, UsageError
from ..format.limits import DEFAULT, Limits
from ..format.tree import items
from ..io import storage, writer
from ..sharded import layout, tiling
from ..sharded.errors import CheckpointError
from ..sharded.files import RankFile
from . import _compat, store as dcp_store
from .save_planner import LocalInfo, SavePlanner
from .staging import staged_copy
from .store import StoreTag

OUTCOME_FQN = "@tensorcanon.rank"  # the WriteResult that carries a rank's file digest
LOGICAL_DIGEST = "tensorcanon.logical_digest"  # key in the Metadata.storage_data every rank gets back


class CheckpointExistsError(FileAccessError, FileExistsError):
    """A save with ``overwrite=False`` found a checkpoint (its index) in its directory.
    Also a ``FileExistsError``; ``filename`` is the directory."""


@dataclass
class HashTask:
    """A tensor split into several chunks whose digest one rank computes."""

    name: str
    chunks: list[tuple[int, tuple, tuple]]  # (writer rank, offsets, sizes)


@dataclass
class RankJob:
    """The coordinator's instructions to one rank (its plan's storage_data)."""

    rank: int
    world_size: int
    algorithm: str
    tasks: list[HashTask] = field(default_factory=list)
    exchange: bool = False  # True when any rank has tasks: every rank takes part in the exchange


@dataclass
class RankOutcome:
    rank: int
    file_digest: str
    tensor_digests: dict[str, bytes]
    stored: dcp_store.RankWrite | None = None  # a save into a store: the rank file's header and blobs


class Writer(StorageWriter):
    """Writes a canonical, pickle-free checkpoint directory; use it with :class:`SavePlanner`.

    ``process_group`` must be the group passed to ``dcp.save`` (None: the default
    group). ``algorithm`` is the digest algorithm of every file (``"xxh3-128"`` or
    ``"sha256"``). With ``overwrite=False`` a directory that already holds a
    checkpoint is refused (:class:`CheckpointExistsError`) before any rank writes;
    by default (as DCP's ``FileSystemWriter``) the new checkpoint replaces it, old or
    new and never a mix. DCP's ``FileSystemWriter`` options are refused, naming why
    (docs/DISTRIBUTED.md).

    Example::

        dcp.save(state, storage_writer=tensorcanon.dcp.Writer("ckpt/step100"),
                 planner=tensorcanon.dcp.SavePlanner())
    """

    def __init__(self, path: str | os.PathLike | StoreTag, *, process_group: dist.ProcessGroup | None = None,
                 algorithm: str = _digest.DEFAULT, overwrite: bool = True, limits: Limits = DEFAULT,
                 storage_options: dict | None = None, **dcp_options: Any) -> None:
        _compat.refuse_storage_options("Writer", dcp_options)
        super().__init__()
        _compat.check_process_group(process_group)  # before any collective, also for a direct dcp.save
        self._storage_options = storage_options
        self.target: StoreTag | None = None  # a checkpoint in a tensorcanon.Store (dcp/store.py)
        self._epoch = b""
        self._at(path)
        self.process_group = process_group
        self.algorithm = _digest.check(algorithm)
        if self.target is not None and self.algorithm != dcp_store.ALGORITHM:
            raise UsageError(f"a checkpoint in a store uses {dcp_store.ALGORITHM} digests (the store names its "
                             f"blobs by them), not {self.algorithm}")
        self.overwrite = overwrite
        self.limits = limits
        self.is_coordinator = False
        self._planner: SavePlanner | None = None

    # -------------------------------------------------------------- set-up
    def _at(self, path: Any) -> None:
        if isinstance(path, StoreTag):
            dcp_store.refuse_options(path, self._storage_options, "tensorcanon.dcp.Writer")
            self.target, self.path, self.options = path, str(path), None
        else:
            self.target = None
            self.path, self.options = layout.where(path, self._storage_options)  # options: None for a local dir

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self._at(checkpoint_id)
        self._planner = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is not None and dist.is_available() and dist.is_initialized() \
                and dist.get_rank(self.process_group) != rank:
            raise UsageError("tensorcanon.dcp.Writer was given another process group than dcp.save: pass "
                             "the same process_group to both")
        if not kwargs.get("use_collectives", True):
            raise UsageError("tensorcanon.dcp.Writer needs use_collectives=True: the index that commits "
                             "the checkpoint is written once, by the coordinator, for all ranks")

    def storage_meta(self) -> None:
        return None  # DCP's holds a fresh uuid and the path: neither belongs in a canonical file

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike, StoreTag))

    @property
    def checkpoint_id(self) -> Any:
        return self.target if self.target is not None else self.path

    if not _compat.DCP_STAGES_FAITHFULLY:
        # This DCP copies a state dict for async_save lossily (see staging.py): the Writer is
        # its stager instead (DCP's AsyncStager protocol) and copies faithfully.
        _synchronize_after_execute = False

        @property
        def should_synchronize_after_execute(self) -> bool:
            return False

        def stage(self, state_dict: dict) -> dict:
            return staged_copy(state_dict)

        def synchronize_staging(self) -> None:
            pass

    def __getstate__(self) -> dict:
        # async_save's process executor pickles the writer into a child process, whose
        # default group plays the part of this one's process group.
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_planner"] = None
        return state

    # -------------------------------------------------------------- planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not isinstance(plan.planner_data, LocalInfo):
            raise UsageError("tensorcanon.dcp.Writer needs tensorcanon.dcp.SavePlanner (pass "
                             "planner=tensorcanon.dcp.SavePlanner() to dcp.save)")
        if self.options is None and self.target is None:  # (an object store has no directories)
            os.makedirs(self.path, exist_ok=True)
        return dataclasses.replace(plan, storage_data=self.algorithm)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One look, by the coordinator, before any rank writes: every rank gets its answer.
        if self.target is not None:
            # the store's collection epoch before any rank looks for a blob (Store._put_record)
            self._epoch = self.target.store._epoch_now()
            exists = not self.overwrite and self.target.exists()
        else:
            exists = not self.overwrite and (os.path.exists(layout.index_path(self.path)) if self.options is None
                                             else layout.is_checkpoint(self.path, self.options))
        if exists and self.target is not None:
            raise CheckpointExistsError(
                f"the store {self.target.store.root!r} already holds the tag {self.target.tag!r} and overwrite=False: "
                "save under another tag, delete that one first (store.delete), or pass overwrite=True (the new "
                "checkpoint then replaces it: old or new, never a mix)", filename=self.path, errno=errno.EEXIST)
        if exists:
            raise CheckpointExistsError(
                f"{storage.redact(self.path)} already holds a checkpoint (its {layout.INDEX_NAME}) and "
                "overwrite=False: save into another directory, remove that checkpoint first, or pass "
                "overwrite=True (the new checkpoint then replaces it: old or new, never a mix)",
                filename=storage.redact(self.path), errno=errno.EEXIST)
        algorithms = sorted({p.storage_data for p in plans}, key=str)
        if len(algorithms) != 1:
            raise UsageError(f"ranks use different digest algorithms {algorithms}; give every rank's "
                             "Writer the same algorithm")
        jobs = assign_hashing(plans, algorithms[0])
        return [dataclasses.replace(p, storage_data=job) for p, job in zip(plans, jobs, strict=True)]

    # -------------------------------------------------------------- writing
    def write_data(self, plan: SavePlan, planner: _DCPSavePlanner) -> Future[list[WriteResult]]:
        job: RankJob = plan.storage_data
        results: list[WriteResult] = []
        own: dict[tuple, torch.Tensor] = {}
        file_digest = None
        stored: dcp_store.RankWrite | None = None
        chunk_digests: dict[str, bytes] = {}
        failure: Exception | None = None
        try:
            if not isinstance(planner, SavePlanner):
                raise UsageError("tensorcanon.dcp.Writer needs tensorcanon.dcp.SavePlanner")
            self._planner = planner
            obj: dict[str, Any] = {}
            for item in plan.items:
                t = planner.resolve_data(item)
                if not isinstance(t, torch.Tensor):
                    raise UsageError(f"{item.index.fqn}: expected a tensor from the planner, got {type(t).__name__}")
                t = t.detach()
                offsets = tuple(item.index.offset or ())
                own[(item.index.fqn, offsets)] = t
                obj[layout.chunk_key(item.index.fqn, offsets)] = t
            per_rank = planner.planned().per_rank
            for (_, value), key in zip(per_rank, layout.per_rank_keys([p for p, _ in per_rank]), strict=True):
                obj[key] = value
            if self.target is not None:  # its tensors as blobs of the store, its header to the coordinator
                stored = dcp_store.write_rank(self.target, obj, job.algorithm, self.limits)
                file_digest, chunk_digests = stored.file_digest, stored.chunk_digests
            else:
                remote = () if self.options is None else (self.options,)  # (a local save: the same call as ever)
                file_digest, chunk_digests = write_rank_file(self.path, job.rank, job.world_size, obj,
                                                             job.algorithm, self.limits, *remote)
            for item in plan.items:
                offsets = tuple(item.index.offset or ())
                key = layout.chunk_key(item.index.fqn, offsets)
                results.append(WriteResult(item.index, item.tensor_storage_size() or 0, chunk_digests[key]))
        except Exception as e:  # noqa: BLE001 - reported to the others first, then raised
            failure = e
        file_digests: list = [None] * job.world_size
        chunks_of: list = [None] * job.world_size  # (a store: each rank's chunk digests, to read its chunks)
        if job.exchange:
            mine = (file_digest, None if failure is None else f"{type(failure).__name__}: {failure}",
                    chunk_digests if self.target is not None else None)
            gathered: list = [None] * job.world_size
            dist.all_gather_object(gathered, mine, group=self.process_group)
            if failure is not None:
                raise failure
            for r, (d, err, theirs) in enumerate(gathered):
                if err is not None:
                    elsewhere = CheckpointError(f"rank {r} could not write its rank file: {err}")
                    elsewhere.secondary = True  # the rank that failed reports the cause itself
                    raise elsewhere
                file_digests[r] = d
                chunks_of[r] = theirs
        elif failure is not None:
            raise failure
        # No failure on any rank: the try above set both.
        assert file_digest is not None and isinstance(planner, SavePlanner)
        tensor_digests = {}
        if job.tasks:
            target = self.target
            fetch = None if target is None else \
                (lambda rank, key: dcp_store.chunk_bytes(target, chunks_of[rank][key]))
            tensor_digests = run_hash_tasks(self.path, job, planner, own, file_digests, self.limits, self.options,
                                            fetch)
        results.append(WriteResult(MetadataIndex(OUTCOME_FQN, [job.rank]), 0,
                                   RankOutcome(job.rank, file_digest, tensor_digests, stored)))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    # -------------------------------------------------------------- committing
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        planner = self._planner
        if planner is None or planner.logical is None:
            raise UsageError("tensorcanon.dcp.Writer.finish called without a planned save")
        logical = planner.logical
        files: dict[int, str] = {}
        stored: dict[int, dcp_store.RankWrite | None] = {}
        chunk_digest: dict[tuple, bytes] = {}
        chunks: dict[str, list[layout.Chunk]] = {name: [] for name in logical.names}
        tensor_digests: dict[str, bytes] = {}
        algorithm = None
        sizes_of = {(fqn, tuple(c.offsets)): tuple(c.sizes)
                    for fqn, md in metadata.state_dict_metadata.items() for c in getattr(md, "chunks", ())}
        for rank_results in results:
            outcome = next(wr.storage_data for wr in rank_results if wr.index.fqn == OUTCOME_FQN)
            files[outcome.rank] = outcome.file_digest
            stored[outcome.rank] = outcome.stored
            tensor_digests.update(outcome.tensor_digests)
            algorithm = _digest.algorithm_of(outcome.file_digest)
            for wr in rank_results:
                if wr.index.fqn == OUTCOME_FQN:
                    continue
                offsets = tuple(wr.index.offset or ())
                chunk_digest[(wr.index.fqn, offsets)] = wr.storage_data
                sizes = sizes_of.get((wr.index.fqn, offsets))
                if sizes is None:
                    raise CheckpointError(f"DCP's metadata has no chunk of {wr.index.fqn!r} at offsets {list(offsets)}")
                chunks[wr.index.fqn].append(layout.Chunk(outcome.rank, tiling.Box(offsets, sizes)))
        world = len(results)
        if algorithm is None or sorted(files) != list(range(world)):
            raise CheckpointError(f"rank outcomes are missing: got ranks {sorted(files)} of {world}")
        plan = logical.plan
        plan.algorithm = algorithm
        table_chunks = []
        for src in plan.tensors:
            cs = sorted(chunks[src.name], key=lambda c: (c.offsets, c.sizes))
            tiling.check(src.shape, [c.box for c in cs], f"tensor {src.name!r}")
            if len(cs) == 1 and cs[0].sizes == tuple(src.shape):
                src.digest = chunk_digest[(src.name, cs[0].offsets)]
            else:
                src.digest = tensor_digests[src.name]
            table_chunks.append(cs)
        logical_raw = plan.manifest_bytes()
        file_list = [files[r] for r in range(world)]
        index_obj = layout.build(logical_raw, file_list, table_chunks, [p for p, _ in logical.per_rank])
        index_plan = writer.plan(index_obj, None, self.limits, algorithm)
        keep = {layout.rank_file_name(r, world, d) for r, d in enumerate(file_list)}
        if self.target is not None:  # one record, after every rank's blobs are durable: the commit
            writes = [stored[r] for r in range(world)]
            if any(w is None for w in writes):
                raise CheckpointError("a rank saved no blobs into the store: give every rank's Writer the same "
                                      "StoreTag")
            dcp_store.commit(self.target, self._epoch, dcp_store.index_bytes(index_plan),
                             [w.header for w in writes if w is not None],
                             [b for w in writes if w is not None for b in w.blobs], self.limits)
        elif self.options is None:
            writer.write_atomic(index_plan, layout.index_path(self.path))
            remove_unreferenced(self.path, keep)
        else:  # one object, after every rank file: the commit marker; then the cleanup (FORMAT.md §14.7)
            from ..io import remote

            store, prefix = layout.open_store(self.path, self.options)
            remote.save_plan(index_plan, store, layout.join(prefix, layout.INDEX_NAME))
            remove_unreferenced_objects(store, prefix, keep)
        metadata.storage_data = {LOGICAL_DIGEST: plan.file_digest(logical_raw)}
        metadata.planner_data = None
        metadata.storage_meta = None


def assign_hashing(plans: list[SavePlan], algorithm: str) -> list[RankJob]:
    """One job per rank: which split tensors it hashes (largest first, to the least loaded rank)."""
    world = len(plans)
    found: dict[str, list] = {}
    sizes: dict[str, tuple] = {}
    nbytes: dict[str, int] = {}
    for r, p in enumerate(plans):
        for item in p.items:
            td = item.tensor_data
            if td is None:  # every item a tensorcanon.dcp.SavePlanner plans is a tensor
                raise UsageError(f"{item.index.fqn}: the save plan holds a value that is not a tensor; "
                                 "plan the save with tensorcanon.dcp.SavePlanner")
            found.setdefault(item.index.fqn, []).append((r, tuple(td.chunk.offsets), tuple(td.chunk.sizes)))
            sizes[item.index.fqn] = tuple(td.size)
            nbytes[item.index.fqn] = item.tensor_storage_size() or 0
    split = [name for name, cs in found.items() if not (len(cs) == 1 and cs[0][2] == sizes[name])]
    jobs = [RankJob(r, world, algorithm) for r in range(world)]
    load = [0] * world
    for name in sorted(split, key=lambda n: (-nbytes[n], n)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += nbytes[name]
        jobs[r].tasks.append(HashTask(name, sorted(found[name], key=lambda c: (c[1], c[2]))))
    for job in jobs:
        job.exchange = bool(split)
    return jobs


def write_rank_file(folder: str, rank: int, world: int, obj: dict, algorithm: str,
                    limits: Limits, options: dict | None = None) -> tuple[str, dict[str, bytes]]:
    """Write one rank's file; return its digest and each top-level tensor's digest by key.

    Written whole under a temporary name, then renamed to its content name (one rename, one
    folder fsync: writer.replace_atomically), so a crash never leaves a partial file under a
    name an index could use. In object storage (``options`` given), where nothing can be
    renamed, every tensor is hashed first to name the file, then the file is written under
    that name as one object (remote.save_plan: it appears complete or not at all), checked
    to have that digest before it is committed.
    """
    p = writer.plan(obj, None, limits, algorithm)
    if options is not None:
        from ..io import remote

        named = writer.fingerprint(p)
        store, prefix = layout.open_store(folder, options)

        def same(written: str) -> None:
            if written != named:
                raise TensorCanonError(f"rank {rank}'s state changed while it was being saved; save again "
                                       "when no other thread modifies it")

        file_digest = remote.save_plan(p, store, layout.join(prefix, layout.rank_file_name(rank, world, named)),
                                       same)
    else:
        file_digest = writer.replace_atomically(
            os.path.join(folder, f".rank-{rank:05d}-of-{world:05d}"),  # names the temp file only (_RANK_TEMP)
            lambda f, tmp: writer.write(p, f), named=lambda digest: layout.rank_file_name(rank, world, digest))
    digests = {}
    root = p.root  # ["dict", key, node, key, node, ...]
    for key, node in items(root):
        if type(node) is list and node and node[0] == "tensor":
            digests[key] = p.tensors[node[1]].digest
    return file_digest, digests


def run_hash_tasks(folder: str, job: RankJob, planner: SavePlanner, own: dict, digests: list,
                   limits: Limits, options: dict | None = None,
                   fetch: Callable[[int, str], memoryview] | None = None) -> dict[str, bytes]:
    """Digest each assigned tensor: its bytes in C order across its chunks, read once. ``fetch(rank,
    key)``: another rank's chunk, where there are no rank files (a checkpoint in a store)."""
    by_name = {s.name: s for s in planner.planned().plan.tensors}
    opened: dict[int, RankFile] = {}
    out = {}
    try:
        for task in job.tasks:
            src = by_name[task.name]
            itemsize = src.dtype.itemsize
            views = []
            for rank, offsets, sizes in task.chunks:
                if rank == job.rank:
                    views.append(tensorbytes.host_bytes(own[(task.name, offsets)], "tensor"))
                    continue
                if fetch is not None:  # (a chunk without bytes has no blob)
                    views.append(fetch(rank, layout.chunk_key(task.name, offsets)) if all(sizes) else memoryview(b""))
                    continue
                f = opened.get(rank)
                if f is None:
                    path = layout.join(folder, layout.rank_file_name(rank, job.world_size, digests[rank]))
                    f = opened[rank] = RankFile.open(path, digests[rank], limits, options)
                key = layout.chunk_key(task.name, offsets)
                views.append(f.raw(f.info(key, functools.partial("chunk {!r}".format, key))))
            h = _digest.tensor_hasher(src.dtype.name, src.shape, job.algorithm)
            boxes = [tiling.Box(o, s) for _, o, s in task.chunks]
            for j, start, count in tiling.runs(src.shape, boxes):
                h.update(views[j][start * itemsize : (start + count) * itemsize])
            out[task.name] = h.digest()
            del views
    finally:
        for f in opened.values():
            f.close()
    return out


_RANK_TEMP = re.compile(r"\.\.rank-\d{5,}-of-\d{5,}\.")  # how write_rank_file's temp files begin


def remove_unreferenced(folder: str, keep: set[str]) -> list[str]:
    """After an index is committed: delete rank files it does not name, and the temp files of
    rank-file writes whose process died (of any rank and world size)."""
    def unwanted(name: str) -> bool:
        if layout.RANK_FILE_RE.fullmatch(name):
            return name not in keep
        m = _RANK_TEMP.match(name)
        return m is not None and writer.stale_temp(name, m.group(0))

    return writer.remove_files(folder, unwanted)


def remove_unreferenced_objects(store: storage.Store, prefix: str, keep: set[str]) -> list[str]:
    """:func:`remove_unreferenced` for a checkpoint in object storage (no temp objects exist there:
    a rank file appears complete or not at all). Best effort, as locally."""
    removed: list[str] = []
    with contextlib.suppress(TensorCanonError):
        found = store.find(prefix)
        for path in found:
            parent, _, name = path.rpartition("/")
            if parent == prefix and layout.RANK_FILE_RE.fullmatch(name) and name not in keep:
                with contextlib.suppress(TensorCanonError):
                    store.delete(path)
                    removed.append(name)
    return removed


__all__ = ["Writer", "CheckpointExistsError", "LOGICAL_DIGEST", "TensorCanonError"]
