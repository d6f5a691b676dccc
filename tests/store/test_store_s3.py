"""A store in S3, against moto's S3 server on 127.0.0.1 (the s3_server fixture: tests/conftest.py), through
the fault-injecting proxy of tests/s3_support.py where a fault is needed. Slow: it starts a server."""

import time
import uuid

import pytest
import torch
from s3_support import BUCKET, FAST_FAIL, NO_RETRIES, SECRET, options

import tensorcanon as tc

pytestmark = pytest.mark.slow


@pytest.fixture
def s3(s3_direct):
    direct, proxy = s3_direct
    return direct, options(proxy.port, config_kwargs=NO_RETRIES), proxy, f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


def drifting(n, size=(256, 1024)):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*size, generator=g)
    frozen = torch.randn(*size, generator=g)
    out = []
    for i in range(n):
        w = w + 1e-4 * torch.randn(*size, generator=g)
        out.append({"frozen": frozen, "w": w.clone(), "step": i})
    return out


def test_a_store_in_s3(s3, tmp_path):
    direct, _, _, base = s3
    url = f"{base}/store"
    store = tc.Store(url, storage_options=direct)
    states = drifting(3)
    for i, s in enumerate(states):
        assert store.save(f"step-{i}", s) == tc.fingerprint(s)
    assert store.tags() == ["step-0", "step-1", "step-2"]
    fresh = tc.Store(url, storage_options=direct)
    for i, s in enumerate(states):
        assert tc.fingerprint(fresh.load(f"step-{i}", map_location="cpu")) == tc.fingerprint(s)
    assert set(fresh.verify()) == {"step-0", "step-1", "step-2"}
    stats = fresh.stats()
    assert _deltas(stats) >= 1 and stats["stored_bytes"] < 0.7 * stats["logical_bytes"]
    assert stats["packs"] == 3 and stats["loose_blobs"] == 0  # one object per save (the frozen tensor: once)
    assert fresh.export("step-2", tmp_path / "o.safetensors") == tc.fingerprint(states[2])
    assert (tmp_path / "o.safetensors").read_bytes() == tc.dumps(states[2])
    fresh.delete("step-0")
    fresh.delete("step-1")
    fresh.gc()
    assert fresh.verify() == {"step-2": tc.fingerprint(states[2])}


def test_a_store_that_stalls_fails_within_the_deadline_naming_the_object(s3):
    direct, proxied, proxy, base = s3
    url = f"{base}/store"
    tc.Store(url, storage_options=direct).save("t", drifting(1)[0])
    proxy.fault = lambda method, path, query: "hold" if method == "GET" and "/packs/" in path else None
    start = time.monotonic()
    with pytest.raises(tc.FileAccessError) as e:
        tc.Store(url, storage_options=dict(proxied, config_kwargs=FAST_FAIL, tensorcanon_deadline=3)).load("t")
    assert time.monotonic() - start < 60
    assert "packs/" in str(e.value) and SECRET not in str(e.value)
    proxy.reset()
    assert tc.Store(url, storage_options=direct).verify("t") == tc.fingerprint(drifting(1)[0])


def test_a_save_is_one_pack_put_and_a_load_reads_ranges_of_it(s3):
    direct, proxied, proxy, base = s3
    url = f"{base}/packs-store"
    g = torch.Generator().manual_seed(1)
    big = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(4)}  # a pack of 4 MiB
    small = {f"a{i}": torch.randn(300, generator=g) for i in range(40)}
    store = tc.Store(url, storage_options=proxied)
    store.save("big", big)
    proxy.reset()
    store.save("small", small)
    puts = [p for m, p, q in proxy.requests if m == "PUT"]
    assert len([p for p in puts if "/packs/" in p]) == 1 and not [p for p in puts if "/blobs/" in p]
    assert len([p for p in puts if "/tags/" in p]) == 1  # (and the save's pending marker)
    proxy.reset()
    fresh = tc.Store(url, storage_options=proxied)
    assert tc.fingerprint(fresh.load("small")) == tc.fingerprint(small)
    assert proxy.bytes_out < 1 << 20  # the big pack's index (its last 64 KiB at most), not its 4 MiB
    assert fresh.verify("big") == tc.fingerprint(big)


def _deltas(stats):
    """Blobs stored as a delta of a base, by any delta codec (XOR, or the integer difference)."""
    return sum(stats["codecs"].get(c, 0) for c in ("delta", "delta-sub", "delta-twos"))
