"""Acting as the job's user.  The hooks run as root; everything that reads a source, or touches a
folder a user owns, runs in a child process that has dropped to the job's uid, gid and groups.

Why a child process and not ``seteuid`` in the hook: a dropped *effective* uid can be regained,
threads share it, and a bug in the copy path would then run as root.  The child (``python -m
stagingloader.slurm.worker``) gets its identity from ``subprocess`` (setgroups, setgid, setuid, in
that order, before ``exec``), a minimal environment, ``/`` as working directory, a JSON request
on stdin, and answers one JSON document on stdout.  So the kernel checks every source read
against the user's own permissions, and files it stages are the user's.  The root side only
creates folders in root-owned parents, and never follows a link a user could plant.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError


@dataclass(frozen=True)
class JobUser:
    uid: int
    gid: int
    name: str
    home: str = "/"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobUser:
        try:
            uid = int(env["SLURM_JOB_UID"])
        except (KeyError, ValueError):
            raise UsageError("SLURM_JOB_UID is missing: is this running as a Slurm prolog?") from None
        try:
            pw = pwd.getpwuid(uid)
            name, gid, home = pw.pw_name, pw.pw_gid, pw.pw_dir
        except KeyError:
            name, gid, home = env.get("SLURM_JOB_USER", str(uid)), uid, "/"
        if env.get("SLURM_JOB_GID", "").isdigit():
            gid = int(env["SLURM_JOB_GID"])
        name = env.get("SLURM_JOB_USER") or name
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise UsageError(f"SLURM_JOB_USER={name!r} cannot name a folder")  # it becomes ROOT/users/<name>
        return cls(uid, gid, name, home)

    def groups(self) -> list[int]:
        try:
            return sorted(set(os.getgrouplist(self.name, self.gid)))
        except (KeyError, OSError):
            return [self.gid]


# The worker runs this hook's own stagingloader (appended to sys.path: where the interpreter finds one
# first, a venv's, that one wins; an editable or source checkout runs itself, not another install).
_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER_MAIN = (f"import sys; sys.path.append({_HERE!r}); "
                "from stagingloader.slurm.worker import main; sys.exit(main())")


def run_worker(op: dict[str, Any], user: JobUser | None, *, python: str | None = None,
               timeout: float | None = None) -> dict[str, Any]:
    """Run one worker operation as ``user`` (None: as root) and return its JSON answer."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": user.home if user else "/root",
           "USER": user.name if user else "root", "LOGNAME": user.name if user else "root"}
    kwargs: dict[str, Any] = {}
    if user is not None and user.uid != os.geteuid():
        kwargs = {"user": user.uid, "group": user.gid, "extra_groups": user.groups()}
    try:
        proc = subprocess.run([python or sys.executable, "-c", _WORKER_MAIN],
                              input=json.dumps(op), capture_output=True, text=True, env=env, cwd="/",
                              timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "Timeout", "message": f"the stager took longer than {timeout:.0f}s"}
    except OSError as e:
        return {"ok": False, "error": "WorkerError", "message": f"cannot start the stager as {user}: {e}"}
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        if not isinstance(answer, dict):
            raise ValueError(answer)
        return answer
    except (ValueError, IndexError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"ok": False, "error": "WorkerError",
                "message": f"the stager exited with status {proc.returncode}: {' | '.join(tail) or 'no output'}"}
