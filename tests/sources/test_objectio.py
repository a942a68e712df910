"""The bytes of s3:// objects (sources/objectio.py): which client reads, what it is told, and how it fails.

The mapping from s3fs options to obstore is pure and tested without a server; the reads run against the real
SeaweedFS server, through the fault proxy where a fault is the point.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from stagingloader.sources.objectio import ObstorePlan, ObstoreReader, plan_obstore
from stagingloader.sources.source import Source
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server, isolated_s3
from tests.support.trees import content

BUCKET = "objio"
BIG = ("ds/big.bin", 24 << 20)  # three 8 MiB ranges when staged
SMALL = {f"ds/s/{i:03d}.bin": 1000 + i for i in range(40)}


def _plan(**kw: Any) -> ObstorePlan | str:
    base: dict[str, Any] = {"options": {}, "endpoint_url": None, "client_kwargs": {}, "config_kwargs": {},
                            "anon": False, "static_credentials": True, "requester_pays": False,
                            "s3_additional_kwargs": {}, "use_ssl": True, "region": None, "resolved_endpoint": None}
    return plan_obstore(**(base | kw))


def test_plan_maps_endpoint_region_and_tls_options() -> None:
    plan = _plan(options={"endpoint_url": "x", "key": "k", "secret": "s", "client_kwargs": {}},
                 endpoint_url="http://127.0.0.1:9000", client_kwargs={"region_name": "eu-west-3", "verify": False},
                 config_kwargs={"connect_timeout": 2, "retries": {"max_attempts": 3},
                                "s3": {"addressing_style": "path"}})
    assert isinstance(plan, ObstorePlan)
    assert plan.config["endpoint"] == "http://127.0.0.1:9000" and plan.config["region"] == "eu-west-3"
    assert plan.config["virtual_hosted_style_request"] is False and plan.credentials == "static"
    assert plan.client_options["allow_http"] is True and plan.client_options["allow_invalid_certificates"] is True
    assert plan.client_options["connect_timeout"] == "2.0s"
    assert not any("secret" in str(v) or v == "s" for v in (*plan.config.values(), *plan.client_options.values()))


def test_plan_on_aws_takes_botocores_region_and_lets_the_bucket_name_choose_the_style() -> None:
    plan = _plan(region="ap-south-1", resolved_endpoint="https://s3.ap-south-1.amazonaws.com", requester_pays=True,
                 static_credentials=False)
    assert isinstance(plan, ObstorePlan)
    assert "endpoint" not in plan.config and plan.config["region"] == "ap-south-1"
    assert plan.config["virtual_hosted_style_request"] is None and plan.config["request_payer"] is True
    assert plan.credentials == "session"
    env_endpoint = _plan(resolved_endpoint="https://minio.example:9000")  # AWS_ENDPOINT_URL, as botocore read it
    assert isinstance(env_endpoint, ObstorePlan) and env_endpoint.config["endpoint"] == "https://minio.example:9000"
    anon = _plan(anon=True, config_kwargs={"signature_version": "UNSIGNED"})
    assert isinstance(anon, ObstorePlan) and anon.credentials == "anonymous"


@pytest.mark.parametrize("kw, why", [
    ({"options": {"acl": "private"}}, "acl"),
    ({"config_kwargs": {"parameter_validation": False}}, "parameter_validation"),
    ({"client_kwargs": {"api_version": "2006-03-01"}}, "api_version"),
    ({"s3_additional_kwargs": {"SSECustomerKey": "k", "SSECustomerAlgorithm": "AES256"}}, "SSE-C"),
    ({"config_kwargs": {"signature_version": "s3"}}, "SigV4"),
    ({"config_kwargs": {"proxies": {"http": "http://a:1", "https": "http://b:2"}}}, "proxies"),
])
def test_plan_refuses_what_obstore_cannot_do(kw: dict[str, Any], why: str) -> None:
    plan = _plan(**kw)
    assert isinstance(plan, str) and why in plan


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    """The session's server, with this module's bucket."""
    with isolated_s3(BUCKET, {k: content(k, n) for k, n in (SMALL | dict([BIG])).items()}, server=s3_server) as server:
        yield server


def _listed(source: Source) -> dict[str, Any]:
    return {f.rel: f for f in source.listing()}


def test_reads_go_through_obstore_and_a_stale_etag_is_refused_by_the_server(s3: S3Server) -> None:
    source = Source(f"s3://{BUCKET}/ds", s3.storage_options())
    files = _listed(source)
    rel, size = BIG[0][3:], BIG[1]
    got = source.read_range(rel, 5 << 20, 13 << 20, files[rel].etag)
    assert bytes(got) == content(BIG[0], size)[5 << 20:13 << 20]
    assert source.object_reader().name == "obstore"
    with pytest.raises(sl.SourceChangedError, match=r"big\.bin was overwritten") as exc:
        source.read_range(rel, 0, 100, "0" * 32)
    from obstore.exceptions import PreconditionError

    chain: list[BaseException] = []
    e: BaseException | None = exc.value
    while e is not None:
        chain.append(e)
        e = e.__cause__
    assert any(isinstance(c, PreconditionError) for c in chain), "If-Match was not sent, or not answered with 412"


def test_an_object_replaced_between_its_ranges_is_caught(s3: S3Server, root: Path) -> None:
    import s3fs

    key, size = "race/obj.bin", 40 << 20  # above the range threshold: five 8 MiB ranges
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
    fs.pipe_file(f"{BUCKET}/{key}", content(key, size, salt="old"))
    new = content(key, size, salt="new")
    host, port = s3.endpoint_url.split("//")[1].split(":")
    with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0) as proxy:
        proxy.hold(key, after=1, action=lambda: fs.pipe_file(f"{BUCKET}/{key}", new))
        with pytest.raises(sl.SourceChangedError, match=r"race/obj\.bin"):
            sl.stage(f"s3://{BUCKET}/race", root=str(root), workers=4,
                     storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
    assert not list(root.rglob("obj.bin"))
    ds = sl.stage(f"s3://{BUCKET}/race", root=str(root), storage_options=s3.storage_options())
    assert (ds.root / "obj.bin").read_bytes() == new


def test_5xx_and_resets_mid_range_are_retried_to_the_same_bytes(s3: S3Server, root: Path) -> None:
    host, port = s3.endpoint_url.split("//")[1].split(":")
    with FaultProxy(host, int(port), error_rate=0.25, drop_rate=0.25, seed=3) as proxy:
        ds = sl.stage(f"s3://{BUCKET}/ds", root=str(root), workers=8,
                      storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
        assert proxy.errors_injected >= 5 and proxy.actions["drop_mid"] >= 3
    for rel, size in (SMALL | dict([BIG])).items():
        assert (ds.root / rel[3:]).read_bytes() == content(rel, size), rel
    assert sl.verify(ds).ok


def _cut_then_forward(path: str, rate: float, cuts: int) -> int:
    """A fault-proxy seed whose first ``cuts`` GETs of ``path`` are cut in the middle of their bodies and whose
    next one passes (the proxy's dice, see FaultProxy._decide)."""
    import random

    def roll(seed: int, n: int) -> tuple[float, float]:
        rng = random.Random(f"{seed}|GET|{path}|{n}")
        return rng.random(), rng.random()

    return next(seed for seed in range(100_000)
                if all(roll(seed, n)[0] < rate and roll(seed, n)[1] >= 0.5 for n in range(1, cuts + 1))
                and roll(seed, cuts + 1)[0] >= rate)


def test_a_range_cut_mid_body_more_often_than_obstore_resumes_is_read_again_whole(s3: S3Server,
                                                                                   tmp_path: Path) -> None:
    """obstore resumes a body cut once or twice by itself; the third cut reaches the caller's retry, which reads
    the range again: what is written, hashed and handed to the stager for the file's digest is the range, whole."""
    import threading

    from stagingloader import digest as dg
    from stagingloader.engine import copyops
    from stagingloader.retry import RetryPolicy

    key, size = BIG
    host, port = s3.endpoint_url.split("//")[1].split(":")
    seed = _cut_then_forward(f"/{BUCKET}/{key}", 0.5, 3)
    listed = _listed(Source(f"s3://{BUCKET}/ds", s3.storage_options()))["big.bin"]
    want = content(key, size)[8 << 20:16 << 20]
    tmp = tmp_path / "big.tmp"
    tmp.write_bytes(bytes(size))
    target = copyops.Target(incoming=str(tmp_path), source_url=f"s3://{BUCKET}/ds", fsync=False,
                            retry=RetryPolicy(first_delay=0.0, max_delay=0.0))
    with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.5, seed=seed) as proxy:
        source = Source(f"s3://{BUCKET}/ds", s3.storage_options(endpoint_url=proxy.endpoint_url))
        worker = copyops.Worker(target, threading.Event(), source)
        digest, _, pieces = worker.copy_range(listed, key, str(tmp), 8 << 20, 8 << 20)
        assert proxy.actions["drop_mid"] == 3 and proxy.actions["forward"] == 1
    assert b"".join(bytes(p) for p in pieces) == want
    assert tmp.read_bytes()[8 << 20:16 << 20] == want and digest == dg.digest_bytes(want)


