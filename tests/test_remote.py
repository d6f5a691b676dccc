"""Objects in a store (fsspec URLs), on fsspec's in-memory filesystem: the fast tier.

The same code runs against a real S3 API in test_remote_s3.py. Here: every public
function takes a URL, the bytes are those of a local save, lazy reads fetch only
what is asked, a failed save leaves the previous object, errors name the URL and
never a credential, and without fsspec a URL is a UsageError naming the extra.
"""

import io
import json
import sys
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import tensorcanon as tc
from tensorcanon import lockfile, testing
from tensorcanon.io import remote, storage
from tensorcanon.tools import cli

from support import fail_at_tensor


@pytest.fixture
def url():
    """A fresh memory:// folder; removed afterwards."""
    base = f"memory://tc-{uuid.uuid4().hex[:8]}"
    yield base
    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        fs.rm(base, recursive=True)


def state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32, dtype=torch.float16)},
            "ids": torch.arange(100), "step": 7}


def test_save_load_verify_same_bytes_as_local(url, tmp_path):
    obj = state()
    digest = tc.save(obj, f"{url}/a.safetensors", metadata={"run": "x"})
    local = tc.save(obj, tmp_path / "a.safetensors", metadata={"run": "x"})
    assert digest == local
    assert fsspec.filesystem("memory").cat_file(f"{url}/a.safetensors") == (tmp_path / "a.safetensors").read_bytes()
    back = tc.load(f"{url}/a.safetensors")
    testing.assert_identical(obj, back)
    assert tc.verify(f"{url}/a.safetensors", expect=digest) == digest
    assert tc.read_metadata(f"{url}/a.safetensors") == {"run": "x"}
    with tc.open(f"{url}/a.safetensors") as f:
        assert torch.equal(f['$["model"]["w"]'], obj["model"]["w"])
        assert f.digest == digest and len(f) == 3
    assert not tc.diff(f"{url}/a.safetensors", tmp_path / "a.safetensors")


def test_file_url_is_the_local_path(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "open_store", lambda *a: pytest.fail("a file:// URL must not go through fsspec"))
    path = tmp_path / "a.safetensors"
    digest = tc.save(state(), f"file://{path}")
    assert tc.verify(path) == digest == tc.verify(f"file://{path}")
    assert tc.load(f"file://{path}", mmap=True)["step"] == 7


def test_storage_options_need_a_url(tmp_path):
    with pytest.raises(tc.UsageError, match="storage_options apply to URLs"):
        tc.save(state(), tmp_path / "a.safetensors", storage_options={"anon": True})
    with pytest.raises(tc.UsageError, match="mmap=True needs a local file"):
        tc.load("memory://x/y.safetensors", mmap=True)


def test_without_fsspec_a_url_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(tc.UsageError, match=r"pip install s3fs for s3:// \(with fsspec: the \[s3\] extra"):
        tc.load("s3://bucket/ckpt.safetensors")


def test_lazy_open_reads_the_header_and_one_tensor(url, monkeypatch):
    """1 tensor of 1,000: the store is asked for less than twice the header plus that tensor."""
    obj = {f"t{i:04d}": torch.full((256,), float(i)) for i in range(1000)}  # 1 KiB each
    tc.save(obj, f"{url}/many.safetensors")
    data = fsspec.filesystem("memory").cat_file(f"{url}/many.safetensors")
    header = 8 + int.from_bytes(data[:8], "little")
    asked = []
    real = MemoryFileSystem.cat_file

    def counting(self, path, start=None, end=None, **kw):
        out = real(self, path, start=start, end=end, **kw)
        asked.append(len(out))
        return out

    monkeypatch.setattr(MemoryFileSystem, "cat_file", counting)
    with tc.open(f"{url}/many.safetensors") as f:
        assert torch.equal(f['$["t0500"]'], obj["t0500"])
    assert sum(asked) < 2 * (header + 1024), (sum(asked), header)
    assert len(data) > 3 * sum(asked)


def test_damaged_object_is_named(url):
    tc.save(state(), f"{url}/a.safetensors")
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(f"{url}/a.safetensors"))
    data[-1] ^= 1
    fs.pipe_file(f"{url}/a.safetensors", bytes(data))
    with pytest.raises(tc.IntegrityError, match=f"of {url}/a.safetensors"):
        tc.verify(f"{url}/a.safetensors")
    with pytest.raises(tc.MissingFileError, match=f"cannot read '{url}/nothing.safetensors': no such object"):
        tc.load(f"{url}/nothing.safetensors")


def test_failed_save_leaves_the_previous_object(url, monkeypatch):
    digest = tc.save(state(), f"{url}/a.safetensors")
    before = fsspec.filesystem("memory").cat_file(f"{url}/a.safetensors")
    calls = fail_at_tensor(monkeypatch, 2, OSError("the tensor went away"))
    with pytest.raises(OSError, match="went away"):
        tc.save({"a": torch.ones(1000), "b": torch.ones(10, dtype=torch.float64)}, f"{url}/a.safetensors")
    calls.clear()
    with pytest.raises(OSError, match="went away"):  # a new object: never appears
        tc.save({"a": torch.ones(1000), "b": torch.ones(10, dtype=torch.float64)}, f"{url}/new.safetensors")
    monkeypatch.undo()
    assert fsspec.filesystem("memory").cat_file(f"{url}/a.safetensors") == before
    assert tc.verify(f"{url}/a.safetensors") == digest
    assert not fsspec.filesystem("memory").exists(f"{url}/new.safetensors")


