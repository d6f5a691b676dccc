"""Red team (reddcp2): sharded checkpoints kept in a store (tensorcanon.dcp.StoreTag; docs/DISTRIBUTED.md,
"In a store"; FORMAT.md §14.10), attacked from the documentation. Every record here is crafted through
the store's own public `Store.save` (a record is an ordinary tag's object), so each is a store that
verifies as a store and lies only about the checkpoint: its index, rank headers and blob list disagree
with each other. Every reader must refuse it with the library's own error, never load wrong values.
tests/attacks/test_dcp_store_attacks.py holds the first round of attacks; these do not repeat them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tensorcanon as tc
import tensorcanon.dcp as tcd

from helpers import Shard, distribute_tensor, zeros_like_state
from states import sharded_state
from threaded import run_ranks

FULL = torch.arange(6, dtype=torch.float32).reshape(3, 2)


def small_state(world, rank, full=FULL):
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "step": 1, "rng": tcd.PerRank(rank)}


def small_target(world, rank):
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.zeros(3, 2), mesh, [Shard(0)]), "step": 0, "rng": tcd.PerRank(-1)}


@pytest.fixture
def small(tmp_path):
    root = str(tmp_path / "store")
    run_ranks(2, lambda r: tcd.save(small_state(2, r), tcd.StoreTag(tc.Store(root), "good")))
    store = tc.Store(root)
    return store, store.load("good")


def header_of(obj) -> tuple[bytes, str, list]:
    """The first 8 + N bytes of the file of ``obj``, its file digest and its tensors (as rows)."""
    data = tc.dumps(obj)
    n = int.from_bytes(data[:8], "little")
    return data[:8 + n], tc.fingerprint(obj), tc.open(data).manifest.tensors


def index_of(record) -> dict:
    return tc.loads(record["index"])


def blobs_for(*tensors) -> list:
    """The ``blobs`` field a writer would give for these tensors: one per digest, sorted by raw digest."""
    by = {}
    for t in tensors:
        if t.numel():
            by[tc.open(tc.dumps({"t": t})).manifest.tensors[0].digest] = t
    return [by[d] for d in sorted(by)]


def readers(store, tag, tmp_path, world=2, target=small_target, options=None):
    """Every way to read the tag; each gives the error it raised (or None, and its result)."""
    st = tcd.StoreTag(store, tag)

    def dcp_load():
        def load(rank):
            state = target(world, rank)
            try:
                tcd.load(state, tcd.StoreTag(tc.Store(store.root, storage_options=options), tag))
            except Exception as e:  # noqa: BLE001 - judged below
                return e
            return state

        return run_ranks(world, load)[0]

    calls = {
        "verify": lambda: tcd.verify(st),
        "load_unsharded": lambda: tcd.load_unsharded(st),
        # export is a byte copy: it refuses the record, or the directory it wrote is refused by verify
        "export": lambda: (tcd.export(st, tmp_path / f"out-{tag}"), tcd.verify(tmp_path / f"out-{tag}"))[1],
        "consolidate": lambda: tcd.consolidate(st, tmp_path / f"{tag}.safetensors"),
        "logical_digest": lambda: tcd.logical_digest(st),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = call()
        except Exception as e:  # noqa: BLE001 - judged by the test
            out[name] = e
    out["load"] = dcp_load()
    return out


def refused(errors, cls=tc.TensorCanonError, words=None, skip=()):
    for name, e in errors.items():
        if name in skip:
            continue
        assert isinstance(e, cls), (name, type(e), e)
        if words is not None:
            assert words in str(e), (name, str(e))


# ----------------------------------------------------------------- the blob list against the headers

def test_a_blob_list_with_blobs_no_header_uses(small, tmp_path):
    """§14.10: `blobs` is exactly one per distinct digest of the rank tables, sorted. A list that
    keeps extra blobs alive (here a large foreign tensor: gc would never free it) is not that list."""
    store, record = small
    evil = dict(record, blobs=blobs_for(*record["blobs"], torch.full((64,), 7.0)))
    store.save("extra", evil)
    # (logical_digest reads the record and its index only, as from a directory: no rank file)
    refused(readers(store, "extra", tmp_path), tc.FormatError, "blobs", skip=("logical_digest",))


def test_a_blob_list_out_of_order_or_twice(small, tmp_path):
    store, record = small
    blobs = list(record["blobs"])
    assert len(blobs) == 2
    store.save("reversed", dict(record, blobs=blobs[::-1]))
    refused(readers(store, "reversed", tmp_path), tc.FormatError, "blobs")
    store.save("twice", dict(record, blobs=[blobs[0], blobs[0].clone(), blobs[1]]))
    refused(readers(store, "twice", tmp_path), tc.FormatError, "blobs")


# ----------------------------------------------------------------- the index against the headers

def resave(store, record, tag, **index_changes):
    index = index_of(record)
    index.update(index_changes)
    store.save(tag, dict(record, index=tc.dumps(index)))


def test_an_index_of_world_size_zero_or_huge(small, tmp_path):
    store, record = small
    files = index_of(record)["files"]
    resave(store, record, "zero", files=[])
    refused(readers(store, "zero", tmp_path), tc.TensorCanonError, "tag 'zero'")
    # files of 2^20 + 1 ranks: the record has 2 headers, and no reader may build 10^6 of anything for it
    store.save("many", dict(record, ranks=record["ranks"] * 3))
    refused(readers(store, "many", tmp_path), tc.TensorCanonError)
    resave(store, record, "dup", files=[files[0], files[0]])
    # (logical_digest reads the index only, as from a directory: it does not open rank files)
    refused(readers(store, "dup", tmp_path), tc.TensorCanonError, skip=("logical_digest",))


@pytest.mark.parametrize("chunks, what", [
    ([[[0, [0, 0], [2, 2]]]], "hole"),                               # row 2 stored by nobody
    ([[[0, [0, 0], [2, 2]], [1, [1, 0], [2, 2]]]], "overlap"),       # row 1 twice, past the end
    ([[[0, [0, 0], [4, 2]], [1, [2, 0], [1, 2]]]], "too large"),     # a chunk larger than its tensor
    ([[[0, [0, 0], [2, 2]], [5, [2, 0], [1, 2]]]], "rank"),          # a rank the world does not have
    ([[[0, [0, 0], [2, 2]], [1, [2, 0], [1, 2]], [1, [2, 0], [1, 2]]]], "twice"),
    ([[[1, [2, 0], [1, 2]], [0, [0, 0], [2, 2]]]], "order"),
    ([[[0, [0, 0], [2, 2]], [1, [2, 0], [1, 2 ** 62]]]], "huge"),
])
def test_chunks_that_do_not_tile(small, tmp_path, chunks, what):
    store, record = small
    resave(store, record, "tiles", chunks=chunks)
    refused(readers(store, "tiles", tmp_path), tc.TensorCanonError)


def test_an_index_whose_chunks_name_the_other_rank(small, tmp_path):
    """The tiling is fine, but each chunk is claimed by the rank that does not hold it."""
    store, record = small
    resave(store, record, "other", chunks=[[[1, [0, 0], [2, 2]], [0, [2, 0], [1, 2]]]])
    refused(readers(store, "other", tmp_path), tc.TensorCanonError, skip=("logical_digest",))


def test_a_logical_digest_claim_that_lies(small, tmp_path):
    """The record's own digest, rank headers and blobs are honest, but the index's logical manifest
    is another checkpoint's (same shapes, other values): verify, load_unsharded and consolidate hash
    the logical tensors and must refuse; none may give the other checkpoint's values or digest."""
    store, record = small
    other = FULL + 100
    run_ranks(2, lambda r: tcd.save(small_state(2, r, other), tcd.StoreTag(tc.Store(store.root), "other")))
    lie = index_of(store.load("other"))["logical"]
    claimed = tcd.logical_digest(tcd.StoreTag(store, "other"))
    resave(store, record, "lie", logical=lie)
    out = readers(store, "lie", tmp_path)
    refused({k: out[k] for k in ("verify", "load_unsharded", "consolidate")}, tc.IntegrityError)
    # a load through DCP checks chunks against the rank files (as from a directory): honest values
    load = out["load"]
    if not isinstance(load, Exception):
        assert torch.equal(load["w"].to_local(), FULL[:2])
    assert out["logical_digest"] == claimed   # the claim, as documented: verify is what checks it


