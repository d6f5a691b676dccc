"""Sharded checkpoints in object storage: tensorcanon.dcp on an ``s3://`` directory URL.

The session's moto S3 server (tests/conftest.py ``s3_server``, reached by s3fs over HTTP);
ranks are threads (threaded.py). Each test checks the S3 checkpoint against the same save to a
local directory: the same object names, the same bytes, the same logical digest.
"""

import subprocess
import sys
import textwrap
import uuid

import pytest
import s3fs
from s3_support import BUCKET, SECRET, kill_mid_upload, stall_after_one_part

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon import testing
from tensorcanon.io import remote
from tensorcanon.sharded import layout
from tensorcanon.tools import cli

from helpers import rank_files, unsharded, zeros_like_state
from states import logical_digest, logical_state, sharded_state
from threaded import run_ranks


@pytest.fixture
def s3(s3_direct):
    """(options reaching the server directly, the proxy, a fresh directory URL, an s3fs filesystem)."""
    direct, proxy = s3_direct
    return direct, proxy, f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/step-100", s3fs.S3FileSystem(**direct)


def objects(fs, url):
    """``{name: bytes}`` of the objects under a directory URL (as helpers.rank_files for a folder)."""
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in sorted(fs.find(url))}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_same_bytes_and_digests_as_a_local_save(s3, tmp_path, world):
    opts, _, url, fs = s3
    local = str(tmp_path / "ckpt")
    here = run_ranks(world, lambda r: tcd.save(sharded_state(world, r), local))
    there = run_ranks(world, lambda r: tcd.save(sharded_state(world, r), url, storage_options=opts))
    assert here == there == [logical_digest()] * world
    assert objects(fs, url) == rank_files(local) and len(rank_files(local)) == world + 1
    assert tcd.verify(url, storage_options=opts) == logical_digest()
    assert tcd.logical_digest(url, storage_options=opts) == logical_digest()
    testing.assert_identical(tcd.load_unsharded(url, storage_options=opts), logical_state())
    assert tcd.load_unsharded(url, rank=world - 1, storage_options=opts)["rng"]["rank"] == world - 1

    def load(rank):
        target = zeros_like_state(sharded_state(world, rank))
        tcd.load(target, url, storage_options=opts)
        return unsharded(target), target["rng"].value["rank"]

    for r, (got, own) in enumerate(run_ranks(world, load)):
        testing.assert_identical(got, logical_state())
        assert own == r


def test_resharded_load_cleanup_and_a_missing_index(s3, tmp_path):
    opts, _, url, fs = s3
    with pytest.raises(tcd.CheckpointNotFoundError, match="holds no index.safetensors"):
        tcd.verify(url, storage_options=opts)
    run_ranks(3, lambda r: tcd.save(sharded_state(3, r), url, storage_options=opts))
    # a rank file of an unfinished save (no index names it): removed by the next save, as locally
    fs.pipe_file(f"{url}/rank-00000-of-00005.{'0' * 32}.safetensors", b"partial")
    fs.pipe_file(f"{url}/notes.txt", b"kept")
    run_ranks(2, lambda r: tcd.save(sharded_state(2, r, seed=1), url, storage_options=opts))
    names = sorted(objects(fs, url))
    assert names == sorted([layout.INDEX_NAME, "notes.txt"] + [n for n in names if n.startswith("rank-000")])
    assert len([n for n in names if layout.RANK_FILE_RE.fullmatch(n)]) == 2
    assert tcd.verify(url, expect=logical_digest(1), storage_options=opts) == logical_digest(1)
    with pytest.raises(tcd.CheckpointExistsError):
        tcd.save(logical_state(), url, overwrite=False, storage_options=opts)

    def load(rank):  # saved by 2 ranks, loaded by 3
        target = zeros_like_state(sharded_state(3, rank, seed=1, per_rank=False))
        tcd.load(target, url, storage_options=opts)
        return unsharded(target)

    for got in run_ranks(3, load):
        testing.assert_identical(got, logical_state(1))
    with pytest.raises(tc.UsageError):
        tcd.verify(str(tmp_path), storage_options=opts)  # storage_options with a local path


