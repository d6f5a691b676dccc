"""Sharded checkpoints in a store across real processes (slow: tests/conftest.py, by their names).

One launch of 2 gloo ranks (tests/store/dcp_store_child.py) runs every scenario: a local store
(a state of every placement, then 3 steps of a state whose shards repeat across ranks and
steps) and a store in S3 (moto's server). A second launch SIGKILLs a rank once its blobs are in
the store; then a lone saver is killed at random moments, again and again.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest
import s3fs
from s3_support import BUCKET

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon import testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dcp_store_child import steps_state

from helpers import rank_files, unsharded, zeros_like_state
from states import logical_digest, logical_state, sharded_state
from support import free_port, run_processes
from threaded import run_ranks

pytestmark = pytest.mark.slow
CHILD = os.path.join(HERE, "dcp_store_child.py")


def launch(mode, folder, world=2, extra=None, timeout=240):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", **(extra or {}))
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    runs = [([sys.executable, CHILD, mode, folder], dict(env, RANK=str(r), LOCAL_RANK=str(r)),
             os.path.join(folder, f"{mode}.rank{r}.log")) for r in range(world)]
    codes = run_processes(runs, timeout)
    logs = {r: open(os.path.join(folder, f"{mode}.rank{r}.log"), errors="replace").read()[-3000:] for r in range(world)}
    return codes, logs


def result(folder, mode, rank, logs):
    path = os.path.join(folder, f"{mode}.rank{rank}.json")
    assert os.path.exists(path), logs
    with open(path) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def s3_url_and_options(s3_server):
    from s3_support import options

    port, _ = s3_server
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/store", options(port)


def test_two_ranks_across_processes_locally_and_in_s3(tmp_path, s3_url_and_options):
    folder = str(tmp_path)
    url, opts = s3_url_and_options
    codes, logs = launch("ranks", folder, extra={"TC_TEST_S3_URL": url, "TC_TEST_S3_OPTIONS": json.dumps(opts)})
    assert codes == [0, 0], logs
    out = [result(folder, "ranks", r, logs) for r in range(2)]
    for name in ("local", "s3"):
        for r in range(2):
            assert "error" not in out[r][name], out[r][name]
    local = out[0]["local"]
    # one logical digest: every rank, the directory save, fingerprint of the unsharded state
    assert out[1]["local"]["state"] == local["state"] == logical_digest()
    for r in range(2):
        assert out[r]["local"]["loaded"] == [logical_digest(), r]
    store = tc.Store(os.path.join(folder, "store"))
    assert store.tags() == ["state", "step-0", "step-1", "step-2"]
    for tag in store.tags():
        tcd.export(tcd.StoreTag(store, tag), tmp_path / f"out-{tag}")
        assert rank_files(str(tmp_path / f"out-{tag}")) == rank_files(os.path.join(folder, f"{tag}-dir"))
    for step in range(3):
        expected = run_ranks(1, lambda r, s=step: tc.fingerprint(unsharded(steps_state(1, 0, s))))[0]
        assert local[f"step-{step}"] == expected
    # dedup across ranks (the zeros' two chunks, the frozen shards) and steps (all but "moving")
    s0, s1, s2 = (local[f"stats-{i}"] for i in range(3))
    moving = 256 * 64 * 4
    assert s1["blobs"] - s0["blobs"] == 2 == s2["blobs"] - s1["blobs"]         # the 2 chunks of "moving"
    assert s1["blob_bytes"] - s0["blob_bytes"] <= moving * 1.05
    assert s1["logical_bytes"] - s0["logical_bytes"] > 2 * moving              # what a directory would take
    # reshard what the processes saved: 3 and 1 ranks (threads) read the same tag
    for world in (1, 3):
        def load(rank, world=world):
            target = zeros_like_state(sharded_state(world, rank))
            tcd.load(target, tcd.StoreTag(tc.Store(os.path.join(folder, "store")), "state"),
                     keep_per_rank_on_resize=True)
            return unsharded(target)

        for got in run_ranks(world, load):
            testing.assert_identical(got, logical_state())
    # S3: the same logical digests, the tags listed, every blob verified, an export equal to the local one
    s3 = out[0]["s3"]
    assert s3 == out[1]["s3"]
    assert s3["step-0"] == local["step-0"] and s3["step-1"] == local["step-1"] == s3["loaded"]
    remote = tc.Store(url, storage_options=opts)
    assert remote.tags() == ["step-0", "step-1"]
    assert set(remote.verify()) == {"step-0", "step-1"}
    assert tcd.verify(tcd.StoreTag(remote, "step-1")) == local["step-1"]
    tcd.export(tcd.StoreTag(remote, "step-1"), tmp_path / "from-s3")
    assert rank_files(str(tmp_path / "from-s3")) == rank_files(os.path.join(folder, "step-1-dir"))
    fs = s3fs.S3FileSystem(**opts)
    assert any("/blobs/" in p or "/packs/" in p for p in fs.find(url))  # (small blobs: in packs)


def test_a_rank_killed_after_storing_its_blobs_leaves_no_tag_in_fresh_processes(tmp_path):
    folder = str(tmp_path)
    codes, logs = launch("killed", folder, timeout=150)
    assert codes[1] == -signal.SIGKILL, logs
    assert codes[0] == 0, logs
    out = result(folder, "killed", 0, logs)
    assert out["before"] == logical_digest()
    assert "error" in out["after"], out["after"]               # the coordinator never committed
    store = tc.Store(os.path.join(folder, "store"))
    assert store.tags() == ["before"]
    assert tcd.verify(tcd.StoreTag(store, "before")) == logical_digest()
    store.gc()                                                 # the dead rank's blobs go; "before" stays whole
    assert tcd.verify(tcd.StoreTag(store, "before")) == logical_digest()


def test_sigkill_at_random_moments_leaves_only_whole_tags_in_fresh_processes(tmp_path):
    rng = random.Random(0)
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, CHILD, "saver", str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "store").exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, err
        store = tc.Store(tmp_path / "store")
        for tag in store.tags():                              # every listed tag is whole
            got = tcd.verify(tcd.StoreTag(store, tag))
            said = tmp_path / f"{tag}.digest"                 # (written after the save returned)
            assert not said.exists() or got == said.read_text()
    store = tc.Store(tmp_path / "store")
    assert len(store.tags()) >= 1
    store.gc()
    for tag in store.tags():
        tcd.verify(tcd.StoreTag(store, tag))
