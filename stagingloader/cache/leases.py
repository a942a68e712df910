"""Leases: who uses which version of a staged dataset.  Eviction never removes a leased version.

Each run of ``stage`` holds its own lease, a small JSON file under ``<dataset>/leases/``:

- tied to a *process*: ``stagingloader.stage()`` in a training script holds one for its own process;
  the CLI's ``stage`` (which exits right after staging, while the job that called it reads on) holds
  one for its caller, the job script or shell.  A process is its pid *and* its start time (from
  ``/proc/PID/stat``, :mod:`..procid`), so a pid reused by another process does not keep the lease alive; a
  process lease on this host whose process has ended (a zombie has) is stale and removed when seen;
- *named*: ``slurm-job-<id>`` inside a Slurm job (dropped by the epilog), or ``--lease NAME``, held
  until ``stagingloader release``.

One process holds one lease per version: staging again from the same shell renews it rather than adding
another.  The *caller's* leases (what ``release`` and ``rm`` drop without ``--lease``) are the process leases
of the calling process and its ancestors, and the Slurm job's.  A process lease whose holder has ended is
*stale*: ``ls`` shows it as such, ``gc``, ``stage`` and ``release`` drop it.  The file format is the one
older versions read (they skip a lease file with a key they do not know, so none is added).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import asdict, dataclass

from .. import procid
from ..errors import UsageError
from ..fsio import atomic_write
from . import trust
from .layout import DatasetDir

_NAME_RE = re.compile(r"^[A-Za-z0-9._@+-]{1,128}$")


@dataclass(frozen=True)
class Lease:
    name: str
    version: str
    user: str
    host: str
    created: float
    pid: int | None = None
    pid_start: int | None = None
    expires: float | None = None

    @property
    def holder(self) -> str:
        """Who keeps this lease alive, in words (for ``ls``)."""
        if self.pid is not None:
            where = "" if self.host == socket.gethostname() else f" on {self.host}"
            return f"process {self.pid}{where}"
        if self.name.startswith("slurm-job-"):
            return f"slurm job {self.name.removeprefix('slurm-job-')}"
        return "named, until release"

    def alive(self, now: float | None = None) -> bool:
        if self.expires is not None and (now or time.time()) > self.expires:
            return False
        if self.pid is None or self.host != socket.gethostname():
            return True
        return procid.alive(self.pid, self.pid_start)


def default_lease_name(env: dict[str, str] | None = None) -> str | None:
    """The CLI's named lease inside a Slurm job (``slurm-job-<id>``, dropped by the epilog); None outside one,
    where the CLI's lease is tied to its caller's process instead."""
    env = dict(os.environ) if env is None else env
    if env.get("SLURM_JOB_ID"):
        return f"slurm-job-{env['SLURM_JOB_ID']}"
    return None


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UsageError(f"bad lease name {name!r}: use letters, digits and ._@+- (at most 128)")
    return name


def take(ddir: DatasetDir, version: str, *, name: str | None = None, pid: int | None = None,
         ttl: float | None = None, renew: bool = False) -> Lease:
    """Record a lease on ``version``; a process lease when ``pid`` is given, else a named one.  ``renew``: a
    process lease ``pid`` already holds on ``version`` is returned instead of a new one (the CLI's lease for its
    caller: a shell that stages 36 times holds one lease, not 36)."""
    from .layout import current_user

    if name is None:
        if pid is None:
            raise UsageError("a lease needs a name or a pid")
        name = f"pid-{socket.gethostname()}-{pid}-{secrets.token_hex(3)}"
    now = time.time()
    start = procid.start_time(pid) if pid is not None else None
    if renew and pid is not None and ttl is None:
        for held in live(ddir):  # the same process staging the same version again: renew its lease
            if (held.pid, held.pid_start, held.host, held.version) == (pid, start, socket.gethostname(), version) \
                    and held.expires is None:
                return held
    lease = Lease(check_name(name), version, current_user(), socket.gethostname(), now, pid, start,
                  now + ttl if ttl else None)
    ddir.leases.mkdir(mode=0o755, exist_ok=True)
    trust.check_folder(ddir.leases, owners=trust.trusted_owners(), what="lease folder")
    atomic_write(ddir.leases / f"{lease.name}.json", json.dumps(asdict(lease)).encode())
    return lease


def release(ddir: DatasetDir, name: str) -> bool:
    """Drop a lease; True if it existed.  Never through a link in place of ``leases/``."""
    st = trust.lstat(ddir.leases)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    try:
        (ddir.leases / f"{check_name(name)}.json").unlink()
        return True
    except FileNotFoundError:
        return False


def caller_chain(pid: int) -> frozenset[tuple[int, int]]:
    """``pid`` and its ancestors up to (not including) init, as (pid, start time): the processes whose leases
    are the caller's (a ``release`` from a subshell of the script that staged finds the script's lease)."""
    chain: set[tuple[int, int]] = set()
    while pid > 1 and len(chain) < 64:
        st = procid.running(pid)
        if st is None:
            break
        chain.add((pid, st.start))
        pid = st.ppid
    return frozenset(chain)


def is_callers(lease: Lease, *, chain: frozenset[tuple[int, int]], names: frozenset[str]) -> bool:
    """Is ``lease`` the caller's: one of ``names`` (``--lease``, the Slurm job's), or held by a process of
    ``chain`` (:func:`caller_chain`) on this host?"""
    if lease.name in names:
        return True
    return lease.pid is not None and lease.host == socket.gethostname() and (lease.pid, lease.pid_start) in chain


def release_callers(ddir: DatasetDir, *, chain: frozenset[tuple[int, int]], names: frozenset[str]
                    ) -> tuple[list[Lease], list[Lease]]:
    """Drop the caller's leases on ``ddir`` and the stale ones: (the caller's dropped, the stale dropped)."""
    stale: list[Lease] = []
    mine = [lease for lease in live(ddir, stale) if is_callers(lease, chain=chain, names=names)]
    return [lease for lease in mine if release(ddir, lease.name)], stale


def drop_stale(ddir: DatasetDir) -> list[Lease]:
    """Remove the leases whose holder has ended (or that expired); those removed."""
    gone: list[Lease] = []
    live(ddir, gone)
    return gone


def live(ddir: DatasetDir, stale_dropped: list[Lease] | None = None) -> list[Lease]:
    """The leases still in force, oldest first; stale ones are removed on the way (and added to
    ``stale_dropped``)."""
    held: list[Lease] = []
    for lease, path, alive in _entries(ddir):
        if alive:
            held.append(lease)
            continue
        try:
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue
        if stale_dropped is not None:
            stale_dropped.append(lease)
    return held


def scan(ddir: DatasetDir) -> tuple[list[Lease], list[Lease]]:
    """The leases in force and the stale ones (holder gone, or expired), oldest first; nothing is removed."""
    entries = _entries(ddir)
    return [e[0] for e in entries if e[2]], [e[0] for e in entries if not e[2]]


def _entries(ddir: DatasetDir) -> list[tuple[Lease, str, bool]]:
    """Each lease file this version can read: (lease, its path, alive?), oldest first.  Never through a link."""
    out: list[tuple[Lease, str, bool]] = []
    now = time.time()
    st = trust.lstat(ddir.leases)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return out  # never through a link (DatasetDir.check names it)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(ddir.leases):
            if not entry.name.endswith(".json") or entry.name.startswith("."):
                continue
            try:
                lease = Lease(**json.loads(trust.read_small(entry.path)))
            except (OSError, ValueError, TypeError):
                continue
            out.append((lease, entry.path, lease.alive(now)))
    return sorted(out, key=lambda e: e[0].created if isinstance(e[0].created, (int, float)) else 0.0)
