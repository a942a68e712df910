"""Where things live under a staging root.

::

    ROOT/<key>/                  one dataset (mode 0700 unless shared)
        dataset.json             its source and selection (no secrets)
        .lock  .lock.info        the staging lock (flock) and who holds it
        current -> v3            the published version: switched by one atomic rename
        v3/manifest.json         a complete, immutable version
        v3/data/...              the staged tree, mirroring the source's relative paths
        incoming/                a version being staged (resumable): data/, .partial/, journal.jsonl
        leases/<name>.json       who uses which version
        repair.json              files `verify` found bad, repaired by the next `stage`
        last_used                its mtime is the time of last use (for gc)
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CacheError, ManifestError, UnsafePathError
from ..fsio import atomic_write
from . import trust
from .manifest import LikeColumns, Manifest

_VERSION_RE = re.compile(r"^v(\d+)$")


def dataset_key(identity: str) -> str:
    """A readable, collision-free folder name for a source identity."""
    tail = identity.split("://", 1)[-1].split("@", 1)[0].rstrip("/")
    words = [w for w in re.split(r"[^A-Za-z0-9._-]+", "-".join(tail.split("/")[-2:])) if w]
    slug = "-".join(words).strip(".-")[:48] or "dataset"
    return f"{slug}-{xxhash.xxh3_64_hexdigest(identity.encode())[:12]}"


def safe_join(base: Path, rel: str) -> Path:
    """``base / rel`` for a validated relative path (no '..', no absolute part)."""
    if rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
        raise UnsafePathError(f"refusing to write {rel!r}: it would leave {base}")
    return base / rel


@dataclass(frozen=True)
class DatasetDir:
    """The folder of one dataset under a root, and the paths inside it."""

    path: Path

    @property
    def key(self) -> str:
        return self.path.name

    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    @property
    def incoming(self) -> Path:
        return self.path / "incoming"

    @property
    def leases(self) -> Path:
        return self.path / "leases"

    @property
    def repair_file(self) -> Path:
        return self.path / "repair.json"

    def version_dir(self, version: str) -> Path:
        return self.path / version

    def versions(self) -> list[str]:
        """Complete-looking version folders, oldest first."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                m = _VERSION_RE.match(entry.name)
                if m and entry.is_dir(follow_symlinks=False):
                    found.append((int(m.group(1)), entry.name))
        return [name for _, name in sorted(found)]

    def next_version(self) -> str:
        versions = self.versions()
        return f"v{int(versions[-1][1:]) + 1 if versions else 1}"

    def current(self) -> str | None:
        """The published version: the ``current`` link if it names a complete version.

        ``current`` must be a link stagingloader wrote: relative, naming a real version folder beside it.
        Anything else there raises :class:`CacheError` naming what to remove."""
        link = self.path / "current"
        st = trust.lstat(link)
        if st is None:
            return None
        fix = (f"remove it (rm -r {link}); the next `stagingloader stage` points it at the newest complete "
               "version again")
        if not stat.S_ISLNK(st.st_mode):
            raise CacheError(f"{link} is {trust.kind_of(st)}, not the link stagingloader writes; {fix}")
        target = os.readlink(link)
        if not _VERSION_RE.match(target):
            raise CacheError(f"{link} points at {target!r}, which is not a version folder of {self.path}; {fix}")
        vst = trust.lstat(self.path / target)
        if vst is None:
            return None
        if not stat.S_ISDIR(vst.st_mode):
            raise CacheError(f"{self.path / target} is {trust.kind_of(vst)}, not a version folder; remove it "
                             f"(rm -r {self.path / target}) and stage again")
        return target if trust.check_file(self.path / target / "manifest.json", what="manifest") else None

    def newest_complete(self) -> str | None:
        """The newest version folder with a manifest (``current`` may be missing: a killed switch)."""
        for v in reversed(self.versions()):
            if trust.check_file(self.version_dir(v) / "manifest.json", what="manifest") is not None:
                return v
        return None

    def check(self, *, writable: bool) -> None:
        """Raise :class:`CacheError` unless this folder and what it holds can be trusted (see ``trust``).

        ``writable``: the caller stages here, so the folder must be its own; else it only reads it, and a
        folder of root's (a site-shared copy) will do.  Either way nothing in it may belong to anyone else,
        the folders stagingloader reads or walks are real folders (never links), and ``current`` is sound."""
        fix = "remove it (rm -r {path}) and stage again, or pick another --root"
        owners = trust.trusted_owners()
        st = trust.check_folder(self.path, owners=None if writable else owners, what="dataset folder", fix=fix)
        if not writable:
            owners = frozenset({st.st_uid})
        for entry in os.scandir(self.path):
            try:
                self._check_entry(entry, owners)
            except FileNotFoundError:  # gone since the listing: replaced (last_used), published or removed by
                continue               # another stager or gc, which hold the same rules
        self.current()

    def _check_entry(self, entry: os.DirEntry[str], owners: frozenset[int]) -> None:
        path = Path(entry.path)
        trust.check_entry(path, entry.stat(follow_symlinks=False), owners)
        if entry.name in ("incoming", "leases") or _VERSION_RE.match(entry.name):
            trust.check_folder(path, owners=owners, what="cache folder")
            for sub in ("data", ".partial") if entry.name != "leases" else ():
                if trust.lstat(path / sub) is not None:
                    trust.check_folder(path / sub, owners=owners, what="cache folder")
            if entry.name != "leases":
                trust.check_file(path / "manifest.json", what="manifest")

    def publish(self, version: str) -> None:
        """Point ``current`` at ``version`` with one atomic rename."""
        tmp = self.path / f".current-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(version, tmp)
        os.replace(tmp, self.path / "current")

    def load_manifest(self, version: str, *, like: LikeColumns | None = None) -> Manifest:
        """``version``'s manifest; ``like``: the listing just made, whose columns it shares where the same."""
        path = self.path / version / "manifest.json"
        trust.check_file(path, what="manifest")
        return Manifest.load(path, like=like)

    def read_info(self) -> dict[str, Any]:
        """``dataset.json`` (source, selection), read bounded, never through a link or from a pipe; {} if unusable."""
        try:
            info = json.loads(trust.read_small(self.path / "dataset.json"))
        except (OSError, ValueError):
            return {}
        return dict(info) if isinstance(info, dict) else {}

    def write_info(self, info: dict[str, Any]) -> None:
        atomic_write(self.path / "dataset.json", json.dumps(info, indent=1).encode())

    def touch(self) -> None:
        fd = os.open(self.path / "last_used", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.utime(fd)
        finally:
            os.close(fd)

    def last_used(self) -> float:
        try:
            return (self.path / "last_used").stat().st_mtime
        except OSError:
            return 0.0

    def read_repairs(self) -> dict[str, list[str]]:
        try:
            return dict(json.loads(self.repair_file.read_text()))
        except (OSError, ValueError):
            return {}

    def write_repairs(self, repairs: dict[str, list[str]]) -> None:
        if repairs:
            atomic_write(self.repair_file, json.dumps(repairs).encode())
        else:
            with contextlib.suppress(FileNotFoundError):
                self.repair_file.unlink()

    def remove_version(self, version: str) -> None:
        """Delete a version; rename first, so a half-deleted one never looks complete."""
        src = self.path / version
        doomed = self.path / f".deleting-{version}-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(src, doomed)
            trust.remove_tree(doomed)

    def remove(self) -> None:
        """Delete the whole dataset: renamed aside first (``.deleting-*``), so nothing half-deleted is ever found
        under its name; a killed deletion is finished by the parent's next sweep."""
        doomed = self.path.with_name(f".deleting-{self.key}-{os.getpid()}")
        os.rename(self.path, doomed)
        trust.remove_tree(doomed)

    def sweep_deleting(self) -> None:
        """Finish deletions a killed process left behind."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                if entry.name.startswith(".deleting-"):
                    trust.remove_tree(Path(entry.path))


def find_dataset_dir(path: Path) -> tuple[DatasetDir, str | None]:
    """Given a dataset folder, a version folder or its data/ folder: the dataset and version."""
    path = path.resolve()
    for candidate in (path, path.parent, path.parent.parent):
        if _VERSION_RE.match(candidate.name) and (candidate / "manifest.json").exists():
            return DatasetDir(candidate.parent), candidate.name
        if (candidate / "dataset.json").exists():
            return DatasetDir(candidate), None
    raise ManifestError(f"{path} is not a staged dataset (no dataset.json or manifest.json found there)")


def current_user() -> str:
    """The user name this process runs as (its uid where the name cannot be looked up)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
