"""Decide what to copy: a pure function of (listing, staged manifest, staged state, capacity).

No I/O here: the stager gathers the facts (the listing, the published version's manifest,
which staged files failed their check, what an interrupted run already finished, the free
bytes) and :func:`make_plan` turns them into a :class:`CopyPlan`.  Tested without a disk.

The plan is made column-wise: the listing is joined to the manifest once (row to row when the paths are
the same, which a re-stage of an unchanged source checks with one buffer comparison), fingerprints are
compared as arrays, and the plan holds row numbers (copy, link, keep), not an object per file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..cache.columns import Int64Array, RowArray, join
from ..cache.manifest import Entry, Manifest
from ..sources.listing import Listing, SourceFile

#: Why a file is copied.
NEW, CHANGED, MISSING, CORRUPT = "new", "changed", "missing", "corrupt"
REASONS = ("", NEW, CHANGED, MISSING, CORRUPT)  #: reason codes: the index of each reason in this tuple
_CODE = {r: i for i, r in enumerate(REASONS)}
_NONE = np.zeros(0, dtype=np.int64)


class _CopyRows(Sequence[tuple[SourceFile, str]]):
    """``plan.copy``: (file, reason) pairs made on access from the plan's rows."""

    def __init__(self, listing: Listing, rows: RowArray, reasons: npt.NDArray[np.uint8]) -> None:
        self.listing, self.rows, self.reasons = listing, rows, reasons

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[SourceFile, str]:  # type: ignore[override]
        return self.listing.row(int(self.rows[i])), REASONS[int(self.reasons[i])]

    def __iter__(self) -> Iterator[tuple[SourceFile, str]]:
        return zip(self.listing.iter_rows(self.rows), (REASONS[c] for c in self.reasons.tolist()))


class _LinkRows(Sequence[Entry]):
    """``plan.link``: the published manifest's entries of the files reused, made on access."""

    def __init__(self, base: Manifest | None, rows: Int64Array) -> None:
        self.base, self.rows = base, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Entry:  # type: ignore[override]
        assert self.base is not None
        return self.base.entry(int(self.rows[i]))

    def __iter__(self) -> Iterator[Entry]:
        return (self.base.entry(r) for r in self.rows.tolist()) if self.base is not None else iter(())


@dataclass(frozen=True, kw_only=True)
class CopyPlan:
    """What staging will do.  ``up_to_date`` means the published version is used as is.

    Rows: ``copy_rows`` (listing rows to copy, with ``copy_reasons`` codes into :data:`REASONS`),
    ``link_rows`` with ``link_base_rows`` (listing rows hard-linked from those rows of ``base``), and
    ``keep`` (what an interrupted run finished, kept, at ``keep_rows``).
    """

    up_to_date: bool
    listing: Listing
    base: Manifest | None = None
    copy_rows: RowArray = field(default_factory=lambda: _NONE)
    copy_reasons: npt.NDArray[np.uint8] = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))
    link_rows: Int64Array = field(default_factory=lambda: _NONE)
    link_base_rows: Int64Array = field(default_factory=lambda: _NONE)
    keep: tuple[Entry, ...] = ()
    keep_rows: Int64Array = field(default_factory=lambda: _NONE)
    drop: tuple[str, ...] = ()
    removed: int = 0
    total_files: int = 0
    total_bytes: int = 0
    free_bytes: int | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def copy(self) -> Sequence[tuple[SourceFile, str]]:
        return _CopyRows(self.listing, self.copy_rows, self.copy_reasons)

    @property
    def link(self) -> Sequence[Entry]:
        return _LinkRows(self.base, self.link_base_rows)

    @property
    def bytes_to_copy(self) -> int:
        return int(self.listing.size[self.copy_rows].sum())

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.bytes_to_copy <= self.free_bytes

    @property
    def reused_files(self) -> int:
        return self.total_files if self.up_to_date else len(self.link_rows) + len(self.keep)

    @property
    def repaired_files(self) -> int:
        return int(np.isin(self.copy_reasons, (_CODE[MISSING], _CODE[CORRUPT])).sum())

    def summary(self) -> dict[str, object]:
        return {
            "up_to_date": self.up_to_date,
            "files": self.total_files,
            "bytes": self.total_bytes,
            "copy_files": len(self.copy_rows),
            "copy_bytes": self.bytes_to_copy,
            "reuse_files": self.reused_files,
            "removed_files": self.removed,
            "reasons": dict(self.reasons),
            "free_bytes": self.free_bytes,
            "fits": self.fits,
        }


