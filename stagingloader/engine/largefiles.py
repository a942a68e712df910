"""A large file copied by ranges into one temp file, by the worker that opened it, and hashed in order.

A large file's ranges go to one worker, in order (:meth:`.copier.Copier._next_job`): it copies each through its
reused buffer and hashes the bytes there, both for the range's digest (the ``.ranges`` journal, from which a
killed copy resumes) and into the file's running digest; with the last range
it sends the file's xxh3-128 digest, the one the manifest records.  The stager's process reads none of it.

When the stager copied a file's first ranges while the workers started, the worker that takes the file over
carries the chain on, after hashing those ranges back from the temp file once.  When the ranges cannot all come
from one worker in order (another worker helps with the last file from a network file system, ranges of an
interrupted run are reused, or a remote source's threads copy them in any order), the chain is *broken*: the
stager then hashes the file itself, in order, as the ranges before them finish.  A remote range comes back with
its bytes (the client's buffer), and up to :data:`HELD_RANGES` of them per file that finished ahead of their turn
wait in memory for it: hashing them there costs a quarter of hashing them again from a mapping of the written
pages (page faults, and a cold read).  Any other range is hashed from a read-only mapping of the temp file.

(obstore can also stream a range in pieces, but it hands each piece over as a new Python ``bytes``: two more
copies of every byte, into fresh pages, which cost more CPU here than the one buffer per range.)
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import xxhash

from .. import digest as dg
from ..errors import SourceChangedError
from ..fsio import atomic_write
from ..sources import stable
from ..sources.source import SourceFile
from .copyops import Buffer, hash_written
from .incoming import Incoming, partial_id

log = logging.getLogger(__name__)

#: remote ranges per file whose bytes wait in memory for the in-order digest (the rest are read back from the file)
HELD_RANGES = 4
_NOBODY, _BROKEN = object(), object()  #: no range handed out yet; ranges handed to several (see hand_out)


class LargeFile:
    """One large file being copied: its temp file, its ``.ranges`` journal, the in-order hasher."""

    def __init__(self, f: SourceFile, path: str, incoming: Incoming, range_size: int, *, local: bool) -> None:
        self.file = f
        self.path = path  #: where the source has it (a local path; for messages otherwise)
        self.range_size = range_size
        pid = partial_id(f.rel)
        self.tmp = incoming.partial / f"{pid}.big"
        self.ranges_path = incoming.partial / f"{pid}.ranges"
        self.hasher: xxhash.xxh3_128 = dg.new_hasher()  #: the stager's in-order digest, once the chain is broken
        self.hashed = 0  #: bytes the stager hashed, in order
        self.next_offset = 0  #: the end of the ranges finished so far, in order
        self.handed_out = 0  #: the end of the last range handed to a worker (or found intact)
        self.finished_ranges: dict[int, int] = {}  #: offset -> length, finished but not yet counted in order
        self.held: dict[int, list[Buffer]] = {}  #: offset -> a remote range's bytes, until the stager hashes them
        self.chain: Any = _NOBODY  #: who hashes the whole file in order: the worker its first range went to
        self.chain_digest = ""  #: the file's digest, sent by that worker with the last range
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
        self.break_chain()  # its bytes passed through no worker this run
        self.finished_ranges[offset] = length
        return True

    def hand_out(self, executor: Any, offset: int, length: int, *, in_order: bool) -> bool:
        """Note that ``executor`` (a worker process, or None: this process or its threads) copies this range;
        True if it should also carry the file's running digest.  Only the executor of the first range can, and only
        while it gets every range in order (``in_order``: it runs its jobs one after the other)."""
        self.handed_out = offset + length
        if self.chain is _NOBODY and offset == 0 and in_order:
            self.chain = executor
        elif self.chain is None and executor is not None and in_order and offset == self.next_offset:
            self.chain = executor  # from this process, which copied the first ranges while the workers started,
            # to a worker, which hashes those back once (all are written: every range before is finished)
        if self.chained and self.chain is executor:
            return True
        self.break_chain()
        return False

    def break_chain(self) -> None:
        """From now on the stager hashes the file itself (from the start, over the pages already written)."""
        self.chain = _BROKEN

    @property
    def chained(self) -> bool:
        return self.chain is not _BROKEN and self.chain is not _NOBODY

    def range_copied(self, offset: int, length: int, digest: str, file_digest: str = "",
                     pieces: Sequence[Buffer] = ()) -> None:
        """A range was copied: journal it (for a resume) and queue it for the in-order count; ``file_digest``
        comes with the last range of a chain, ``pieces`` with a remote range (its bytes, kept to hash in order)."""
        os.write(self.ranges_fd, f"{offset} {length} {digest}\n".encode())
        self.finished_ranges[offset] = length
        if file_digest:
            self.chain_digest = file_digest
        if pieces and not self.chained and (
                len(self.held) < HELD_RANGES or offset == self.next_offset):  # the next in order: hashed at once
            self.held[offset] = list(pieces)

    def hash_ready(self) -> bool:
        """Count the ranges now finished in order (and hash them, unless a worker does); True once the whole file
        is copied and its digest known."""
        while self.next_offset in self.finished_ranges:
            self.next_offset += self.finished_ranges.pop(self.next_offset)
        if not self.chained:
            while self.hashed < self.next_offset:  # from the start when the chain just broke
                pieces = self.held.pop(self.hashed, None)
                if pieces is not None:
                    for piece in pieces:
                        self.hasher.update(piece)
                        self.hashed += len(piece)
                    continue
                length = min(self.range_size, self.next_offset - self.hashed)
                with mmap.mmap(self.fd, length, prot=mmap.PROT_READ, offset=self.hashed) as m:
                    self.hasher.update(m)
                self.hashed += length
        if self.next_offset != self.file.size:
            return False
        if self.chained and not self.chain_digest:  # the worker lost the chain (it should not): hash here
            self.break_chain()
            return self.hash_ready()
        return True

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
        return self.chain_digest if self.chained else dg.format_digest(self.hasher)

    def close(self) -> None:
        self.held.clear()
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