def test_damaged_or_replaced_rank_object_is_refused(s3):
    opts, _, url, fs = s3
    tcd.save(logical_state(), url, storage_options=opts)
    index = layout.read(url, storage_options=opts)
    rank_url = index.file_path(0)
    data = bytearray(fs.cat_file(rank_url))
    data[-3] ^= 0x10
    fs.pipe_file(rank_url, bytes(data))
    with pytest.raises(tc.IntegrityError) as e:
        tcd.verify(url, storage_options=opts)
    assert SECRET not in str(e.value)
    fs.rm_file(rank_url)
    with pytest.raises(tcd.CheckpointNotFoundError, match="is missing"):
        tcd.load_unsharded(url, storage_options=opts)


def test_async_save_consolidate_and_cli(s3, monkeypatch, capsys, tmp_path):
    opts, _, url, fs = s3
    assert tcd.async_save(logical_state(), url, storage_options=opts).result() == logical_digest()
    assert tcd.verify(url, storage_options=opts) == logical_digest()
    out = url.rsplit("/", 1)[0] + "/whole.safetensors"
    assert tcd.consolidate(url, out, storage_options=opts) == logical_digest()
    assert fs.cat_file(out) == tc.dumps(logical_state())
    local = str(tmp_path / "whole.safetensors")
    assert tcd.consolidate(url, local, storage_options=opts) == logical_digest()
    # the command line: credentials from the environment only
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    for command in (["verify", url], ["hash", url], ["inspect", url]):
        capsys.readouterr()
        assert cli.main(command) == 0, command
        shown = capsys.readouterr()
        assert SECRET not in shown.out + shown.err
        if command[0] != "inspect":
            assert logical_digest() in shown.out, (command, shown.out)
    lock = str(tmp_path / "tensorcanon.lock")
    assert cli.main(["lock", url, "-o", lock]) == 0
    assert logical_digest() in open(lock).read() and cli.main(["check", "--allow", url, lock]) == 0


KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    import tensorcanon.dcp as tcd
    url, endpoint, secret = sys.argv[1:]
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(6)}   # 24 MiB: multipart
    tcd.save(state, url, storage_options={"endpoint_url": endpoint, "key": "testing", "secret": secret})
    print("saved", flush=True)
""")


def test_sigkill_mid_upload_leaves_the_previous_checkpoint(s3):
    """A W=1 save killed while its rank file uploads (the proxy lets one part through and holds
    the rest, so the kill lands mid-upload): the directory holds the previous checkpoint, which still verifies; the
    new rank file never appears; a fresh URL never becomes a checkpoint."""
    opts, proxy, url, fs = s3
    fresh = url.rsplit("/", 1)[0] + "/step-200"
    old = tcd.save(logical_state(), url, storage_options=opts)
    before = objects(fs, url)
    proxy.fault = stall_after_one_part
    endpoint = f"http://127.0.0.1:{proxy.port}"
    procs = {u: subprocess.Popen([sys.executable, "-c", KILLED_SAVE, u, endpoint, SECRET],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for u in (url, fresh)}
    kill_mid_upload(proxy, procs)
    proxy.reset()
    assert objects(fs, url) == before
    assert tcd.verify(url, expect=old, storage_options=opts) == old
    with pytest.raises(tcd.CheckpointNotFoundError):
        tcd.verify(fresh, storage_options=opts)
    # the killed uploads stay pending (invisible) until aborted, as a bucket lifecycle rule would
    prefix = url.split("://", 1)[1].split("/", 1)[1].rsplit("/", 1)[0] + "/"
    pending = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert len(pending) == 2
    for u in pending:
        fs.call_s3("abort_multipart_upload", Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])
    assert remote.PART == 8 << 20  # (the 24 MiB rank file above is a multipart upload)