# ----------------------------------------------------------------- rank headers that lie

@pytest.mark.parametrize("chunk, what", [
    (torch.arange(4, dtype=torch.int32).reshape(2, 2), "dtype"),            # same shape, other dtype
    (torch.arange(6, dtype=torch.float32).reshape(3, 2), "shape"),          # more rows than the chunk
    (torch.arange(4, dtype=torch.float32).reshape(4, 1), "shape"),          # same bytes, other shape
    (torch.arange(2, dtype=torch.float32).reshape(1, 2), "shape"),          # fewer rows: a hole
    (torch.arange(4, dtype=torch.float64).reshape(2, 2), "dtype"),          # more bytes per element
])
def test_a_rank_header_whose_chunk_is_not_the_index_chunk(small, tmp_path, chunk, what):
    """Rank 0's header is replaced (and the index's `files[0]` and the blob list follow it, so the
    record is consistent with itself): its chunk row `w@0,0` has another dtype or shape than the
    index's chunk [0, [0, 0], [2, 2]] of the float32 [3, 2] tensor. Loading must not cast, copy a
    partial chunk, or read past it."""
    store, record = small
    head, digest, _ = header_of({"rng@rank": 0, "w@0,0": chunk})
    one = tc.open(header_of({"rng@rank": 1, "w@2,0": FULL[2:]})[0] + FULL[2:].numpy().tobytes())
    assert one.digest == index_of(record)["files"][1]
    files = index_of(record)["files"]
    index = index_of(record)
    index["files"] = [digest, files[1]]
    store.save("chunk", dict(record, index=tc.dumps(index), ranks=[head, record["ranks"][1]],
                             blobs=blobs_for(chunk, FULL[2:].clone())))
    refused(readers(store, "chunk", tmp_path), tc.TensorCanonError, skip=("logical_digest",))


