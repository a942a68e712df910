"""A streaming stage's rows from the source manifest: the answer before the walk of the source.

``stage(SRC, wait=False)`` answers once its readers' rows are written, and the rows come from a listing of the
source: a ``stat`` per file, 3.2-3.5 s of the 5.9 s to a first batch at 1.28 M files on this machine's ext4, and
a round trip per file on a network file system.  Where a local source folder has a manifest (``stagingloader
manifest SRC``), the rows come from it instead, and the source is listed behind the answer, in a process of its
own (:class:`ListingCheck`), then compared with the rows:

- the same files with the same sizes and mtimes: the run goes on and publishes, as any run does;
- any difference (a file added, removed, resized or touched since the manifest was written) fails the run before it
  publishes, naming the files and the fix.  What was copied stays for the next run, which resumes.

No wrong byte can be served meanwhile: every file is hashed as it is copied and renamed into place only when its
digest is the manifest's.  A file only touched since (same bytes, a new mtime) is copied, and the listing's
verdict fails the run before the version is published.  Rows from a manifest carry no inode, so the copy's
same-inode check (:func:`~..sources.stable.open_listed`) does not apply to them; the digest does.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cache import trust
from ..cache.columns import StrColumn
from ..cache.manifest import SOURCE_MANIFEST_NAME, Manifest
from ..engine.workerpool import die_with_parent
from ..errors import SourceChangedError, SourceError
from ..sources.listing import Listing
from .sharding import node_listing, take_shard

if TYPE_CHECKING:
    from ..sources.source import Source
    from .stager import StageOptions

NAMED = 5  #: files named per kind of difference in the message
MANIFEST_MAX = 1 << 34  #: a source manifest is read whole (1.28 M files: about 100 MB in JSON)


def rows_from_manifest(source: Source, opts: StageOptions, say: Callable[[str], None]) -> Listing | None:
    """The run's listing from the source's manifest, selected and sharded as a listing would be; None where the
    source is no local folder, has no manifest, or one this process may not take its paths from (then it is
    listed first, as always, and the manifest gives digests only).

    Only a manifest of this process's own user gives paths: the rows are what it reads, and a file is renamed
    into place only when its digest is the manifest's, so a manifest nobody else could have written is what makes
    the bytes served before the listing comes right.  Another user's manifest (a shared folder, a replaced file)
    and one whose paths leave the source (``..``, ``/``) are not used for rows."""
    if not source.is_folder:
        return None
    path = f"{source.base}/{SOURCE_MANIFEST_NAME}"
    try:
        raw = trust.read_small(path, limit=MANIFEST_MAX, owners=frozenset({os.geteuid()}))
    except OSError as e:  # none, a link, unreadable: the stage says what it must, as without rows from it
        if e.errno in (errno.EINVAL, errno.EPERM):
            say(f"{path} is not a file of this user: its digests are checked, its paths not taken as rows")
        return None
    m = Manifest.parse(raw, path)
    source.use_manifest(m)  # the digests every copy is checked against: this manifest's, read once
    if not len(m) or not m.sorted_by_bytes or not plain_paths(m.path):
        say(f"{path} does not list plain relative paths in order: its paths are not taken as rows")
        return None
    listing = Listing(m.path, m.size, m.mtime_ns)
    return Listing.of(take_shard(source.selected(listing, opts.include, opts.exclude), opts.shard))


_DOT, _SLASH = ord("."), ord("/")


def plain_paths(paths: StrColumn) -> bool:
    """Is every path relative, without empty, ``.`` or ``..`` parts (a path a listing of the folder could give)?
    Each row's first and last bytes in columns, then four searches of the joined paths for what may lie inside
    (a match across two rows needs one of them to start or end badly): about 0.05 s at 1.28 M paths, where one
    regular expression over them took 1.2 s."""
    blob = bytes(paths.blob)
    starts, ends = paths.offsets[:-1], paths.offsets[1:]
    n = ends - starts
    if not len(n) or bool((n <= 0).any()):
        return False
    b = np.frombuffer(blob, dtype=np.uint8)

    def byte(at: np.ndarray, where: np.ndarray) -> np.ndarray:  # the byte at ``at`` where the row has one, else 0
        out = np.zeros(len(at), dtype=np.uint8)
        out[where] = b[at[where]]
        return out

    f0, f1, f2 = b[starts], byte(starts + 1, n > 1), byte(starts + 2, n > 2)
    l1, l2, l3 = b[ends - 1], byte(ends - 2, n > 1), byte(ends - 3, n > 2)
    bad = (f0 == _SLASH) | (l1 == _SLASH)  # "/x", "x/"
    bad |= (f0 == _DOT) & ((n == 1) | (f1 == _SLASH) | ((f1 == _DOT) & ((n == 2) | (f2 == _SLASH))))  # . .. ./ ../
    bad |= (l1 == _DOT) & ((l2 == _SLASH) | ((l2 == _DOT) & (l3 == _SLASH)))  # x/. x/..
    return not bool(bad.any()) and not any(part in blob for part in (b"//", b"/./", b"/../", b"\x00"))


class ListingCheck:
    """The source listed in a forked process and compared there with ``rows`` (which the fork shares): the
    verdict comes back as a few words, never the listing.  Start it before any thread does (a fork copies only
    the thread that forks)."""

    def __init__(self, source: Source, opts: StageOptions, rows: Listing) -> None:
        self.url = source.url
        self.manifest = f"{source.base}/{SOURCE_MANIFEST_NAME}"
        self.changes = ""  #: what differs, once the verdict says
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc: Any = ctx.Process(target=_check, args=(child, source, opts, rows, os.getpid()),
                                      name="stagingloader-listing-check", daemon=True)
        self._proc.start()
        child.close()
        self._verdict: tuple[str, str] | None = None

    def done(self) -> bool:
        """Has the verdict come (or the process ended without one)?"""
        return self._verdict is not None or self._conn.poll() or not self._proc.is_alive()

    def verdict(self) -> None:
        """Wait for the verdict: nothing if the source is as the rows say, else a SourceError that says what
        differs and what to do."""
        if self._verdict is None:
            try:
                self._verdict = self._conn.recv()
            except (EOFError, OSError):
                self._verdict = ("error", f"listing {self.url} to check it against its manifest ended without an "
                                          f"answer (exit code {self._proc.exitcode}); stage again")
            self.close()
        kind, text = self._verdict
        if kind == "changed":
            self.changes = text
            raise SourceChangedError(
                f"{self.url} changed since its manifest {self.manifest} was written: {text}. This run served only "
                "files whose digests match the manifest, and publishes nothing; what it copied stays. Run "
                f"`stagingloader manifest {self.url}` again if the change is intended, then stage again (it resumes)")
        if kind == "error":
            raise SourceError(text)

    def close(self) -> None:
        """Stop the listing if it still runs."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        with contextlib.suppress(OSError):
            self._conn.close()


