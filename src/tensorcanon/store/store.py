"""``tensorcanon.Store``: many checkpoints in one folder or bucket, each tensor stored once.

A store holds *blobs*, one per distinct tensor, named by the tensor digest of
docs/FORMAT.md §7.1, and *tag records*, one per saved object, each the header of the file
``tensorcanon.save`` writes for it (manifest, table with every tensor digest, devices).
Saving writes only the tensors the store does not hold, compressed losslessly where that
pays (compress.py), then the record (atomically). Loading, verifying and exporting read a tag
as that file: its header from the record, its data section from the blobs (tagfile.py presents
it), through the one reader every file goes through (io/reader.CheckedFile), so a tag is checked
exactly as the file would be. docs/STORE.md is the user's guide and the layout's specification.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import api
from ..format import container, digest, optional, paths
from ..format.errors import (
    FormatError,
    IntegrityError,
    MissingFileError,
    TensorCanonError,
    UsageError,
)
from ..format.limits import DEFAULT, Limits
from ..format.tensorbytes import host_bytes
from ..io import placement, reader, writer
from ..io.source import Source
from . import backend, background, compress, layout
from .tagfile import _Bases, _Buffers, _prefixed, _TagFile

if TYPE_CHECKING:
    import torch
else:
    torch = optional.torch_module(globals())

#: A delta chain is at most this many links: the tensor after a blob of this depth is stored
#: whole again (grouped or zstd), so loading a tensor reads at most CHAIN + 1 blobs.
CHAIN = 8
#: Bytes of the last save's changed tensors kept in memory as the bases of the next save's deltas.
#: Beyond it, a base is read back from the store (CHAIN + 1 blobs at most).
BASE_CACHE = 4 << 30
#: A marker (a pending save's, a running collection's) older than this is taken as left by a
#: process that died (one on this machine whose process is gone is taken as such at once).
STALE = 3600.0
#: A live marker is rewritten (its time renewed) at least this often.
REFRESH = 600.0
#: What a record may weigh: its header is a file header (limits.max_header_bytes) plus a few bytes.
_RECORD_LIMIT = DEFAULT.max_header_bytes + (1 << 20)
#: New blobs of a save are encoded and written on this many threads at once.
WORKERS = 2
#: A tensor of fewer bytes than this is encoded on the saving thread: its encoding is mostly Python
#: calls, so on a worker it would wait for the interpreter lock the saving thread holds (and hand
#: over a future) for longer than it runs. LoRA adapters and their AdamW state (8-40 KiB each):
#: a save's wall time 29-34% less, its CPU time 26-29% less (benchmarks/RESULTS.md).
INLINE = 64 << 10
#: A tensor of at least this many bytes is encoded on the saving thread, its byte planes on
#: compress.py's threads (one large tensor then uses both cores too).
PARALLEL = 64 << 20
#: A new blob whose encoded size is under this goes into the save's pack (docs/STORE.md, "Packs");
#: a larger one is a loose object of its own, whose per-object cost is small beside its bytes.
PACK_BLOB_LIMIT = 1 << 20
#: A pack being written is closed, and another started, once it holds this many bytes.
PACK_SIZE = 256 << 20
#: gc rewrites a pack holding dead blobs whose live blobs take less than this fraction of its bytes.
REPACK_LIVE = 0.5
#: gc merges the packs smaller than MERGE_SMALL into one when there are at least MERGE_AT of them
#: (each save writes a pack: without merging, a reader would read ever more indexes).
MERGE_SMALL = 16 << 20
MERGE_AT = 8
#: Bytes read from a pack's end to find its trailer (and, for most packs, its whole index).
_TAIL = 64 << 10
_OURS = frozenset({layout.MARKER, layout.EPOCH, layout.TAGS, layout.PENDING, layout.GC, layout.TMP,
                   layout.PACKS, layout.BLOBS.split("/")[0]})


class Store:
    """A content-addressed, verifiable store of checkpoints (docs/STORE.md).

    ``root`` is a folder (created on the first save) or a URL of object storage
    (``s3://bucket/prefix``, ``memory://…``, any fsspec protocol; ``storage_options`` go to
    fsspec, as for :func:`tensorcanon.save`).

    Example::

        store = tensorcanon.Store("ckpts")
        digest = store.save("step-100", {"model": model.state_dict(), "opt": opt.state_dict()})
        state = store.load("step-100", map_location="cpu")
        store.verify()            # every record and blob against its digest
        store.export("step-100", "step-100.safetensors")   # the bytes tensorcanon.save writes
    """

    def __init__(self, root: str | os.PathLike[str], storage_options: Any = None) -> None:
        self._b = backend.open_backend(root, storage_options)
        self._lock = threading.Lock()
        # storage (data_ptr, offset, dtype, shape, stride, device) -> (weakref to the storage, its
        # nbytes, the tensor's version counter, digest): tensors unchanged since this process hashed them
        self._hashed: dict[tuple, tuple[Any, int, int, bytes]] = {}
        self._known: set[bytes] = set()          # blobs this process wrote or found in the store
        self._depth: dict[bytes, int] = {}       # blob digest -> its delta depth, where known
        # the last tag this object saved: (tensor name, prefix) -> digest (a base has the tensor's dtype and shape)
        self._last: dict[tuple[str, bytes], bytes] | None = None
        self._copies: dict[bytes, np.ndarray] = {}  # digest -> its bytes: the next save's delta bases
        # (tensor name, prefix) -> how its last blob written by this object was encoded: the codec,
        # the fraction of the bytes stored, whether a delta base was at hand (compress.encode's hint)
        self._codec_of: dict[tuple[str, bytes], tuple[int, float, bool] | None] = {}
        self._ready = False
        self._epoch: bytes | None = None         # the collection epoch (layout.EPOCH) seen at the last save
        self._layout: int | None = None          # the layout the store's marker says
        # The packs listed (packs/<hex>.pack): their checked indexes, the ones that could not be
        # read (and why), and where each blob they hold is: digest -> (pack, offset, length).
        self._packs: dict[str, layout.PackIndex] = {}
        self._bad_packs: dict[str, TensorCanonError] = {}
        self._gc_damaged: dict[str, TensorCanonError] = {}  # packs the last gc() found damaged and kept
        self._where: dict[bytes, tuple[str, int, int]] = {}
        self._pack_lock = threading.Lock()
        self._copies_chosen = 0                  # how many times _use_sound_copies moved a blob to another copy
        self._listed = False                     # packs/ listed at least once
        self._root_synced = False                # the root folder fsynced by a save of this object
        self._loose: set[bytes] | None = None    # object storage: the loose blobs listed during this save
        self._pending: tuple[int, background.Pending] | None = None  # save_async's under way: (its process, its future)

    def __repr__(self) -> str:
        return f"tensorcanon.Store({self._b.display()!r})"

    @property
    def root(self) -> str:
        """The store's folder or URL (credentials hidden)."""
        return self._b.display()

    # ------------------------------------------------------------------ the root
    def _check_root(self) -> None:
        """Refuse a root that is not a store (no marker), or a marker of another layout."""
        if not self._b.root_exists():
            raise MissingFileError(f"no store at {self._b.display()!r}: nothing was saved there yet "
                                   "(Store.save creates it)", filename=self._b.display())
        try:
            text = self._b.get(layout.MARKER, 4096)
        except MissingFileError:
            b = self._b
            if isinstance(b, backend.Local) and all(e.name in _OURS for e in os.scandir(b.root)):
                raise MissingFileError(f"no store at {b.display()!r} yet: it is being created (or its creation "
                                       "was interrupted: save to it to finish)", filename=b.display()) from None
            raise FormatError(f"{self._b.display()!r} is not a tensorcanon store: it has no "
                              f"{layout.MARKER!r} file") from None
        for version, marker in layout.MARKER_TEXTS.items():
            if text == marker:
                self._layout = version
                return
        raise FormatError(f"{self._b.display(layout.MARKER)!r} says {text[:60]!r}: not a store of layout "
                          f"{' or '.join(map(str, layout.LAYOUTS))} (the layouts this tensorcanon reads; a newer "
                          "tensorcanon may read it)")

    def _create(self, later: list) -> None:
        """Check the store's root, or make it a store (its marker's fsync added to ``later``)."""
        if self._ready:
            return
        if self._b.root_exists() and self._b.exists(layout.MARKER):
            self._check_root()
        else:
            b = self._b  # (names of ours: another process may be creating the store at the same time)
            local = isinstance(b, backend.Local) and b.root_exists()
            if local and any(e.name not in _OURS for e in os.scandir(b.root)):  # type: ignore[union-attr]
                raise UsageError(f"{self._b.display()!r} is a folder that is not empty and not a tensorcanon "
                                 "store: give a new or empty folder as a store's root")
            self._b.ensure()
            self._b.put(layout.MARKER, [layout.MARKER_TEXT], len(layout.MARKER_TEXT), durable=False, later=later)
            self._layout = layout.LAYOUT
        self._b.ensure()
        self._ready = True

    def _upgrade(self) -> None:
        """Before the first pack goes into a store of layout 1: its marker rewritten (atomically) to
        layout 2, so that a reader of layout 1 refuses the store instead of missing the packed blobs."""
        if self._layout is not None and self._layout < 2:
            self._b.put(layout.MARKER, [layout.MARKER_TEXT], len(layout.MARKER_TEXT))
            self._layout = layout.LAYOUT

    # ------------------------------------------------------------------ markers (docs/STORE.md, "gc")
    def _marker(self, folder: str) -> str:
        return f"{folder}/{backend.host()}.{os.getpid()}.{secrets.token_hex(8)}"

    def _stale(self, rel: str, mtime: float) -> bool:
        m = layout.MARKER_RE.match(rel.rsplit("/", 1)[-1])
        if m is None:
            return True
        if m.group(1) == backend.host() and not writer._pid_alive(int(m.group(2))):
            return True
        return self._b.now() - mtime > STALE

    def _live(self, folder: str) -> dict[str, float]:
        return {rel: t for rel, (_, t) in self._b.listing(folder).items() if not self._stale(rel, t)}

    @contextlib.contextmanager
    def _saving(self) -> Iterator[_Refresher]:
        """Hold a pending-save marker for the block, after waiting out any running collection."""
        me = self._marker(layout.PENDING)
        while True:
            self._b.put(me, [b""], 0, durable=False)  # (a marker matters while its process lives)
            running = self._live(layout.GC)
            if not running:
                break
            self._b.delete(me)  # a collection runs: step back until it ends (it waits for no one)
            while self._live(layout.GC):
                time.sleep(0.2)
        try:
            yield _Refresher(self._b, me)
        finally:
            with contextlib.suppress(TensorCanonError):
                self._b.delete(me)

    def _since_gc(self) -> None:
        """Forget which blobs exist (and their depths) if a collection ran since this object's last save:
        it may have deleted blobs this object wrote or saw (no collection runs during a save)."""
        try:
            epoch = self._b.get(layout.EPOCH, 64)
        except MissingFileError:
            epoch = b""
        if epoch != self._epoch:
            self._known.clear()
            self._depth.clear()
            self._epoch = epoch

    # ------------------------------------------------------------------ packs (docs/STORE.md, "Packs")
    def _refresh_packs(self) -> bool:
        """List ``packs/``; read and check the index of every pack not seen before; forget the packs
        gone. Returns whether anything changed. A pack whose trailer or index is refused is kept
        aside with its error (its blobs count as absent: a save writes them again)."""
        with self._pack_lock:
            listed = {rel for rel in self._b.listing(layout.PACKS) if layout.pack_digest(rel) is not None}
            packs = {rel: ix for rel, ix in self._packs.items() if rel in listed}
            bad = {rel: e for rel, e in self._bad_packs.items() if rel in listed}
            gone = len(packs) != len(self._packs)
            added = []
            for rel in sorted(listed - set(packs) - set(bad)):
                try:
                    packs[rel] = self._read_index(rel)
                except MissingFileError:
                    continue  # (deleted since it was listed)
                except (FormatError, IntegrityError) as e:
                    bad[rel] = e
                    continue
                added.append(rel)
            if gone:
                where: dict[bytes, tuple[str, int, int]] = {}
                for rel in sorted(packs):
                    for raw, (offset, length) in packs[rel].entries.items():
                        where.setdefault(raw, (rel, offset, length))
                self._where = where
            else:
                for rel in added:
                    for raw, (offset, length) in packs[rel].entries.items():
                        self._where.setdefault(raw, (rel, offset, length))
            self._packs, self._bad_packs = packs, bad
            self._listed = True
            return gone or bool(added)

    def _read_index(self, rel: str) -> layout.PackIndex:
        """The checked index of pack ``rel``: its trailer first (bounded by the pack's size), then
        the index it locates (most packs: both in one read of the last 64 KiB)."""
        blob = self._b.blob(rel)
        try:
            where = f"pack {blob.where!r}"
            tail = blob.read(max(0, blob.size - _TAIL), blob.size)
            index_at, count = layout.pack_trailer(tail, blob.size, where)
            n = count * layout.ENTRY_SIZE
            if n + layout.TRAILER_SIZE <= len(tail):
                index = tail[len(tail) - layout.TRAILER_SIZE - n : len(tail) - layout.TRAILER_SIZE]
            else:
                index = blob.read(index_at, index_at + n)
            return layout.parse_pack_index(index, index_at, count, blob.size, where)
        finally:
            blob.close()

    def _add_packs(self, packs: list[tuple[str, layout.PackIndex]]) -> None:
        """Packs this object wrote: known without listing them again."""
        with self._pack_lock:
            for rel, ix in packs:
                self._packs[rel] = ix
                for raw, (offset, length) in ix.entries.items():
                    self._where.setdefault(raw, (rel, offset, length))

    def _damage_note(self) -> str:
        """What to add to a missing blob's error where some packs could not be read."""
        if not self._bad_packs:
            return ""
        rel, e = sorted(self._bad_packs.items())[0]
        more = f" (and {len(self._bad_packs) - 1} more)" if len(self._bad_packs) > 1 else ""
        where = self._b.display(rel)  # (its error names the pack first: named once here)
        return f"; pack {where!r}{more} could not be read, and may hold it: {str(e).removeprefix(f'pack {where!r}: ')}"

    # ------------------------------------------------------------------ hashing, with the cache
    def _key(self, s: Any) -> tuple | None:
        v = s.value
        if s.kind == "ndarray" or type(v).__name__ == "Stored" or not s.nbytes:
            return None
        try:
            st = v.untyped_storage()
            if st is not v.untyped_storage():  # a torch that does not keep one object per storage
                return None
            return (st.data_ptr(), v.storage_offset(), v.dtype, tuple(v.shape), tuple(v.stride()), str(v.device),
                    v.is_conj(), v.is_neg())
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    def _cached(self, s: Any, key: tuple | None) -> bytes | None:
        """The digest this object hashed tensor ``s`` (its :meth:`_key` ``key``) to, if unchanged since."""
        if key is None:
            return None
        hit = self._hashed.get(key)
        if hit is None:
            return None
        ref, nbytes, version, raw = hit
        try:
            st = s.value.untyped_storage()
            same = ref() is st and st.nbytes() == nbytes and s.value._version == version
        except (RuntimeError, AttributeError):
            return None
        return raw if same else None

    def _remember(self, s: Any, raw: bytes, keep: dict, key: tuple | None) -> None:
        if key is None:
            return
        try:
            st = s.value.untyped_storage()
            keep[key] = (weakref.ref(st), st.nbytes(), s.value._version, raw)
        except (RuntimeError, AttributeError, TypeError):
            return

    # ------------------------------------------------------------------ blobs
    def _blob_exists(self, raw: bytes) -> bool:
        """Whether the store holds blob ``raw``: in a pack listed at this save, or a loose object (a
        local store: looked up; object storage: one listing of the loose blobs per save)."""
        if raw in self._known or raw in self._where:
            return True
        if self._b.is_local:
            found = self._b.exists(layout.blob_path(raw))
        else:
            if self._loose is None:
                self._loose = {d for d in map(layout.blob_digest, self._b.listing(layout.BLOBS)) if d is not None}
            found = raw in self._loose
        if found:
            self._known.add(raw)
        return found

    def _open_blob(self, raw: bytes, handles: dict[str, backend.Blob] | None = None, *, share: bool = False,
                   loc: str | tuple[str, int, int] | None = None,
                   heads: dict[tuple[str, int, int], layout.BlobHeader] | None = None,
                   ) -> tuple[backend.Blob, layout.BlobHeader]:
        """Blob ``raw`` opened, its header checked (nothing allocated for its claims). It is read from
        the pack that holds it, else as a loose object; where neither has it (a pack gone since the
        packs were listed: a collection rewrote it), the packs are listed again, once. ``handles``:
        packs already open (``share``: packs opened here are added to it); ``loc``: this copy only
        (``"loose"``, or a pack's ``(name, offset, length)``); ``heads``: the headers of blobs in
        the packs of ``handles`` parsed already, by place (one load's: the same bytes of the same
        open pack), used and filled (a loose blob's header is read each time)."""
        for attempt in (0, 1):
            at = self._where.get(raw) if loc is None else (None if loc == "loose" else loc)
            try:
                if at is None:
                    blob = self._b.blob(layout.blob_path(raw))
                else:
                    blob = self._open_packed(raw, cast(tuple, at), handles, share)
            except MissingFileError:
                if attempt or loc is not None or not self._refresh_packs():
                    raise
                continue
            break
        place = cast(tuple[str, int, int], at) if at is not None and heads is not None and handles is not None \
            and at[0] in handles else None
        known = heads.get(place) if heads is not None and place is not None else None
        if known is not None:
            return blob, known
        try:
            head = blob.read(0, min(blob.size, layout.HEAD))
            h = layout.parse_header(head, blob.size, f"blob {blob.where!r}")
        except BaseException:
            blob.close()
            raise
        self._depth[raw] = h.depth
        if heads is not None and place is not None:
            heads[place] = h
        return blob, h

    def _open_packed(self, raw: bytes, at: tuple[str, int, int], handles: dict[str, backend.Blob] | None,
                     share: bool) -> backend.Blob:
        rel, offset, length = at
        parent = handles.get(rel) if handles is not None else None
        owns = parent is None and not share
        if parent is None:
            parent = self._b.blob(rel)
            if share and handles is not None:
                handles[rel] = parent
        if offset + length > parent.size:
            if owns:
                parent.close()
            raise FormatError(f"pack {parent.where!r} is {parent.size} bytes, shorter than its index says (blob "
                              f"{raw.hex()} at byte {offset}, {length} bytes); it was truncated")
        return parent.part(offset, length, f"{parent.where} (blob {raw.hex()} at byte {offset})", owns=owns)

    def _depth_of(self, raw: bytes) -> int | None:
        if raw not in self._depth:
            try:
                blob, _ = self._open_blob(raw)
            except TensorCanonError:
                return None
            blob.close()
        return self._depth.get(raw)

    def _decode(self, raw: bytes, prefix: bytes | None = None, depth: int | None = None,
                handles: dict[str, backend.Blob] | None = None,
                loc: str | tuple[str, int, int] | None = None, pool: bool = True,
                bufs: _Buffers | None = None, *, out: Any = None, bases: _Bases | None = None) -> np.ndarray:
        """Blob ``raw`` decoded (its delta base first, recursively) and checked against ``raw``;
        ``pool``: a large blob's planes are decoded on the codec's threads; ``bufs``: the buffers
        it is decoded into are taken from there, and its delta base's given back once used;
        ``out``: decoded into this writable buffer of its size instead (a tensor being returned);
        ``bases``: the delta bases this load shares between blobs (:class:`_Bases`)."""
        blob, h = self._open_blob(raw, handles, loc=loc, heads=bases.heads if bases is not None else None)
        try:
            where = f"blob {blob.where!r}"
            _check_link(h, where, prefix, depth)
            return self._decode_checked(raw, h, blob.whole(), where, handles, pool=pool, bufs=bufs, out=out,
                                        bases=bases)
        finally:
            blob.close()

    def _decode_checked(self, raw: bytes, h: layout.BlobHeader, data: Any, where: str,
                        handles: dict[str, backend.Blob] | None = None, *, pool: bool = True,
                        bufs: _Buffers | None = None, out: Any = None, bases: _Bases | None = None) -> np.ndarray:
        """The bytes ``data`` of blob ``raw`` (header ``h``, checked) decoded, its delta base read
        from the store, and checked against ``raw``; ``pool``, ``bufs``, ``out`` and ``bases`` as
        for :meth:`_decode`."""
        if out is not None:
            target = compress.as_u8(out)
        else:
            target = bufs.take(h.size) if bufs is not None else np.empty(h.size, dtype=np.uint8)
        base = None
        used: list[np.ndarray] = []
        shared: list[bytes] = []
        if h.codec in layout.DELTAS:  # (delta, delta-sub or delta-twos)
            assert h.base is not None
            base_raw = h.base

            def decode_base() -> np.ndarray:
                return self._decode(base_raw, h.prefix, h.depth - 1, handles, pool=pool, bufs=bufs, bases=bases)

            def base() -> np.ndarray:
                try:
                    if bases is not None:
                        got = bases.get(base_raw, h.prefix, h.depth - 1, h.size, decode_base)
                        if got is not None:
                            shared.append(base_raw)
                            return got
                    used.append(decode_base())
                    return used[-1]
                except MissingFileError:
                    raise IntegrityError(f"{where} is a delta against {layout.show(base_raw)}, which the "
                                         f"store does not hold; the store is damaged{self._damage_note()}"
                                         ) from None
        try:
            compress.decode_into(h, data, target.data, base, where, pool=pool)
        finally:
            for d in shared:  # (a shared base is freed by its last user)
                assert bases is not None
                bases.done(d)
        if bufs is not None:  # (the base is not needed any more, nor seen by anyone else)
            for a in used:
                bufs.give(a)
        self._check_decoded(raw, h, target, where)
        return target

    def _check_decoded(self, raw: bytes, h: layout.BlobHeader | bytes, data: Any, where: str) -> None:
        """Raise unless ``data`` (with the prefix of header ``h``, or prefix ``h``) hashes to ``raw``."""
        prefix = h if isinstance(h, bytes) else h.prefix
        base_raw = None if isinstance(h, bytes) else h.base
        hasher = digest.constructor(layout.ALGORITHM)(prefix)
        hasher.update(data)
        got = hasher.digest()
        if got != raw:
            base = f" (a delta against {layout.show(base_raw)})" if base_raw is not None else ""
            raise IntegrityError(f"{where}{base} decodes to bytes whose digest is {layout.show(got)}, not the "
                                 f"{layout.show(raw)} it is named by; the blob is damaged (or its delta base "
                                 "lies)", expected=layout.show(raw), actual=layout.show(got))

    def _write_blob(self, s: Any, raw: bytes, data: Any, base: tuple[bytes, int] | None, fresh: bool,
                    keep: bool, pool: bool, later: list,
                    hint: tuple[int, float, bool] | None = None
                    ) -> tuple[int, np.ndarray | None, list[Any] | None, int, tuple[int, float, bool]]:
        """Encode tensor ``s`` (bytes ``data``, digest ``raw``) and check its blob. A blob of
        PACK_BLOB_LIMIT bytes or more is written as a loose object (not yet durable); a smaller one
        is returned, for the saving thread to put into the save's pack. Returns its delta depth,
        (``keep``) its bytes, proven to hash to ``raw``: a later save's delta base, and the blob's
        pieces (None where written), length and how it was encoded (the next ``hint``). ``fresh``:
        ``raw`` was computed from ``data`` in this save; ``hint``: how its previous blob was encoded
        (compress.encode's hint, used where a delta base is at hand as it was then). Runs on a
        worker thread: it changes nothing of the object but the depths it learns."""
        prefix = digest.tensor_prefix(s.dtype.name, s.shape)
        where = (f"the tensor at {paths.join(s.path)} (changed while it was being saved, or written behind its "
                 "version counter: save it again)")
        base_bytes = None
        if base is not None:
            base_bytes = self._copies.get(base[0])
            if base_bytes is None:
                try:
                    base_bytes = self._decode(base[0], prefix, base[1])
                except TensorCanonError:
                    base, base_bytes = None, None  # an unusable base: store the tensor whole
        at_hand = base_bytes is not None
        enc = compress.encode(data, s.dtype.itemsize, base_bytes, pool=pool,
                              hint=hint[:2] if hint is not None and hint[2] == at_hand else None)
        how = (enc.codec, 1.0 if enc.codec == layout.RAW else enc.payload_size / max(1, len(data)), at_hand)
        is_delta = enc.codec in layout.DELTAS  # (storecodec: delta, delta-sub or delta-twos)
        depth = base[1] + 1 if is_delta and base is not None else 0
        head = layout.header_bytes(enc.codec, depth, prefix, len(data),
                                   base[0] if is_delta and base is not None else None, enc.planes)
        # What is written must hash to its name: a tensor changed since it was hashed (by another
        # thread, or behind its version counter) is refused rather than stored under the wrong name.
        copy = None
        if enc.codec == layout.RAW:
            if keep:  # (the copy is what is hashed and written: the bytes kept are those proven)
                copy = np.array(compress.as_u8(data))
                data = copy
            if keep or not fresh:  # (fresh, not kept: hashed from these very bytes a moment ago)
                self._check_decoded(raw, prefix, data, where)
            pieces: list[Any] = [head, data]
            total = len(head) + len(data)
        else:  # decoded and hashed as a reader would: the writer never writes a blob its reader refuses
            blob = b"".join([head, *enc.pieces])
            h = layout.parse_header(blob[: layout.HEAD], len(blob), "a blob being written")
            check = np.empty(h.size, dtype=np.uint8)
            compress.decode_into(h, blob, check.data, (lambda: base_bytes) if is_delta else None,
                                 "a blob being written", pool=pool)
            self._check_decoded(raw, h, check, where)
            copy = check if keep else None
            del check
            pieces = [blob]
            total = len(blob)
        if total < PACK_BLOB_LIMIT:
            return depth, copy, pieces, total, how
        # (its fsync starts now, on another thread; every blob is durable before the record is written)
        self._b.put(layout.blob_path(raw), pieces, total, durable=False, later=later)
        return depth, copy, None, total, how

    # ------------------------------------------------------------------ records
    def _base_names(self) -> dict[tuple[str, bytes], bytes]:
        """(Tensor name, prefix) -> digest in the tag a delta is taken against: the last one this
        object saved, else the store's most recently written tag. Keyed by the prefix too: a tensor
        whose dtype or shape changed has no base (a delta's base MUST have its prefix)."""
        if self._last is not None:
            return self._last
        found = {rel: t for rel, (_, t) in self._b.listing(layout.TAGS).items()
                 if layout.tag_of(rel.rsplit("/", 1)[-1]) is not None}
        if not found:
            return {}
        newest = max(found, key=lambda r: (found[r], r))
        tag = layout.tag_of(newest.rsplit("/", 1)[-1])
        assert tag is not None
        try:
            with self._tag_file(tag, blobs=False) as cf:
                return {(r.name, digest.tensor_prefix(r.dtype.name, r.shape)): r.digest for r in cf.rows}
        except TensorCanonError:
            return {}

    def _record(self, tag: str) -> bytes:
        """The header a tag's record holds, the record checked (a tensorcanon file, its digest)."""
        rel = layout.tag_path(tag)
        where = self._b.display(rel)
        try:
            data = self._b.get(rel, _RECORD_LIMIT)
        except MissingFileError:
            self._check_root()
            raise MissingFileError(f"the store {self._b.display()!r} has no tag {tag!r} (its tags: "
                                   f"{_few(self._tags())})", filename=where) from None
        try:
            obj = api.loads(data)
        except TensorCanonError as e:
            _prefixed(e, f"tag {tag!r} (record {where!r}): ")
            raise
        return layout.record_header(obj, tag, f"tag {tag!r} (record {where!r})")

    @contextlib.contextmanager
    def _tag_file(self, tag: str, limits: Limits = DEFAULT, *, blobs: bool = True) -> Iterator[reader.CheckedFile]:
        """The file of ``tag`` (header from its record, data from its blobs), checked by CheckedFile;
        ``blobs=False``: its header only (the rows), no blob opened, no data to read."""
        if not self._ready:
            self._check_root()
        header = self._record(layout.check_tag(tag))
        with self._header_file(header, tag, limits, blobs=blobs) as cf:
            yield cf

    @contextlib.contextmanager
    def _header_file(self, header: bytes, tag: str, limits: Limits = DEFAULT, *,
                     blobs: bool = True) -> Iterator[reader.CheckedFile]:
        """The file whose header is ``header`` and whose data section is blobs of this store, checked by
        CheckedFile; ``tag`` names it in errors. (:meth:`_tag_file` after reading the record; tensorcanon.dcp
        reads a sharded checkpoint's rank files, whose headers its record holds, through it.)"""
        prefix, raw = header[: container.LENGTH_SIZE], header[container.LENGTH_SIZE :]
        where = f"tag {tag!r}"
        try:
            parsed = container.parse_raw(prefix, raw, None, limits)
        except TensorCanonError as e:
            _prefixed(e, f"{where}: ")
            raise
        size = len(header) + max((e.end for e in parsed.entries), default=0)
        vf = _TagFile(self, tag, header, size)
        try:
            try:
                cf = reader.CheckedFile(Source(cast(Any, vf), name=f"{self._b.display()} tag {tag}"), limits)
            except TensorCanonError as e:
                _prefixed(e, f"{where}: ")
                raise
            if not cf.is_tensorcanon:
                raise FormatError(f"{where}: its record holds a plain safetensors header, not a tensorcanon one")
            if blobs:
                if not self._listed:  # (then a blob found nowhere lists the packs again: _open_blob)
                    self._refresh_packs()
                vf.attach(cf.rows, cf.tensor_path)
            yield cf
        finally:
            vf.close()

    # ------------------------------------------------------------------ the public names
    def save(self, tag: str, obj: Any, *, metadata: dict | None = None) -> str:
        """Save ``obj`` under ``tag`` and return its digest (``tensorcanon.fingerprint(obj)``).

        Writes only the tensors the store does not hold (by tensor digest), each compressed
        losslessly where that pays, then the tag's record, atomically: a tag is listed complete or
        not at all, and saving a tag again replaces it. Tensors unchanged since this object last
        hashed them (same storage, same version counter) are not hashed again. ``metadata`` as in
        :func:`tensorcanon.save`.
        """
        tag = layout.check_tag(tag)
        background.refuse_at_exit("Store.save", tag)
        self._drain(raise_failure=True)
        p = writer.plan(obj, metadata)
        writer.refuse_skip_data(p, "Store.save")
        return self._put(p, tag)[0]

    def save_async(self, tag: str, obj: Any, *, metadata: dict | None = None) -> Future[str]:
        """:meth:`save`, the slow part in the background: returns once the object is taken, a future
        whose result is the digest :meth:`save` returns, set once the tag is listed.

        Before it returns, every tensor the store does not hold is copied, and the copy hashed (and
        every other tensor hashed, unless unchanged since this object last hashed it), so ``obj``
        may change as soon as it returns; compressing, checking and writing the copies, then the
        record, run on a background thread. One background save runs at a time: a save (either
        kind) waits for this object's previous one first, and raises its failure there if
        ``result()`` was never asked for it; the other methods of the object wait for it too. A
        background save under way at exit is finished first (Python joins the thread). The copies
        cost memory: the bytes of the new tensors, until written (docs/STORE.md, "In the background").
        """
        tag = layout.check_tag(tag)
        background.refuse_at_exit("Store.save_async", tag)
        self._drain(raise_failure=True)
        p = writer.plan(obj, metadata)
        writer.refuse_skip_data(p, "Store.save_async")
        with self._lock:
            snap = self._snapshot(p)
        pending = background.Pending(tag)
        pending.set_running_or_notify_cancel()  # (taken: cancel() cannot undo it, the save goes on)
        self._pending = (os.getpid(), pending)
        try:
            background.pool().submit(self._put_pending, p, tag, snap, pending)
        except RuntimeError as e:  # (the interpreter began to exit since refuse_at_exit looked)
            pending.seen = True
            pending.set_exception(e)
            background.refuse_at_exit("Store.save_async", tag)
            raise
        return pending

    def _put_pending(self, p: writer.Plan, tag: str, snap: background.Snapshot, pending: background.Pending) -> None:
        """The background part of :meth:`save_async`: its result, or its failure, into ``pending``."""
        background.HERE.on = True  # (the object's own methods called from here wait for nothing)
        try:
            pending.set_result(self._put(p, tag, snap)[0])
        except BaseException as e:  # noqa: BLE001 (the thread's failure belongs to the future)
            if isinstance(e, TensorCanonError):
                _prefixed(e, f"the background save of tag {tag!r}: ")
            pending.set_exception(e)

    def _drain(self, *, raise_failure: bool = False) -> None:
        """Wait for this object's background save under way, if any (one started by this process:
        a forked child's copy of the object waits for nothing). ``raise_failure``: raise its failure
        if it failed and ``result()``/``exception()`` of its future was never asked for."""
        mine = self._pending
        if mine is not None and mine[0] != os.getpid():
            # A child forked while its parent's background save ran: that thread is not here, and the
            # object's locks it held stay held in this copy. Fresh locks; no save of this process is under way.
            self._pending = None
            self._lock, self._pack_lock = threading.Lock(), threading.Lock()
            return
        if mine is None or getattr(background.HERE, "on", False):
            return
        pending = mine[1]
        wait([pending])
        if raise_failure and not pending.seen:
            e = Future.exception(pending)
            if e is not None:
                pending.seen = True
                raise e

    def _snapshot(self, p: writer.Plan) -> background.Snapshot:
        """The part of :meth:`save_async` done before it returns: every tensor of ``p`` given its digest
        (the cache's, else hashed), and each one the store does not hold copied first and its copy
        hashed (the bytes a background save writes, whatever the tensor becomes)."""
        self._since_gc()
        self._refresh_packs()
        self._loose = None
        snap = background.Snapshot()
        for s in p.ordered:
            key = self._key(s)
            raw = self._cached(s, key)
            if raw is not None and s.nbytes and raw not in snap.data and not self._blob_exists(raw):
                raw = None  # (a collection deleted the blob since: taken as a new tensor)
            copy = None
            if raw is None:
                h = p.hasher(s)
                if s.nbytes:
                    copy = _own_copy(s)  # (copied, then hashed: what is hashed is kept)
                    h.update(copy.data)
                raw = h.digest()
            self._remember(s, raw, snap.hashed, key)
            s.digest = raw
            if copy is None or raw in snap.data or self._blob_exists(raw):
                continue
            snap.data[raw] = copy
        return snap

    def _put(self, p: writer.Plan, tag: str | None, snap: background.Snapshot | None = None) -> tuple[str, bytes]:
        """:meth:`save` of plan ``p``: its new blobs, then the record of ``tag``; returns the file's digest
        and header. ``tag=None`` writes the blobs only, durable (tensorcanon.dcp: one rank's file of a
        sharded checkpoint, whose record the coordinator writes last, with :meth:`_put_record`).
        ``snap``: the digests of ``p``'s tensors, and the copies of those the store did not hold,
        taken by :meth:`save_async` (a tensor the store has lost since is read as it is now, and
        refused unless it still hashes to its digest)."""
        with self._lock:
            later: list[Any] = []  # the fsyncs under way: loose blobs, a new marker; folders to fsync
            self._create(later)
            with self._saving() as refresh:
                self._since_gc()
                self._refresh_packs()
                self._loose = None
                names = self._base_names()
                hashed: dict[tuple, tuple[Any, int, int, bytes]] = {}
                copies: dict[bytes, np.ndarray] = {}
                kept = 0
                # New blobs are encoded and checked on WORKERS threads (zstd, xxhash and file writes
                # release the GIL), a few at a time, while this thread hashes the next tensors (those
                # under INLINE bytes and from PARALLEL up: on this thread); this thread appends the
                # small ones to the save's pack in the order of the tensors.
                order: collections.deque[tuple[bytes, tuple[str, bytes], Future[Any]]] = collections.deque()
                queued: set[bytes] = set()
                done: list[tuple[bytes, int, np.ndarray | None]] = []
                codecs: dict[tuple[str, bytes], tuple[int, float, bool]] = {}
                packed: list[tuple[str, layout.PackIndex]] = []
                pack: list[_PackBuilder] = []
                can_delta = compress.zstd() is not None

                def settle_one() -> None:
                    raw, named, job = order.popleft()
                    depth, copy, pieces, total, codecs[named] = job.result()  # (the first failure raised, in order)
                    done.append((raw, depth, copy))
                    if pieces is None:
                        return
                    if pack and pack[0].full(total):
                        packed.append(pack.pop().finish())
                    if not pack:
                        pack.append(_PackBuilder(self))
                    pack[0].add(raw, pieces, total)

                try:
                    for s in p.ordered:
                        data: Any = None
                        if snap is not None:
                            raw = s.digest
                            data = snap.data.get(raw)
                            fresh = data is not None  # (the copy hashed to it)
                        else:
                            key = self._key(s)  # (once: a parameter's methods are slow to call)
                            cached = self._cached(s, key)
                            fresh = cached is None
                            if cached is None:
                                data = _bytes_of(s)
                                h = p.hasher(s)
                                h.update(data)
                                raw = h.digest()
                            else:
                                raw = cached
                            self._remember(s, raw, hashed, key)
                            s.digest = raw
                        if not s.nbytes or raw in queued or self._blob_exists(raw):
                            if raw in self._copies:
                                copies[raw] = self._copies[raw]
                            continue
                        if data is None:
                            data = _bytes_of(s)
                        base = None
                        named = (s.name, digest.tensor_prefix(s.dtype.name, s.shape))
                        old = names.get(named)
                        if can_delta and old is not None and old != raw:
                            depth = self._depth_of(old)
                            if depth is not None and depth < CHAIN:
                                base = (old, depth)
                        while order and (len(order) >= 2 * WORKERS or order[0][2].done()):
                            settle_one()  # (bounded: each holds its encoded bytes)
                            refresh()
                        # (a copy: the tensor will change; without zstd there are no deltas to take)
                        keep = can_delta and kept + len(data) <= BASE_CACHE
                        kept += len(data) if keep else 0
                        big = len(data) >= PARALLEL
                        hint = self._codec_of.get(named)
                        job = _workers().submit(self._write_blob, s, raw, data, base, fresh, keep, False, later, hint) \
                            if INLINE <= len(data) < PARALLEL \
                            else _done(self._write_blob, s, raw, data, base, fresh, keep, big, later, hint)
                        order.append((raw, named, job))
                        queued.add(raw)
                        refresh()
                    while order:
                        settle_one()
                    header, manifest_raw = p.header()
                    if pack:
                        pack[0].seal()
                    out = self._b.appender() if tag is not None else None  # (no tag: blobs only, for dcp)
                    try:
                        if out is not None:
                            out.write(api.dumps(layout.record_object(cast(str, tag), header)))
                            out.start_sync()  # (the record's fsync and the pack's run at once)
                        if pack:  # (renamed; its folder fsynced by settle, with the others)
                            packed.append(pack.pop().finish(later))
                        if not self._root_synced:  # (the marker's and the folders' names, once per object)
                            self._b.root_later(later)
                        self._b.settle(later)  # every pack and blob durable before the record that names them
                        if out is not None:
                            out.finish(layout.tag_path(cast(str, tag)))
                        self._root_synced = True
                    except BaseException:
                        if out is not None:
                            out.abort()
                        raise
                except BaseException:
                    wait([f for _, _, f in order])  # (fsyncs started by a failed save finish on their own)
                    if pack:
                        pack.pop().abort()
                    raise
                for raw, depth, copy in done:
                    self._depth[raw] = depth
                    self._known.add(raw)
                    if copy is not None:
                        copies[raw] = copy
                self._add_packs(packed)
                self._hashed = hashed if snap is None else snap.hashed
                self._copies = copies
                self._last = {(s.name, digest.tensor_prefix(s.dtype.name, s.shape)): s.digest for s in p.tensors}
                self._codec_of = {n: codecs.get(n, self._codec_of.get(n)) for n in self._last
                                  if n in codecs or n in self._codec_of}  # (the tensors of this save only)
        return p.file_digest(manifest_raw), header

    def load(self, tag: str, *, map_location: Any = None, mmap: bool = False) -> Any:
        """The object saved under ``tag``, every tensor checked against its digest.

        ``map_location`` as in :func:`tensorcanon.load`. ``mmap=True``: tensors whose blob is stored
        raw in a local store view a private, copy-on-write map of it (hashed in place first);
        the others are decoded into memory.
        """
        self._drain()  # (this object's background save first)
        if mmap is not False and mmap is not True:
            raise UsageError(f"mmap must be True or False, not {mmap!r}")

        def load() -> Any:
            with self._tag_file(tag) as cf:
                placement.check_all(cf.rows, map_location, cf.tensor_path)
                vf = cf.src.f
                assert isinstance(vf, _TagFile)
                return cf._decode(vf.values(cf, map_location, mmap))[0]

        return self._sound_copies(tag, load)

    def _sound_copies(self, tag: str, read: Callable[[], Any]) -> Any:
        """``read()`` of ``tag``; where it finds damage and a blob it needs (or a delta base below
        one) is held more than once (two saves wrote it at once, each into its own pack; a pack and
        a loose copy), every such blob whose copy read first does not decode to its digest is read
        from one that does from then on, and ``read()`` runs again (docs/STORE.md, "Copies"). The
        damaged copy stays, for the whole store's verify to report and gc to drop. Another thread of
        this object may have moved the blobs to sound copies while ``read()`` ran: then the pass
        here finds nothing to change, and ``read()`` runs again all the same."""
        chosen = self._copies_chosen
        try:
            return read()
        except (FormatError, IntegrityError):
            if not self._use_sound_copies(tag) and self._copies_chosen == chosen:
                raise
        return read()

    def _use_sound_copies(self, tag: str) -> bool:
        """:meth:`_sound_copies`'s choice of copies; whether any changed."""
        try:
            with self._tag_file(tag, blobs=False) as cf:
                stack = [r.digest for r in cf.rows if r.nbytes]
            loose = self._b.listing(layout.BLOBS)
        except TensorCanonError:
            return False
        copies: dict[bytes, list[str | tuple[str, int, int]]] = {}
        for rel, ix in sorted(self._packs.items()):
            for raw, (offset, length) in ix.entries.items():
                copies.setdefault(raw, []).append((rel, offset, length))
        for rel in loose:
            named = layout.blob_digest(rel)
            if named is not None:
                copies.setdefault(named, []).append("loose")
        if all(len(locs) < 2 for locs in copies.values()):
            return False  # (no blob is held twice: the usual store, whose error is raised at once)
        depth: dict[bytes, int] = {}  # the tag's blobs and, through every copy's header, their bases
        while stack:
            raw = stack.pop()
            if raw in depth:
                continue
            depth[raw] = layout.MAX_DEPTH
            for loc in copies.get(raw, []):
                try:
                    blob, h = self._open_blob(raw, loc=loc)
                except TensorCanonError:
                    continue
                blob.close()
                depth[raw] = min(depth[raw], h.depth)
                if h.base is not None:
                    stack.append(h.base)
        # Bases before the blobs that name them (by depth): a base's copy is chosen before its users
        # are checked, so one pass does it, each blob held twice decoded once or twice.
        changed = False
        for raw in sorted((r for r in depth if len(copies.get(r, [])) > 1), key=lambda r: (depth[r], r)):
            now = self._where.get(raw, "loose")
            if self._sound(raw, now):
                continue
            for loc in copies[raw]:
                if loc != now and self._sound(raw, loc):
                    with self._pack_lock:
                        if loc == "loose":
                            self._where.pop(raw, None)
                        else:
                            self._where[raw] = cast(tuple[str, int, int], loc)
                        self._copies_chosen += 1
                    changed = True
                    break
        return changed

    def verify(self, tag: str | None = None) -> Any:
        """Check ``tag`` (its record, every blob it uses and its delta bases, decoded and hashed, and
        its object tree) and return its digest; with no tag, check the whole store (every tag and
        every blob, used or not) and return ``{tag: digest}``. Raises :class:`IntegrityError` (or
        :class:`FormatError`) naming the tag and blob that failed."""
        self._drain()  # (this object's background save first)
        if tag is not None:
            return self._sound_copies(tag, lambda: self._verify_tag(tag))
        out: dict[str, str] = {}
        for kind, name, result in self.checks():
            if isinstance(result, BaseException):
                raise result
            if kind == "tag":
                out[name] = result
        return out

    def checks(self) -> Iterator[tuple[str, str, Any]]:
        """Every check of the whole store, one at a time: ``("tag", tag, digest or the error)`` for
        each tag, then ``("blob", name, None or the error)`` for each loose blob no tag used (a
        tag's check decodes its own blobs), then ``("pack", name, None or the error)`` for each
        pack: its bytes against its name, its header and index, and every blob it holds that no
        tag's check read from it. For reports that go on past the first damage."""
        self._drain()  # (this object's background save first)
        self._check_root()
        self._refresh_packs()
        seen: set[bytes] = set()
        # (an object another writer removed since it was listed, a tag deleted or a blob or pack
        # collected, is left out: its failure is no damage of what the store holds)
        for t in self._tags():
            try:
                with self._tag_file(t, blobs=False) as cf:
                    seen.update(r.digest for r in cf.rows)
                result: Any = self._sound_copies(t, functools.partial(self._verify_tag, t))
            except (FormatError, IntegrityError, MissingFileError) as e:
                if self._vanished(layout.tag_path(t), layout.TAGS):
                    continue
                if isinstance(e, MissingFileError):
                    raise
                result = e
            yield "tag", t, result
        for rel in sorted(self._b.listing(layout.BLOBS)):
            raw = layout.blob_digest(rel)
            if raw is None or (raw in seen and raw not in self._where):
                continue
            try:
                self._decode(raw, loc="loose")
                result = None
            except (FormatError, IntegrityError, MissingFileError) as e:
                if self._vanished(rel, layout.BLOBS):
                    continue
                if isinstance(e, MissingFileError):
                    raise
                result = e
            yield "blob", self._b.display(rel), result
        for rel in sorted(set(self._packs) | set(self._bad_packs)):
            try:
                self._check_pack(rel, seen)
                result = None
            except (FormatError, IntegrityError, MissingFileError) as e:
                if self._vanished(rel, layout.PACKS):
                    continue
                if isinstance(e, MissingFileError):
                    raise
                result = e
            yield "pack", self._b.display(rel), result

    def _vanished(self, rel: str, folder: str) -> bool:
        """Whether object ``rel`` of ``folder`` is gone now (another writer removed it since it was listed)."""
        return rel not in self._b.listing(folder) and rel not in self._b.irregular(folder)

    def _check_pack(self, rel: str, seen: set[bytes]) -> None:
        """Pack ``rel`` checked whole: its bytes hash to its name, it starts with a pack's header, its
        index is sound, and every blob it holds decodes to its digest (those a tag's check read from
        it were decoded then)."""
        if rel in self._bad_packs:
            raise self._bad_packs[rel]
        ix = self._packs[rel]
        named = layout.pack_digest(rel)
        assert named is not None
        blob = self._b.blob(rel)
        try:
            where = f"pack {blob.where!r}"
            h = digest.constructor(layout.ALGORITHM)(b"")
            step = 16 << 20
            for at in range(0, blob.size, step):
                h.update(blob.read(at, min(blob.size, at + step)))
            got = h.digest()
            if got != named or blob.size != ix.size:
                raise IntegrityError(f"{where}: its {blob.size} bytes hash to {layout.show(got)}, not the "
                                     f"{layout.show(named)} it is named by; the pack is damaged (or was replaced)",
                                     expected=layout.show(named), actual=layout.show(got))
            if blob.read(0, len(layout.PACK_HEADER)) != layout.PACK_HEADER:
                raise FormatError(f"{where}: it does not start with a pack's header ({layout.PACK_MAGIC!r} and "
                                  f"{len(layout.PACK_HEADER) - len(layout.PACK_MAGIC)} zero bytes)")
        finally:
            blob.close()
        handles: dict[str, backend.Blob] = {rel: self._b.blob(rel)}  # (opened once for all its blobs)
        try:
            for raw, (offset, length) in sorted(ix.entries.items(), key=lambda e: e[1]):
                if raw in seen and self._where.get(raw) == (rel, offset, length):
                    continue
                self._decode(raw, handles=handles, loc=(rel, offset, length))
        finally:
            for b in handles.values():
                b.close()

    def _verify_tag(self, tag: str) -> str:
        with self._tag_file(tag) as cf:
            return self._verify_file(tag, cf)

    def _verify_file(self, tag: str, cf: reader.CheckedFile) -> str:
        try:
            return cf.verify()
        except TensorCanonError as e:
            _prefixed(e, f"tag {tag!r}: ")
            raise

    def export(self, tag: str, path: str | os.PathLike[str], *, storage_options: Any = None) -> str:
        """Write ``tag`` as one file at ``path`` (a path or URL): the bytes ``tensorcanon.save``
        writes for the object, every tensor checked on the way; returns its digest."""
        self._drain()  # (this object's background save first)
        if not isinstance(path, (str, os.PathLike)):
            raise UsageError(f"Store.export writes to a path or a URL, not {type(path).__name__}"
                             + (" (a path in bytes: os.fsdecode(path))" if isinstance(path, bytes) else ""))

        target = api.storage.resolve(path, storage_options)
        local = api.storage.local_target(target.url) if isinstance(target, api.storage.Location) else target
        if local is not None and self._b.holds(os.fspath(local)):
            raise UsageError(f"Store.export: {os.fspath(path)!r} is inside the store's folder, where gc deletes "
                             "what is not the store's; export to a path outside it")

        def export() -> str:
            with self._tag_file(tag) as cf:
                cf.check_tree()
                vf = cf.src.f
                assert isinstance(vf, _TagFile)

                def fill(f: Any) -> str:
                    vf.write_to(f, cf)
                    return cf.digest or ""

                if isinstance(target, api.storage.Location):
                    from ..io import remote

                    store, obj = api.storage.open_store(target.url, target.options)
                    return remote.write_object(store, obj, fill, hold=0, total=vf.size)
                return writer.replace_atomically(target, lambda f, tmp: fill(f))

        return cast(str, self._sound_copies(tag, export))

    def tags(self) -> list[str]:
        """Every tag of the store, sorted."""
        self._drain()  # (this object's background save first)
        return self._tags()

    def _tags(self) -> list[str]:
        """:meth:`tags`, not waiting for a background save (called where this object's lock may be
        held: a background save waits for that lock)."""
        if not self._b.root_exists():
            return []
        self._check_root()  # (layout: a reader MUST refuse a root without the marker, or with other bytes)
        out = []
        # (a folder or FIFO in place of a record is listed too: read, it is damage, where left out
        # the whole-store verify passed and gc deleted the blobs of a tag it could not read)
        for rel in [*self._b.listing(layout.TAGS), *self._b.irregular(layout.TAGS)]:
            tag = layout.tag_of(rel.rsplit("/", 1)[-1])
            if tag is not None and rel == layout.tag_path(tag):
                out.append(tag)
        return sorted(out)

    def delete(self, tag: str) -> None:
        """Remove ``tag`` (its record); its blobs stay until :meth:`gc` finds no tag uses them."""
        self._drain()  # (this object's background save first)
        rel = layout.tag_path(tag)
        self._check_root()
        with self._lock:
            if not self._b.delete(rel):
                raise MissingFileError(f"the store {self._b.display()!r} has no tag {tag!r}",
                                       filename=self._b.display(rel))
            if self._last is not None:
                self._last = None  # (its blobs may go: take the next delta's base from what remains)

    def gc(self) -> dict[str, int]:
        """Delete every blob no tag needs (directly, or as a delta base), and what dead processes
        left (temp files, markers): a loose blob no tag needs is deleted, a pack none of whose blobs
        a tag needs is deleted, and a pack mostly of such blobs (or one of many small packs) is
        rewritten with the blobs still needed, made durable, before the old one is deleted. Safe
        while other processes save (docs/STORE.md, "gc"): it announces itself, waits for the saves
        under way, and saves that start meanwhile wait for it. Returns counts: ``deleted_blobs``,
        ``freed_bytes``, ``kept_blobs``, ``deleted_packs``, ``written_packs``."""
        self._drain()  # (this object's background save first)
        self._check_root()
        with self._lock:
            self._b.ensure()
            me = self._marker(layout.GC)
            self._b.put(me, [b""], 0, durable=False)
            refresh = _Refresher(self._b, me)
            self._gc_damaged = {}
            try:
                waited_for = set(self._live(layout.PENDING))
                while waited_for:
                    time.sleep(0.1)
                    refresh()
                    waited_for &= set(self._live(layout.PENDING))
                for rel, (_, when) in self._b.listing(layout.PENDING).items():
                    if self._stale(rel, when):
                        self._b.delete(rel)
                for rel, (_, when) in self._b.listing(layout.GC).items():
                    if rel != me and self._stale(rel, when):
                        self._b.delete(rel)
                self._refresh_packs()
                live: set[bytes] = set()
                for tag in self._tags():
                    try:
                        with self._tag_file(tag, blobs=False) as cf:
                            live.update(r.digest for r in cf.rows if r.nbytes)
                    except MissingFileError:
                        if self._vanished(layout.tag_path(tag), layout.TAGS):
                            continue  # (deleted by another writer since it was listed: its blobs are dead)
                        raise
                # The delta bases the live blobs need, and theirs: those of EVERY copy of a blob (each
                # pack entry, the loose one). Following one copy's header only, a copy that lies (or
                # is damaged) would leave the base of an honest copy to be deleted.
                copies_of: dict[bytes, list[str | tuple[str, int, int]]] = {}
                for rel, ix in sorted(self._packs.items()):
                    for raw, (offset, length) in ix.entries.items():
                        copies_of.setdefault(raw, []).append((rel, offset, length))
                loose_blobs = self._b.listing(layout.BLOBS)
                for rel in loose_blobs:
                    named = layout.blob_digest(rel)
                    if named is not None:
                        copies_of.setdefault(named, []).append("loose")
                todo = list(live)
                while todo:
                    raw = todo.pop()
                    locs: list[str | tuple[str, int, int] | None] = [*copies_of.get(raw, [])] or [None]
                    for loc in locs:
                        try:
                            blob, h = self._open_blob(raw, loc=loc)
                        except MissingFileError:
                            continue  # (verify reports it; nothing to keep)
                        blob.close()
                        if h.base is not None and h.base not in live:
                            live.add(h.base)
                            todo.append(h.base)
                deleted = freed = kept = 0
                # live blobs with a copy that stays (loose, or in a pack kept whole): where
                held: dict[bytes, list[str | tuple[str, int, int]]] = {}
                for rel, (size, _) in sorted(loose_blobs.items()):
                    named = layout.blob_digest(rel)
                    if named is not None and named in live:
                        kept += 1
                        held.setdefault(named, []).append("loose")
                        continue
                    refresh()
                    if self._b.delete(rel):
                        deleted += 1
                        freed += size
                    if named is not None:
                        self._known.discard(named)
                        self._copies.pop(named, None)
                # Packs (a pack whose index cannot be read is kept: what it holds is unknown).
                packs = sorted(self._packs.items())
                merge = sum(1 for _, ix in packs if ix.size < MERGE_SMALL) >= MERGE_AT
                rewrite: list[tuple[str, layout.PackIndex, list[tuple[int, int, bytes]]]] = []
                dropped = 0
                for rel, ix in packs:
                    alive = sorted((o, n, r) for r, (o, n) in ix.entries.items() if r in live)
                    if not alive:
                        refresh()
                        if self._b.delete(rel):
                            dropped += 1
                            deleted += len(ix.entries)
                            freed += ix.size
                        continue
                    # (rewritten to drop dead blobs, or to merge: one with none dead would come out the same)
                    mostly_dead = len(alive) < len(ix.entries) and sum(n for _, n, _ in alive) < REPACK_LIVE * ix.size
                    if mostly_dead or (merge and ix.size < MERGE_SMALL):
                        rewrite.append((rel, ix, alive))
                    else:
                        kept += len(alive)
                        for o, n, r in alive:
                            held.setdefault(r, []).append((rel, o, n))
                written = made = 0
                if rewrite:
                    written, made, gone = self._repack(rewrite, held, refresh)
                    for rel, ix, alive in rewrite:
                        if rel in gone:
                            dropped += 1
                            deleted += len(ix.entries) - len(alive)
                            freed += ix.size
                        kept += len(alive)
                    freed -= written
                for rel, (size, when) in self._b.listing(layout.TMP).items():
                    if self._stale_temp(rel, when) and self._b.delete(rel):
                        freed += size
                token = secrets.token_hex(16).encode()
                # (before the marker goes: saves still wait)
                self._b.put(layout.EPOCH, [token], len(token), durable=False)
                self._known.clear()
                self._depth.clear()
                self._copies = {r: c for r, c in self._copies.items() if r in live}
                self._refresh_packs()
            finally:
                with contextlib.suppress(TensorCanonError):
                    self._b.delete(me)
        return {"deleted_blobs": deleted, "freed_bytes": max(freed, 0), "kept_blobs": kept, "deleted_packs": dropped,
                "written_packs": made}

    def _repack(self, rewrite: list[tuple[str, layout.PackIndex, list[tuple[int, int, bytes]]]],
                held: dict[bytes, list[str | tuple[str, int, int]]],
                refresh: Callable[[], None]) -> tuple[int, int, set[str]]:
        """Copy the live blobs of packs ``rewrite`` (but those ``held`` elsewhere) into new packs,
        make those durable, then delete the old ones. A pack whose bytes do not hash to its name is
        left as it is (damaged: verify reports it; nothing of it is copied). Returns the bytes and
        packs written, and the packs deleted."""
        builder: _PackBuilder | None = None
        made: list[tuple[str, layout.PackIndex]] = []
        sources: list[str] = []
        counts = collections.Counter(r for _, _, alive in rewrite for _, _, r in alive)
        twice = {raw for raw, n in counts.items() if n > 1}
        copied = set()
        for raw, locs in held.items():
            # (a copy that stays is trusted only once checked, where the rewritten packs hold another:
            # else a lying copy kept would cost the honest one; rare, so cheap)
            if raw not in counts or any(self._sound(raw, loc) for loc in locs):
                copied.add(raw)
            else:
                twice.add(raw)
        try:
            for rel, ix, alive in rewrite:
                try:
                    blob = self._b.blob(rel)
                except MissingFileError:
                    continue  # (another collection rewrote it)
                data: Any = None
                try:
                    data = blob.whole()
                    h = digest.constructor(layout.ALGORITHM)(b"")
                    h.update(data)
                    if h.digest() != layout.pack_digest(rel) or len(data) != ix.size:
                        self._gc_damaged[rel] = IntegrityError(
                            f"pack {self._b.display(rel)!r} does not hash to its name: it is damaged, and was kept "
                            "as it is, none of its blobs copied")
                        continue
                    sound = True
                    for offset, length, raw in alive:
                        if raw in copied:
                            continue
                        # A pack that hashes to its name proves only that it is what its writer wrote.
                        # A blob held by two of these packs is decoded and checked against its digest
                        # before it is copied, so that a lying copy never replaces an honest one (both
                        # packs are deleted after); a copy that does not check stays where it is, its
                        # pack kept (verify reports it). A blob held once is copied as it is: damage
                        # moves with it, and verify reports it in the new pack.
                        piece = bytes(memoryview(data)[offset : offset + length])
                        if raw in twice:
                            try:
                                where = f"blob {self._b.display(rel)!r} (blob {raw.hex()} at byte {offset})"
                                bh = layout.parse_header(piece[: layout.HEAD], length, where)
                                self._decode_checked(raw, bh, piece, where)
                            except TensorCanonError as e:
                                self._gc_damaged.setdefault(rel, e)
                                sound = False
                                continue
                        if builder is not None and builder.full(length):
                            made.append(builder.finish())
                            builder = None
                        if builder is None:
                            builder = _PackBuilder(self)
                        builder.add(raw, [piece], length)
                        copied.add(raw)
                        refresh()
                    if sound:
                        sources.append(rel)
                finally:
                    del data
                    blob.close()
            if builder is not None:
                made.append(builder.finish())
                builder = None
        except BaseException:
            if builder is not None:
                builder.abort()
            raise
        self._add_packs(made)
        new = {rel for rel, _ in made}
        gone = set()
        for rel in sources:  # (every blob they held that a tag needs is durable in a new pack)
            if rel not in new and self._b.delete(rel):
                gone.add(rel)
            refresh()
        return sum(ix.size for _, ix in made), len(made), gone

    def _sound(self, raw: bytes, loc: str | tuple[str, int, int]) -> bool:
        """Whether copy ``loc`` of blob ``raw`` decodes to bytes that hash to ``raw``."""
        try:
            self._decode(raw, loc=loc)
        except TensorCanonError:
            return False
        return True

    def _stale_temp(self, rel: str, mtime: float) -> bool:
        parts = rel.rsplit("/", 1)[-1].split(".")
        if len(parts) >= 3 and parts[0] == backend.host() and parts[1].isdigit():
            return not writer._pid_alive(int(parts[1]))
        return self._b.now() - mtime > STALE

    def stats(self) -> dict[str, Any]:
        """Sizes and counts: ``logical_bytes`` (what saving every tag as its own file would take; a
        sharded checkpoint's tag, as the directory ``tensorcanon.dcp.save`` writes),
        ``stored_bytes`` (what the store takes: blobs, packs and records), ``tags``, ``blobs``
        (distinct blobs, loose or in packs), ``loose_blobs``, ``packs``, ``pack_bytes``,
        ``blob_bytes`` (loose blobs and packs), ``record_bytes``, ``tensor_bytes`` (the decoded
        size of every blob), ``codecs`` (blobs per codec) and ``max_depth`` (the longest delta chain)."""
        self._drain()  # (this object's background save first)
        if not self._b.root_exists():
            return {"tags": 0, "blobs": 0, "logical_bytes": 0, "stored_bytes": 0, "blob_bytes": 0,
                    "record_bytes": 0, "tensor_bytes": 0, "codecs": {}, "max_depth": 0, "loose_blobs": 0,
                    "packs": 0, "pack_bytes": 0}
        self._check_root()
        self._refresh_packs()
        if self._bad_packs:
            raise sorted(self._bad_packs.items())[0][1]
        from . import sharded  # (imported when used: the sharded layer is not needed to save or load)

        tags = self._tags()
        logical = record_bytes = gone = 0
        records = self._b.listing(layout.TAGS)
        for t in tags:
            try:
                header = self._record(t)
            except MissingFileError:
                if self._vanished(layout.tag_path(t), layout.TAGS):
                    gone += 1
                    continue  # (deleted by another writer since it was listed)
                raise
            if sharded.claims_header(self, header, t):  # (a sharded checkpoint: its directory's bytes)
                try:
                    logical += sharded.summary(self, t).size   # (it reads the record again)
                except MissingFileError:
                    if self._vanished(layout.tag_path(t), layout.TAGS):
                        gone += 1
                        continue
                    raise
            else:
                parsed = container.parse_raw(header[:8], header[8:], None, DEFAULT)
                logical += len(header) + max((e.end for e in parsed.entries), default=0)
            record_bytes += records.get(layout.tag_path(t), (0, 0))[0]
        loose = {rel: size for rel, (size, _) in self._b.listing(layout.BLOBS).items()
                 if layout.blob_digest(rel) is not None}
        names = {cast(bytes, layout.blob_digest(rel)) for rel in loose} | set(self._where)
        kinds: dict[str, int] = {}
        tensor_bytes = max_depth = 0
        gone_blobs: set[bytes] = set()
        handles: dict[str, backend.Blob] = {}
        try:
            for raw in sorted(names):
                try:
                    blob, h = self._open_blob(raw, handles, share=True)
                except MissingFileError:
                    rel = layout.blob_path(raw)
                    if raw in self._where or not self._vanished(rel, layout.BLOBS):
                        raise
                    gone_blobs.add(raw)  # (collected by another writer since it was listed)
                    loose.pop(rel, None)
                    continue
                blob.close()
                kinds[h.codec_name] = kinds.get(h.codec_name, 0) + 1
                tensor_bytes += h.size
                max_depth = max(max_depth, h.depth)
        finally:
            for b in handles.values():
                b.close()
        pack_bytes = sum(ix.size for ix in self._packs.values())
        blob_bytes = sum(loose.values()) + pack_bytes
        return {"tags": len(tags) - gone, "blobs": len(names - gone_blobs), "logical_bytes": logical,
                "stored_bytes": blob_bytes + record_bytes, "blob_bytes": blob_bytes, "record_bytes": record_bytes,
                "tensor_bytes": tensor_bytes, "codecs": dict(sorted(kinds.items())), "max_depth": max_depth,
                "loose_blobs": len(loose), "packs": len(self._packs), "pack_bytes": pack_bytes}

    # ------------------------------------------------------------------ for sharded checkpoints
    # A sharded checkpoint in a store (dcp/store.py writes it, store/sharded.py reads it): each rank
    # writes its rank file's blobs (_put with no tag), the coordinator then writes one record naming
    # every blob, last (_put_record); rank files are read back through _header_file and split tensors'
    # chunks through _blob_bytes. docs/DISTRIBUTED.md.
    def _epoch_now(self) -> bytes:
        """The collection epoch (layout.EPOCH) now: b"" before any collection (or any store)."""
        try:
            return self._b.get(layout.EPOCH, 64)
        except MissingFileError:
            return b""

    def _put_record(self, tag: str, header: bytes, blobs: list[bytes], epoch: bytes) -> None:
        """Write the record of ``tag``, whose file header ``header`` names ``blobs``: blobs that other
        processes made durable with :meth:`_put` after this store's epoch was ``epoch``. If a
        collection ran since (it may have deleted them before any record named them), each is looked
        for first, and a missing one refuses the record."""
        tag = layout.check_tag(tag)
        with self._lock:
            later: list[Any] = []
            self._create(later)
            self._b.settle(later)
            with self._saving():  # (no collection runs from here until the record is written)
                if self._epoch_now() != epoch:
                    self._since_gc()
                    self._refresh_packs()
                    self._loose = None
                    for raw in blobs:
                        if not self._blob_exists(raw):
                            raise IntegrityError(
                                f"tag {tag!r}: blob {layout.show(raw)} that a rank wrote is gone: `gc` ran while "
                                "the checkpoint was being saved, before its record could name it; save it again",
                                expected=layout.show(raw))
                record = api.dumps(layout.record_object(tag, header))
                self._b.put(layout.tag_path(tag), [record], len(record))

    def _blob_bytes(self, raw: bytes) -> np.ndarray:
        """The decoded bytes of blob ``raw`` (delta bases first), checked against its digest."""
        return self._decode(raw)

    def _stored_length(self, raw: bytes) -> int:
        """The stored (encoded) length of blob ``raw``: from the index of the pack that holds it (no
        read), else the loose object's size; MissingFileError where the store holds none. (Added for
        tensorcanon.dcp, red team reddcp2: a rank file's header, kept in a record, claims its chunks'
        sizes, which nothing else bounds before a load allocates them; its blobs' lengths do.)"""
        if not self._listed:
            self._refresh_packs()
        for attempt in (0, 1):
            at = self._where.get(raw)
            if at is not None:
                return int(at[2])
            try:
                blob = self._b.blob(layout.blob_path(raw))
            except MissingFileError:
                if attempt or not self._refresh_packs():  # (a collection may have rewritten its pack)
                    raise
                continue
            try:
                return int(blob.size)
            finally:
                blob.close()
        raise AssertionError("unreachable")