def test_permanent_answers_fail_at_once_with_one_clear_message(s3: S3Server) -> None:
    host, port = s3.endpoint_url.split("//")[1].split(":")
    with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0) as proxy:
        source = Source(f"s3://{BUCKET}/ds", s3.storage_options(endpoint_url=proxy.endpoint_url))
        files = _listed(source)
        for status, error, words in ((403, sl.SourceAccessError, "access denied"),
                                     (404, sl.SourceNotFoundError, "not found"),
                                     (400, sl.SourceError, "400")):
            proxy.clear_failures()
            proxy.fail_always("s/007.bin", status)
            before = proxy.requests
            with pytest.raises(error, match=words) as exc:
                source.read_range("s/007.bin", 0, 100, files["s/007.bin"].etag)
            assert "ds/s/007.bin" in str(exc.value) and s3.secret_key not in str(exc.value)
            assert "gave up" not in str(exc.value) and proxy.requests - before == 1  # not retried
        proxy.clear_failures()
    with pytest.raises(sl.SourceError, match="cannot reach the server") as unreachable:  # the proxy is gone
        source.read_range("s/007.bin", 0, 100, files["s/007.bin"].etag)
    assert "gave up after 2 attempts" in str(unreachable.value)


def test_credentials_from_the_environment_as_botocore_reads_them(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    source = Source(f"s3://{BUCKET}/ds/s", {"endpoint_url": s3.endpoint_url, "skip_instance_cache": True})
    files = _listed(source)
    assert bytes(source.read_range("001.bin", 0, 1001, files["001.bin"].etag)) == content("ds/s/001.bin", 1001)
    reader = source.object_reader()
    assert isinstance(reader, ObstoreReader) and reader.plan.credentials == "session"


def test_options_obstore_cannot_map_fall_back_to_s3fs_and_say_so(s3: S3Server, root: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    opts = s3.storage_options(config_kwargs={"parameter_validation": False})
    with caplog.at_level(logging.INFO, logger="stagingloader.sources.objectio"):
        ds = sl.stage(f"s3://{BUCKET}/ds/s", root=str(root), storage_options=opts)
    assert "through s3fs, not obstore" in caplog.text and "parameter_validation" in caplog.text
    assert s3.secret_key not in caplog.text
    assert {p.name for p in ds.root.iterdir()} == {k.rsplit("/", 1)[1] for k in SMALL}
    assert sl.verify(ds).ok


def test_given_credentials_list_and_read_without_s3fs_or_botocore(s3: S3Server, root: Path) -> None:
    import json
    import subprocess
    import sys

    code = ("import json, sys, stagingloader as sl\n"
            f"ds = sl.stage('s3://{BUCKET}/ds/s', root={str(root)!r}, storage_options=json.loads(sys.argv[1]))\n"
            "print(json.dumps([len(ds.files), sl.verify(ds).ok, 's3fs' in sys.modules, 'botocore' in sys.modules,\n"
            "                  'fsspec' in sys.modules]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC")} | {"HOME": str(root)}  # no config
    out = subprocess.run([sys.executable, "-c", code, json.dumps(s3.storage_options())], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2], env=env)
    assert json.loads(out.stdout) == [len(SMALL), True, False, False, False]


@pytest.mark.parametrize("where", ["folder", "environment", "none"])
def test_fsspecs_config_is_read_where_there_is_one_and_fsspec_not_imported_where_there_is_none(
        tmp_path: Path, where: str) -> None:
    import json
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / ".config" / "fsspec").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC")} | {"HOME": str(home)}
    if where == "folder":
        (home / ".config" / "fsspec" / "conf.json").write_text(json.dumps({"s3": {"key": "k1", "secret": "s1"}}))
    elif where == "environment":
        env["FSSPEC_S3"] = json.dumps({"key": "k1", "secret": "s1"})
    code = ("import json, sys\nfrom stagingloader.sources.objectio import fsspec_config\n"
            "print(json.dumps([fsspec_config('s3'), 'fsspec' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    conf, imported = json.loads(out.stdout)
    assert conf == ({} if where == "none" else {"key": "k1", "secret": "s1"})
    assert imported == (where != "none")
