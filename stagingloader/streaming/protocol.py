"""The streaming protocol's files: what a streaming stager and the readers of its dataset tell each other.

Everything lives in ``DDIR/incoming/stream/`` (see docs/staging.md, "Streaming"):

- ``files.bin``: the listing the run stages, in row order (sorted by relative path), in columns; written once
  (:mod:`.rows`);
- ``state.json``: the stager's pid and start time, its state (copying, complete, failed, stopped), its error,
  counts.  ``stopped``: it stopped before it finished (SIGTERM, its last lease gone); the next stage resumes;
- ``order-<reader>``: a reader's upcoming rows (int64, little-endian), replaced atomically at each epoch;
- ``urgent-<reader>``: rows a reader is blocked on, appended (8 bytes a row, ``O_APPEND``);
- ``job-<id>.leases``: the named leases runs inside Slurm job ``<id>`` took on this stream, one a line (appended):
  the job's epilog releases them with the job's own lease.

A row is ready when ``DDIR/incoming/data/<rel>`` is a regular file, or, once the run is complete, when
``DDIR/<version>/data/<rel>`` is.  This module reads and writes those files and decides readiness; it copies
nothing.  When the stager publishes, ``incoming`` (with ``stream/`` in it) becomes ``DDIR/<version>``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import procid
from ..cache import trust
from ..cache.layout import DatasetDir, safe_join
from ..errors import UnsafePathError
from ..fsio import atomic_write, atomic_write_parts
from .rows import StreamFiles as StreamFiles  # the rows file (its own module); readers and the stager find it here
from .rows import open_regular

ROW = np.dtype("<i8")
COPYING, COMPLETE, FAILED, STOPPED = "copying", "complete", "failed", "stopped"

Rows = npt.NDArray[np.int64]


def stream_dir(ddir: DatasetDir | Path) -> Path:
    """``DDIR/incoming/stream``: where a streaming run of the dataset folder ``ddir`` keeps the protocol files."""
    path = ddir.path if isinstance(ddir, DatasetDir) else Path(ddir)
    return path / "incoming" / "stream"


def reader_id(rank: int = 0, pid: int | None = None) -> str:
    """The name of one reader's order and urgent files: ``r<rank>-<pid>``."""
    return f"r{int(rank)}-{os.getpid() if pid is None else int(pid)}"


# ---- state.json ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StreamState:
    """What ``state.json`` says: who stages, how far it is, and how it ended."""

    pid: int
    start_time: int | None
    state: str = COPYING
    error: str | None = None
    files_done: int = 0
    bytes_done: int = 0
    files_total: int = 0
    bytes_total: int = 0
    version: str = ""
    updated: float = field(default_factory=time.time)
    cache_limit: int | None = None
    evicted_files: int = 0

    @property
    def alive(self) -> bool:
        """Is the stager that wrote this still running (same pid, same start time)?"""
        return procid.alive(self.pid, self.start_time)

    def write(self, sdir: Path) -> None:
        atomic_write(sdir / "state.json", json.dumps(asdict(self), ensure_ascii=False).encode(), mode=0o644)

    def problem(self, dataset: str) -> str | None:
        """Why readers can wait no longer (the stager failed or vanished), in one line; None while it is fine."""
        fix = "stage it again to resume (stagingloader stage SRC, or sl.stage(..., wait=False))"
        if self.state == FAILED:
            return f"the streaming stage of {dataset} failed: {self.error or 'no reason recorded'}; {fix}"
        if self.state == STOPPED:
            return (f"the streaming stager of {dataset} (pid {self.pid}) is gone: it stopped before it finished "
                    f"({self.error or 'asked to stop'}); {fix}")
        if self.state == COPYING and not self.alive:
            return f"the streaming stager of {dataset} (pid {self.pid}) is gone before it finished; {fix}"
        return None


