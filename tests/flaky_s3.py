"""An S3 endpoint that misbehaves as busy object stores do: a proxy on loopback in front of a real S3 server
(moto's) that answers a seeded share of requests with 503 SlowDown, or applies them and drops the answer (the
client sees the connection close; the write happened). A request that failed goes through when the client sends
it again, so every failure is one a client's retry fixes."""

from __future__ import annotations

import http.client
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')


class FlakyS3:
    """:param upstream: the real server's URL.
    :param rate: the share of requests that fail, half with a 503 and half with a dropped answer.
    :param seed: seeds which ones."""

    def __init__(self, upstream: str, *, rate: float, seed: int = 0) -> None:
        self.upstream = urlsplit(upstream)
        self.rate, self.random, self.lock = rate, random.Random(seed), threading.Lock()
        self.counts = {"requests": 0, "slow_down": 0, "dropped": 0}
        self.failed: set[tuple[str, str]] = set()  # requests whose retry goes through
        self.drops: list[str] = []  # methods whose next request is applied and its answer dropped (drop_next)
        self.refusals: list[tuple[str, str]] = []  # (method, part of the path): one per request to refuse (fail_next)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyS3:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def drop_next(self, method: str) -> None:
        """The next `method` request (PUT, ...) is applied and its answer dropped, whatever the rate says."""
        with self.lock:
            self.drops.append(method)

    def fail_next(self, method: str, times: int, *, path_part: str = "") -> None:
        """The next `times` requests of `method` (any, if "") whose path holds `path_part` are answered 503
        SlowDown, their retries included: more than the client retries, the request fails."""
        with self.lock:
            self.refusals += [(method, path_part)] * times

    def _fate(self, key: tuple[str, str]) -> str:
        with self.lock:
            self.counts["requests"] += 1
            refusal = next(((m, part) for m, part in self.refusals if m in ("", key[0]) and part in key[1]), None)
            if refusal is not None:
                self.refusals.remove(refusal)
                self.counts["slow_down"] += 1
                return "slow_down"
            if key in self.failed:
                self.failed.discard(key)
                return "pass"
            if key[0] in self.drops:
                self.drops.remove(key[0])
                self.failed.add(key)
                self.counts["dropped"] += 1
                return "dropped"
            draw = self.random.random()
            if draw >= self.rate:
                return "pass"
            self.failed.add(key)
            fate = "slow_down" if draw < self.rate / 2 else "dropped"
            self.counts[fate] += 1
            return fate

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        body = _body(request)
        fate = self._fate((request.command, request.path))
        if fate == "slow_down":
            request.send_response(503)
            request.send_header("Content-Type", "application/xml")
            request.send_header("Content-Length", str(len(SLOW_DOWN)))
            request.end_headers()
            if request.command != "HEAD":  # a HEAD answer has no body: its bytes would be read as the next answer
                request.wfile.write(SLOW_DOWN)
            return
        connection = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length")}
            headers["Content-Length"] = str(len(body))
            connection.request(request.command, request.path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        finally:
            connection.close()
        if fate == "dropped":  # the request was applied; its answer never arrives
            request.close_connection = True
            return
        request.send_response(response.status, response.reason)
        head = request.command == "HEAD"  # its Content-Length is the object's, and it has no body
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "keep-alive", "transfer-encoding", "date", "server") and (
                    head or key.lower() != "content-length"):
                request.send_header(key, value)
        if not head:
            request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        if not head:
            request.wfile.write(payload)


def _body(request: BaseHTTPRequestHandler) -> bytes:
    """The request's body, sent with a Content-Length or in chunks (forwarded with a Content-Length)."""
    if "chunked" in (request.headers.get("Transfer-Encoding") or "").lower():
        parts = []
        while True:
            size = int(request.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while request.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            parts.append(request.rfile.read(size))
            request.rfile.readline()  # the chunk's CRLF
    length = int(request.headers.get("Content-Length") or 0)
    return request.rfile.read(length) if length else b""
