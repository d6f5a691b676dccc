"""Objects in S3, against a real S3 API: moto's server on 127.0.0.1, reached by s3fs over HTTP.

One server for the session; a small HTTP proxy in front of it injects the faults
a real store has (503 answers, a server that stops answering, one that answers
too late) and counts what the client asks for. Nothing here mocks the client.
"""

import subprocess
import sys
import textwrap
import uuid

import pytest
import s3fs
import torch
from s3_support import (  # (the s3_server, s3_direct fixtures: tests/conftest.py)
    BUCKET,
    FAST_FAIL,
    NO_RETRIES,
    SECRET,
    kill_mid_upload,
    options,
    part_number,
    stall_after_one_part,
)

import tensorcanon as tc
from tensorcanon import testing
from tensorcanon.io import remote
from tensorcanon.tools import cli

from support import free_port


@pytest.fixture
def s3(s3_direct):
    """(options reaching the server directly, options through the proxy, the proxy, a fresh key prefix)."""
    direct, proxy = s3_direct
    return direct, options(proxy.port, config_kwargs=NO_RETRIES), proxy, f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


def big_state(mib):
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}": torch.randn(256, 1024, generator=g) for i in range(mib)} | {"step": 3}


def pending_uploads(opts):
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
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
    handed = []  # part numbers in the order the writer hands them to the upload threads
    real_send = remote.ObjectWriter._send

    def send(self, buf, number=None):
        real_send(self, buf, number)
        handed.append(self._number if number is None else number)

    monkeypatch.setattr(remote.ObjectWriter, "_send", send)
    tc.save(big_state(16), f"{base}/p.safetensors", storage_options=proxied)
    numbers = [part_number(q) for m, _, q in proxy.requests if m == "PUT" and part_number(q) is not None]
    # every part reached the store once (in an order that is up to the upload threads' timing)
    assert sorted(numbers) == list(range(1, len(numbers) + 1)) and len(numbers) >= 3
    assert sorted(handed) == sorted(numbers) and handed[-1] == 1  # the held first part is handed over last


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
    action = {"503": 503, "drop": "drop", "timeout": "hold"}[fault]  # hold: no answer until reset() below
    seen = []

    def inject(method, path, query):
        if method == "PUT" and "partNumber=" in query:
            seen.append(query)
            if len(seen) >= 2:  # the first part goes through, the next ones fail
                return action
        return None

    proxy.fault = inject
    with pytest.raises(tc.FileAccessError) as e:  # (FAST_FAIL bounds the waiting and retrying; not timed here)
        tc.save(big_state(16), url, storage_options=dict(proxied, config_kwargs=FAST_FAIL))
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
    proxy.fault = stall_after_one_part
    procs = {url: subprocess.Popen([sys.executable, "-c", KILLED_WRITER, url, proxied["endpoint_url"], SECRET],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for url in (url_new, url_old)}
    kill_mid_upload(proxy, procs)
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
    assert cli.main(["check", "--allow", f"{base}/", lock]) == 0
    out = capsys.readouterr().out
    assert f"OK        {base}/a.safetensors  {digest}" in out and f"{digest}  {base}/a.safetensors" in out
    s3fs.S3FileSystem.clear_instance_cache()
