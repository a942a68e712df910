"""Reading a dataset while it stages (issue 12): a sample comes only from a whole, verified file.

The streaming stager renames each file into ``DDIR/incoming/data/`` only when it is whole and verified, and at
the end publishes ``incoming`` as ``DDIR/<version>`` (:mod:`stagingloader.streaming.protocol` holds the protocol).
:class:`StreamReader` is what a dataset reads through while that runs:

* the fast path is one ``open`` (``O_NOFOLLOW``) of the row's file under ``incoming/data``: the cost of reading a
  finished stage;
* a miss (the file is not there yet, or was evicted under a cache limit) appends the row to this process's
  ``urgent-<reader>`` file, so it jumps the stager's queue, then waits with short sleeps backing off to 20 ms,
  re-checking ``incoming`` and the published version (the rename can fall between two checks); the wait is
  counted as "not staged yet" in the loader's clock (``NOT_STAGED_S``), apart from reading and decoding;
* a failed or vanished stager raises :class:`~stagingloader.errors.StagerFailedError` naming the dataset and the
  fix; once the run is published, :attr:`StreamReader.published` names the version's data folder and the dataset
  reads there directly, with no per-sample cost left.

It holds nothing a process cannot inherit: pickled into a spawned DataLoader worker, or forked, each process
names its own ``urgent`` file after its pid.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing.util
import os
import stat
import time
from pathlib import Path
from typing import Any

from ..cache.layout import DatasetDir
from ..errors import StagerFailedError
from ..streaming import protocol, rows
from .context import current
from .stats import MISSES, NOT_STAGED_S

log = logging.getLogger("stagingloader.loader")

WAIT_MIN_S, WAIT_MAX_S = 0.001, 0.02  #: sleeps while a file is not staged yet: 1 ms, doubling up to 20 ms
ALIVE_EVERY_S = 0.5  #: how often a waiting reader checks that the stager still runs (pid + start time)
NO_STATE_S = 60.0  #: a stream folder without state.json for this long while a reader waits: no stager runs
WARN_EVERY_S = 60.0  #: a reader waiting on one file this long says so in the log, then again as often
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
MISSING = (errno.ENOENT, errno.ENOTDIR)


#: (pid, stream folder) whose reader files this process removes at exit (one registration each)
_CLEANUP_REGISTERED: set[tuple[int, Path]] = set()


def _remove_reader_files(reader: StreamReader, name: str, pid: int) -> None:
    """At a reader process's exit (a DataLoader worker's, which no one else cleans up after): remove its files
    from the stream folder, so the stager forgets it, or from the published version's, where the rename took them;
    each epoch's workers would otherwise leave theirs behind.  Only in the process that registered it (a child
    forked without multiprocessing inherits the registration)."""
    if os.getpid() != pid:
        return
    with contextlib.suppress(OSError):
        protocol.remove_reader(reader.sdir, name)
    ddir = DatasetDir(reader.ddir)
    with contextlib.suppress(OSError):  # the version this process saw, or the one published since (a checked link)
        for version in set(ddir.versions()) & {reader.version, ddir.current()}:
            with contextlib.suppress(OSError):
                protocol.remove_reader(ddir.version_dir(version) / "stream", name)


def rank_now() -> int:
    """This process's rank for the order and urgent files' names: torch.distributed's, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-initialised process group: the name only has to be unique with the pid
        pass
    return 0


