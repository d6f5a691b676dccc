"""The S3 test server's pieces, shared by tests/test_remote_s3.py and tests/dcp/test_remote_dcp.py:
a proxy that injects faults, and the names the session's server uses (the ``s3_server`` fixture,
one per session, is in tests/conftest.py)."""

import http.client
import http.server
import socket
import threading
import time

SECRET = "SECRETtestingKEY0123456789"
BUCKET = "tensorcanon-test"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """An HTTP proxy to the S3 server that counts requests and injects faults.

    ``fault(method, path, query) -> None | int | "drop" | ("delay", seconds)``: None forwards the
    request; an int answers with that status (an S3 error document); "drop" closes the connection
    without an answer (a server that went away); ("delay", s) waits, then forwards.
    """

    def __init__(self, upstream_port):
        self.upstream = upstream_port
        self.fault = lambda method, path, query: None
        self.requests = []        # (method, path, query)
        self.bytes_out = 0        # body bytes of the answers to GETs of objects
        self.lock = threading.Lock()
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
                action = proxy.fault(self.command, path, query)
                if isinstance(action, tuple) and action[0] == "delay":
                    time.sleep(action[1])
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

    def reset(self):
        self.fault = lambda method, path, query: None
        with self.lock:
            self.requests.clear()
            self.bytes_out = 0

    def count(self, method, marker):
        with self.lock:
            return sum(1 for m, _, q in self.requests if m == method and marker in q)


# Through the proxy: no retries by botocore, short timeouts, so that each fault is seen at once.
FAST_FAIL = {"connect_timeout": 2, "read_timeout": 0.5, "retries": {"max_attempts": 1, "mode": "standard"}}
