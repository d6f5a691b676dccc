"""The S3 test server's pieces, shared by tests/test_remote_s3.py and tests/dcp/test_remote_dcp.py:
a proxy that injects faults, and the names the session's server uses (the ``s3_server`` fixture,
one per session, is in tests/conftest.py)."""

import http.client
import http.server
import signal
import socket
import threading
import time
import urllib.parse

SECRET = "SECRETtestingKEY0123456789"
BUCKET = "tensorcanon-test"
def options(port, **more):
    """s3fs storage options reaching an S3 endpoint on 127.0.0.1:``port`` with the test credentials."""
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": SECRET, **more}


HOLD_S = 120  # the longest a held request waits for release(): only a test that never releases it


class Proxy:
    """An HTTP proxy to the S3 server that counts requests and injects faults.

    ``fault(method, path, query) -> None | int | "drop" | "hold"``: None forwards the request; an
    int answers with that status (an S3 error document); "drop" closes the connection without an
    answer (a server that went away); "hold" answers nothing until :meth:`release` or
    :meth:`reset` (a server that answers too late, or an upload stuck part way), then forwards.
    Holding waits on an event, not a clock: a client sees no answer for as long as the test says.
    """

    def __init__(self, upstream_port):
        self.upstream = upstream_port
        self.fault = lambda method, path, query: None
        self.requests = []        # (method, path, query)
        self.bytes_out = 0        # body bytes of the answers to GETs of objects
        self.lock = threading.Lock()
        self.released = threading.Event()  # what held requests wait for; a new one after each release
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_any(self):
                path, _, query = self.path.partition("?")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.requests.append((self.command, path, query))
                    released = proxy.released
                action = proxy.fault(self.command, path, query)
                if action == "hold":
                    released.wait(HOLD_S)
                    action = None
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(action, int):
                    doc = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
                           b"<Message>injected failure</Message></Error>")
                    self.send_response(action)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(doc)))
                    self.end_headers()
                    self.wfile.write(doc)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                if self.command == "GET" and path.count("/") >= 2:
                    with proxy.lock:
                        proxy.bytes_out += len(data)
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_any

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that gave up (a timeout test) leaves a broken pipe here: expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def release(self):
        """Let every held request go on (forwarded, whoever still waits for the answer)."""
        with self.lock:
            self.released.set()
            self.released = threading.Event()

    def reset(self):
        self.fault = lambda method, path, query: None
        self.release()
        with self.lock:
            self.requests.clear()
            self.bytes_out = 0

    def count(self, method, marker):
        with self.lock:
            return sum(1 for m, _, q in self.requests if m == method and marker in q)

    def parts(self, url):
        """How many part uploads (``PUT ...?partNumber=``) have reached the proxy for the object
        ``url`` (``s3://bucket/key``) or for objects under it as a directory."""
        key = "/" + url.split("://", 1)[1].rstrip("/")
        with self.lock:
            return sum(1 for m, p, q in self.requests
                       if m == "PUT" and (p == key or p.startswith(key + "/")) and part_number(q) is not None)


def part_number(query):
    """The ``partNumber`` of a request's query string, or None."""
    n = urllib.parse.parse_qs(query).get("partNumber")
    return int(n[0]) if n else None


def stall_after_one_part(method, path, query):
    """A Proxy fault: of each multipart upload the first part sent goes through (number 2: number
    1, which holds the header, is sent last) and every other part is held, so the upload cannot
    finish before the test releases them."""
    n = part_number(query)
    return "hold" if n is not None and n != 2 else None


def kill_mid_upload(proxy, procs, timeout=90.0):
    """SIGKILL each writer process of ``procs`` (``{url: subprocess.Popen}``, run with the fault
    :func:`stall_after_one_part` in place) once two parts of its upload have reached the proxy: one
    sent, one held, so the kill lands mid-upload whatever the timing. A writer must not have printed
    "saved". ``timeout`` only bounds a wait for a writer that hangs before it uploads.
    """
    deadline = time.monotonic() + timeout
    while any(proxy.parts(u) < 2 and p.poll() is None for u, p in procs.items()) and time.monotonic() < deadline:
        time.sleep(0.05)  # how often to look; the holds decide where the kill lands
    for url, proc in procs.items():
        proc.send_signal(signal.SIGKILL)  # (nothing, where it has ended)
        out, err = proc.communicate()
        tail = err.decode(errors="replace")[-2000:]
        assert proxy.parts(url) >= 2, f"{url}: the writer never got to its second part\n{tail}"
        assert b"saved" not in out, tail


# Through the proxy: no retries by botocore, so that each fault is seen at once; botocore's own
# timeouts (60 s), which a slow or loaded machine does not reach.
NO_RETRIES = {"retries": {"max_attempts": 1, "mode": "standard"}}
# For the faults themselves: also a short read timeout, for a server that answers too late. The
# proxy's "hold" sends no answer until the test releases it, so the timeout fires however fast or
# slow the machine is; an ordinary answer that takes longer (a loaded machine) is retried by
# s3fs, which a fault test also accepts.
FAST_FAIL = {"connect_timeout": 2, "read_timeout": 0.5, **NO_RETRIES}
