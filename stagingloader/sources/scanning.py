"""Scan a large tree with several processes: the top folder's entries split in contiguous runs, one per process.

A listing (and the fast check of a staged copy) costs one ``stat`` per file, and a Python loop around it
holds one interpreter's lock: on a tree of many files the scan is CPU-bound in one process.  Here the
sorted entries of the top folder are cut into runs of about equal count; this process walks the first run
while forked workers walk the others, and the columns come back (pickled numpy arrays) to be concatenated
in order, so the result is exactly the serial scan's.  Small trees (fewer top-level entries than
:data:`MIN_ENTRIES`) and one-core machines scan in this process: a fork costs more than it saves there.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from ..cache.tiers import MountInfo
from ..retry import as_source_error
from .listing import Listing, ListingBuilder, scan_local, scan_staged

T = TypeVar("T")

MIN_ENTRIES = 16  #: top-level entries (usually folders) below which a tree is scanned in one process
MAX_WORKERS = 8


def default_workers() -> int:
    """Processes for a scan: the cores this process may use, at most :data:`MAX_WORKERS`; one on a machine of
    two cores or fewer, where a forked scan measured slower than one process (docs/benchmarks.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return 1 if cores <= 2 else min(MAX_WORKERS, cores)


def _runs(names: list[bytes], workers: int) -> list[frozenset[bytes]]:
    """Cut the sorted names into ``workers`` runs whose walks follow each other in the listing's order.

    The walk sorts a folder as ``name/``, so a folder ``a`` walks after a file ``a.b``: a cut must never
    separate a name from the names it is a prefix of (they sort next to it); anywhere else the two orders agree.
    """
    n = len(names)
    seen = set(names)
    cuts = [0]
    for k in range(1, workers):
        c = max(cuts[-1], n * k // workers)
        while 0 < c < n and any(names[c][:j] in seen and names[c][:j] <= names[c - 1]
                                for j in range(1, len(names[c]))):
            c += 1
        cuts.append(c)
    cuts.append(n)
    return [frozenset(names[a:b]) for a, b in itertools.pairwise(cuts) if b > a]


def _in_parallel(top: str, workers: int, scan: Callable[[frozenset[bytes] | None], Listing]) -> Listing:
    return Listing.concat(in_parts(top, workers, scan))


def in_parts(top: str, workers: int, scan: Callable[[frozenset[bytes] | None], T], *,
             here: Callable[[frozenset[bytes] | None], T] | None = None,
             initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()) -> list[T]:
    """``scan(run)`` for contiguous runs of ``top``'s entries, in up to ``workers - 1`` forked processes, and
    ``here(run)`` (default ``scan``) for the first run in this process, in the listing's order; ``here(None)``
    alone (the whole tree) for a small tree, one worker, or a folder that cannot be listed.
    ``initializer(*initargs)`` runs first in each forked process: its arguments are inherited with the fork,
    never pickled (a manifest of millions of files), where ``scan`` and its arguments are."""
    here = here or scan
    try:
        names = sorted(os.listdir(os.fsencode(top)))
    except OSError:
        return [here(None)]  # the serial scan says what is wrong, as it always did
    if workers < 2 or len(names) < MIN_ENTRIES:
        return [here(None)]
    runs = _runs(names, workers)
    if len(runs) < 2:
        return [here(None)]
    ctx = multiprocessing.get_context("fork")  # the child runs only the scan: no threads, locks or imports
    with ProcessPoolExecutor(len(runs) - 1, mp_context=ctx, initializer=initializer, initargs=initargs) as pool:
        futures = [pool.submit(scan, run) for run in runs[1:]]
        parts = [here(runs[0])]
        parts += [f.result() for f in futures]  # a worker's error is raised here, in the caller
    return parts


def _list_part(top: str, skip_top: bytes, for_others: bool, only: frozenset[bytes] | None) -> Listing:
    out = ListingBuilder(for_others=for_others)
    scan_local(top, top, "", out, skip_top=skip_top, on_error=as_source_error, only=only)
    return out.listing()


class BackgroundScan:
    """A staged tree scanned in a forked process while this one does something else (lists the source).

    A re-stage of an unchanged source is two scans, the source's and the staged copy's, each a ``stat`` per
    file: one after the other they took twice as long as ``rsync -a``, which runs its two sides at once.
    The result is used only for the tree it was started for, and an error there is left to the scan the
    caller then makes itself, which reports it as it always did."""

    def __init__(self, top: str | os.PathLike[str]) -> None:
        self.top = os.fspath(top)
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
        self._future = self._pool.submit(scan_staged_tree, self.top, workers=1)

    def result_for(self, top: str | os.PathLike[str]) -> Listing | None:
        """The scan of ``top`` if that is the tree scanned, else None (and the scan is dropped)."""
        try:
            if os.fspath(top) != self.top:
                return None
            return self._future.result()
        except Exception:  # the caller's own scan raises it as it should be said
            return None
        finally:
            self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._future.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


def list_tree(top: str, *, skip_top: bytes = b"", workers: int | None = None, for_others: bool = False,
              threads: int = 0) -> Listing:
    """A local source folder's listing (see :func:`~.listing.scan_local`), scanned by up to ``workers`` processes,
    or, with ``threads`` > 1, by that many threads (a network file system: :func:`listing_threads`);
    ``for_others``: refused (:class:`~.listing.NotForOthersError`) where other users may not read all of it."""
    from functools import partial

    scan = partial(_list_part, top, skip_top, for_others)
    if threads > 1:
        return Listing.concat(in_threads(top, threads, scan))
    return _in_parallel(top, default_workers() if workers is None else workers, scan)


NETWORK_THREADS = 16  #: folders listed at once on a network file system, where each ``stat`` is a round trip
RUNS_PER_THREAD = 4  #: runs of top-level entries per thread, so that a thread done early takes another


def listing_threads(mount: MountInfo) -> int:
    """Threads to list a source on ``mount`` with: :data:`NETWORK_THREADS` on a network file system (NFS, Lustre,
    GPFS, SMB...), where the walk waits on the server and threads overlap the waits; 0 (processes, or one) on a
    local disk, where the walk is CPU-bound and threads would only share one interpreter's lock."""
    return NETWORK_THREADS if mount.is_network else 0


def in_threads(top: str, threads: int, scan: Callable[[frozenset[bytes] | None], T]) -> list[T]:
    """``scan(run)`` for contiguous runs of ``top``'s entries in up to ``threads`` threads, in the listing's order
    (the runs as :func:`in_parts` cuts them, several per thread); ``scan(None)`` alone (the whole tree) for a
    folder of one entry or one that cannot be listed.  A thread's error is raised here, in the caller."""
    try:
        names = sorted(os.listdir(os.fsencode(top)))
    except OSError:
        return [scan(None)]  # the serial scan says what is wrong, as it always did
    runs = _runs(names, min(len(names), threads * RUNS_PER_THREAD))
    if len(runs) < 2:
        return [scan(None)]
    with ThreadPoolExecutor(min(threads, len(runs)), thread_name_prefix="stagingloader-list") as pool:
        return list(pool.map(scan, runs))


def scan_staged_tree(top: str | os.PathLike[str], *, workers: int | None = None) -> Listing:
    """A staged tree's columns (see :func:`~.listing.scan_staged`), scanned by up to ``workers`` processes."""
    from functools import partial

    return _in_parallel(os.fspath(top), default_workers() if workers is None else workers,
                        partial(scan_staged, os.fspath(top)))
