"""Attacks on object storage's messages: no credential of a URL in any message, CLI output or lockfile.

A URL's password (also where ``urllib.parse.urlsplit`` cannot parse the URL) and a presigned URL's
signature and credential are hidden by one function (format/redact.py) that every error of the
library goes through when it is made, so a message built anywhere (a store's exception text
passed on, a URL put in an f-string) cannot show one. The fast tier: no server (the lying server's
and moto's attacks are in test_storage_attacks.py).
"""

import contextlib
import io
import pickle
import sys

import fsspec
import pytest
import torch

import tensorcanon as tc
from tensorcanon.format.errors import FileAccessError, FormatError, TensorCanonError
from tensorcanon.format.redact import redact
from tensorcanon.io import storage
from tensorcanon.tools import cli

PASSWORD = "pa/ss[wo#rd"  # "/" and "[" and "#": urlsplit mis-reads or refuses such a URL
SIGNATURE = "SIGsecret0123456789abcdef"
CREDENTIAL = "AKIDSECRET%2F20260101%2Fus-east-1"
SECRETS = ("pa/ss", "wo#rd", "SIGsecret", "AKIDSECRET", "TOKENsecret")

# The URL forms an attacker or an unlucky user writes, each with a secret in it.
URLS = [
    f"https://user:{PASSWORD}@127.0.0.1:9/model.safetensors",
    f"s3://AKID:{PASSWORD}@bucket/model.safetensors",
    f"http://user:{PASSWORD}@[::1/model.safetensors",  # an IPv6 host urlsplit refuses
    "https://user:p@ss@127.0.0.1:9/x",  # an "@" in the password
    f"https://127.0.0.1:9/k.safetensors?X-Amz-Algorithm=AWS4&X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={SIGNATURE}",
    f"https://127.0.0.1:9/k?X%2DAmz%2DSignature={SIGNATURE}&x-amz-security-token=TOKENsecret",  # percent-encoded name
    f"https://127.0.0.1:9/k?Signature={SIGNATURE}&Expires=1&GoogleAccessId=a",
    f"https://127.0.0.1:9/k?X-Goog-Signature={SIGNATURE}",
    f"https://127.0.0.1:9/c/k?sv=2020&sig={SIGNATURE}",
    "https://TOKENsecret@127.0.0.1:9/k.safetensors",  # a token as the user name
    f"simplecache::s3://AKID:{PASSWORD}@bucket/k",
    f"memory://user:{PASSWORD}@bucket/x.safetensors",
]


def leaked(text):
    return [s for s in SECRETS if s in text]


@pytest.mark.parametrize("url", URLS)
def test_redact_hides_every_form(url):
    shown = redact(url)
    assert not leaked(shown), shown
    assert "***" in shown
    assert redact(shown) == shown  # hiding is stable: shown text is never hidden further


def test_text_without_credentials_is_unchanged():
    for text in ("/data/token=abc/model.safetensors", "s3://bucket/user@example.com/file.safetensors",
                 "https://[::1]:80/a@b", "memory:///a/b", 'expect=xxh3-128:00 $["key"]', "sort_keys=True",
                 "s3://bucket/k?versionId=3", "file digest is sha256:ab, expected sha256:cd"):
        assert redact(text) == text


def test_every_error_hides_what_its_message_names():
    """A message built with a URL in it, by any code: the error itself hides the secrets (and
    keeps them hidden through pickling, as DCP sends errors between ranks)."""
    for cls in (TensorCanonError, FormatError, tc.UsageError, tc.IntegrityError):
        for url in URLS:
            e = cls(f"cannot read {url!r}: damaged")
            assert not leaked(str(e)) and not leaked(repr(e)), (cls, str(e))
            back = pickle.loads(pickle.dumps(e))
            assert not leaked(str(back)) and type(back) is cls
    e = FileAccessError(f"cannot read {URLS[0]}", filename=URLS[0])
    assert not leaked(str(e)) and not leaked(e.filename)
    assert not leaked(pickle.loads(pickle.dumps(e)).filename)


