"""Sources: any fsspec URL, listed as (relative path, size, fingerprint) and read by ranges.

Local and mounted paths (NFS, Lustre, GPFS...) are listed with ``os.scandir`` directly: it is
several times faster than a generic walk and lets the stager follow symlinks safely.  Every
relative path is validated: nothing from a source can name a place outside the staging root
(``..``, a leading ``/``) or make the stager read outside the source (a symlink pointing out).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from ..cache.manifest import SOURCE_MANIFEST_NAME, Manifest
from ..cache.tiers import mount_of
from ..cache.trust import kind_of
from ..errors import (
    MissingDependencyError,
    SourceError,
    SourceNotFoundError,
    UnsafePathError,
    UsageError,
)
from ..retry import RetryPolicy, as_source_error, call_with_retry, redact
from .listing import Listing, ListingBuilder, SourceFile, check_for_others, scan_local
from .objectio import Buffer, ObstoreReader, RangeReader, direct_reader, s3_reader
from .scanning import list_tree, listing_threads

__all__ = ["Listing", "Source", "SourceFile", "selected", "validate_rel"]

GLOB_CHARS = "*?["
#: kernel file systems: their files are not data (sizes read 0, contents made on read), never a source
PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "debugfs", "tracefs", "securityfs", "cgroup", "cgroup2",
                       "configfs", "pstore", "bpf", "efivarfs", "fusectl", "mqueue", "hugetlbfs", "binfmt_misc"})
_INSTALL_HINTS = {
    "s3": "pip install s3fs (stagingloader's [s3] extra: pip install '.[s3]' in its checkout)",
    "s3a": "pip install s3fs (stagingloader's [s3] extra: pip install '.[s3]' in its checkout)",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "http": "pip install aiohttp (stagingloader's [http] extra: pip install '.[http]' in its checkout)",
    "https": "pip install aiohttp (stagingloader's [http] extra: pip install '.[http]' in its checkout)",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
}


def validate_rel(rel: str) -> str:
    """Return ``rel`` if it is a safe relative path; else raise :class:`UnsafePathError` naming it."""
    if not rel or rel.startswith("/") or "\0" in rel or "\\" in rel:
        raise UnsafePathError(f"refusing unsafe name {rel!r} in the source: it is empty, absolute or has NUL/\\")
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(
                f"refusing unsafe name {rel!r} in the source: a '..', '.' or empty component could "
                "escape the staging root; rename the object or exclude it with --exclude"
            )
    return rel


def _matches(rel: str, patterns: Sequence[str]) -> bool:
    base = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel if "/" in p else base, p) for p in patterns)


def selected(rel: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    if include and not _matches(rel, include):
        return False
    return not (exclude and _matches(rel, exclude))


class Source:
    """A dataset's source: an fsspec filesystem and a base path (a folder, a prefix or a glob)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url.strip():
            raise UsageError(f"the source is empty ({url!r}): give a folder, a file or a URL such as "
                             "s3://bucket/prefix (write . for the current folder)")
        self.url = redact(url)  #: for people and records; the filesystem gets the URL as given
        self.storage_options = dict(storage_options or {})
        self.protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
        self.is_local = self.protocol in ("file", "local")
        check_storage_options(self.protocol, self.storage_options)
        self.retry = RetryPolicy()
        self._reader: RangeReader | None = None
        self._reader_lock = threading.Lock()
        if self.is_local:
            path = url.split("://", 1)[1] if "://" in url else url
            self._fs: Any = None
            self.pattern = os.path.abspath(os.path.expanduser(path)) if any(c in path for c in GLOB_CHARS) else ""
            self.base = os.path.realpath(os.path.expanduser(path)) if not self.pattern else ""
        else:
            self._given = url  #: for the filesystem, made when first needed
            direct = direct_reader(self.storage_options, environ=os.environ) if self.protocol in ("s3", "s3a") else None
            if direct is not None:  # s3fs would only have been asked for its options: it is not even imported
                self._reader, self._fs = direct, None
                path = url.split("://", 1)[1].split("?", 1)[0]
            else:
                self._fs, path = _filesystem(url, self.storage_options)
            path = path.rstrip("/")
            self.pattern = path if any(c in path for c in GLOB_CHARS) else ""
            self.base = path
        if self.pattern:
            head = self.pattern[: min(self.pattern.find(c) for c in GLOB_CHARS if c in self.pattern)]
            self.base = head.rsplit("/", 1)[0] if "/" in head else ""
            if self.is_local:
                self.base = os.path.realpath(self.base or ".")
        self._single = False
        self._manifest: Manifest | None = None  #: the source manifest, once read

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (for worker processes): the reader and its lock are made again where they are used; the source
        manifest is read again where it is needed."""
        state = dict(self.__dict__)
        state["_reader"], state["_reader_lock"], state["_manifest"] = None, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reader_lock = threading.Lock()
        if self.protocol in ("s3", "s3a") and self._fs is None:
            self._reader = direct_reader(self.storage_options, environ=os.environ)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (None for a local path); for an S3 source that obstore serves alone, made on first
        use (writing a manifest, a glob)."""
        if self._fs is None and not self.is_local:
            self._fs, _ = _filesystem(self._given, self.storage_options)
        return self._fs

    def _lister(self) -> Any:
        """What lists and reads whole objects: obstore when it serves this source alone, else the filesystem."""
        return self._reader if isinstance(self._reader, ObstoreReader) and self._fs is None else self.fs

    @property
    def kind(self) -> str:
        """'local', 'object' or 'http': sizes the copy pool (more threads for object stores)."""
        if self.is_local:
            return "local"
        return "http" if self.protocol in ("http", "https") else "object"

    def identity(self) -> str:
        """What makes two sources the same dataset: the URL and the endpoint, never secrets."""
        endpoint = self.storage_options.get("endpoint_url") or self.storage_options.get(
            "client_kwargs", {}
        ).get("endpoint_url", "")
        where = redact(self.pattern or self.base)
        return f"{self.protocol}://{where}" + (f"@{redact(str(endpoint))}" if endpoint else "")

    def path_of(self, rel: str) -> str:
        if self._single:
            return self.base
        return f"{self.base}/{rel}" if self.base else rel

    # ---- listing ---------------------------------------------------------------------------
    def listing(self, include: Sequence[str] = (), exclude: Sequence[str] = (), *, for_others: bool = False,
                workers: int | None = None) -> Listing:
        """List the source into columns, sorted by relative path. Raises SourceError naming what is wrong.
        ``for_others`` (a local source only): refused, naming the first path, unless every user may read the source
        folder and all in it (:class:`~.listing.NotForOthersError`), checked on the listing's own ``stat`` calls.
        ``workers``: processes that walk a local folder (default: one per core, at most 8)."""
        files = self._list_local(for_others, workers) if self.is_local else Listing.from_files(
            f for f in self._list_remote() if f.rel != SOURCE_MANIFEST_NAME)
        return self.selected(files, include, exclude)

    def selected(self, files: Listing, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Listing:
        """The files of ``files`` that ``include`` and ``exclude`` keep; a SourceError if none is left."""
        if include or exclude:
            keep = np.fromiter((selected(rel, include, exclude) for rel in files.path), dtype=bool, count=len(files))
            files = files.mask(keep)
        if not len(files):
            what = f" matching --include {list(include)}" if include else ""
            raise SourceError(f"source {self.url} holds no files{what}: nothing to stage")
        return files

    @property
    def is_folder(self) -> bool:
        """A local folder named as it is (no glob pattern, no single file)."""
        return self.is_local and not self.pattern and not self._single and os.path.isdir(self.base)

    def _list_local(self, for_others: bool = False, workers: int | None = None) -> Listing:
        out = ListingBuilder(for_others=for_others)
        if self.pattern:
            import glob

            for match in sorted(glob.glob(self.pattern, recursive=True)):
                rel = os.path.relpath(match, self.base)
                if os.path.isdir(match):
                    scan_local(os.path.realpath(match), self.base, rel + "/", out, on_error=as_source_error)
                else:
                    _scan_one(match, self.base, rel, out)
            if not len(out.paths) and not os.path.isdir(self.base):
                raise SourceNotFoundError(f"source {self.url} does not exist; check the path")
            found = out.listing()
            return Listing.from_files(f for f in found if f.rel != SOURCE_MANIFEST_NAME)  # globs may overlap
        try:
            st = os.stat(self.base)
        except FileNotFoundError:
            raise SourceNotFoundError(f"source {self.url} does not exist; check the path") from None
        except OSError as e:
            raise as_source_error(e, self.url) from e
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise SourceError(f"source {self.url} is {kind_of(st)}, not a file or a folder: stage a folder of files, "
                              "a file, or a URL such as s3://bucket/prefix")
        mount = mount_of(self.base)
        fs_type = mount.fs_type
        if fs_type in PSEUDO_FS:
            raise SourceError(f"source {self.url} is on {fs_type}, a kernel file system whose files are not data "
                              "(their sizes read 0): copy what you need into a folder first")
        if for_others:
            check_for_others(self.base, st)
        if stat.S_ISREG(st.st_mode):
            self._single = True
            out.add(os.fsencode(os.path.basename(self.base)), st)
            return out.listing()
        return list_tree(self.base, skip_top=os.fsencode(SOURCE_MANIFEST_NAME), for_others=for_others,
                         threads=listing_threads(mount), workers=workers)

    def _list_remote(self) -> list[SourceFile]:
        def listing() -> dict[str, dict[str, Any]]:
            if self.pattern:
                found: dict[str, dict[str, Any]] = self.fs.glob(self.pattern, detail=True)
                for name, info in list(found.items()):
                    if info.get("type") == "directory":
                        del found[name]
                        found.update(self.fs.find(name, detail=True, withdirs=False))
                return found
            return dict(self._lister().find(self.base, detail=True, withdirs=False))

        found = call_with_retry(listing, self.url, self.retry)
        if not found:
            info = call_with_retry(lambda: self._lister().info(self.base), self.url, self.retry)
            if info.get("type") == "file":
                self._single = True
                found = {self.base: info}
                return [_remote_entry(self.base.rsplit("/", 1)[-1], info)]
        prefix = self.base + "/" if self.base else ""
        out = []
        for name, info in found.items():
            name = name.rstrip("/") if info.get("type") == "directory" else name
            if info.get("type") == "directory" or name.endswith("/"):
                continue
            if self.protocol in ("http", "https") and name == self.base:
                self._single = True
                return [_remote_entry(name.rsplit("/", 1)[-1], self._with_size(name, info))]
            if not name.startswith(prefix):
                raise UnsafePathError(f"listing of {self.url} returned {name!r}, which is outside it")
            rel = validate_rel(name[len(prefix):])
            out.append(_remote_entry(rel, self._with_size(name, info)))
        return out

    def _with_size(self, name: str, info: dict[str, Any]) -> dict[str, Any]:
        if info.get("size") is None:
            info = call_with_retry(lambda: self.fs.info(name), name, self.retry)
            if info.get("size") is None:
                raise SourceError(f"{name}: the server does not say how large it is (no Content-Length)")
        return info

    # ---- reading ---------------------------------------------------------------------------
    def read_range(self, rel: str, start: int, end: int, etag: str = "") -> Buffer:
        """Bytes ``[start, end)`` of a remote file (bytes or a read-only view), retried on transient errors.

        Thread-safe: the copier calls it from many threads at once.  On S3 (through :mod:`.objectio`), with the
        ``etag`` (``ETAG[@VERSION]``) the listing gave, every range is read from that one object version
        (``If-Match``, and the version id where the bucket keeps versions), so the ranges of an object
        overwritten while it is copied are never spliced: :class:`SourceChangedError` instead.
        """
        path = self.path_of(rel)
        if start >= end:
            return b""
        if self.protocol in ("s3", "s3a"):
            reader = self.object_reader()
            data: Buffer = call_with_retry(lambda: reader.read(path, start, end, etag), path, self.retry)
        else:
            data = call_with_retry(lambda: self.fs.cat_file(path, start=start, end=end), path, self.retry)
        if len(data) != end - start:
            raise SourceError(f"{path}: expected {end - start} bytes at offset {start}, got {len(data)}; "
                              "the object changed while it was read, stage again")
        return data

    def object_reader(self) -> RangeReader:
        """The client for an object store's bytes, chosen once (obstore where the options map to it, else s3fs)."""
        with self._reader_lock:
            if self._reader is None:
                self._reader = call_with_retry(lambda: s3_reader(self.fs, self.storage_options), self.url,
                                               self.retry)
            return self._reader

    def local_path(self, rel: str) -> str:
        return self.path_of(rel)

    def local_prefix(self) -> str | None:
        """What :meth:`local_path` puts before a relative path (None for a source of one file)."""
        if self._single:
            return None
        return f"{self.base}/" if self.base else ""

    def read_manifest(self) -> Manifest | None:
        """The source's own digest manifest (``stagingloader manifest``), if it has one (read once: 0.9 s at
        1.28 M files)."""
        if self._single:
            return None
        if self._manifest is not None:
            return self._manifest
        self._manifest = self._read_manifest()
        return self._manifest

    def use_manifest(self, manifest: Manifest) -> None:
        """Take ``manifest`` as the source's (read already, with the checks its use needed)."""
        self._manifest = manifest

    def _read_manifest(self) -> Manifest | None:
        path = f"{self.base}/{SOURCE_MANIFEST_NAME}" if self.base else SOURCE_MANIFEST_NAME
        if self.is_local:
            if not os.path.exists(path):
                return None
            with open(path, "rb") as f:
                return Manifest.parse(f.read(), path)
        try:
            raw = call_with_retry(lambda: self._lister().cat_file(path), path, self.retry)
        except SourceNotFoundError:
            return None
        return Manifest.parse(raw, path)

    def write_manifest(self, manifest: Manifest, dest: str | None = None, *, binary: bool = False) -> str:
        """Write the source's manifest (``binary``: version 2's columns, else version 1's plain JSON)."""
        from ..fsio import atomic_write

        target = dest or (f"{self.base}/{SOURCE_MANIFEST_NAME}" if self.base else SOURCE_MANIFEST_NAME)
        data = manifest.to_bytes() if binary else manifest.to_json()
        if self.is_local or (dest is not None and "://" not in dest):
            atomic_write(target, data)
        else:
            call_with_retry(lambda: self.fs.pipe_file(target, data), target, self.retry)
        return target


#: what every fsspec filesystem takes (AbstractFileSystem's own)
_FSSPEC_COMMON = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache",
                            "asynchronous", "loop"})


