"""``stage()``: list, plan, copy, publish.  Each step lives in its own module; this one sequences them.

1. list the source (``sources``) and pick the root (``capacity``);
2. under the dataset's lock (``locking``): check the published version (``verify``) and what an
   interrupted run left (``incoming``), and plan (``planning``, pure);
3. refuse if it does not fit; else hard-link unchanged files and copy the rest (``copying``);
4. write the manifest, rename ``incoming`` to a new version and switch ``current`` to it;
5. take a lease (``leases``) and remove old versions nobody leases.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import leases
from .capacity import Tier, resolve_root
from .copying import Copier, CopySettings, Progress, _translate
from .dataset import StagedDataset, StageReport
from .errors import ManifestError, NoSpaceError, RootError, UsageError
from .incoming import Incoming
from .layout import DatasetDir, dataset_key, safe_join
from .locking import DatasetLock, _user
from .manifest import Entry, Manifest
from .planning import CORRUPT, Plan, make_plan
from .sources import Source, SourceFile
from .storage import human_bytes
from .verify import check_fast, check_full

log = logging.getLogger(__name__)

DEFAULT_WORKERS = {"local": 4, "object": 32, "http": 16}


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """Every knob of ``stage``, mirroring the command-line options."""

    root: str = "auto"
    workers: int | None = None
    verify: str = "fast"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    fsync: bool | None = None
    max_ram_fraction: float = 0.5
    lock_timeout: float | None = 3600.0
    dry_run: bool = False
    shard: tuple[int, int] | None = None
    lease: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise UsageError(f"workers must be a whole number of at least 1, not {self.workers!r}")
        if self.verify not in ("fast", "full"):
            raise UsageError(f"verify must be 'fast' (size + mtime) or 'full' (re-hash), not {self.verify!r}")
        if not 0.0 < self.max_ram_fraction <= 1.0:
            raise UsageError(f"max_ram_fraction must be in (0, 1], not {self.max_ram_fraction!r}")
        if self.lock_timeout is not None and self.lock_timeout < 0:
            raise UsageError("lock_timeout cannot be negative")
        if self.shard is not None:
            i, n = self.shard
            if not (n >= 1 and 0 <= i < n):
                raise UsageError(f"shard must be I/N with 0 <= I < N, not {i}/{n}")


@dataclass
class StagePlan:
    """What a dry run found: the plan, where it would go, and whether it fits."""

    source: str
    root: str
    root_reason: str
    dataset_dir: str
    plan: Plan

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "root": self.root, "root_reason": self.root_reason,
                "dataset_dir": self.dataset_dir, **self.plan.summary()}


def shard_files(files: list[SourceFile], shard: tuple[int, int] | None) -> list[SourceFile]:
    """The files of shard I of N: every N-th file of the sorted listing, from the I-th."""
    if shard is None:
        return files
    i, n = shard
    return files[i::n]


def run_stage(src: str, opts: StageOptions, *, env: Mapping[str, str] | None = None,
              callback: Any = None, on_file: Callable[[int], None] | None = None,
              on_event: Callable[[str], None] | None = None,
              pid_lease: bool = False) -> StagedDataset | StagePlan:
    """Stage ``src`` as ``opts`` say; see :func:`stagingloader.stage`."""
    env = dict(os.environ) if env is None else env
    say = on_event or (lambda text: log.info("%s", text))
    t0 = time.perf_counter()
    source = Source(src, opts.storage_options)
    listing = shard_files(source.listing(opts.include, opts.exclude), opts.shard)
    total = sum(f.size for f in listing)
    identity = source.identity() + _selection_suffix(opts)
    key = dataset_key(identity)
    tier, why = resolve_root(opts.root, total, key, max_ram_fraction=opts.max_ram_fraction, env=env, user=_user())
    say(f"staging {src} ({len(listing)} files, {human_bytes(total)}) into {tier.describe()}: {why}")
    ddir = DatasetDir(tier.path / key)
    if ddir.path.is_dir() and not os.access(ddir.path, os.W_OK) and not opts.dry_run:
        return _use_read_only(source, listing, ddir, tier, why, t0, say)
    try:
        ddir.path.mkdir(mode=0o700, exist_ok=True)
    except PermissionError:
        raise RootError(f"cannot create {ddir.path}: permission denied; pick another --root") from None
    with DatasetLock(ddir.lock_file, timeout=opts.lock_timeout, on_wait=say):
        return _stage_locked(source, listing, opts, tier, why, ddir, identity, t0, callback, on_file, say,
                             pid_lease, env)


def _use_read_only(source: Source, listing: list[SourceFile], ddir: DatasetDir, tier: Tier, why: str, t0: float,
                   say: Callable[[str], None]) -> StagedDataset:
    """A dataset someone else staged for us (a site-wide shared copy): use it as it is, if it is current.

    Its owner (the Slurm prolog, for a shared dataset) holds the lease that protects it.
    """
    version = ddir.current()
    if version is None:
        raise RootError(f"{ddir.path} belongs to another user and holds no complete copy yet; wait for its stager "
                        f"(the Slurm prolog) or read {source.url} directly")
    manifest = ddir.load_manifest(version)
    plan = make_plan(listing, manifest, base_bad=check_fast(ddir.version_dir(version) / "data", manifest))
    if not plan.up_to_date:
        raise RootError(f"the shared copy {ddir.path} ({version}) differs from {source.url} in "
                        f"{len(plan.copy) + plan.removed} files and only its owner can update it; read the source "
                        "directly, or ask for it to be staged again")
    say(f"using the shared copy {ddir.path} ({version}) read-only: its stager holds the lease")
    report = StageReport(source=source.url, staging_root=str(tier.path), tier=tier.kind, root_reason=why,
                         dataset_dir=str(ddir.path), version=version, files=len(manifest), bytes=manifest.total_bytes,
                         reused_files=len(manifest), seconds=time.perf_counter() - t0)
    return StagedDataset(source.url, ddir.version_dir(version) / "data", version, ddir.path, manifest, report, None)


def _selection_suffix(opts: StageOptions) -> str:
    parts = []
    if opts.include:
        parts.append("include=" + ",".join(opts.include))
    if opts.exclude:
        parts.append("exclude=" + ",".join(opts.exclude))
    if opts.shard:
        parts.append(f"shard={opts.shard[0]}/{opts.shard[1]}")
    return ("?" + "&".join(parts)) if parts else ""


def _stage_locked(source: Source, listing: list[SourceFile], opts: StageOptions, tier: Tier, why: str,
                  ddir: DatasetDir, identity: str, t0: float, callback: Any,
                  on_file: Callable[[int], None] | None, say: Callable[[str], None], pid_lease: bool,
                  env: Mapping[str, str]) -> StagedDataset | StagePlan:
    ddir.sweep_deleting()
    if not ddir.read_info():
        ddir.write_info({"source": source.url, "identity": identity, "created": time.time(),
                         "include": list(opts.include), "exclude": list(opts.exclude),
                         "shard": list(opts.shard) if opts.shard else None})
    base_version, base = _load_base(ddir, say)
    base_bad: dict[str, str] = {}
    if base is not None and base_version is not None:
        data = ddir.version_dir(base_version) / "data"
        if opts.verify == "full":
            base_bad, _ = check_full(data, base, _workers(opts, source))
        else:
            base_bad = check_fast(data, base)
        for rel in ddir.read_repairs().get(base_version, []):
            base_bad.setdefault(rel, CORRUPT)
    expected = _expected_digests(source)
    if base is not None and expected:
        for rel, digest in zip(base.path, base.digest):
            if expected.get(rel, digest) != digest:
                base_bad.setdefault(rel, CORRUPT)
    fsync = (not tier.mount.is_memory) if opts.fsync is None else opts.fsync
    incoming = Incoming(ddir.incoming, fsync=fsync)
    done, stray = incoming.load({f.rel: f for f in listing}) if ddir.incoming.exists() else ({}, 0)
    plan = make_plan(listing, base, base_bad=base_bad, incoming=done, free_bytes=tier.budget + stray)
    if opts.dry_run:
        return StagePlan(source.url, str(tier.path), why, str(ddir.path), plan)
    if not plan.fits:
        raise NoSpaceError(
            f"{source.url} needs {human_bytes(plan.bytes_to_copy)} more on {tier.describe()}: "
            f"{human_bytes(plan.bytes_to_copy - (plan.free_bytes or 0))} short. Free space (stagingloader gc "
            "--keep-bytes N), raise --max-ram-fraction for tmpfs, or pick a bigger --root"
        )
    copier = None
    if plan.up_to_date:
        assert base is not None and base_version is not None
        version, manifest = base_version, base
        if ddir.incoming.exists():
            shutil.rmtree(ddir.incoming, ignore_errors=True)
    else:
        version = ddir.next_version()
        manifest, copier = _build_version(source, plan, listing, opts, ddir, base_version, incoming, done,
                                          expected, callback, on_file, version)
        repairs = ddir.read_repairs()
        repairs.pop(version, None)
        ddir.write_repairs(repairs)
    lease_name = opts.lease
    if lease_name is not None or pid_lease:
        lease_name = leases.take(ddir, version, name=lease_name, pid=None if lease_name else os.getpid()).name
    _remove_unleased(ddir, keep=version)
    ddir.touch()
    seconds = time.perf_counter() - t0
    copied = plan.copy if not plan.up_to_date else ()
    report = StageReport(
        source=source.url, staging_root=str(tier.path), tier=tier.kind, root_reason=why, dataset_dir=str(ddir.path),
        version=version, files=len(manifest), bytes=manifest.total_bytes,
        copied_files=len(copied), copied_bytes=copier.bytes_copied if copier else 0,
        resumed_bytes=copier.bytes_resumed if copier else 0,
        reused_files=plan.reused_files, linked_files=len(plan.link),
        repaired_files=sum(1 for _, r in copied if r in ("missing", "corrupt")),
        removed_files=plan.removed, seconds=seconds, new_version=not plan.up_to_date, reasons=dict(plan.reasons),
    )
    return StagedDataset(source.url, ddir.version_dir(version) / "data", version, ddir.path, manifest, report,
                         lease_name)


def _load_base(ddir: DatasetDir, say: Callable[[str], None]) -> tuple[str | None, Manifest | None]:
    version = ddir.current()
    if version is None:
        versions = ddir.versions()
        complete = [v for v in versions if (ddir.version_dir(v) / "manifest.json").exists()]
        if not complete:
            return None, None
        version = complete[-1]  # published but the switch was interrupted
        ddir.publish(version)
    try:
        return version, ddir.load_manifest(version)
    except ManifestError as e:
        say(f"ignoring the staged version {version}: {e}")
        return None, None


def _expected_digests(source: Source) -> dict[str, str]:
    m = source.read_manifest()
    return dict(zip(m.path, m.digest)) if m is not None else {}


def _workers(opts: StageOptions, source: Source) -> int:
    return opts.workers or DEFAULT_WORKERS[source.kind]


def _build_version(source: Source, plan: Plan, listing: Sequence[SourceFile], opts: StageOptions,
                   ddir: DatasetDir, base_version: str | None, incoming: Incoming, done: dict[str, Entry],
                   expected: dict[str, str], callback: Any, on_file: Callable[[int], None] | None,
                   version: str) -> tuple[Manifest, Copier]:
    if ddir.incoming.exists():
        incoming.sweep(done)
        incoming.drop(plan.drop)
    incoming.path.mkdir(exist_ok=True)
    incoming.rewrite_journal(list(plan.keep))
    incoming.open()
    to_copy = [f for f, _ in plan.copy]
    if plan.link and base_version is not None:
        to_copy += _link_unchanged(ddir.version_dir(base_version) / "data", incoming, plan.link, listing)
    if callback is not None:
        callback.set_size(sum(f.size for f in to_copy))
    progress = Progress(callback, on_file)
    copier = Copier(source, incoming,
                    CopySettings(workers=_workers(opts, source), fsync=incoming.fsync),
                    expected=expected, progress=progress, stop=threading.Event())
    try:
        copier.run(to_copy)
    except BaseException:
        with contextlib.suppress(OSError):  # e.g. a full disk: the copier's error is the one to report
            incoming.close()
        raise
    try:
        incoming.close()
    except OSError as e:  # the journal's last lines did not fit: a full disk, said as such
        raise _translate(e) from e
    entries = {e.path: e for e in plan.keep}
    entries.update((e.path, e) for e in incoming.entries)
    missing = [f.rel for f in listing if f.rel not in entries]
    if missing:
        raise AssertionError(f"internal error: {len(missing)} files were not staged, e.g. {missing[0]}")
    manifest = Manifest.from_entries(source.url, list(entries.values()))
    try:
        manifest.save(ddir.incoming / "manifest.json", fsync=incoming.fsync)
    except OSError as e:
        raise _translate(e) from e
    shutil.rmtree(incoming.partial, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        incoming.journal_path.unlink()
    os.rename(ddir.incoming, ddir.version_dir(version))
    ddir.publish(version)
    return manifest, copier


def _link_unchanged(base_data: Path, incoming: Incoming, link: Sequence[Entry],
                    listing: Sequence[SourceFile]) -> list[SourceFile]:
    """Hard-link unchanged files from the published version; return those that must be copied."""
    fallback: list[str] = []
    linked: list[Entry] = []
    for e in link:
        dest = safe_join(incoming.data, e.path)
        incoming.ensure_parent(dest)
        try:
            os.link(safe_join(base_data, e.path), dest, follow_symlinks=False)
        except FileExistsError:
            os.unlink(dest)
            os.link(safe_join(base_data, e.path), dest, follow_symlinks=False)
        except OSError as err:
            if err.errno not in (errno.EMLINK, errno.EPERM, errno.EXDEV, errno.ENOTSUP):
                raise
            fallback.append(e.path)
            continue
        linked.append(e)
    incoming.record_many(linked)
    if not fallback:
        return []
    wanted = set(fallback)
    return [f for f in listing if f.rel in wanted]


def _remove_unleased(ddir: DatasetDir, keep: str) -> None:
    """Delete versions other than ``keep`` that no live lease holds."""
    held = {lease.version for lease in leases.live(ddir)}
    for v in ddir.versions():
        if v != keep and v not in held:
            log.info("removing %s/%s: replaced by %s and no longer leased", ddir.key, v, keep)
            ddir.remove_version(v)
