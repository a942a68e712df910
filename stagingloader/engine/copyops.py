"""Copying one small file or one range of a large file: what a copy worker (a process or a thread) runs.

Nothing here holds state between calls but a reusable buffer and the running digests of large files copied in
order, so the same functions run in the stager's process, in its threads (remote sources) and in worker
processes (:mod:`.workerpool`).

A local file is read through a reused buffer, hashed from it and written (``readv``/``write``): each byte
passes once through the buffer and once through the hash, as ``cp`` plus the hash.  A large file's ranges go
the same way (``preadv``/``pwrite``) into tmpfs; onto other file systems the kernel copies them (``sendfile``)
and they are hashed from a read-only mapping of the pages written.  Measured in alternating A/B runs
(``benchmarks/ab_commits.py``, 2026-12-03): the buffer against ``sendfile`` with the mapping, into tmpfs,
20,000 x 100 KiB 1.75 against 2.08 CPU-s, 4 x 1 GiB 3.69 against 4.55 (the mapping's page faults); onto ext4,
100 KiB files level, 1 GiB files 6.4 against 3.7 CPU-s (the buffer's writes cost ext4 twice the system time).
The source is never mapped: a source truncated under a mapping would kill the process with SIGBUS.

A small local file that fits one read of the buffer is copied by the compiled helper (``fastcopy.c``, built by
``setup.py`` where a C compiler is at hand): the same system calls and checks as :meth:`Worker._quick_write`, with
no Python call between them.  Without it (no compiler, or ``STAGINGLOADER_PURE_PYTHON=1``) the Python path runs.

Every file is written under a temp name in ``incoming/.partial``, checked against the source manifest's
digest when there is one, and renamed into ``incoming/data``: a file there is whole and verified.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from .. import digest as dg
from ..cache.tiers import mount_of
from ..errors import NoSpaceError, RootError, SourceChangedError, StagingError, VerificationError
from ..retry import RetryPolicy, as_source_error, call_with_retry, is_transient_os_error
from ..sources import stable
from ..sources.files import DataFolders, SourceFile

try:  # the compiled quick path (setup.py builds it where a C compiler is at hand; the Python one runs otherwise)
    from . import fastcopy  # type: ignore[attr-defined]
except ImportError:
    fastcopy = None

log = logging.getLogger(__name__)

def _libc(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """libc's function ``name`` taking ``argtypes`` and returning an int (Linux), or None where there is none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_SYNCFS = _libc("syncfs", ctypes.c_int)
_SYNC_FILE_RANGE = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 2  #: start writeback of the range's dirty pages, do not wait
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.ESPIPE}
QUICK_MAX = 64 << 10  #: smaller local files are read in one call, the quick way (see Worker._quick_write)
BUFFER_SIZE = 1 << 20  #: the reused read buffer of small files
#: the most one read asks of a FUSE share: the kernel waits out a FUSE request it has sent, even for a killed
#: process, so a stage stopped mid-read of a slow share ends only when that read does (64 KiB, what ``sendfile``
#: asked of it through its pipe; 4 s at 256 KiB/s for a read of the whole buffer)
FUSE_READ = 64 << 10


class StopFlag(Protocol):
    """A ``threading.Event`` or a ``multiprocessing`` one: only ``is_set`` is used."""

    def is_set(self) -> bool: ...


#: (rel, size, mtime_ns, etag, digest): an Entry's fields, cheap to send between processes
EntryTuple = tuple[str, int, int, str, str]
#: a small file to copy: the listed file, where it is (a local path; for messages otherwise), its expected digest
Item = tuple[SourceFile, str, str]
#: small local files as the listing's columns (see :meth:`Worker.copy_rows`): the source's path prefix (the
#: source folder and "/"), their paths' bytes, the int64 offsets of each path in them (one more than the files),
#: and their int64 sizes, mtimes, devices and inodes, each column as bytes (a worker process has no numpy)
RowBatch = tuple[str, bytes, bytes, bytes, bytes, bytes, bytes]
#: what :meth:`Worker.copy_rows` copied: a byte a file, 1 where copied, the sizes and mtimes copied (int64 bytes),
#: the digests (16 raw bytes each) and the journal lines of the copied files ('\n' between them)
RowsDone = tuple[bytes, bytes, bytes, bytes, str]

NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')


def _json_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if NEEDS_ESCAPE.search(text) else f'"{text}"'


def journal_line(path: str, size: int, mtime_ns: int, etag: str, digest: str) -> str:
    """One line of ``incoming/journal.jsonl``: the JSON list ``[path, size, mtime_ns, etag, digest]``;
    ``json.dumps`` only for the strings that need escaping (it cost the stager 5 us a file)."""
    return f"[{_json_str(path)}, {size}, {mtime_ns}, {_json_str(etag) if etag else chr(34) * 2}, \"{digest}\"]"


#: fastcopy.copy_rows's status of a file (see fastcopy.c)
_COPIED, _UNUSUAL, _WRITTEN, _COPIED_UNQUOTED = 0, 1, 3, 4
_DONE = bytes(int(code in (_COPIED, _COPIED_UNQUOTED)) for code in range(256))  #: status -> 1 if renamed in place


Buffer = bytes | memoryview


class Remote(Protocol):
    """A remote source's bytes (:class:`~.sources.Source` is one)."""

    def read_range(self, rel: str, start: int, end: int, etag: str = "") -> Buffer: ...


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where and how files are written; sent once to every worker process."""

    incoming: str  #: the incoming folder (``data/`` and ``.partial/`` are under it)
    source_url: str  #: for messages
    fsync: bool
    retry: RetryPolicy


class Worker:
    """The per-worker state: a reused buffer, the folders already created, the temp-name counter."""

    def __init__(self, target: Target, stop: StopFlag, remote: Remote | None = None) -> None:
        self.target = target
        self.stop = stop
        self.remote = remote  #: a remote source (threads only)
        self.folders = DataFolders(f"{target.incoming}/data", target.incoming)
        # this process's own temp folder: two processes creating and renaming files out of one folder contend for
        # its lock (10 % more CPU per 4 KiB file here); made at the first file
        self.partial = f"{target.incoming}/.partial/w{os.getpid()}/"
        self._partial_made = False
        self.data = f"{target.incoming}/data"
        self._local = threading.local()  #: each thread's reused buffer
        #: a local large file's ranges: through the buffer into tmpfs (1.23x less CPU for 4 x 1 GiB than sendfile
        #: and a hash of the written pages), by sendfile elsewhere (ext4: 0.6x the CPU of the buffer's writes)
        self._range_buffer: bool | None = None
        #: the Python path even where the compiled one is built: for comparisons, and a way out should it misbehave
        self.pure = bool(os.environ.get("STAGINGLOADER_PURE_PYTHON"))
        self._read_size = 0  #: the most one read of the source asks for (see FUSE_READ); set at the first read
        self._names = 0
        self._lock = threading.Lock()
        self._chains: dict[str, tuple[xxhash.xxh3_128, int]] = {}  #: temp file -> its running digest, bytes in it

    def buffer(self) -> memoryview:
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(BUFFER_SIZE)  # touched once, then reused (fresh pages are slow here)
        return memoryview(buf)

    def source_view(self, path: str) -> memoryview:
        """The buffer, as much of it as one read of the local source that holds ``path`` may fill."""
        if not self._read_size:
            self._read_size = FUSE_READ if mount_of(path).fs_type.startswith("fuse") else BUFFER_SIZE
        return self.buffer()[:self._read_size]

    # ---- small files -------------------------------------------------------------------------
    def copy_batch(self, items: list[Item]) -> tuple[list[EntryTuple], BaseException | None]:
        """Copy small files one after the other; return the entries of those renamed into ``data/`` and the error
        that stopped the batch (None if none did).

        With fsync on, a batch is made durable at once: its files are written under their temp names, one
        ``syncfs`` of the staging file system flushes them all, and only then are they renamed into ``data/``
        (a file under its final name has durable bytes, as with an ``fsync`` per file, which cost 2.2x the
        whole copy of 20,000 x 100 KiB files to ext4 here)."""
        batched = self.target.fsync and len(items) > 1 and _SYNCFS is not None
        written: list[tuple[str, str, str, str, str, EntryTuple]] = []  # where, tmp, final, digest, want, entry
        done: list[EntryTuple] = []
        err: BaseException | None = None
        quick = self.remote is None
        # the compiled copy's buffer: as much of it as one read asks of this source (None: the Python path)
        view = self.source_view(items[0][1]) if quick and fastcopy is not None and not self.pure and items else None
        for f, path, want in items:
            if self.stop.is_set():
                break
            try:
                final = f"{self.data}/{f.rel}"
                if view is not None and f.size <= len(view):
                    now = not batched and not want  # renamed by the C helper, when nothing is to be checked first
                    got = self._fast_write(f, path, view, final if now else None, sync=not batched)
                    if got is not None and now:
                        done.append(got[1])
                        continue
                else:
                    got = self._quick_write(f, path, sync=not batched) if quick and f.size < QUICK_MAX else None
                tmp, entry = got if got is not None else self._careful_write(f, path, sync=not batched)
                if batched:
                    written.append((path, tmp, final, entry[4], want, entry))
                else:
                    self.publish(path, tmp, final, entry[4], want)
                    done.append(entry)
            except BaseException as e:  # handed to the caller, which re-raises it
                err = as_root_error(e)
                break
        if written:
            try:
                self._sync_written([w[1] for w in written])
                for where, tmp, final, digest, want, entry in written:
                    self.publish(where, tmp, final, digest, want)
                    done.append(entry)
            except BaseException as e:  # what is not renamed stays a temp file: swept, copied again
                err = err or as_root_error(e)
        return done, err

    def copy_rows(self, batch: RowBatch) -> tuple[RowsDone | None, BaseException | None]:
        """Copy a batch of small local files given as the listing's columns (no expected digests to check): the
        compiled helper copies, renames and journals the usual ones in one call, with no Python object per file
        (with fsync, all are written, then made durable by one ``syncfs``, then renamed, as :meth:`copy_batch`);
        a file it finds unusual (changed, larger than the buffer, an error) is copied here the careful way, one
        whose folder is not made yet is renamed here, one whose path JSON escapes is journaled here.  Returns
        what was copied (None if nothing was: the run was stopped) and the error that stopped the batch."""
        prefix, blob, offsets_b, sizes_b, mtimes_b, devs_b, inos_b = batch
        if self.stop.is_set():
            return None, None
        offsets = memoryview(offsets_b).cast("q")
        n = len(offsets) - 1
        first = self.reserve_names(n)
        if fastcopy is not None and not self.pure:
            status, size_b, mtime_b, digest_b, journal = fastcopy.copy_rows(
                os.fsencode(prefix), os.fsencode(f"{self.data}/"), os.fsencode(self.partial), first, blob, offsets_b,
                sizes_b, devs_b, inos_b, self.source_view(prefix or "."), stable.opens_as_root(), self.target.fsync)
            lines = [journal.decode("ascii")] if journal else []
        else:  # every file the Python way
            status, size_b, mtime_b, digest_b, lines = bytes([_UNUSUAL]) * n, bytes(8 * n), bytes(8 * n), \
                bytes(16 * n), []
        ok = bytearray(status.translate(_DONE))  # 1 where the helper copied the file
        left = [i for i, s in enumerate(status) if s != _COPIED] if status.count(_COPIED) < n else []
        got_size, got_mtime, digests = bytearray(size_b), bytearray(mtime_b), bytearray(digest_b)
        sizes, mtimes, devs, inos = (memoryview(b).cast("q") for b in (sizes_b, mtimes_b, devs_b, inos_b))
        got_sizes, got_mtimes = memoryview(got_size).cast("q"), memoryview(got_mtime).cast("q")
        err: BaseException | None = None
        for i in left:  # the few the helper left (all, without it)
            rel = bytes(blob[offsets[i]:offsets[i + 1]]).decode("utf-8", "surrogateescape")
            path, final = f"{prefix}{rel}", f"{self.data}/{rel}"
            try:
                if status[i] == _UNUSUAL:  # the careful way, which retries or says what is wrong
                    if self.stop.is_set():
                        break
                    f = SourceFile(rel, sizes[i], mtimes[i], "", devs[i], inos[i])
                    sync = self.target.fsync
                    got = self._quick_write(f, path, sync=sync) if f.size < QUICK_MAX else None
                    tmp, entry = got if got is not None else self._careful_write(f, path, sync=sync)
                    self.publish(path, tmp, final, entry[4], "")
                    got_sizes[i], got_mtimes[i], digest = entry[1], entry[2], entry[4]
                    digests[16 * i:16 * i + 16] = bytes.fromhex(digest[len(dg.PREFIX):])
                else:
                    digest = dg.PREFIX + digests[16 * i:16 * i + 16].hex()
                    if status[i] == _WRITTEN:  # whole and verified: its folder is made here
                        self.publish(path, f"{self.partial}{first + i}.tmp", final, digest, "")
                lines.append(journal_line(rel, got_sizes[i], got_mtimes[i], "", digest))
                ok[i] = 1
            except BaseException as e:  # handed to the caller, which re-raises it
                err = as_root_error(e)
                break
        if not any(ok):
            return None, err
        return (bytes(ok), bytes(got_size), bytes(got_mtime), bytes(digests), "\n".join(lines)), err

    def copy_small(self, f: SourceFile, path: str, want: str) -> EntryTuple:
        """Copy one small file (``path``: where a local source has it) and rename it into ``data/``."""
        tmp, entry = self._careful_write(f, path, sync=self.target.fsync)
        self.publish(path, tmp, f"{self.data}/{f.rel}", entry[4], want)
        return entry

    def _sync_written(self, tmps: list[str]) -> None:
        """Make the temp files ``tmps`` durable: one ``syncfs`` of their file system, else an ``fsync`` each."""
        if _SYNCFS is not None:
            fd = os.open(self.partial, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _SYNCFS(fd) == 0:
                    return
            finally:
                os.close(fd)
        for tmp in tmps:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _fast_write(self, f: SourceFile, path: str, view: memoryview, final: str | None, *,
                    sync: bool) -> tuple[str, EntryTuple] | None:
        """:meth:`_quick_write` in C (``fastcopy.copy_small``), for files that fit one read of the buffer,
        renamed into ``final`` as well unless that is None: no Python call per system call (a copy worker's user
        CPU per 4 KiB file 5.1-5.4 us against 7.4-7.6 in Python; see docs/benchmarks.md).  None as for
        :meth:`_quick_write`."""
        tmp = f"{self.partial}{self.new_name()}.tmp"
        if final is not None:
            self.folders.ensure_parent(final)
        got = fastcopy.copy_small(path, f.dev, f.ino, tmp, final, view, stable.opens_as_root(), sync)
        if got is None:
            return None
        return tmp, (f.rel, got[0], got[1], "", got[2])

    def _quick_write(self, f: SourceFile, path: str, *, sync: bool) -> tuple[str, EntryTuple] | None:
        """The usual local small file written under a temp name, without the careful path's layers (retries,
        messages): one read, one write, the same checks.  None when anything is unusual (an error, a file that
        changed or is not what was listed): nothing is left behind, and the caller then copies the file the
        careful way, which retries or says what is wrong.  Half the Python time per 4 KiB file."""
        tmp = f"{self.partial}{self.new_name()}.tmp"
        try:
            src, before = stable.open_listed(path, f)
        except Exception:  # said by the careful way
            return None
        made = False
        try:
            size = before.size
            if size >= QUICK_MAX:
                return None
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            made = True
            try:
                view = self.buffer()[:size]
                if (os.readv(src, [view]) if size else 0) != size:
                    return None
                digest = dg.PREFIX + xxhash.xxh3_128_hexdigest(view)
                if size and os.write(fd, view) != size:
                    return None
                after = os.fstat(src)
                if (after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino, after.st_dev) != (
                        size, before.mtime_ns, before.ctime_ns, before.ino, before.dev):
                    return None
                if before.mtime_ns:
                    os.utime(fd, ns=(before.mtime_ns, before.mtime_ns))
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            made = False
            return tmp, (f.rel, size, before.mtime_ns, "", digest)
        except OSError:  # said by the careful way
            return None
        finally:
            os.close(src)
            if made:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _careful_write(self, f: SourceFile, path: str, *, sync: bool) -> tuple[str, EntryTuple]:
        """Write one small file under a temp name, with retries and every check; the temp name and the entry."""
        tmp = f"{self.partial}{self.new_name()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if self.remote is None:
                mtime_ns, size, digest = self._read_local(f, path, fd)
                etag = ""
            else:
                data = self.remote.read_range(f.rel, 0, f.size, f.etag) if f.size else b""
                digest = dg.digest_bytes(data)
                write_out(fd, memoryview(data))
                mtime_ns, size, etag = f.mtime_ns, f.size, f.etag
            if mtime_ns:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp, (f.rel, size, mtime_ns, etag, digest)

    def new_name(self) -> str:
        return str(self.reserve_names(1))

    def reserve_names(self, n: int) -> int:
        """The first of ``n`` temp names (numbers) for this worker's folder under ``.partial``, made at the first."""
        with self._lock:
            if not self._partial_made:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.partial, 0o700)
                if not stat.S_ISDIR(os.lstat(self.partial).st_mode):
                    raise RootError(f"{self.partial} is not a folder: the cache was tampered with; remove "
                                    f"{self.target.incoming} and stage again")
                self._partial_made = True
            first = self._names + 1
            self._names += n
            return first

    def _read_local(self, f: SourceFile, path: str, out_fd: int) -> tuple[int, int, str]:
        """Copy a local file into ``out_fd``; return the (mtime_ns, size, digest) copied.

        The bytes are one state of the file the listing named, or the file is refused (see :mod:`..sources.stable`).
        A transient error of a mounted share (EIO, ESTALE...) starts the copy again, with back-off.
        """
        try:  # the first try runs bare: the retry machinery costs a few us a file, and only a failure needs it
            got = self._attempt(f, path, out_fd, again=False)
            if got is not None:
                return got
        except Exception:  # tried again below, where a permanent error is raised as it should be
            pass
        for _ in range(stable.READ_TRIES):
            got = call_with_retry(lambda: self._attempt(f, path, out_fd, again=True), path,
                                  self.target.retry, self.stop)  # type: ignore[arg-type]
            if got is not None:
                return got
            log.info("%s changed while it was copied: reading it again", path)
        raise stable.changing(path)

    def _attempt(self, f: SourceFile, path: str, out_fd: int, *, again: bool) -> tuple[int, int, str] | None:
        if again:  # start again from nothing
            os.lseek(out_fd, 0, os.SEEK_SET)
            os.ftruncate(out_fd, 0)
        src, before = stable.open_listed(path, f)
        try:
            size, digest = self._through_buffer(src, out_fd, before.size, path)
            after = stable.identity(src)
        finally:
            os.close(src)
        return (after.mtime_ns, size, digest) if after == before and size == after.size else None

    def _through_buffer(self, src: int, out_fd: int, expect: int, path: str) -> tuple[int, str]:
        """Copy ``expect`` bytes (the size when opened: no read at the end only to meet it; a file that grew or
        shrank meanwhile shows in its identity after the copy)."""
        view = self.source_view(path)
        hasher = dg.new_hasher()
        size = 0
        while size < expect and (n := read_source(src, view[:expect - size], path)):
            hasher.update(view[:n])
            write_out(out_fd, view[:n])
            size += n
        return size, dg.format_digest(hasher)

    def publish(self, where: str, tmp: str, final: str, digest: str, want: str) -> None:
        """Rename a finished temp file into ``data/``, if it matches the source manifest's digest (when known);
        ``where`` names the source file in the error."""
        if want and want != digest:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise VerificationError(
                f"{where}: digest {digest} does not match the source manifest's {want}; the bytes were corrupted "
                "on the way or the source changed since `stagingloader manifest` ran (run it again if the change "
                "is intended)")
        self.folders.ensure_parent(final)
        try:
            os.rename(tmp, final)
        except OSError:  # the root refused it (a squatted name, no space): nothing is left in .partial either
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # ---- ranges of large files -----------------------------------------------------------------
    def _start_writeback(self, fd: int, offset: int, length: int) -> None:
        """With fsync on, start writing a copied range to the disk now (``sync_file_range``, which does not wait):
        the file's ``fsync`` at the end, in the stager's thread while no job is handed out, then has little
        left to wait for.  Durability still comes from that ``fsync``; this only moves the waiting earlier."""
        if self.target.fsync and _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    def copy_range(self, f: SourceFile, path: str, tmp: str, offset: int, length: int,
                   chain: bool = False) -> tuple[str, str, list[Buffer]]:
        """Copy ``length`` bytes at ``offset`` of a large file into its temp file; return the range's digest (for
        the ``.ranges`` journal), with ``chain`` the whole file's digest when this was its last range, and a remote
        range's bytes (the client's buffer, no copy: the stager hashes the file in order from it; none for a local
        range, whose pages the stager maps when it must).

        ``chain`` says this worker copies the file's ranges in order (the stager decides, see
        :class:`~.largefiles.LargeFile`): it then also feeds each range into the file's running digest, kept here
        between calls, so the stager need not read the file again.  A local range is read through the reused
        buffer, hashed from it and written when the staging root is in memory (tmpfs), and copied by the kernel
        (``sendfile``) and hashed from a mapping of the pages written elsewhere (see the module doc); a transient
        read error retries the range from its start, with the running digest as it was before it."""
        fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            running = self._chained(tmp, offset, fd) if chain else None
            if self.remote is not None:
                data = memoryview(self.remote.read_range(f.rel, offset, offset + length, f.etag))
                if len(data) != length:
                    raise SourceChangedError(f"{path}: a range came back with {len(data)} "
                                             f"bytes, not {length}; stage again once the source is stable")
                pwrite_all(fd, data, offset)
                self._start_writeback(fd, offset, length)
                if running is not None:
                    running.update(data)
                return dg.digest_bytes(data), self._chain_end(tmp, running, offset + length, f.size), [data]

            if self._range_buffer is None:
                self._range_buffer = mount_of(self.target.incoming).is_memory
            if not self._range_buffer:
                try:
                    return self._sendfile_range(f, path, tmp, fd, offset, length, running)
                except OSError as e:
                    if e.errno not in _NO_SENDFILE:
                        raise
                    self._range_buffer = True  # this file system cannot: the buffer from now on
            hashers: list[Any] = []

            def attempt() -> int:  # from the range's start each time: the running digest takes each byte once
                src, _ = stable.open_listed(path, f)
                try:
                    view, done = self.source_view(path), 0
                    whole, chained = dg.new_hasher(), running.copy() if running is not None else None
                    while done < length and (n := read_source(src, view[:min(len(view), length - done)], path,
                                                              offset + done)):
                        chunk = view[:n]
                        whole.update(chunk)
                        if chained is not None:
                            chained.update(chunk)
                        pwrite_all(fd, chunk, offset + done)
                        done += n
                    hashers[:] = [whole, chained]
                    return done
                finally:
                    os.close(src)

            n = call_with_retry(attempt, path, self.target.retry, self.stop)  # type: ignore[arg-type]
            if n != length:
                raise SourceChangedError(f"{path} shrank while it was copied; stage again once it is stable")
            self._start_writeback(fd, offset, length)
            whole, chained = hashers
            return dg.format_digest(whole), self._chain_end(tmp, chained, offset + length, f.size), []
        finally:
            os.close(fd)

    def _sendfile_range(self, f: SourceFile, path: str, tmp: str, fd: int, offset: int, length: int,
                        running: xxhash.xxh3_128 | None) -> tuple[str, str, list[Buffer]]:
        """A local range copied by the kernel and hashed from a read-only mapping of the pages written."""
        def attempt() -> int:
            src, _ = stable.open_listed(path, f)
            try:
                os.lseek(fd, offset, os.SEEK_SET)
                return sendfile_range(src, fd, offset, length, path)
            finally:
                os.close(src)

        n = call_with_retry(attempt, path, self.target.retry, self.stop)  # type: ignore[arg-type]
        if n != length:
            raise SourceChangedError(f"{path} shrank while it was copied; stage again once it is stable")
        self._start_writeback(fd, offset, length)
        with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=offset) as m:  # mapped once for both digests
            if running is not None:
                running.update(m)
            digest = dg.digest_bytes(m)  # type: ignore[arg-type]
        return digest, self._chain_end(tmp, running, offset + length, f.size), []

    def _chained(self, tmp: str, offset: int, fd: int) -> xxhash.xxh3_128 | None:
        """The running digest of ``tmp``'s file (open as ``fd``) if this worker hashed every byte before ``offset``,
        else None.  A worker handed the chain in the middle of the file (its first ranges were copied by the
        stager while the workers started, and are all written: see ``LargeFile.hand_out``) hashes them back once,
        from their pages, rather than the stager hashing the whole file again."""
        with self._lock:
            if offset == 0:
                self._chains[tmp] = (dg.new_hasher(), 0)
            elif tmp not in self._chains:
                self._chains[tmp] = (hash_written(fd, 0, offset)[0], offset)
            hasher, upto = self._chains.get(tmp, (None, -1))
            return hasher if upto == offset else None

    def _chain_end(self, tmp: str, hasher: xxhash.xxh3_128 | None, end: int, size: int) -> str:
        """Keep ``hasher`` as ``tmp``'s running digest up to ``end``; the file's digest once that is its size."""
        if hasher is None:
            return ""
        with self._lock:
            if end == size:
                self._chains.pop(tmp, None)
                return dg.format_digest(hasher)
            self._chains[tmp] = (hasher, end)
        return ""