def check_storage_options(protocol: str, options: Mapping[str, Any]) -> None:
    """An unknown storage option is a usage error for every protocol, at once (not a silent no-op for a path, nor a
    retried failure for a server).  A local path takes none but fsspec's generic ones; s3:// is checked where it is
    read (obstore or s3fs: no import here); another protocol by the options its filesystem class names."""
    unknown = sorted(set(options) - _FSSPEC_COMMON)
    if not unknown or protocol in ("s3", "s3a"):
        return
    if protocol not in ("file", "local"):
        known = _named_options(protocol)
        if known is None:
            return  # cannot tell (not installed: the filesystem's own error says so)
        unknown = [k for k in unknown if k not in known]
        if not unknown:
            return
    where = "a local source (a path takes none: -o options are for s3://, gs://, https://...)" \
        if protocol in ("file", "local") else f"{protocol}:// sources"
    raise UsageError(f"unknown storage option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                     f"{where}; see `stagingloader stage --help`")


def _named_options(protocol: str) -> frozenset[str] | None:
    """The keyword arguments the filesystem of ``protocol`` names (every class of its MRO), plus, for http(s),
    what aiohttp takes per request (fsspec passes its other options there); None when it cannot be known."""
    import inspect

    try:
        import fsspec

        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        with contextlib.suppress(TypeError, ValueError):
            names.update(p.name for p in inspect.signature(init).parameters.values()
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if protocol in ("http", "https"):
        try:
            import aiohttp

            names.update(inspect.signature(aiohttp.ClientSession._request).parameters)
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
    return frozenset(names - {"self"})


#: botocore's defaults wait 60 s for a connection and retry it 4 times: a host that does not answer took
#: minutes to fail.  A user's own config_kwargs win.
_S3_CLIENT_DEFAULTS = {"connect_timeout": 5, "retries": {"max_attempts": 3, "mode": "standard"}}


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    protocol = url.split("://", 1)[0].lower()
    options = dict(storage_options)
    if protocol in ("s3", "s3a"):
        options["config_kwargs"] = {**_S3_CLIENT_DEFAULTS, **dict(options.get("config_kwargs") or {})}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError:
        hint = _INSTALL_HINTS.get(protocol, f"install the fsspec implementation for {protocol}://")
        raise MissingDependencyError(f"{protocol}:// sources need an extra package: {hint}") from None
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise UsageError(
                f"unknown URL scheme {protocol}:// in {url}; use a path, s3://, gs:// or https://"
            ) from None
        raise UsageError(f"bad source URL {url}: {e}") from None
    except TypeError as e:
        raise UsageError(f"bad storage option for {protocol}:// ({e}); see `stagingloader stage --help`") from None
    return fs, path


def _remote_entry(rel: str, info: dict[str, Any]) -> SourceFile:
    mtime = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if isinstance(mtime, datetime):
        mtime_ns = int(mtime.timestamp() * 1e9)
    elif isinstance(mtime, (int, float)):
        mtime_ns = int(mtime * 1e9)
    else:
        mtime_ns = 0
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    version = info.get("VersionId") or info.get("version_id")
    if version and version != "null":
        etag = f"{etag}@{version}"
    return SourceFile(rel, int(info["size"]), mtime_ns, etag)


def _scan_one(path: str, base: str, rel: str, out: ListingBuilder) -> None:
    real = os.path.realpath(path)
    if not (real == base or real.startswith(base + "/")):
        raise UnsafePathError(f"refusing {path}: it is a symlink to {real}, outside the source {base}")
    try:
        st = os.stat(path)
    except OSError as e:
        raise as_source_error(e, path) from e
    if out.for_others:
        check_for_others(path, st)
    out.add(os.fsencode(validate_rel(rel)), st)
