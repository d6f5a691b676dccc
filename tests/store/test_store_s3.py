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
    assert sum(stats["codecs"].get(c, 0) for c in ("delta", "delta-sub", "delta-twos")) >= 1
    assert stats["stored_bytes"] < 0.7 * stats["logical_bytes"]
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
    proxy.fault = lambda method, path, query: "hold" if method == "GET" and "/blobs/" in path else None
    start = time.monotonic()
    with pytest.raises(tc.FileAccessError) as e:
        tc.Store(url, storage_options=dict(proxied, config_kwargs=FAST_FAIL, tensorcanon_deadline=3)).load("t")
    assert time.monotonic() - start < 60
    assert "blobs/" in str(e.value) and SECRET not in str(e.value)
    proxy.reset()
    assert tc.Store(url, storage_options=direct).verify("t") == tc.fingerprint(drifting(1)[0])
