"""The trail root owns: one JSON line of figures per job per node, and per-job logs that do not pile up for ever.

- **The trail** (site config ``trail``; default ``<log_dir>/trail.jsonl``): the epilog appends one line per job
  that asked for staging on this node: its job id, user, node, status (and why it failed), and per dataset the
  source, tier, time, files, bytes copied and reused; then the bytes the user's staged copies take on each tier.
  Appended with ``O_APPEND | O_NOFOLLOW`` in a single ``write``, so the lines of concurrent epilogs never
  interleave; only to a plain file root owns that nobody else may write (created 0640).  A link, a FIFO or a file of
  anyone else's in its place is refused, named, and left alone: the figures go to the node's log instead.
- **Retention** (site config ``log_retention_days``): the epilog removes the per-job logs of ``log_dir``
  (``<id>.log``, and the users' copies ``users/<user>/<id>.log``) last changed more than that many days ago: only
  root's own plain files, found through folder descriptors opened without following a link.  The node's log and
  the trail are never removed here (logrotate's business).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CacheError
from . import rootsafe
from .config import SiteConfig
from .identity import JobUser
from .jobstate import JobLog

TRAIL_MODE = 0o640
JOB_LOG = re.compile(r"^\d+\.log$")  #: a per-job log: ``<job id>.log``
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NUMBERS = ("seconds", "files", "bytes", "copied_bytes", "reused_bytes")


# ---- what the epilog does --------------------------------------------------------------------------------------
def record_job(cfg: SiteConfig, job: str, user: JobUser, record: dict[str, Any], say: JobLog,
               deadline: float) -> None:
    """Append the job's line to the site's trail (if it keeps one); a refused trail is told to the node's log."""
    path = cfg.trail_path()
    if path is None:
        return
    used: dict[str, int] = {}
    for kind, root in sorted(cfg.roots.items()):
        n = used_bytes(cfg.path(root) / "users" / user.name, deadline)
        if n is not None:
            used[kind] = n
    line = figures(job=job, user=user.name, uid=user.uid, node=say.node, record=record, used=used, when=time.time())
    try:
        append(path, line)
    except (OSError, CacheError) as e:
        say.problem(f"{e}; the job's figures: {_json(line)}")


def retain(cfg: SiteConfig, say: JobLog, deadline: float) -> None:
    """With ``log_retention_days``: remove the per-job logs older than that (:func:`prune_logs`)."""
    if cfg.log_retention_days is not None:
        prune_logs(cfg.path(cfg.log_dir), cfg.log_retention_days, now=time.time(), deadline=deadline, say=say)


# ---- the figures (pure) ----------------------------------------------------------------------------------------
def figures(*, job: str, user: str, uid: int, node: str, record: dict[str, Any], used: dict[str, int],
            when: float) -> dict[str, Any]:
    """The trail's line for a job, from root's record of it (what the prolog's stager wrote) and the bytes the user's
    copies take per tier (``used``)."""
    datasets = []
    for d in record.get("datasets", []):
        if not isinstance(d, dict):
            continue
        entry: dict[str, Any] = {"src": str(d.get("src", "")), "shared": d.get("shared") is True,
                                 "tier": d.get("tier"), "state": str(d.get("state", ""))}
        entry.update({k: d[k] for k in _NUMBERS if isinstance(d.get(k), (int, float))})
        if d.get("streaming"):
            entry["streaming"] = True
        if d.get("reason"):
            entry["reason"] = str(d["reason"])[:500]
        datasets.append(entry)
    state = str(record.get("state", "unknown"))
    status = "stopped: the job ended while it staged" if state == "staging" else state
    line: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when)), "job": job,
                            "user": user, "uid": uid, "node": node, "status": status}
    if record.get("reason"):
        line["reason"] = str(record["reason"])[:1000]
    for key in _NUMBERS:
        values = [d[key] for d in datasets if key in d]
        if values:
            line[key] = round(sum(values), 3) if key == "seconds" else sum(values)
    line["datasets"] = datasets
    line["used_bytes"] = used
    return line


