"""The streaming stager: one process per streaming run (``python -m stagingloader.streaming.process``).

It is started by ``stage(..., wait=False)``, ``stagingloader stage --no-wait`` and the Slurm prolog (``wait=no``)
with a JSON request on its stdin, and answers on its stdout with JSON lines: ``{"event": text}`` while it lists
and waits for the dataset's lock, then one ``{"ready": {...}}`` (or ``{"error": {...}}``) once the stream is
set up, after which it writes no more there (its stderr goes to ``stream/stager.log``) and copies on alone:

1. under the dataset's lock, plan as any stage does; an up-to-date dataset is answered as done;
2. write ``stream/files.bin`` (the rows) and ``state.json``, take the run's lease (on the version it will
   publish), answer;
3. copy in the order :class:`~.schedule.Schedule` picks (urgent rows, the readers' merged order, listing order),
   evicting under a cache limit, through the ordinary copier (whole, verified, journaled files only);
4. when every file is there and no cache limit got in the way: publish the version exactly as ``stage`` does.

It stops (resumable, state "stopped") on SIGTERM or when no lease holds its version any more: its own (its
holder process ended, ``stagingloader release``, the Slurm epilog) and those of the runs reading along.  Its own
lease file is looked at every poll (``POLL_SECONDS``), all leases every ``LEASE_SECONDS`` and at once when its own
is gone.  Stopping takes at most ``STOP_DEADLINE`` seconds whatever it was doing, mid-file included: the copier
gives the copies in flight ``STOP_SECONDS``, then abandons them (under temp names, swept by the next run) and kills
its worker processes; past the deadline a watchdog writes the state, kills the workers and ends the process (a
copy this process runs itself, blocked in a slow read, ends with it: as after ``kill -9``, a stage to resume).
If another live stager streams the same dataset it does not wait for the lock: it answers ``read_along`` with that
run's version and takes a lease beside it.  A named lease taken inside a Slurm job (``$SLURM_JOB_ID``: ``stagingloader
stage SRC --no-wait --lease NAME`` in a job step) is noted in the stream folder (``job-<id>.leases``), so the
job's epilog releases it with the job's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .. import procid
from ..cache import leases, trust
from ..cache.locking import DatasetLock
from ..cache.manifest import Entry
from ..engine.copier import STOP_GRACE_SECONDS, STOP_SECONDS, Copier, CopySettings
from ..engine.feed import Polled
from ..errors import InternalError, NoSpaceError, SourceChangedError, StagingError
from ..sources.listing import Listing
from ..sources.source import SourceFile
from ..staging.result import StagedDataset
from ..staging.sharding import node_listing
from ..staging.stager import (
    LockedPlan,
    StageOptions,
    StageRun,
    begin_version_rows,
    finish,
    keep_published,
    open_run,
    own_folder,
    plan_locked,
    publish_version,
    someone_elses,
    take_lease,
)
from ..units import human_bytes
from .protocol import (
    COMPLETE,
    COPYING,
    FAILED,
    STOPPED,
    RequestReader,
    StreamFiles,
    StreamState,
    note_job_lease,
    read_state,
    stream_dir,
)
from .schedule import Rows, Schedule

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
#: the feed reads the readers' files again before a pick at most this often: each read is a folder listing and an
#: open per file (25 us of CPU), paid per file at 2,000 objects a second
REQUESTS_SECONDS = 0.002
#: a file the readers need later than this is copied in a batch, one after the other in one copy worker; a file
#: needed sooner goes at once, in a small job (NOW_BATCH_FILES).  A local source's batches are a blocking stage's
#: (CopySettings): a job of one file cost a message to a worker process and back, so a streaming stage of 1.28 M
#: small files ran at 7,500 files a second.  An object store's are of a file per THREADS_PER_BATCH_FILE threads, at
#: most REMOTE_BATCH_FILES: each job a thread takes costs hand-overs through the interpreter's lock that every
#: thread waits for (16-file jobs at 128 threads: half the thread switches, 20 % less CPU, for 20,000 objects at
#: 20 ms)
BATCH_LEAD_SECONDS = 2.0
#: files a reader needs now go NOW_BATCH_FILES to a job from a local source: each is renamed into place as it is
#: copied, the first as soon as it would be alone, and a first batch's 256 files no longer cost 256 messages to a
#: worker and back (docs/benchmarks.md, "first batch"); from a remote one, one a job, whose threads fetch them side
#: by side
NOW_BATCH_FILES = 8
REMOTE_BATCH_FILES = 16
THREADS_PER_BATCH_FILE = 8
STATE_SECONDS = 0.2
LEASE_SECONDS = 1.0
STOP_DEADLINE = STOP_SECONDS + STOP_GRACE_SECONDS  #: after a stop, the process ends within this (plus a poll)
PUBLISH_SECONDS = 10.0  #: a publish under way when the deadline comes gets this long before the process ends


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    """What the starter asks of a streaming stager."""

    src: str
    opts: StageOptions
    holder_pid: int | None = None
    #: with peers, where the nodes meet and the job's key, as the Slurm prolog says (else the environment's)
    peers: dict[str, Any] | None = None

    def to_json(self) -> str:
        o = {f.name: getattr(self.opts, f.name) for f in fields(StageOptions)}
        return json.dumps({"src": self.src, "opts": o, "holder_pid": self.holder_pid, "peers": self.peers})

    @classmethod
    def from_json(cls, text: str) -> StreamRequest:
        d = json.loads(text)
        o = dict(d["opts"])
        for name in ("include", "exclude"):
            o[name] = tuple(o.get(name) or ())
        if o.get("shard") is not None:
            o["shard"] = tuple(o["shard"])
        return cls(src=d["src"], opts=StageOptions(**o), holder_pid=d.get("holder_pid"), peers=d.get("peers"))


def stream_stage(req: StreamRequest, *, tell: Callable[[dict[str, Any]], None], stop: threading.Event,
                 env: dict[str, str] | None = None) -> None:
    """Run a streaming stage as ``req`` says; ``tell`` answers the starter (events, then ready)."""
    opts = req.opts
    def say(text: str) -> None:
        tell({"event": text})

    run, identity = open_run(req.src, opts, env=env, on_event=say, verb="streaming", from_manifest=True)
    try:
        _stream_locked(run, identity, req, tell=tell, stop=stop, env=env)
    finally:
        if run.check is not None:
            run.check.close()


def _stream_locked(run: StageRun, identity: str, req: StreamRequest, *, tell: Callable[[dict[str, Any]], None],
                   stop: threading.Event, env: dict[str, str] | None) -> None:
    if someone_elses(run):  # root's site-shared copy: read along its stager, or use it as published
        tell({"ready": _read_along(run, foreign=True, holder_pid=None) or _published_foreign(run)})
        return
    own_folder(run, env)
    lock = DatasetLock(run.ddir.lock_file, timeout=req.opts.lock_timeout, on_wait=run.say)
    along = _lock_or_read_along(run, lock, req)
    if along is not None:
        tell({"ready": along})
        return
    try:
        own_folder(run)
        lp = plan_locked(run, identity)
        if lp.plan.up_to_date and not _rows_hold(run):  # a version is published: answer only from the source
            opts = req.opts
            listed = node_listing(run.source, opts.include, opts.exclude, opts.shard)
            run = dataclasses.replace(run, listing=listed, check=None)
            lp = plan_locked(run, identity)
        if lp.plan.up_to_date:
            version, manifest = keep_published(run, lp)
            ds = finish(run, lp, version, manifest, holder_pid=req.holder_pid)
            tell({"ready": {"done": True, "dataset_dir": str(run.ddir.path), "version": version,
                            "lease": ds.lease}})
            return
        StreamRun(run, lp, req, tell=tell, stop=stop).run()
    finally:
        lock.release()


def _rows_hold(run: StageRun) -> bool:
    """Are the run's rows the source's own?  Listed rows are; rows from the source manifest are once the listing
    made meanwhile says so (False, said, when the source changed since the manifest)."""
    if run.check is None:
        return True
    try:
        run.check.verdict()
    except SourceChangedError:
        run.say(f"warning: {run.source.url} changed since its manifest was written ({run.check.changes}); "
                "listing the source instead")
        return False
    return True


def _lock_or_read_along(run: StageRun, lock: DatasetLock, req: StreamRequest) -> dict[str, Any] | None:
    """Take the dataset's lock; or, while another stager holds it and streams this listing, read along with it
    (its answer).  Waits at most the lock timeout, as ``stage`` does."""
    deadline = None if req.opts.lock_timeout is None else time.monotonic() + req.opts.lock_timeout
    said = False
    while not lock.try_acquire():
        along = _read_along(run, foreign=False, holder_pid=req.holder_pid)
        if along is not None:
            return along
        if not said:
            run.say(f"waiting for the lock on {run.ddir.path}: another stager works on it")
            said = True
        if deadline is not None and time.monotonic() >= deadline:
            lock.timeout = 0
            lock.acquire()  # one last try: it raises the LockTimeoutError that names the holder
            break
        time.sleep(POLL_SECONDS)
    return None


def stream_rows(run: StageRun) -> Listing:
    """The rows a streaming run and its readers agree on: the listing in its own order (sorted by path bytes,
    which is the order of the names for every name that is valid UTF-8)."""
    return Listing.of(run.listing)


def _read_along(run: StageRun, *, foreign: bool, holder_pid: int | None) -> dict[str, Any] | None:
    """Another stager streams this very listing now: the answer that reads along with it (None if not)."""
    sdir = stream_dir(run.ddir)
    state = read_state(sdir)
    if state is None or state.state != COPYING or not state.alive:
        return None
    if foreign and state.cache_limit is not None:  # it could evict what we read, and we cannot tell it our order
        return None
    try:
        files = StreamFiles.load(sdir)
    except StagingError:
        return None
    if not files.path.same_as(stream_rows(run).path):
        return None
    lease = None if foreign else take_lease(run, state.version, holder_pid)
    _note_job(sdir, run.opts.lease if lease is not None else None)
    run.say(f"reading along the streaming stage of {run.source.url} by process {state.pid}")
    return {"read_along": True, "dataset_dir": str(run.ddir.path), "version": state.version, "lease": lease,
            "stream_dir": str(sdir), "cache_limit": state.cache_limit}


def _note_job(sdir: Path, named: str | None) -> None:
    """Inside a Slurm job, note the named lease (``--lease NAME``) this run took on the stream: the job's epilog
    releases it with the job's own lease, so that it does not keep the stager copying after the job."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if named is None or not job.isdigit() or named == f"slurm-job-{job}":
        return
    with contextlib.suppress(OSError):
        note_job_lease(sdir, job, named)


