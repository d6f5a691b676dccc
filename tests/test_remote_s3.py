"""Objects in S3, against a real S3 API: moto's server on 127.0.0.1, reached by s3fs over HTTP.

One server for the session; a small HTTP proxy in front of it injects the faults
a real store has (503 answers, a server that stops answering, one that answers
too late) and counts what the client asks for. Nothing here mocks the client.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import s3fs
import torch
from s3_support import BUCKET, FAST_FAIL, SECRET, free_port  # (the s3_server fixture: tests/conftest.py)

import tensorcanon as tc
from tensorcanon import testing
from tensorcanon.io import remote
from tensorcanon.tools import cli


@pytest.fixture
def s3(s3_server, monkeypatch):
    """(options reaching the server directly, options through the proxy, the proxy, a fresh key prefix)."""
    port, proxy = s3_server
    proxy.reset()
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)  # s3fs's own retries: bounded, and quick here
    direct = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": SECRET}
    proxied = {"endpoint_url": f"http://127.0.0.1:{proxy.port}", "key": "testing", "secret": SECRET,
               "config_kwargs": FAST_FAIL}
    yield direct, proxied, proxy, f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    proxy.reset()


def big_state(mib):
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}": torch.randn(256, 1024, generator=g) for i in range(mib)} | {"step": 3}


def pending_uploads(options):
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    return fs.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])


def test_single_put_and_multipart_same_bytes_as_local(s3, monkeypatch):
    direct, _, _, base = s3
    monkeypatch.setattr(remote, "PART", 5 << 20)
    fs = s3fs.S3FileSystem(**direct)
    for name, obj in (("small", {"w": torch.arange(10.0), "n": 1}), ("large", big_state(12))):
        url = f"{base}/{name}.safetensors"
        digest = tc.save(obj, url, storage_options=direct)
        assert fs.cat_file(url) == tc.dumps(obj) and digest == tc.fingerprint(obj)
        assert tc.verify(url, expect=digest, storage_options=direct) == digest
        testing.assert_identical(obj, tc.load(url, storage_options=direct))
    assert pending_uploads(direct) == []


def test_multipart_sends_parts_in_parallel_with_the_header_last(s3, monkeypatch):
    _, proxied, proxy, base = s3
    monkeypatch.setattr(remote, "PART", 5 << 20)
    tc.save(big_state(16), f"{base}/p.safetensors", storage_options=proxied)
    parts = [q for m, _, q in proxy.requests if m == "PUT" and "partNumber=" in q]
    numbers = [int(q.split("partNumber=")[1].split("&")[0]) for q in parts]
    assert sorted(numbers) == list(range(1, len(numbers) + 1)) and len(numbers) >= 3
    assert numbers[-1] == 1 or numbers.index(1) >= len(numbers) - 2  # the held first part goes last


def test_lazy_open_fetches_header_and_one_tensor(s3):
    _, proxied, proxy, base = s3
    obj = {f"t{i:04d}": torch.full((256,), float(i)) for i in range(1000)}
    url = f"{base}/many.safetensors"
    data = tc.dumps(obj)
    tc.save(obj, url, storage_options=proxied)
    header = 8 + int.from_bytes(data[:8], "little")
    proxy.reset()
    with tc.open(url, storage_options=proxied) as f:
        assert torch.equal(f['$["t0777"]'], obj["t0777"])
    assert proxy.bytes_out < 2 * (header + 1024), (proxy.bytes_out, header)


def test_object_replaced_between_ranged_reads(s3):
    direct, _, _, base = s3
    url = f"{base}/r.safetensors"
    tc.save({"a": torch.zeros(1000), "b": torch.ones(1000)}, url, storage_options=direct)
    with tc.open(url, storage_options=direct) as f:
        tc.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, url, storage_options=direct)
        with pytest.raises(tc.FileAccessError, match="replaced while it was being read"):
            f['$["b"]']


@pytest.mark.parametrize("fault", ["503", "drop", "timeout"])
def test_failed_upload_leaves_previous_object(s3, monkeypatch, fault):
    """A 503 answer, a server that stops answering, one that answers too late: each a clear error
    naming the URL (never the secret), in bounded time; the previous object is untouched and the
    multipart upload is aborted."""
    direct, proxied, proxy, base = s3
    monkeypatch.setattr(remote, "PART", 5 << 20)
    url = f"{base}/ckpt.safetensors"
    old = tc.save({"w": torch.arange(5.0)}, url, storage_options=direct)
    action = {"503": 503, "drop": "drop", "timeout": ("delay", 1.5)}[fault]
    seen = []

    def inject(method, path, query):
        if method == "PUT" and "partNumber=" in query:
            seen.append(query)
            if len(seen) >= 2:  # the first part goes through, the next ones fail
                return action
        return None

    proxy.fault = inject
    start = time.monotonic()
    with pytest.raises(tc.FileAccessError) as e:
        tc.save(big_state(16), url, storage_options=proxied)
    assert time.monotonic() - start < 30
    message = str(e.value)
    assert url in message and "previous object there, if any, is unchanged" in message
    assert SECRET not in message and "testing" not in message.replace(f"{base}", "")
    proxy.reset()
    assert tc.verify(url, storage_options=direct) == old
    assert pending_uploads(direct) == []


def test_secret_never_in_an_error(s3):
    direct, _, _, _ = s3
    options = dict(direct, endpoint_url=f"http://127.0.0.1:{free_port()}", config_kwargs=FAST_FAIL)
    for call in (lambda: tc.load("s3://no-such-bucket/x.safetensors", storage_options=direct),
                 lambda: tc.load("s3://bucket/x.safetensors", storage_options=options)):  # nobody listening
        with pytest.raises(tc.FileAccessError) as e:
            call()
        assert SECRET not in str(e.value) and SECRET not in repr(e.value) and "s3://" in str(e.value)


KILLED_WRITER = textwrap.dedent("""
    import sys, torch, tensorcanon
    from tensorcanon.io import remote
    remote.PART = 5 << 20
    state = {f"layer{i}": torch.randn(256, 1024) for i in range(16)}
    options = {"endpoint_url": sys.argv[2], "key": "testing", "secret": sys.argv[3]}
    tensorcanon.save(state, sys.argv[1], storage_options=options)
    print("saved")