# ---- the file ---------------------------------------------------------------------------------------------------
def append(path: Path, line: dict[str, Any]) -> None:
    """Append ``line`` as one JSON line to the trail at ``path``, in one ``write``.

    Raises :class:`CacheError` naming the path and the fix when the trail, or its folder, is not root's alone (a
    link, a FIFO, a file of another user's or one others may write, a second name of another file)."""
    folder = rootsafe.make_trusted_dir(path.parent, 0o755)
    dfd = os.open(folder, _DIR)
    try:
        fd = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     TRAIL_MODE, dir_fd=dfd)
    except OSError as e:  # ELOOP: a link; ENXIO: a FIFO nobody reads; EISDIR...
        raise CacheError(f"the trail {path} is {rootsafe.describe(path)} ({e.strerror}): not written; remove it "
                         "(the epilog creates a new one, root's, 0640)") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        problem = _not_roots(st)
        if problem:
            raise CacheError(f"the trail {path} {problem}: not written, so nothing of it can be trusted; move it "
                             "aside (the epilog creates a new one, root's, 0640)")
        data = (_json(line) + "\n").encode("utf-8", "replace")
        written = os.write(fd, data)  # one write: O_APPEND puts it whole at the end, whatever other epilogs do
        if written != len(data):
            raise OSError(f"the trail {path}: wrote {written} of {len(data)} bytes (is its file system full?)")
    finally:
        os.close(fd)


def _json(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"), default=str)


def _not_roots(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a plain file"
    if st.st_uid != os.geteuid():
        return f"belongs to {rootsafe.owner(st.st_uid)}, not to root"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} names (a hard link to another file)"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check(path: Path) -> str | None:
    """Why the epilog would refuse the trail at ``path`` as it is now (None: it would append, or create it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be looked at ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"is {rootsafe.describe(path)}"
    return _not_roots(st)


# ---- what a user's copies take -------------------------------------------------------------------------------
def used_bytes(folder: Path, deadline: float) -> int | None:
    """The bytes (blocks) of the files under ``folder``, walked by descriptors opened without following a link
    (a link a user plants in her folder is counted as itself); None when it is not a folder or time runs out."""
    try:
        top = os.open(folder, _DIR)
    except OSError:
        return None
    total, stack = 0, [top]
    try:
        while stack:
            if time.monotonic() > deadline:
                return None
            fd = stack.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        with contextlib.suppress(OSError):
                            st = entry.stat(follow_symlinks=False)
                            if stat.S_ISDIR(st.st_mode):
                                stack.append(os.open(entry.name, _DIR, dir_fd=fd))
                            else:
                                total += st.st_blocks * 512
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return total


# ---- retention --------------------------------------------------------------------------------------------------
def prune_logs(log_dir: Path, days: float, *, now: float, deadline: float,
               say: Callable[[str], None] | None = None, dry_run: bool = False) -> list[str]:
    """Remove the per-job logs in ``log_dir`` and its ``users/<user>/`` folders last changed more than ``days`` ago:
    root's own plain files named ``<id>.log`` only, never through a link.  The paths removed (``dry_run``: that
    would be, removing nothing)."""
    cutoff = now - days * 86400
    removed: list[str] = []
    try:
        top = os.open(log_dir, _DIR)
    except OSError:
        return removed
    try:
        if not _roots_folder(os.fstat(top)):
            return removed
        removed += _prune_in(top, log_dir, cutoff, deadline, dry_run)
        try:
            users = os.open("users", _DIR, dir_fd=top)
        except OSError:
            return removed
        try:
            if not _roots_folder(os.fstat(users)):
                return removed
            for entry in os.scandir(users):
                if time.monotonic() > deadline:
                    break
                with contextlib.suppress(OSError):
                    ufd = os.open(entry.name, _DIR, dir_fd=users)
                    try:
                        removed += _prune_in(ufd, log_dir / "users" / entry.name, cutoff, deadline, dry_run)
                    finally:
                        os.close(ufd)
        finally:
            os.close(users)
    finally:
        os.close(top)
    if removed and say is not None and not dry_run:
        say(f"removed {len(removed)} job log(s) older than {days:g} days (log_retention_days)")
    return removed


def _roots_folder(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _prune_in(dfd: int, where: Path, cutoff: float, deadline: float, dry_run: bool) -> list[str]:
    removed = []
    with os.scandir(dfd) as entries:
        names = [e.name for e in entries if JOB_LOG.match(e.name)]
    for name in names:
        if time.monotonic() > deadline:
            break
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
                    and st.st_mtime < cutoff):
                if not dry_run:
                    os.unlink(name, dir_fd=dfd)
                removed.append(str(where / name))
    return removed
