"""Process identity: the one reader of ``/proc/PID/stat``.

A process is its pid *and* its start time (clock ticks after boot): a pid is reused, the pair names one process
for the life of the machine.  Whoever records a process (a lease's holder, a streaming stager in ``state.json``,
the supervisor the Slurm epilog may signal) records both, and asks :func:`alive` later.

A zombie (state ``Z``, or ``X``: dead) is gone: it has exited and only waits for its parent to reap it.  A stager
killed while its starter has not reaped it yet must not keep its readers waiting, nor a lease alive.

``/proc/PID/stat`` is ``pid (comm) state ppid pgrp session ...``, and ``comm`` is whatever the process named
itself: spaces, parentheses, ``") Z 1 "`` included.  It is split at the *last* ``)``.

Ground floor: imports nothing of stagingloader.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

#: the states of a process that has exited (``x``: the same, on kernels 2.6.33 to 3.13)
GONE_STATES = frozenset({"Z", "X", "x"})


@dataclass(frozen=True, kw_only=True)
class ProcStat:
    """What ``/proc/PID/stat`` says of a process (the fields stagingloader uses)."""

    pid: int
    comm: str  #: the name it gave itself (``surrogateescape``), at most 15 bytes
    state: str  #: R, S, D, Z, T, ... (one letter)
    ppid: int
    pgrp: int
    session: int
    start: int  #: clock ticks after boot: with the pid, names one process for the life of the machine

    @property
    def gone(self) -> bool:
        """Has it exited (a zombie not reaped yet, or dead)?"""
        return self.state in GONE_STATES


def parse_stat(raw: bytes) -> ProcStat:
    """The fields of one ``/proc/PID/stat`` line; ValueError if it is not one."""
    head, sep, tail = raw.rpartition(b")")
    pid, open_paren, comm = head.partition(b" (")
    fields = tail.split()
    if not sep or not open_paren or len(fields) < 20:
        raise ValueError(f"not a /proc/PID/stat line: {raw[:200]!r}")
    # after the name: state(0) ppid(1) pgrp(2) session(3) ... starttime(19): field 22 of the whole line
    return ProcStat(pid=int(pid), comm=comm.decode("utf-8", "surrogateescape"),
                    state=fields[0].decode("ascii", "replace"), ppid=int(fields[1]), pgrp=int(fields[2]),
                    session=int(fields[3]), start=int(fields[19]))


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/PID/stat`` of ``pid``, zombie or not; None if there is no such process (or pid is not > 0)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat(f.read())
    except (OSError, ValueError):
        return None


def running(pid: int) -> ProcStat | None:
    """``/proc/PID/stat`` of ``pid`` while it runs; None when it is gone: no such process, or a zombie."""
    st = read_stat(pid)
    return None if st is None or st.gone else st


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or None when it is gone (a zombie is gone)."""
    st = running(pid)
    return None if st is None else st.start


def alive(pid: int, start: int | None) -> bool:
    """Does the process ``(pid, start)`` still run: not gone, not a zombie, its pid not reused by another?"""
    return start is not None and start_time(pid) == start


def owner(pid: int) -> int | None:
    """The uid that owns ``/proc/PID`` (the process's effective uid, while it is dumpable); None if gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def all_pids() -> Iterator[int]:
    """The pids in ``/proc`` now (a process may be gone by the time it is read)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)
