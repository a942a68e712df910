"""An HTTP/1.1 reverse proxy on 127.0.0.1 that injects S3-style faults.

Requests are forwarded byte-for-byte (method, target, all headers including
Host), so SigV4 signatures made for the proxy's address still validate at the
target.  Per request the proxy either answers ``503 SlowDown``, drops the
connection (before forwarding, with a TCP RST; or after forwarding, part-way
through the response body or, for a response without body, before any of it),
or forwards it.  The choice is seeded and made per (method, path, n-th time
seen), so it does not depend on how concurrent requests interleave.  Every
response carries ``Connection: close``; request bodies may be sized or chunked,
and ``Expect: 100-continue`` is honoured.
"""

from __future__ import annotations

import http.client
import io
import random
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

HOST = "127.0.0.1"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}
_CODES = {502: "BadGateway", 403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}
_BLOCK = 64 * 1024


def s3_error_body(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>faultproxy</RequestId></Error>"
    ).encode()


class Bandwidth:
    """One token bucket shared by every connection through the proxy: a link of ``bytes_per_s`` (a share of the
    network to an object store), both directions together."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


def _copy_exact(src: io.BufferedIOBase, dst: socket.socket, length: int, link: Bandwidth | None = None) -> None:
    while length > 0:
        data = src.read(min(_BLOCK, length))
        if not data:
            raise ConnectionError("client closed while sending the request body")
        if link is not None:
            link.take(len(data))
        dst.sendall(data)
        length -= len(data)


def _copy_chunked(src: io.BufferedIOBase, dst: socket.socket, link: Bandwidth | None = None) -> None:
    """Relay a chunked body verbatim (sizes, extensions, trailers)."""
    while True:
        line = src.readline(1024)
        dst.sendall(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, up to the empty line
                trailer = src.readline(8192)
                dst.sendall(trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return
        _copy_exact(src, dst, size + 2, link)  # data and its CRLF


class FaultProxy:
    """Reverse proxy to ``target_host:target_port`` with seeded fault injection."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        error_rate: float = 0.2,
        drop_rate: float = 0.1,
        seed: int = 0,
        timeout: float = 30.0,
        bytes_per_s: float | None = None,
    ) -> None:
        if error_rate < 0 or drop_rate < 0 or error_rate + drop_rate > 1:
            raise ValueError("need 0 <= error_rate, drop_rate and error_rate + drop_rate <= 1")
        self.target = (target_host, target_port)
        self.error_rate = error_rate
        self.drop_rate = drop_rate
        self.timeout = timeout
        self.seed = seed
        self.link = Bandwidth(bytes_per_s)  #: None: as fast as loopback
        self.requests = 0
        self.response_bytes = 0  #: body bytes the target delivered through the proxy (what a source served)
        self.actions: Counter[str] = Counter()  # forward/error/drop_before/drop_mid/forced
        self._seen: dict[tuple[str, str], int] = {}
        self.handler_errors: list[str] = []  # exceptions in handler threads (client went away...)
        self.log: list[tuple[str, str]] = []  #: (method, path) of each request, in the order they passed the holds
        #: (method, path) of each request in the order it arrived, before any hold: the order a client asked in,
        #: whatever order held requests are let go in
        self.arrivals: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._always: list[tuple[str, int]] = []
        self._holds: list[_Hold] = []
        self._server: _QuietServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def clean(cls, endpoint_url: str, **kwargs: Any) -> FaultProxy:
        """A proxy in front of ``endpoint_url`` (``http://host:port``) that injects no faults (hold or throttle it)."""
        host, port = endpoint_url.split("//")[1].split(":")
        return cls(host, int(port), error_rate=0.0, drop_rate=0.0, **kwargs)

    def gets_under(self, prefix: str, names: Collection[str]) -> list[str]:
        """``names`` (paths after ``prefix``) in the order the proxy was first asked for them by a GET.

        The order of arrival, not of passing: requests held together (``hold``) are let go in no set order."""
        out: list[str] = []
        for method, path in self.arrivals:
            name = path.split(prefix, 1)[-1]
            if method == "GET" and prefix in path and name in names and name not in out:
                out.append(name)
        return out

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("proxy not started")
        return int(self._server.server_address[1])

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def fail_always(self, substring: str, status: int = 404) -> None:
        """Answer ``status`` (S3 XML error) to every request whose target contains ``substring``."""
        with self._lock:
            self._always.append((substring, status))

    def hold(self, substring: str, *, after: int, action: Callable[[], None]) -> None:
        """Let the first ``after`` ranged GETs whose path contains ``substring`` through; hold the later ones until
        ``action`` (run once, by the first held request) has returned: e.g. overwrite the object between its ranges."""
        with self._lock:
            self._holds.append(_Hold(substring, after, action))

    def _wait_for_holds(self, method: str, target: str, ranged: bool) -> None:
        path = target.split("?", 1)[0]
        with self._lock:
            self.arrivals.append((method, path))
        if method != "GET" or not ranged:
            return
        for h in list(self._holds):
            if h.substring in path:
                h.pass_or_wait()

    def clear_failures(self) -> None:
        with self._lock:
            self._always.clear()

    def set_rates(self, error_rate: float, drop_rate: float) -> None:
        with self._lock:
            self.error_rate, self.drop_rate = error_rate, drop_rate

    def _decide(self, method: str, target: str) -> tuple[str, int]:
        """Return (action, status); action in forward/error/forced/drop_before/drop_mid.

        The dice for the n-th request with a given method and path (query ignored) are
        ``Random(f"{seed}|{method}|{path}|{n}")``: the same whatever the interleaving of
        concurrent requests for other objects.
        """
        path = target.split("?", 1)[0]
        with self._lock:
            self.requests += 1
            self.log.append((method, path))
            for substring, status in self._always:
                if substring in target:
                    self.actions["forced"] += 1
                    return "forced", status
            n = self._seen[(method, path)] = self._seen.get((method, path), 0) + 1
            rng = random.Random(f"{self.seed}|{method}|{path}|{n}")
            roll, kind = rng.random(), rng.random()
            if roll < self.error_rate:
                action = "error"
            elif roll < self.error_rate + self.drop_rate:
                action = "drop_before" if kind < 0.5 else "drop_mid"
            else:
                action = "forward"
            self.actions[action] += 1
            return action, 503 if action == "error" else 0

    @property
    def errors_injected(self) -> int:
        """503 SlowDown answers given."""
        return self.actions["error"]

    @property
    def drops_injected(self) -> int:
        """Connections dropped, before forwarding or part-way through the response."""
        return self.actions["drop_before"] + self.actions["drop_mid"]

    @property
    def forced_failures(self) -> int:
        """Answers given by a ``fail_always`` rule."""
        return self.actions["forced"]

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("already started")
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = _QuietServer((HOST, 0), Handler)
        self._server.errors = self.handler_errors
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="FaultProxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _Hold:
    """One ``FaultProxy.hold`` rule: the first ``after`` requests pass, the rest wait for ``action`` to have run."""

    def __init__(self, substring: str, after: int, action: Callable[[], None]) -> None:
        self.substring, self.after, self.action = substring, after, action
        self.seen = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.ran = 0

    def pass_or_wait(self) -> None:
        with self.lock:
            self.seen += 1
            if self.seen <= self.after:
                return
            first = self.ran == 0
            self.ran += 1
        if first:
            try:
                self.action()
            finally:
                self.done.set()
        self.done.wait(60)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    errors: list[str]

    def handle_error(self, request: object, client_address: object) -> None:
        self.errors.append(repr(sys.exc_info()[1]))  # instead of a traceback on stderr


