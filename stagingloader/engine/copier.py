"""The copy engine: files copied and hashed in parallel, each under a temp name, renamed when whole, journaled.

Small files travel in *batches* (``CopySettings.small_batch_files`` files or ``batch_bytes`` bytes), large ones
(above ``large_threshold``) in ranges of ``range_size`` bytes (see :mod:`.largefiles`).  Where they are
copied depends on the source:

* a **local** source (a path, a mounted share) is copied by worker *processes* (:mod:`.workerpool`), as
  many as the node has usable cores, each with its own interpreter lock, fed a few jobs ahead.  A job is
  copied in the stager's own process until they are up, and a job too small to pay for starting them
  (fewer than ``process_min_files`` small files and no large one) never starts them.  On a disk with fsync,
  a gate (:mod:`.gate`) measures whether twice as many processes, overlapping their fsync waits, copy faster;
* a **remote** source (S3, http...) is read by threads calling ``Source.read_range``, which wait on the
  network rather than hold the interpreter's lock.

Whatever copies, the stager's process alone journals (``Incoming.record_many``), counts progress and calls
``on_done``.  :meth:`Copier.run` pulls files from its iterable only when a worker can take more (a few batches
ahead), so a caller may reorder what comes next while it runs: a :class:`~.feed.Polled` source (a streaming
run's schedule) is asked in the dispatcher's thread and may say a file goes alone, at once, rather than in a
batch; another iterable that is not a list is pulled in a thread of its own (:mod:`.feed`), so it may wait.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import trust
from ..cache.columns import RowArray
from ..cache.layout import safe_join
from ..cache.manifest import Entry
from ..cache.tiers import mount_of
from ..errors import NoSpaceError
from ..sources.listing import Listing
from ..sources.source import Source, SourceFile
from .copyops import Buffer, EntryTuple, Item, RowBatch, RowsDone, Target, Worker, as_root_error, compiled
from .feed import Direct, Feed, Polled, Rows, Wakeup
from .gate import Gate
from .incoming import Incoming
from .largefiles import LargeFile
from .workerpool import DEPTH, WorkerPool

log = logging.getLogger(__name__)

STOP_SECONDS = 1.0  #: after a stop, how long the copies in flight may finish before they are left for the next run
STOP_GRACE_SECONDS = 0.5  #: then how long a stopped worker process has to exit before it is killed


@dataclass(frozen=True, kw_only=True)
class CopySettings:
    workers: int = 8  #: copy threads for a remote source
    range_size: int = 8 << 20  #: large files are split into ranges of this size (a multiple of the page size)
    large_threshold: int = 32 << 20  #: files above this size are copied by ranges
    fsync: bool = False
    small_batch_files: int = 64  #: small files per job (a streaming run from a remote source: fewer)
    batch_bytes: int = 16 << 20  #: bytes of small files per job
    #: a job holding a file someone waits for (a streaming run's :meth:`Polled.alone`) is handed out at this many
    #: files or bytes: at once, and the files after it come in the same job rather than one job each
    now_batch_files: int = 1
    now_batch_bytes: int = 1 << 20
    range_bytes_in_flight: int = 256 << 20  #: a remote source's large-file ranges held at once (threads' memory)
    processes: int | None = None  #: worker processes for a local source; None: the usable cores; 0: none
    process_min_files: int = 256  #: small files a local run pulls (without a large one) before starting them


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


@dataclass
class _Job:
    """A batch of small files, or one range of a large file."""

    items: list[Item] = field(default_factory=list)
    nbytes: int = 0
    large: LargeFile | None = None
    offset: int = 0
    length: int = 0
    chain: bool = False  #: the range's worker also carries the file's running digest (see largefiles)
    rows: Any = None  #: small files as listing rows (numpy), and their columns for the worker
    row_batch: RowBatch | None = None
    now: bool = False  #: it holds a file someone waits for: handed out at CopySettings.now_batch_files

    @property
    def files(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.items)

    def payload(self) -> tuple[str, Any]:
        if self.row_batch is not None:
            return "rows", self.row_batch
        if self.large is None:
            return "batch", self.items
        lf = self.large
        return "range", (lf.file, lf.path, str(lf.tmp), self.offset, self.length, self.chain)


def _execute(worker: Worker, job: _Job) -> tuple[Any, BaseException | None]:
    """Run a job in this process; the result as a worker process sends it back."""
    try:
        if job.row_batch is not None:
            return worker.copy_rows(job.row_batch)
        if job.large is None:
            return worker.copy_batch(job.items)
        lf = job.large
        return worker.copy_range(lf.file, lf.path, str(lf.tmp), job.offset, job.length, job.chain), None
    except BaseException as e:  # handed to the dispatcher, which re-raises it
        return None, as_root_error(e)


class _Threads:
    """Jobs run by up to ``count`` threads (remote sources: the threads wait on the network).

    The threads take jobs off one queue and put their results on another, with nothing made per job: a
    streaming run sends one file a job, and ``ThreadPoolExecutor``'s future, lock and condition per job were a
    tenth of its dispatcher's time (py-spy) while 128 threads wanted the interpreter's lock.  A thread rings the
    dispatcher only when no ring is pending.  Threads are started as jobs come, one per job in flight, up to
    ``count``."""

    def __init__(self, count: int, worker: Worker, wakeup: Wakeup, max_ranges: int) -> None:
        self.worker = worker
        self.wakeup = wakeup
        self.count = count
        self.capacity = count + min(count, 4)  #: jobs in flight
        #: large-file ranges in flight, each held in memory whole: the many threads that hide an object store's
        #: latency for small objects (128 at 20 ms) would hold a GiB of 8 MiB ranges
        self.max_ranges = max(1, max_ranges)
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[tuple[_Job, Any]] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.in_flight = 0
        self.ranges = 0
        self._rung = False  #: a thread rang the dispatcher since it last took the results

    def submit(self, job: _Job) -> None:
        self.in_flight += 1
        self.ranges += job.large is not None
        self.jobs.put(job)
        if self.in_flight > len(self.threads) < self.count:  # as many threads as jobs in flight, up to count
            t = threading.Thread(target=self._loop, name=f"stagingloader-copy-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()

    def full(self, ranging: bool) -> bool:
        """No job more now (``ranging``: the next one is a range of the large file being handed out)."""
        return self.in_flight >= self.capacity or (ranging and self.ranges >= self.max_ranges)

    def _loop(self) -> None:
        jobs, results, worker, ring = self.jobs, self.results, self.worker, self.wakeup.ring
        while (job := jobs.get()) is not None:
            results.put((job, _execute(worker, job)))
            if not self._rung:  # else a ring since the dispatcher last looked is pending: it takes this one too
                self._rung = True
                ring()

    def poll(self) -> list[tuple[_Job, Any]]:
        out = []
        self._rung = False  # before taking the results: one put after this rings again
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self.results.get_nowait())
        self.in_flight -= len(out)
        self.ranges -= sum(job.large is not None for job, _ in out)
        return out

    def close(self, *, wait: bool = True) -> None:
        """Stop the threads: wait for their copies, or (after a stop) drop what has not started and return."""
        if not wait:
            with contextlib.suppress(queue.Empty):
                while True:
                    self.jobs.get_nowait()
        for _ in self.threads:
            self.jobs.put(None)
        if wait:
            for t in self.threads:
                t.join()


class _Processes:
    """Jobs run by worker processes, each sent up to ``DEPTH`` jobs ahead."""

    def __init__(self, target: Target, cores: int, fsync: bool) -> None:
        high = 2 * cores if fsync else cores  # fsync waits: more processes may overlap them (measured by the gate)
        self.pool = WorkerPool(target, high)
        self.gate = Gate(high, adaptive=True, low=cores)
        self.jobs: dict[int, _Job] = {}
        self._keys = 0
        self.pool.grow(self.gate.limit)

    @property
    def ready(self) -> bool:
        return bool(self.pool.ready())

    @property
    def in_flight(self) -> int:
        return len(self.jobs)

    def free(self) -> list[Any]:
        """The ready workers the gate lets run that can take another job, least busy first."""
        if self.gate.limit > self.pool.started:
            self.pool.grow(self.gate.limit)
        return sorted((p for p in self.pool.ready(self.gate.limit) if len(p.jobs) < DEPTH), key=lambda p: len(p.jobs))

    def running(self) -> list[Any]:
        """The workers the gate lets run (ready or starting)."""
        return self.pool.procs[:self.gate.limit]

    def submit(self, proc: Any, job: _Job) -> None:
        self._keys += 1
        self.jobs[self._keys] = job
        kind, payload = job.payload()
        self.pool.submit(proc, self._keys, kind, payload)

    def poll(self, timeout: float) -> list[tuple[_Job, Any]]:
        out = [(self.jobs.pop(key), result) for key, result in self.pool.poll(timeout)]
        for job, _ in out:
            if job.large is None:
                self.gate.note(job.files)
        return out

    def close(self, *, grace: float = 5.0) -> None:
        self.pool.close(grace=grace)


def row_batch(listing: Listing, rows: RowArray, prefix: str) -> RowBatch:
    """The columns a worker copies ``rows`` of ``listing`` from (see :meth:`.copyops.Worker.copy_rows`), the
    source's files being ``prefix`` + their paths."""
    offsets = listing.path.offsets
    starts, ends = offsets[rows], offsets[rows + 1]
    blob = np.frombuffer(listing.path.blob, dtype=np.uint8)
    if int(rows[-1]) - int(rows[0]) == len(rows) - 1:  # consecutive rows: their paths are one slice
        paths, at = blob[starts[0]:ends[-1]], np.append(starts, ends[-1]) - starts[0]
    else:  # gathered with one index array
        lengths = ends - starts
        at = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=at[1:])
        paths = blob[np.repeat(starts - at[:-1], lengths) + np.arange(at[-1])]
    dev = listing.dev_table[listing.dev_index[rows]]
    ends_b, sizes_b, mtimes_b, devs_b, inos_b = (
        c.astype(np.int64, copy=False).tobytes() for c in (at, listing.size[rows], listing.mtime_ns[rows], dev,
                                                           listing.ino[rows]))
    return prefix, paths.tobytes(), ends_b, sizes_b, mtimes_b, devs_b, inos_b


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
        self._error: BaseException | None = None
        self._large: list[LargeFile] = []
        target = Target(incoming=str(incoming.path), source_url=source.url, fsync=settings.fsync,
                        retry=source.retry)
        self._target = target
        self._worker = Worker(target, self.stop, None if source.is_local else source)
        self._on_done: Callable[[list[Entry]], None] | None = None
        self._inline: list[tuple[_Job, Any]] = []  #: results of jobs run in this thread, not yet handled
        self._threads: _Threads | None = None
        self._procs: _Processes | None = None
        # what the iterable gave and no job holds yet
        self._wakeup = Wakeup()
        self._feed: Feed | None = None
        self._exhausted = False
        self._batch = _Job()
        self._queued: collections.deque[_Job] = collections.deque()  #: jobs made and not handed out yet
        # large files with ranges not handed out yet: their ranges, and the worker they belong to (see _next_job)
        self._handing: dict[LargeFile, Iterator[tuple[int, int]]] = {}
        self._owner: dict[LargeFile, Any] = {}
        self._pulled_small = 0
        self._want_processes = False
        self._rows: Rows | None = None  #: a plan's rows, taken as columns (see run)
        self._row_at = 0
        self._prefix: str | None = None  #: the local source's path prefix, for a Rows plan
        self._network: bool | None = None  #: a local source on a network file system (see _help_reads)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of this run's copy worker processes (none while it copies in its own process)."""
        return [p.proc.pid for p in self._procs.pool.procs] if self._procs is not None else []

    # ---- driver ----------------------------------------------------------------------------
    def run(self, files: Iterable[SourceFile] | Polled | Rows,
            on_done: Callable[[list[Entry]], None] | None = None) -> None:
        """Copy ``files``; on the first failure stop, clean up, and raise it.

        ``files`` is pulled lazily, a few batches ahead of what the workers finished; ``on_done`` is called in
        this thread with the entries of the files renamed into ``data/`` and journaled, as they are.  A
        :class:`~.feed.Rows` plan from a local folder goes to the workers as the listing's columns, a batch of
        small files copied, renamed and journaled by one call of the compiled helper (no object per file
        anywhere: the stager's per-file work was as much CPU as the workers' own for 4 KiB files); where that
        does not apply (no compiled helper, a source manifest's digests to check, ``on_done``), the rows
        are made into files one by one (``Incoming.track``).
        """
        self._on_done = on_done
        if isinstance(files, Rows):  # as columns where the compiled copy can take them, else file by file
            if self._by_rows():
                self._rows, self._prefix = files, self.source.local_prefix()
                self.incoming.track_rows(files.listing)
                files = []
            else:
                files = Direct(self.incoming.track(files.listing, files.rows))
        self._feed = Feed(files, self._wakeup)
        if not self.source.is_local:
            s = self.settings
            self._threads = _Threads(s.workers, self._worker, self._wakeup, s.range_bytes_in_flight // s.range_size)
        try:
            while not self.stop.is_set():
                busy = self._fill()
                if self._idle():
                    break
                self._handle(self._poll(0.0 if busy else 0.05))
        except BaseException as e:  # KeyboardInterrupt in the dispatcher, a worker's death
            self._fail(e)
        finally:
            self._shut_down()
        if self._error is not None:
            raise self._error

    def _by_rows(self) -> bool:
        """Whether a :class:`~.feed.Rows` plan can go to the workers as columns (see :meth:`run`)."""
        return (self.source.is_local and self.source.local_prefix() is not None and compiled()
                and not self._worker.pure and not self.expected
                and self._on_done is None and self.incoming.on_record is None)

    def _processes_allowed(self) -> int:
        n = self.settings.processes
        if n is None:
            n = usable_cores()
            return n if n > 1 else 0  # one core: a worker would only take turns with this process
        return max(0, n)

    def _fill(self) -> bool:
        """Hand out jobs while a worker can take one; True if any was."""
        busy = False
        threads = self._threads
        if threads is not None:  # while a large file is handed out, its ranges come next (a new one's first range
            # may take one over the bound)
            while not threads.full(bool(self._handing)) and (job := self._next_job()) is not None:
                threads.submit(job)
                busy = True
            return busy
        procs = self._procs
        while procs is not None:  # each job to the least busy worker that has one (a large file's ranges go to
            # the worker copying it, so the least busy may have none while another does)
            for proc in procs.free():
                job = self._next_job(proc)
                if job is not None:
                    procs.submit(proc, job)
                    busy = True
                    break
            else:
                break
        if (procs is None or not procs.ready) and not self._inline:  # copy here while no worker process is up
            job = self._next_job()
            if job is not None:
                self._inline.append((job, _execute(self._worker, job)))
                busy = True
        if procs is None and self._want_processes and (n := self._processes_allowed()):
            try:
                self._procs = _Processes(self._target, n, self.settings.fsync)
            except OSError as e:  # no interpreter to start (an embedded Python): copy here
                log.warning("cannot start copy worker processes (%s); copying in this process", e)
                self._want_processes = False
        return busy

    def _idle(self) -> bool:
        """Nothing left to hand out and nothing in flight."""
        left = self._batch.items or self._queued or self._handing or not self._exhausted
        flying = self._inline or (self._threads and self._threads.in_flight) or (self._procs and
                                                                                  self._procs.in_flight)
        return not left and not flying

    def _poll(self, timeout: float) -> list[tuple[_Job, Any]]:
        """Results ready within ``timeout``; wakes up early for results, a file the feed brings, or a worker."""
        out, self._inline = self._inline, []
        if not out and timeout > 0:
            conns: list[Any] = [self._wakeup.reader]
            if self._procs is not None:
                conns += [p.conn for p in self._procs.pool.procs]
            wait(conns, timeout)
        self._wakeup.drain()
        if self._threads is not None:
            out += self._threads.poll()
        if self._procs is not None:
            if self.stop.is_set():
                self._procs.pool.set_stop()
            out += self._procs.poll(0.0)
        return out

    def _handle(self, results: list[tuple[_Job, Any]]) -> None:
        """Journal and count what the workers sent back.  The small files of every batch here are journaled as
        one: a streaming run's jobs are of one file, and journaling each alone was a third of its dispatcher's
        time (numpy's per-call cost, paid per file)."""
        done: list[EntryTuple] = []
        errors: list[BaseException] = []
        for job, result in results:
            if job.large is not None:
                self._complete_range(job, result)
                continue
            if job.rows is not None:
                self._complete_rows(job, result)
                continue
            got, err = result
            if got:
                done += got
            if err is not None:
                errors.append(err)
        if done or errors:
            self._complete_batch(done, errors[0] if errors else None)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = as_root_error(exc)
        self.stop.set()

    def _shut_down(self) -> None:
        """Collect what is in flight (its finished files are journaled), stop the workers, close large files.

        After a stop (Ctrl-C, SIGTERM, an error, a streaming stager's lost lease) the copies in flight get
        STOP_SECONDS to finish; what is still in flight then is abandoned (under temp names, swept by the next
        run) and the workers are stopped, killed if they do not exit at once.  So an interrupted stage ends within
        about two seconds whatever it was doing, even if the interrupt landed in this process's own bookkeeping of
        a job (a result taken off a worker's socket but not yet counted), which nothing would ever answer."""
        deadline: float | None = None
        try:
            if self._procs is not None and self.stop.is_set():
                self._procs.pool.set_stop()
            while self._inline or (self._threads and self._threads.in_flight) or (
                    self._procs and self._procs.in_flight):
                if self.stop.is_set():
                    deadline = time.monotonic() + STOP_SECONDS if deadline is None else deadline
                    if time.monotonic() > deadline:
                        log.info("stopping: copies still in flight after %.0f s are left for the next run to redo",
                                 STOP_SECONDS)
                        break
                self._handle(self._poll(0.1))
        except BaseException as e:  # a worker died while we waited for it, or a second Ctrl-C
            self._fail(e)
        finally:
            if self._feed is not None and not self._feed.close():
                log.warning("the files to copy are still being produced after the copy stopped; leaving them")
            stopping = self.stop.is_set()
            if self._threads is not None:
                self._threads.close(wait=not stopping)
            if self._procs is not None:
                self._procs.close(grace=STOP_GRACE_SECONDS if stopping else 5.0)
            self._wakeup.close()
            remove = isinstance(self._error, NoSpaceError)
            self._remove_worker_folders(remove)
            for lf in self._large:
                lf.close()
                if remove and not lf.finished:
                    lf.discard()

    def _remove_worker_folders(self, with_files: bool) -> None:
        """Remove the copy workers' temp folders under ``.partial`` (they are stopped): the empty ones, or with
        what is in them when no space was left (a resume sweeps what a killed run left)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.incoming.partial):
                path = os.path.join(self.incoming.partial, name)
                if not name.startswith("w") or os.path.islink(path) or not os.path.isdir(path):
                    continue
                if with_files:
                    trust.remove_tree(Path(path))
                else:
                    with contextlib.suppress(OSError):  # not empty: a file of a failed copy, for the sweep
                        os.rmdir(path)

    # ---- jobs --------------------------------------------------------------------------------
    def _next_job(self, proc: Any = None) -> _Job | None:
        """The next job for worker process ``proc`` (None: this process, or a thread).

        A large file's ranges go to the worker that opened it, and a worker with none left takes the next file:
        two processes writing one file contend for its inode lock, which doubled the system time of a tmpfs copy
        here (1.13 CPU-s per GiB against 0.55 for two files).  Only when no new file is there to take does an
        idle worker take ranges of another's file, and then only from a network file system (:meth:`_help_reads`)
        or when that file's worker no longer runs (:meth:`_runs`).
        """
        for lf in list(self._handing):
            owner = self._owner[lf]
            if proc is None or owner is proc or owner is None:  # this process takes any; a worker, its own or none's
                self._owner[lf] = proc
                job = self._next_range(lf, proc)
                if job is not None:
                    return job
        job = self._next_from_feed(proc)
        if job is not None or proc is None:
            return job
        # nothing new to take: help with the file that has the most ranges left, where that helps
        while helped := [lf for lf in self._handing if self._help_reads() or not self._runs(self._owner[lf])]:
            job = self._next_range(max(helped, key=lambda x: x.file.size - x.handed_out), proc)
            if job is not None:
                return job
        return None

    def _help_reads(self) -> bool:
        """Whether a worker with nothing to do helps copy another's large file: where the source is a network
        file system, whose reads of two ranges overlap their round trips.  From a local disk or memory it waits:
        writes into one file serialize on its inode lock, so the help saved no time and cost CPU (the waiter
        spins on the lock, and the file is hashed again by the stager): one 1 GiB file into tmpfs took 0.95-1.06 s
        and 1.56-1.68 CPU-s with help, 1.03-1.11 s and 1.44-1.49 CPU-s without."""
        if self._network is None:
            self._network = self.source.is_local and mount_of(self.source.local_path("")).is_network
        return self._network

    def _runs(self, owner: Any) -> bool:
        """Whether ``owner`` (a worker process; None: this process) will ask for jobs again: one the gate has
        since stopped letting run will not, and its file's ranges go to the others."""
        return owner is None or self._procs is None or owner in self._procs.running()

    def _next_from_feed(self, proc: Any) -> _Job | None:
        """A batch of the next small files, or the first range of the next large file (then ``proc``'s)."""
        if self._queued:
            return self._queued.popleft()
        if self._rows is not None:
            return self._next_from_rows(proc)
        s = self.settings
        batch = self._batch
        feed = self._feed
        assert feed is not None
        take, local_path, expected = feed.take, self.source.local_path, self.expected.get  # bound once: per file
        polled = feed.polled
        while not self._exhausted and not self.stop.is_set():
            f = take()
            if f is None:
                if feed.error is not None:
                    raise feed.error
                if feed.ended:
                    self._exhausted = True
                elif not feed.asked:  # pulled in a thread: ask for the rest of a batch, or a file for each idle
                    # thread (one at a time, each file cost a round trip to the feed's thread, which waits for the
                    # interpreter's lock behind the copy threads), and hand out what is here
                    idle = self._threads.capacity - self._threads.in_flight if self._threads is not None else 0
                    feed.ask(max(1, s.small_batch_files - len(batch.items), idle))
                break
            if f.size > s.large_threshold:
                lf = self._open_large(f, proc)
                if batch.items:  # hand out the small files gathered so far first
                    self._batch = _Job()
                    return batch
                job = self._next_range(lf, proc)
                if job is not None:
                    return job
                continue
            begun = None
            if polled and feed.alone():  # needed now: in a small job, handed out soon
                if batch.items and not batch.now:  # after the batch begun so far
                    begun, batch = batch, _Job()
                    self._batch = batch
                batch.now = True
            batch.items.append((f, local_path(f.rel), expected(f.rel, "")))
            batch.nbytes += f.size
            self._pulled_small += 1
            if self._pulled_small >= s.process_min_files:
                self._want_processes = True
            files, nbytes = (s.now_batch_files, s.now_batch_bytes) if batch.now else (s.small_batch_files,
                                                                                       s.batch_bytes)
            if len(batch.items) >= files or batch.nbytes >= nbytes:
                self._batch = _Job()
                if begun is None:
                    return batch
                self._queued.append(batch)
            if begun is not None:
                return begun
        if batch.items:
            self._batch = _Job()
            return batch
        return None

    def _open_large(self, f: SourceFile, proc: Any) -> LargeFile:
        """Start copying the large file ``f``: its ranges go to ``proc`` (see :meth:`_next_job`)."""
        self._want_processes = True
        lf = LargeFile(f, self.source.local_path(f.rel), self.incoming, self.settings.range_size,
                       local=self.source.is_local)
        self._large.append(lf)
        self._handing[lf] = lf.ranges()
        self._owner[lf] = proc
        return lf

    def _next_from_rows(self, proc: Any) -> _Job | None:
        """:meth:`_next_from_feed` for a :class:`~.feed.Rows` plan: the next batch of small files as columns (up
        to ``small_batch_files`` or ``batch_bytes``), or the first range of the next large file."""
        s, plan = self.settings, self._rows
        assert plan is not None and self._prefix is not None
        listing, rows = plan.listing, plan.rows
        while self._row_at < len(rows) and not self.stop.is_set():
            chunk = rows[self._row_at:self._row_at + s.small_batch_files]
            sizes = listing.size[chunk]
            large = np.flatnonzero(sizes > s.large_threshold)
            if large.size and large[0] == 0:  # a large file: by ranges, as from any feed
                row = int(chunk[0])
                self._row_at += 1
                f = listing.row(row)
                self.incoming.expect(listing, f.rel, row)
                job = self._next_range(self._open_large(f, proc), proc)
                if job is not None:
                    return job
                continue
            ends = np.cumsum(sizes[:large[0] if large.size else len(chunk)])
            n = min(len(ends), int(np.searchsorted(ends, s.batch_bytes)) + 1)  # the file that reaches the bytes too
            chunk = chunk[:n]
            self._row_at += n
            self._pulled_small += n
            if self._pulled_small >= s.process_min_files:
                self._want_processes = True
            return _Job(rows=chunk, nbytes=int(ends[n - 1]), row_batch=row_batch(listing, chunk, self._prefix))
        self._exhausted = True
        return None

    def _next_range(self, lf: LargeFile, proc: Any) -> _Job | None:
        """The next range of ``lf`` for ``proc`` to copy (ranges intact from an interrupted run count as copied);
        None once every range is handed out."""
        ranges = self._handing[lf]
        for offset, length in ranges:
            if not lf.resumed(offset, length):
                chain = lf.hand_out(proc, offset, length, in_order=self._threads is None)
                return _Job(large=lf, offset=offset, length=length, chain=chain)
            lf.handed_out = offset + length
            self.bytes_resumed += length
            self.progress.add_bytes(length)
            if lf.hash_ready():
                self._finish_large(lf)
        del self._handing[lf], self._owner[lf]
        return None

    # ---- results (in this thread only) ---------------------------------------------------------
    def _complete_batch(self, done: list[EntryTuple], err: BaseException | None) -> None:
        if done:
            entries = [Entry(*t) for t in done] if self._on_done is not None or self.incoming.on_record else None
            nbytes = sum([t[1] for t in done])
            self.incoming.record_tuples(done, entries)
            self.progress.add_files(len(done), nbytes)
            self.bytes_copied += nbytes
            if self._on_done is not None:
                assert entries is not None
                self._on_done(entries)
        if err is not None:
            self._fail(err)

    def _complete_rows(self, job: _Job, result: tuple[RowsDone | None, BaseException | None]) -> None:
        got, err = result
        if got is not None:
            copied, sizes_b, mtimes_b, digests, lines = got
            ok = np.frombuffer(copied, dtype=bool)
            sizes, mtimes = np.frombuffer(sizes_b, dtype=np.int64)[ok], np.frombuffer(mtimes_b, dtype=np.int64)[ok]
            digest = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 16)[ok]
            self.incoming.record_rows(job.rows[ok], sizes, mtimes, digest, lines)
            nbytes = int(sizes.sum())
            self.progress.add_files(len(sizes), nbytes)
            self.bytes_copied += nbytes
        if err is not None:
            self._fail(err)

    def _complete_range(self, job: _Job,
                        result: tuple[tuple[str, str, list[Buffer]] | None, BaseException | None]) -> None:
        digests, err = result
        lf = job.large
        assert lf is not None
        if err is not None:
            self._fail(err)
            return
        if digests is None:
            return  # not copied: the run was stopped
        if self._error is not None or lf.fd < 0:
            return  # the run failed meanwhile: the range stays journaled for a resume, nothing more
        lf.range_copied(job.offset, job.length, *digests)
        self.progress.add_bytes(job.length)
        self.bytes_copied += job.length
        if lf.hash_ready():
            self._finish_large(lf)

    def _finish_large(self, lf: LargeFile) -> None:
        f = lf.file
        lf.check_source()
        digest = lf.seal(self.settings.fsync)
        entry = Entry(f.rel, f.size, f.mtime_ns, f.etag, digest)
        self._worker.publish(lf.path, str(lf.tmp), str(safe_join(self.incoming.data, f.rel)), digest,
                             self.expected.get(f.rel, ""))
        self.incoming.record_many([entry])
        self.progress.add_files(1, 0)
        with contextlib.suppress(FileNotFoundError):
            lf.ranges_path.unlink()
        if self._on_done is not None:
            self._on_done([entry])


__all__ = ["Copier", "CopySettings", "Progress", "as_root_error", "row_batch", "usable_cores"]
