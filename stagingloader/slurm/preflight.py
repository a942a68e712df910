"""What the hooks would do, found out before they do it: ``slurm check-config`` and ``slurm prolog --dry-run``.

- :func:`check_config` (an admin, as root, on a node): the site config as the hooks read it, unknown keys named one
  by one, ``{node}`` expanded; the folder-trust checks of :mod:`.rootsafe` on every root, state and log folder and
  the trail; a folder under a world-writable one (``/dev/shm``, ``/tmp``) that no tmpfiles line creates at boot;
  ``budget_seconds`` against Slurm's ``PrologEpilogTimeout``; ``shared`` sources every user may read.  A list of
  :class:`Finding`: an ``error`` is what makes the hooks refuse or fail; a ``warning``, what works but should change.
- :func:`dry_run` (the prolog's view of one job, from its environment): which sources, roots, private or shared,
  shard, peers, wait and time budget; and whether it would fail, and why.

Both only look (``lstat``, ``stat``, reading the config and Slurm's): no folder, state file or log is written.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import socket
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CacheError, UsageError
from . import config as site_config
from . import rootsafe, slurmconf, trail
from .access import not_world_readable
from .identity import JobUser
from .nodelist import expand, node_index
from .request import check_names, is_request, parse_comment

TMPFILES_DIRS = ("/etc/tmpfiles.d", "/run/tmpfiles.d", "/usr/lib/tmpfiles.d")
BOOT_FIX = "docs/slurm.md, Create the hooks' folders at boot"


@dataclass(frozen=True, kw_only=True)
class Finding:
    level: str  #: "error", "warning" or "ok"
    what: str  #: the config key it is about (``roots.tmpfs``, ``budget_seconds``...)
    path: str
    message: str
    fix: str = ""

    def text(self) -> str:
        return f"{self.level:<7} {self.what}: {self.message}" + (f"\n        fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True, kw_only=True)
class Report:
    config: str
    node: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(f.level == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.level == "warning" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.errors == 0, "config": self.config, "node": self.node, "errors": self.errors,
                "warnings": self.warnings, "findings": [asdict(f) for f in self.findings]}


# ---- check-config ------------------------------------------------------------------------------------------------
def check_config(env: Mapping[str, str], *, node: str, tmpfiles_dirs: Iterable[str] = TMPFILES_DIRS,
                 slurm: tuple[str, dict[str, str]] | None = None) -> Report:
    """Every finding on the site config named by ``env`` (``$STAGINGLOADER_CONFIG``), for the node ``node``.

    ``slurm``: Slurm's settings and where they came from (default: :func:`.slurmconf.live`, asking slurmctld)."""
    path = site_config.where(env)
    report = Report(config=path, node=node)
    out = report.findings
    cfg = _read_config(path, {**env, "SLURMD_NODENAME": node}, out)
    if cfg is None:
        return report
    boot = tmpfiles_lines(tmpfiles_dirs)
    for kind, root in sorted(cfg.roots.items()):
        out += _folder(f"roots.{kind}", cfg.path(root), boot, is_root=True)
        for sub in ("shared", "users"):
            if os.path.lexists(cfg.path(root) / sub):
                out += _folder(f"roots.{kind}", cfg.path(root) / sub, {}, is_root=False)
    out += _folder("state_dir", cfg.path(cfg.state_dir), boot, is_root=False)
    out += _folder("log_dir", cfg.path(cfg.log_dir), boot, is_root=False)
    out += _trail(cfg, boot)
    out.append(_budget(cfg, *(slurm if slurm is not None else slurmconf.live(env))))
    out += [_shared(src) for src in cfg.shared]
    return report