def read_state(sdir: Path) -> StreamState | None:
    """``state.json`` of the stream folder ``sdir``, or None if there is none (yet, or any more)."""
    raw = _read_regular(sdir / "state.json")
    if raw is None:
        return None
    try:
        data: dict[str, Any] = json.loads(raw)
        known = set(StreamState.__dataclass_fields__)
        return StreamState(**{k: v for k, v in data.items() if k in known})
    except (ValueError, TypeError):
        return None


def find_state(ddir: DatasetDir | Path, version: str | None = None) -> StreamState | None:
    """The state of the dataset's streaming run: ``incoming/stream`` while it streams, the published version's
    ``stream`` folder after (the rename moves it there)."""
    d = ddir if isinstance(ddir, DatasetDir) else DatasetDir(Path(ddir))
    state = read_state(stream_dir(d))
    if state is None and version:
        state = read_state(d.version_dir(version) / "stream")
    return state


# ---- readiness ----------------------------------------------------------------------------------------------
def resolve(ddir: DatasetDir | Path, rel: str, version: str | None = None) -> Path | None:
    """The whole, verified local copy of ``rel``, or None if it is not staged yet (the READY rule).

    ``incoming/data/<rel>`` while the run streams; ``<version>/data/<rel>`` once published (``version``: the one
    the run publishes, from ``StagedDataset.version`` or ``state.json``; else ``current``).  Only regular files
    count (``lstat``: a link is never followed)."""
    d = ddir if isinstance(ddir, DatasetDir) else DatasetDir(Path(ddir))
    path = _regular(safe_join(d.incoming / "data", rel))
    if path is not None:
        return path
    if version is None:
        state = read_state(stream_dir(d))
        version = state.version if state is not None and state.state == COMPLETE else None
    if version is None:
        with contextlib.suppress(OSError):
            version = d.current()
    if not version:
        return None
    return _regular(safe_join(d.version_dir(version) / "data", rel))


def _regular(path: Path) -> Path | None:
    try:
        st = os.lstat(path)
    except OSError:  # absent, or a folder on the way is not one
        return None
    return path if stat.S_ISREG(st.st_mode) else None


# ---- order and urgent files (readers write, the stager reads) -----------------------------------------------
def _rows(rows: Iterable[int] | npt.ArrayLike) -> bytes:
    return _row_array(rows).tobytes()


def _row_array(rows: Iterable[int] | npt.ArrayLike) -> npt.NDArray[Any]:
    arr = np.asarray(rows if not isinstance(rows, (range, list, tuple)) else np.fromiter(rows, dtype=np.int64),
                     dtype=ROW)
    return np.ascontiguousarray(arr.reshape(-1))


def write_order(sdir: Path, reader: str, rows: Iterable[int] | npt.ArrayLike) -> None:
    """Replace ``order-<reader>`` with ``rows``: this epoch's remaining reads, then the next epoch's."""
    _check_reader(reader)
    atomic_write_parts(sdir / f"order-{reader}", (_row_array(rows).data,), mode=0o644)  # 20 MB: not copied


def write_position(sdir: Path, reader: str, consumed: int) -> None:
    """Replace ``pos-<reader>``: how many rows of the reader's current order file it has consumed so far."""
    _check_reader(reader)
    atomic_write(sdir / f"pos-{reader}", _rows([int(consumed)]), mode=0o644)


