"""The two kinds of tier a checkpoint lives on, behind one small interface.

:class:`FolderTier` is a local or mounted folder (node-local NVMe or tmpfs, NFS, Lustre...): a file
is written under a temp name and renamed, the marker too, with fsync where the tier survives a
reboot.  :class:`ObjectTier` is any other fsspec URL (``s3://`` with an ``endpoint_url``...): an
object appears only when its upload completes (a multipart upload is aborted on error), and the
marker object is uploaded after every file.  Listing, reading the marker and removing a step
(marker first, so that a half-removed step is never taken for complete) are the same on both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from .. import digest as dg
from ..cache.manifest import Manifest
from ..cache.tiers import mount_of
from ..errors import ManifestError, MissingDependencyError, UsageError
from ..fsio import atomic_write, fsync_dir
from ..retry import redact
from .layout import MARKER, TMP_PREFIX, parse_step, step_name

log = logging.getLogger(__name__)
CHUNK = 8 << 20


class Writer(Protocol):
    def write(self, data: bytes | bytearray | memoryview, /) -> int | None: ...


class Tier(Protocol):
    """What the checkpoint code needs of a tier."""

    url: str
    is_folder: bool

    def steps(self) -> list[int]: ...
    def read_marker(self, step: int) -> Manifest | None: ...
    def open_read(self, step: int, rel: str) -> BinaryIO: ...
    def size(self, step: int, rel: str) -> int | None: ...
    def writing(self, step: int, rel: str) -> contextlib.AbstractContextManager[Writer]: ...
    def write_marker(self, step: int, marker: Manifest) -> None: ...
    def remove(self, step: int) -> None: ...


def open_tier(url: str, storage_options: dict[str, Any] | None = None, *, fsync: bool | None = None) -> Tier:
    """A folder tier for a path or ``file://`` URL, an object tier for any other fsspec URL."""
    if not url:
        raise UsageError("a checkpoint tier needs a path or URL, not an empty string")
    if "://" not in url or url.startswith(("file://", "local://")):
        return FolderTier(url.split("://", 1)[-1], fsync=fsync)
    return ObjectTier(url, storage_options or {})


def complete_steps(tier: Tier) -> list[int]:
    """Steps whose marker loads (and, on a folder, whose files have the recorded sizes), oldest first."""
    return [s for s in tier.steps() if is_complete(tier, s)]


def latest_complete(tier: Tier, below: int | None = None) -> int | None:
    """The newest complete step (below ``below`` if given), reading markers newest first."""
    for step in sorted(tier.steps(), reverse=True):
        if (below is None or step < below) and is_complete(tier, step):
            return step
    return None


def is_complete(tier: Tier, step: int) -> bool:
    marker = tier.read_marker(step)
    if marker is None:
        return False
    if tier.is_folder:  # a stat per file: cheap, and it catches a truncated or missing file
        return all(tier.size(step, e.path) == e.size for e in marker)
    return True


def hash_file_on(tier: Tier, step: int, rel: str, buf: bytearray) -> tuple[str, int]:
    """Stream one file of a tier through xxh3-128: ``(digest, size)``."""
    view = memoryview(buf)
    hasher = dg.new_hasher()
    size = 0
    with tier.open_read(step, rel) as f:
        while n := f.readinto(view):  # type: ignore[attr-defined]
            hasher.update(view[:n])
            size += n
    return dg.format_digest(hasher), size


def verify_step(tier: Tier, step: int, marker: Manifest) -> dict[str, str]:
    """Re-hash every file of ``step`` against ``marker``: relative path -> what is wrong (empty when whole)."""
    bad: dict[str, str] = {}
    buf = bytearray(CHUNK)
    for e in marker:
        try:
            got, size = hash_file_on(tier, step, e.path, buf)
        except FileNotFoundError:
            bad[e.path] = "missing"
            continue
        except OSError as exc:
            bad[e.path] = f"unreadable ({exc})"
            continue
        if size != e.size:
            bad[e.path] = f"{size} bytes, the marker says {e.size}"
        elif got != e.digest:
            bad[e.path] = f"digest {got}, the marker says {e.digest}"
    return bad