def same_source_rows(listing: Listing, rows: Int64Array, base: Manifest, base_rows: Int64Array,
                     ) -> npt.NDArray[np.bool_]:
    """Row-wise :func:`~stagingloader.cache.manifest.same_source` of ``listing[rows]`` against
    ``base[base_rows]``: sizes equal, then the etags where either side has one, else the mtimes."""
    same = listing.size[rows] == base.size[base_rows]
    if not (listing.etag.any_nonempty() or base.etag.any_nonempty()):
        out: npt.NDArray[np.bool_] = same & (listing.mtime_ns[rows] == base.mtime_ns[base_rows])
        return out
    le = listing.etag.lengths()[rows]
    be = base.etag.lengths()[base_rows]
    by_mtime = (le == 0) & (be == 0)
    out = same & np.where(by_mtime, listing.mtime_ns[rows] == base.mtime_ns[base_rows], False)
    for k in np.flatnonzero(same & ~by_mtime).tolist():  # objects: the etags decide (one compare each)
        out[k] = listing.etag.raw(int(rows[k])) == base.etag.raw(int(base_rows[k]))
    return out


def unchanged(listing: Listing, base: Manifest) -> bool:
    """The common re-stage, checked on whole columns: the same paths in the same order (one buffer
    comparison), the same fingerprints, and nothing else."""
    if len(listing) != len(base) or not listing.path.same_as(base.path):
        return False
    if not np.array_equal(listing.size, base.size):
        return False
    if not (listing.etag.any_nonempty() or base.etag.any_nonempty()):  # whole columns: no temporary per row
        return bool(np.array_equal(listing.mtime_ns, base.mtime_ns))
    every = np.arange(len(listing), dtype=np.int64)
    return bool(same_source_rows(listing, every, base, every).all())


def _bad_codes(base: Manifest, base_bad: Mapping[str, str]) -> npt.NDArray[np.uint8]:
    codes = np.zeros(len(base), dtype=np.uint8)
    for rel, why in base_bad.items():
        i = base.find(rel)
        if i >= 0:
            codes[i] = _CODE[why]
    return codes


def make_plan(
    listing: Sequence[SourceFile],
    base: Manifest | None,
    *,
    base_bad: Mapping[str, str] | None = None,
    incoming: Mapping[str, Entry] | None = None,
    free_bytes: int | None = None,
) -> CopyPlan:
    """Plan the copy of ``listing`` against the published ``base`` and an unfinished ``incoming`` run.

    ``base_bad`` maps staged files of ``base`` that failed their check to MISSING or CORRUPT;
    ``incoming`` holds the files an interrupted run already finished (path -> entry).
    """
    files = Listing.of(listing)
    base_bad = base_bad or {}
    incoming = incoming or {}
    n = len(files)
    total = files.total_bytes
    if base is not None and not incoming and not base_bad and unchanged(files, base):
        return CopyPlan(up_to_date=True, listing=files, base=base, total_files=n, total_bytes=total,
                        free_bytes=free_bytes)
    if base is not None:
        base_row = join(files.path, base.path)
        known = np.flatnonzero(base_row >= 0)
        same = np.zeros(n, dtype=bool)
        same[known] = same_source_rows(files, known, base, base_row[known])
        codes = np.where(base_row >= 0, _CODE[CHANGED], _CODE[NEW]).astype(np.uint8)
        bad = _bad_codes(base, base_bad)
        codes[same] = bad[base_row[same]]
        removed = len(base) - len(known)
    else:
        base_row = _NONE
        codes = np.full(n, _CODE[NEW], dtype=np.uint8)
        removed = 0
    link = codes == 0
    keep_mask = np.zeros(n, dtype=bool)
    keep: list[Entry] = []
    for rel, done in incoming.items():
        row = files.find(rel)
        if row >= 0 and not link[row] and done.same_source(int(files.size[row]), int(files.mtime_ns[row]),
                                                            files.etag[row]):
            keep_mask[row] = True
    keep_rows = np.flatnonzero(keep_mask).astype(np.int64)
    kept = set()
    for row in keep_rows.tolist():
        rel = files.path[row]
        keep.append(incoming[rel])
        kept.add(rel)
    drop = tuple(sorted(p for p in incoming if p not in kept))
    link_rows = np.flatnonzero(link).astype(np.int64)
    rows_dtype = np.int32 if n < 1 << 31 else np.int64  # a first stage copies every row: 4 bytes a file, not 8
    copy_rows = (np.arange(n, dtype=rows_dtype) if not len(link_rows) and not len(keep_rows)
                 else np.flatnonzero(~link & ~keep_mask).astype(rows_dtype))
    del link, keep_mask
    if base is not None and not len(copy_rows) and not len(keep_rows) and removed == 0:
        return CopyPlan(up_to_date=True, listing=files, base=base, drop=tuple(sorted(incoming)), total_files=n,
                        total_bytes=total, free_bytes=free_bytes)
    copy_reasons = codes[copy_rows]
    counts = np.bincount(copy_reasons, minlength=len(REASONS))
    reasons = {REASONS[c]: int(k) for c, k in enumerate(counts.tolist()) if k}
    return CopyPlan(up_to_date=False, listing=files, base=base, copy_rows=copy_rows, copy_reasons=copy_reasons,
                    link_rows=link_rows, link_base_rows=base_row[link_rows] if len(link_rows) else _NONE,
                    keep=tuple(keep), keep_rows=keep_rows,
                    drop=drop, removed=removed, total_files=n, total_bytes=total, free_bytes=free_bytes,
                    reasons=reasons)