def compiled() -> bool:
    """Whether the compiled small-file copy (``fastcopy.c``) was built and loads here."""
    return fastcopy is not None


def sendfile_range(src: int, out_fd: int, offset: int, length: int, path: str) -> int:
    """``sendfile`` ``length`` bytes at ``offset`` of ``src`` to ``out_fd``'s position; the bytes copied (fewer
    when the source ended first).  Source errors as :func:`read_source` says, target errors as the root's."""
    done = 0
    while done < length:
        try:
            n = os.sendfile(out_fd, src, offset + done, length - done)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
                raise as_root_error(e) from e
            if is_transient_os_error(e) or e.errno in _NO_SENDFILE:
                raise
            raise as_source_error(e, path) from e
        if n == 0:
            break
        done += n
    return done


def hash_written(fd: int, offset: int, length: int) -> tuple[xxhash.xxh3_128, str]:
    """xxh3-128 of ``length`` bytes at ``offset`` (a multiple of the page size) of a file we wrote, read from a
    mapping of its pages (no copy); the hasher and its digest."""
    hasher = dg.new_hasher()
    if length:
        with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=offset) as m:
            hasher.update(m)
    return hasher, dg.format_digest(hasher)


def read_source(fd: int, view: memoryview, path: str, offset: int | None = None) -> int:
    """Read from a local source: a transient error as it is (to be retried), any other as a SourceError."""
    try:
        return os.readv(fd, [view]) if offset is None else os.preadv(fd, [view], offset)
    except OSError as e:
        if is_transient_os_error(e):
            raise
        raise as_source_error(e, path) from e


def write_out(fd: int, view: memoryview) -> None:
    """Write to the staged copy: its errors are the staging root's (no space, read-only), never retried."""
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        err = as_root_error(e)
        raise (err if isinstance(err, StagingError) else RootError(f"writing the staged copy failed: {e}")) from e


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    except OSError as e:
        err = as_root_error(e)
        raise (err if isinstance(err, StagingError) else RootError(f"writing the staged copy failed: {e}")) from e


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


__all__ = ["BUFFER_SIZE", "FUSE_READ", "QUICK_MAX", "Buffer", "EntryTuple", "Item", "Remote", "StopFlag", "Target",
           "Worker", "as_root_error", "compiled", "hash_written", "pwrite_all", "read_source", "sendfile_range",
           "write_out"]
