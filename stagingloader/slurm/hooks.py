"""The Slurm hooks: ``prolog`` and ``epilog`` (root, on every node of the job) and ``task-prolog``
(the job's user, before each task; what it prints as ``export NAME=value`` enters the job).

The rule that shapes them: a non-zero prolog exit, or a timeout, drains the node.  So a user's
problem (bad request, unreadable or unreachable source, no space, checksum mismatch) exits 0 with
the failure recorded for the job; only a broken node (a staging root's parent missing or
read-only) exits non-zero.  Anything a user can create on a root's path is the job's problem too:
a file, a link, a FIFO or a folder of theirs at ``/dev/shm/stagingloader``, or at ``/dev/shm/site``
above a root ``/dev/shm/site/{node}``.  Root acts only on its own record and the site config, never
on a file a user can write, and the files it keeps for a job are its own (see :mod:`.rootsafe` and
:mod:`.jobstate`).  The prolog stages in a detached supervisor process and waits for it at most
``budget_seconds``; past that it exits 0 and the supervisor finishes while the job starts (the
job's ``stagingloader.stage(SRC)`` waits on the dataset's lock).  Hooks never call scontrol.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..cache.capacity import check_root
from ..cache.layout import DatasetDir
from ..cache.leases import release
from ..errors import CacheError, RootError, UsageError
from . import config as site_config
from . import jobstate, quick, rootsafe, slurmconf, trail
from .identity import JobUser, run_worker
from .jobstate import JobLog, write_status
from .nodelist import expand, node_index
from .request import StageRequest, check_names, is_request, parse_comment, parse_spec

log = logging.getLogger(__name__)
SPEC_MAX_BYTES = 64 * 1024
BROKEN_CONFIG = "the site's stagingloader config is broken: ask your admin"
#: the job states in which the prolog keeps waiting for its stager (anything else: the job ended, e.g. scancel)
#: peers=yes: how long a node waits for the job's other nodes to meet, and for a silent one
PEERS_TIMEOUT = 120.0
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED")


# ---- requests ------------------------------------------------------------------------------------
def read_spec(path: str, user: JobUser) -> list[StageRequest]:
    """The spec file's requests, read *as the job's user* (root may not read an NFS home with
    root_squash; and a file the user cannot read must not be read for them)."""
    answer = run_worker({"op": "spec", "path": path, "max_bytes": SPEC_MAX_BYTES}, user, timeout=30)
    if not answer.get("ok"):
        raise UsageError(str(answer.get("message")))
    return parse_spec(str(answer["text"]), path)


def site_root(root: Path) -> Path:
    """A configured staging root, ready for the hooks: a real folder that only root can change.

    Raises RootError when its parent is missing or read-only (the node is broken), CacheError when the
    path, or a folder above it, is held by something root did not make: a file, a link, a FIFO or a folder
    a user created (in ``/dev/shm`` anyone can), which is the job's problem, never a reason to drain the
    node.  So what a user made is named before anything is asked of the file system it leads to.
    """
    try:
        rootsafe.check_trusted_dir(root.parent, sticky_ok=True)
    except rootsafe.MissingError as e:  # nobody holds the path: a mount or a boot-time folder is missing
        raise RootError(f"staging root {root}: {e}; create it at boot (see docs/slurm.md) or fix the mount") from None
    check_root(root.parent)
    if os.geteuid() == 0:
        rootsafe.ensure_dir(root, 0o755, 0, 0)
    else:
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o755)
    rootsafe.check_trusted_dir(root)
    check_root(root)
    return root


def node_check(cfg: site_config.SiteConfig, kinds: set[str]) -> None:
    """Raise RootError if a staging root of these kinds is unusable (the node is broken), CacheError if a
    user squats its path."""
    for kind in sorted(kinds):
        if kind != "auto" and kind not in cfg.roots:
            continue  # the job asked for a tier this site lacks: its problem, reported later
        for root in cfg.candidates(kind):
            site_root(root)


# ---- folders -------------------------------------------------------------------------------------
def shared_folders(cfg: site_config.SiteConfig) -> set[Path]:
    """Where shared datasets may be: ``ROOT/shared`` of the site's roots, from the site config only."""
    return {cfg.path(r) / "shared" for r in cfg.roots.values()}


def private_folders(cfg: site_config.SiteConfig, user: JobUser) -> set[Path]:
    return {cfg.path(r) / "users" / user.name for r in cfg.roots.values()}


