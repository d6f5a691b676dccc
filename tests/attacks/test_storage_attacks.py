"""Attacks on object storage: a store that lies about sizes, answers ranges with more (or fewer) bytes
than asked, trickles or stalls; a ``local://`` URL naming a FIFO; a URL that is both an object and a
checkpoint; presigned URLs whose signatures a store's errors repeat.

The lies are told by a small server of the tests' own on 127.0.0.1 (tests/lying_store.py), spoken to
by s3fs (S3) and fsspec's http filesystem; the ambiguity and presigned-URL attacks also run against
moto's S3 server (the ``s3_direct`` fixture). Every remote call here runs under a short deadline,
so no attack can hang the suite. The slow tier (tests/conftest.py: servers).
"""

import os
import socket
import threading
import tracemalloc
import urllib.parse
import uuid

import pytest
import torch
from lying_store import LyingStore

import tensorcanon as tc
import tensorcanon.dcp as tcd
from tensorcanon import lockfile
from tensorcanon.io import fetch
from tensorcanon.tools import cli

HERE = os.path.dirname(os.path.abspath(__file__))
TB = 1 << 40
BOUND_S = 120.0  # a hang guard, not a timing: the deadline tests use 1 or 2 s, the others fail at once; only a
# call that never returns runs past it (no test asserts how long a call took: the messages say what stopped it)
SLOW_OK = {"tensorcanon_deadline": 30}  # tests not about deadlines: a loaded machine (or tracemalloc) is slow


@pytest.fixture
def lies():
    with LyingStore() as store:
        yield store


def warm_up(store):
    """One honest read through S3 and HTTP (with the options of the reads that follow, so that the
    same clients are used) before memory is traced: botocore's and aiohttp's first-use costs
    (loading their models) are not what is measured."""
    store.put("honest.safetensors", small())
    tc.load("s3://lies/honest.safetensors", storage_options=store.options(**SLOW_OK, skip_instance_cache=False))
    tc.load(store.http("honest.safetensors"), storage_options=SLOW_OK)


def small():
    return tc.dumps({"w": torch.arange(64.0), "step": 3})


def command(argv):
    """The command line's run, its exit status raised as SystemExit (for :func:`within`)."""
    raise SystemExit(cli.main(argv))


def within(seconds, call):
    """``call()``'s exception; a call still running after ``seconds`` fails the test rather than hanging the
    suite (a hang guard: the time a call took is not asserted)."""
    out = {}

    def run():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - what the test inspects
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    assert "error" in out, "no error"
    return out["error"]


# --------------------------------------------------------------------------- sizes are claims

def test_a_size_claim_is_proven_before_anything_is_allocated(lies):
    """A 96-byte object whose header claims a 1 TB tensor, whose store claims 1 TiB: locally a
    FormatError, and through S3 and HTTP a FormatError too, for load, open, verify and
    read_metadata, with little memory and few requests."""
    data = open(os.path.join(HERE, "tensor_1tb.bin"), "rb").read()
    with pytest.raises(tc.FormatError):
        tc.loads(data)
    url = lies.put("claim.safetensors", data, claim=TB)
    opts = lies.options(**SLOW_OK)
    warm_up(lies)
    calls = [lambda: tc.load(url, storage_options=opts), lambda: tc.open(url, storage_options=opts),
             lambda: tc.verify(url, storage_options=opts), lambda: tc.read_metadata(url, storage_options=opts),
             lambda: tc.load(lies.http("claim.safetensors"), storage_options=SLOW_OK),
             lambda: tc.verify(lies.http("claim.safetensors"), storage_options=SLOW_OK)]
    for call in calls:  # (a 1 TiB allocation would be torch's RuntimeError or a MemoryError, not this)
        e = within(BOUND_S, call)
        assert isinstance(e, tc.FormatError), repr(e)
        assert "ends before the 1099511627776 bytes its store reported" in str(e)
    assert lies.count("GET") < 40


def test_a_sharded_checkpoint_whose_store_claims_too_much(lies, tmp_path):
    """load_unsharded and verify of a checkpoint whose rank object the store says is 1 TiB."""
    folder = tmp_path / "ck"
    tcd.save({"w": torch.arange(1000.0), "step": 1}, folder)
    for name in os.listdir(folder):
        claim = {"claim": TB} if name.startswith("rank-") else {}
        lies.put(f"ck/{name}", (folder / name).read_bytes(), **claim)
    opts = lies.options(**SLOW_OK)
    for call in (lambda: tcd.load_unsharded("s3://lies/ck", storage_options=opts),
                 lambda: tcd.verify("s3://lies/ck", storage_options=opts),
                 lambda: tc.verify("s3://lies/ck/", storage_options=opts)):
        e = within(BOUND_S, call)
        assert isinstance(e, tc.FormatError) and "ends before" in str(e), repr(e)


