"""Staging from a real S3-compatible server (SeaweedFS) over HTTP, with faults injected by a proxy."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from tests.conftest import cli_json, run_cli
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server, isolated_s3
from tests.support.trees import content

BUCKET = "data"
SMALL = {f"ds/small/{i % 10}/{i:05d}.bin": 500 + (i * 37) % 3000 for i in range(2000)}
MULTIPART = {"ds/multi/a.bin": 12 << 20, "ds/multi/b.bin": (11 << 20) + 7}
LARGE = {"ds/large/c.bin": 40 << 20}  # above the range threshold: copied by parallel ranges


def _s3fs(server: S3Server) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    """The session's server, with this module's bucket (its tests share it: they read it, and the two that change an
    object use keys of their own or put it back)."""
    # nothing from the environment may lend credentials to the "no credentials" cases
    with isolated_s3(BUCKET, {k: content(k, n) for k, n in (SMALL | LARGE).items()}, server=s3_server) as server:
        fs = _s3fs(server)
        for key, size in MULTIPART.items():
            data = content(key, size)
            with fs.open(f"{BUCKET}/{key}", "wb", block_size=5 << 20) as f:
                for off in range(0, size, 1 << 20):
                    f.write(data[off:off + (1 << 20)])
        yield server


def _expected(prefix: str = "ds/") -> dict[str, bytes]:
    return {k[len(prefix):]: content(k, n) for k, n in (SMALL | MULTIPART | LARGE).items() if k.startswith(prefix)}


def _check_bytes(root: Path, expected: dict[str, bytes]) -> None:
    found = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert found == set(expected)
    for rel, data in expected.items():
        assert (root / rel).read_bytes() == data, rel


def _creds(server: S3Server, endpoint: str | None = None) -> list[str]:
    return ["--endpoint-url", endpoint or server.endpoint_url, "-o", f"key={server.access_key}",
            "-o", f"secret={server.secret_key}"]


def test_stage_a_prefix_with_multipart_objects(s3: S3Server, root: Path) -> None:
    ds = sl.stage(f"s3://{BUCKET}/ds", root=str(root), storage_options=s3.storage_options())
    _check_bytes(ds.root, _expected())
    etags = {e.path: e.etag for e in ds.manifest}
    for name in ("multi/a.bin", "multi/b.bin"):  # multipart uploads: ETag "<md5 of md5s>-<parts>"
        assert re.fullmatch(r"[0-9a-f]{32}-[2-9]", etags[name]), etags[name]
    assert all(etags[p] and "-" not in etags[p] for p in etags if p.startswith("small/"))
    assert sl.verify(ds).ok


def test_restage_reuses_and_a_changed_object_makes_a_new_version(s3: S3Server, root: Path) -> None:
    opts = s3.storage_options()
    first = sl.stage(f"s3://{BUCKET}/ds/small/3", root=str(root), storage_options=opts, lease="a")
    again = sl.stage(f"s3://{BUCKET}/ds/small/3", root=str(root), storage_options=opts, lease="a")
    assert again.report is not None and again.report.copied_files == 0 and again.version == first.version
    fs = _s3fs(s3)
    key = f"{BUCKET}/ds/small/3/00003.bin"
    original = fs.cat_file(key)
    fs.pipe_file(key, b"a new object under the same key")
    try:
        changed = sl.stage(f"s3://{BUCKET}/ds/small/3", root=str(root), storage_options=opts, lease="a")
        assert changed.report is not None and changed.report.reasons == {"changed": 1}
        assert (changed.root / "00003.bin").read_bytes() == b"a new object under the same key"
        assert changed.version == "v2"
    finally:
        fs.pipe_file(key, original)


def test_cli_stage_from_s3(s3: S3Server, root: Path) -> None:
    out = cli_json("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), *_creds(s3))
    assert out["files"] == 2 and out["copied_bytes"] == sum(MULTIPART.values())
    _check_bytes(Path(out["root"]), _expected("ds/multi/"))


def test_transient_faults_are_retried_to_identical_bytes(s3: S3Server, root: Path) -> None:
    host, port = s3.endpoint_url.split("//")[1].split(":")
    with FaultProxy(host, int(port), error_rate=0.15, drop_rate=0.1, seed=7) as proxy:
        ds = sl.stage(f"s3://{BUCKET}/ds", root=str(root), workers=16,
                      storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url),
                      include=["small/[0-2]/*", "multi/*", "large/*"])
        assert proxy.errors_injected > 20 and proxy.drops_injected > 10
    want = {k: v for k, v in _expected().items() if not k.startswith("small/") or k[6] in "012"}
    _check_bytes(ds.root, want)


def test_an_object_overwritten_between_its_ranges_is_never_published_spliced(s3: S3Server, root: Path) -> None:
    key, size = "race/big.bin", 40 << 20  # five 8 MiB ranges
    fs = _s3fs(s3)
    old, new = content(key, size, salt="old"), content(key, size, salt="new")
    fs.pipe_file(f"{BUCKET}/{key}", old)
    host, port = s3.endpoint_url.split("//")[1].split(":")
    with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0) as proxy:
        proxy.hold(key, after=1, action=lambda: fs.pipe_file(f"{BUCKET}/{key}", new))
        with pytest.raises(sl.SourceError, match=r"race/big\.bin"):
            sl.stage(f"s3://{BUCKET}/race", root=str(root), workers=8,
                     storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
    assert not list(root.rglob("big.bin")), "a spliced object was published"
    ds = sl.stage(f"s3://{BUCKET}/race", root=str(root), storage_options=s3.storage_options())
    assert (ds.root / "big.bin").read_bytes() == new
    assert sl.verify(ds).ok


def test_permanent_error_fails_with_the_object_name(s3: S3Server, root: Path) -> None:
    host, port = s3.endpoint_url.split("//")[1].split(":")
    with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0) as proxy:
        proxy.fail_always("00042.bin", 403)
        proc = run_cli("stage", f"s3://{BUCKET}/ds/small/2", "--root", str(root),
                       *_creds(s3, proxy.endpoint_url))
    assert proc.returncode == 4, proc.stderr
    assert "ds/small/2/00042.bin" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(root.rglob("00042.bin"))


def test_wrong_secret_and_missing_credentials(s3: S3Server, root: Path) -> None:
    wrong = run_cli("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), "--endpoint-url", s3.endpoint_url,
                    "-o", f"key={s3.access_key}", "-o", "secret=wrong")
    assert wrong.returncode == 4 and "access denied" in wrong.stderr and "Traceback" not in wrong.stderr
    anon = run_cli("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), "--endpoint-url", s3.endpoint_url)
    assert anon.returncode == 4 and "Traceback" not in anon.stderr
    assert "credentials" in anon.stderr or "access denied" in anon.stderr


def test_missing_bucket_and_prefix(s3: S3Server, root: Path) -> None:
    proc = run_cli("stage", "s3://no-such-bucket/x", "--root", str(root), *_creds(s3))
    assert proc.returncode == 4 and "no-such-bucket" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("stage", f"s3://{BUCKET}/no/such/prefix", "--root", str(root), *_creds(s3))
    assert proc.returncode == 4 and "no/such/prefix" in proc.stderr


def test_source_manifest_on_s3(s3: S3Server, root: Path) -> None:
    url = f"s3://{BUCKET}/ds/small/5"
    _where, m = sl.write_manifest(url, storage_options=s3.storage_options())
    assert len(m) == 200
    ds = sl.stage(url, root=str(root), storage_options=s3.storage_options())
    assert {e.path: e.digest for e in ds.manifest} == {e.path: e.digest for e in m}


def test_unsafe_object_keys_are_refused(root: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/evil/ds/ok.bin", b"x")
    fs.pipe_file("/evil/ds/a/../../../escape.bin", b"y")
    with pytest.raises(sl.UnsafePathError) as exc:
        sl.stage("memory://evil/ds", root=str(root))
    assert "a/../../../escape.bin" in str(exc.value)
    assert not list(root.rglob("*.bin")) and not (root.parent / "escape.bin").exists()
    fs.rm("/evil", recursive=True)


def test_probe_an_object_store(s3: S3Server, tmp_path: Path) -> None:
    out = cli_json("probe", f"s3://{BUCKET}/ds/small/7", "--seconds", "4", *_creds(s3),
                   env={"STAGINGLOADER_ROOT": str(tmp_path)})
    assert out["kind"] == "source" and out["fs_type"] == "s3"
    levels = out["get_concurrency"]
    assert sorted(levels, key=int) == ["1", "4", "16", "64"]
    for row in levels.values():
        assert row["objects/s"] > 0 and row["MB/s"] > 0 and row["p50_ms"] <= row["p99_ms"]


def test_secrets_stay_off_the_command_line(s3: S3Server, root: Path, tmp_path: Path) -> None:
    """--options-file and fsspec's own environment carry the credentials; the command line holds none."""
    opts = tmp_path / "s3.json"
    opts.write_text(json.dumps({"key": s3.access_key, "secret": s3.secret_key}))
    opts.chmod(0o600)
    out = cli_json("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), "--endpoint-url", s3.endpoint_url,
                   "--options-file", str(opts))
    _check_bytes(Path(out["root"]), _expected("ds/multi/"))
    env = {"FSSPEC_S3_KEY": s3.access_key, "FSSPEC_S3_SECRET": s3.secret_key}
    again = cli_json("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), "--endpoint-url", s3.endpoint_url,
                     env=env)
    assert again["root"] == out["root"] and again["copied_files"] == 0
    bad = run_cli("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), "--options-file", str(tmp_path / "no"))
    assert bad.returncode == 2 and "--options-file" in bad.stderr
    opts.write_text("[1, 2]")
    bad = run_cli("stage", f"s3://{BUCKET}/ds/multi", "--root", str(root), "--options-file", str(opts))
    assert bad.returncode == 2 and "JSON object" in bad.stderr