def _read_config(path: str, env: Mapping[str, str], out: list[Finding]) -> site_config.SiteConfig | None:
    if not os.path.lexists(path):
        out.append(Finding(level="warning", what="config", path=path,
                           message=f"there is no site config at {path}: the hooks use the defaults (tmpfs root "
                                   "/dev/shm/stagingloader, no NVMe root, no eviction)",
                           fix="write one, root-owned, mode 0644 (docs/slurm.md, Site config)"))
    else:
        try:
            rootsafe.check_trusted_file(Path(path))
        except (CacheError, OSError) as e:
            out.append(Finding(level="error", what="config", path=path,
                               message=f"the hooks will not read it: {e}",
                               fix=f"chown root:root {path} && chmod 0644 {path}, in folders only root can change"))
    try:
        data = site_config.read(path)
    except UsageError as e:
        out.append(Finding(level="error", what="config", path=path, message=str(e),
                           fix="correct the TOML syntax at the place the message names"))
        return None
    for key in sorted(set(data) - set(site_config.KEYS)):
        close = difflib.get_close_matches(key, site_config.KEYS, n=1)
        out.append(Finding(level="error", what=key, path=path,
                           message=f"unknown key {key!r} in {path}: the hooks refuse the whole file, and no job on "
                                   "this node gets staged data",
                           fix=f"rename it to {close[0]!r}" if close else
                               f"remove it; the keys are {', '.join(site_config.KEYS)}"))
    try:
        cfg = site_config.parse({k: v for k, v in data.items() if k in site_config.KEYS}, path, env)
    except UsageError as e:
        out.append(Finding(level="error", what="config", path=path, message=str(e),
                           fix="give the value the message asks for (docs/slurm.md, Site config)"))
        return None
    if not any(f.level == "error" for f in out):
        out.append(Finding(level="ok", what="config", path=path, message=f"{path} parses; node {cfg.node}"))
    return cfg


def _folder(what: str, path: Path, boot: Mapping[str, str], *, is_root: bool) -> list[Finding]:
    """The folder-trust rule on ``path`` (as the hooks apply it) and, under a world-writable folder, the boot line."""
    p = str(path)
    fix = f"remove what is there (rm -rf {p}) and create it at boot, root-owned, mode 0755 ({BOOT_FIX})"
    try:
        if os.path.lexists(path):
            rootsafe.check_trusted_dir(path)
            found = Finding(level="ok", what=what, path=p, message=f"{p}: {rootsafe.describe(path)}")
        else:
            above = path.parent
            while not os.path.lexists(above) and above != above.parent:
                above = above.parent
            if is_root and above != path.parent:
                return [Finding(level="error", what=what, path=p,
                                message=f"{path.parent}, the folder above the staging root {p}, does not exist: "
                                        "the prolog of every staging job exits 1 here, and Slurm drains the node",
                                fix=f"mount the file system, or create {path.parent} at boot ({BOOT_FIX})")]
            rootsafe.check_trusted_dir(above, sticky_ok=True)
            found = Finding(level="ok", what=what, path=p,
                            message=f"{p} does not exist yet: the hooks create it in {above}")
    except CacheError as e:
        return [Finding(level="error", what=what, path=p, message=f"the hooks refuse it: {e}", fix=fix)]
    return [found, *_boot_line(what, path, boot)]


def _boot_line(what: str, path: Path, boot: Mapping[str, str]) -> list[Finding]:
    """A warning when ``path`` lies under a world-writable folder and no tmpfiles line creates, at boot, the folder
    just below it on the way (which any user could otherwise create first)."""
    shared_dir = None
    cur = Path("/")
    for part in path.parts[1:]:
        try:
            st = os.stat(cur)
        except OSError:
            break
        if st.st_mode & stat.S_IWOTH:
            shared_dir = cur
        cur = cur / part
    if shared_dir is None:
        return []
    first = shared_dir / path.relative_to(shared_dir).parts[0]
    line = boot.get(str(first))
    wanted = f"d {first} 0755 root root -"
    if line is None:
        return [Finding(level="warning", what=what, path=str(path),
                        message=f"{first} lies in the world-writable {shared_dir} and no tmpfiles line creates it at "
                                "boot: any user can create it first, and staging then fails on this node until an "
                                "admin removes it",
                        fix=f"add `{wanted}` to /etc/tmpfiles.d/stagingloader.conf, then systemd-tmpfiles --create")]
    if not _safe_line(line):
        return [Finding(level="warning", what=what, path=str(path),
                        message=f"the tmpfiles line `{line}` creates {first} for someone other than root, or "
                                "writable by others: the hooks will refuse it",
                        fix=f"make it `{wanted}`")]
    return []


def tmpfiles_lines(dirs: Iterable[str]) -> dict[str, str]:
    """The folders systemd-tmpfiles creates at boot (``d``, ``D``, ``v``, ``q``, ``Q`` lines), by path: the line."""
    lines: dict[str, str] = {}
    for d in dirs:
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".conf"))
        except OSError:
            continue
        for name in names:
            try:
                text = Path(d, name).read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            for raw in text.splitlines():
                words = raw.split()
                if len(words) >= 2 and re.fullmatch(r"[dDvqQ][-!+=~^]*", words[0]) and "%" not in words[1]:
                    lines.setdefault(os.path.normpath(words[1]), raw.strip())
    return lines


