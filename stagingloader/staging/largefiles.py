"""A large file copied by ranges, by several workers at once, into one temp file; hashed in order behind them.

Workers copy ranges in any order (``sendfile``: no bytes pass through Python).  The file's xxh3-128 digest,
the one the manifest records, is computed in the stager's process over the pages already written, in order,
as the ranges before them finish: from a read-only mapping of the temp file, so no bytes are copied for it and
nothing waits in memory for its turn.  The same mapping gives each range's own digest for the ``.ranges``
journal, from which a killed copy resumes (mapping the pages costs more than hashing them: 0.24 s of system
time per GiB here against 0.1 s to hash, so they are mapped once).  A remote range arrives in memory and is
journaled with its digest at once.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import xxhash

from .. import digest as dg
from ..errors import SourceChangedError
from ..fsio import atomic_write
from . import stable
from .copyops import hash_written
from .incoming import Incoming, partial_id
from .sources import SourceFile

log = logging.getLogger(__name__)


class LargeFile:
    """One large file being copied: its temp file, its ``.ranges`` journal, the in-order hasher."""

    def __init__(self, f: SourceFile, path: str, incoming: Incoming, range_size: int, *, local: bool) -> None:
        self.file = f
        self.path = path  #: where the source has it (a local path; for messages otherwise)
        self.range_size = range_size
        pid = partial_id(f.rel)
        self.tmp = incoming.partial / f"{pid}.big"
        self.ranges_path = incoming.partial / f"{pid}.ranges"
        self.hasher: xxhash.xxh3_128 = dg.new_hasher()
        self.next_offset = 0  #: bytes hashed so far, in order
        self.handed_out = 0  #: the end of the last range handed to a worker (or found intact)
        self.finished_ranges: dict[int, int] = {}  #: offset -> length, copied but not hashed in order yet
        self.unjournaled: set[int] = set()  #: offsets of finished ranges to journal once hashed
        self.fd = self.src_fd = self.ranges_fd = -1
        self.identity: stable.Identity | None = None  #: a local source's identity when it was opened
        self.finished = False
        self.done = self._resumable()  #: offset -> range digest, from an interrupted run
        self._open(local)

    def _header(self) -> str:
        f = self.file
        return f"# {f.size} {f.mtime_ns} {f.etag}"

    def _resumable(self) -> dict[int, str]:
        try:
            lines = self.ranges_path.read_text("utf-8").splitlines()
        except (FileNotFoundError, UnicodeDecodeError):
            return {}
        done: dict[int, str] = {}
        if lines and lines[0] == self._header() and self.tmp.exists():
            for line in lines[1:]:
                parts = line.split()
                if len(parts) == 3 and dg.is_digest(parts[2]) and parts[0].isdigit():
                    done[int(parts[0])] = parts[2]
        return done

    def _open(self, local: bool) -> None:
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if not self.done:
                os.ftruncate(self.fd, 0)
                atomic_write(self.ranges_path, (self._header() + "\n").encode("utf-8"), mode=0o600)
            os.ftruncate(self.fd, self.file.size)
            self.ranges_fd = os.open(self.ranges_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            if local:
                self.src_fd, self.identity = stable.open_listed(self.path, self.file)
        except BaseException:
            self.close()
            raise

    def ranges(self) -> Iterator[tuple[int, int]]:
        """(offset, length) of every range, in order."""
        size, step = self.file.size, self.range_size
        for offset in range(0, size, step):
            yield offset, min(step, size - offset)

    def resumed(self, offset: int, length: int) -> bool:
        """True if a finished range of an interrupted run is intact in the temp file (it then counts as copied)."""
        want = self.done.get(offset)
        if want is None:
            return False
        if hash_written(self.fd, offset, length)[1] != want:
            return False
        self.finished_ranges[offset] = length
        return True

    def range_copied(self, offset: int, length: int, digest: str) -> None:
        """A worker copied a range: queue it for the in-order hash; journal it (for a resume) now if its digest is
        known, else once it is hashed."""
        if digest:
            os.write(self.ranges_fd, f"{offset} {length} {digest}\n".encode())
        else:
            self.unjournaled.add(offset)
        self.finished_ranges[offset] = length

    def hash_ready(self) -> bool:
        """Hash every range now next in order; True once the whole file is hashed."""
        while self.next_offset in self.finished_ranges:
            length = self.finished_ranges.pop(self.next_offset)
            if length:
                with mmap.mmap(self.fd, length, prot=mmap.PROT_READ, offset=self.next_offset) as m:
                    self.hasher.update(m)
                    if self.next_offset in self.unjournaled:
                        self.unjournaled.discard(self.next_offset)
                        digest = dg.digest_bytes(m)  # type: ignore[arg-type]
                        os.write(self.ranges_fd, f"{self.next_offset} {length} {digest}\n".encode())
            self.next_offset += length
        return self.next_offset == self.file.size

    def check_source(self) -> None:
        """Refuse the copy if a local source changed since it was opened (a write moves its ctime)."""
        if self.src_fd < 0:
            return
        f = self.file
        opened, now = self.identity, stable.identity(self.src_fd)
        if opened is None or now != opened or (now.size, now.mtime_ns) != (f.size, f.mtime_ns):
            self.close()
            self.discard()  # ranges of a file that changed must not be resumed
            raise SourceChangedError(f"{self.path} changed while it was copied (or since it was listed); stage "
                                     "again once it is stable")

    def seal(self, fsync: bool) -> str:
        """Set the mtime, fsync if asked, close; the file's digest."""
        mtime_ns = self.file.mtime_ns
        if mtime_ns:
            os.utime(self.fd, ns=(mtime_ns, mtime_ns))
        if fsync:
            os.fsync(self.fd)
        self.finished = True
        self.close()
        return dg.format_digest(self.hasher)

    def close(self) -> None:
        for name in ("fd", "src_fd", "ranges_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    def discard(self) -> None:
        for p in (self.tmp, self.ranges_path):
            with contextlib.suppress(FileNotFoundError):
                Path(p).unlink()


__all__ = ["LargeFile"]