def test_a_stores_exception_text_is_hidden():
    """A store's own exception names the presigned URL it asked (aiohttp, botocore do): passed on
    through Store.error, hidden; also when the text is longer than what is kept of it."""
    store = storage.Store(fsspec.filesystem("memory"), {})
    for url in URLS:
        raw = OSError(f"403, message='Forbidden', url=URL('{url}')")
        err = store.error(raw, "read", "/bucket/k")
        assert not leaked(str(err)), str(err)
        long = OSError("x" * 290 + f" {url}")  # cut at 300 characters: hidden before the cut
        assert not leaked(str(store.error(long, "read", "/bucket/k")))


@pytest.mark.parametrize("url", [u for u in URLS if u.startswith(("https://", "http://", "memory://"))])
def test_load_verify_open_errors_hold_no_secret(url):
    for call in (lambda: tc.load(url), lambda: tc.verify(url), lambda: tc.read_metadata(url),
                 lambda: tc.open(url).close()):
        with pytest.raises(TensorCanonError) as e:
            call()
        assert not leaked(str(e.value)) and not leaked(repr(e.value)), str(e.value)


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("url", [u for u in URLS if u.startswith(("https://", "http://", "memory://"))])
def test_cli_output_and_lockfiles_hold_no_secret(url, tmp_path):
    for argv in (["verify", url], ["verify", "--json", url], ["hash", url], ["hash", "--json", url],
                 ["inspect", url], ["verify", "--expect", tc.fingerprint({"a": 1}), url]):
        code, out, err = run_cli(*argv)
        assert code == 2, (argv, out, err)
        assert not leaked(out + err), (argv, out + err)
    lock = tmp_path / "t.lock"
    code, out, err = run_cli("lock", url, "-o", str(lock))
    assert code == 2 and not leaked(out + err), out + err
    assert not lock.exists() or not leaked(lock.read_text())


def test_a_lockfile_never_records_an_unparseable_url_with_a_password(tmp_path):
    """The lockfile's refusal rests on redact: a URL that urlsplit cannot parse is refused too."""
    from tensorcanon import lockfile

    for url in URLS[:4]:
        with pytest.raises(tc.UsageError) as e:
            lockfile.make_lock([url], tmp_path / "t.lock")
        assert not leaked(str(e.value))


def test_a_saved_object_reachable_by_a_url_with_a_password_names_it_hidden():
    """memory:// ignores the user info: a real object, read through a URL holding a password; its
    damage error names it with the password hidden."""
    url = f"memory://user:{PASSWORD}@tc-secret-bucket/x.safetensors"
    fs = fsspec.filesystem("memory")
    try:
        tc.save({"w": torch.arange(4.0)}, url)
        path = next(p for p in fs.find("/") if p.endswith("x.safetensors") and "tc-secret-bucket" in p)
        data = bytearray(fs.cat_file(path))
        data[-1] ^= 1
        fs.pipe_file(path, bytes(data))
        with pytest.raises(tc.IntegrityError) as e:
            tc.verify(url)
        assert not leaked(str(e.value)) and "***" in str(e.value)
    finally:
        for p in fs.find("/"):
            if "tc-secret-bucket" in p:
                fs.rm_file(p)
    assert sys.modules["tensorcanon"] is tc


def test_check_of_a_lockfile_holding_a_password_shows_it_hidden(tmp_path):
    """A lockfile written by hand (or by an older tensorcanon) with a password in a URL line:
    `check` names the entry on stdout, in text and JSON, with the password hidden."""
    from tensorcanon import lockfile

    url = "memory://tc-lock-secret/a.safetensors"
    tc.save({"w": torch.ones(2)}, url)
    lock = tmp_path / "t.lock"
    try:
        lockfile.write_lock(lockfile.make_lock([url], lock), lock)
        text = lock.read_text().replace(url, f"memory://user:{PASSWORD}@tc-lock-secret/a.safetensors")
        lock.write_text(text)
        for argv in (["check", str(lock)], ["check", "--json", str(lock)]):
            code, out, err = run_cli(*argv)
            assert code in (1, 2) and "user:***@" in out + err, out + err
            assert not leaked(out + err), out + err
    finally:
        fsspec.filesystem("memory").rm("/tc-lock-secret", recursive=True)
