"""Re-hash staged copies against their manifest."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from .. import digest as dg
from ..cache.columns import StrColumn, join
from ..cache.layout import DatasetDir, find_dataset_dir
from ..cache.manifest import Manifest
from ..errors import ManifestError, UsageError
from ..sources.listing import Listing, scan_staged
from ..sources.scanning import default_workers, in_parts, scan_staged_tree
from .copyplan import CORRUPT, MISSING
from .result import StagedDataset, VerifyReport


def check_fast(data: Path, manifest: Manifest, found: Listing | None = None) -> dict[str, str]:
    """Staged files whose size or mtime differ from the manifest (no hashing): rel -> reason.

    One sorted scan of the staged tree (``os.scandir``, never through a link) compared with the manifest's
    columns as it is walked, a chunk of files at a time, so that its columns are never all held (a re-stage of
    10 million files would hold about 650 MB more); ``found``: a whole scan made already (the early scan of a
    smaller tree), compared at once."""
    if found is None:
        return check_staged_tree(data, manifest)
    merge = ManifestMerge(manifest)
    merge.add(found)
    return merge.result()


class ManifestMerge:
    """The fast check fed sorted chunks of a staged tree's scan, in order (or several such streams whose files
    do not overlap: the parts of a parallel scan): each chunk is compared with the manifest's rows in its range
    of paths, row to row when the same paths are there (the usual case), else joined by path.  A manifest row
    no chunk matched is missing; a staged file the manifest does not have is not this check's business."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.matched = np.zeros(len(manifest), dtype=bool)
        self.bad: dict[str, str] = {}

    def add(self, chunk: Listing) -> None:
        n = len(chunk)
        if not n:
            return
        m = self.manifest
        if m.sorted_by_bytes:
            lo = m.path.bisect(chunk.path.raw(0))
            hi = m.path.bisect(chunk.path.raw(n - 1), right=True)
        else:  # one chunk, the whole scan (see check_fast): every row
            lo, hi = 0, len(m)
        if hi <= lo:
            return
        offsets = m.path.offsets[lo:hi + 1]
        rows = join(StrColumn(memoryview(m.path.blob)[int(offsets[0]):int(offsets[-1])], offsets - offsets[0]),
                    chunk.path)
        present = np.flatnonzero(rows >= 0)
        r = rows[present]
        size, mtime = m.size[lo + present], m.mtime_ns[lo + present]
        wrong = (chunk.size[r] != size) | ((mtime != 0) & (chunk.mtime_ns[r] != mtime))
        self.matched[lo + present] = True
        for i in (lo + present[wrong]).tolist():
            self.bad[m.path[i]] = CORRUPT

    def result(self) -> dict[str, str]:
        """rel -> reason, the missing rows included (in the manifest's order, then the wrong ones)."""
        missing = {self.manifest.path[i]: MISSING for i in np.flatnonzero(~self.matched).tolist()}
        return missing | self.bad


def check_staged_tree(data: str | os.PathLike[str], manifest: Manifest, workers: int | None = None) -> dict[str, str]:
    """:func:`check_fast` of a whole tree, walked by up to ``workers`` processes (see :mod:`..sources.scanning`), each
    comparing its part as it walks and sending back only what it found wrong and which rows it matched."""
    merge = ManifestMerge(manifest)
    if not manifest.sorted_by_bytes:  # rows in another order (an old manifest): the whole scan, joined once
        merge.add(scan_staged_tree(data, workers=workers))
        return merge.result()
    top = os.fspath(data)
    parts = in_parts(top, default_workers() if workers is None else workers, partial(_check_part, top, None),
                     here=partial(_check_part, top, manifest), initializer=_part_manifest, initargs=(manifest,))
    for matched, bad in parts:
        merge.matched |= np.unpackbits(matched, count=len(manifest)).astype(bool)
        merge.bad.update(bad)
    return merge.result()


CHUNK_ROWS = 1 << 16  #: staged files scanned before they are compared and dropped (about 4 MB of columns)
_MANIFEST: Manifest | None = None  #: in a forked scan process: the manifest its part is compared with


def _part_manifest(manifest: Manifest) -> None:
    global _MANIFEST
    _MANIFEST = manifest


def _check_part(top: str, manifest: Manifest | None, only: frozenset[bytes] | None) -> tuple[Any, dict[str, str]]:
    merge = ManifestMerge(manifest if manifest is not None else _MANIFEST)  # type: ignore[arg-type]
    scan_staged(top, only, on_chunk=merge.add, chunk_rows=CHUNK_ROWS)
    return np.packbits(merge.matched), merge.bad


def check_full(data: Path, manifest: Manifest, workers: int = 4,
               on_bytes: Callable[[int], None] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Re-hash every staged file: (rel -> reason, rel -> 'expected X, found Y')."""
    bad: dict[str, str] = {}
    details: dict[str, str] = {}
    lock = threading.Lock()
    local = threading.local()

    def one(i: int) -> None:
        rel = manifest.path[i]
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(dg.CHUNK)
        try:
            digest, size = dg.hash_file(data / rel, buf, nofollow=True)
        except OSError:
            with lock:
                bad[rel] = MISSING
                details[rel] = "missing or unreadable"
            return
        if on_bytes is not None:
            on_bytes(size)
        if digest != manifest.digest[i] or size != manifest.size[i]:
            with lock:
                bad[rel] = CORRUPT
                details[rel] = (f"expected {manifest.digest[i]} ({manifest.size[i]} bytes), "
                                f"found {digest} ({size} bytes)")

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="stagingloader-verify") as pool:
        list(pool.map(one, range(len(manifest))))
    return bad, details


def verify(dataset: StagedDataset | str | os.PathLike[str], *, workers: int = 4,
           on_bytes: Callable[[int], None] | None = None) -> VerifyReport:
    """Re-hash a staged copy against its manifest; bad files are remembered for the next stage.

    ``dataset`` is a :class:`StagedDataset` or the path of a staged dataset (its folder, a
    version folder or a ``data/`` folder).  Staging the source again repairs the bad files.
    """
    version: str | None
    if isinstance(dataset, StagedDataset):
        ddir, version = DatasetDir(dataset.dataset_dir), dataset.version
    elif isinstance(dataset, (str, os.PathLike)):
        ddir, version = find_dataset_dir(Path(dataset))
    else:
        raise UsageError(f"verify takes the dataset sl.stage() returned or a staged dataset's folder, not "
                         f"{type(dataset).__name__} {dataset!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise UsageError(f"workers must be a whole number of at least 1, not {workers!r}")
    ddir.check(writable=False)
    version = version or ddir.current() or ddir.newest_complete()
    if version is None:
        raise ManifestError(f"{ddir.path} has no complete version yet; stage it first (stagingloader stage SRC)")
    manifest = ddir.load_manifest(version)
    t0 = time.perf_counter()
    bad, details = check_full(ddir.version_dir(version) / "data", manifest, workers, on_bytes)
    seconds = time.perf_counter() - t0
    if ddir.path.lstat().st_uid == os.geteuid():  # a copy of root's is only read; its stager repairs it
        repairs = ddir.read_repairs()
        if bad:
            repairs[version] = sorted(bad)
        else:
            repairs.pop(version, None)
        ddir.write_repairs(repairs)
    return VerifyReport(
        str(ddir.path), version, len(manifest), manifest.total_bytes, seconds,
        tuple(sorted(r for r, why in bad.items() if why == CORRUPT)),
        tuple(sorted(r for r, why in bad.items() if why == MISSING)),
        details,
    )
