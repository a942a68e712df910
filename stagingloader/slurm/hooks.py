"""The Slurm hooks: ``prolog`` and ``epilog`` (root, on every node of the job) and ``task-prolog``
(the job's user, before each task; what it prints as ``export NAME=value`` enters the job).

The rule that shapes them: a non-zero prolog exit, or a timeout, drains the node.  So a user's
problem (bad request, unreadable or unreachable source, no space, checksum mismatch) exits 0 with
the failure recorded for the job; only a broken node (staging root missing or read-only) exits
non-zero.  The prolog stages in a detached supervisor process and waits for it at most
``budget_seconds``; past that it exits 0 and the supervisor finishes while the job starts (the
job's ``stagingloader.stage(SRC)`` waits on the dataset's lock).  Hooks never call scontrol.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from ..cache.capacity import check_root
from ..cache.housekeeping import gc
from ..cache.layout import DatasetDir
from ..cache.leases import release
from ..errors import RootError, StagingError, UsageError
from . import config as site_config
from .identity import JobUser, run_worker
from .nodelist import node_index
from .request import StageRequest, check_names, is_request, parse_comment, parse_spec

log = logging.getLogger(__name__)
SPEC_MAX_BYTES = 64 * 1024


class JobLog:
    """``<log_dir>/<jobid>.log``: one per job and node folder, owned by the job's user so they can read it."""

    def __init__(self, cfg: site_config.SiteConfig, job: str, hook: str, user: JobUser | None) -> None:
        self.hook = hook
        self.node = cfg.node or socket.gethostname()
        self.file: TextIO | None = None
        with contextlib.suppress(OSError):
            d = cfg.path(cfg.log_dir)
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(d / f"{job}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            if user is not None and os.geteuid() == 0:
                os.fchown(fd, user.uid, user.gid)
            self.file = os.fdopen(fd, "a", buffering=1)

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


# ---- the job's status, read by the task prolog ---------------------------------------------------
def status_path(cfg: site_config.SiteConfig, job: str) -> Path:
    return cfg.path(cfg.state_dir) / f"job-{job}.json"


def write_status(cfg: site_config.SiteConfig, job: str, user: JobUser | None, status: dict[str, Any]) -> None:
    """Atomically, in a root-owned folder, owned by (and private to) the job's user."""
    d = cfg.path(cfg.state_dir)
    d.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = d / f".job-{job}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        if user is not None and os.geteuid() == 0:
            os.fchown(fd, user.uid, user.gid)
        os.write(fd, json.dumps(status, indent=1).encode())
    finally:
        os.close(fd)
    os.replace(tmp, status_path(cfg, job))


def read_status(cfg: site_config.SiteConfig, job: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads(status_path(cfg, job).read_text()))
    except (OSError, ValueError):
        return None


# ---- requests ------------------------------------------------------------------------------------
def read_spec(path: str, user: JobUser) -> list[StageRequest]:
    """The spec file's requests, read *as the job's user* (root may not read an NFS home with
    root_squash; and a file the user cannot read must not be read for them)."""
    answer = run_worker({"op": "spec", "path": path, "max_bytes": SPEC_MAX_BYTES}, user, timeout=30)
    if not answer.get("ok"):
        raise UsageError(str(answer.get("message")))
    return parse_spec(str(answer["text"]), path)


def node_check(cfg: site_config.SiteConfig, kinds: set[str]) -> None:
    """Raise RootError if a staging root of these kinds is unusable: the node, not the job, is broken."""
    for kind in sorted(kinds):
        if kind != "auto" and kind not in cfg.roots:
            continue  # the job asked for a tier this site lacks: its problem, reported later
        for root in cfg.candidates(kind):
            check_root(root.parent)
            with contextlib.suppress(FileExistsError):
                os.mkdir(root, 0o755)
            check_root(root)


# ---- folders -------------------------------------------------------------------------------------
def _root_dir(path: Path, mode: int, uid: int, gid: int) -> Path:
    """Create (or check) a folder the hook relies on: a real folder, not a link, owned as expected."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
        os.chown(path, uid, gid, follow_symlinks=False)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise UsageError(f"{path} is not a folder owned by uid {uid}: refusing to use it (remove it)")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    return path


def prepare_roots(cfg: site_config.SiteConfig, req: StageRequest, user: JobUser, shared: bool) -> list[Path]:
    """The folders the worker may stage into: ``ROOT/shared`` or ``ROOT/users/<user>``.

    Raises RootError when a staging root's parent is missing or read-only: the node is broken.
    """
    out = []
    for root in cfg.candidates(req.root):
        check_root(root.parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o755)
        check_root(root)
        top = _root_dir(root, 0o755, 0, 0) if os.geteuid() == 0 else root
        if shared:
            out.append(_root_dir(top / "shared", 0o755, os.geteuid(), os.getegid()))
        else:
            users = _root_dir(top / "users", 0o755, os.geteuid(), os.getegid())
            out.append(_root_dir(users / user.name, 0o700, user.uid, user.gid))
    return out


# ---- prolog --------------------------------------------------------------------------------------
def _job(env: Mapping[str, str]) -> str:
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise UsageError("SLURM_JOB_ID is missing: run this from Slurm's Prolog/Epilog/TaskProlog")
    return job


def prolog(env: Mapping[str, str]) -> int:
    comment = env.get("SLURM_JOB_COMMENT", "")
    if not is_request(comment):
        return 0
    try:
        cfg = site_config.load(env)
        job, user = _job(env), JobUser.from_env(env)
    except UsageError as e:
        log.error("stagingloader prolog: %s", e)
        return 0
    say = JobLog(cfg, job, "prolog", user)
    try:
        return _prolog(env, cfg, job, user, comment, say)
    except Exception as e:  # never drain a node for something we did not foresee
        say(f"unexpected {type(e).__name__}: {e}; the job runs without staged data")
        with contextlib.suppress(Exception):
            write_status(cfg, job, user, {"state": "failed", "reason": f"internal error: {e}", "datasets": []})
        return 0
    finally:
        say.close()


def _prolog(env: Mapping[str, str], cfg: site_config.SiteConfig, job: str, user: JobUser, comment: str,
            say: JobLog) -> int:
    say(f"job {job} of {user.name} (uid {user.uid}) asks: {comment!r}")
    try:
        requests, spec = parse_comment(comment)
        node_check(cfg, {r.root for r in requests} | (set(cfg.roots) if spec else set()))
    except RootError as e:
        say(f"this node is broken: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"node problem: {e}", "datasets": []})
        return 1
    except UsageError as e:
        say(f"bad request: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"bad request: {e}", "datasets": []})
        return 0
    write_status(cfg, job, user, {"state": "staging", "datasets": [], "supervisor": None})
    pid = os.fork()
    if pid == 0:  # the supervisor: its own session, survives the prolog
        code = 0
        try:
            os.setsid()
            _detach_stdio(say)
            _supervise(env, cfg, job, user, requests, spec, say)
        except BaseException as e:
            code = 1
            with contextlib.suppress(BaseException):
                say(f"unexpected {type(e).__name__}: {e}")
                write_status(cfg, job, user, {"state": "failed", "reason": f"internal error: {e}", "datasets": []})
        finally:
            os._exit(code)
    deadline = time.monotonic() + cfg.budget_seconds
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            final = read_status(cfg, job) or {}
            say(f"prolog done: {final.get('state')}")
            return 0
        time.sleep(0.05)
    say(f"staging goes on past the prolog's budget of {cfg.budget_seconds:.0f}s in pid {pid}; "
        "the job's stagingloader.stage() waits for it")
    return 0


def _plan(env: Mapping[str, str], cfg: site_config.SiteConfig, user: JobUser, requests: list[StageRequest],
          spec: str | None) -> list[dict[str, Any]]:
    if spec is not None:
        requests = requests + read_spec(spec, user)
    if not requests:
        raise UsageError("the job comment asks for nothing to stage")
    plans = []
    for req in check_names(requests):
        shared = cfg.is_shared(req.src)
        shard = None
        if req.shard == "node":
            node, nodes = node_index(env.get("SLURM_NODELIST", cfg.node), cfg.node or socket.gethostname())
            shard = [node, nodes] if nodes > 1 else None
        plans.append({"request": req, "shared": shared, "shard": shard,
                      "roots": [str(p) for p in prepare_roots(cfg, req, user, shared)]})
    return plans


def _entry(plan: dict[str, Any], state: str, **extra: Any) -> dict[str, Any]:
    req: StageRequest = plan["request"]
    return {"src": req.src, "name": req.name, "shared": plan["shared"], "shard": plan["shard"],
            "roots": plan["roots"], "state": state, **extra}


def _detach_stdio(say: JobLog) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    out = say.file.fileno() if say.file is not None else null
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)


def _supervise(env: Mapping[str, str], cfg: site_config.SiteConfig, job: str, user: JobUser,
               requests: list[StageRequest], spec: str | None, say: JobLog) -> None:
    try:
        plans = _plan(env, cfg, user, requests, spec)
    except (UsageError, OSError) as e:  # RootError included: checked by the prolog, so a race or a tier
        say(f"bad request: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"bad request: {e}", "datasets": []})
        return
    # the supervisor records itself (not the prolog: it could overwrite a final status)
    write_status(cfg, job, user, {"state": "staging", "datasets": [_entry(p, "staging") for p in plans],
                                  "supervisor": os.getpid()})
    lease = f"slurm-job-{job}"
    results = []
    for plan in plans:
        req: StageRequest = plan["request"]
        t0 = time.monotonic()
        op = {"op": "stage", "src": req.src, "roots": plan["roots"], "lease": lease, "shard": plan["shard"],
              "shared": plan["shared"], "max_ram_fraction": cfg.max_ram_fraction, "lock_timeout": None}
        if plan["shared"]:
            answer = run_worker({"op": "access", "src": req.src}, user)
            if answer.get("ok"):
                answer = run_worker(op, None)
        else:
            answer = run_worker(op, user)
        seconds = time.monotonic() - t0
        if answer.get("ok"):
            say(f"staged {req.src}: {answer['files']} files, {answer['bytes']} bytes in {seconds:.1f}s "
                f"-> {answer['root']}")
            results.append(_entry(plan, "ok", **{k: answer[k] for k in ("root", "dataset_dir", "version",
                                                                        "staging_root", "lease")}))
        else:
            reason = f"{answer.get('error')}: {answer.get('message')}"
            say(f"staging {req.src} failed: {reason}")
            results.append(_entry(plan, "failed", reason=reason, lease=lease))
    failed = [r for r in results if r["state"] == "failed"]
    state = "failed" if failed else "ok"
    reason = "; ".join(f"{r['src']}: {r['reason']}" for r in failed)
    write_status(cfg, job, user, {"state": state, "reason": reason, "datasets": results, "supervisor": None})


# ---- task prolog ---------------------------------------------------------------------------------
def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:500]


def task_prolog_lines(status: dict[str, Any] | None) -> list[str]:
    """The ``export`` lines for a job, from its status (pure)."""
    if status is None:
        return []
    lines = []
    state = status.get("state")
    if state == "failed" and not status.get("datasets"):
        return [f"export STAGINGLOADER_STATUS=failed: {_one_line(status.get('reason', ''))}"]
    for i, d in enumerate(status.get("datasets", [])):
        suffix = f"_{d['name'].upper()}" if d.get("name") else (f"_{i}" if i else "")
        names = [suffix, ""] if suffix and i == 0 else [suffix]  # the first dataset also without a suffix
        if d.get("state") == "ok":
            value = "ok"
        elif d.get("state") == "failed":
            value = f"failed: {_one_line(d.get('reason', ''))}"
        else:
            value = "staging"
        for s in names:
            if d.get("root"):
                lines.append(f"export STAGINGLOADER_DATASET{s}={d['root']}")
            lines.append(f"export STAGINGLOADER_STATUS{s}={value}")
        if i == 0 and not d.get("shared") and d.get("roots"):
            lines.append(f"export STAGINGLOADER_ROOT={d.get('staging_root') or d['roots'][0]}")
    return lines


def task_prolog(env: Mapping[str, str]) -> int:
    try:
        cfg = site_config.load(env)
        job = _job(env)
    except UsageError:
        return 0
    status = read_status(cfg, job)
    if status is None and is_request(env.get("SLURM_JOB_COMMENT", "")):
        status = {"state": "failed", "reason": "the prolog left no status (is the stagingloader Prolog configured, "
                                               "with PrologFlags=Alloc?)", "datasets": []}
    for line in task_prolog_lines(status):
        print(line)
    return 0


# ---- epilog --------------------------------------------------------------------------------------
def epilog(env: Mapping[str, str]) -> int:
    try:
        cfg = site_config.load(env)
        job = _job(env)
        user = JobUser.from_env(env)
    except UsageError:
        return 0
    status = read_status(cfg, job)
    if status is None:
        return 0
    say = JobLog(cfg, job, "epilog", user)
    try:
        _epilog(cfg, job, user, status, say)
    except Exception as e:
        say(f"unexpected {type(e).__name__}: {e}")
    finally:
        say.close()
    return 0


def _stop_supervisor(pid: int, say: JobLog) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
        say(f"stopped the stager (session {pid}) still running at the end of the job")
        for _ in range(100):
            os.killpg(pid, 0)
            time.sleep(0.05)
        os.killpg(pid, signal.SIGKILL)


def _epilog(cfg: site_config.SiteConfig, job: str, user: JobUser, status: dict[str, Any], say: JobLog) -> None:
    if status.get("state") == "staging" and isinstance(status.get("supervisor"), int):
        _stop_supervisor(status["supervisor"], say)
        status = read_status(cfg, job) or status
    lease = f"slurm-job-{job}"
    folders: set[tuple[str, bool]] = set()
    for d in status.get("datasets", []):
        for r in d.get("roots", []):
            folders.add((r, bool(d.get("shared"))))
        cleanup = d.get("state") != "ok"
        ddirs = [d["dataset_dir"]] if d.get("dataset_dir") else []
        if cleanup:  # a failed stage: find its leftovers by the lease it would have taken
            ddirs = [str(p) for r in d.get("roots", []) for p in _datasets_named(r, d, user)]
        for dd in ddirs:
            if d.get("shared"):
                release(DatasetDir(Path(dd)), lease)
                answer: dict[str, Any] = {"ok": True}
            else:
                answer = run_worker({"op": "release", "dataset_dir": dd, "lease": lease, "cleanup": cleanup}, user)
            say(f"released {lease} on {dd}: {answer}")
    if cfg.keep_bytes is not None:
        for folder, shared in sorted(folders):
            if shared:
                result = gc(folder, cfg.keep_bytes, {})
            else:
                result = run_worker({"op": "gc", "root": folder, "keep_bytes": cfg.keep_bytes}, user)
            say(f"evicted under {cfg.keep_bytes} bytes in {folder}: removed {result.get('removed')}, "
                f"kept in use {result.get('busy')}")
    with contextlib.suppress(OSError):
        status_path(cfg, job).unlink()


def _datasets_named(root: str, d: dict[str, Any], user: JobUser) -> list[Path]:
    """Dataset folders in ``root`` made for this request's source (read as root only in root-owned folders)."""
    from ..cache.layout import dataset_key
    from ..staging.sources import Source

    try:
        identity = Source(d["src"]).identity()
    except (StagingError, OSError, ValueError):
        return []
    if d.get("shard"):
        identity += f"?shard={d['shard'][0]}/{d['shard'][1]}"
    return [Path(root) / dataset_key(identity)]