@pytest.mark.parametrize("obj, what", [
    ({"rng@rank": 0}, "missing chunk"),
    ({"rng@rank": 0, "w@0,0": FULL[:2].clone(), "extra@0": torch.ones(2)}, "extra key"),
    ({"w@0,0": FULL[:2].clone()}, "missing per-rank"),
    ({"rng@rank": 0, "w@0,0": FULL[:2].clone().requires_grad_()}, "requires_grad"),
    ({"rng@rank": 0, "w@0,0": torch.nn.Parameter(FULL[:2].clone())}, "parameter"),
    ([0, FULL[:2].clone()], "not a dict"),
])
def test_a_rank_header_with_other_keys(small, tmp_path, obj, what):
    store, record = small
    head, digest, rows = header_of(obj)
    index = index_of(record)
    index["files"] = [digest, index["files"][1]]
    tensors = [v for v in (obj.values() if isinstance(obj, dict) else obj) if isinstance(v, torch.Tensor)]
    store.save("keys", dict(record, index=tc.dumps(index), ranks=[head, record["ranks"][1]],
                            blobs=blobs_for(*[t.detach() for t in tensors], FULL[2:].clone())))
    out = readers(store, "keys", tmp_path)
    # verify checks §14.2's keys exactly; every reader that needs w@0,0 must refuse
    must = ["verify"] + (["load_unsharded", "consolidate", "load", "export"] if what == "missing chunk" else [])
    refused({k: out[k] for k in must}, tc.TensorCanonError)
    for name, value in out.items():   # whatever is not refused gives honest values
        assert isinstance(value, (Exception, str, dict, type(None))), (name, value)
        if name == "load_unsharded" and isinstance(value, dict):
            assert torch.equal(value["w"], FULL)


def test_rank_headers_and_index_with_trailing_bytes(small, tmp_path):
    """`ranks[R]` is exactly the first 8 + N bytes; `index` is the index file whole."""
    store, record = small
    store.save("trail", dict(record, ranks=[record["ranks"][0] + b" ", record["ranks"][1]]))
    refused(readers(store, "trail", tmp_path), tc.TensorCanonError)
    store.save("trail-index", dict(record, index=record["index"] + b"\x00" * 8))
    refused(readers(store, "trail-index", tmp_path), tc.TensorCanonError)


def test_a_record_of_another_checkpoint_under_this_tag(small, tmp_path):
    """Headers of another checkpoint (another state) with this one's index."""
    store, record = small
    run_ranks(2, lambda r: tcd.save(small_state(2, r, FULL * 2), tcd.StoreTag(tc.Store(store.root), "b")))
    other = store.load("b")
    store.save("mixed", dict(record, ranks=other["ranks"], blobs=other["blobs"]))
    refused(readers(store, "mixed", tmp_path), tc.TensorCanonError, skip=("logical_digest",))


# ----------------------------------------------------------------- tags, targets and the store's own tools

