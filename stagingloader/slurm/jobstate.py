"""What the hooks keep per job: root's record, the job's view of it, root's log and the job's copy of the log.

Every file here is root's: root-owned, not writable by the job's user, written by root (issue 23).

- **Root's record**, ``<state_dir>/root/job-<id>.json`` (0600, in a 0700 folder): what the epilog acts on (the
  supervisor's pid and start time, the datasets and the folders they went to).
- **The job's view**, ``<state_dir>/users/<user>/job-<id>.json`` (root's, 0644) in a folder of the user's own
  (0700: nobody else can read it): what the task prolog (running as the user) turns into ``STAGINGLOADER_*``
  variables.  It names its job and user; the task prolog reads it only while it is a plain file root owns with
  this job's id and this user's uid (a file she put there, or a view she kept back from another job, is not).
  Root writes it and never reads it back.
- **Root's log**, ``<log_dir>/<id>.log`` (0600), and **the job's copy**, ``<log_dir>/users/<user>/<id>.log``
  (root's, 0644, in her 0700 folder): the same lines, appended by root to both.
- **The node's log**, ``<log_dir>/stagingloader.log`` (0600): one line per problem an admin should see (a broken
  site config, a failed stage, a refusal), also written to slurmd's log at level ``error``.

``state_dir`` and ``log_dir`` must be folders only root can change (checked every time, see :mod:`.rootsafe`).
Files in root's folders are opened with ``O_NOFOLLOW``; in the user's folders through a descriptor of the
folder, and only root's own plain files are appended to or kept (:func:`.rootsafe.append_in`).  So she can
neither grow root's files nor write on through a descriptor kept open: she never has one that writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import CacheError
from . import config as site_config
from . import rootsafe
from .identity import JobUser

log = logging.getLogger(__name__)


NODE_LOG = "stagingloader.log"


def node_log(cfg: site_config.SiteConfig, text: str, *, slurmd_log: str | None = None) -> None:
    """A problem for the admin: a line in root's node log (``<log_dir>/stagingloader.log``) and, at level ``error``,
    in slurmd's log file (``slurmd_log``; else syslog), where the default ``SlurmdDebug`` shows it."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    node = cfg.node or socket.gethostname()
    with contextlib.suppress(OSError):  # and on stderr, which slurmd keeps too (at its debug levels)
        print(f"stagingloader: {text}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError, CacheError):
        d = rootsafe.make_trusted_dir(cfg.path(cfg.log_dir), 0o755)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = rootsafe.append_in(dfd, NODE_LOG, 0o600)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "a") as f:
            f.write(f"{stamp} {node} {text}\n")
    line = f"[{stamp}.000] error: {text}\n"
    if slurmd_log is not None:
        with contextlib.suppress(OSError, CacheError):  # slurmd's own file: a plain file root owns, never a link
            fd = rootsafe.open_file(Path(slurmd_log), os.O_WRONLY | os.O_APPEND)
            try:
                if os.fstat(fd).st_uid == os.geteuid():
                    os.write(fd, line.encode("utf-8", "replace"))
                    return
            finally:
                os.close(fd)
    with contextlib.suppress(OSError):
        import syslog

        syslog.openlog("stagingloader", 0, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_ERR, text)