class StreamReader:
    """Opens a streaming dataset's files once they are ready, waiting (and asking) for those that are not.

    ``ddir``: the dataset folder (``StagedDataset.dataset_dir``); ``name``: what messages call the dataset (its
    source URL); ``version``: the version the run publishes, when known.
    """

    def __init__(self, ddir: str | os.PathLike[str], *, name: str, version: str | None = None) -> None:
        self.ddir = Path(ddir)
        self.sdir = protocol.stream_dir(self.ddir)
        self.name = name
        self.version = version or None
        self.incoming = os.fsencode(self.ddir / "incoming" / "data") + b"/"
        self.published: bytes | None = None  #: the published version's data folder, once the run is complete
        self.waited_s = 0.0  #: this process's seconds spent waiting for files not staged yet
        self.misses = 0  #: this process's reads that had to wait
        self._reader: tuple[int, str] | None = None  # (pid, reader name) of this process

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_reader=None, waited_s=0.0, misses=0)  # a worker counts, and asks, under its own name
        return state

    def files(self) -> protocol.StreamFiles:
        """The run's listing (``files.bin``): row ``i`` is ``path[i]``."""
        return protocol.StreamFiles.load(self.sdir)

    @property
    def reader(self) -> str:
        """This process's reader name, ``r<rank>-<pid>`` (a forked worker gets its own)."""
        pid = os.getpid()
        if self._reader is None or self._reader[0] != pid:
            self._reader = (pid, protocol.reader_id(rank_now(), pid))
            if (pid, self.sdir) not in _CLEANUP_REGISTERED:  # a DataLoader worker leaves no urgent file behind
                _CLEANUP_REGISTERED.add((pid, self.sdir))
                multiprocessing.util.Finalize(None, _remove_reader_files, args=(self, self._reader[1], pid),
                                              exitpriority=0)
        return self._reader[1]

    def root(self) -> bytes:
        """The data folder reads go to now: ``incoming/data/`` while streaming, the version's once published."""
        return self.published or self.incoming

    def open(self, row: int, rel: bytes) -> int:
        """A read-only descriptor of row ``row`` (relative path ``rel``), once its file is whole and verified."""
        try:
            return os.open((self.published or self.incoming) + rel, OPEN_FLAGS)
        except OSError as e:
            if e.errno not in MISSING:
                raise
        return self._wait(int(row), rel)

    def ready(self, row: int, rel: bytes) -> bytes:
        """The path of row ``row``'s file once it is ready (for readers that open files themselves: GDS).

        It may move once more (``incoming`` renamed to the version): open it, and on ``FileNotFoundError`` ask
        again."""
        fd = self.open(row, rel)
        os.close(fd)
        return self.root() + rel

    def is_published(self) -> bool:
        """Has the run been published (looked up once in ``state.json`` until it has)?"""
        if self.published is None:
            self._published_by(self._state())
        return self.published is not None

    def wait_published(self) -> bytes:
        """Wait until the run is published (every file ready); the version's data folder."""
        t0 = time.monotonic()
        sleep = WAIT_MIN_S
        while self.published is None:
            state = self._state()
            if self._published_by(state):
                break
            self._check(state, t0)
            time.sleep(sleep)
            sleep = min(2 * sleep, 10 * WAIT_MAX_S)
        self._count(time.monotonic() - t0, 0)
        assert self.published is not None
        return self.published

    # ---- the slow path ------------------------------------------------------------------------------
    def _wait(self, row: int, rel: bytes) -> int:
        t0 = time.monotonic()
        asked = slept = False
        sleep = WAIT_MIN_S
        warned = t0
        alive_at = 0.0
        while True:
            fd = self._try(rel)
            if fd is not None:
                break
            state = self._state()
            if state is not None and state.version:
                self.version = state.version
            if self.published is None and self._published_by(state):
                continue  # look in the version now: moved, not missing (no wait, nothing to ask)
            if self.published is not None:
                raise StagerFailedError(
                    f"{self.name}: {os.fsdecode(rel)} is missing from the published version {self.version} of "
                    f"{self.ddir}; stage the dataset again (stagingloader stage SRC) to repair it")
            if not asked:
                asked = True
                try:
                    protocol.append_urgent(self.sdir, self.reader, [row])  # False: published meanwhile (next look)
                except PermissionError:  # another user's shared copy: wait on its stager's own order
                    log.debug("%s: cannot ask for %s (the stream folder is not ours); waiting", self.name,
                              os.fsdecode(rel))
            now = time.monotonic()
            if now - alive_at >= ALIVE_EVERY_S:
                self._check(state, t0)
                alive_at = now
            if now - warned >= WARN_EVERY_S:
                warned = now
                done = f"{state.files_done}/{state.files_total} files staged" if state is not None else "no state"
                log.warning("waited %.0fs for %s of %s, not staged yet (%s); the source is the bottleneck",
                            now - t0, os.fsdecode(rel), self.name, done)
            time.sleep(sleep)
            slept = True
            sleep = min(2 * sleep, WAIT_MAX_S)
        if slept:
            self._count(time.monotonic() - t0, 1)
        return fd

    def _try(self, rel: bytes) -> int | None:
        for base in (self.incoming, self.published):
            if base is None:
                continue
            try:
                return os.open(base + rel, OPEN_FLAGS)
            except OSError as e:
                if e.errno not in MISSING:
                    raise
        return None

    def _state(self) -> protocol.StreamState | None:
        return protocol.find_state(self.ddir, self.version)

    def _published_by(self, state: protocol.StreamState | None) -> bool:
        """Take the published version when ``state`` says complete and the version's folder is there (the stager
        writes the final state just before it renames ``incoming``: until then, reads stay in ``incoming``)."""
        if state is None or state.state != protocol.COMPLETE or not state.version:
            return False
        data = self.ddir / state.version / "data"
        try:
            if not stat.S_ISDIR(os.lstat(data).st_mode):
                return False
        except OSError:
            return False
        self.version = state.version
        self.published = os.fsencode(data) + b"/"
        log.debug("%s: the streaming stage is published as %s; reading there", self.name, state.version)
        return True

    def _check(self, state: protocol.StreamState | None, t0: float) -> None:
        """Raise where waiting cannot end: the stager failed or is gone, or never started."""
        if state is None:
            if time.monotonic() - t0 > NO_STATE_S:
                raise StagerFailedError(f"{self.name}: no streaming stager reports on {self.sdir} (no state.json "
                                        f"for {NO_STATE_S:.0f}s); stage the dataset again (stagingloader stage SRC "
                                        "--no-wait, or sl.stage(..., wait=False)) to resume it")
            return
        if state.state == protocol.COMPLETE and time.monotonic() - t0 > NO_STATE_S:
            raise StagerFailedError(f"{self.name}: its streaming stager reported complete, but {self.ddir} holds no "
                                    f"folder {state.version} after {NO_STATE_S:.0f}s; stage the dataset again "
                                    "(stagingloader stage SRC) to publish it")
        problem = state.problem(self.name)
        if problem is not None:
            raise StagerFailedError(problem)

    def _count(self, seconds: float, misses: int) -> None:
        self.waited_s += seconds
        self.misses += misses
        clock = current().clock
        if clock is not None:
            clock.add(NOT_STAGED_S, seconds)
            clock.add(MISSES, misses)


def stream_of(staged: Any) -> StreamReader | None:
    """A reader over ``staged`` when it is a StagedDataset that is still streaming (``ds.streaming``), else None."""
    if not getattr(staged, "streaming", False):
        return None
    return StreamReader(staged.dataset_dir, name=str(getattr(staged, "source", staged.dataset_dir)),
                        version=getattr(staged, "version", None) or None)


def stream_at(ddir: Path) -> StreamReader | None:
    """A reader over the dataset folder ``ddir`` when a streaming stage of it is under way (``incoming/stream``
    holds its listing), else None: what ``StagedFiles(folder)`` uses for a dataset with no complete version yet."""
    sdir = protocol.stream_dir(ddir)
    if not (sdir / rows.NAME).is_file():
        return None
    state = protocol.read_state(sdir)
    return StreamReader(ddir, name=str(ddir), version=state.version if state is not None else None)
