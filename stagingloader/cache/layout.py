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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import ManifestError, UnsafePathError
from ..fsio import atomic_write
from .manifest import Manifest

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
        """The published version: the ``current`` link if it names a complete version."""
        try:
            target = os.readlink(self.path / "current")
        except OSError:
            return None
        return target if _VERSION_RE.match(target) and (self.path / target / "manifest.json").exists() else None

    def publish(self, version: str) -> None:
        """Point ``current`` at ``version`` with one atomic rename."""
        tmp = self.path / f".current-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(version, tmp)
        os.replace(tmp, self.path / "current")

    def load_manifest(self, version: str) -> Manifest:
        return Manifest.load(self.path / version / "manifest.json")

    def read_info(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.path / "dataset.json").read_text()))
        except (OSError, ValueError):
            return {}

    def write_info(self, info: dict[str, Any]) -> None:
        atomic_write(self.path / "dataset.json", json.dumps(info, indent=1).encode())

    def touch(self) -> None:
        p = self.path / "last_used"
        p.touch()
        os.utime(p)

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
            shutil.rmtree(doomed, ignore_errors=True)

    def remove(self) -> None:
        """Delete the whole dataset: renamed aside first (``.deleting-*``), so nothing half-deleted is ever found
        under its name; a killed deletion is finished by the parent's next sweep."""
        doomed = self.path.with_name(f".deleting-{self.key}-{os.getpid()}")
        os.rename(self.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def sweep_deleting(self) -> None:
        """Finish deletions a killed process left behind."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                if entry.name.startswith(".deleting-"):
                    shutil.rmtree(entry.path, ignore_errors=True)


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