@pytest.mark.parametrize("lie", [{"extra": 256 << 20}, {"short": 10}, {"length": "9" * 5000}, {"length": "abc"},
                                 {"shift": 8}])
def test_a_range_answered_with_other_than_what_was_asked_is_refused(lies, lie):
    """256 MiB more than asked is refused after reading at most one byte more of it; fewer bytes
    are the object ending early (a FormatError, as locally); a Content-Length of 5,000 digits or
    not a number is refused without being parsed as one; bytes from elsewhere in the object (their
    Content-Range says so) are refused before they are read."""
    data = small()
    name = f"range-{uuid.uuid4().hex[:6]}.safetensors"
    url = lies.put(name, data, **lie)
    warm_up(lies)
    tracemalloc.start()
    try:
        for call in (lambda: tc.load(url, storage_options=lies.options(**SLOW_OK, skip_instance_cache=False)),
                     lambda: tc.load(lies.http(name), storage_options=SLOW_OK)):
            e = within(BOUND_S, call)
            if "short" in lie:
                assert isinstance(e, tc.FormatError) and "ends before" in str(e), repr(e)
            else:
                assert isinstance(e, tc.FileAccessError), repr(e)
                assert "tensorcanon takes only what it asked for" in str(e) or "deadline" not in str(e), str(e)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak  # the 256 MiB answer is never held


# --------------------------------------------------------------------------- deadlines

@pytest.mark.parametrize("lie", [{"trickle": 3}, {"stall": True}])
def test_a_store_that_trickles_or_stalls_is_stopped_at_the_deadline(lies, lie):
    url = lies.put("slow.safetensors", small(), **lie)
    http = lies.http("slow.safetensors")
    opts = lies.options(tensorcanon_deadline=1)
    for call in (lambda: tc.load(url, storage_options=opts), lambda: tc.verify(url, storage_options=opts),
                 lambda: tc.open(url, storage_options=opts), lambda: tc.save({"a": 1}, url, storage_options=opts),
                 lambda: tc.load(http, storage_options={"tensorcanon_deadline": 1}),
                 lambda: tc.load(f"simplecache::{http}", storage_options={"tensorcanon_deadline": 1})):
        e = within(BOUND_S, call)
        assert isinstance(e, tc.FileAccessError), repr(e)
        message = str(e)
        assert "within the deadline of 1 s" in message and "tensorcanon_deadline" in message
        assert fetch.DEADLINE_ENV in message and ("s3://lies/slow" in message or "127.0.0.1" in message)
        assert "SECRETlyingKEY" not in message


