"""Decide what to copy: a pure function of (listing, staged manifest, staged state, capacity).

No I/O here: the stager gathers the facts (the listing, the published version's manifest,
which staged files failed their check, what an interrupted run already finished, the free
bytes) and :func:`make_plan` turns them into a :class:`CopyPlan`.  Tested without a disk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..cache.manifest import Entry, Manifest, same_source
from .sources import SourceFile

#: Why a file is copied.
NEW, CHANGED, MISSING, CORRUPT = "new", "changed", "missing", "corrupt"


@dataclass(frozen=True)
class CopyPlan:
    """What staging will do.  ``up_to_date`` means the published version is used as is."""

    up_to_date: bool
    copy: tuple[tuple[SourceFile, str], ...] = ()
    link: tuple[Entry, ...] = ()
    keep: tuple[Entry, ...] = ()
    drop: tuple[str, ...] = ()
    removed: int = 0
    total_files: int = 0
    total_bytes: int = 0
    free_bytes: int | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_to_copy(self) -> int:
        return sum(f.size for f, _ in self.copy)

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.bytes_to_copy <= self.free_bytes

    @property
    def reused_files(self) -> int:
        return self.total_files if self.up_to_date else len(self.link) + len(self.keep)

    def summary(self) -> dict[str, object]:
        return {
            "up_to_date": self.up_to_date,
            "files": self.total_files,
            "bytes": self.total_bytes,
            "copy_files": len(self.copy),
            "copy_bytes": self.bytes_to_copy,
            "reuse_files": self.reused_files,
            "removed_files": self.removed,
            "reasons": dict(self.reasons),
            "free_bytes": self.free_bytes,
            "fits": self.fits,
        }


def _unchanged(listing: Sequence[SourceFile], base: Manifest) -> bool:
    """The common re-stage, checked in one pass over the columns: the same files, in the same order,
    with the same fingerprints, and nothing else."""
    if len(listing) != len(base.path):
        return False
    for f, path, size, mtime_ns, etag in zip(listing, base.path, base.size, base.mtime_ns, base.etag):
        if f.rel != path or not same_source(f.size, f.mtime_ns, f.etag, size, mtime_ns, etag):
            return False
    return True


def make_plan(
    listing: Sequence[SourceFile],
    base: Manifest | None,
    *,
    base_bad: Mapping[str, str] | None = None,
    incoming: Mapping[str, Entry] | None = None,
    free_bytes: int | None = None,
) -> CopyPlan:
    """CopyPlan the copy of ``listing`` against the published ``base`` and an unfinished ``incoming`` run.

    ``base_bad`` maps staged files of ``base`` that failed their check to MISSING or CORRUPT;
    ``incoming`` holds the files an interrupted run already finished (path -> entry).
    """
    base_bad = base_bad or {}
    incoming = incoming or {}
    if base is not None and not incoming and not base_bad and _unchanged(listing, base):
        return CopyPlan(True, total_files=len(listing), total_bytes=sum(f.size for f in listing), free_bytes=free_bytes)
    copy: list[tuple[SourceFile, str]] = []
    link: list[Entry] = []
    keep: list[Entry] = []
    reasons: dict[str, int] = {}
    base_index = base.index() if base is not None else {}
    for f in listing:
        i = base_index.get(f.rel)
        reason = NEW
        if i is not None and base is not None:
            old = Entry(base.path[i], base.size[i], base.mtime_ns[i], base.etag[i], base.digest[i])
            reason = CHANGED
            if old.same_source(f.size, f.mtime_ns, f.etag):
                reason = base_bad.get(f.rel, "")
                if not reason:
                    link.append(old)
                    continue
        done = incoming.get(f.rel)
        if done is not None and done.same_source(f.size, f.mtime_ns, f.etag):
            keep.append(done)
            continue
        copy.append((f, reason))
        reasons[reason] = reasons.get(reason, 0) + 1
    kept = {e.path for e in keep}
    drop = tuple(sorted(p for p in incoming if p not in kept))
    listed = {f.rel for f in listing}
    removed = sum(1 for p in base_index if p not in listed)
    total = sum(f.size for f in listing)
    up_to_date = base is not None and not copy and not keep and removed == 0
    if up_to_date:
        return CopyPlan(True, drop=tuple(sorted(incoming)), total_files=len(listing), total_bytes=total,
                    free_bytes=free_bytes)
    return CopyPlan(False, tuple(copy), tuple(link), tuple(keep), drop, removed, len(listing), total,
                free_bytes, reasons)
