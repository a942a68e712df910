"""Leases: who uses which version of a staged dataset.  Eviction never removes a leased version.

Each run of ``stage`` holds its own lease, a small JSON file under ``<dataset>/leases/``:

- tied to a *process*: ``stagingloader.stage()`` in a training script holds one for its own process;
  the CLI's ``stage`` (which exits right after staging, while the job that called it reads on) holds
  one for its caller, the job script or shell.  A process is its pid *and* its start time (from
  ``/proc/PID/stat``, :mod:`..procid`), so a pid reused by another process does not keep the lease alive; a
  process lease on this host whose process has ended (a zombie has) is stale and removed when seen;
- *named*: ``slurm-job-<id>`` inside a Slurm job (dropped by the epilog), or ``--lease NAME``, held
  until ``stagingloader release``.
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
from pathlib import Path

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
         ttl: float | None = None) -> Lease:
    """Record a lease on ``version``; a process lease when ``pid`` is given, else a named one."""
    from .layout import current_user

    if name is None:
        if pid is None:
            raise UsageError("a lease needs a name or a pid")
        name = f"pid-{socket.gethostname()}-{pid}-{secrets.token_hex(3)}"
    now = time.time()
    lease = Lease(check_name(name), version, current_user(), socket.gethostname(), now, pid,
                  procid.start_time(pid) if pid is not None else None, now + ttl if ttl else None)
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


def release_held_by(ddir: DatasetDir, pid: int) -> list[str]:
    """Drop the leases this host's process ``pid`` (the one running now: same start time) holds; their names."""
    start = procid.start_time(pid)
    dropped = []
    for lease in live(ddir):
        if lease.pid == pid and lease.pid_start == start and lease.host == socket.gethostname() \
                and release(ddir, lease.name):
            dropped.append(lease.name)
    return dropped


def live(ddir: DatasetDir) -> list[Lease]:
    """The leases still in force; stale ones are removed on the way."""
    out: list[Lease] = []
    now = time.time()
    st = trust.lstat(ddir.leases)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return out  # never through a link (DatasetDir.check names it)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(ddir.leases):
            if not entry.name.endswith(".json"):
                continue
            try:
                lease = Lease(**json.loads(Path(entry.path).read_text()))
            except (OSError, ValueError, TypeError):
                continue
            if lease.alive(now):
                out.append(lease)
            else:
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    os.unlink(entry.path)
    return out
