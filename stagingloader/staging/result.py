"""What staging returns: a :class:`StagedDataset` over one immutable version, and its reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..cache.layout import DatasetDir
from ..cache.manifest import Manifest

if TYPE_CHECKING:
    from ..streaming.handle import StreamHandle


@dataclass(frozen=True)
class StreamProgress:
    """How far a streaming stage is: ``ds.progress``."""

    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    state: str
    error: str | None = None
    evicted_files: int = 0
    cache_limit: int | None = None

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0


@dataclass(frozen=True)
class StageReport:
    """The summary of one ``stage``: what was copied, reused and repaired, and how fast."""

    source: str
    staging_root: str
    tier: str
    root_reason: str
    dataset_dir: str
    version: str
    files: int
    bytes: int
    copied_files: int = 0
    copied_bytes: int = 0
    resumed_bytes: int = 0
    reused_files: int = 0
    linked_files: int = 0
    repaired_files: int = 0
    removed_files: int = 0
    seconds: float = 0.0
    new_version: bool = False
    reasons: dict[str, int] = field(default_factory=dict)
    #: with peers: this node's exchange (from_source_bytes, from_peers_bytes, sent_bytes, the nodes that left)
    peers: dict[str, Any] | None = None

    @property
    def gbps(self) -> float:
        return self.copied_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": round(self.gbps, 4)}


@dataclass(frozen=True)
class VerifyReport:
    """The result of re-hashing a staged copy against its manifest."""

    dataset: str
    version: str
    checked_files: int
    checked_bytes: int
    seconds: float
    bad: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    details: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.missing

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["bad"], d["missing"] = list(self.bad), list(self.missing)
        return d


@dataclass(frozen=True)
class StagedDataset:
    """A verified, staged copy of a dataset: one immutable version under a staging root.

    ``root`` mirrors the source's relative paths, so tools that expect a folder (ImageFolder,
    DALI readers) use it as is.  Use as a context manager, or call :meth:`release`, to drop
    the lease this object holds.

    From ``stage(..., wait=False)`` while the copy goes on, ``streaming`` is True: ``root`` does not exist yet
    (the version is published when complete), ``manifest`` lists paths and sizes without digests, files are
    read through ``StagedFiles(ds)`` (or :func:`stagingloader.streaming.protocol.resolve`), and :meth:`wait`
    returns the finished dataset.  :meth:`release` (or leaving the ``with`` block) also stops the stager.
    """

    source: str
    root: Path
    version: str
    dataset_dir: Path
    manifest: Manifest
    report: StageReport | None = None
    lease: str | None = None
    stream: StreamHandle | None = field(default=None, compare=False, repr=False)

    @property
    def streaming(self) -> bool:
        """Was this returned while the dataset still streams in (``stage(..., wait=False)``)?"""
        return self.stream is not None

    @property
    def stream_dir(self) -> Path | None:
        """``DDIR/incoming/stream``: the streaming protocol's folder (None for a finished stage)."""
        return self.stream.stream_dir if self.stream is not None else None

    @property
    def progress(self) -> StreamProgress:
        """How far the stage is (files and bytes done, state, error); a finished stage is complete."""
        if self.stream is not None:
            return self.stream.progress()
        n, b = len(self.manifest), self.manifest.total_bytes
        return StreamProgress(n, n, b, b, "complete")

    def wait(self, timeout: float | None = None) -> StagedDataset:
        """Block until the streaming stage is published (at most ``timeout`` seconds: StageTimeoutError); the
        finished dataset, sharing this one's lease.  Raises the stager's error (StagerFailedError) if it failed
        or is gone.  A finished dataset returns itself."""
        if self.stream is None:
            return self
        manifest = self.stream.wait(timeout)
        return StagedDataset(self.source, self.root, self.version, self.dataset_dir, manifest, self.report, self.lease)

    @property
    def key(self) -> str:
        return self.dataset_dir.name

    @property
    def files(self) -> Sequence[str]:
        """Relative paths of the staged files, sorted."""
        return self.manifest.path

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def path(self, rel: str) -> Path:
        return self.root / rel

    def release(self) -> None:
        """Stop a streaming stager this object started, and drop its lease; the version may then be evicted or
        replaced."""
        if self.stream is not None:
            self.stream.close()
        if self.lease is not None:
            from ..cache import leases

            leases.release(DatasetDir(self.dataset_dir), self.lease)

    def __enter__(self) -> StagedDataset:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        extra = ", streaming" if self.stream is not None else ""
        return (f"StagedDataset({self.source!r}, root={str(self.root)!r}, files={len(self.files)}, "
                f"version={self.version}{extra})")