_WORKERS: list[ThreadPoolExecutor] = []
if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: it makes its own
    os.register_at_fork(after_in_child=_WORKERS.clear)


def _workers() -> ThreadPoolExecutor:
    if not _WORKERS:
        _WORKERS.append(ThreadPoolExecutor(WORKERS, thread_name_prefix="tensorcanon-store-save"))
    return _WORKERS[0]


def _check_link(h: layout.BlobHeader, where: str, prefix: bytes | None, depth: int | None) -> None:
    """Raise unless blob header ``h`` has the prefix and depth its delta needs of its base (when given)."""
    if prefix is not None and h.prefix != prefix:
        raise IntegrityError(f"{where} holds a {h.prefix.decode()} tensor where a {prefix.decode()} one "
                             "is expected (a delta's base must have its dtype and shape); the store is "
                             "damaged: run `tensorcanon store verify`", expected=prefix.decode(),
                             actual=h.prefix.decode())
    if depth is not None and h.depth != depth:
        raise IntegrityError(f"{where} has delta depth {h.depth}, but the blob it is the base of needs "
                             f"depth {depth}: a delta chain that lies (or loops) is refused",
                             expected=str(depth), actual=str(h.depth))


def _done(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` run here, as a finished future (its result or its exception)."""
    f: Future[Any] = Future()
    try:
        f.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 (re-raised by result(); an interrupt propagates at once)
        f.set_exception(e)
    return f


class _PackBuilder:
    """One pack being written (docs/STORE.md, "Packs"): its header, then each blob at the next
    multiple of 64 bytes, then, by :meth:`finish`, its index and trailer; it is named by the digest
    of all its bytes (hashed as they are written) and made durable before :meth:`finish` returns."""

    def __init__(self, store: Store) -> None:
        self._s = store
        self._out = store._b.appender()
        self._h = digest.constructor(layout.ALGORITHM)(b"")
        self.size = 0
        self.entries: list[tuple[bytes, int, int]] = []
        self._put(layout.PACK_HEADER)

    def _put(self, piece: Any) -> None:
        self._out.write(piece)
        self._h.update(piece)
        self.size += memoryview(piece).nbytes

    def full(self, total: int) -> bool:
        """Whether a blob of ``total`` bytes should start another pack."""
        return bool(self.entries) and (self.size + total > PACK_SIZE or len(self.entries) >= layout.MAX_PACK_ENTRIES)

    def add(self, raw: bytes, pieces: list[Any], total: int) -> None:
        pad = -self.size % layout.PAYLOAD_ALIGN
        if pad:
            self._put(bytes(pad))
        at = self.size
        for piece in pieces:
            self._put(piece)
        if self.size - at != total:
            raise AssertionError(f"a blob of {self.size - at} bytes where {total} were announced")
        self.entries.append((raw, at, total))

    def seal(self) -> None:
        """Write the index and trailer, and start the pack's fsync (on another thread)."""
        self._index_at = self.size
        self._put(layout.pack_tail(self.entries, self._index_at))
        self._out.start_sync()

    def finish(self, later: list | None = None) -> tuple[str, layout.PackIndex]:
        """Make the pack durable under its name (sealed first, if it was not); its name and index.
        ``later``: its folder's fsync is left to ``Local.settle`` (with the other folders')."""
        if not hasattr(self, "_index_at"):
            self.seal()
        rel = layout.pack_path(self._h.digest())
        try:
            self._s._upgrade()  # (a layout-1 store: its marker says layout 2 before it holds a pack)
            self._out.finish(rel, later)
        except BaseException:
            self._out.abort()
            raise
        return rel, layout.PackIndex(self.size, self._index_at, {r: (o, n) for r, o, n in self.entries})

    def abort(self) -> None:
        self._out.abort()


class _Refresher:
    """Rewrites a marker when it is older than REFRESH, so that no one takes it for a dead one's."""

    def __init__(self, b: Any, rel: str) -> None:
        self._b, self._rel, self._at = b, rel, time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self._at > REFRESH:
            self._b.put(self._rel, [b""], 0, durable=False)
            self._at = time.monotonic()


def _bytes_of(s: Any) -> memoryview:
    """A tensor's canonical bytes (a copy to the host for a tensor on another device)."""
    return host_bytes(s.value, s.kind)


def _own_copy(s: Any) -> np.ndarray:
    """A copy of a tensor's canonical bytes that nothing else holds: a tensor on another device is
    copied to the host once, a tensor or array in host memory copied from its bytes."""
    v = s.value
    data = compress.as_u8(host_bytes(v, s.kind))
    device = getattr(v, "device", None) if s.kind != "ndarray" else None
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return data  # (host_bytes made the host copy; nothing else holds it)
    return np.array(data)


def _few(tags: list[str]) -> str:
    if not tags:
        return "none"
    shown = ", ".join(repr(t) for t in tags[:5])
    return shown + (f" and {len(tags) - 5} more" if len(tags) > 5 else "")