class JobLog:
    """Root's log of a job (``<log_dir>/<id>.log``) and the job's copy in the user's own folder, one line per event;
    :meth:`problem` also tells the node's log and slurmd's."""

    def __init__(self, cfg: site_config.SiteConfig, job: str, hook: str, user: JobUser | None, *,
                 slurmd_log: str | None = None) -> None:
        self.hook = hook
        self.cfg, self.job, self.slurmd_log = cfg, job, slurmd_log
        self.node = cfg.node or socket.gethostname()
        self.file: TextIO | None = None  #: root's log (the supervisor's stdout and stderr too)
        self.copy: TextIO | None = None  #: the job's copy, for its user
        try:
            d = rootsafe.make_trusted_dir(cfg.path(cfg.log_dir), 0o755)
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                self.file = os.fdopen(rootsafe.append_in(dfd, f"{job}.log", 0o600), "a", buffering=1)
            finally:
                os.close(dfd)
        except (OSError, CacheError) as e:
            log.error("stagingloader %s: no job log in %s: %s", hook, cfg.log_dir, e)
            return
        if user is None or os.geteuid() != 0:
            return
        try:
            users = rootsafe.make_trusted_dir(d / "users", 0o755)
            ufd = rootsafe.user_dir(users / user.name, user.uid, user.gid)
            try:
                self.copy = os.fdopen(rootsafe.append_in(ufd, f"{job}.log", 0o644), "a", buffering=1)
            finally:
                os.close(ufd)
        except (OSError, CacheError) as e:
            self(f"no copy of this log for {user.name}: {e}")

    def __call__(self, text: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {self.node} {self.hook}[{os.getpid()}]: {text}"
        log.info("%s", line)
        for f in (self.file, self.copy):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.write(line + "\n")

    def problem(self, text: str) -> None:
        """A failure or a refusal: in the job's log (and her copy), the node's log and slurmd's log."""
        self(text)
        node_log(self.cfg, f"stagingloader {self.hook}: job {self.job}: {text}", slurmd_log=self.slurmd_log)

    def close(self) -> None:
        for f in (self.file, self.copy):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def state_dir(cfg: site_config.SiteConfig) -> Path:
    """The checked state folder (raises :class:`CacheError` when a user could change it)."""
    return rootsafe.make_trusted_dir(cfg.path(cfg.state_dir), 0o755)


def view_path(cfg: site_config.SiteConfig, job: str, user: JobUser) -> Path:
    return cfg.path(cfg.state_dir) / "users" / user.name / f"job-{job}.json"


def record_path(cfg: site_config.SiteConfig, job: str) -> Path:
    return cfg.path(cfg.state_dir) / "root" / f"job-{job}.json"


def _write(folder: Path, name: str, data: bytes, mode: int) -> None:
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        rootsafe.write_in(dfd, name, data, mode)
    finally:
        os.close(dfd)


def write_status(cfg: site_config.SiteConfig, job: str, user: JobUser | None, status: dict[str, Any]) -> None:
    """Root's record (what the epilog acts on), then the job's view (what the task prolog reads)."""
    d = state_dir(cfg)
    folder = rootsafe.make_trusted_dir(d / "root", 0o700)
    record = {**status, "uid": user.uid if user is not None else None}  # whose job: job ids can come back
    _write(folder, f"job-{job}.json", json.dumps(record, indent=1).encode(), 0o600)
    if user is None or os.geteuid() != 0:
        return
    view = {"job": job, "uid": user.uid, **{k: v for k, v in status.items() if k != "supervisor"}}
    try:
        users = rootsafe.make_trusted_dir(d / "users", 0o755)
        ufd = rootsafe.user_dir(users / user.name, user.uid, user.gid)
        try:
            rootsafe.write_in(ufd, f"job-{job}.json", json.dumps(view, indent=1).encode(), 0o644)
        finally:
            os.close(ufd)
    except (OSError, CacheError) as e:  # her folder is not usable (she made it a link...): her job goes without
        log.warning("stagingloader: job %s: no status for %s in %s: %s", job, user.name, d / "users", e)


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


def read_view(cfg: site_config.SiteConfig, job: str, user: JobUser) -> dict[str, Any] | None:
    """The job's view, for the task prolog (running as the job's user): only what root wrote for this job and
    this user (a plain file root owns, naming both); None for anything else."""
    raw = rootsafe.read_roots(view_path(cfg, job, user))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("job") != job or data.get("uid") != user.uid:
        return None  # another job's, kept back: stale
    return data


def remove(cfg: site_config.SiteConfig, job: str, user: JobUser | None) -> None:
    """Drop root's record and the job's view (the logs stay)."""
    with contextlib.suppress(OSError):
        record_path(cfg, job).unlink()
    if user is None:
        return
    try:
        ufd = os.open(view_path(cfg, job, user).parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(ufd).st_uid == user.uid:
            with contextlib.suppress(OSError):
                rootsafe.remove_in(ufd, f"job-{job}.json")
    finally:
        os.close(ufd)
