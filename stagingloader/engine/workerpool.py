"""Copy worker processes: each copies and hashes whole batches of small files, or ranges of large ones, on its
own core and under its own interpreter lock.

Workers are fresh interpreters (``python -c``, never forked: the stager may run in a process that holds
threads, a DataLoader's or a streaming stager's; and not ``multiprocessing``'s spawn either, which runs the
caller's main script again in each child: a script calling ``stage()`` without a ``__main__`` guard would
stage in every worker), started once per :class:`~.copier.Copier` run and fed through one socket each, a few
jobs ahead, so that a worker never waits for the next job.  A worker dies with its parent
(``PR_SET_PDEATHSIG``): nothing renames files into the cache after the stager that owned them is gone.
What a worker raises comes back pickled, with its type; a worker that dies (killed, out of memory) fails the
run with a :class:`StagingError` naming it, and what it left is only temp files in ``.partial/``, swept when
the stage is resumed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from ..errors import StagingError
from .copyops import Target, Worker, as_root_error

log = logging.getLogger(__name__)

DEPTH = 2  #: jobs sent ahead to each worker (one running, one waiting in its pipe)
_PR_SET_PDEATHSIG = 1
#: the folder this package is in: on the workers' path even when an editable install's finder put it there
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerDiedError(StagingError):
    """A copy worker process died while it held a job."""


# A worker starts without ``site`` (``-S``: 11 ms of CPU instead of 34 here, an editable install's finder
# included) on the stager's own ``sys.path``.  The packages stagingloader, its engine, sources and cache are
# registered without running their __init__ (which import the whole library, numpy and fsspec: 0.2 s of CPU per
# worker); then only the copy modules load.
_BOOT = ("import sys, importlib.util as u; from multiprocessing.connection import Connection; "
         "c = Connection(int(sys.argv[1]))\n"
         "try:\n"
         "    sys.path[:] = c.recv()\n"
         "except (EOFError, OSError):\n"  # the stager stopped (Ctrl-C) before it gave us work: nothing to say
         "    sys.exit(0)\n"
         "for n in ('stagingloader', 'stagingloader.engine', 'stagingloader.sources', 'stagingloader.cache'):\n"
         "    sys.modules[n] = u.module_from_spec(u.find_spec(n))\n"
         "from stagingloader.engine.workerpool import main; main(c)")


class _Proc:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.name = name
        self.proc = proc
        self.conn = conn
        self.ready = False
        self.jobs: deque[Any] = deque()  #: the keys of the jobs sent, oldest first


class WorkerPool:
    """Up to ``size`` worker processes; :meth:`grow` starts them, :meth:`poll` collects results."""

    def __init__(self, target: Target, size: int) -> None:
        self.target = target
        self.size = size
        self.procs: list[_Proc] = []
        self.started = 0  #: workers started, including any that could not start
        self._stopped = False

    def grow(self, count: int) -> None:
        """Start workers until there are ``count`` (at most ``size``); they report ready on their own."""
        while self.started < min(count, self.size):
            ours, theirs = socket.socketpair()
            name = f"stagingloader-copy-{self.started}"
            self.started += 1
            try:
                proc = subprocess.Popen([sys.executable, "-S", "-c", _BOOT, str(theirs.fileno()), name],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        start_new_session=True)  # Ctrl-C goes to the stager, which stops them
            finally:
                theirs.close()
            conn = Connection(ours.detach())
            conn.send([*sys.path, _PACKAGE_ROOT])
            conn.send((self.target, os.getpid()))
            self.procs.append(_Proc(name, proc, conn))

    def set_stop(self) -> None:
        """Ask every worker to stop after the file it copies (a job it has not started is not run)."""
        if self._stopped:
            return
        self._stopped = True
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.conn.send("stop")

    def ready(self, limit: int | None = None) -> list[_Proc]:
        return [p for p in self.procs[:limit] if p.ready]

    def submit(self, p: _Proc, key: Any, kind: str, payload: Any) -> None:
        p.jobs.append(key)
        p.conn.send((kind, payload))

    @property
    def in_flight(self) -> int:
        return sum(len(p.jobs) for p in self.procs)

    def poll(self, timeout: float) -> list[tuple[Any, Any]]:
        """(key, result) of every job finished within ``timeout``; raises :class:`WorkerDiedError`."""
        if not self.procs:
            return []
        conns = {p.conn: p for p in self.procs}
        out: list[tuple[Any, Any]] = []
        for obj in wait(list(conns), timeout):
            if obj not in conns:
                continue
            p = conns[obj]
            while True:
                try:
                    if not p.conn.poll():
                        break
                    msg = p.conn.recv()
                except (EOFError, OSError):
                    self._died(p)
                    break
                if msg == "ready":
                    p.ready = True
                else:
                    out.append((p.jobs.popleft(), msg))
        return out

    def _died(self, p: _Proc) -> None:
        try:
            code = p.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        if not p.ready and not p.jobs:  # it never started: the stager copies without it
            log.warning("copy worker %s could not start (%s); copying in fewer processes", p.name, how)
            self.procs.remove(p)
            p.conn.close()
            return
        raise WorkerDiedError(
            f"copy worker {p.name} (pid {p.proc.pid}) died ({how}) while it held {len(p.jobs)} jobs; the files it "
            "had finished are kept and its partial files are never published: stage again to resume (out of "
            "memory? see dmesg)")

    def close(self, *, grace: float = 5.0) -> None:
        """Stop every worker: ask, wait up to ``grace`` seconds, then kill."""
        self.set_stop()
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.conn.send(None)
        _wait_all([p.proc for p in self.procs], grace)
        for p in self.procs:
            try:
                p.proc.wait(0.1)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
            p.conn.close()
        self.procs.clear()


class _Inbox:
    """A worker's end of its socket, and its stop flag: ``is_set`` looks for a "stop" at most every 20 ms."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.jobs: deque[Any] = deque()
        self.stopped = False
        self._next_look = 0.0

    def is_set(self) -> bool:
        if not self.stopped:
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + 0.02
                while self.conn.poll():
                    self._take(self.conn.recv())
        return self.stopped

    def _take(self, msg: Any) -> None:
        if msg == "stop":
            self.stopped = True
        else:
            self.jobs.append(msg)

    def next_job(self) -> Any:
        while not self.jobs:
            self._take(self.conn.recv())
        return self.jobs.popleft()


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every one of ``procs`` has exited, or ``timeout``: woken by the exits themselves (pidfds), not
    by ``Popen.wait``'s polling sleeps, which cost a stage up to 50 ms at its end."""
    fds: list[int] = []
    try:
        for proc in procs:
            with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfd here: polled below
                fds.append(os.pidfd_open(proc.pid))
        deadline = time.monotonic() + timeout
        while fds and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(fds, [], [], left)
            for fd in ready:
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def die_with_parent(parent: int) -> None:
    """End this process with ``parent`` (SIGKILL when it dies, whatever ends it); at once if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the socket's end still stops it after the job
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def main(conn: Connection) -> None:
    """A worker process: run the jobs its socket brings until it brings None (or closes).  A stager that stopped
    (Ctrl-C, SIGTERM) closes the socket at any moment: the worker then ends without a word."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    try:
        target, parent = conn.recv()
    except (EOFError, OSError):
        return
    die_with_parent(parent)
    inbox = _Inbox(conn)
    worker = Worker(target, inbox)
    try:
        conn.send("ready")
    except OSError:
        return
    while True:
        try:
            job = inbox.next_job()
        except (EOFError, OSError):
            return
        if job is None:
            return
        kind, payload = job
        if inbox.stopped:
            result: Any = ([], None) if kind == "batch" else (None, None)  # not run
        else:
            try:
                if kind == "batch":
                    done, err = worker.copy_batch(payload)
                    result = (done, _portable(err))
                elif kind == "rows":
                    got, err = worker.copy_rows(payload)
                    result = (got, _portable(err))
                else:
                    result = (worker.copy_range(*payload), None)
            except BaseException as e:  # a range's error, or a bug: sent back with its type
                result = (None, _portable(as_root_error(e)))
        try:
            conn.send(result)
        except OSError:
            return
def _portable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it survives pickling with its type and message, else a StagingError that says what it was."""
    if exc is None:
        return None
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:  # any failure to pickle: replaced below
        pass
    return StagingError(f"{type(exc).__name__} in a copy worker: {exc}")


__all__ = ["DEPTH", "WorkerDiedError", "WorkerPool"]