def test_sequential_store_same_bytes(tmp_path):
    """A store without multipart uploads or seeking (local:// through fsspec): the writer's
    sequential two-pass path, committed at the end; the same bytes."""
    obj = state()
    target = tmp_path / "via-fsspec.safetensors"
    digest = tc.save(obj, f"local://{target}")
    assert target.read_bytes() == tc.dumps(obj) and digest == tc.fingerprint(obj)
    assert tc.verify(f"local://{target}") == digest


def test_store_operations(url):
    store, path = storage.open_store(f"{url}/dir/x.bin")
    assert not store.multipart
    store.put(path, b"abc")
    assert store.exists(path) and store.size(path) == 3
    assert store.reader(path).fetch(1, 3) == b"bc"
    assert [p.rsplit("/", 1)[1] for p in store.find(path.rsplit("/", 1)[0])] == ["x.bin"]
    assert len(store.glob(path.rsplit("/", 1)[0] + "/*.bin")) == 1
    store.delete(path)
    assert not store.exists(path)


def test_redact_and_secrets_stay_out_of_errors():
    assert storage.redact("https://user:pw@host/a?X-Amz-Signature=abc&versionId=3") == \
        "https://user:***@host/a?X-Amz-Signature=***&versionId=3"
    assert storage.redact("/plain/path") == "/plain/path"
    store = storage.Store(fsspec.filesystem("memory"), {"key": "AKIDSECRETKEY", "client_kwargs": {"t": "tok-12345"}})
    err = store.error(OSError("denied for AKIDSECRETKEY with tok-12345"), "read", "/a/b")
    assert "AKIDSECRETKEY" not in str(err) and "tok-12345" not in str(err) and "memory://" in str(err)
    assert "AKIDSECRETKEY" not in repr(storage.Location("memory://a/b", {"key": "AKIDSECRETKEY"}))


def test_lockfile_with_urls(url, tmp_path):
    tc.save(state(), f"{url}/ckpt/a.safetensors")
    tc.save({"x": torch.ones(3)}, f"{url}/ckpt/b.safetensors")
    lock = tmp_path / "tensors.lock"
    entries = lockfile.make_lock([f"{url}/ckpt/*.safetensors"], lock)
    assert [e.path for e in entries] == [f"{url}/ckpt/a.safetensors", f"{url}/ckpt/b.safetensors"]
    lockfile.write_lock(entries, lock)
    with pytest.raises(tc.FormatError, match="outside the allowed URL prefixes"):  # never followed by default
        lockfile.check_lock(lock)
    assert all(r.ok for r in lockfile.check_lock(lock, allow=[f"{url}/ckpt"]))
    tc.save({"x": torch.zeros(3)}, f"{url}/ckpt/b.safetensors")
    fsspec.filesystem("memory").rm_file(f"{url}/ckpt/a.safetensors")
    assert [r.status for r in lockfile.check_lock(lock, allow=[f"{url}/ckpt"])] == ["missing", "mismatch"]
    with pytest.raises(tc.UsageError, match="password or a signature"):
        lockfile.make_lock(["https://u:pw@example.com/a.safetensors"], lock)


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli.main(list(argv))
    finally:
        sys.stdout, sys.stderr = old
    return code, out.getvalue(), err.getvalue()


def test_cli_with_urls(url, tmp_path):
    digest = tc.save(state(), f"{url}/a.safetensors")
    tc.save({**state(), "step": 8}, f"{url}/b.safetensors")
    code, out, _ = run_cli("verify", f"{url}/a.safetensors")
    assert code == 0 and out.split() == ["OK", f"{url}/a.safetensors", digest]
    code, out, _ = run_cli("hash", "--verify", f"{url}/a.safetensors")
    assert code == 0 and out.split() == [digest, f"{url}/a.safetensors"]
    code, out, _ = run_cli("inspect", "--json", f"{url}/a.safetensors")
    assert code == 0 and json.loads(out)["digest"] == digest
    code, out, _ = run_cli("diff", f"{url}/a.safetensors", f"{url}/b.safetensors")
    assert code == 1 and '$["step"]: value 7 -> 8' in out
    code, _, err = run_cli("verify", f"{url}/missing.safetensors")
    assert code == 2 and "no such object" in err
    lock = str(tmp_path / "t.lock")
    code, _, err = run_cli("lock", f"{url}/a.safetensors", "-o", lock)
    assert code == 0 and f"check --allow {url} " in err, err
    assert run_cli("check", lock)[0] == 2
    assert run_cli("check", "--allow", url, lock)[0] == 0


def test_remote_file_reads_ahead_in_order():
    """RemoteFile's window: sequential reads are served from parallel pieces, in order."""
    data = bytes(range(256)) * 4096  # 1 MiB
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/tc-remotefile/x", data)
    try:
        store, path = storage.open_store("memory://tc-remotefile/x")
        with remote.RemoteFile(store.reader(path), sequential=True) as fh:
            got = b"".join(iter(lambda: fh.read(100_003), b""))
            assert got == data
            fh.seek(500_000)
            assert fh.read(10) == data[500_000:500_010]
    finally:
        fs.rm("/tc-remotefile", recursive=True)
