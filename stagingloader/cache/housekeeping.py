"""What is staged (``ls``), eviction (``gc``) and dropping leases (``release``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheError, DatasetNotFoundError, ManifestError
from . import leases, trust
from .capacity import auto_candidates
from .layout import DatasetDir, current_user, find_dataset_dir
from .locking import DatasetLock, is_locked
from .registry import known_roots


@dataclass(frozen=True)
class DatasetInfo:
    key: str
    path: str
    source: str
    version: str | None
    files: int
    bytes: int
    leases: list[str]
    last_used: float
    state: str  #: ready | staging | incomplete | broken

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def roots(root: str, env: Mapping[str, str]) -> list[Path]:
    """The staging roots to look in: the one given; or, for ``auto``, ``$STAGINGLOADER_ROOT``, every ``auto``
    candidate that exists, and every root this user staged into on this node (so nobody has to remember
    which ``--root`` they gave)."""
    if root != "auto":
        return [Path(root).expanduser().absolute()]
    out = []
    if env.get("STAGINGLOADER_ROOT"):
        out.append(Path(env["STAGINGLOADER_ROOT"]).expanduser().absolute())
    out += [p for p, _ in auto_candidates(env, current_user()) if _own_folder(p)]
    out += known_roots(env)
    unique: dict[str, Path] = {}
    for p in out:
        unique.setdefault(os.path.realpath(p), p)
    return list(unique.values())


def _own_folder(path: Path) -> bool:
    """Is ``path`` a real folder of the caller's (a ``stagingloader-$USER`` someone else made is not looked in)?"""
    try:
        trust.check_folder(path)
    except (OSError, CacheError):
        return False
    return True


def datasets(root: Path) -> Iterator[DatasetDir]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False) and os.path.exists(os.path.join(entry.path, "dataset.json")):
                yield DatasetDir(Path(entry.path))


def describe(ddir: DatasetDir) -> DatasetInfo:
    info = ddir.read_info()
    files = size = 0
    state = "ready"
    try:
        version = ddir.current()
        if version is not None:
            m = ddir.load_manifest(version)
            files, size = len(m), m.total_bytes
        else:
            state = "incomplete"
    except (ManifestError, CacheError):
        version, state = None, "broken"
    if is_locked(ddir.lock_file):
        state = "staging"
    live = leases.live(ddir)
    return DatasetInfo(ddir.key, str(ddir.path), str(info.get("source", "?")), version, files, size,
                       sorted(f"{lease.name}@{lease.version}" for lease in live), ddir.last_used(), state)


def list_datasets(root: str, env: Mapping[str, str]) -> list[DatasetInfo]:
    return [describe(d) for r in roots(root, env) for d in datasets(r)]


def gc(root: str, keep_bytes: int, env: Mapping[str, str], *, dry_run: bool = False) -> dict[str, Any]:
    """Evict least recently used datasets until at most ``keep_bytes`` stay staged.

    Old versions no lease holds go first; then whole datasets, oldest use first.  A dataset
    with a live lease, or one being staged (locked), is never touched.
    """
    found = [d for r in roots(root, env) for d in datasets(r) if _own_folder(d.path)]  # never another user's
    removed = [name for d in found for name in _drop_old_versions(d, dry_run=dry_run)]
    infos = [describe(d) for d in found]
    total = sum(i.bytes for i in infos)
    busy: list[str] = []
    for info in sorted(infos, key=lambda i: i.last_used):
        if total <= keep_bytes:
            break
        if _evict(info, dry_run=dry_run):
            removed.append(info.key)
            total -= info.bytes
        else:
            busy.append(info.key)
    return {"removed": removed, "busy": busy, "remaining_bytes": total, "keep_bytes": keep_bytes,
            "dry_run": dry_run, "time": time.time()}


def _drop_old_versions(d: DatasetDir, *, dry_run: bool) -> list[str]:
    """Remove versions other than ``current`` that no live lease holds; return their names."""
    if is_locked(d.lock_file):
        return []
    held = {lease.version for lease in leases.live(d)}
    current = d.current()
    doomed = [v for v in d.versions() if v != current and v not in held]
    if not dry_run:
        for v in doomed:
            d.remove_version(v)
    return [f"{d.key}/{v}" for v in doomed]


def _evict(info: DatasetInfo, *, dry_run: bool) -> bool:
    """Remove a whole dataset unless it is leased or being staged; True if it went (or would go)."""
    if info.leases or info.state == "staging":
        return False
    d = DatasetDir(Path(info.path))
    lock = DatasetLock(d.lock_file, timeout=0)
    if not lock.try_acquire():
        return False
    try:
        if leases.live(d):
            return False
        if not dry_run:
            d.remove()
        return True
    finally:
        lock.release()


def find(dataset: str, root: str, env: Mapping[str, str], *,
         key_of: Callable[[str], str | None] | None = None) -> DatasetDir:
    """A staged dataset given by its path, its key, or its source URL (looked up under the roots).

    ``key_of`` maps a source URL to its dataset key (the caller knows how to read a source; the cache does not).
    """
    p = Path(dataset).expanduser()
    if p.exists() and not _looks_like_source(p):
        return find_dataset_dir(p)[0]
    wanted = {dataset.rstrip("/")}
    key = key_of(dataset) if key_of is not None else None
    if key:
        wanted.add(key)
    for r in roots(root, env):
        for d in datasets(r):
            if d.key in wanted or d.read_info().get("source", "").rstrip("/") in wanted:
                return d
    raise DatasetNotFoundError(
        f"no staged dataset matches {dataset} under {', '.join(map(str, roots(root, env))) or 'any root'}; "
        "see `stagingloader ls`, or pass --root"
    )


def _looks_like_source(p: Path) -> bool:
    return p.is_dir() and not (p / "dataset.json").exists() and not (p / "manifest.json").exists() \
        and not (p.parent / "manifest.json").exists()