class _ProxyHandler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # so that Expect: 100-continue is answered

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output quiet

    def _drain_body(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline(1024).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(8192) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                self.rfile.read(size + 2)
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:
            data = self.rfile.read(min(_BLOCK, length))
            if not data:
                return
            length -= len(data)

    def _send_error_xml(self, status: int, code: str, message: str) -> None:
        self._drain_body()  # so that the client reads our answer, not a broken pipe
        body = b"" if self.command == "HEAD" else s3_error_body(code, message)
        reason = http.client.responses.get(status, "Error")
        if status == 503:
            reason = "Slow Down"
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.wfile.write(head.encode("latin-1") + body)
        self.wfile.flush()

    def _proxy(self) -> None:
        self.close_connection = True
        self.owner._wait_for_holds(self.command, self.path, "Range" in self.headers)
        action, status = self.owner._decide(self.command, self.path)
        if action == "forced":
            self._send_error_xml(status, _CODES.get(status, "InjectedError"), "fault proxy: permanent failure")
            return
        if action == "error":
            self._send_error_xml(503, "SlowDown", "Please reduce your request rate.")
            return
        if action == "drop_before":  # RST without answering or forwarding
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # the fd closes (RST, no FIN first) once finish() closes r/wfile
            return
        try:
            up = socket.create_connection(self.owner.target, timeout=self.owner.timeout)
        except OSError as exc:
            self._send_error_xml(502, "BadGateway", f"fault proxy: target unreachable: {exc}")
            return
        with up:
            self._forward_request(up)
            self._relay_response(up, truncate=action == "drop_mid")

    def _forward_request(self, up: socket.socket) -> None:
        head = f"{self.command} {self.path} {self.request_version}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        up.sendall(head.encode("latin-1") + b"\r\n")
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            _copy_chunked(self.rfile, up, self.owner.link)
        else:
            _copy_exact(self.rfile, up, int(self.headers.get("Content-Length") or 0), self.owner.link)

    def _relay_response(self, up: socket.socket, *, truncate: bool) -> None:
        resp = http.client.HTTPResponse(up, method=self.command)
        resp.begin()  # skips any upstream "100 Continue"
        length = resp.getheader("Content-Length")
        no_body = self.command == "HEAD" or resp.status in (204, 304)
        chunked = length is None and not no_body
        if truncate and (no_body or length == "0"):
            return  # nothing to cut short: lose the whole response instead
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
        lines += [f"{k}: {v}" for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        lines.append("Connection: close")
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if no_body:
            self.wfile.flush()
            return
        budget = int(length) // 2 if (truncate and length is not None) else -1
        sent = 0
        while True:
            data = resp.read(_BLOCK)
            if not data:
                break
            if truncate and budget >= 0 and sent + len(data) > budget:
                data = data[: budget - sent]
            if data:
                self.owner.link.take(len(data))
                with self.owner._lock:
                    self.owner.response_bytes += len(data)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                sent += len(data)
            if truncate and (budget < 0 or sent >= budget):
                self.wfile.flush()
                return  # close mid-body: chunked without terminator, or short body
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _proxy
