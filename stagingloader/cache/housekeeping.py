"""What is staged (``ls``), eviction (``gc``) and dropping leases (``release``).

``gc`` takes each dataset's lock, the stager's own, for every decision and removal: what is current,
what is leased and what a stager is writing cannot change between its reads.  A dataset being staged
(locked) is left alone.  What a killed stager left in ``incoming/`` (no lock holder) counts against
the budget and goes before whole datasets do: on tmpfs it is memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CacheError, DatasetNotFoundError, LockTimeoutError, ManifestError, UsageError
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
    state: str  #: ready | staging | incomplete | "incomplete, N bytes in incoming/" | broken
    incoming_bytes: int = 0  #: what an unpublished (or killed) stage holds in incoming/, in blocks used
    lease_details: list[dict[str, Any]] = field(default_factory=list)  #: name, version, holder of each lease
    stale_leases: list[dict[str, Any]] = field(default_factory=list)  #: leases whose holder is gone (gc drops them)
    root: str = ""  #: the staging root it lives in

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
    """The datasets under ``root`` that pass the trust rule (:func:`.trust.trusted_folder`: the caller's or root's,
    writable by nobody else); never one that a killed ``gc`` left half-deleted (``.deleting-*``)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            if trust.trusted_folder(path) and trust.lstat(path / "dataset.json") is not None:
                yield DatasetDir(path)


def sweep_deleted(root: Path) -> None:
    """Finish the removals of whole datasets that a killed ``gc`` left renamed aside (``ROOT/.deleting-*``)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(root):
            if entry.name.startswith(".deleting-") and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


def describe(ddir: DatasetDir, *, drop_stale: bool = True) -> DatasetInfo:
    """What ``ls`` shows of one dataset.  ``drop_stale``: remove the leases whose holder is gone (else they are
    listed as stale, and left for ``gc``)."""
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
    incoming = used_bytes(ddir.incoming)
    if state == "incomplete" and incoming:
        state = f"incomplete, {incoming} bytes in incoming/"
    if is_locked(ddir.lock_file):
        state = "staging"
    stale: list[leases.Lease] = []
    if drop_stale:
        live = leases.live(ddir)
    else:
        live, stale = leases.scan(ddir)
    return DatasetInfo(ddir.key, str(ddir.path), str(info.get("source", "?")), version, files, size,
                       [f"{lease.name}@{lease.version}" for lease in live], ddir.last_used(), state, incoming,
                       [_lease_detail(lease) for lease in live], [_lease_detail(lease) for lease in stale],
                       str(ddir.path.parent))


def _lease_detail(lease: leases.Lease) -> dict[str, Any]:
    return {"name": lease.name, "version": lease.version, "holder": lease.holder, "created": lease.created}


def used_bytes(path: Path) -> int:
    """The space the files under ``path`` take (blocks, so a sparse partial file counts what it holds); links and
    what they point to are not followed."""
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


@contextlib.contextmanager
def _holding_lock(d: DatasetDir) -> Iterator[bool]:
    """The dataset's lock if it is free (True), else nothing (False): gc never waits for a stager."""
    lock = DatasetLock(d.lock_file, timeout=0)
    try:
        got = lock.try_acquire()
    except OSError:  # not ours to lock (another user's dataset), or gone
        got = False
    try:
        yield got
    finally:
        lock.release()


def list_datasets(root: str, env: Mapping[str, str]) -> list[DatasetInfo]:
    """Every dataset under the roots, stale leases shown (``gc`` drops them)."""
    return [describe(d, drop_stale=False) for r in roots(root, env) for d in datasets(r)]


def gc(root: str, keep_bytes: int, env: Mapping[str, str], *, dry_run: bool = False) -> dict[str, Any]:
    """Evict least recently used datasets until at most ``keep_bytes`` stay staged.

    Leases whose holder is gone go first (the run that took them has ended); then old versions no lease holds;
    then what killed stagers left in ``incoming/``, and datasets a refused first stage left empty; then whole
    datasets, oldest use first.  Every decision and removal is made under the dataset's lock; a dataset with a
    live lease (another job's, this user's included), or one being staged (locked), is never removed.  The result
    names the roots looked in and each dataset by its folder (two roots may hold datasets of one name).
    """
    looked = roots(root, env)
    if not dry_run:
        for r in looked:
            sweep_deleted(r)
    found = [d for r in looked for d in datasets(r) if _own_folder(d.path)]  # never another user's
    stale = 0 if dry_run else sum(len(leases.drop_stale(d)) for d in found)
    removed: list[str] = []
    paths: list[str] = []
    for d in found:
        for name in _drop_old_versions(d, dry_run=dry_run):
            removed.append(name)
            paths.append(str(d.path / name.rpartition("/")[2]))
    infos = [describe(d, drop_stale=not dry_run) for d in found]
    size = {i.path: i.bytes + i.incoming_bytes for i in infos}
    total = sum(size.values())
    by_age = sorted(infos, key=lambda i: i.last_used)
    for info in by_age:
        if total <= keep_bytes:
            break
        if info.incoming_bytes and _drop_incoming(DatasetDir(Path(info.path)), dry_run=dry_run):
            removed.append(f"{info.key}/incoming")
            paths.append(f"{info.path}/incoming")
            total -= info.incoming_bytes
            size[info.path] -= info.incoming_bytes
    gone: set[str] = set()
    for info in by_age:  # what a refused first stage left (dataset.json, .lock): nothing to keep, whatever the budget
        if info.version is None and info.state == "incomplete" and not size[info.path] and not info.leases \
                and _evict(info, dry_run=dry_run):
            removed.append(info.key)
            paths.append(info.path)
            gone.add(info.path)
    busy: list[str] = []
    kept: list[dict[str, Any]] = []
    for info in by_age:
        if total <= keep_bytes:
            break
        if info.path in gone:
            continue
        if _evict(info, dry_run=dry_run):
            removed.append(info.key)
            paths.append(info.path)
            total -= size[info.path]
        else:
            busy.append(info.key)
            kept.append({"path": info.path, "why": _why_kept(info)})
    return {"removed": removed, "removed_paths": paths, "busy": busy, "kept": kept, "remaining_bytes": total,
            "keep_bytes": keep_bytes, "dry_run": dry_run, "roots": [str(r) for r in looked],
            "stale_leases_dropped": stale, "time": time.time()}


