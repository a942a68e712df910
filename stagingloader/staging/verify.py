"""Re-hash staged copies against their manifest."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import digest as dg
from ..cache.columns import join
from ..cache.layout import DatasetDir, find_dataset_dir
from ..cache.manifest import Manifest
from ..errors import ManifestError
from .copyplan import CORRUPT, MISSING
from .listing import Listing
from .result import StagedDataset, VerifyReport
from .scanning import scan_staged_tree


def check_fast(data: Path, manifest: Manifest, found: Listing | None = None) -> dict[str, str]:
    """Staged files whose size or mtime differ from the manifest (no hashing): rel -> reason.

    One sorted scan of the staged tree (``os.scandir``, never through a link; ``found``: that scan, made
    already) compared with the manifest's columns: row to row when the same paths are there, which is the
    common case, else joined by path."""
    if found is None:
        found = scan_staged_tree(data)
    if found.path.same_as(manifest.path):  # every file there, nothing else: whole columns compared
        mtime = manifest.mtime_ns
        wrong = (found.size != manifest.size) | ((mtime != 0) & (found.mtime_ns != mtime))
        return {manifest.path[i]: CORRUPT for i in np.flatnonzero(wrong).tolist()}
    rows = join(manifest.path, found.path)
    present = rows >= 0
    r = rows[present]
    size, mtime = manifest.size[present], manifest.mtime_ns[present]
    wrong = (found.size[r] != size) | ((mtime != 0) & (found.mtime_ns[r] != mtime))
    bad: dict[str, str] = {}
    for i in np.flatnonzero(~present).tolist():
        bad[manifest.path[i]] = MISSING
    for i in np.flatnonzero(present)[wrong].tolist():
        bad[manifest.path[i]] = CORRUPT
    return bad


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
    else:
        ddir, version = find_dataset_dir(Path(dataset))
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