def _check(conn: Connection, source: Source, opts: StageOptions, rows: Listing, parent: int) -> None:
    """In the forked process: list, select, shard, compare; send ("same" | "changed" | "error", text)."""
    die_with_parent(parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    try:
        # one walking process (a fork of the stager beside the first batch; it may start no pool of its own)
        real = node_listing(source, opts.include, opts.exclude, opts.shard, workers=1)
        conn.send(("same", "") if same_files(real, rows) else ("changed", differences(real, rows)))
    except BaseException as e:  # said by the stager, as its own error
        with contextlib.suppress(OSError):
            conn.send(("error", str(e) if isinstance(e, SourceError) else f"listing {source.url} failed: {e}"))
    finally:
        conn.close()


def same_files(a: Listing, b: Listing) -> bool:
    """The same paths in the same order, with the same sizes and mtimes (column against column)."""
    return (a.path.same_as(b.path) and bool(np.array_equal(a.size, b.size))
            and bool(np.array_equal(a.mtime_ns, b.mtime_ns)))


def differences(real: Listing, rows: Listing) -> str:
    """What differs between the source as listed and the rows its manifest gave, in the user's words."""
    listed = dict(zip(real.path, zip(real.size.tolist(), real.mtime_ns.tolist())))
    kept = dict(zip(rows.path, zip(rows.size.tolist(), rows.mtime_ns.tolist())))
    added = [p for p in listed if p not in kept]
    removed = [p for p in kept if p not in listed]
    changed = [p for p, sm in kept.items() if p in listed and listed[p] != sm]
    parts = [f"{len(names)} {what} ({', '.join(names[:NAMED])}{', ...' if len(names) > NAMED else ''})"
             for names, what in ((added, "added"), (removed, "removed"), (changed, "changed in size or mtime"))
             if names]
    return "; ".join(parts) or "the manifest lists its files out of order"


__all__ = ["ListingCheck", "differences", "plain_paths", "rows_from_manifest", "same_files"]