def _safe_line(line: str) -> bool:
    words = line.split() + ["-"] * 4
    mode, user = words[2], words[3]
    try:
        writable = mode not in ("-", "") and bool(int(mode.lstrip("~:"), 8) & 0o022)
    except ValueError:
        writable = True
    return not writable and user in ("-", "root", "0")


def _trail(cfg: site_config.SiteConfig, boot: Mapping[str, str]) -> list[Finding]:
    path = cfg.trail_path()
    if path is None:
        return [Finding(level="ok", what="trail", path="", message="no trail (trail = false)")]
    out = _folder("trail", path.parent, boot, is_root=False) if path.parent != cfg.path(cfg.log_dir) else []
    problem = trail.check(path)
    if problem:
        out.append(Finding(level="error", what="trail", path=str(path),
                           message=f"the trail {path} {problem}: the epilog refuses to append to it",
                           fix=f"move it aside (mv {path} {path}.suspect); the epilog creates a new one, root's, 0640"))
    else:
        out.append(Finding(level="ok", what="trail", path=str(path), message=f"the epilog appends to {path}"))
    return out


def _budget(cfg: site_config.SiteConfig, source: str, settings: Mapping[str, str]) -> Finding:
    timeout = slurmconf.prolog_epilog_timeout(settings)
    b = cfg.budget_seconds
    if not settings:
        return Finding(level="warning", what="budget_seconds", path="",
                       message="Slurm's config could not be read (no slurm.conf here, and scontrol show config does "
                               "not answer): budget_seconds is not checked against PrologEpilogTimeout",
                       fix="run check-config on a compute node, or set SLURM_CONF")
    if timeout is None:
        return Finding(level="ok", what="budget_seconds", path=source,
                       message=f"PrologEpilogTimeout sets no limit ({source}): the prolog waits up to {b:g} s")
    hand = slurmconf.hand_over_after(b, timeout)
    if b <= hand:
        return Finding(level="ok", what="budget_seconds", path=source,
                       message=f"budget_seconds = {b:g} is well below PrologEpilogTimeout = {timeout:g} ({source})")
    return Finding(level="warning", what="budget_seconds", path=source,
                   message=f"budget_seconds = {b:g} is not well below PrologEpilogTimeout = {timeout:g} ({source}): "
                           f"the prolog hands over after {hand:g} s (half of Slurm's limit less a second) instead, "
                           f"and the epilog's clean-up gets {slurmconf.epilog_time(timeout):g} s",
                   fix=f"set budget_seconds = {max(0, math.floor(timeout / 2 - 1))} or less, or PrologEpilogTimeout "
                       f"= {math.ceil(2 * (b + 1))} or more in slurm.conf (then scontrol reconfigure)")


def _shared(src: str) -> Finding:
    if "://" in src:
        return Finding(level="warning", what="shared", path=src,
                       message=f"{src} is a URL: who may read it cannot be checked here, and its shared copy is "
                               "readable by every user of the node",
                       fix="share only data every user may read; stage the rest privately (leave it out of shared)")
    if not os.path.exists(src):
        return Finding(level="warning", what="shared", path=src,
                       message=f"{src} does not exist on this node (not mounted?): jobs asking for it fail",
                       fix="mount it, or correct the path in shared")
    why = not_world_readable(src)
    if why:
        return Finding(level="error", what="shared", path=src,
                       message=f"{src} is declared shared, but {why}: the prolog refuses to stage it for anyone, "
                               "as a shared copy would be readable by every user of the node",
                       fix=f"let every user read it (chmod -R o+rX {src}), or take it out of shared: each user then "
                           "stages a private copy")
    return Finding(level="ok", what="shared", path=src, message=f"{src}: every user may read it")


