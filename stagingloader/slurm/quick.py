"""The hooks' first look: does this job give them anything to do?  Standard library only.

Every job runs the prolog and the epilog on each of its nodes, and the task prolog before each task, whether it
asks for staging or not.  So each hook first decides, from the environment and a few ``lstat`` calls, whether
there is work; a job with none costs an interpreter start, not stagingloader's imports (issue 29: each hook of
such a job exits within 50 ms).  There is work when:

- **prolog**: the job's comment asks for staging (``stage=`` or ``stage-spec=``);
- **task prolog**: the comment asks, or root left this job a status (the job's view);
- **epilog**: root kept a record of the job, or a dataset on this node holds the job's lease ``slurm-job-<id>``
  (taken in a job step: ``srun stagingloader stage SRC`` inside the job), found by :func:`job_lease_roots`.

Nothing here acts: it only looks, never following a link, and what it finds in a user's folder is a hint that the
epilog acts on *as that user* (:mod:`.worker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import socket
import stat
from collections.abc import Mapping

from .request import is_request

#: the folders the CLI's ``--root auto`` may pick on a node, each with ``stagingloader-<user>`` in it (see
#: :func:`..cache.capacity.auto_candidates`; $TMPDIR and $SLURM_TMPDIR are the job's and found in its registry)
AUTO_PARENTS = ("/dev/shm", "/local_scratch", "/scratch_local", "/lscratch", "/local/scratch", "/mnt/local_scratch",
                "/tmp")
MAX_REGISTRY_BYTES = 64 * 1024


def _real_dir(path: str, uid: int | None = None) -> bool:
    """A folder (not a link to one), owned by ``uid`` when given."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid)


def registry_roots(home: str, uid: int) -> list[str]:
    """The roots the user's own registry (``~/.local/state/stagingloader/roots-<host>.json``, the CLI's list of
    roots it staged into on this host) names: read only from a plain file she owns, never through a link."""
    path = os.path.join(home, ".local", "state", "stagingloader", f"roots-{socket.gethostname()}.json")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return []
        names = json.loads(os.read(fd, MAX_REGISTRY_BYTES))
    except (OSError, ValueError):
        return []
    finally:
        os.close(fd)
    return [n for n in names if isinstance(n, str) and n.startswith("/")] if isinstance(names, list) else []


def candidate_roots(site_private: list[str], user: str, uid: int, home: str) -> list[str]:
    """Where a job step of this user may have staged on this node: the site's private folders, ``--root auto``'s
    folders and the roots of the user's registry; only real folders the user owns (a link is never looked into)."""
    out = list(site_private) + [os.path.join(p, f"stagingloader-{user}") for p in AUTO_PARENTS]
    out += registry_roots(home, uid)
    seen: list[str] = []
    for p in out:
        p = os.path.normpath(p)
        if p not in seen and _real_dir(p, uid):
            seen.append(p)
    return seen


def job_lease_roots(roots: list[str], job: str) -> list[str]:
    """Those of ``roots`` holding a dataset with the lease ``slurm-job-<job>`` (``lstat`` only: a dataset folder,
    its ``leases`` folder and the lease file are each checked not to be a link)."""
    name = f"slurm-job-{job}.json"
    found = []
    for root in roots:
        with contextlib.suppress(OSError):
            for entry in os.scandir(root):
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                leases = os.path.join(entry.path, "leases")
                if _real_dir(leases):
                    with contextlib.suppress(OSError):
                        if stat.S_ISREG(os.lstat(os.path.join(leases, name)).st_mode):
                            found.append(root)
                            break
    return found


def job_user(env: Mapping[str, str]) -> tuple[str, int, str] | None:
    """The job's user as (name, uid, home), or None when the environment does not say."""
    uid_text = env.get("SLURM_JOB_UID", "")
    if not uid_text.isdigit():
        return None
    try:
        pw = pwd.getpwuid(int(uid_text))
        name, home = pw.pw_name, pw.pw_dir
    except KeyError:
        name, home = "", "/"
    return env.get("SLURM_JOB_USER") or name, int(uid_text), home


def nothing_to_do(hook: str, env: Mapping[str, str]) -> bool:
    """True when ``hook`` (prolog, epilog, task-prolog) surely has nothing to do for this job; False when it may
    (then the hook runs in full, and reports any problem, a broken site config included)."""
    if is_request(env.get("SLURM_JOB_COMMENT")):
        return False
    if hook == "prolog":
        return True
    job = env.get("SLURM_JOB_ID", "")
    user = job_user(env)
    if not job.isdigit() or user is None or not user[0] or "/" in user[0]:
        return False  # let the hook say what is wrong
    from .config import peek  # standard library and this package's light modules only

    cfg = peek(env)
    if cfg is None:
        return False  # no readable config: the hook reports it
    state = cfg.path(cfg.state_dir)
    if hook == "task-prolog":
        return not os.path.lexists(state / "users" / user[0] / f"job-{job}.json")
    if hook != "epilog":
        return False
    if os.path.lexists(state / "root" / f"job-{job}.json"):
        return False
    private = [str(cfg.path(r) / "users" / user[0]) for r in cfg.roots.values()]
    return not job_lease_roots(candidate_roots(private, user[0], user[1], user[2]), job)
