"""The bytes of ``s3://`` objects: ranged GETs that run off the GIL, pinned to the object version the listing saw.

Users give s3fs their URL and options (``storage_options``, ``--endpoint-url``, ``-o KEY=VALUE``, the environment).
Where the credentials and the endpoint (or region) are given, obstore lists and reads alone (:func:`direct_reader`:
s3fs and botocore are never imported); else s3fs lists, and the bytes come through ``obstore`` (Rust: signing, HTTP
and the body never hold the GIL, so the copy threads overlap for real) when every option the user gave has an
obstore equivalent (:func:`plan_obstore`); otherwise, or when obstore is not installed, through s3fs as before, said
in one log line.
Measured on 2 cores against the same SeaweedFS server (``benchmarks/bench_s3_clients.py``, docs/benchmarks.md):
2,000 x 100 KiB GETs, 32 in flight, took 5.0 s through obstore against 10.9 s through s3fs's event loop, with
0.9 CPU-s of client work against 4.8; 4 x 256 MiB in 8 MiB ranges 3.4 s against 4.1 s.

Whichever client reads, a range of an object listed with an ETag is read with ``If-Match`` of that ETag (and the
version id where the bucket keeps versions), and the ETag of the answer is checked too: an object replaced
while it is copied is :class:`SourceChangedError`, never a file spliced from two versions.  Retries stay with
:func:`.retry.call_with_retry` (the caller's); the clients retry little inside, so an endpoint that does not
answer fails fast.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import SourceChangedError, SourceError
from ..retry import redact

log = logging.getLogger(__name__)

#: what a range read returns: bytes, or a view of a buffer the client owns (no copy)
Buffer = bytes | memoryview

#: s3fs options that only shape listing, caching or writing: they do not change how bytes are read
_READ_NEUTRAL = frozenset({
    "default_block_size", "default_fill_cache", "default_cache_type", "use_listings_cache", "listings_expiry_time",
    "max_paths", "skip_instance_cache", "asynchronous", "loop", "max_concurrency", "fixed_upload_size",
    "version_aware", "cache_regions", "local_expiry_check", "session", "profile",
    # mapped below from the filesystem's own attributes (they may come from fsspec's config, not the options)
    "key", "secret", "token", "username", "password", "anon", "endpoint_url", "client_kwargs", "config_kwargs",
    "requester_pays", "s3_additional_kwargs", "use_ssl",
})
#: botocore Config fields with an obstore equivalent, or none needed (retries: ours; pool size: no limit there)
_CONFIG_MAPPED = frozenset({"connect_timeout", "read_timeout", "retries", "max_pool_connections", "region_name",
                            "signature_version", "s3", "proxies", "user_agent", "user_agent_extra",
                            "tcp_keepalive", "request_checksum_calculation", "response_checksum_validation"})
_CLIENT_MAPPED = frozenset({"region_name", "endpoint_url", "verify", "use_ssl", "aws_access_key_id",
                            "aws_secret_access_key", "aws_session_token"})
#: the reads obstore makes inside one call before the caller's retry policy takes over
_INNER_RETRIES = 2
_DNS_LABEL = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")


class RangeReader(Protocol):
    """Reads bytes ``[start, end)`` of ``bucket/key`` (an fsspec path), from the version ``etag`` names."""

    name: str

    def read(self, path: str, start: int, end: int, etag: str) -> Buffer: ...


@dataclass(frozen=True, kw_only=True)
class ObstorePlan:
    """How to reach the server with obstore: no credential in here (they are resolved when the store is made)."""

    config: Mapping[str, Any] = field(default_factory=dict)  #: S3Config keys: endpoint, region, request_payer...
    client_options: Mapping[str, Any] = field(default_factory=dict)  #: ClientConfig keys
    credentials: str = "session"  #: 'anonymous', 'static' (the options') or 'session' (botocore's chain)


def plan_obstore(*, options: Mapping[str, Any], endpoint_url: str | None, client_kwargs: Mapping[str, Any],
                 config_kwargs: Mapping[str, Any], anon: bool, static_credentials: bool, requester_pays: bool,
                 s3_additional_kwargs: Mapping[str, Any], use_ssl: bool, region: str | None,
                 resolved_endpoint: str | None) -> ObstorePlan | str:
    """The obstore settings equivalent to these s3fs settings, or the reason there are none (a str).

    ``options`` are the storage options as the user gave them (their names are checked); the other arguments are
    the filesystem's resolved values.  ``region`` and ``resolved_endpoint`` are what botocore settled on.
    """
    unknown = sorted(set(options) - _READ_NEUTRAL)
    if unknown:
        return f"storage option(s) {unknown} have no obstore equivalent"
    extra = sorted(set(config_kwargs) - _CONFIG_MAPPED)
    if extra:
        return f"config_kwargs {extra} have no obstore equivalent"
    extra = sorted(set(client_kwargs) - _CLIENT_MAPPED)
    if extra:
        return f"client_kwargs {extra} have no obstore equivalent"
    if set(s3_additional_kwargs) - {"RequestPayer"}:
        return f"s3_additional_kwargs {sorted(s3_additional_kwargs)} (e.g. SSE-C keys) are read through s3fs"
    config: dict[str, Any] = {}
    client: dict[str, Any] = {"timeout": "600s", "read_timeout": "60s", "connect_timeout": "5s",
                              "pool_idle_timeout": "30s"}
    endpoint = endpoint_url or client_kwargs.get("endpoint_url")
    if not endpoint and resolved_endpoint and not _is_aws(resolved_endpoint):
        endpoint = resolved_endpoint  # from the environment or a profile (AWS_ENDPOINT_URL...)
    if endpoint:
        endpoint = str(endpoint)
        if not use_ssl or client_kwargs.get("use_ssl") is False:
            endpoint = re.sub(r"^https://", "http://", endpoint)
        config["endpoint"] = endpoint
        if endpoint.startswith("http://"):
            client["allow_http"] = True
    region = client_kwargs.get("region_name") or config_kwargs.get("region_name") or region
    config["region"] = str(region or "us-east-1")
    style = (config_kwargs.get("s3") or {}).get("addressing_style")
    if style is not None and style not in ("auto", "path", "virtual"):
        return f"addressing_style {style!r} is not one obstore knows"
    config["virtual_hosted_style_request"] = style == "virtual"  # 'auto' resolved per bucket by the reader
    if style == "auto" or (style is None and not endpoint):
        config["virtual_hosted_style_request"] = None
    if requester_pays or s3_additional_kwargs.get("RequestPayer") == "requester":
        config["request_payer"] = True
    verify = client_kwargs.get("verify")
    if verify is False:
        client["allow_invalid_certificates"] = True
    elif isinstance(verify, str):
        try:
            with open(verify, "rb") as f:
                client["root_certificate"] = f.read()
        except OSError as e:
            return f"cannot read the CA bundle {verify} ({e.strerror})"
    for name in ("connect_timeout", "read_timeout"):
        if isinstance(config_kwargs.get(name), (int, float)):
            client[name] = f"{float(config_kwargs[name])}s"
    proxies = config_kwargs.get("proxies") or {}
    if proxies:
        urls = set(proxies.values())
        if len(urls) != 1:
            return "several proxies (one per scheme) have no obstore equivalent"
        client["proxy_url"] = urls.pop()
    signature = config_kwargs.get("signature_version")
    unsigned = anon or (signature is not None and "UNSIGNED" in str(signature).upper())
    if signature is not None and not unsigned and str(signature) not in ("s3v4", "v4"):
        return f"signature_version {signature!r} is not SigV4"
    credentials = "anonymous" if unsigned else ("static" if static_credentials else "session")
    return ObstorePlan(config=config, client_options=client, credentials=credentials)


def _is_aws(url: str) -> bool:
    host = url.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    return host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")


# ---- the readers ---------------------------------------------------------------------------------------------------

def _changed(path: str, tag: str) -> SourceChangedError:
    return SourceChangedError(f"{path} was overwritten while it was copied (its ETag is no longer {tag}); "
                              "stage again once it is stable")


class S3fsReader:
    """Ranges through s3fs's ``get_object`` on its event loop thread (one loop: bound by one core)."""

    name = "s3fs"

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def read(self, path: str, start: int, end: int, etag: str) -> Buffer:
        from fsspec.asyn import sync

        if not etag:
            data: bytes = self.fs.cat_file(path, start=start, end=end)
            return data
        bucket, key, _ = self.fs.split_path(path)
        tag, _, version = etag.partition("@")
        extra = {"VersionId": version} if version else {}

        async def get() -> bytes:
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                              IfMatch=f'"{tag}"', **extra)
            except OSError as e:
                if precondition_failed(e):
                    raise _changed(path, tag) from None
                raise
            try:
                if str(resp.get("ETag", tag)).strip('"') != tag:
                    raise _changed(path, tag)
                body: bytes = await resp["Body"].read()
                return body
            finally:
                resp["Body"].close()

        result: bytes = sync(self.fs.loop, get)
        return result