@pytest.mark.parametrize("tag", ["", "../x", "a/b", ".hidden", "x" * 201, "tag\n", None, 5, b"good"])
def test_bad_tag_names(small, tmp_path, tag):
    store, _ = small
    with pytest.raises(tc.TensorCanonError):
        tcd.verify(tcd.StoreTag(store, tag))
    with pytest.raises(tc.TensorCanonError):
        tcd.export(tcd.StoreTag(store, tag), tmp_path / "x")


def test_missing_tag_and_not_a_store(small, tmp_path):
    store, _ = small
    with pytest.raises(tc.MissingFileError):
        tcd.verify(tcd.StoreTag(store, "nope"))
    (tmp_path / "plain").mkdir()
    for where in (str(tmp_path / "plain"), str(tmp_path / "absent"), 5):
        with pytest.raises(tc.TensorCanonError):
            tcd.verify(tcd.StoreTag(where, "good"))


def test_load_unsharded_rank_out_of_range(small):
    store, _ = small
    for rank in (2, -1, 10 ** 30, True, "0"):
        with pytest.raises(tc.TensorCanonError):
            tcd.load_unsharded(tcd.StoreTag(store, "good"), rank=rank)


def test_load_into_a_state_of_another_shape(small):
    store, _ = small

    def load(rank):
        mesh = init_device_mesh("cpu", (2,))
        state = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]), "step": 0, "rng": tcd.PerRank(-1)}
        try:
            tcd.load(state, tcd.StoreTag(tc.Store(store.root), "good"))
        except Exception as e:  # noqa: BLE001
            return e
        return state

    for e in run_ranks(2, load):
        assert isinstance(e, tc.TensorCanonError), (type(e), e)

    def load_dtype(rank):
        mesh = init_device_mesh("cpu", (2,))
        state = {"w": distribute_tensor(torch.zeros(3, 2, dtype=torch.int64), mesh, [Shard(0)]),
                 "step": 0, "rng": tcd.PerRank(-1)}
        try:
            tcd.load(state, tcd.StoreTag(tc.Store(store.root), "good"))
        except Exception as e:  # noqa: BLE001
            return e
        return state

    for e in run_ranks(2, load_dtype):
        assert isinstance(e, Exception), "an int64 target silently took float32 values"
        assert isinstance(e, tc.TensorCanonError), (type(e), e)


def test_plain_tag_and_dcp_tag_crossed(small, tmp_path):
    """A plain tag read by tcd (refused, covered) and a DCP tag read by the store: the record object,
    and `store export` of it writes a file that loads as that record."""
    store, record = small
    path = tmp_path / "record.safetensors"
    store.export("good", str(path))
    tc.verify(str(path))
    got = tc.load(str(path))
    assert got["index"] == record["index"] and got["ranks"] == record["ranks"]
    # a tcd.save over a plain tag replaces it; overwrite=False refuses it
    store.save("plain", {"w": torch.ones(2)})
    errs = run_ranks(2, lambda r: _raised(lambda: tcd.save(small_state(2, r),
                                                             tcd.StoreTag(tc.Store(store.root), "plain"),
                                                             overwrite=False)))
    for e in errs:
        assert isinstance(e, tc.TensorCanonError), (type(e), e)


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def cli(*args):
    import os
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "tensorcanon", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_store_cli_on_damaged_dcp_tags_in_fresh_processes(small, tmp_path):
    """One CLI process per command: exit 0 on the good tag, 1 on a missing blob; `ls` and `verify`
    print the digest the save returned, and `store export` of the tag writes the checkpoint's
    directory (the record's index last)."""
    store, record = small
    root = store.root
    logical = tc.fingerprint({"step": 1, "w": FULL})
    r = cli("store", "verify", root)
    assert r.returncode == 0 and logical in r.stdout, r.stdout
    r = cli("store", "ls", root)
    assert r.returncode == 0 and "good" in r.stdout and logical in r.stdout and "2 ranks" in r.stdout, r.stdout
    r = cli("store", "export", root, "good", str(tmp_path / "dir"))
    assert r.returncode == 0 and logical in r.stdout, r.stderr
    assert (tmp_path / "dir" / "index.safetensors").read_bytes() == record["index"]
    assert tcd.verify(str(tmp_path / "dir")) == logical
    # gc keeps every blob of the DCP tag, frees a deleted plain tag's blob
    store.save("plain", {"junk": torch.full((50,), 5.0)})
    store.delete("plain")
    r = cli("store", "gc", root)
    assert r.returncode == 0, r.stderr
    assert tcd.verify(tcd.StoreTag(tc.Store(root), "good")) == tc.fingerprint({"step": 1, "w": FULL})
    # a truncated record: damage, exit 1
    other = str(tmp_path / "other")
    run_ranks(2, lambda r: tcd.save(small_state(2, r), tcd.StoreTag(tc.Store(other), "t")))
    rec = tmp_path / "other" / "tags" / "t.safetensors"
    rec.write_bytes(rec.read_bytes()[:-5])
    r = cli("store", "verify", other)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    # a DCP tag whose record names a blob the store lost: damage, exit 1
    store.save("lost", dict(record, blobs=blobs_for(*record["blobs"], torch.full((8,), 3.0))))
    import pathlib
    for p in sorted(pathlib.Path(root).rglob("*")):
        if p.is_file() and (p.parent.name == "packs" or "blobs" in p.parts):
            p.unlink()
    r = cli("store", "verify", root)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