def test_a_clients_own_timeout_is_not_called_the_deadline(lies):
    """A ranged read stopped by the HTTP client's own timeout (storage_options) says so, rather than
    naming tensorcanon's deadline, which it did not reach."""
    import aiohttp

    lies.put("ranges.safetensors", small(), stall_ranges=True)
    opts = {"tensorcanon_deadline": 30, "client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_read=1)}}
    e = within(BOUND_S, lambda: tc.load(lies.http("ranges.safetensors"), storage_options=opts))
    assert isinstance(e, tc.FileAccessError) and "client timed out" in str(e), repr(e)
    assert "deadline" not in str(e)


def test_the_command_line_takes_the_deadline_from_the_environment(lies, monkeypatch, capsys):
    lies.put("slow.safetensors", small(), stall=True)
    monkeypatch.setenv(fetch.DEADLINE_ENV, "1")
    for argv in (["verify", lies.http("slow.safetensors")], ["hash", lies.http("slow.safetensors")]):
        e = within(BOUND_S, lambda argv=argv: command(argv))
        assert isinstance(e, SystemExit) and e.code == 2
    err = capsys.readouterr().err
    assert "within the deadline of 1 s" in err


def test_the_deadline_option_is_checked(monkeypatch):
    assert fetch.deadline_of({})[0] == fetch.DEADLINE_S
    assert fetch.deadline_of({"tensorcanon_deadline": 2.5, "key": "k"}) == (2.5, {"key": "k"})
    monkeypatch.setenv(fetch.DEADLINE_ENV, "7")
    assert fetch.deadline_of(None)[0] == 7.0
    assert fetch.deadline_of({"tensorcanon_deadline": 3})[0] == 3.0  # the option wins
    for bad in (0, -1, float("nan"), float("inf"), "soon", True, [1]):
        with pytest.raises(tc.UsageError, match="tensorcanon_deadline"):
            fetch.deadline_of({"tensorcanon_deadline": bad})
    monkeypatch.setenv(fetch.DEADLINE_ENV, "never")
    with pytest.raises(tc.UsageError, match=fetch.DEADLINE_ENV):
        fetch.deadline_of(None)


# --------------------------------------------------------------------------- local:// and FIFOs

def test_a_local_url_naming_a_fifo_is_refused_not_read(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    url = f"local://{fifo}"
    for call in (lambda: tc.load(url), lambda: tc.verify(url), lambda: tc.open(url),
                 lambda: tc.read_metadata(url), lambda: tc.load(f"simplecache::{url}")):
        e = within(BOUND_S, call)
        assert isinstance(e, tc.FileAccessError) and "a FIFO" in str(e), repr(e)
    e = within(BOUND_S, lambda: command(["verify", url]))
    assert e.code == 2


def test_a_lockfile_check_of_a_local_url_replaced_by_a_fifo(tmp_path):
    target = tmp_path / "a.safetensors"
    tc.save({"w": torch.arange(3.0)}, target)
    lock = tmp_path / "t.lock"
    entries = lockfile.make_lock([f"local://{target}"], lock)
    lockfile.write_lock(entries, lock)
    target.unlink()
    os.mkfifo(target)
    e = within(BOUND_S, lambda: command(["check", str(lock)]))
    assert e.code != 0


# --------------------------------------------------------------------------- against moto's server

def test_an_object_that_is_also_a_checkpoint_is_refused_everywhere(s3_direct, tmp_path, capsys):
    """s3://bkt/model is an object and a checkpoint's prefix: load, verify, open, the sharded
    readers and every command refuse it by one rule; with a trailing '/' it is the checkpoint."""
    from s3_support import BUCKET

    direct, _ = s3_direct
    base = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/model"
    tc.save({"w": torch.zeros(3)}, base, storage_options=direct)
    locked = tmp_path / "before.lock"  # a lockfile made while the URL named only the object
    lockfile.write_lock(lockfile.make_lock([base], locked, storage_options=direct), locked)
    ckpt = tcd.save({"w": torch.arange(100.0)}, base, storage_options=direct)
    for call in (lambda: tc.load(base, storage_options=direct), lambda: tc.verify(base, storage_options=direct),
                 lambda: tc.open(base, storage_options=direct), lambda: tc.read_metadata(base, storage_options=direct),
                 lambda: tcd.load_unsharded(base, storage_options=direct),
                 lambda: tcd.verify(base, storage_options=direct),
                 lambda: lockfile.make_lock([base], tmp_path / "x.lock", storage_options=direct)):
        with pytest.raises(tc.UsageError, match="is ambiguous"):
            call()
    assert tc.verify(base + "/", storage_options=direct) == ckpt
    os.environ.update(AWS_ENDPOINT_URL=direct["endpoint_url"], AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY=direct["secret"], AWS_DEFAULT_REGION="us-east-1")
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        capsys.readouterr()
        for argv in (["verify", base], ["verify", "--expect", ckpt, base], ["hash", base], ["inspect", base],
                     ["lock", base, "-o", str(tmp_path / "t.lock")]):
            assert cli.main(argv) == 2, argv
            assert "is ambiguous" in capsys.readouterr().err
        assert cli.main(["check", "--allow", f"s3://{BUCKET}/", str(locked)]) != 0  # (the entry fails)
        captured = capsys.readouterr()
        assert "is ambiguous" in captured.out + captured.err
        assert not (tmp_path / "t.lock").exists()
    finally:
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            os.environ.pop(k, None)
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_presigned_urls_signature_never_shows(s3_direct, capsys):
    """Presigned URLs (moto's S3 over plain HTTP): one of an object, one of a missing key, one of a
    damaged object; the errors name the URL, and neither the signature nor the credential appears in
    them, on stderr or on stdout."""
    import s3fs
    from s3_support import BUCKET

    direct, _ = s3_direct
    base = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(**direct)
    tc.save({"w": torch.arange(3.0)}, f"{base}/a.safetensors", storage_options=direct)
    data = bytearray(tc.dumps({"w": torch.arange(3.0)}))
    data[-1] ^= 1
    fs.pipe_file(f"{base}/damaged.safetensors", bytes(data))
    secrets = []
    urls = {}
    for name in ("a", "missing", "damaged"):
        signed = fs.url(f"{base}/{name}.safetensors", expires=600)
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(signed).query))
        key = next(k for k in query if k in ("X-Amz-Signature", "Signature"))  # SigV4, or moto's SigV2
        secrets.append(urllib.parse.quote(query[key], safe=""))
        secrets.append("=" + urllib.parse.quote(query.get("X-Amz-Credential") or query["AWSAccessKeyId"], safe=""))
        urls[name] = signed
    assert all(s[:8] in urls["a"] + urls["missing"] + urls["damaged"] for s in secrets)
    assert tc.verify(urls["a"], storage_options=SLOW_OK)  # the genuine one reads
    for call, error in ((lambda: tc.load(urls["missing"]), tc.MissingFileError),
                        (lambda: tc.verify(urls["missing"]), tc.MissingFileError),
                        (lambda: tc.verify(urls["damaged"]), tc.IntegrityError),
                        (lambda: tc.load(urls["damaged"]), tc.IntegrityError)):
        with pytest.raises(error) as e:
            call()
        assert "127.0.0.1" in str(e.value) and "***" in str(e.value)
        assert not [s for s in secrets if s in str(e.value)], str(e.value)
    capsys.readouterr()
    assert cli.main(["verify", urls["a"]]) == 0
    assert cli.main(["verify", urls["missing"]]) == 2
    assert cli.main(["verify", urls["damaged"]]) == 1
    assert cli.main(["hash", "--json", urls["missing"]]) == 2
    captured = capsys.readouterr()
    assert not [s for s in secrets if s in captured.err + captured.out], captured