def append_urgent(sdir: Path, reader: str, rows: Iterable[int] | npt.ArrayLike) -> bool:
    """Append ``rows`` to ``urgent-<reader>`` (one ``O_APPEND`` write); False if the stream folder is gone
    (the run was published: every row is ready)."""
    _check_reader(reader)
    data = _rows(rows)
    try:
        fd = os.open(sdir / f"urgent-{reader}", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except FileNotFoundError:
        return False
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


def remove_reader(sdir: Path, reader: str) -> None:
    """A reader that is done removes its order and urgent files (the stager then forgets it)."""
    _check_reader(reader)
    for name in (f"order-{reader}", f"urgent-{reader}", f"pos-{reader}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sdir / name)


# ---- the named leases of a Slurm job (its runs write, its epilog reads) -------------------------------------
def note_job_lease(sdir: Path, job: str, lease: str) -> None:
    """Note that a run inside Slurm job ``job`` took the named lease ``lease`` on this stream."""
    if not job.isdigit() or not lease or "\n" in lease or "/" in lease:
        raise UnsafePathError(f"{job!r}, {lease!r}: not a job id and a lease name")
    fd = os.open(sdir / f"job-{job}.leases", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, f"{lease}\n".encode())
    finally:
        os.close(fd)


def job_leases(ddir: DatasetDir | Path, job: str, version: str | None = None) -> list[str]:
    """The named leases runs inside Slurm job ``job`` took on the dataset's stream: noted in ``incoming/stream``
    while it streams, in the published version's ``stream`` folder after (never read through a link)."""
    d = ddir if isinstance(ddir, DatasetDir) else DatasetDir(Path(ddir))
    if not job.isdigit():
        return []
    found: list[str] = []
    folders = [stream_dir(d)] + ([d.version_dir(version) / "stream"] if version else [])
    for sdir in folders:
        with contextlib.suppress(OSError):
            raw = _read_regular(sdir / f"job-{job}.leases")
            for line in (raw or b"").decode("utf-8", "replace").splitlines():
                if line and line not in found:
                    found.append(line)
    return found


def _check_reader(reader: str) -> None:
    if not reader or "/" in reader or reader.startswith(".") or len(reader) > 128:
        raise UnsafePathError(f"{reader!r} is not a reader name (r<rank>-<pid>)")


@dataclass
class _Seen:
    key: tuple[int, int, int] = (0, 0, 0)  # (inode, size, mtime_ns) of the order file last read
    pos_key: tuple[int, int, int] = (0, 0, 0)  # the same, of the position file
    offset: int = 0  # bytes of the urgent file already read


class RequestReader:
    """The stager's side: poll the stream folder for the readers' order and urgent files.

    Files are opened without following links (``O_NOFOLLOW`` under a descriptor of the folder) and used only if
    they are regular files owned by one of ``owners`` (default: this process's user and root); rows outside
    ``[0, n_rows)`` are dropped.  ``poll()`` returns the orders that changed, the urgent rows appended since, and
    the readers whose files are gone; ``positions`` holds each reader's last ``pos-`` value (rows consumed)."""

    def __init__(self, sdir: Path, n_rows: int, *, owners: frozenset[int] | None = None) -> None:
        self.sdir = sdir
        self.n_rows = n_rows
        self.owners = owners if owners is not None else trust.trusted_owners()
        self._seen: dict[str, _Seen] = {}
        self.positions: dict[str, int] = {}

    def poll(self) -> tuple[dict[str, Rows], dict[str, Rows], set[str]]:
        """``(changed orders by reader, new urgent rows by reader, readers gone)``."""
        orders: dict[str, Rows] = {}
        urgent: dict[str, Rows] = {}
        try:
            dfd = trust.open_dir(self.sdir)
        except OSError:
            return orders, urgent, set()
        try:
            names = sorted(os.listdir(dfd))  # order- before pos-: a new order resets, then its position counts
            present = set()
            for name in names:
                kind, _, reader = name.partition("-")
                if kind not in ("order", "urgent", "pos") or not reader or reader.startswith("."):
                    continue
                present.add(reader)
                seen = self._seen.setdefault(reader, _Seen())
                if kind == "order":
                    got = self._read_order(dfd, name, seen)
                    if got is not None:
                        orders[reader] = got
                        self.positions.pop(reader, None)  # a new order starts at its first row
                elif kind == "pos":
                    self._read_pos(dfd, name, seen, reader)
                else:
                    rows = self._read_urgent(dfd, name, seen)
                    if rows is not None and len(rows):
                        urgent[reader] = rows
            gone = {r for r in self._seen if r not in present}
            for r in gone:
                del self._seen[r]
                self.positions.pop(r, None)
            return orders, urgent, gone
        finally:
            os.close(dfd)

    def _open(self, dfd: int, name: str) -> tuple[int, os.stat_result] | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ELOOP, errno.EACCES, errno.ENXIO):
                raise
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in self.owners:
            os.close(fd)
            return None
        return fd, st

    def _read_changed(self, dfd: int, name: str,
                      last: tuple[int, int, int]) -> tuple[bytes, tuple[int, int, int]] | None:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if (st.st_ino, st.st_size, st.st_mtime_ns) == last:
            return None
        opened = self._open(dfd, name)
        if opened is None:
            return None
        fd, st = opened
        try:
            data = _read_all(fd, st.st_size)
        finally:
            os.close(fd)
        return data, (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read_order(self, dfd: int, name: str, seen: _Seen) -> Rows | None:
        got = self._read_changed(dfd, name, seen.key)
        if got is None:
            return None
        data, seen.key = got
        return self._bounded(data)

    def _read_pos(self, dfd: int, name: str, seen: _Seen, reader: str) -> None:
        got = self._read_changed(dfd, name, seen.pos_key)
        if got is None or len(got[0]) < 8:
            return
        data, seen.pos_key = got
        self.positions[reader] = max(0, int(np.frombuffer(data[:8], dtype=ROW)[0]))

    def _read_urgent(self, dfd: int, name: str, seen: _Seen) -> Rows | None:
        opened = self._open(dfd, name)
        if opened is None:
            return None
        fd, st = opened
        try:
            end = st.st_size - st.st_size % 8
            if end <= seen.offset:
                return None
            data = os.pread(fd, end - seen.offset, seen.offset)
        finally:
            os.close(fd)
        seen.offset += len(data) - len(data) % 8
        return self._bounded(data)

    def _bounded(self, data: bytes) -> Rows:
        rows = np.frombuffer(data, dtype=ROW, count=len(data) // 8).astype(np.int64, copy=False)
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.n_rows):
            rows = rows[(rows >= 0) & (rows < self.n_rows)]
        return rows


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_regular(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (never through a link); None if absent."""
    fd = open_regular(path)
    if fd is None:
        return None
    try:
        return _read_all(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def merge_orders(orders: Sequence[Rows]) -> Rows:
    """Interleave the readers' orders by position (reader A's 1st, B's 1st, A's 2nd...), first sight wins.  Linear
    in the rows (no sort): the stager merges again at every new order, 2.56 M rows for one reader's two epochs of
    ImageNet, where a sort took 0.6 s."""
    if not orders:
        return np.empty(0, dtype=np.int64)
    return first_sight(orders[0] if len(orders) == 1 else interleave(orders))


def interleave(orders: Sequence[Rows]) -> Rows:
    """Every order's 1st row (in the orders' order), then every 2nd..., skipping orders that have ended."""
    lens = np.array([len(o) for o in orders], dtype=np.int64)
    longest = int(lens.max(initial=0))
    # live[p]: how many orders have a row at position p; start[p]: where position p begins in the result
    live = len(orders) - np.cumsum(np.bincount(lens, minlength=longest + 1))[:longest]
    start = np.cumsum(live) - live
    out = np.empty(int(lens.sum()), dtype=np.int64)
    before = np.zeros(longest, dtype=np.int64)  # at each position, how many earlier orders have a row there
    for order in orders:
        n = len(order)
        out[start[:n] + before[:n]] = order
        before[:n] += 1
    return out


def first_sight(rows: Rows) -> Rows:
    """``rows`` without repeats, each kept where it first comes."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return rows
    at = np.arange(len(rows), dtype=np.int64)
    first = np.full(int(rows.max()) + 1, len(rows), dtype=np.int64)
    np.minimum.at(first, rows, at)
    kept: Rows = rows[first[rows] == at]
    return kept