def precondition_failed(exc: BaseException) -> bool:
    """An S3 answer 412 (PreconditionFailed): the object is no longer the version asked for."""
    cause = exc.__cause__ or exc.__context__
    response = getattr(cause, "response", None) or {}
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "PreconditionFailed" or status == 412 or "pre-condition" in str(exc).lower()


class ObstoreReader:
    """Ranges through obstore: each call blocks its thread in Rust with the GIL released."""

    name = "obstore"

    def __init__(self, plan: ObstorePlan, credentials: Callable[[], dict[str, Any]] | None) -> None:
        self.plan = plan
        self._credentials = credentials
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                store = self._stores[bucket] = self._make_store(bucket)
            return store

    def _make_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        config = dict(self.plan.config)
        if config.get("virtual_hosted_style_request") is None:  # botocore's 'auto': virtual where the name allows
            config["virtual_hosted_style_request"] = bool(_DNS_LABEL.match(bucket)) and "." not in bucket
        if self.plan.credentials == "anonymous":
            config["skip_signature"] = True
        retry = {"max_retries": _INNER_RETRIES, "retry_timeout": datetime.timedelta(seconds=30),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                             "max_backoff": datetime.timedelta(seconds=1), "base": 2}}
        provider = self._credentials if self.plan.credentials != "anonymous" else None
        return S3Store(bucket, config=config, client_options=dict(self.plan.client_options),  # type: ignore[arg-type]
                       retry_config=retry, credential_provider=provider)  # type: ignore[arg-type]

    # listing, shaped as s3fs's ``find``/``info``/``cat_file`` answers, for sources that need no s3fs at all
    def find(self, path: str, detail: bool = True, withdirs: bool = False) -> dict[str, dict[str, Any]]:
        """Every object under the prefix ``bucket/prefix`` (as a folder: ``prefix/...``), keyed by its path."""
        import obstore

        bucket, _, prefix = path.strip("/").partition("/")
        out: dict[str, dict[str, Any]] = {}
        try:
            for batch in obstore.list(self.store(bucket), prefix or None, chunk_size=1000):
                for meta in batch:
                    name = f"{bucket}/{meta['path']}"
                    out[name] = _info(name, meta)
        except Exception as e:
            known = translate(e, path, "")
            if known is e:
                raise
            raise known from e
        return out

    def info(self, path: str) -> dict[str, Any]:
        import obstore

        bucket, _, key = path.partition("/")
        try:
            return _info(path, obstore.head(self.store(bucket), key))
        except Exception as e:
            known = translate(e, path, "")
            if known is e:
                raise
            raise known from e

    def cat_file(self, path: str) -> bytes:
        import obstore

        bucket, _, key = path.partition("/")
        try:
            return bytes(obstore.get(self.store(bucket), key).bytes())
        except Exception as e:
            known = translate(e, path, "")
            if known is e:
                raise
            raise known from e

    def read(self, path: str, start: int, end: int, etag: str) -> Buffer:
        import obstore

        bucket, _, key = path.partition("/")
        options: dict[str, Any] = {"range": (start, end)}
        tag, _, version = etag.partition("@")
        if tag:
            options["if_match"] = f'"{tag}"'
        if version:
            options["version"] = version
        try:
            result = obstore.get(self.store(bucket), key, options=options)  # type: ignore[arg-type]
            if tag and str(result.meta.get("e_tag") or tag).strip('"') != tag:
                raise _changed(path, tag)
            return memoryview(result.bytes())
        except Exception as e:
            known = translate(e, path, tag)
            if known is e:
                raise
            raise known from e


