"""Red-team attacks on object storage (docs/STORAGE.md "What a store may say", docs/SECURITY.md
"Object storage: a store's answers are input too").

A hostile HTTP store of this file's own on 127.0.0.1 serves a valid tensorcanon file and lies in
ways the docs bound: answers longer than the range asked (streamed, chunked, compressed), odd
Content-Length texts, huge claimed sizes. Each read runs in a subprocess with a wall-clock
timeout and reports its peak memory growth, so a hang or an unbounded read fails the test.
"""

from __future__ import annotations

import gzip
import http.server
import json
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import tensorcanon

MiB = 1 << 20


def _file_bytes() -> bytes:
    return tensorcanon.dumps({"w": np.arange(64 * 1024, dtype=np.float32)})  # 256 KiB of data


def _gzip_bomb(n: int) -> bytes:
    import io

    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as g:
        chunk = b"\0" * MiB
        for _ in range(n // MiB):
            g.write(chunk)
    return buf.getvalue()


class Hostile:
    """Serves DATA at /b/x.safetensors. ``mode`` picks the lie told to ranged GETs."""

    def __init__(self, data: bytes, mode: str, arg=None):
        self.data, self.mode, self.arg = data, mode, arg
        self.requests: list[tuple[str, str, str | None]] = []
        self.stop = threading.Event()
        srv = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _missing(self):
                if self.path.split("?")[0] == "/b/x.safetensors":
                    return False
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True

            def do_HEAD(self):
                srv.requests.append(("HEAD", self.path, None))
                if self._missing():
                    return
                self.send_response(200)
                size = srv.arg if srv.mode == "head_length" else str(len(srv.data))
                self.send_header("Content-Length", size)
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()

            def do_GET(self):
                rng = self.headers.get("Range")
                srv.requests.append(("GET", self.path, rng))
                if self._missing():
                    return
                m = re.match(r"bytes=(\d+)-(\d*)", rng or "")
                start = int(m.group(1)) if m else 0
                stop = int(m.group(2)) + 1 if m and m.group(2) else len(srv.data)
                want = srv.data[start:stop]
                try:
                    if srv.mode == "stream_200":  # ignore Range: 200 and an endless body, no length
                        self.send_response(200)
                        self.send_header("Connection", "close")
                        self.end_headers()
                        self._endless()
                    elif srv.mode == "chunked_206":  # 206, chunked, far more than asked
                        self.send_response(206)
                        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(srv.data)}")
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        block = b"\0" * (64 * 1024)
                        for _ in range(srv.arg // len(block)):
                            if srv.stop.is_set():
                                return
                            self.wfile.write(b"%x\r\n" % len(block) + block + b"\r\n")
                        self.wfile.write(b"0\r\n\r\n")
                    elif srv.mode == "gzip_206":  # a compressed answer, whatever was asked
                        body = srv.arg
                        self.send_response(206)
                        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(srv.data)}")
                        self.send_header("Content-Encoding", "gzip")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                    elif srv.mode == "get_length":  # a ranged answer whose Content-Length text lies
                        self.send_response(206)
                        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(srv.data)}")
                        self.send_header("Content-Length", srv.arg)
                        self.send_header("Connection", "close")
                        self.end_headers()
                        self.wfile.write(want)
                    else:  # honest, or head_length
                        self.send_response(206 if m else 200)
                        if m:
                            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(srv.data)}")
                        self.send_header("Content-Length", str(len(want)))
                        self.end_headers()
                        self.wfile.write(want)
                except (BrokenPipeError, ConnectionResetError):
                    return

            def _endless(self):
                block = b"\0" * (64 * 1024)
                for _ in range(srv.arg // len(block)):
                    if srv.stop.is_set():
                        return
                    self.wfile.write(block)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/b/x.safetensors"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


READER = textwrap.dedent("""
    import json, resource, sys, tensorcanon
    from tensorcanon.format.errors import TensorCanonError
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    try:
        tensorcanon.verify(sys.argv[1], storage_options={"tensorcanon_deadline": 20})
        out["result"] = "ok"
    except TensorCanonError as e:
        out["result"] = "tc:" + type(e).__name__ + ": " + str(e)[:300]
    except BaseException as e:
        out["result"] = "foreign:" + type(e).__name__ + ": " + str(e)[:300]
    out["grew_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps(out))
""")


def _read(url, timeout=90):
    try:
        proc = subprocess.run([sys.executable, "-c", READER, url], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {url} from a hostile store ran past {timeout} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def data():
    return _file_bytes()


def test_honest_store_control(data):
    """The harness itself: an honest answer verifies (so the lies below are what fail)."""
    s = Hostile(data, "honest")
    try:
        assert _read(s.url)["result"] == "ok"
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["stream_200", "chunked_206"])
def test_an_answer_longer_than_asked_is_not_held(data, mode):
    s = Hostile(data, mode, 512 * MiB)
    try:
        r = _read(s.url)
    finally:
        s.close()
    assert r["result"].startswith("tc:"), r
    assert r["grew_mib"] < 64, r


def test_a_compressed_answer_is_not_inflated(data):
    """A store that sends Content-Encoding: gzip whatever was asked: 512 MiB of zeros in ~0.5 MiB.
    Decompressing it would hold the bomb; the documented bound is what was asked, plus one byte."""
    s = Hostile(data, "gzip_206", _gzip_bomb(512 * MiB))
    try:
        r = _read(s.url)
    finally:
        s.close()
    assert r["result"].startswith("tc:"), r
    assert r["grew_mib"] < 64, r


@pytest.mark.parametrize("text", ["+100", "1e3", "0x10", "-1", "9" * 5000, " 100 ", "100, 100", "١٠٠"])
def test_odd_content_length_texts_are_tensorcanon_errors(data, text):
    s = Hostile(data, "get_length", text)
    try:
        r = _read(s.url, timeout=60)
    finally:
        s.close()
    assert not r["result"].startswith("foreign:"), r


@pytest.mark.parametrize("text", ["9" * 25, "-5", "1e12", "١٠٠", "18446744073709551616"])
def test_odd_head_sizes_are_tensorcanon_errors(data, text):
    s = Hostile(data, "head_length", text)
    try:
        r = _read(s.url, timeout=60)
    finally:
        s.close()
    assert not r["result"].startswith("foreign:"), r
    assert r["grew_mib"] < 64, r


def test_cli_verify_of_a_hostile_store_is_exit_2_without_traceback(data):
    s = Hostile(data, "stream_200", 64 * MiB)
    try:
        proc = subprocess.run([sys.executable, "-m", "tensorcanon", "verify", s.url], capture_output=True,
                              text=True, timeout=90)
    finally:
        s.close()
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "please report" not in proc.stderr.lower(), proc.stderr


# -- credentials against moto's S3 --------------------------------------------------------------

SECRET = "Zq9SuperSecretPw"


@pytest.mark.parametrize("url", [
    "s3://AKIAEXAMPLE:{s}@tensorcanon-test/missing.safetensors",
    "s3://tensorcanon-test/missing.safetensors?X-Amz-Security-Token={s}",
    "s3://AKIAEXAMPLE:{s}@tensorcanon-test/ckpt/",
    "s3://AKIAEXAMPLE:{s}@tensorcanon-test/ckpt/x.safetensors",
])
def test_s3_urls_with_credentials_show_no_secret(s3_server, url):
    import os

    env = dict(os.environ)
    port, _ = s3_server
    env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
                "AWS_DEFAULT_REGION": "us-east-1"})
    for argv in (["verify", url.format(s=SECRET)], ["hash", url.format(s=SECRET)],
                 ["inspect", url.format(s=SECRET)]):
        proc = subprocess.run([sys.executable, "-m", "tensorcanon", *argv], capture_output=True, text=True,
                              timeout=90, env=env)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr[-2000:])
        assert SECRET not in proc.stdout + proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_store_key_with_a_line_break_cannot_forge_lockfile_lines(tmp_path):
    """A bucket listing (the tests' lying S3 store) holding a key with a line break and a forged
    entry after it: `lock` of the prefix must refuse it, or write exactly one line per object."""
    from lying_store import LyingStore

    from tensorcanon.format.errors import TensorCanonError
    from tensorcanon.tools import lockfile

    data = _file_bytes()
    forged = "p/b.safetensors\nxxh3-128:" + "0" * 32 + " 96 evil.safetensors"
    lock = tmp_path / "n.lock"
    with LyingStore() as store:
        store.put("p/a.safetensors", data)
        store.put(forged, data)
        try:
            entries = lockfile.make_lock(["s3://lies/p/"], lock, storage_options=store.options())
        except TensorCanonError:
            return
    lockfile.write_lock(entries, lock)
    assert len(lockfile.read_lock(lock)) == 2