def test_memory_store_attacks(tmp_path):
    """The same crafted records in a memory:// store."""
    url = "memory://reddcp2-store"
    run_ranks(2, lambda r: tcd.save(small_state(2, r), tcd.StoreTag(url, "good")))
    store = tc.Store(url)
    record = store.load("good")
    assert tcd.verify(tcd.StoreTag(store, "good")) == tc.fingerprint({"step": 1, "w": FULL})
    store.save("extra", dict(record, blobs=blobs_for(*record["blobs"], torch.ones(9))))
    refused(readers(store, "extra", tmp_path), tc.FormatError, "blobs", skip=("logical_digest",))


def test_sharded_state_roundtrip_sanity(tmp_path):
    """The big test state, as a control for the crafted records above: good tags load."""
    root = str(tmp_path / "s")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r), tcd.StoreTag(tc.Store(root), "t")))

    def load(rank):
        state = zeros_like_state(sharded_state(2, rank))
        tcd.load(state, tcd.StoreTag(tc.Store(root), "t"))
        return True

    assert run_ranks(2, load) == [True, True]


# ----------------------------------------------------------------- sizes a rank header claims

_TERABYTE = textwrap.dedent('''
    import resource, sys, warnings
    warnings.simplefilter("ignore")  # DCP's "no process group" warning
    import msgpack, torch
    import tensorcanon as tc, tensorcanon.dcp as tcd
    from tensorcanon.dcp import store as dcp_store
    from tensorcanon.format import dtypes, manifest
    from tensorcanon.format.tensorbytes import Stored
    from tensorcanon.io import writer

    root, out = sys.argv[1], sys.argv[2]
    store = tc.Store(root)
    tcd.save({"w": torch.arange(6.0).reshape(3, 2), "step": 1, "rng": tcd.PerRank(0)}, tcd.StoreTag(store, "good"))
    record = store.load("good")
    SHAPE = (2**37, 2)   # float32: 1 TiB, which fits in 64 bits: only the blob can refute it
    existing = tc.open(tc.dumps({"t": record["blobs"][0]})).manifest.tensors[0].digest

    def forge(tag, raw):
        """A record, consistent with itself, whose one rank header's row w@0,0 claims SHAPE and names
        blob ``raw``; the index claims w of SHAPE as that one chunk (an attacker writes these bytes)."""
        obj = {"rng@rank": 0, "w@0,0": Stored(dtypes.BY_NAME["float32"], SHAPE, memoryview(b""))}
        p = writer.plan(obj, None, tc.Limits(), "xxh3-128")
        for s in p.tensors:
            s.digest = raw
        header, _ = p.header()
        with store._header_file(header, tag, blobs=False) as cf:
            file_digest = cf.digest
        index = tc.loads(record["index"])
        m = dict(manifest.unpack(index["logical"])[0])
        rows = [dict(r) for r in m["tensors"]]
        rows[0]["shape"] = list(SHAPE)
        m["tensors"] = rows
        index.update(logical=msgpack.packb(m, use_bin_type=True), chunks=[[[0, [0, 0], list(SHAPE)]]],
                     files=[file_digest])
        target = tcd.StoreTag(store, tag)
        dcp_store.commit(target, store._epoch_now(), tc.dumps(index), [header], [(raw, "float32", SHAPE)])
        return target

    targets = {"missing": forge("missing", bytes(range(16))), "small": forge("small", existing)}
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # 1 TiB cannot fit
    for kind, t in targets.items():
        calls = {"verify": lambda: tcd.verify(t), "load_unsharded": lambda: tcd.load_unsharded(t),
                 "consolidate": lambda: tcd.consolidate(t, out + "/" + kind + ".safetensors"),
                 "export": lambda: tcd.export(t, out + "/" + kind),
                 "load": lambda: tcd.load({"w": None, "step": 0, "rng": tcd.PerRank(None)}, t)}
        for name, call in calls.items():
            try:
                call()
                print(kind, name, "LOADED")
            except BaseException as e:  # (DCP's CheckpointException is a BaseException)
                e = tcd.api.unwrap(e)
                ok = isinstance(e, tc.TensorCanonError) and "allocate" not in str(e) and "w@0,0" in str(e)
                print(kind, name, type(e).__name__ if ok else f"RAW {type(e).__name__} {e}")
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS and /proc")
def test_a_rank_header_claiming_a_terabyte_is_refused_before_it_is_allocated_in_a_subprocess(tmp_path):
    """A directory's rank file bounds its rows by its size; a store's rank file is a header kept in
    the record, and its rows' sizes are bounded only by the blobs they name. A record whose header
    claims a 1 TiB chunk, its blob missing or a 30-byte blob of the store, is refused by every reader
    before anything of that size is allocated (checked under a capped address space: one process)."""
    out = subprocess.run([sys.executable, "-c", _TERABYTE, str(tmp_path / "store"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")[:-1]
    want = {"missing": "IntegrityError", "small": "FormatError"}
    assert lines == [f"{kind} {name} {err if name != 'export' else 'IntegrityError'}"
                     for kind, err in want.items()
                     for name in ("verify", "load_unsharded", "consolidate", "export", "load")], out.stdout


# ----------------------------------------------------------------- object storage that lies

@pytest.mark.slow
def test_an_s3_store_that_truncates_or_loses_a_pack(s3_direct, tmp_path):
    """moto's S3 (tests/conftest.py): the checkpoint's pack object is replaced by a truncated copy,
    then deleted (a listing without it); the record is then truncated. Every reader refuses with the
    library's own error, naming the tag; a fresh save of the same tag then reads back."""
    import uuid

    import s3fs
    from s3_support import BUCKET

    direct, _ = s3_direct
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/store"
    run_ranks(2, lambda r: tcd.save(small_state(2, r), tcd.StoreTag(tc.Store(url, storage_options=direct), "good")))
    fs = s3fs.S3FileSystem(**direct)
    packs = fs.ls(url[len("s3://"):] + "/packs")
    assert len(packs) >= 1
    whole = {p: fs.cat_file(p) for p in packs}
    for p, data in whole.items():
        fs.pipe_file(p, data[: len(data) // 2])      # a truncated object
    errs = readers(tc.Store(url, storage_options=direct), "good", tmp_path / "a", options=direct)
    refused({k: v for k, v in errs.items() if k != "logical_digest"}, tc.TensorCanonError, "good")
    for p in whole:
        fs.rm(p)                                     # a listing that omits the packs
    errs = readers(tc.Store(url, storage_options=direct), "good", tmp_path / "b", options=direct)
    refused({k: v for k, v in errs.items() if k != "logical_digest"}, tc.TensorCanonError, "good")
    record = url[len("s3://"):] + "/tags/good.safetensors"
    data = fs.cat_file(record)
    fs.pipe_file(record, data[:-7])                   # a truncated record
    errs = readers(tc.Store(url, storage_options=direct), "good", tmp_path / "c", options=direct)
    refused(errs, tc.TensorCanonError, "good")
    run_ranks(2, lambda r: tcd.save(small_state(2, r), tcd.StoreTag(tc.Store(url, storage_options=direct), "good")))
    assert tcd.verify(tcd.StoreTag(tc.Store(url, storage_options=direct), "good")) == \
        tc.fingerprint({"step": 1, "w": FULL})


# ----------------------------------------------------------------- saving

def test_ranks_that_name_different_stores_or_tags(tmp_path):
    """Every rank must pass a StoreTag of one store and tag (docs/DISTRIBUTED.md). Ranks that do not
    either fail with the library's error on every rank, or write a checkpoint that verifies: never a
    listed tag whose blobs are in another store."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def save(rank, roots, tags):
        try:
            tcd.save(small_state(2, rank), tcd.StoreTag(tc.Store(roots[rank]), tags[rank]))
        except Exception as e:  # noqa: BLE001
            return e
        return None

    for roots, tags in (((a, b), ("t", "t")), ((a, a), ("t", "u"))):
        errs = run_ranks(2, lambda r, roots=roots, tags=tags: save(r, roots, tags))
        for e in errs:
            assert e is None or isinstance(e, tc.TensorCanonError), (type(e), e)
        for root in set(roots):
            store = tc.Store(root)
            for tag in store.tags():
                assert tcd.verify(tcd.StoreTag(store, tag)) == tc.fingerprint({"step": 1, "w": FULL}), (root, tag)


def test_save_refusals(tmp_path):
    root = str(tmp_path / "s")
    store = tc.Store(root)

    def one(fn):
        return run_ranks(1, lambda r: _raised(fn))[0]

    e = one(lambda: tcd.save(small_state(1, 0), tcd.StoreTag(store, "x"), algorithm="sha256"))
    assert isinstance(e, tc.UsageError), (type(e), e)
    e = one(lambda: tcd.save(small_state(1, 0), tcd.StoreTag(store, "x"), storage_options={"anon": True}))
    assert isinstance(e, tc.TensorCanonError), (type(e), e)
    assert store.tags() == []
    e = _raised(lambda: tcd.StoreTag(store, "x", storage_options={"anon": True}))
    assert e is None or isinstance(e, tc.TensorCanonError), (type(e), e)


def test_async_save_with_the_process_executor_is_refused(tmp_path):
    store = tc.Store(str(tmp_path / "s"))

    def go(rank):
        try:
            fut = tcd.async_save(small_state(1, 0), tcd.StoreTag(store, "x"), executor="process")
            fut.result(timeout=60)
        except Exception as e:  # noqa: BLE001
            return e
        return None

    e = run_ranks(1, go)[0]
    assert isinstance(e, tc.UsageError), (type(e), e)
    assert store.tags() == []


def test_per_rank_values_on_resize_from_a_store(small):
    """A 2-rank tag loaded by 3 ranks: per-rank values refused naming the path, unless kept."""
    store, _ = small

    def load(rank, keep):
        state = small_target(3, rank)
        try:
            tcd.load(state, tcd.StoreTag(tc.Store(store.root), "good"), keep_per_rank_on_resize=keep)
        except Exception as e:  # noqa: BLE001
            return e
        return state

    for e in run_ranks(3, lambda r: load(r, False)):
        assert isinstance(e, tc.TensorCanonError) and "rng" in str(e), (type(e), e)
    for rank, s in enumerate(run_ranks(3, lambda r: load(r, True))):
        assert not isinstance(s, Exception), s
        assert s["step"] == 1 and torch.equal(s["w"].to_local(), FULL[rank:rank + 1])


def test_a_rank_row_naming_an_honest_blob_of_another_dtype_or_shape(small, tmp_path):
    """Rank 0's row w@0,0 says float32 [2, 2], as the index wants, but names the digest of a blob the
    store holds honestly for another tensor (int32 [2, 2]: same bytes; float32 [4, 1]: same bytes,
    other shape). The record is consistent with itself (an attacker writes these bytes); no reader
    may take those bytes for the chunk."""
    from tensorcanon.dcp import store as dcp_store
    from tensorcanon.format import dtypes
    from tensorcanon.format.tensorbytes import Stored
    from tensorcanon.io import writer

    store, record = small
    for i, other in enumerate((torch.arange(4, dtype=torch.int32).reshape(2, 2), FULL[:2].reshape(4, 1).clone())):
        store.save(f"holder{i}", {"t": other})
        raw = tc.open(tc.dumps({"t": other})).manifest.tensors[0].digest
        obj = {"rng@rank": 0, "w@0,0": Stored(dtypes.BY_NAME["float32"], (2, 2), memoryview(b""))}
        p = writer.plan(obj, None, tc.Limits(), "xxh3-128")
        for s in p.tensors:
            s.digest = raw
        header, _ = p.header()
        with store._header_file(header, "x", blobs=False) as cf:
            file_digest = cf.digest
        index = index_of(record)
        index["files"] = [file_digest, index["files"][1]]
        rank1 = tc.open(tc.dumps({"t": FULL[2:].clone()})).manifest.tensors[0].digest
        tag = f"honest{i}"
        dcp_store.commit(tcd.StoreTag(store, tag), store._epoch_now(), tc.dumps(index),
                         [header, record["ranks"][1]], [(raw, "float32", (2, 2)), (rank1, "float32", (1, 2))])
        refused(readers(store, tag, tmp_path), tc.TensorCanonError, skip=("logical_digest",))


def test_export_and_consolidate_targets(small, tmp_path):
    """Where `export` and `consolidate` write: a file where a folder belongs, a folder that holds a
    checkpoint, a URL; each refused with the library's own error, nothing half-written."""
    store, _ = small
    st = tcd.StoreTag(store, "good")
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    full = tmp_path / "full"
    tcd.export(st, full)
    for where in (a_file, full, "s3://bucket/x", tmp_path / "file" / "below"):
        e = _raised(lambda where=where: tcd.export(st, where))
        assert isinstance(e, tc.TensorCanonError), (where, type(e), e)
    assert a_file.read_bytes() == b"x"
    e = _raised(lambda: tcd.consolidate(st, tmp_path))          # a folder where the file belongs
    assert isinstance(e, tc.TensorCanonError), (type(e), e)
    for call in (tcd.verify, tcd.load_unsharded, tcd.logical_digest):
        e = _raised(lambda call=call: call(st, storage_options={"anon": True}))
        assert isinstance(e, tc.UsageError), (call, type(e), e)


def test_a_bad_tag_on_every_rank_of_a_save(tmp_path):
    root = str(tmp_path / "s")
    errs = run_ranks(2, lambda r: _raised(lambda: tcd.save(small_state(2, r), tcd.StoreTag(tc.Store(root), "../x"))))
    for e in errs:
        assert isinstance(e, tc.TensorCanonError), (type(e), e)


def test_the_writer_passes_the_new_record_checks(tmp_path):
    """States at the edges of the blob list (no tensor at all; only empty tensors; the same bytes in
    every rank and twice in one rank; per-rank tensors) save and verify: the writer never writes a
    record the reader's exact blob-list check refuses."""
    root = str(tmp_path / "s")

    def state(kind, world, rank):
        mesh = init_device_mesh("cpu", (world,))
        if kind == "none":
            return {"step": 3, "rng": tcd.PerRank(rank)}
        if kind == "empty":
            return {"e": distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)]), "rng": tcd.PerRank(rank)}
        if kind == "same":
            return {"a": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]), "b": torch.ones(2, 2),
                    "rng": tcd.PerRank(torch.ones(2, 2))}
        return {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]),
                "rng": tcd.PerRank({"t": torch.full((3,), float(rank))})}

    for kind in ("none", "empty", "same", "per-rank"):
        digests = run_ranks(2, lambda r, kind=kind: tcd.save(state(kind, 2, r), tcd.StoreTag(tc.Store(root), kind)))
        st = tcd.StoreTag(tc.Store(root), kind)
        assert tcd.verify(st) == digests[0], kind
        assert tcd.load_unsharded(st, rank=1) is not None
        tcd.export(st, tmp_path / kind)
        assert tcd.verify(str(tmp_path / kind)) == digests[0]
    assert tc.Store(root).verify().keys() == {"none", "empty", "same", "per-rank"}


def test_gc_with_a_plain_tag_and_a_dcp_tag_sharing_blobs(small):
    """A plain tag holding the very chunks of the DCP tag: deleting either and collecting keeps the
    other whole (its blobs are named by its record's `blobs`)."""
    store, _ = small
    store.save("plain", {"a": FULL[:2].clone(), "b": FULL[2:].clone()})
    store.delete("good")
    store.gc()
    assert torch.equal(store.load("plain")["a"], FULL[:2])
    run_ranks(2, lambda r: tcd.save(small_state(2, r), tcd.StoreTag(tc.Store(store.root), "good")))
    store = tc.Store(store.root)
    store.delete("plain")
    store.gc()
    assert tcd.verify(tcd.StoreTag(store, "good")) == tc.fingerprint({"step": 1, "w": FULL})
    assert list(store.verify()) == ["good"]


def test_a_record_of_a_sha256_checkpoint(small, tmp_path):
    """A store names blobs by XXH3-128 only: a record holding a sha256 checkpoint's index and rank
    headers (copied from a directory save) is refused, whatever its blob list."""
    import pathlib

    store, record = small
    folder = str(tmp_path / "sha")
    run_ranks(2, lambda r: tcd.save(small_state(2, r), folder, algorithm="sha256"))
    index = (pathlib.Path(folder) / "index.safetensors").read_bytes()
    heads = []
    for r in range(2):
        data = next(pathlib.Path(folder).glob(f"rank-{r:05d}-of-00002.*.safetensors")).read_bytes()
        heads.append(data[:8 + int.from_bytes(data[:8], "little")])
    store.save("sha", dict(record, index=index, ranks=heads))
    refused(readers(store, "sha", tmp_path), tc.FormatError, "sha256")   # logical_digest included