def _why_kept(info: DatasetInfo) -> str:
    if info.lease_details:
        holders = sorted({f"{d['name']} ({d['holder']})" for d in info.lease_details})
        return "leased by " + ", ".join(holders[:3]) + (f" and {len(holders) - 3} more" if len(holders) > 3 else "")
    return "being staged" if info.state == "staging" else "locked by a stager"


def _drop_old_versions(d: DatasetDir, *, dry_run: bool) -> list[str]:
    """Remove versions other than ``current`` that no live lease holds; return their names."""
    with _holding_lock(d) as locked:
        if not locked:
            return []
        held = {lease.version for lease in (leases.scan(d)[0] if dry_run else leases.live(d))}
        current = d.current()
        doomed = [v for v in d.versions() if v != current and v not in held]
        if not dry_run:
            for v in doomed:
                d.remove_version(v)
        return [f"{d.key}/{v}" for v in doomed]


def _drop_incoming(d: DatasetDir, *, dry_run: bool) -> bool:
    """Remove what a stager that is no longer running left in ``incoming/``; True if it went (or would go)."""
    with _holding_lock(d) as locked:
        if not locked or not d.incoming.is_dir() or d.incoming.is_symlink():
            return False
        if not dry_run:
            doomed = d.path / f".deleting-incoming-{os.getpid()}"
            os.rename(d.incoming, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        return True


def evict_dataset(path: Path, *, dry_run: bool = False) -> bool:
    """Remove the whole dataset at ``path`` (a folder of the caller's own) unless it is leased or being staged, as
    ``gc`` would; True if it went (or would go).  For root's node-wide budget, run as the dataset's owner."""
    if not _own_folder(path) or trust.lstat(path / "dataset.json") is None:
        return False
    return _evict(describe(DatasetDir(path), drop_stale=not dry_run), dry_run=dry_run)


def _evict(info: DatasetInfo, *, dry_run: bool) -> bool:
    """Remove a whole dataset unless it is leased or being staged; True if it went (or would go)."""
    if info.leases or info.state == "staging":
        return False
    d = DatasetDir(Path(info.path))
    with _holding_lock(d) as locked:
        if not locked or (leases.scan(d)[0] if dry_run else leases.live(d)):
            return False
        if not dry_run:
            d.remove()
        return True


def remove(d: DatasetDir, *, chain: frozenset[tuple[int, int]], names: frozenset[str],
           dry_run: bool = False) -> dict[str, Any]:
    """Remove one whole dataset (``stagingloader rm``) once the caller's leases on it are dropped.

    ``chain`` and ``names`` say which leases are the caller's (:func:`.leases.is_callers`).  Refused, with whose
    they are, while another live lease holds it (another job's, this user's included), and while a stager holds
    its lock: :class:`UsageError` and :class:`LockTimeoutError`.  Only a folder of the caller's own is removed."""
    if not _own_folder(d.path):
        raise CacheError(f"{d.path} is not a folder of yours: it is not yours to remove")
    with _holding_lock(d) as locked:
        if not locked:
            raise LockTimeoutError(f"{d.path} is being staged{_lock_holder(d)}; wait for it to finish, then run "
                                   "`stagingloader rm` again")
        held, _stale = leases.scan(d)
        others = [lease for lease in held if not leases.is_callers(lease, chain=chain, names=names)]
        if others:
            whose = ", ".join(f"{lease.name}@{lease.version} ({lease.holder})" for lease in others[:3])
            more = f" and {len(others) - 3} more" if len(others) > 3 else ""
            raise UsageError(f"{d.path} is in use: {len(others)} lease{'s' if len(others) != 1 else ''} other than "
                             f"yours hold{'s' if len(others) == 1 else ''} it ({whose}{more}); removed when they "
                             "are released (`stagingloader release DATASET --lease NAME`) or their holders end")
        mine = [lease.name for lease in held]
        size = sum(used_bytes(d.path / v) for v in d.versions()) + used_bytes(d.incoming)
        if not dry_run:
            for name in mine:
                leases.release(d, name)
            d.remove()
    if not dry_run and d.path.parent.name == f"stagingloader-{current_user()}":
        with contextlib.suppress(OSError):  # the private folder --root auto made, now empty: nothing left in RAM
            d.path.parent.rmdir()
    return {"ok": True, "removed": str(d.path), "bytes": size, "leases_dropped": mine, "dry_run": dry_run}


def _lock_holder(d: DatasetDir) -> str:
    try:
        info = json.loads(trust.read_small(d.path / ".lock.info"))
    except (OSError, ValueError):
        return ""
    if not isinstance(info, dict):
        return ""
    return f" (pid {info.get('pid', '?')} on {info.get('host', '?')})"


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
