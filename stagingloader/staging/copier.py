"""The copy engine: parallel, chunked, hashing while copying, temp file + rename, journaled.

Work items are whole small files or fixed-size ranges of large files, run by a bounded thread
pool.  A *slot* (a reusable buffer) is taken by the dispatcher before an item is submitted, in
order, which bounds memory (slots x range size) and guarantees progress: the earliest
unhashed range of a large file always holds a slot.  Each file's xxh3-128 digest is computed
in order from the bytes as they stream through (ranges finishing early wait, buffered, for
their turn), so the source is read once.  A range's own digest goes to a ``.ranges`` journal
so that a killed copy resumes from its finished ranges.

Small files from a local path pass a *gate* (:class:`_Gate`) that decides how many batches of
them copy at once.  Python holds the GIL for much of a small file's copy: when the source
answers at once (page cache, a fast local disk) more threads only fight over it (measured on 2
cores: 200,000 x 4 KiB in 8.5 s with one thread, 18.9 s with four), while a source or target
that makes a thread wait (a network file system, a cold disk, fsync on a disk) needs the threads
to overlap the waits.  So the gate times windows of batches and tries one thread against all of
them from time to time, keeping whichever copies files faster.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .. import digest as dg
from ..cache.layout import safe_join
from ..cache.manifest import Entry
from ..errors import NoSpaceError, RootError, SourceChangedError, StagingError, VerificationError
from ..fsio import atomic_write
from . import stable
from .incoming import Incoming, partial_id
from .retry import as_source_error, call_with_retry, is_transient_os_error
from .sources import Source, SourceFile

log = logging.getLogger(__name__)


SMALL_BATCH_FILES = 64  #: small files per task
SMALL_BATCH_BYTES = 16 << 20


@dataclass(frozen=True, kw_only=True)
class CopySettings:
    workers: int = 8
    range_size: int = 8 << 20  #: large files are split into ranges of this size
    large_threshold: int = 32 << 20  #: files above this size are copied by ranges
    fsync: bool = False
    small_batch_files: int = SMALL_BATCH_FILES  #: small files per task (a streaming run takes 1: no file waits)


class Progress:
    """Thread-safe counters, forwarded to an fsspec-style callback (``relative_update(bytes)``)."""

    def __init__(self, callback: Any = None, on_file: Callable[[int], None] | None = None) -> None:
        self.callback = callback
        self.on_file = on_file
        self.lock = threading.Lock()
        self.bytes = 0
        self.files = 0

    def set_size(self, nbytes: int) -> None:
        """Tell the callback how many bytes this run will copy."""
        if self.callback is not None:
            self.callback.set_size(nbytes)

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes += n
            if self.callback is not None and n:
                self.callback.relative_update(n)

    def add_files(self, files: int, nbytes: int) -> None:
        with self.lock:
            self.files += files
            self.bytes += nbytes
            if self.callback is not None and nbytes:
                self.callback.relative_update(nbytes)
            if self.on_file is not None:
                self.on_file(self.files)


class _Slots:
    """A fixed set of reusable buffers; ``get`` blocks while all are in use."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: queue.LifoQueue[bytearray | None] = queue.LifoQueue()
        for _ in range(count):
            self._free.put(None)  # allocated on first use, then reused

    def get(self, stop: threading.Event) -> tuple[bool, bytearray | None]:
        """A free slot's buffer; (False, None) once ``stop`` is set."""
        while not stop.is_set():
            try:
                return True, self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return False, None

    def put(self, buf: bytearray | None) -> None:
        self._free.put(buf)

    def buffer(self, buf: bytearray | None) -> bytearray:
        return buf if buf is not None else bytearray(self.size)


