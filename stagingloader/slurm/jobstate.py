"""What the hooks keep per job: root's record, the job's copy of it, and the job's log.

- **Root's record**, ``<state_dir>/root/job-<id>.json`` (root, 0600, in a 0700 folder): what the
  epilog acts on (the supervisor's pid and start time, the datasets and the folders they went to).
  No user can write it, so nothing a user writes decides what root signals, releases or evicts.
- **The job's copy**, ``<state_dir>/job-<id>.json`` (owned by the job's user, 0600): what the task
  prolog (running as the user) turns into ``STAGINGLOADER_*`` variables.  Root writes it and never
  reads it back.
- **The job's log**, ``<log_dir>/<id>.log`` (owned by the job's user, 0600), appended to by root.

``state_dir`` and ``log_dir`` must be folders only root can change (checked every time, see
:mod:`.rootsafe`); every file in them is opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import CacheError
from . import config as site_config
from . import rootsafe
from .identity import JobUser

log = logging.getLogger(__name__)


class JobLog:
    """``<log_dir>/<jobid>.log``: one per job and node folder, owned by the job's user so they can read it."""

    def __init__(self, cfg: site_config.SiteConfig, job: str, hook: str, user: JobUser | None) -> None:
        self.hook = hook
        self.node = cfg.node or socket.gethostname()
        self.file: TextIO | None = None
        try:
            d = rootsafe.make_trusted_dir(cfg.path(cfg.log_dir), 0o755)
            path = d / f"{job}.log"
            owners = {os.geteuid()} | ({user.uid} if user is not None else set())
            try:
                fd = rootsafe.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                if os.fstat(fd).st_uid not in owners:  # an older job's (a job id reused): not this user's to read
                    os.close(fd)
                    raise CacheError(f"{path} belongs to another job")
            except CacheError:  # not a plain file of this job: root's folder, so root may replace it
                path.unlink()
                fd = rootsafe.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
            if user is not None and os.geteuid() == 0:
                os.fchown(fd, user.uid, user.gid)
            self.file = os.fdopen(fd, "a", buffering=1)
        except (OSError, CacheError) as e:
            log.error("stagingloader %s: no job log in %s: %s", hook, cfg.log_dir, e)

    def __call__(self, text: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {self.node} {self.hook}[{os.getpid()}]: {text}"
        log.info("%s", line)
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.write(line + "\n")

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


def state_dir(cfg: site_config.SiteConfig) -> Path:
    """The checked state folder (raises :class:`CacheError` when a user could change it)."""
    return rootsafe.make_trusted_dir(cfg.path(cfg.state_dir), 0o755)


def view_path(cfg: site_config.SiteConfig, job: str) -> Path:
    return cfg.path(cfg.state_dir) / f"job-{job}.json"


def record_path(cfg: site_config.SiteConfig, job: str) -> Path:
    return cfg.path(cfg.state_dir) / "root" / f"job-{job}.json"


def _write(path: Path, data: bytes, owner: JobUser | None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = rootsafe.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        if owner is not None and os.geteuid() == 0:
            os.fchown(fd, owner.uid, owner.gid)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_status(cfg: site_config.SiteConfig, job: str, user: JobUser | None, status: dict[str, Any]) -> None:
    """Root's record (what the epilog acts on), then the job's copy (what the task prolog reads)."""
    d = state_dir(cfg)
    rootsafe.make_trusted_dir(d / "root", 0o700)
    record = {**status, "uid": user.uid if user is not None else None}  # whose job: job ids can come back
    _write(record_path(cfg, job), json.dumps(record, indent=1).encode(), None)
    view = {k: v for k, v in status.items() if k != "supervisor"}
    _write(view_path(cfg, job), json.dumps(view, indent=1).encode(), user)


def read_record(cfg: site_config.SiteConfig, job: str) -> dict[str, Any] | None:
    """Root's record of a job, only from a plain file in the checked folder that root owns and wrote."""
    try:
        rootsafe.make_trusted_dir(state_dir(cfg) / "root", 0o700)
        fd = rootsafe.open_file(record_path(cfg, job), os.O_RDONLY)
    except (OSError, CacheError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read(1 << 20))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def read_view(cfg: site_config.SiteConfig, job: str) -> dict[str, Any] | None:
    """The job's copy, for the task prolog (running as the job's user: it reads only what it may)."""
    try:
        data = json.loads(view_path(cfg, job).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def remove(cfg: site_config.SiteConfig, job: str) -> None:
    for p in (view_path(cfg, job), record_path(cfg, job)):
        with contextlib.suppress(OSError):
            p.unlink()
