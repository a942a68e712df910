"""``stage()``: list, plan, copy, publish.  Each step lives in its own module; this one sequences them.

1. list the source (:mod:`..sources`) and pick the root (:mod:`..cache.capacity`);
2. under the dataset's lock (:mod:`..cache.locking`): check the published version (:mod:`.verify`) and what an
   interrupted run left (:mod:`..engine.incoming`), and plan (:mod:`.copyplan`, pure);
3. refuse if it does not fit; else hard-link unchanged files and copy the rest (:mod:`..engine.copier`);
4. write the manifest, rename ``incoming`` to a new version and switch ``current`` to it;
5. take a lease (:mod:`..cache.leases`) and remove old versions nobody leases.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import leases, trust
from ..cache.capacity import Tier, auto_candidates, resolve_root
from ..cache.columns import CHUNK_ROWS, DigestColumn, Int64Array, RowArray, StrColumn, digest_raw, join
from ..cache.layout import DatasetDir, current_user, dataset_key, safe_join
from ..cache.locking import DatasetLock
from ..cache.manifest import Entry, Manifest
from ..cache.registry import remember_root
from ..engine.copier import Copier, CopySettings, Progress, as_root_error, usable_cores
from ..engine.feed import Rows
from ..engine.incoming import Incoming
from ..errors import CacheError, InternalError, ManifestError, NoSpaceError, RootError, UsageError
from ..sources.listing import Listing
from ..sources.scanning import BackgroundScan
from ..sources.source import Source
from ..units import human_bytes, parse_bytes
from .copyplan import CORRUPT, CopyPlan, make_plan
from .manifest_rows import ListingCheck, rows_from_manifest
from .result import StagedDataset, StageReport
from .sharding import node_listing
from .verify import check_fast, check_full

log = logging.getLogger(__name__)

DEFAULT_WORKERS = {"local": 4, "object": 128, "http": 16}


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
    shard: tuple[int, int] | None = None
    lease: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: False: return once the source is listed, a detached stager copying in the readers' order (streaming)
    wait: bool = True
    #: with ``wait=False``: the bytes the run may keep on the tier (a size such as ``"16G"`` is read as bytes)
    cache_limit: int | None = None
    #: one process per node stages (torchrun or srun ranks), the others wait and get the same dataset
    distributed: bool = False
    #: the job's nodes stage together: each file is read from the source by one node and passed to the others
    peers: bool = False
    #: with peers: how long to wait for the other nodes to join, and for a silent peer before it is out
    peer_timeout: float = 120.0

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):  # one pattern given as a string is one pattern, not its characters
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not all(isinstance(v, str) for v in value):
                raise UsageError(f"{name} takes glob patterns (strings), not {value!r}")
        if not isinstance(self.root, str) or not self.root:
            raise UsageError(f"root must be a folder path or 'auto', not {self.root!r}")
        if not isinstance(self.storage_options, dict):
            raise UsageError(f"storage_options must be a dict of fsspec options (e.g. {{'anon': True}}), "
                             f"not {type(self.storage_options).__name__} {self.storage_options!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise UsageError(f"workers must be a whole number of at least 1, not {self.workers!r}")
        if self.verify not in ("fast", "full"):
            raise UsageError(f"verify must be 'fast' (size + mtime) or 'full' (re-hash), not {self.verify!r}")
        if not isinstance(self.max_ram_fraction, (int, float)) or not 0.0 < self.max_ram_fraction <= 1.0:
            raise UsageError(f"max_ram_fraction must be in (0, 1], not {self.max_ram_fraction!r}")
        if self.lock_timeout is not None and (not isinstance(self.lock_timeout, (int, float))
                                              or math.isnan(self.lock_timeout) or self.lock_timeout < 0):
            raise UsageError(f"lock_timeout must be a number of seconds >= 0 (or None to wait for ever), "
                             f"not {self.lock_timeout!r}")
        if self.shard is not None:
            i, n = self.shard
            if not (n >= 1 and 0 <= i < n):
                raise UsageError(f"shard must be I/N with 0 <= I < N, not {i}/{n}")
        self._check_streaming()

    def _check_streaming(self) -> None:
        """``wait``, ``cache_limit`` and ``distributed`` together: an option that cannot apply is refused."""
        if not isinstance(self.wait, bool):
            raise UsageError(f"wait must be True (block until staged) or False (stream), not {self.wait!r}")
        if not isinstance(self.distributed, bool):
            raise UsageError(f"distributed must be True or False, not {self.distributed!r}")
        limit = self.cache_limit
        if isinstance(limit, str):
            try:
                limit = parse_bytes(limit)
            except ValueError as e:
                raise UsageError(f"cache_limit: {e}") from None
            object.__setattr__(self, "cache_limit", limit)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
            raise UsageError(f"cache_limit must be a number of bytes > 0 (or a size such as '16G'), not {limit!r}")
        if limit is not None and self.wait:
            raise UsageError("cache_limit needs wait=False: a dataset kept under a limit is only ever streamed")
        if not isinstance(self.peers, bool):
            raise UsageError(f"peers must be True or False, not {self.peers!r}")
        if (not isinstance(self.peer_timeout, (int, float)) or isinstance(self.peer_timeout, bool)
                or math.isnan(self.peer_timeout) or self.peer_timeout <= 0):
            raise UsageError(f"peer_timeout must be a number of seconds > 0, not {self.peer_timeout!r}")
        if self.peers and limit is not None:
            raise UsageError("peers=True gives every node the whole dataset; a cache limit keeps a part of it, "
                             "evicting what the other nodes may still want: drop one of them")
        if self.peers and self.distributed:
            raise UsageError("peers=True already stages once per node (local rank 0 of each node takes part, the "
                             "other ranks wait for it): drop distributed=True")
        if self.peers and self.shard is not None:
            raise UsageError("peers=True gives every node the whole dataset, read from the source once; a shard "
                             "gives each node a part: drop one of them")
        if self.distributed and not self.wait:
            raise UsageError("distributed=True blocks until each node's stage is published; with wait=False every "
                             "rank calls stage() itself (the first streams, the others read along): drop "
                             "distributed=True")


@dataclass
class StagePlan:
    """What a dry run found: the plan, where it would go, and whether it fits."""

    source: str
    root: str
    root_reason: str
    dataset_dir: str
    plan: CopyPlan

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "root": self.root, "root_reason": self.root_reason,
                "dataset_dir": self.dataset_dir, **self.plan.summary()}


def run_stage(src: str, opts: StageOptions, *, env: Mapping[str, str] | None = None,
              callback: Any = None, on_file: Callable[[int], None] | None = None,
              on_event: Callable[[str], None] | None = None,
              holder_pid: int | None = None, renew_lease: bool = False, listing: Listing | None = None
              ) -> StagedDataset:
    """Stage ``src`` as ``opts`` say and block until it is published; see :func:`stagingloader.stage`.
    ``listing``: the source's listing (this node's shard) the caller made, used instead of listing again.

    The run's lease is the named one ``opts.lease`` if given, else one tied to the process ``holder_pid`` (the
    Python API's own process; the CLI's caller), else none.  ``renew_lease`` (the CLI): the lease ``holder_pid``
    already holds on the version is kept rather than another taken, so a shell that stages often holds one.
    """
    run, identity = open_run(src, opts, env=env, on_event=on_event, early_scan=True, listing=listing)
    try:
        if _someone_elses(run.ddir):  # another user's folder, or a link, is refused here
            return _use_read_only(run)
        own_folder(run, env)
        with DatasetLock(run.ddir.lock_file, timeout=opts.lock_timeout, on_wait=run.say):
            own_folder(run)  # the folder whose lock we hold: gc may have removed the one we checked meanwhile
            return _stage_locked(run, identity=identity, callback=callback, on_file=on_file, holder_pid=holder_pid,
                                 renew_lease=renew_lease)
    finally:
        if run.early is not None:
            run.early.close()


def plan_stage(src: str, opts: StageOptions, *, env: Mapping[str, str] | None = None,
               on_event: Callable[[str], None] | None = None) -> StagePlan:
    """A dry run: what staging ``src`` would do, found without writing anything (no folder, no lock, no lease)."""
    run, _identity = open_run(src, opts, env=env, on_event=on_event, dry_run=True)
    if not _someone_elses(run.ddir) and trust.lstat(run.ddir.path) is not None:
        run.ddir.check(writable=True)
    return _dry_run(run)


def open_run(src: str, opts: StageOptions, *, env: Mapping[str, str] | None = None,
             on_event: Callable[[str], None] | None = None, verb: str = "staging", early_scan: bool = False,
             dry_run: bool = False, listing: Listing | None = None, from_manifest: bool = False
             ) -> tuple[StageRun, str]:
    """List the source (this node's shard) and pick the root: what a run works on, and the source's identity.
    ``listing``: the source's listing as another node made it (peers), used instead of listing again.
    ``opts.cache_limit``: the bytes the run may keep on the tier (a streaming run), which is what ``auto`` must find.
    ``early_scan``: scan a large published copy of the dataset in another process meanwhile (for the fast check).
    ``dry_run``: find the root without creating it.
    ``from_manifest``: take the rows from the source's manifest where a local folder has one, and check them
    against a listing made in another process meanwhile (a streaming run, see :mod:`.manifest_rows`).
    """
    env = dict(os.environ) if env is None else env
    say = on_event or (lambda text: log.info("%s", text))
    t0 = time.perf_counter()
    source = Source(src, opts.storage_options)
    identity = dataset_identity(source, opts)
    key = dataset_key(identity)
    early = _scan_published_early(opts, key, env) if early_scan and not dry_run else None
    check = None
    try:
        if listing is None and from_manifest and not dry_run:
            listing = rows_from_manifest(source, opts, say)
            if listing is not None:
                check = ListingCheck(source, opts, listing)
                say(f"rows from the manifest of {source.url} ({len(listing)} files); the source is listed "
                    "meanwhile and checked against them before the version is published")
        if listing is None:
            listing = node_listing(source, opts.include, opts.exclude, opts.shard)
    except BaseException:
        if early is not None:
            early.close()
        if check is not None:
            check.close()
        raise
    total = listing.total_bytes
    needed = total if opts.cache_limit is None else min(total, opts.cache_limit)
    try:
        tier, why = resolve_root(opts.root, needed, key, max_ram_fraction=opts.max_ram_fraction, env=env,
                                 user=current_user(), create=not dry_run)
    except BaseException:
        for started in (early, check):
            if started is not None:
                started.close()
        raise
    say(f"{'would stage' if dry_run else verb} {source.url} ({len(listing)} files, {human_bytes(total)}) "
        f"into {tier.describe()}: {why}")
    run = StageRun(source=source, listing=listing, opts=opts, tier=tier, why=why, ddir=DatasetDir(tier.path / key),
                   t0=t0, say=say, early=early, check=check)
    return run, identity


EARLY_SCAN_MANIFEST_BYTES = 1 << 20  #: a published copy whose manifest is this large (~15,000 files) is scanned early
#: ... and up to this large (~1,000,000 files): the scan comes back pickled, and for 10 million files holding it
#: twice for a moment would cost more memory (about 1 GB) than the second core saves time
EARLY_SCAN_MAX_MANIFEST_BYTES = 64 << 20


def _scan_published_early(opts: StageOptions, key: str, env: Mapping[str, str]) -> BackgroundScan | None:
    """Start scanning the published copy a fast check will look at, if there is a large one where the root
    will be found (the given root, or an ``auto`` candidate holding this dataset) and a second core."""
    if opts.verify != "fast" or usable_cores() < 2:
        return None
    if opts.root != "auto" or env.get("STAGINGLOADER_ROOT"):
        roots = [Path(opts.root if opts.root != "auto" else env["STAGINGLOADER_ROOT"]).expanduser().absolute()]
    else:
        roots = [path for path, _why in auto_candidates(env, current_user())]
    for root in roots:
        ddir = DatasetDir(root / key)
        try:
            version = ddir.current()
            if version is None:
                continue
            manifest = os.lstat(ddir.version_dir(version) / "manifest.json")
        except (OSError, CacheError):
            return None  # the stage itself says what is wrong there
        if not stat.S_ISREG(manifest.st_mode) or not (
                EARLY_SCAN_MANIFEST_BYTES <= manifest.st_size <= EARLY_SCAN_MAX_MANIFEST_BYTES):
            return None
        return BackgroundScan(ddir.version_dir(version) / "data")
    return None


def someone_elses(run: StageRun) -> bool:
    """Is the run's dataset folder another user's (root's site-shared copy)?  Another ordinary user's, or a link,
    is refused with a CacheError."""
    return _someone_elses(run.ddir)


def own_folder(run: StageRun, env: Mapping[str, str] | None = None) -> None:
    """Make the dataset folder (0700), or check the one there is ours and sound.  Until this run holds the dataset's
    lock, gc may remove the folder between two steps: then it is made again."""
    for attempt in range(1, 6):
        try:
            trust.private_dir(run.ddir.path, what="dataset folder",
                              fix="remove it (rm -r {path}) and stage again, or pick another --root")
            run.ddir.check(writable=True)
            if env is not None:
                remember_root(run.tier.path, env)
            return
        except PermissionError:
            raise RootError(f"cannot create {run.ddir.path}: permission denied; pick another --root") from None
        except FileNotFoundError:  # removed by gc (it held the lock) between our steps
            if attempt == 5:
                raise
        except CacheError as e:
            raise CacheError(f"{e}{_owner_note(run.tier.path)}") from None


def _owner_note(root: Path) -> str:
    """Said when a dataset folder is refused in a root another user owns: that user can swap its folders."""
    st = trust.lstat(root)
    if st is None or st.st_uid in (os.geteuid(), trust.ROOT_UID):
        return ""
    owner = trust.user_name(st.st_uid)
    return (f" (the staging root {root} belongs to {owner}, who can rename or replace anything in it, the sticky "
            "bit notwithstanding: stage into a root of your own)")


@dataclass(frozen=True, kw_only=True)
class StageRun:
    """What one ``stage`` call works on: the source and its listing, the options, the tier and the dataset folder."""

    source: Source
    listing: Listing
    opts: StageOptions
    tier: Tier
    why: str
    ddir: DatasetDir
    t0: float
    say: Callable[[str], None]
    early: BackgroundScan | None = None  #: the published copy's scan, started while the source was listed
    #: the rows came from the source manifest: the listing that checks them, made meanwhile (see .manifest_rows)
    check: ListingCheck | None = None

    @property
    def workers(self) -> int:
        return self.opts.workers or DEFAULT_WORKERS[self.source.kind]

    @property
    def fsync(self) -> bool:
        return (not self.tier.mount.is_memory) if self.opts.fsync is None else self.opts.fsync


def _someone_elses(ddir: DatasetDir) -> bool:
    """Is the dataset folder there and someone else's?  Only root's may be read (a site-shared copy); one of
    another ordinary user, or a link, is refused here with a CacheError naming it."""
    st = trust.lstat(ddir.path)
    if st is None or (st.st_uid == os.geteuid() and not stat.S_ISLNK(st.st_mode)):
        return False
    try:
        ddir.check(writable=False)
    except CacheError as e:
        raise CacheError(f"{e}{_owner_note(ddir.path.parent)}") from None
    return True


def _use_read_only(run: StageRun) -> StagedDataset:
    """A dataset root staged for everyone (a site-wide shared copy): use it as it is, if it is current and,
    checked as ``--verify`` says and against the source manifest where there is one, intact.

    Its owner (the Slurm prolog, for a shared dataset) holds the lease that protects it.
    """
    ddir, source = run.ddir, run.source
    version = ddir.current()
    if version is None:
        raise RootError(f"{ddir.path} belongs to another user and holds no complete copy yet; wait for its stager "
                        f"(the Slurm prolog) or read {source.url} directly")
    manifest = ddir.load_manifest(version)
    plan = make_plan(run.listing, manifest, base_bad=_check_base(run, version, manifest, _expected_digests(source)))
    if not plan.up_to_date:
        raise RootError(f"the shared copy {ddir.path} ({version}) differs from {source.url} in "
                        f"{len(plan.copy_rows) + plan.removed} files and only its owner can update it; read the source "
                        "directly, or ask for it to be staged again")
    run.say(f"using the shared copy {ddir.path} ({version}) read-only: its stager holds the lease")
    report = _report(run, plan, manifest, version, copier=None)
    return StagedDataset(source.url, ddir.version_dir(version) / "data", version, ddir.path, manifest, report, None)


def dataset_identity(source: Source, opts: StageOptions) -> str:
    """What names the dataset ``opts`` select of ``source``: the source's identity and the selection (include,
    exclude, shard); :func:`..cache.layout.dataset_key` of it is the dataset's folder under a root."""
    return source.identity() + _selection_suffix(opts)


def _selection_suffix(opts: StageOptions) -> str:
    parts = []
    if opts.include:
        parts.append("include=" + ",".join(opts.include))
    if opts.exclude:
        parts.append("exclude=" + ",".join(opts.exclude))
    if opts.shard:
        parts.append(f"shard={opts.shard[0]}/{opts.shard[1]}")
    return ("?" + "&".join(parts)) if parts else ""


@dataclass(frozen=True, kw_only=True)
class LockedPlan:
    """What a run found under the dataset's lock: the published version, the source manifest's digests, what an
    interrupted run left in ``incoming``, and the plan."""

    base_version: str | None
    base: Manifest | None
    expected: Mapping[str, str]  #: path -> digest of the source manifest (a view of ``source_manifest``), or {}
    incoming: Incoming
    done: dict[str, Entry]
    plan: CopyPlan
    source_manifest: Manifest | None = None


def plan_locked(run: StageRun, identity: str) -> LockedPlan:
    """Under the dataset's lock: record the dataset, check the published version and ``incoming``, and plan."""
    ddir = run.ddir
    ddir.sweep_deleting()
    _record_dataset(run, identity)
    base_version, base = _load_base(ddir, run.say, like=run.listing)
    source_manifest = _expected_digests(run.source)
    base_bad = _check_base(run, base_version, base, source_manifest)
    incoming = Incoming(ddir.incoming, fsync=run.fsync)
    done, stray = incoming.load(run.listing.by_path()) if ddir.incoming.exists() else ({}, 0)
    plan = make_plan(run.listing, base, base_bad=base_bad, incoming=done, free_bytes=run.tier.budget + stray)
    expected = source_manifest.digests(incoming.row_of) if source_manifest is not None else {}
    return LockedPlan(base_version=base_version, base=base, expected=expected, incoming=incoming, done=done,
                      plan=plan, source_manifest=source_manifest)


def _stage_locked(run: StageRun, *, identity: str, callback: Any, on_file: Callable[[int], None] | None,
                  holder_pid: int | None, renew_lease: bool = False) -> StagedDataset:
    """The stage's story, under the dataset's lock: check what is staged, plan, copy, publish, lease."""
    ddir = run.ddir
    lp = plan_locked(run, identity)
    plan = lp.plan
    try:
        refuse_if_short(run, plan)
    except NoSpaceError:
        _drop_if_empty(ddir)  # a refused first stage leaves nothing behind (no dataset.json, no .lock)
        raise
    copier = None
    if plan.up_to_date:
        version, manifest = keep_published(run, lp)
    else:
        version = ddir.next_version()
        progress = Progress(callback, on_file)
        manifest, copier = _build_version(run, lp, progress, version)
    return finish(run, lp, version, manifest, holder_pid=holder_pid, copier=copier, renew_lease=renew_lease)


def _drop_if_empty(ddir: DatasetDir) -> None:
    """Remove a dataset folder that holds nothing yet (no version, nothing in ``incoming/``, no lease); we hold its
    lock, so no stager is writing it."""
    if not ddir.versions() and trust.lstat(ddir.incoming) is None and not leases.scan(ddir)[0]:
        ddir.remove()


def keep_published(run: StageRun, lp: LockedPlan) -> tuple[str, Manifest]:
    """The plan found the published version up to date: keep it, and drop what an interrupted run left."""
    if lp.base is None or lp.base_version is None:
        raise InternalError("a plan found the dataset up to date without a staged version")
    trust.remove_tree(run.ddir.incoming)
    return lp.base_version, lp.base


def finish(run: StageRun, lp: LockedPlan, version: str, manifest: Manifest, *, holder_pid: int | None,
           copier: Copier | None = None, lease_name: str | None = None, renew_lease: bool = False) -> StagedDataset:
    """After the version is published: take the run's lease (unless ``lease_name`` is the one it holds already),
    remove versions nobody leases, and say what was done."""
    ddir = run.ddir
    if lease_name is None:
        lease_name = take_lease(run, version, holder_pid, renew=renew_lease)
    _remove_unleased(ddir, keep=version)
    ddir.touch()
    return StagedDataset(run.source.url, ddir.version_dir(version) / "data", version, ddir.path, manifest,
                         _report(run, lp.plan, manifest, version, copier), lease_name)


def _dry_run(run: StageRun) -> StagePlan:
    """What a stage would do, found without writing anything: no folder, no lock, no lease, no switch."""
    ddir = run.ddir
    base_version, base = (_load_base(ddir, run.say, publish=False, like=run.listing) if ddir.path.is_dir()
                          else (None, None))
    base_bad = _check_base(run, base_version, base, _expected_digests(run.source))
    incoming = Incoming(ddir.incoming, fsync=False)
    done, stray = incoming.load(run.listing.by_path()) if ddir.incoming.is_dir() else ({}, 0)
    plan = make_plan(run.listing, base, base_bad=base_bad, incoming=done, free_bytes=run.tier.budget + stray)
    return StagePlan(run.source.url, str(run.tier.path), run.why, str(ddir.path), plan)


def _record_dataset(run: StageRun, identity: str) -> None:
    """Write ``dataset.json`` (source and selection, no secrets) the first time a dataset is staged."""
    if not run.ddir.read_info():
        opts = run.opts
        run.ddir.write_info({"source": run.source.url, "identity": identity, "created": time.time(),
                             "include": list(opts.include), "exclude": list(opts.exclude),
                             "shard": list(opts.shard) if opts.shard else None})


def _check_base(run: StageRun, base_version: str | None, base: Manifest | None,
                expected: Manifest | None) -> dict[str, str]:
    """Files of the published version that must not be reused: bad on disk, queued for repair, or not what
    the source manifest says."""
    if base is None or base_version is None:
        return {}
    data = run.ddir.version_dir(base_version) / "data"
    if run.opts.verify == "full":
        base_bad, _ = check_full(data, base, run.workers)
    else:
        base_bad = check_fast(data, base, run.early.result_for(data) if run.early is not None else None)
    for rel in run.ddir.read_repairs().get(base_version, []):
        base_bad.setdefault(rel, CORRUPT)
    if expected is not None:  # the source manifest's digests, compared column-wise
        rows = join(base.path, expected.path)
        known = np.flatnonzero(rows >= 0)
        differ = (base.digest.array[known] != expected.digest.array[rows[known]]).any(axis=1)
        for i in known[differ].tolist():
            base_bad.setdefault(base.path[i], CORRUPT)
    return base_bad


def refuse_if_short(run: StageRun, plan: CopyPlan) -> None:
    if not plan.fits:
        raise NoSpaceError(
            f"{run.source.url} needs {human_bytes(plan.bytes_to_copy)} more on {run.tier.describe()}: "
            f"{human_bytes(plan.bytes_to_copy - (plan.free_bytes or 0))} short. Free space (stagingloader gc "
            "--keep-bytes N), raise --max-ram-fraction for tmpfs, or pick a bigger --root"
        )


def _forget_repairs(ddir: DatasetDir, version: str) -> None:
    repairs = ddir.read_repairs()
    repairs.pop(version, None)
    ddir.write_repairs(repairs)


def take_lease(run: StageRun, version: str, holder_pid: int | None, *, renew: bool = False) -> str | None:
    """This run's lease: a named one (``--lease``, a Slurm job's), or one tied to the process ``holder_pid``
    (``renew``: the one it holds on ``version`` already, if any)."""
    name = run.opts.lease
    if name is None and holder_pid is None:
        return None
    try:
        return leases.take(run.ddir, version, name=name, pid=None if name else holder_pid, renew=renew).name
    except OSError as e:  # a disk that filled after the copy: the version is whole and published, the lease not
        raise as_root_error(e) from e


def _report(run: StageRun, plan: CopyPlan, manifest: Manifest, version: str, copier: Copier | None) -> StageReport:
    return StageReport(
        source=run.source.url, staging_root=str(run.tier.path), tier=run.tier.kind, root_reason=run.why,
        dataset_dir=str(run.ddir.path), version=version, files=len(manifest), bytes=manifest.total_bytes,
        copied_files=len(plan.copy_rows) if not plan.up_to_date else 0,
        copied_bytes=copier.bytes_copied if copier else 0,
        resumed_bytes=copier.bytes_resumed if copier else 0,
        reused_files=plan.reused_files, linked_files=len(plan.link_rows),
        repaired_files=plan.repaired_files if not plan.up_to_date else 0,
        removed_files=plan.removed, seconds=time.perf_counter() - run.t0, new_version=not plan.up_to_date,
        reasons=dict(plan.reasons),
    )


def _load_base(ddir: DatasetDir, say: Callable[[str], None], *, publish: bool = True,
               like: Listing | None = None) -> tuple[str | None, Manifest | None]:
    """The published version and its manifest (sharing the listing ``like``'s columns where they are the same);
    a version whose switch was interrupted is published now."""
    version = ddir.current()
    if version is None:
        version = ddir.newest_complete()  # published but the switch was interrupted
        if version is None:
            return None, None
        if publish:
            ddir.publish(version)
    try:
        return version, ddir.load_manifest(version, like=like)
    except ManifestError as e:
        say(f"ignoring the staged version {version}: {e}")
        return None, None


def _expected_digests(source: Source) -> Manifest | None:
    """The source's own manifest (``stagingloader manifest``), whose digests every copy must match."""
    return source.read_manifest()


def _build_version(run: StageRun, lp: LockedPlan, progress: Progress, version: str) -> tuple[Manifest, Copier]:
    """Copy what the plan says into ``incoming``, write its manifest, and publish it as ``version``."""
    incoming = lp.incoming
    to_copy = begin_version_rows(run, lp)
    progress.set_size(int(run.listing.size[to_copy].sum()))
    settings = CopySettings(workers=run.workers, fsync=incoming.fsync, processes=run.opts.workers)
    copier = Copier(run.source, incoming, settings, expected=lp.expected, progress=progress, stop=threading.Event())
    try:
        copier.run(Rows(run.listing, to_copy))
    except BaseException:
        with contextlib.suppress(OSError):  # e.g. a full disk: the copier's error is the one to report
            incoming.close()
        raise
    return publish_version(run, lp, version), copier


def begin_version_rows(run: StageRun, lp: LockedPlan) -> RowArray:
    """Ready ``incoming`` for the copy: sweep what an interrupted run left, drop stale files, start the journal,
    hard-link unchanged files from the published version.  Returns the listing rows left to copy, in order."""
    ddir, plan, incoming = run.ddir, lp.plan, lp.incoming
    if ddir.incoming.exists():
        incoming.sweep(lp.done)
        incoming.drop(plan.drop)
    incoming.path.mkdir(mode=0o755, exist_ok=True)
    incoming.rewrite_journal(list(plan.keep))
    incoming.open()
    to_copy = plan.copy_rows
    if len(plan.link_rows) and lp.base_version is not None and plan.base is not None:
        fallback = _link_unchanged(ddir.version_dir(lp.base_version) / "data", incoming, plan)
        if len(fallback):
            to_copy = np.sort(np.concatenate([to_copy, fallback]))
    return to_copy


def publish_version(run: StageRun, lp: LockedPlan, version: str,
                    before_rename: Callable[[], None] | None = None) -> Manifest:
    """Every file is in ``incoming``: close its journal, write its manifest, rename it to ``version`` and switch
    ``current`` to it.  ``before_rename`` runs once the manifest is written (a streaming run's last state)."""
    ddir, incoming = run.ddir, lp.incoming
    try:
        incoming.close()
    except OSError as e:  # the journal's last lines did not fit: a full disk, said as such
        raise as_root_error(e) from e
    manifest = _new_manifest(run, lp.plan, incoming)
    try:
        manifest.save(ddir.incoming / "manifest.json", fsync=incoming.fsync)
    except OSError as e:
        raise as_root_error(e) from e
    trust.remove_tree(incoming.partial)
    with contextlib.suppress(FileNotFoundError):
        incoming.journal_path.unlink()
    if before_rename is not None:
        before_rename()
    os.rename(ddir.incoming, ddir.version_dir(version))
    ddir.publish(version)
    return manifest


def _new_manifest(run: StageRun, plan: CopyPlan, incoming: Incoming) -> Manifest:
    """The new version's manifest, column by column: the listing's paths; each row's size, mtime, etag and
    digest from the published version (hard links), the interrupted run (kept) or this run (copied).  The
    listing's size and mtime arrays and the run's digest array are used as they are where nothing differs."""
    listing = run.listing
    n = len(listing)
    rec = incoming.recorded()
    digest = rec.digest if len(rec.digest) == n else np.zeros((n, 16), dtype=np.uint8)
    have = rec.have.copy() if len(rec.have) == n else np.zeros(n, dtype=bool)
    size, mtime = listing.size, listing.mtime_ns
    changed: dict[int, tuple[int, int, str]] = {}
    base, lrows, brows = plan.base, plan.link_rows, plan.link_base_rows
    if base is not None and len(lrows):
        fresh = ~have[lrows]  # a row that fell back to a copy keeps what the copy recorded
        lrows, brows = lrows[fresh], brows[fresh]
        digest[lrows] = base.digest.array[brows]
        have[lrows] = True
        differ = (base.size[brows] != size[lrows]) | (base.mtime_ns[brows] != mtime[lrows])
        if base.etag.any_nonempty() or listing.etag.any_nonempty():
            differ |= np.fromiter((base.etag.raw(b) != listing.etag.raw(r) for r, b in zip(lrows.tolist(),
                                                                                             brows.tolist())),
                                  dtype=bool, count=len(lrows))
        for r, b in zip(lrows[differ].tolist(), brows[differ].tolist()):  # an object's mtime moved: the base's
            changed[r] = (int(base.size[b]), int(base.mtime_ns[b]), base.etag[b])
    for e in [*plan.keep, *rec.extra]:
        row = listing.find(e.path)
        if row >= 0 and not (len(rec.have) == n and rec.have[row]):
            digest[row] = np.frombuffer(digest_raw(e.digest), np.uint8)
            have[row] = True
            changed[row] = (e.size, e.mtime_ns, e.etag)
    changed.update(rec.changed)
    if not bool(have.all()):
        missing = np.flatnonzero(~have)
        raise InternalError(f"{len(missing)} files were not staged, e.g. {listing.path[int(missing[0])]}")
    etag = listing.etag
    if changed:
        size, mtime = size.copy(), mtime.copy()
        for r, (s, m, _t) in changed.items():
            size[r], mtime[r] = s, m
        if any(listing.etag[r] != t for r, (_s, _m, t) in changed.items()):
            column = list(listing.etag)
            for r, (_s, _m, t) in changed.items():
                column[r] = t
            etag = StrColumn.from_strs(column)
    return Manifest(run.source.url, listing.path, size, mtime, etag, DigestColumn(digest), sorted_by_bytes=True)


def _link_unchanged(base_data: Path, incoming: Incoming, plan: CopyPlan) -> Int64Array:
    """Hard-link unchanged files from the published version; return the listing rows that must be copied."""
    base = plan.base
    assert base is not None
    fallback: list[int] = []
    for start in range(0, len(plan.link_rows), CHUNK_ROWS):
        linked: list[Entry] = []
        rows = plan.link_rows[start:start + CHUNK_ROWS].tolist()
        for row, brow in zip(rows, plan.link_base_rows[start:start + CHUNK_ROWS].tolist()):
            rel = base.path[brow]
            dest = safe_join(incoming.data, rel)
            incoming.ensure_parent(dest)
            try:
                os.link(safe_join(base_data, rel), dest, follow_symlinks=False)
            except FileExistsError:
                os.unlink(dest)
                os.link(safe_join(base_data, rel), dest, follow_symlinks=False)
            except OSError as err:
                if err.errno not in (errno.EMLINK, errno.EPERM, errno.EXDEV, errno.ENOTSUP):
                    raise
                fallback.append(row)
                continue
            linked.append(base.entry(brow))
        incoming.journal(linked)
    return np.array(fallback, dtype=np.int64)


def _remove_unleased(ddir: DatasetDir, keep: str) -> None:
    """Delete versions other than ``keep`` that no live lease holds."""
    held = {lease.version for lease in leases.live(ddir)}
    for v in ddir.versions():
        if v != keep and v not in held:
            log.info("removing %s/%s: replaced by %s and no longer leased", ddir.key, v, keep)
            ddir.remove_version(v)