def prepare_roots(cfg: site_config.SiteConfig, req: StageRequest, user: JobUser, shared: bool) -> list[Path]:
    """The folders the worker may stage into: ``ROOT/shared`` or ``ROOT/users/<user>``.

    Raises RootError when a staging root's parent is missing or read-only: the node is broken.
    """
    out = []
    for root in cfg.candidates(req.root):
        site_root(root)
        me, group = os.geteuid(), os.getegid()
        if shared:
            rootsafe.ensure_dir(root / "shared", 0o755, me, group)
            out.append(root / "shared")
        else:
            rootsafe.ensure_dir(root / "users", 0o755, me, group)
            rootsafe.ensure_dir(root / "users" / user.name, 0o700, user.uid, user.gid)
            out.append(root / "users" / user.name)
    return out


# ---- prolog --------------------------------------------------------------------------------------
def _job(env: Mapping[str, str]) -> str:
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise UsageError("SLURM_JOB_ID is missing: run this from Slurm's Prolog/Epilog/TaskProlog")
    return job


def _node(env: Mapping[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def broken_config(env: Mapping[str, str], hook: str, job: str, user: JobUser, error: Exception,
                  slurmd_log: str | None) -> None:
    """The site config cannot be used: said to the admin (root's node log, slurmd's log at level error) and, from the
    prolog, to the job (``failed: the site's stagingloader config is broken: ask your admin``)."""
    cfg = site_config.fallback(env)
    jobstate.node_log(cfg, f"stagingloader {hook}: job {job}: {error}; no staging on this node until it is fixed "
                           "(docs/slurm.md, the site config)", slurmd_log=slurmd_log)
    if hook == "prolog":
        with contextlib.suppress(Exception):
            write_status(cfg, job, user, {"state": "failed", "reason": BROKEN_CONFIG, "datasets": []})


def prolog(env: Mapping[str, str]) -> int:
    comment = env.get("SLURM_JOB_COMMENT", "")
    if not is_request(comment):
        return 0
    settings = slurmconf.read(env)
    slurmd_log = slurmconf.slurmd_log(settings, _node(env))
    try:
        job, user = _job(env), JobUser.from_env(env)
    except UsageError as e:
        jobstate.node_log(site_config.fallback(env), f"stagingloader prolog: {e}", slurmd_log=slurmd_log)
        return 0
    try:
        cfg = site_config.load(env)
    except UsageError as e:
        broken_config(env, "prolog", job, user, e, slurmd_log)
        return 0
    wait = slurmconf.hand_over_after(cfg.budget_seconds, slurmconf.prolog_epilog_timeout(settings))
    say = JobLog(cfg, job, "prolog", user, slurmd_log=slurmd_log)
    try:
        try:
            jobstate.state_dir(cfg)
        except OSError as e:  # CacheError included: a state folder a user could change is not used
            say.problem(f"the job runs without staged data: cannot keep its status in {cfg.state_dir}: {e}")
            return 0
        return _prolog(env, cfg, job, user, comment, say, wait)
    except Exception as e:  # never drain a node for something we did not foresee
        say.problem(f"unexpected {type(e).__name__}: {e}; the job runs without staged data")
        with contextlib.suppress(Exception):
            write_status(cfg, job, user, {"state": "failed", "reason": f"internal error: {e}", "datasets": []})
        return 0
    finally:
        say.close()


def _prolog(env: Mapping[str, str], cfg: site_config.SiteConfig, job: str, user: JobUser, comment: str,
            say: JobLog, wait: float) -> int:
    say(f"job {job} of {user.name} (uid {user.uid}) asks: {comment!r}")
    try:
        requests, spec = parse_comment(comment)
        node_check(cfg, {r.root for r in requests} | (set(cfg.roots) if spec else set()))
    except CacheError as e:  # a path a user can squat (/dev/shm/...) is the job's problem, not the node's
        say.problem(f"staging refused: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"unsafe staging root: {e}", "datasets": []})
        return 0
    except RootError as e:
        say.problem(f"this node is broken: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"node problem: {e}", "datasets": []})
        return 1
    except UsageError as e:
        say.problem(f"bad request: {e}")
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
        except KeyboardInterrupt:  # SIGTERM from the epilog at the job's end: its record stays "staging", as it was
            code = 1
            with contextlib.suppress(BaseException):
                say("the stager was stopped (the job ended)")
        except BaseException as e:
            code = 1
            with contextlib.suppress(BaseException):
                say.problem(f"unexpected {type(e).__name__}: {e}")
                write_status(cfg, job, user, {"state": "failed", "reason": f"internal error: {e}", "datasets": []})
        finally:
            os._exit(code)
    return _wait_for(pid, env, cfg, job, say, wait)


def _wait_for(pid: int, env: Mapping[str, str], cfg: site_config.SiteConfig, job: str, say: JobLog,
              wait: float) -> int:
    """Wait for the supervisor ``pid`` at most ``wait`` seconds, and no longer than the job lives (``scancel``
    during the prolog: Slurm waits for the prolog before it runs the epilog, which stops the supervisor)."""
    t0 = time.monotonic()
    next_look = t0 + 1.0
    while time.monotonic() - t0 < wait:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            final = jobstate.read_record(cfg, job) or {}
            say(f"prolog done: {final.get('state')}")
            return 0
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + 1.0
            state = job_state(job, env)
            if state is not None and not state.startswith(LIVE_STATES):
                say(f"the job is {state}: the prolog stops waiting; the epilog stops the stager (what it copied stays)")
                return 0
        time.sleep(0.05)
    why = "" if wait >= cfg.budget_seconds else " (half of Slurm's PrologEpilogTimeout)"
    say(f"staging goes on past the prolog's budget of {wait:.0f}s{why} in pid {pid}; "
        "the job's stagingloader.stage() waits for it")
    return 0


def job_state(job: str, env: Mapping[str, str]) -> str | None:
    """The job's state as slurmctld sees it (``scontrol show job``), or None when it does not answer."""
    import subprocess

    path = {"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"}
    if env.get("SLURM_CONF"):
        path["SLURM_CONF"] = env["SLURM_CONF"]
    try:
        proc = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=3,
                              env=path, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return "GONE" if "Invalid job id" in proc.stderr else None
    m = re.search(r"\bJobState=(\S+)", proc.stdout)
    return m.group(1) if m else None


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
    except CacheError as e:  # e.g. ROOT/users/<user> is a link: refused, named, the job's problem
        say.problem(f"staging refused: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"unsafe staging folder: {e}", "datasets": []})
        return
    except (UsageError, OSError) as e:  # RootError included: checked by the prolog, so a race or a tier
        say.problem(f"bad request: {e}")
        write_status(cfg, job, user, {"state": "failed", "reason": f"bad request: {e}", "datasets": []})
        return
    # the supervisor records itself (not the prolog: it could overwrite a final status)
    write_status(cfg, job, user, {"state": "staging", "datasets": [_entry(p, "staging") for p in plans],
                                  "supervisor": rootsafe.me()})
    lease = f"slurm-job-{job}"
    results = []
    for plan in plans:
        req: StageRequest = plan["request"]
        t0 = time.monotonic()
        op = {"op": "stage", "src": req.src, "roots": plan["roots"], "lease": lease, "shard": plan["shard"],
              "shared": plan["shared"], "max_ram_fraction": cfg.max_ram_fraction, "lock_timeout": None,
              "wait": req.wait}
        if req.peers:
            op["peers"] = _peers(env, cfg, job, user, plan["shared"], say)
        if plan["shared"]:  # a local source must be readable by all (checked by root's stager); a URL, by her
            remote = "://" in req.src and not req.src.startswith("file://")
            answer: dict[str, Any] = run_worker({"op": "access", "src": req.src}, user) if remote else {"ok": True}
            if answer.get("ok"):
                answer = run_worker(op, None)
        else:
            answer = run_worker(op, user)
        seconds = time.monotonic() - t0
        if answer.get("ok"):
            verb = "streaming" if answer.get("streaming") else "staged"
            fig = answer["peers"] if isinstance(answer.get("peers"), dict) else None
            how = (f" (with peers: node {fig['node']} of {fig['nodes']}, {fig['from_source_files']} files read from "
                   f"the source, {fig['from_peers_files']} from peers)") if fig else ""
            say(f"{verb} {req.src}: {answer['files']} files, {answer['bytes']} bytes in {seconds:.1f}s "
                f"-> {answer['root']}{how}")
            results.append(_entry(plan, "ok", streaming=bool(answer.get("streaming")),
                                  **{k: answer[k] for k in ("root", "dataset_dir", "version", "staging_root",
                                                            "lease")}, **_figures(cfg, answer, seconds)))
        else:
            reason = f"{answer.get('error')}: {answer.get('message')}"
            say.problem(f"staging {req.src} failed: {reason}")
            results.append(_entry(plan, "failed", reason=reason, lease=lease, seconds=round(seconds, 3)))
    failed = [r for r in results if r["state"] == "failed"]
    state = "failed" if failed else "ok"
    reason = "; ".join(f"{r['src']}: {r['reason']}" for r in failed)
    write_status(cfg, job, user, {"state": state, "reason": reason, "datasets": results, "supervisor": None})


def _figures(cfg: site_config.SiteConfig, answer: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What the trail keeps of a stage: its tier (the site's name for the root it went to), time, files, bytes."""
    staged_in = Path(str(answer.get("staging_root")))
    tier = next((k for k, r in cfg.roots.items() if staged_in.parent in (cfg.path(r), cfg.path(r) / "users")), None)
    total, copied = int(answer.get("bytes") or 0), answer.get("copied_bytes")
    out: dict[str, Any] = {"tier": tier, "seconds": round(seconds, 3), "files": answer.get("files"), "bytes": total}
    if isinstance(copied, int) and not answer.get("streaming"):
        out.update(copied_bytes=copied, reused_bytes=max(0, total - copied))
    return out


def _peers(env: Mapping[str, str], cfg: site_config.SiteConfig, job: str, user: JobUser, shared: bool,
           say: JobLog) -> dict[str, Any] | None:
    """``peers=yes``: where this node meets the job's others (the first node of the job's node list, at the port
    the job id gives) and the job's key, made from the site's secret for this job and this user (or for the
    shared copy, which the user never sees: she cannot feed root's stager).  None: this node stages alone."""
    from ..peers.wire import read_key_file
    from ..peers.world import job_port

    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    try:
        node, nodes = node_index(nodelist, cfg.node or socket.gethostname())
    except (UsageError, ValueError) as e:
        say.problem(f"peers=yes: this node is not in the job's node list {nodelist!r} ({e}): it stages alone")
        return None
    if nodes <= 1:
        return None
    try:
        secret = read_key_file(cfg.path(cfg.peer_key), owner=0)
    except UsageError as e:
        say.problem(f"peers=yes: {e}; ask your admin (peer_key in the site config): each node stages alone")
        return None
    label = "shared" if shared else f"private:{user.uid}"
    key = hmac.new(secret, f"stagingloader-slurm-peers\0{label}\0{job}".encode(), hashlib.sha256).hexdigest()
    first = expand(nodelist)[0]
    return {"addr": slurmconf.node_addr(env, first), "port": job_port(job), "node": node, "nodes": nodes,
            "job": job, "key": key, "timeout": PEERS_TIMEOUT}


# ---- task prolog ---------------------------------------------------------------------------------
# slurmstepd reads the task prolog's output a line at a time (lines end at "\n" only, a NUL ends it all) and
# takes everything after "export NAME=" to the end of the line as the value, verbatim: it removes no quotes.
# So a value is made one line (control characters become spaces) and never quoted; the names are fixed.
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


def _value(text: object) -> str:
    """A value on one line, as slurmstepd will set it."""
    return _CONTROL.sub(" ", str(text))


def _one_line(text: object) -> str:
    return " ".join(_value(text).split())[:500]


def task_prolog_lines(status: dict[str, Any] | None) -> list[str]:
    """The ``export`` lines for a job, from its status (pure): ``STAGINGLOADER_*`` names only, one line each."""
    if status is None:
        return []
    lines = []
    state = status.get("state")
    if state == "failed" and not status.get("datasets"):
        return [f"export STAGINGLOADER_STATUS=failed: {_one_line(status.get('reason', ''))}"]
    for i, d in enumerate(status.get("datasets", [])):
        name = d.get("name")
        named = isinstance(name, str) and _NAME.match(name)
        suffix = f"_{str(name).upper()}" if named else (f"_{i}" if i else "")
        names = [suffix, ""] if suffix and i == 0 else [suffix]  # the first dataset also without a suffix
        if d.get("state") == "ok":
            value = "streaming" if d.get("streaming") else "ok"
        elif d.get("state") == "failed":
            value = f"failed: {_one_line(d.get('reason', ''))}"
        else:
            value = "staging"
        for s in names:
            if d.get("root"):
                lines.append(f"export STAGINGLOADER_DATASET{s}={_value(d['root'])}")
            lines.append(f"export STAGINGLOADER_STATUS{s}={value}")
        if i == 0 and not d.get("shared") and d.get("roots"):
            lines.append(f"export STAGINGLOADER_ROOT={_value(d.get('staging_root') or d['roots'][0])}")
    return lines


def task_prolog(env: Mapping[str, str]) -> int:
    """Print the job's ``export`` lines from what root wrote for this job and user only (``jobstate.read_view``)."""
    try:
        job = _job(env)
        user = JobUser.from_env(env)
    except UsageError:
        return 0
    asked = is_request(env.get("SLURM_JOB_COMMENT", ""))
    try:
        cfg = site_config.load(env)
    except UsageError:  # the prolog told the admin; the job is told here
        status = jobstate.read_view(site_config.fallback(env), job, user)
        if status is None and asked:
            status = {"state": "failed", "reason": BROKEN_CONFIG, "datasets": []}
    else:
        status = jobstate.read_view(cfg, job, user)
        if status is None and asked:
            status = {"state": "failed", "reason": "the prolog left no status (is the stagingloader Prolog "
                                                   "configured, with PrologFlags=Alloc?)", "datasets": []}
    for line in task_prolog_lines(status):
        print(line)
    return 0


# ---- epilog --------------------------------------------------------------------------------------
def epilog(env: Mapping[str, str]) -> int:
    """Root's housekeeping after a job, driven by root's own record, the site config and the job's lease: every
    dataset on this node that holds ``slurm-job-<id>`` is released, however it was taken.  Bounded: each step gets
    what is left of half of Slurm's ``PrologEpilogTimeout``; what does not fit is left to the next epilog or gc."""
    settings = slurmconf.read(env)
    slurmd_log = slurmconf.slurmd_log(settings, _node(env))
    try:
        job = _job(env)
        user = JobUser.from_env(env)
    except UsageError:
        return 0
    try:
        cfg = site_config.load(env)
    except UsageError as e:
        broken_config(env, "epilog", job, user, e, slurmd_log)
        return 0
    deadline = time.monotonic() + slurmconf.epilog_time(slurmconf.prolog_epilog_timeout(settings))
    record = jobstate.read_record(cfg, job)  # never the job's view: it is for the task prolog, in her folder
    if record is not None and record.get("uid") != user.uid:  # an older job's with this id, another user's
        log.warning("stagingloader epilog: job %s: dropped a record of uid %s's job", job, record.get("uid"))
        jobstate.remove(cfg, job, None)
        record = None
    if record is None and not _job_lease_roots(cfg, user, job):
        return 0
    say = JobLog(cfg, job, "epilog", user, slurmd_log=slurmd_log)
    try:
        folders: set[tuple[Path, bool]] = set()
        if record is not None:
            folders = _epilog(cfg, job, user, record, say, deadline)
        folders |= _release_job_leases(cfg, job, user, say, deadline)
        _evict(cfg, user, folders, say, deadline)
        if record is not None:
            trail.record_job(cfg, job, user, jobstate.read_record(cfg, job) or record, say, deadline)
        trail.retain(cfg, say, deadline)
        from .node import epilog_budget  # the node budget, across users: only where a tier may be over it

        epilog_budget(cfg, env, say, deadline)
    except Exception as e:
        say.problem(f"unexpected {type(e).__name__}: {e}")
    finally:
        if record is not None:
            jobstate.remove(cfg, job, user)
        say.close()
    return 0


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _job_lease_roots(cfg: site_config.SiteConfig, user: JobUser, job: str) -> list[str]:
    """The user's folders on this node holding a dataset with the job's lease (:func:`.quick.job_lease_roots`)."""
    private = [str(p) for p in sorted(private_folders(cfg, user))]
    return quick.job_lease_roots(quick.candidate_roots(private, user.name, user.uid, user.home), job)


def _trusted_entry(cfg: site_config.SiteConfig, user: JobUser, d: Any, say: JobLog) -> dict[str, Any] | None:
    """A dataset of root's record, its folders checked against the site config (never taken on trust)."""
    if not isinstance(d, dict) or not isinstance(d.get("src"), str):
        return None
    shared = d.get("shared") is True and cfg.is_shared(d["src"])
    allowed = shared_folders(cfg) if shared else private_folders(cfg, user)
    roots = [Path(r) for r in d.get("roots", []) if isinstance(r, str) and Path(r) in allowed]
    dd = d.get("dataset_dir")
    if isinstance(dd, str) and Path(dd).parent not in roots:
        say(f"ignored {dd}: not in a staging folder of this job")
        dd = None
    return {"src": d["src"], "shared": shared, "roots": roots, "dataset_dir": dd, "failed": d.get("state") == "failed",
            "shard": d.get("shard"), "version": d.get("version") if isinstance(d.get("version"), str) else None}


def _epilog(cfg: site_config.SiteConfig, job: str, user: JobUser, record: dict[str, Any], say: JobLog,
            deadline: float) -> set[tuple[Path, bool]]:
    """Stop the prolog's stager if it still runs and drop the leases its record names; the folders it used."""
    if record.get("state") == "staging":
        rootsafe.stop_group(record.get("supervisor"), say, grace=min(5.0, _left(deadline) / 3))
        record = jobstate.read_record(cfg, job) or record
    lease = f"slurm-job-{job}"
    folders: set[tuple[Path, bool]] = set()
    for raw in record.get("datasets", []):
        d = _trusted_entry(cfg, user, raw, say)
        if d is None:
            continue
        folders.update((r, d["shared"]) for r in d["roots"])
        if d["shared"]:  # root's own folders: checked, then released as root (never cleaned: other jobs use it)
            ddirs = [Path(d["dataset_dir"])] if d["dataset_dir"] else _datasets_named(d)
            for dd in ddirs:
                if not os.path.lexists(dd):
                    continue
                try:
                    rootsafe.check_trusted_dir(dd)
                except (OSError, CacheError) as e:
                    say.problem(f"did not release {lease} on {dd}: {e}")
                    continue
                release(DatasetDir(dd), lease)
                say(f"released {lease} on {dd}")
        else:  # the user's folder: everything in it is done as the user
            # a failed stage's leftovers go; a stage cut short by the job's end keeps its partial copy (resumed next)
            op = {"op": "release", "lease": lease, "cleanup": d["failed"], "dataset_dir": d["dataset_dir"],
                  "src": d["src"], "shard": d["shard"], "roots": [str(r) for r in d["roots"]], "job": job,
                  "version": d["version"]}
            answer = run_worker(op, user, timeout=max(1.0, _left(deadline)))
            say(f"released {lease} in {', '.join(op['roots'])}: {answer}")
    return folders


def _release_job_leases(cfg: site_config.SiteConfig, job: str, user: JobUser, say: JobLog,
                        deadline: float) -> set[tuple[Path, bool]]:
    """Drop the job's lease wherever a job step took it (``stagingloader stage`` in the job), as the user."""
    roots = _job_lease_roots(cfg, user, job)
    if not roots:
        return set()
    answer = run_worker({"op": "release-job", "roots": roots, "lease": f"slurm-job-{job}", "job": job}, user,
                        timeout=max(1.0, _left(deadline)))
    say(f"released slurm-job-{job} taken in the job's steps in {', '.join(roots)}: {answer}")
    private = private_folders(cfg, user)
    return {(Path(r), False) for r in roots if Path(r) in private}


def _evict(cfg: site_config.SiteConfig, user: JobUser, folders: set[tuple[Path, bool]], say: JobLog,
           deadline: float) -> None:
    """With ``keep_bytes``: evict in the job's folders, each in a worker bounded by the time left (a gc cut short
    leaves its work to the next one)."""
    if cfg.keep_bytes is None:
        return
    for folder, shared in sorted(folders):
        if _left(deadline) < 1:
            say(f"no time left to evict in {folder}: left to the next epilog or `stagingloader gc`")
            continue
        if shared:
            try:
                rootsafe.check_trusted_dir(folder)
            except (OSError, CacheError) as e:
                say.problem(f"did not evict in {folder}: {e}")
                continue
        result = run_worker({"op": "gc", "root": str(folder), "keep_bytes": cfg.keep_bytes},
                            None if shared else user, timeout=_left(deadline))
        say(f"evicted under {cfg.keep_bytes} bytes in {folder}: removed {result.get('removed')}, "
            f"kept in use {result.get('busy')}" if result.get("ok") else f"eviction in {folder}: {result}")


def _datasets_named(d: dict[str, Any]) -> list[Path]:
    """The dataset folders a shared request's source maps to in its roots (the site config names that source)."""
    from .worker import datasets_for

    return [Path(p) for p in datasets_for(d["src"], d.get("shard"), [str(r) for r in d["roots"]])]
