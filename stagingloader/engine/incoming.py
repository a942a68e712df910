"""The folder of a version being staged, and its journal: what a killed stager leaves to resume.

``incoming/data/`` holds only whole, verified files (each arrived by rename from
``incoming/.partial/``); ``journal.jsonl`` records each one's manifest entry.  A file under
``data/`` with no journal line (the journal is flushed in batches) is deleted at resume and
copied again; a journal line whose file is gone is forgotten.  Large files keep their
finished ranges in ``.partial/<id>`` with a ``.ranges`` journal, so they resume mid-file.

In memory, what this run records is kept in columns by listing row (:meth:`Incoming.track` hands the
copier its files and remembers each one's row until its entry comes back): row, size, mtime and the
16-byte digest, no object per file.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

from .. import digest as dg
from ..cache import trust
from ..cache.columns import Int64Array, RowArray
from ..cache.manifest import Entry
from ..fsio import atomic_write
from ..sources.files import DataFolders
from ..sources.listing import Listing, SourceFile
from .copyops import NEEDS_ESCAPE, journal_line


@dataclass(frozen=True, kw_only=True)
class Recorded:
    """Entries recorded by one run, by listing row: ``have`` marks the rows recorded, ``digest`` holds their
    16-byte digests (one row per listing row); size, mtime and etag are the listing's except where the copier
    recorded another (``changed``: row -> (size, mtime_ns, etag), rare: a file that changed as it was read)."""

    have: npt.NDArray[np.bool_]
    digest: npt.NDArray[np.uint8]
    changed: dict[int, tuple[int, int, str]]
    extra: list[Entry]

    @property
    def rows(self) -> Int64Array:
        return np.flatnonzero(self.have).astype(np.int64)


def partial_id(rel: str) -> str:
    return xxhash.xxh3_128_hexdigest(rel.encode("utf-8", "surrogateescape"))


_PREFIX_LEN = len(dg.PREFIX)


def journal_lines(done: list[tuple[str, int, int, str, str]]) -> list[str]:
    """:func:`journal_line` of each tuple: in one pass when no path or ETag needs escaping (the usual case)."""
    if not any([t[3] for t in done]) and not NEEDS_ESCAPE.search("".join([t[0] for t in done])):
        return [f'["{p}", {size}, {mtime}, "", "{digest}"]' for p, size, mtime, _, digest in done]
    return [journal_line(*t) for t in done]


class Incoming:
    """``ROOT/<key>/incoming``: a resumable, not yet published version."""

    FLUSH_EVERY = 32
    FLUSH_SECONDS = 0.1

    def __init__(self, path: Path, *, fsync: bool = False) -> None:
        self.path = path
        self.data = path / "data"
        self.partial = path / ".partial"
        self.journal_path = path / "journal.jsonl"
        self.fsync = fsync
        self._lock = threading.Lock()
        self._buffer: list[str] = []  #: journal lines not written yet (an element may hold several: a batch's)
        self._buffered = 0  #: the files in them
        self._last_flush = time.monotonic()
        self._fd: int | None = None
        self._folders = DataFolders(self.data, path)
        self._pending: dict[str, int] = {}  # rel -> listing row, for the files handed out and not yet recorded
        self._listing: Listing | None = None
        self._have = np.zeros(0, dtype=bool)  # per listing row: recorded by this run
        self._digest = np.zeros((0, 16), dtype=np.uint8)  # per listing row: its digest, once recorded
        self._changed: dict[int, tuple[int, int, str]] = {}  # row -> what was recorded, where not the listing's
        self._extra: list[Entry] = []  # entries of files not handed out by track()
        self.on_record: Callable[[list[Entry]], None] | None = None  #: told of each file recorded (streaming)

    def open(self) -> None:
        self.data.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.partial.mkdir(mode=0o755, exist_ok=True)
        self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    # ---- journal ---------------------------------------------------------------------------
    def record(self, entry: Entry) -> None:
        self.record_many([entry])

    def record_many(self, entries: list[Entry]) -> None:
        """Journal ``entries`` (whole, verified files under ``data/``) and file them by listing row."""
        self.record_tuples([(e.path, e.size, e.mtime_ns, e.etag, e.digest) for e in entries], entries)

    def record_tuples(self, done: list[tuple[str, int, int, str, str]], entries: list[Entry] | None = None) -> None:
        """:meth:`record_many` for ``(path, size, mtime_ns, etag, digest)`` tuples, as the copy workers send them
        back: filed in columns, a batch at a time, with no object made per file (``entries``: the same files as
        Entry objects, when the caller made them anyway, for :attr:`on_record`)."""
        if not done:
            return
        lines = journal_lines(done)
        recorded = done  #: every file, for on_record (those track() did not hand out too)
        with self._lock:
            pending = self._pending
            rows = [pending.pop(t[0], -1) for t in done]
            if min(rows) < 0:
                self._extra.extend(Entry(*t) for t, row in zip(done, rows) if row < 0)
                kept = [i for i, row in enumerate(rows) if row >= 0]
                done, rows = [done[i] for i in kept], [rows[i] for i in kept]
            if rows:
                at = np.array(rows, dtype=np.int64)
                self._have[at] = True
                hexes = "".join([t[4][_PREFIX_LEN:] for t in done])
                self._digest[at] = np.frombuffer(bytes.fromhex(hexes), dtype=np.uint8).reshape(-1, 16)
                listing = self._listing
                assert listing is not None
                sizes = np.fromiter((t[1] for t in done), dtype=np.int64, count=len(done))
                mtimes = np.fromiter((t[2] for t in done), dtype=np.int64, count=len(done))
                odd = (sizes != listing.size[at]) | (mtimes != listing.mtime_ns[at])
                with_etag = listing.etag.any_nonempty()
                if with_etag or any(t[3] for t in done):
                    odd |= np.array([t[3] != (listing.etag[r] if with_etag else "") for t, r in zip(done, rows)])
                for i in np.flatnonzero(odd).tolist():
                    self._changed[rows[i]] = done[i][1:4]
            self._buffer.extend(lines)
            self._buffered += len(lines)
            due = self._buffered >= self.FLUSH_EVERY or time.monotonic() - self._last_flush > self.FLUSH_SECONDS
        if due:
            self.flush()
        if self.on_record is not None:
            self.on_record(entries if entries is not None else [Entry(*t) for t in recorded])

    def track_rows(self, listing: Listing) -> None:
        """Rows of ``listing`` will be recorded by :meth:`record_rows` (a blocking local stage's batches)."""
        self._use(listing)

    def record_rows(self, rows: RowArray, sizes: Int64Array, mtimes: Int64Array, digests: npt.NDArray[np.uint8],
                    lines: str) -> None:
        """Journal the files at ``rows`` of the tracked listing, copied with these sizes, mtimes and raw digests
        (a row of 16 bytes each), whose journal ``lines`` the copy worker wrote: a batch in a few array
        operations."""
        if not len(rows):
            return
        with self._lock:
            listing = self._listing
            assert listing is not None
            self._have[rows] = True
            self._digest[rows] = digests
            odd = (sizes != listing.size[rows]) | (mtimes != listing.mtime_ns[rows])
            for i in np.flatnonzero(odd).tolist():  # changed since the listing: what was copied is recorded
                self._changed[int(rows[i])] = (int(sizes[i]), int(mtimes[i]), "")
            self._buffer.append(lines)
            self._buffered += len(rows)
            due = self._buffered >= self.FLUSH_EVERY or time.monotonic() - self._last_flush > self.FLUSH_SECONDS
        if due:
            self.flush()

    def journal(self, entries: list[Entry]) -> None:
        """Journal ``entries`` without filing them (files whose entries the caller already holds: hard links)."""
        lines = [journal_line(e.path, e.size, e.mtime_ns, e.etag, e.digest) for e in entries]
        with self._lock:
            self._buffer.extend(lines)
        self.flush()

    def track(self, listing: Listing, rows: RowArray) -> Iterator[SourceFile]:
        """The files at ``rows`` of ``listing``, made one at a time for the copier; each one's row is remembered
        until its entry is recorded, so that :meth:`record_many` files it in columns."""
        self._use(listing)
        return listing.iter_rows(rows, on_rows=self._expect)

    def expect(self, listing: Listing, rel: str, row: int) -> None:
        """File ``rel``, row ``row`` of ``listing``, by row once it is recorded, as :meth:`track` does for the
        files it hands out: for files handed out one at a time (a streaming run's picks, a peer's file).  Left
        untracked, a file's entry waits in a list, and the manifest then looks each one up by path (20,000
        binary searches in Python were 4 s of a 20,000-object streaming stage's publish)."""
        self._use(listing)
        self._pending[rel] = row

    def _use(self, listing: Listing) -> None:
        """Rows are ``listing``'s (the first call sets the columns up; they are one run's, for one listing)."""
        if self._listing is not listing:
            with self._lock:
                if self._listing is not None:
                    raise ValueError("one Incoming tracks the rows of one listing")
                self._listing = listing
                self._have = np.zeros(len(listing), dtype=bool)
                self._digest = np.zeros((len(listing), 16), dtype=np.uint8)

    def _expect(self, rels: list[str], rows: list[int]) -> None:
        self._pending.update(zip(rels, rows))  # atomic under the interpreter's lock, and runs a chunk at a time

    def row_of(self, rel: str) -> int:
        """The listing row of a file handed out by :meth:`track` and not yet recorded, else -1."""
        return self._pending.get(rel, -1)

    def recorded(self) -> Recorded:
        """What this process recorded, by listing row, and the entries of files :meth:`track` did not hand out."""
        with self._lock:
            return Recorded(have=self._have, digest=self._digest, changed=dict(self._changed),
                            extra=list(self._extra))

    @property
    def entries(self) -> list[Entry]:
        """Every entry recorded by this process (made on access)."""
        rec = self.recorded()
        out = list(rec.extra)
        if self._listing is not None:
            for row in rec.rows.tolist():
                f = self._listing.row(row)
                size, mtime, etag = rec.changed.get(row, (f.size, f.mtime_ns, f.etag))
                out.append(Entry(f.rel, size, mtime, etag, dg.PREFIX + bytes(rec.digest[row].tobytes()).hex()))
        return out

    def flush(self) -> None:
        with self._lock:
            if not self._buffer or self._fd is None:
                return
            data = ("\n".join(self._buffer) + "\n").encode("utf-8", "surrogateescape")
            self._buffer.clear()
            self._buffered = 0
            self._last_flush = time.monotonic()
            os.write(self._fd, data)

    def load(self, listing: Mapping[str, SourceFile]) -> tuple[dict[str, Entry], int]:
        """Finished files an interrupted run left, and the bytes of the others (to be removed).

        A file is kept when its journal entry, or for a file the journal missed (it is flushed
        in batches) the current listing, has its size and mtime; the latter is re-hashed here,
        locally.  Files are under their final names only when whole, so this is safe.
        """
        journal: dict[str, Entry] = {}
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            raw = b""
        for line in raw.decode("utf-8", "surrogateescape").splitlines():
            try:
                path, size, mtime_ns, etag, digest = json.loads(line)
            except (ValueError, TypeError):
                continue  # a line torn by a kill
            journal[path] = Entry(path, size, mtime_ns, etag, digest)
        done: dict[str, Entry] = {}
        stray = 0
        buf = bytearray(dg.CHUNK)
        walk = os.fwalk(self.data) if trust.lstat(self.data) is not None else iter(())
        for dirpath, _dirs, names, dir_fd in walk:  # never through a link
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.data)
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    continue  # a link or another thing: never ours, swept
                e = journal.get(rel)
                if e is not None and st.st_size == e.size and st.st_mtime_ns == e.mtime_ns:
                    done[rel] = e
                    continue
                f = listing.get(rel)
                if e is None and f is not None and f.mtime_ns and (f.size, f.mtime_ns) == (st.st_size, st.st_mtime_ns):
                    digest, size = dg.hash_file(full, buf, nofollow=True)
                    if size == f.size:
                        done[rel] = Entry(rel, size, f.mtime_ns, f.etag, digest)
                        continue
                stray += st.st_size
        return done, stray

    def sweep(self, journaled: Mapping[str, Entry]) -> None:
        """Remove files of ``data/`` not in ``journaled`` (copied again) and stale temp files.

        Walks by directory descriptors and never through a link: a link found here is removed as a link, and
        ``data/`` and ``.partial/`` themselves were checked to be real folders (``DatasetDir.check``)."""
        walk = os.fwalk(self.data) if trust.lstat(self.data) is not None else iter(())
        for dirpath, dirs, files, dir_fd in walk:
            for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
                full = os.path.join(dirpath, name)
                if os.path.relpath(full, self.data) not in journaled:
                    os.unlink(name, dir_fd=dir_fd)
        try:
            fd = trust.open_dir(self.partial)
        except FileNotFoundError:
            return
        try:
            names = set(os.listdir(fd))
            for name in names:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):  # a copy worker's temp folder (w<pid>): what it left is never resumed
                    trust.remove_tree(self.partial / name)
                    continue
                stem, _, ext = name.partition(".")
                resumable = (ext == "big" and f"{stem}.ranges" in names) or (ext == "ranges" and f"{stem}.big" in names)
                if not resumable:
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                        os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def drop(self, rels: list[str] | tuple[str, ...]) -> None:
        for rel in rels:
            trust.unlink_under(self.data, rel)

    def rewrite_journal(self, entries: list[Entry]) -> None:
        """Start a clean journal holding just ``entries`` (after a plan dropped stale ones)."""
        lines = [journal_line(e.path, e.size, e.mtime_ns, e.etag, e.digest) for e in entries]
        atomic_write(self.journal_path, ("\n".join(lines) + ("\n" if lines else "")).encode("utf-8", "surrogateescape"),
                     mode=0o600)

    # ---- files -----------------------------------------------------------------------------
    def ensure_parent(self, final: str | Path) -> None:
        """Create the parent folders of ``final`` under ``data/``, never through a link (see :class:`DataFolders`)."""
        self._folders.ensure_parent(final)

    def remove_partials(self) -> None:
        trust.remove_tree(self.partial)
        self.partial.mkdir(mode=0o755, exist_ok=True)