def _published_foreign(run: StageRun) -> dict[str, Any]:
    from ..staging.stager import run_stage

    ds = run_stage(run.source.url, run.opts)  # the read-only path: checks it is current and intact, or says why
    if not isinstance(ds, StagedDataset):
        raise InternalError("a stage that is no dry run returned a plan")
    return {"done": True, "dataset_dir": str(run.ddir.path), "version": ds.version, "lease": None}


class StreamRun(Polled):
    """One streaming run under the dataset's lock: set up the stream folder, answer, copy, publish.  It is the
    copier's source of files (:class:`~..engine.feed.Polled`: :meth:`take` the schedule's next pick, :meth:`alone`
    whether a reader needs it soon, :meth:`ring` when the readers asked for something new).  A stage with
    peers (:mod:`stagingloader.peers.streamrun`) overrides :meth:`plan_rows`, :meth:`copy_all` and
    :meth:`requests`: its rows come from the source or from the other nodes."""

    def __init__(self, run: StageRun, lp: LockedPlan, req: StreamRequest, *,
                 tell: Callable[[dict[str, Any]], None], stop: threading.Event) -> None:
        self.run_ = run
        self.lp = lp
        self.req = req
        self.tell = tell
        self.stop = stop
        self.sdir = stream_dir(run.ddir)
        self.version = run.ddir.next_version()
        self.listing = stream_rows(run)  #: in columns: nothing per file until a file is handed to the copier
        self.inflight: dict[str, int] = {}  #: rel -> row of the files handed to the copier and not yet done
        self.done_q: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.lock = threading.Lock()  #: the schedule: the feed (copier's dispatcher) and the poller share it
        self.req_lock = threading.Lock()  #: the request reader, polled by both
        self._done = threading.Event()
        self.feed_closed = threading.Event()  #: the copy ends: the feed yields no more
        self._poll_error: BaseException | None = None
        self.start_time = procid.start_time(os.getpid())
        self.lease: str | None = None
        self.stopped_why = ""
        self._last_state = 0.0
        self._last_lease = time.monotonic()
        self.copier: Copier | None = None
        self._stop_at: float | None = None  #: when the poller saw the stop (then the watchdog runs)
        self._end_lock = threading.Lock()
        self._ending = False  #: the final state is claimed (by the run, or by the watchdog): see _claim_end
        self.failed = False
        self.checked = run.check is None  #: the rows are the source's (listed, or checked against a listing)
        self._read_at = 0.0  #: when the feed last read the readers' files

    def run(self) -> None:
        run, lp = self.run_, self.lp
        is_ready = np.ones(len(self.listing), dtype=bool)
        is_ready[begin_version_rows(run, lp)] = False
        sizes = self.listing.size.tolist()
        ready = np.flatnonzero(is_ready).tolist()
        limit = self._limit(int(self.listing.size[is_ready].sum()))
        self.sched = Schedule(sizes, ready=ready, limit=limit)
        lp.incoming.on_record = self._recorded
        self.plan_rows(np.flatnonzero(~is_ready))
        self.sdir.mkdir(mode=0o755, exist_ok=True)
        trust.check_folder(self.sdir, what="stream folder")
        StreamFiles(run.source.url, self.listing.path, self.listing.size).write(self.sdir)
        self.requests_reader = RequestReader(self.sdir, len(self.listing))
        self._write_state(COPYING, force=True)
        self.lease = take_lease(run, self.version, self.req.holder_pid)
        _note_job(self.sdir, self.req.opts.lease if self.lease is not None else None)
        self.tell({"ready": {"streaming": True, "dataset_dir": str(run.ddir.path), "version": self.version,
                             "lease": self.lease, "stream_dir": str(self.sdir), "pid": os.getpid(),
                             "cache_limit": limit}})
        _log_to(self.sdir / "stager.log")
        batch = (CopySettings.small_batch_files if run.source.is_local
                 else max(1, min(REMOTE_BATCH_FILES, run.workers // THREADS_PER_BATCH_FILE)))
        settings = CopySettings(workers=run.workers, fsync=lp.incoming.fsync, small_batch_files=batch,
                                now_batch_files=NOW_BATCH_FILES if run.source.is_local else 1)
        copier = self.copier = Copier(run.source, lp.incoming, settings, expected=lp.expected, stop=self.stop)
        poller = threading.Thread(target=self._poll_loop, name="stagingloader-stream-poll", daemon=True)
        poller.start()
        try:
            self.copy_all(copier)
            self._done.set()
            poller.join()
            if self._poll_error is not None:
                raise self._poll_error
            with self.lock:
                self._collect()
            if not self.checked and self.sched.finished and not self.sched.evicted:
                assert run.check is not None
                run.check.verdict()  # wait for the listing: a version is published only of the source as it is
                self.checked = True
        except BaseException as e:
            self._done.set()
            with contextlib.suppress(OSError):
                lp.incoming.close()
            if self._claim_end():
                self.failed = True
                self._write_state(FAILED, force=True, error=_one_line(e))
            else:  # the watchdog writes the state and ends the process now
                time.sleep(PUBLISH_SECONDS)
            raise
        if not self._claim_end():  # the watchdog writes the state and ends the process now
            time.sleep(PUBLISH_SECONDS)
            return
        if self.sched.finished and not self.sched.evicted:
            self._publish()
        else:
            lp.incoming.close()
            self._write_state(STOPPED, force=True, error=self._stopped_text())
            log.info("stopped (%s); the next stage of %s resumes", self._stopped_text(), run.source.url)

    # ---- what a stage with peers changes ------------------------------------------------------------------
    def plan_rows(self, rows: np.ndarray) -> None:
        """``rows`` (listing order) are to be brought here; the schedule is made, nothing copied yet."""

    def copy_all(self, copier: Copier) -> None:
        """Copy every row the schedule picks, until it is finished or the run stops."""
        copier.run(self)

    def requests(self) -> tuple[dict[str, Rows], dict[str, Rows], set[str], dict[str, int]]:
        """The readers' new orders, urgent rows and departures, and every reader's position."""
        with self.req_lock:
            orders, urgent, gone = self.requests_reader.poll()
            return orders, urgent, gone, dict(self.requests_reader.positions)

    def _stopped_text(self) -> str:
        if self.stop.is_set():
            return f"stopped: {self.stopped_why or 'asked to stop'}"
        return "stopped: every file was staged once under the cache limit; this run publishes no version"

    def _claim_end(self) -> bool:
        """Who writes the final state: the first to ask, the run as it ends or the watchdog at the deadline."""
        with self._end_lock:
            if self._ending:
                return False
            self._ending = True
            return True

    def _limit(self, ready_bytes: int) -> int | None:
        """The cache limit: the one asked for, or, where the dataset does not fit the tier, what the tier holds.
        One that cannot hold the largest file is refused (NoSpaceError)."""
        run, plan = self.run_, self.lp.plan
        room = ready_bytes + (plan.free_bytes or 0)
        want = self.req.opts.cache_limit
        if want is None and plan.fits:
            return None
        limit = room if want is None or want > room else want
        total = sum(f.size for f in run.listing)
        largest = max((f.size for f in run.listing), default=0)
        if limit < largest:
            raise NoSpaceError(
                f"{run.source.url} cannot stream through {human_bytes(limit)} on {run.tier.describe()}: its largest "
                f"file is {human_bytes(largest)}. Free space (stagingloader gc --keep-bytes N), raise "
                "--max-ram-fraction for tmpfs, or pick a bigger --root or --cache-limit")
        if limit < total:
            run.say(f"{run.source.url} ({human_bytes(total)}) streams through a cache limit of {human_bytes(limit)} "
                    f"on {run.tier.describe()}: this version is never published complete")
        return limit

    def _publish(self) -> None:
        run, lp = self.run_, self.lp

        def last_state() -> None:
            self._write_state(COMPLETE, force=True)

        manifest = publish_version(run, lp, self.version, before_rename=last_state)
        finish(run, lp, self.version, manifest, holder_pid=self.req.holder_pid, lease_name=self.lease)
        log.info("published %s of %s", self.version, run.source.url)

    # ---- what the copier copies next (Polled: asked in its dispatcher) ------------------------------------------
    def take(self) -> SourceFile | None:
        """The next file to copy, None if none now, StopIteration at the end."""
        if self.stop.is_set() or self.feed_closed.is_set():
            raise StopIteration
        now = time.monotonic()
        if now - self._read_at >= REQUESTS_SECONDS:  # the freshest order and urgent rows decide this pick
            self._read_at = now
            self._take_requests()
        sched = self.sched
        with self.lock:
            self._collect()
            if sched.finished:
                raise StopIteration
            pick = sched.next()
            if pick is not None:
                for row in pick.evict:
                    trust.unlink_under(self.lp.incoming.data, self.listing.path[row])
        if pick is None:
            return None
        f = self.listing.row(pick.row)
        self.inflight[f.rel] = pick.row
        self.lp.incoming.expect(self.listing, f.rel, pick.row)
        return f

    def alone(self) -> bool:
        return self.sched.lead < BATCH_LEAD_SECONDS

    def _recorded(self, entries: list[Entry]) -> None:  # copier threads
        self.done_q.put([e.path for e in entries])

    def _row_of(self, rel: str) -> int:
        row = self.inflight.pop(rel, -1)
        return row if row >= 0 else self.listing.find(rel)

    def _collect(self) -> None:
        rows: list[int] = []
        with contextlib.suppress(queue.Empty):
            while True:
                rows.extend(self._row_of(rel) for rel in self.done_q.get_nowait())
        if rows:
            self.sched.done(rows)

    def _poll_loop(self) -> None:
        """The readers' requests, the state file and the lease, every POLL_SECONDS, whatever the copier waits on."""
        try:
            while not self._done.wait(POLL_SECONDS):
                self._poll()
        except BaseException as e:  # re-raised by run()
            self._poll_error = e
            self.stop.set()

    def _take_requests(self) -> bool:
        """Read the readers' files into the schedule; True if anything changed."""
        orders, urgent, gone, positions = self.requests()
        with self.lock:
            for reader in gone:
                self.sched.forget(reader)
            for reader, rows in orders.items():
                self.sched.set_order(reader, rows)
            for reader, consumed in positions.items():
                self.sched.set_position(reader, consumed)
            for reader, rows in urgent.items():
                self.sched.add_urgent(reader, rows)
        return bool(orders or urgent or gone)

    def _poll(self) -> None:
        if self.stop.is_set():  # SIGTERM, a lost lease, a failure: say so, and make sure the process ends
            self._stopping()
            return
        check = self.run_.check
        if check is not None and not self.checked and check.done():
            check.verdict()  # rows from the source manifest: a source changed since fails the run now
            self.checked = True
            log.info("the listing of %s matches the rows its manifest gave", self.run_.source.url)
        if self._take_requests():
            self.ring()
        with self.lock:
            self._collect()
            self._write_live(COPYING)
        now = time.monotonic()
        own_gone = self.lease is not None and not os.path.lexists(self.run_.ddir.leases / f"{self.lease}.json")
        if own_gone or now - self._last_lease >= LEASE_SECONDS:
            self._last_lease = now
            held = [lease for lease in leases.live(self.run_.ddir) if lease.version == self.version]
            if self.lease and not held:  # its own lease, and those of every run reading along
                self.stopped_why = (f"its lease {self.lease} is gone (its holder ended or released it) and no other "
                                    f"run reads along")
                log.info("stopping: %s", self.stopped_why)
                self.stop.set()
                self._stopping()

    def _stopping(self) -> None:
        """The stop is seen (once): the state says so, and a watchdog makes sure the process ends in time."""
        if self._stop_at is not None:
            return
        self._stop_at = time.monotonic()
        with self.lock:
            self._write_live(COPYING, force=True, error=f"stopping: {self.stopped_why or 'asked to stop'}")
        threading.Thread(target=self._watchdog, name="stagingloader-stream-stop", daemon=True).start()

    def _watchdog(self) -> None:
        """At ``STOP_DEADLINE`` after the stop, end the process if the run has not: a copy it makes itself may be
        blocked in a read of a slow source for as long as that file takes.  The state is written first (what was
        copied is journaled; what was in flight is left for the next run), the copy workers are killed with it."""
        assert self._stop_at is not None
        time.sleep(max(0.0, self._stop_at + STOP_DEADLINE - time.monotonic()))
        if self._claim_end():
            got = self.lock.acquire(timeout=0.2)
            try:
                self._write_state(STOPPED, force=True, error=f"{self._stopped_text()}; the copies in flight were "
                                                             "left for the next stage")
            except Exception as e:  # it ends anyway: the readers see it gone
                log.error("could not write the final state: %s", _one_line(e))
            finally:
                if got:
                    self.lock.release()
            log.info("stopped (%s) with copies in flight; the next stage of %s resumes", self._stopped_text(),
                     self.run_.source.url)
        else:  # the run ends by itself (a publish under way, or the last state): give it a while
            time.sleep(PUBLISH_SECONDS)
        _end_now(self.copier.worker_pids if self.copier is not None else [], 1 if self.failed else 0)

    def _write_live(self, state: str, *, force: bool = False, error: str | None = None) -> None:
        """The poller's state: never once the final state is claimed (a failure's, say, written meanwhile)."""
        with self._end_lock:
            if not self._ending:
                self._write_state(state, force=force, error=error)

    def _write_state(self, state: str, *, force: bool = False, error: str | None = None) -> None:
        now = time.monotonic()
        if not force and now - self._last_state < STATE_SECONDS:
            return
        self._last_state = now
        s = self.sched
        ready = s.ready
        StreamState(pid=os.getpid(), start_time=self.start_time, state=state, error=error,
                    files_done=int(ready.sum()), bytes_done=s.cached_bytes, files_total=len(ready),
                    bytes_total=int(s.sizes.sum()), version=self.version, cache_limit=s.limit,
                    evicted_files=s.evicted).write(self.sdir)


def _one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, StagingError) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:2000]


def _end_now(workers: list[int], code: int = 0) -> None:
    """End this process at once, and its copy worker processes with it (no thread is waited for)."""
    for pid in workers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    logging.shutdown()
    os._exit(code)


def _log_to(path: Path) -> None:
    """From here on the process talks to no one: stderr and logging go to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(process)d %(name)s: %(message)s")


Stage = Callable[..., None]  #: :func:`stream_stage`'s signature: (req, *, tell, stop)


def main(stdin: TextIO | None = None, stage: Stage = stream_stage) -> int:
    """The process: read the request, answer on stdout (then nowhere), copy until done, stopped or failed
    (``stage``: :func:`stream_stage`, or a stage with peers')."""
    req = StreamRequest.from_json((stdin or sys.stdin).read())
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 0)
    os.close(devnull)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    told = False

    def tell(msg: dict[str, Any]) -> None:
        nonlocal told
        if told:
            return
        told = "ready" in msg or "error" in msg
        with contextlib.suppress(OSError):
            answer.write(json.dumps(msg) + "\n")
            answer.flush()
            if told:
                answer.close()

    try:
        stage(req, tell=tell, stop=stop)
        if stop.is_set():  # stopped: a copy thread may still wait on a slow source; nothing is left to do
            _end_now([])
    except BaseException as e:
        err = e if isinstance(e, StagingError) else InternalError(_one_line(e))
        tell({"error": {"type": type(err).__name__, "message": str(err)}})
        log.error("streaming stage failed: %s", _one_line(e), exc_info=not isinstance(e, StagingError))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