class _Gate:
    """How many batches of small files copy at once: one thread or all of them, whichever copies faster.

    It keeps a *settled* limit and times windows of batches under it; now and then it tries the other
    limit for one window and settles there if files came faster by ``GAIN``.  Failed trials come less
    and less often (after 2, 4, ... ``MAX_WAIT`` windows), so a steady source costs a trial now and then.
    """

    WINDOW = 8  #: batches per measurement
    GAIN = 1.15  #: how much faster a trial must copy to be kept
    MAX_WAIT = 64  #: the most windows between trials

    def __init__(self, workers: int, adaptive: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        self.workers = workers
        self.adaptive = adaptive and workers > 1
        self.limit = 1 if self.adaptive else workers
        self.running = 0
        self.cond = threading.Condition()
        self._clock = clock
        self._t0 = clock()
        self._batches = self._files = 0
        self._settled = self.limit
        self._rate = 0.0  #: files/s of the last window at the settled limit
        self._trial = False
        self._wait = 1  #: windows before the next trial
        self._countdown = 1

    def enter(self, stop: threading.Event) -> bool:
        """Wait for a place; False if ``stop`` was set meanwhile."""
        with self.cond:
            while self.running >= self.limit:
                if stop.is_set():
                    return False
                self.cond.wait(0.1)
            self.running += 1
            return True

    def leave(self, files: int) -> None:
        """A batch of ``files`` finished."""
        with self.cond:
            self.running -= 1
            if self.adaptive:
                self._batches += 1
                self._files += files
                if self._batches >= self.WINDOW:
                    self._judge()
            self.cond.notify_all()

    def _judge(self) -> None:
        now = self._clock()
        rate = self._files / max(now - self._t0, 1e-9)
        if self._trial:
            self._trial = False
            if rate > self.GAIN * self._rate:
                log.debug("small files: %d at a time copy %.0f files/s against %.0f with %d: keeping %d",
                          self.limit, rate, self._rate, self._settled, self.limit)
                self._settled, self._rate, self._wait = self.limit, rate, 8
            else:
                self.limit, self._wait = self._settled, min(2 * self._wait, self.MAX_WAIT)
            self._countdown = self._wait
        else:
            self._rate = rate
            self._countdown -= 1
            if self._countdown <= 0:
                self._trial = True
                self.limit = 1 if self._settled > 1 else self.workers
        self._t0 = now
        self._batches = self._files = 0


class _LargeFile:
    """Shared state of one large file copied by ranges."""

    def __init__(self, f: SourceFile, tmp: Path, ranges_path: Path, done: dict[int, str]) -> None:
        self.file = f
        self.tmp = tmp
        self.ranges_path = ranges_path
        self.done = done  #: offset -> range digest, from an interrupted run
        self.lock = threading.Lock()
        self.hasher = dg.new_hasher()
        self.next_offset = 0
        self.pending: dict[int, tuple[memoryview, bytearray | None]] = {}
        self.fd = -1
        self.src_fd = -1
        self.ranges_fd = -1
        self.finished = False
        self.identity: stable.Identity | None = None  #: a local source's identity when it was opened


class Copier:
    """Copy files from a source into an :class:`Incoming` folder; see the module docstring."""

    def __init__(self, source: Source, incoming: Incoming, settings: CopySettings, *,
                 expected: Mapping[str, str] | None = None, progress: Progress | None = None,
                 stop: threading.Event | None = None) -> None:
        self.source = source
        self.incoming = incoming
        self.settings = settings
        self.expected = expected or {}
        self.progress = progress or Progress()
        self.stop = stop or threading.Event()
        self.bytes_copied = 0
        self.bytes_resumed = 0
        self._count_lock = threading.Lock()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._large: list[_LargeFile] = []
        self._names = itertools.count()  # temp names: unique within this run, and .partial is swept at resume
        self._partial = f"{incoming.partial}/{os.getpid()}-"
        self._data = str(incoming.data)
        self._gate = _Gate(settings.workers, adaptive=source.is_local)

    # ---- driver ----------------------------------------------------------------------------
    def run(self, files: Iterable[SourceFile]) -> None:
        """Copy ``files``, pulled lazily (a generator may pick each next file when a slot frees; the stager hands
        them out one at a time from its columns); on the first failure stop, clean up, and raise it."""
        s = self.settings
        slots = _Slots(s.workers + min(s.workers, 4), s.range_size)
        futures: set[Future[None]] = set()
        with ThreadPoolExecutor(s.workers, thread_name_prefix="stagingloader-copy") as pool:
            try:
                for task in self._tasks(files):
                    got, buf = slots.get(self.stop)
                    if not got:
                        break
                    fut = pool.submit(self._run_task, task, slots, buf)
                    futures.add(fut)
                    fut.add_done_callback(futures.discard)
            except BaseException as e:  # KeyboardInterrupt in the dispatcher
                self._fail(e)
            finally:
                if self._error is not None:
                    self.stop.set()
        self._close_large(remove=isinstance(self._error, NoSpaceError))
        if self._error is not None:
            raise self._error

    def _tasks(self, files: Iterable[SourceFile]) -> Iterator[tuple[Any, ...]]:
        """Small files in batches (one task, one buffer, one progress update for many files); large ones by range."""
        s = self.settings
        batch: list[SourceFile] = []
        batch_bytes = 0
        for f in files:
            if self.stop.is_set():
                return
            if f.size <= s.large_threshold:
                batch.append(f)
                batch_bytes += f.size
                if len(batch) >= s.small_batch_files or batch_bytes >= SMALL_BATCH_BYTES:
                    yield ("files", batch)
                    batch, batch_bytes = [], 0
                continue
            lf = self._open_large(f)
            if lf is None:
                continue
            for offset in range(0, f.size, s.range_size):
                yield ("range", lf, offset, min(s.range_size, f.size - offset))
        if batch:
            yield ("files", batch)

    def _run_task(self, task: tuple[Any, ...], slots: _Slots, buf: bytearray | None) -> None:
        keep_slot = False
        try:
            if self.stop.is_set():
                return
            if task[0] == "files":
                if not self._gate.enter(self.stop):
                    return
                try:
                    buf = self._copy_batch(task[1], slots, buf)
                finally:
                    self._gate.leave(len(task[1]))
            else:
                lf, offset, length = task[1:]
                view, buf = self._fetch_range(lf, offset, length, slots, buf)
                keep_slot = True  # from here the slot belongs to the in-order hasher
                if self._hash_in_order(lf, offset, view, buf, slots):
                    self._finish_large(lf)
        except BaseException as e:
            self._fail(e)
        finally:
            if not keep_slot:
                slots.put(buf)

    def _fail(self, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = as_root_error(exc)
        self.stop.set()

    def _count(self, copied: int = 0, resumed: int = 0) -> None:
        with self._count_lock:
            self.bytes_copied += copied
            self.bytes_resumed += resumed

    # ---- small files -----------------------------------------------------------------------
    def _copy_batch(self, files: list[SourceFile], slots: _Slots, buf: bytearray | None) -> bytearray | None:
        """Copy small files one after the other through one buffer; journal and count them together."""
        entries: list[Entry] = []
        nbytes = 0
        try:
            for f in files:
                if self.stop.is_set():
                    break
                entry, buf = self._copy_small(f, slots, buf)
                entries.append(entry)
                nbytes += entry.size
        finally:
            if entries:
                self.incoming.record_many(entries)
                self.progress.add_files(len(entries), nbytes)
                self._count(copied=nbytes)
        return buf

    def _copy_small(self, f: SourceFile, slots: _Slots, buf: bytearray | None) -> tuple[Entry, bytearray | None]:
        tmp = f"{self._partial}{next(self._names)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            hasher = dg.new_hasher()
            if self.source.is_local:
                buf = slots.buffer(buf)
                mtime_ns, size = self._read_local(f, memoryview(buf), hasher, fd)
                etag = ""
            else:
                data = self.source.read_range(f.rel, 0, f.size, f.etag) if f.size else b""
                hasher.update(data)
                _write_all(fd, memoryview(data))
                mtime_ns, size, etag = f.mtime_ns, f.size, f.etag
            if mtime_ns:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            if self.settings.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        entry = Entry(f.rel, size, mtime_ns, etag, dg.format_digest(hasher))
        self._publish(f.rel, tmp, f"{self._data}/{f.rel}", entry)
        return entry, buf

    def _read_local(self, f: SourceFile, view: memoryview, hasher: xxhash.xxh3_128, out_fd: int) -> tuple[int, int]:
        """Copy a local file into ``out_fd`` through ``view``; return the (mtime_ns, size) copied.

        The bytes are one state of the file the listing named, or the file is refused (see :mod:`.stable`).
        A transient error of a mounted share (EIO, ESTALE...) starts the read again, with back-off.
        """
        path = self.source.local_path(f.rel)
        tries = 0

        def attempt() -> tuple[int, int] | None:
            nonlocal tries
            tries += 1
            if tries > 1:  # start again from nothing: only a retry pays these three calls, not every small file
                hasher.reset()
                os.lseek(out_fd, 0, os.SEEK_SET)
                os.ftruncate(out_fd, 0)
            src, before = stable.open_listed(path, f)
            try:
                size = 0
                while n := _read_source(src, view, path):
                    hasher.update(view[:n])
                    _write_out(out_fd, view[:n])
                    size += n
                after = stable.identity(src)
            finally:
                os.close(src)
            return (after.mtime_ns, size) if after == before and size == after.size else None

        for _ in range(stable.READ_TRIES):
            got = call_with_retry(attempt, path, self.source.retry, self.stop)
            if got is not None:
                return got
            log.info("%s changed while it was copied: reading it again", path)
        raise stable.changing(path)

    def _publish(self, rel: str, tmp: str | Path, final: str | Path, entry: Entry) -> None:
        want = self.expected.get(rel)
        if want is not None and want != entry.digest:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise VerificationError(
                f"{self.source.path_of(rel)}: digest {entry.digest} does not match the source manifest's "
                f"{want}; the bytes were corrupted on the way or the source changed since "
                "`stagingloader manifest` ran (run it again if the change is intended)"
            )
        self.incoming.ensure_parent(final)
        os.rename(tmp, final)

    # ---- large files -----------------------------------------------------------------------
    def _open_large(self, f: SourceFile) -> _LargeFile | None:
        pid = partial_id(f.rel)
        tmp = self.incoming.partial / f"{pid}.big"
        ranges_path = self.incoming.partial / f"{pid}.ranges"
        header = f"# {f.size} {f.mtime_ns} {f.etag}"
        done: dict[int, str] = {}
        try:
            lines = ranges_path.read_text("utf-8").splitlines()
        except (FileNotFoundError, UnicodeDecodeError):
            lines = []
        if lines and lines[0] == header and tmp.exists():
            for line in lines[1:]:
                parts = line.split()
                if len(parts) == 3 and dg.is_digest(parts[2]):
                    done[int(parts[0])] = parts[2]
        lf = _LargeFile(f, tmp, ranges_path, done)
        lf.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if not done:
            os.ftruncate(lf.fd, 0)
            atomic_write(ranges_path, (header + "\n").encode("utf-8"), mode=0o600)
        os.ftruncate(lf.fd, f.size)
        lf.ranges_fd = os.open(ranges_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        if self.source.is_local:
            path = self.source.local_path(f.rel)
            try:
                lf.src_fd, lf.identity = stable.open_listed(path, f)
            except BaseException:
                self._close_one(lf)
                raise
        self._large.append(lf)
        return lf

    def _fetch_range(self, lf: _LargeFile, offset: int, length: int, slots: _Slots,
                     buf: bytearray | None) -> tuple[memoryview, bytearray | None]:
        """Copy one range into the temp file (or reuse a finished one); return its bytes and buffer."""
        view: memoryview | None = None
        resumed = False
        want = lf.done.get(offset)
        if want is not None:
            buf = slots.buffer(buf)
            view = memoryview(buf)[:length]
            if os.preadv(lf.fd, [view], offset) == length and dg.digest_bytes(view) == want:
                resumed = True
            else:
                view = None
        if view is None:
            if self.source.is_local:
                buf = slots.buffer(buf)
                view = memoryview(buf)[:length]
                path = self.source.local_path(lf.file.rel)
                chunk = view
                n = call_with_retry(lambda: _read_source(lf.src_fd, chunk, path, offset), path, self.source.retry,
                                    self.stop)
                if n != length:
                    raise SourceChangedError(f"{path} shrank while it was copied; stage again once it is stable")
            else:
                view = memoryview(self.source.read_range(lf.file.rel, offset, offset + length, lf.file.etag))
            _pwrite_all(lf.fd, view, offset)
            os.write(lf.ranges_fd, f"{offset} {length} {dg.digest_bytes(view)}\n".encode())
        self.progress.add_bytes(length)
        self._count(copied=0 if resumed else length, resumed=length if resumed else 0)
        return view, buf

    def _hash_in_order(self, lf: _LargeFile, offset: int, view: memoryview, buf: bytearray | None,
                       slots: _Slots) -> bool:
        """Queue a range for the file digest; hash every range now in order. True when all are."""
        with lf.lock:
            lf.pending[offset] = (view, buf)
            while lf.next_offset in lf.pending:
                v, b = lf.pending.pop(lf.next_offset)
                lf.hasher.update(v)
                lf.next_offset += len(v)
                v.release()
                slots.put(b)
            return lf.next_offset == lf.file.size

    def _finish_large(self, lf: _LargeFile) -> None:
        f = lf.file
        mtime_ns = f.mtime_ns
        if lf.src_fd >= 0:
            opened, now = lf.identity, stable.identity(lf.src_fd)
            if opened is None or now != opened or (now.size, now.mtime_ns) != (f.size, f.mtime_ns):
                self._close_one(lf)
                for p in (lf.tmp, lf.ranges_path):  # ranges of a file that changed must not be resumed
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                raise SourceChangedError(
                    f"{self.source.local_path(f.rel)} changed while it was copied (or since it was listed); "
                    "stage again once it is stable")
        if mtime_ns:
            os.utime(lf.fd, ns=(mtime_ns, mtime_ns))
        if self.settings.fsync:
            os.fsync(lf.fd)
        lf.finished = True
        self._close_one(lf)
        entry = Entry(f.rel, f.size, mtime_ns, f.etag, dg.format_digest(lf.hasher))
        self._publish(f.rel, lf.tmp, safe_join(self.incoming.data, f.rel), entry)
        self.incoming.record_many([entry])
        self.progress.add_files(1, 0)
        with contextlib.suppress(FileNotFoundError):
            lf.ranges_path.unlink()

    def _close_one(self, lf: _LargeFile) -> None:
        for name in ("fd", "src_fd", "ranges_fd"):
            fd = getattr(lf, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(lf, name, -1)

    def _close_large(self, remove: bool) -> None:
        for lf in self._large:
            self._close_one(lf)
            if remove and not lf.finished:
                for p in (lf.tmp, lf.ranges_path):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()


def _read_source(fd: int, view: memoryview, path: str, offset: int | None = None) -> int:
    """Read from a local source: a transient error as it is (to be retried), any other as a SourceError."""
    try:
        return os.readv(fd, [view]) if offset is None else os.preadv(fd, [view], offset)
    except OSError as e:
        if is_transient_os_error(e):
            raise
        raise as_source_error(e, path) from e


def _write_out(fd: int, view: memoryview) -> None:
    """Write to the staged copy: its errors are the staging root's (no space, read-only), never retried."""
    try:
        _write_all(fd, view)
    except OSError as e:
        err = as_root_error(e)
        raise (err if isinstance(err, StagingError) else RootError(f"writing the staged copy failed: {e}")) from e


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def as_root_error(exc: BaseException) -> BaseException:
    """An error met while writing the staging root, as the user should read it: no space, read-only, or as is."""
    if isinstance(exc, StagingError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {exc.filename}" if exc.filename else ""
        return NoSpaceError(f"the staging root ran out of space{where}; partial files were removed, finished "
                            "ones are kept: free space (stagingloader gc) or pick a bigger --root, then stage again")
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return RootError(f"the staging root is read-only ({exc.filename}); remount it or pick another --root")
    return exc


__all__ = ["Copier", "CopySettings", "Progress", "as_root_error"]