# ---- prolog --dry-run --------------------------------------------------------------------------------------------
def dry_run(env: Mapping[str, str]) -> dict[str, Any]:
    """What the prolog would do for the job of ``env``: ``{"would": "nothing"|"stage"|"fail"|"drain", "lines": [...],
    "datasets": [...]}``.  Raises :class:`UsageError` when ``env`` is not a job's."""
    comment = env.get("SLURM_JOB_COMMENT", "")
    if not is_request(comment):
        return {"would": "nothing", "lines": [f"the job's comment {comment!r} asks for no staging: the prolog does "
                                               "nothing (exit 0)"], "datasets": []}
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise UsageError("SLURM_JOB_ID is missing: give the job's environment (SLURM_JOB_ID, SLURM_JOB_UID, "
                         "SLURM_JOB_USER, SLURM_JOB_COMMENT, SLURMD_NODENAME), as docs/slurm.md shows")
    user = JobUser.from_env(env)
    node = node_name(env)
    head = f"job {job} of {user.name} (uid {user.uid}) on node {node}"
    try:
        cfg = site_config.load(env)
    except UsageError as e:
        return _fails(head, f"the site's stagingloader config is broken: ask your admin ({e})")
    settings = slurmconf.read(env)
    timeout = slurmconf.prolog_epilog_timeout(settings)
    wait = slurmconf.hand_over_after(cfg.budget_seconds, timeout)
    try:
        requests, spec = parse_comment(comment)
        if spec is not None:
            from .hooks import read_spec  # the spec file, read as the job's user (a child process; writes nothing)

            requests = requests + read_spec(spec, user)
        plans = [_plan(env, cfg, user, job, req) for req in check_names(requests)]
    except UsageError as e:
        return _fails(head, f"bad request: {e}")
    limit = f"PrologEpilogTimeout = {timeout:g}" if timeout is not None else "no PrologEpilogTimeout"
    lines = [f"{head}: the prolog would stage {len(plans)} dataset(s), waiting at most {wait:g} s (budget_seconds = "
             f"{cfg.budget_seconds:g}, {limit}), then hand over to its detached stager and exit 0"]
    would = "stage"
    for plan in plans:
        lines.append(plan.pop("text"))
        if plan["problem"]:
            would = "drain" if plan["problem"].startswith("node problem") else (
                would if would == "drain" else "fail")
    lines.append("dry run: nothing was written (no state file, no log, no folder)")
    return {"would": would, "job": job, "user": user.name, "node": node, "wait_seconds": wait, "lines": lines,
            "datasets": plans}


def _fails(head: str, reason: str) -> dict[str, Any]:
    return {"would": "fail", "lines": [f"{head}: the prolog would start the job without staged data, with "
                                       f"STAGINGLOADER_STATUS=failed: {reason}",
                                       "dry run: nothing was written (no state file, no log, no folder)"],
            "datasets": [], "reason": reason}


def _plan(env: Mapping[str, str], cfg: site_config.SiteConfig, user: JobUser, job: str, req: Any) -> dict[str, Any]:
    shared = cfg.is_shared(req.src)
    roots = cfg.candidates(req.root)
    folders = [str(r / "shared") if shared else str(r / "users" / user.name) for r in roots]
    problems = [p for p in (_root_problem(r) for r in roots) if p]
    if shared and "://" not in req.src:
        why = not_world_readable(req.src)
        if why:
            problems.append(f"SourceAccessError: {req.src} is declared shared in the site config, but {why}")
    shard = None
    if req.shard == "node":
        i, n = node_index(env.get("SLURM_NODELIST", cfg.node), cfg.node or socket.gethostname())
        shard = [i, n] if n > 1 else None
    peers: dict[str, Any] | None = None
    if req.peers:
        from ..peers.world import job_port  # a number from the job id (no torch)

        nodes = expand(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "") or node_name(env))
        peers = {"meet": nodes[0], "port": job_port(job), "nodes": len(nodes)}
    how = "shared (one copy for every user, as root)" if shared else f"private to {user.name}, read as {user.name}"
    text = (f"  {req.src}: {how}, into {' or '.join(folders)} (root={req.root}), wait={'yes' if req.wait else 'no'}"
            f", shard={f'node {shard[0]} of {shard[1]}' if shard else 'no'}"
            f", peers={_peers_text(peers)}")
    problem = "; ".join(problems)
    if problem:
        text += f"\n    would fail: {problem}"
    return {"src": req.src, "name": req.name, "shared": shared, "root": req.root, "folders": folders,
            "wait": req.wait, "shard": shard, "peers": peers, "problem": problem, "text": text}


def _peers_text(peers: dict[str, Any] | None) -> str:
    if peers is None:
        return "no"
    return f"yes, {peers['nodes']} nodes meeting at {peers['meet']} port {peers['port']}"


def node_name(env: Mapping[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _root_problem(root: Path) -> str:
    """What the prolog would find wrong with a staging root (as :func:`.hooks.site_root`, without creating it)."""
    try:
        rootsafe.check_trusted_dir(root.parent, sticky_ok=True)
        if os.path.lexists(root):
            rootsafe.check_trusted_dir(root)
    except rootsafe.MissingError as e:
        return f"node problem: staging root {root}: {e}: the prolog exits 1 and Slurm drains the node"
    except CacheError as e:
        return f"unsafe staging root: {e}"
    return ""