def _info(name: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, "size": meta["size"], "type": "file", "LastModified": meta["last_modified"],
            "ETag": meta.get("e_tag") or "", "VersionId": meta.get("version")}


def translate(exc: Exception, path: str, tag: str) -> Exception:
    """An obstore error as the exception the rest of stagingloader knows (see :mod:`..retry`)."""
    from obstore import exceptions as ox

    if not isinstance(exc, ox.BaseError):
        return exc
    text = redact(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    low = str(exc).lower()
    if isinstance(exc, ox.PreconditionError):
        return _changed(path, tag)
    if isinstance(exc, ox.NotFoundError):
        return FileNotFoundError(f"NoSuchKey: {text}")
    if isinstance(exc, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or "status code: 403" in low:
        return PermissionError(f"AccessDenied: {text}")
    if "connection refused" in low or "dns error" in low or "failed to lookup address" in low:
        return ConnectionRefusedError(f"Could not connect to the endpoint URL ({text})")
    if "status code: 404" in low:
        return FileNotFoundError(f"NoSuchBucket or NoSuchKey: {text}")
    status = re.search(r"status code: (4\d\d)", low)
    if status and status.group(1) not in ("408", "429"):
        return SourceError(f"{redact(path)}: {text}")  # a request the server refuses: asking again cannot help
    return ConnectionError(text)  # 5xx after obstore's own retries, a reset, a timeout: the caller retries


# ---- choosing ------------------------------------------------------------------------------------------------------

def s3_reader(fs: Any, options: Mapping[str, Any]) -> RangeReader:
    """The reader for an s3fs filesystem made from ``options``: obstore when they map to it, else s3fs (logged)."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        log.info("reading s3:// through s3fs: obstore is not installed (pip install obstore, or stagingloader's "
                 "[s3] extra) and would read several times faster")
        return S3fsReader(fs)
    client_kwargs = dict(fs.client_kwargs or {})
    meta = fs.s3.meta  # connects as s3fs would (it has, for the listing)
    static = bool(fs.key or fs.secret or client_kwargs.get("aws_access_key_id"))
    plan = plan_obstore(options=options, endpoint_url=fs.endpoint_url, client_kwargs=client_kwargs,
                        config_kwargs=dict(fs.config_kwargs or {}), anon=bool(fs.anon), static_credentials=static,
                        requester_pays=bool(fs.requester_pays),
                        s3_additional_kwargs=dict(fs.s3_additional_kwargs or {}), use_ssl=bool(fs.use_ssl),
                        region=meta.region_name, resolved_endpoint=meta.endpoint_url)
    credentials: Callable[[], dict[str, Any]] | None = None
    if isinstance(plan, ObstorePlan) and plan.credentials == "static":
        frozen = {"access_key_id": fs.key or client_kwargs.get("aws_access_key_id") or "",
                  "secret_access_key": fs.secret or client_kwargs.get("aws_secret_access_key") or "",
                  "token": fs.token or client_kwargs.get("aws_session_token"), "expires_at": None}
        credentials = lambda: frozen  # noqa: E731
    elif isinstance(plan, ObstorePlan) and plan.credentials == "session":
        credentials = _session_credentials(fs)
        if credentials is None:
            plan = "botocore found no credentials"
    if isinstance(plan, str):
        log.info("reading s3:// through s3fs, not obstore: %s", redact(plan))
        return S3fsReader(fs)
    log.debug("reading s3:// through obstore (%s credentials, %s)", plan.credentials,
              redact(str(plan.config.get("endpoint", "AWS"))))
    return ObstoreReader(plan, credentials)


def fsspec_config(protocol: str) -> dict[str, Any]:
    """fsspec's configuration of ``protocol`` (its ``FSSPEC_*`` environment variables and config folder), without
    importing fsspec (50-130 ms of a stage's start here) when there is neither."""
    if "fsspec.config" not in sys.modules and not any(k.startswith("FSSPEC") for k in os.environ):
        folder = os.path.join(os.path.expanduser("~"), ".config/fsspec")  # FSSPEC_CONFIG_DIR would be seen above
        try:
            if not os.listdir(folder):
                return {}
        except OSError:  # no such folder (or not one we may read): fsspec reads nothing from it either
            return {}
    import fsspec.config

    return dict(fsspec.config.conf.get(protocol, {}))


def direct_reader(options: Mapping[str, Any], *, environ: Mapping[str, str]) -> ObstoreReader | None:
    """An obstore reader (and lister) made from the s3fs options alone, without importing s3fs or botocore.

    Only where nothing needs botocore to resolve: the credentials are given (options or fsspec's config, e.g.
    ``FSSPEC_S3_KEY``) or anonymous, and the endpoint is given or the region is (a bucket on AWS is in the region
    botocore would find it in only if that was said).  Else None: s3fs lists, and :func:`s3_reader` maps what it
    resolved.  ``environ`` is the process environment, as botocore would read it.
    """
    try:
        import obstore  # noqa: F401
    except ImportError:
        return None
    merged: dict[str, Any] = {}
    for proto in ("s3", "s3a"):  # as fsspec applies its config to s3fs's keyword arguments
        merged.update(fsspec_config(proto))
    merged.update(options)
    client_kwargs = dict(merged.get("client_kwargs") or {})
    config_kwargs = dict(merged.get("config_kwargs") or {})
    key = merged.get("key") or merged.get("username") or client_kwargs.get("aws_access_key_id")
    secret = merged.get("secret") or merged.get("password") or client_kwargs.get("aws_secret_access_key")
    token = merged.get("token") or client_kwargs.get("aws_session_token")
    anon = merged.get("anon") is True
    if not anon and not (key and secret):
        return None  # botocore's credential chain: environment, profiles, SSO, instance roles
    if merged.get("profile") or merged.get("session") or merged.get("version_aware") or merged.get("cache_regions"):
        return None
    endpoint = merged.get("endpoint_url") or client_kwargs.get("endpoint_url")
    region = (client_kwargs.get("region_name") or config_kwargs.get("region_name") or environ.get("AWS_REGION")
              or environ.get("AWS_DEFAULT_REGION"))
    if not endpoint and (not region or any(k.startswith("AWS_ENDPOINT_URL") for k in environ)):
        return None
    config_file = environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    if not region and os.path.exists(config_file):
        return None  # a profile may name the region
    plan = plan_obstore(options=merged, endpoint_url=endpoint, client_kwargs=client_kwargs,
                        config_kwargs=config_kwargs, anon=anon, static_credentials=not anon,
                        requester_pays=bool(merged.get("requester_pays")),
                        s3_additional_kwargs=dict(merged.get("s3_additional_kwargs") or {}),
                        use_ssl=merged.get("use_ssl", True) is not False, region=region, resolved_endpoint=None)
    if isinstance(plan, str):
        return None
    frozen = {"access_key_id": str(key or ""), "secret_access_key": str(secret or ""),
              "token": str(token) if token else None, "expires_at": None}
    log.debug("listing and reading s3:// through obstore alone (%s)", redact(str(plan.config.get("endpoint", "AWS"))))
    return ObstoreReader(plan, None if anon else (lambda: frozen))


def _session_credentials(fs: Any) -> Callable[[], dict[str, Any]] | None:
    """botocore's credential chain (environment, profile, SSO, instance role), refreshed as botocore refreshes it."""
    from fsspec.asyn import sync

    creds = sync(fs.loop, fs.session.get_credentials)
    if creds is None:
        return None
    refreshable = hasattr(creds, "refresh_needed")

    def provide() -> dict[str, Any]:
        frozen = sync(fs.loop, creds.get_frozen_credentials)
        later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": later if refreshable else None}

    return provide


__all__ = ["Buffer", "ObstorePlan", "ObstoreReader", "RangeReader", "S3fsReader", "direct_reader", "fsspec_config",
           "plan_obstore", "precondition_failed", "s3_reader", "translate"]