def test_a_multipart_upload_whose_parts_stall_is_stopped_at_the_deadline(s3_server, monkeypatch):
    """moto behind the fault-injecting proxy: every part but one is held (never answered), with
    botocore's own timeouts at their 60 s defaults. The save fails at the deadline, aborts its
    upload (under the deadline too) and leaves the previous object verifying."""
    import s3fs
    from s3_support import BUCKET, NO_RETRIES, options, stall_after_one_part

    from tensorcanon.io import remote

    port, proxy = s3_server
    proxy.reset()
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    monkeypatch.setattr(remote, "PART", 5 << 20)
    direct = options(port)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/big.safetensors"
    old = tc.save({"w": torch.arange(5.0)}, url, storage_options=direct)
    proxied = options(proxy.port, config_kwargs=NO_RETRIES, tensorcanon_deadline=2)
    proxy.fault = stall_after_one_part
    state = {f"layer{i}": torch.full((256, 1024), float(i)) for i in range(12)}  # 12 MiB: 3 parts
    try:
        e = within(BOUND_S, lambda: tc.save(state, url, storage_options=proxied))
    finally:
        proxy.reset()
    assert isinstance(e, tc.FileAccessError) and "within the deadline of 2 s" in str(e), repr(e)
    assert "previous object there, if any, is unchanged" in str(e)
    # (the message shows tensorcanon's deadline stopped it, not botocore's own 60 s per held part)
    assert tc.verify(url, storage_options=direct) == old
    fs = s3fs.S3FileSystem(**direct, skip_instance_cache=True)
    prefix = url.split(f"{BUCKET}/", 1)[1].split("/", 1)[0]
    assert fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix).get("Uploads", []) == []


def test_an_unreachable_http_store_is_not_a_missing_object(lies):
    """fsspec's http filesystem reports a server it cannot reach as a missing file; tensorcanon says
    what happened (a FileAccessError, not a MissingFileError), and a real 404 stays 'no such object'."""
    from support import free_port

    with pytest.raises(tc.FileAccessError, match="could not be reached") as e:
        tc.load(f"http://user:{'pw-SECRET'}@127.0.0.1:{free_port()}/x.safetensors")
    assert not isinstance(e.value, tc.MissingFileError) and "pw-SECRET" not in str(e.value)
    with pytest.raises(tc.MissingFileError, match="no such object"):
        tc.load(lies.http("nothing.safetensors"))


def ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_an_ipv6_host_is_one_url_not_a_chain():
    """fsspec reads '::' as the joint of a chained URL, so http://[::1]:8000/x was opened as the
    chain 'http://[' + '1]:8000/x' (every read a 'no such object'). A URL whose every '::' is in
    brackets is one URL; on a machine with IPv6, the lying store on [::1] is read, lies refused."""
    from tensorcanon.io import storage

    for url in ("http://[::1]:9/lies/a.safetensors", "http://user:pw@[fe80::1]:9/a.safetensors?sig=x"):
        _, path = storage.open_store(url)
        assert path == url
    _, path = storage.open_store("simplecache::memory://x/a.safetensors")
    assert path.endswith("x/a.safetensors")  # a real chain is still a chain
    if not ipv6_loopback():  # (this machine has no IPv6: the parsing above is the rule tested)
        return
    with LyingStore("::1") as store:
        store.put("a.safetensors", small())
        store.put("claim.safetensors", small(), claim=TB)
        assert tc.load(store.http("a.safetensors"))["step"] == 3
        assert tc.load("s3://lies/a.safetensors", storage_options=store.options())["step"] == 3
        with pytest.raises(tc.FormatError, match="ends before"):
            tc.load(store.http("claim.safetensors"))