""")


def test_sigkill_mid_upload_never_leaves_an_object_that_verifies(s3):
    """Writers killed mid-upload (to a new key, and over an existing object): the new key never
    appears, the existing object still verifies as it was."""
    direct, proxied, proxy, base = s3
    url_new, url_old = f"{base}/new.safetensors", f"{base}/old.safetensors"
    old = tc.save({"w": torch.arange(5.0)}, url_old, storage_options=direct)
    proxy.fault = lambda m, p, q: ("delay", 0.3) if "partNumber=" in q else None
    procs = {url: subprocess.Popen([sys.executable, "-c", KILLED_WRITER, url, proxied["endpoint_url"], SECRET],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for url in (url_new, url_old)}

    def parts_sent(url):
        key = "/" + url.split("://", 1)[1]
        with proxy.lock:
            return sum(1 for m, p, q in proxy.requests if m == "PUT" and p == key and "partNumber=" in q)

    deadline = time.monotonic() + 60
    while any(parts_sent(u) < 2 and p.poll() is None for u, p in procs.items()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for url, proc in procs.items():
        assert parts_sent(url) >= 2
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        assert b"saved" not in out, err.decode()[-2000:]
    proxy.reset()
    with pytest.raises(tc.MissingFileError):
        tc.verify(url_new, storage_options=direct)
    assert tc.verify(url_old, storage_options=direct) == old


def test_cli_with_credentials_from_the_environment(s3, monkeypatch, capsys, tmp_path):
    direct, _, _, base = s3
    digest = tc.save({"w": torch.arange(5.0)}, f"{base}/a.safetensors", storage_options=direct)
    monkeypatch.setenv("AWS_ENDPOINT_URL", direct["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()
    assert cli.main(["verify", f"{base}/a.safetensors"]) == 0
    assert cli.main(["hash", f"{base}/a.safetensors"]) == 0
    assert cli.main(["inspect", f"{base}/a.safetensors"]) == 0
    lock = str(tmp_path / "t.lock")
    assert cli.main(["lock", f"{base}/", "-o", lock]) == 0
    assert cli.main(["check", lock]) == 0
    out = capsys.readouterr().out
    assert f"OK        {base}/a.safetensors  {digest}" in out and f"{digest}  {base}/a.safetensors" in out
    s3fs.S3FileSystem.clear_instance_cache()