class FolderTier:
    """A local or mounted folder."""

    is_folder = True

    def __init__(self, path: str, *, fsync: bool | None = None) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(path)))
        self.url = str(self.root)
        self._fsync = fsync

    @property
    def fsync(self) -> bool:
        """fsync files and folders unless the tier is memory (tmpfs), which a reboot loses anyway."""
        if self._fsync is None:
            self._fsync = not mount_of(self.root if self.root.exists() else self.root.parent).is_memory
        return self._fsync

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(parse_step, names) if s is not None)

    def read_marker(self, step: int) -> Manifest | None:
        path = self.step_dir(step) / MARKER
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return _parse_marker(raw, str(path))

    def open_read(self, step: int, rel: str) -> BinaryIO:
        return open(self.step_dir(step) / rel, "rb", buffering=0)

    def size(self, step: int, rel: str) -> int | None:
        try:
            return os.stat(self.step_dir(step) / rel).st_size
        except OSError:
            return None

    @contextlib.contextmanager
    def writing(self, step: int, rel: str) -> Iterator[Writer]:
        final = self.step_dir(step) / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}")
        f = open(tmp, "xb", buffering=0)  # noqa: SIM115 (closed below, on every path)
        try:
            yield f
            if self.fsync:
                os.fsync(f.fileno())
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        f.close()
        os.replace(tmp, final)

    def write_marker(self, step: int, marker: Manifest) -> None:
        d = self.step_dir(step)
        if self.fsync:
            fsync_dir(d)  # the files' renames are durable before the marker that vouches for them
        atomic_write(d / MARKER, marker.to_json(), fsync=self.fsync)

    def remove(self, step: int) -> None:
        d = self.step_dir(step)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(d / MARKER)
        doomed = d.with_name(f"{TMP_PREFIX}deleting-{d.name}-{secrets.token_hex(4)}")
        try:
            os.rename(d, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def remove_marker(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.step_dir(step) / MARKER)

    def sweep_temp(self) -> None:
        """Remove what a killed writer left: temp files in step folders, half-deleted folders."""
        if not self.root.is_dir():
            return
        for entry in os.scandir(self.root):
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif parse_step(entry.name) is not None and entry.is_dir():
                for sub in Path(entry.path).rglob(f"{TMP_PREFIX}*"):
                    with contextlib.suppress(OSError):
                        sub.unlink()


class ObjectTier:
    """Any fsspec URL that is not a folder: an object store (s3://, gs://...) or an fsspec file system."""

    is_folder = False

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import fsspec

        try:
            self.fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError:
            raise MissingDependencyError(
                f"{url}: this URL needs an fsspec implementation: pip install s3fs for s3:// "
                "(stagingloader's [s3] extra: pip install '.[s3]' in its checkout)"
            ) from None
        except (ValueError, TypeError) as e:
            raise UsageError(f"bad checkpoint URL or storage option for {url}: {e}") from None
        self.base = path.rstrip("/")
        self.url = redact(url.rstrip("/"))  # what logs, errors and the settings file show: no user:password@

    def _path(self, step: int, rel: str = "") -> str:
        return f"{self.base}/{step_name(step)}" + (f"/{rel}" if rel else "")

    def steps(self) -> list[int]:
        try:
            names = self.fs.ls(self.base, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(parse_step, names) if s is not None)

    def read_marker(self, step: int) -> Manifest | None:
        path = self._path(step, MARKER)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return _parse_marker(raw, f"{self.url}/{step_name(step)}/{MARKER}")

    def open_read(self, step: int, rel: str) -> BinaryIO:
        f: BinaryIO = self.fs.open(self._path(step, rel), "rb", block_size=CHUNK, cache_type="none")
        return f

    def size(self, step: int, rel: str) -> int | None:
        try:
            return int(self.fs.info(self._path(step, rel))["size"])
        except FileNotFoundError:
            return None

    def _open_write(self, path: str) -> Any:
        try:
            return self.fs.open(path, "wb", block_size=CHUNK)
        except FileNotFoundError:  # a file system with folders (an fsspec-mounted one): make them
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            return self.fs.open(path, "wb", block_size=CHUNK)

    @contextlib.contextmanager
    def writing(self, step: int, rel: str) -> Iterator[Writer]:
        f = self._open_write(self._path(step, rel))
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # s3fs: abort the multipart upload; nothing appears under the name
                f.closed = True
            raise
        f.close()

    def write_marker(self, step: int, marker: Manifest) -> None:
        with self._open_write(self._path(step, MARKER)) as f:
            f.write(marker.to_json())

    def remove(self, step: int) -> None:
        self.remove_marker(step)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(step), recursive=True)

    def remove_marker(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(step, MARKER))


def _parse_marker(raw: bytes, where: str) -> Manifest | None:
    try:
        return Manifest.parse(raw, where)
    except ManifestError as e:
        log.warning("ignoring checkpoint %s: its commit marker does not load (%s)", where, e)
        return None
