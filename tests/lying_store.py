"""A small lying object store of the tests' own, on 127.0.0.1: enough of S3 (path-style) and of
plain HTTP for s3fs and fsspec's http filesystem to read objects from it, and the lies a hostile
or broken store tells (tests/attacks/test_storage_attacks.py).

``LyingStore.put(name, data, **lies)`` serves ``data`` at ``/bucket/name`` (``s3://bucket/name``
or ``http://127.0.0.1:PORT/bucket/name``), with any of these lies:

- ``claim=N``: HEAD (and listings) say the object holds N bytes;
- ``extra=N``: a ranged GET is answered with N more bytes than asked (Content-Length says so; the
  bytes are streamed, so the server itself holds little of them); ``short=N``: with N fewer;
  ``length=TEXT``: its Content-Length header says TEXT, whatever is sent;
- ``trickle=B``: every answer to a request for this object (headers and body) is sent at B bytes
  a second;
- ``stall=True``: requests for it are never answered (until the server stops); ``stall_ranges=True``:
  ranged GETs only;
- ``shift=N``: a ranged GET is answered with the right number of bytes, from N bytes further on
  (``Content-Range`` says so).

Every request is counted (``requests``). A slow answer gives up by itself after ``GIVE_UP_S``
(or when the server stops), so no test can leave a thread running: the server stops at the end
of its ``with`` block.
"""

import email.utils
import hashlib
import http.server
import re
import socket
import threading
import time
import urllib.parse

GIVE_UP_S = 20.0  # the longest a trickled or stalled answer goes on: far past every test's deadline
BUCKET = "lies"


class LyingStore:
    def __init__(self, host="127.0.0.1"):
        self.host = host
        self.objects = {}  # name -> (data, lies)
        self.requests = []  # (method, path, Range header)
        self.uploads = []  # PUT paths that were answered
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def answer(self, status, headers, body=b"", lies=None):
                lies = lies or {}
                head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"]
                head += [f"{k}: {v}\r\n" for k, v in headers.items()]
                head.append("\r\n")
                raw = "".join(head).encode() + (body if self.command != "HEAD" else b"")
                rate = lies.get("trickle")
                if not rate:
                    self.wfile.write(raw)
                    zeros, piece = lies.get("pad", 0), bytes(1 << 16)
                    while zeros > 0 and not store.stopping.is_set():  # streamed: the server holds 64 KiB
                        self.wfile.write(piece[:zeros])
                        zeros -= len(piece)
                    return
                give_up = time.monotonic() + GIVE_UP_S
                for i in range(0, len(raw), max(1, int(rate))):
                    if store.stopping.wait(1.0) or time.monotonic() > give_up:
                        return
                    self.wfile.write(raw[i:i + max(1, int(rate))])
                    self.wfile.flush()

            def handle_any(self):
                url = urllib.parse.urlsplit(self.path)
                path = urllib.parse.unquote(url.path)
                query = urllib.parse.parse_qs(url.query)
                with store.lock:
                    store.requests.append((self.command, path, self.headers.get("Range")))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = path.lstrip("/").split("/", 1)
                if len(parts) == 1 or not parts[1]:  # the bucket: a listing, or a bucket lookup
                    return self.listing(query)
                name = parts[1]
                found = store.objects.get(name)
                lies = found[1] if found else {}
                if lies.get("stall"):
                    store.stopping.wait(GIVE_UP_S)
                    self.close_connection = True
                    return
                if self.command == "PUT":
                    with store.lock:
                        store.uploads.append(path)
                    store.objects[name] = (body, dict(lies))
                    return self.answer(200, {"ETag": f'"{hashlib.md5(body).hexdigest()}"',
                                             "Content-Length": "0"}, lies=lies)
                if found is None:
                    doc = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>no</Message></Error>"
                    return self.answer(404, {"Content-Type": "application/xml",
                                             "Content-Length": str(len(doc) if self.command != "HEAD" else 0)}, doc)
                data = found[0]
                size = lies.get("claim", len(data))
                common = {"ETag": f'"{hashlib.md5(data).hexdigest()}"', "Accept-Ranges": "bytes",
                          "Last-Modified": email.utils.formatdate(0, usegmt=True),
                          "Content-Type": "application/octet-stream"}
                rng = self.headers.get("Range")
                if self.command == "HEAD":
                    return self.answer(200, {**common, "Content-Length": str(size)}, lies=lies)
                m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
                if not m:
                    return self.answer(200, {**common, "Content-Length": str(len(data))}, data, lies)
                if lies.get("stall_ranges"):  # HEAD answered, ranged reads never
                    store.stopping.wait(GIVE_UP_S)
                    self.close_connection = True
                    return
                start, end = int(m.group(1)), int(m.group(2)) + 1
                if start >= len(data):
                    return self.answer(416, {"Content-Length": "0", "Content-Range": f"bytes */{size}"}, lies=lies)
                start += lies.get("shift", 0)
                end += lies.get("shift", 0)
                chunk = data[start:end][:max(0, end - start - lies.get("short", 0))]
                n = len(chunk) + lies.get("extra", 0)
                length = lies.get("length", n)  # what Content-Length says (a lie of its own)
                return self.answer(206, {**common, "Content-Length": str(length),
                                         "Content-Range": f"bytes {start}-{start + n - 1}/{size}"},
                                   chunk, {**lies, "pad": lies.get("extra", 0)})

            def listing(self, query):
                prefix = query.get("prefix", [""])[0]
                keys = "".join(f"<Contents><Key>{k}</Key><Size>{v[1].get('claim', len(v[0]))}</Size>"
                               f"<ETag>\"x\"</ETag><LastModified>2020-01-01T00:00:00.000Z</LastModified>"
                               f"<StorageClass>STANDARD</StorageClass></Contents>"
                               for k, v in sorted(store.objects.items()) if k.startswith(prefix))
                doc = (f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>{BUCKET}</Name>"
                       f"<Prefix>{prefix}</Prefix><KeyCount>{keys.count('<Key>')}</KeyCount><MaxKeys>1000</MaxKeys>"
                       f"<IsTruncated>false</IsTruncated>{keys}</ListBucketResult>").encode()
                self.answer(200, {"Content-Type": "application/xml", "Content-Length": str(len(doc))}, doc)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_any

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def handle_error(self, request, client_address):
                pass  # a client that gave up (a deadline test) leaves a broken pipe here: expected

        self.server = Server((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def put(self, name, data, **lies):
        self.objects[name] = (bytes(data), lies)
        return f"s3://{BUCKET}/{name}"

    @property
    def netloc(self):
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def http(self, name):
        return f"http://{self.netloc}/{BUCKET}/{name}"

    def options(self, **more):
        """s3fs options reaching this server (no retries by botocore: each lie is seen at once)."""
        return {"endpoint_url": f"http://{self.netloc}", "key": "testing", "secret": "SECRETlyingKEY",
                "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}},
                "skip_instance_cache": True, **more}

    def count(self, method):
        with self.lock:
            return sum(1 for m, _, _ in self.requests if m == method)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
        with socket.socket(self.server.address_family) as s:  # nothing of the server is left listening
            s.settimeout(1)
            assert s.connect_ex((self.host, self.port)) != 0
